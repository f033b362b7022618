#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (fuzz/corpus/<target>/): valid
and near-valid inputs from the README, topics/ and the tests, so the fuzzer
starts past the first parse. Rerun after changing the input formats of
src/lib.rs; the files are committed (the fuzzer adds its finds only to
/tmp)."""
import base64
import hashlib
import hmac
import json
import struct
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "corpus"
DEMO_KEY = "sk-fuzz-demo"
JWT_SECRET = b"fuzz-secret-0123456789abcdef-0123456789"
DEV, PW = "demo-device-1", "demo-pass-1"


def put(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


# --- JSON bodies ----------------------------------------------------------
MIN = {"model": "general-chat", "messages": [{"role": "user", "content": "Hello"}]}
FULL = {
    "model": "general-chat", "stream": True, "stream_options": {"include_usage": True},
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Weather?"}],
    "max_tokens": 64, "max_completion_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n"],
    "n": 1, "request_id": "r-1", "idempotency_key": "k-1", "session_id": "s-1", "priority": "P2",
    "context_policy": "truncate_oldest",
    "timeouts": {"queue_ms": 1000, "first_token_ms": 2000, "inference_ms": 3000, "idle_ms": 500, "total_ms": 9000},
    "routing": {"local_only": True, "data_class": "sensitive", "allow_smaller_model": True},
    "metadata": {"user_id": "u-1", "site": "plant-4"}, "user": "u-1",
}
BAD = ['{"model": "general-chat", "messages": [{"role": "user", "content": 5}]}',
       '{"model": "general-chat", "messages": [], "tools": [{}], "logprobs": true, "n": 3}',
       '{"model": "nope", "messages": [{"role": "robot", "content": "x"}], "priority": "P9"}',
       '{"model": "general-chat", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}']
for i, b in enumerate([json.dumps(MIN), json.dumps(FULL)] + BAD):
    put("request_body", f"body-{i}.json", b)

# Device payloads: first byte 0 = req, 1 = cancel, 2 = resume.
REQ = dict(FULL, request_id="r-7", on_disconnect="cancel", expires_at=int(time.time() * 1000) + 60000,
           coalesce_ms=100, max_chunk_bytes=512)
put("device_payload", "req-min", b"\x00" + json.dumps(dict(MIN, request_id="r-1")).encode())
put("device_payload", "req-full", b"\x00" + json.dumps(REQ).encode())
put("device_payload", "req-broken", b'\x00{"request_id": "r-2", "messages": [ oops')
put("device_payload", "cancel", b'\x01{"request_id": "r-1"}')
put("device_payload", "resume", b'\x02{"request_id": "r-1", "from_seq": 3}')


# NATS: header lines NUL payload (first byte even = chat, odd = cancel).
def jwt(claims):
    enc = lambda o: base64.urlsafe_b64encode(json.dumps(o).encode()).rstrip(b"=")
    head = enc({"alg": "HS256", "typ": "JWT"}) + b"." + enc(claims)
    sig = base64.urlsafe_b64encode(hmac.new(JWT_SECRET, head, hashlib.sha256).digest()).rstrip(b"=")
    return (head + b"." + sig).decode()


TOKEN = jwt({"sub": "user-1", "app": "demo", "tenant": "demo", "exp": 4102444800})
put("nats_message", "chat-key", f"Authorization: Bearer {DEMO_KEY}\n".encode() + b"\x00\x00" + json.dumps(FULL).encode())
put("nats_message", "chat-xapikey", f"X-Api-Key: {DEMO_KEY}\n".encode() + b"\x00\x00" + json.dumps(MIN).encode())
put("nats_message", "chat-jwt", f"authorization: {TOKEN}\n".encode() + b"\x00\x00" + json.dumps(MIN).encode())
put("nats_message", "cancel", f"Authorization: Bearer {DEMO_KEY}\n".encode() + b"\x00\x01" + b'{"request_id": "r-1"}')


# --- MQTT -----------------------------------------------------------------
def varint(n):
    out = b""
    while True:
        b, n = n % 128, n // 128
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def s(x):
    x = x.encode() if isinstance(x, str) else x
    return struct.pack(">H", len(x)) + x


def frame(kind, flags, body):
    return bytes([(kind << 4) | flags]) + varint(len(body)) + body


def props(p):
    return varint(len(p)) + p


def connect(v5, client, user=None, pw=None, will=None, keep=30, name="MQTT", level=None):
    flags = 0x02
    payload = s(client)
    wp = b""
    if will:
        flags |= 0x04 | 0x08  # will, QoS 1
        wp = (props(b"\x18" + struct.pack(">I", 5)) if v5 else b"") + s(will[0]) + s(will[1])
    if user:
        flags |= 0x80
    if pw:
        flags |= 0x40
    payload += wp + (s(user) if user else b"") + (s(pw) if pw else b"")
    level = level or (5 if v5 else 4)
    vh = s(name) + bytes([level, flags]) + struct.pack(">H", keep)
    if v5:
        vh += props(b"\x11" + struct.pack(">I", 300) + b"\x21" + struct.pack(">H", 10))
    return frame(1, 0, vh + payload)


def publish(v5, topic, payload, qos=1, pkid=1, rt=None, corr=None, expiry=None):
    vh = s(topic) + (struct.pack(">H", pkid) if qos else b"")
    if v5:
        p = b""
        if expiry is not None:
            p += b"\x02" + struct.pack(">I", expiry)
        if rt:
            p += b"\x08" + s(rt)
        if corr:
            p += b"\x09" + s(corr)
        p += b"\x26" + s("k") + s("v")
        vh += props(p)
    return frame(3, qos << 1, vh + payload)


def subscribe(v5, filters, pkid=2):
    vh = struct.pack(">H", pkid) + (props(b"") if v5 else b"")
    body = b"".join(s(f) + b"\x01" for f in filters)
    return frame(8, 2, vh + body)


def unsubscribe(v5, filters, pkid=3):
    vh = struct.pack(">H", pkid) + (props(b"") if v5 else b"")
    return frame(10, 2, vh + b"".join(s(f) for f in filters))


PING = frame(12, 0, b"")
REQ_JSON = json.dumps(dict(MIN, request_id="r-1")).encode()
for v5 in (False, True):
    tag = "v5" if v5 else "v4"
    disc = frame(14, 0, b"\x00\x00" if v5 else b"")
    session = (connect(v5, DEV, DEV, PW, will=("status", "gone"))
               + subscribe(v5, [f"ai/v1/{DEV}/res/#", "$share/g/ai/v1/shared/models", "#"])
               + publish(v5, f"ai/v1/{DEV}/req", REQ_JSON, rt=f"ai/v1/{DEV}/res/x", corr="c1", expiry=30)
               + publish(v5, f"ai/v1/{DEV}/cancel", b'{"request_id": "r-1"}', qos=0)
               + publish(v5, "$SYS/x", b"", qos=2, pkid=9)
               + unsubscribe(v5, ["#"]) + PING + disc)
    put("mqtt_packets", f"session-{tag}", b"\x00" + session)
    put("mqtt_packets", f"refused-{tag}", b"\x00" + connect(v5, DEV, DEV, "wrong") + PING)
    put("mqtt_packets", f"badid-{tag}", b"\x00" + connect(v5, "no/such id", "x", "y"))
    put("mqtt_packets", f"instance-{tag}", b"\x00" + connect(v5, DEV + ":sub", DEV, PW, keep=0) + connect(v5, DEV, DEV, PW))
put("mqtt_packets", "mqtt31", b"\x00" + connect(False, DEV, DEV, PW, name="MQIsdp", level=3))
put("mqtt_packets", "small-limit", b"\x03" + connect(False, DEV, DEV, PW) + PING)
