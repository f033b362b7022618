"""Devices over MQTT against the real llama.cpp engine, with clients the
project did not write: mosquitto_pub / mosquitto_sub / mosquitto_rr
(Debian's mosquitto-clients) and Python paho-mqtt (3.1.1 and 5).

Every message edgeway sends is validated against topics/schemas. The model
is a base model: the tests assert on the protocol, never on the text.
"""
import json
import queue
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import jsonschema
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from conftest import busy_slots

SCHEMAS = Path(__file__).resolve().parents[2] / "topics" / "schemas"
D1 = ("demo-device-1", "demo-pass-1")
D2 = ("demo-device-2", "demo-pass-2")
WAIT = 120


def schema(name):
    return json.loads((SCHEMAS / f"{name}.json").read_text())


def check_event(ev):
    jsonschema.validate(ev, schema(f"event-{ev['type']}"))
    return ev


def check_stream(events):
    assert [e["seq"] for e in events] == list(range(len(events))), events
    assert [e["type"] in ("done", "error") for e in events] == [False] * (len(events) - 1) + [True], events
    for e in events:
        check_event(e)
    return "".join(e["text"] for e in events if e["type"] == "delta")


def request(rid, max_tokens=16, **extra):
    body = {
        "model": "general-chat",
        "request_id": rid,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        "max_tokens": max_tokens,
    }
    body.update(extra)
    jsonschema.validate(body, schema("request"))
    return body


def rid():
    return "e2e-" + uuid.uuid4().hex[:12]


needs_mosquitto = pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="mosquitto-clients not installed")


def mosquitto_args(port, client_id, creds, version="311"):
    return ["-h", "127.0.0.1", "-p", str(port), "-i", client_id, "-u", creds[0], "-P", creds[1], "-V", version]


@needs_mosquitto
def test_mosquitto_pub_and_sub_request_and_stream(edgeway, llama):
    r = rid()
    topic = f"ai/v1/demo-device-1/res/{r}"
    # stdbuf: mosquitto_sub's stdout is a pipe here; line-buffer it so the
    # SUBACK debug line arrives before the request is sent.
    sub = subprocess.Popen(
        ["stdbuf", "-oL", "mosquitto_sub", *mosquitto_args(edgeway.mqtt_port, "demo-device-1:sub", D1), "-q", "1", "-t", topic, "-v", "-d"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Never hang on a silent mosquitto_sub: kill it after the deadline.
    watchdog = threading.Timer(WAIT, sub.kill)
    watchdog.start()
    try:
        lines = iter(sub.stdout.readline, "")
        for line in lines:
            if "received SUBACK" in line:
                break
        else:
            pytest.fail("mosquitto_sub ended before its SUBACK")
        subprocess.run(
            ["mosquitto_pub", *mosquitto_args(edgeway.mqtt_port, "demo-device-1:pub", D1), "-q", "1",
             "-t", "ai/v1/demo-device-1/req", "-m", json.dumps(request(r))],
            check=True, timeout=30)
        events = []
        for line in lines:
            if line.startswith(topic + " "):
                ev = json.loads(line[len(topic) + 1:])
                events.append(ev)
                if ev["type"] in ("done", "error"):
                    break
    finally:
        watchdog.cancel()
        sub.terminate()
        sub.wait(10)
    text = check_stream(events)
    done = events[-1]
    assert done["type"] == "done", done
    assert done["result"]["usage"]["output_tokens"] > 0
    assert done["result"]["status"] == "SUCCEEDED"
    assert text
    state, _, _ = edgeway.wait_task_state(events[0]["task_id"], "SUCCEEDED")
    assert state == "SUCCEEDED"


@needs_mosquitto
def test_mosquitto_rr_uses_the_mqtt5_response_topic(edgeway):
    r = rid()
    out = subprocess.run(
        ["mosquitto_rr", *mosquitto_args(edgeway.mqtt_port, "demo-device-1:rr", D1, "5"),
         "-t", "ai/v1/demo-device-1/req", "-e", f"ai/v1/demo-device-1/answers/{r}",
         "-m", json.dumps(request(r, coalesce_ms=60000, max_chunk_bytes=1048576)), "-W", "60"],
        capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    ev = json.loads(out.stdout.strip().splitlines()[0])
    assert check_event(ev)["type"] == "accepted"
    assert ev["request_id"] == r


@needs_mosquitto
def test_mosquitto_wrong_password_is_refused(edgeway):
    out = subprocess.run(
        ["mosquitto_pub", *mosquitto_args(edgeway.mqtt_port, "demo-device-1", ("demo-device-1", "wrong")),
         "-t", "ai/v1/demo-device-1/req", "-m", "{}"],
        capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "not authorised" in out.stderr.lower() or "bad user" in out.stderr.lower(), out.stderr


class Device:
    """A paho-mqtt client acting as a device."""

    def __init__(self, port, creds, client_id=None, v5=True):
        self.q = queue.Queue()
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self.rc = None
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or creds[0],
                             protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311)
        self.c.username_pw_set(*creds)
        self.c.on_connect = self._on_connect
        self.c.on_subscribe = lambda c, u, mid, codes, props: self.subscribed.set()
        self.c.on_message = lambda c, u, m: self.q.put(m)
        self.c.connect("127.0.0.1", port, keepalive=30)
        self.c.loop_start()

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        self.rc = reason_code
        self.connected.set()

    def wait_connected(self):
        assert self.connected.wait(30)
        return self.rc

    def subscribe(self, topic):
        self.subscribed.clear()
        self.c.subscribe(topic, qos=1)
        assert self.subscribed.wait(30)

    def publish(self, topic, payload, props=None):
        info = self.c.publish(topic, json.dumps(payload), qos=1, properties=props)
        info.wait_for_publish(30)

    def next(self, timeout=WAIT):
        m = self.q.get(timeout=timeout)
        return m, json.loads(m.payload)

    def stream(self, topic, events=None):
        events = events if events is not None else []
        while True:
            m, ev = self.next()
            assert m.topic == topic, (m.topic, ev)
            events.append(ev)
            if ev["type"] in ("done", "error"):
                return events

    def close(self):
        self.c.disconnect()
        self.c.loop_stop()


def resumed(edgeway, creds, subscription, request_id, from_seq, v5=False):
    """A device back after a drop: connected, subscribed to
    `subscription`, and resuming `request_id` from `from_seq`."""
    d = Device(edgeway.mqtt_port, creds, v5=v5)
    try:
        assert d.wait_connected() == 0
        d.subscribe(subscription)
        d.publish(f"ai/v1/{creds[0]}/resume", {"request_id": request_id, "from_seq": from_seq})
    except BaseException:
        d.close()
        raise
    return d


def test_paho_mqtt5_cancel_stops_the_engine(edgeway, llama):
    d = Device(edgeway.mqtt_port, D2)
    try:
        assert d.wait_connected() == 0
        d.subscribe("ai/v1/demo-device-2/res/#")
        r = rid()
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = b"paho-1"
        d.publish("ai/v1/demo-device-2/req", request(r, max_tokens=400, coalesce_ms=0), props)
        topic = f"ai/v1/demo-device-2/res/{r}"
        events = []
        while not any(e["type"] == "delta" for e in events):
            m, ev = d.next()
            assert m.topic == topic
            assert m.properties.CorrelationData == b"paho-1"
            events.append(ev)
        assert busy_slots(llama) >= 1
        d.publish("ai/v1/demo-device-2/cancel", {"request_id": r})
        d.stream(topic, events)
        check_stream(events)
        assert events[-1]["type"] == "error" and events[-1]["code"] == "REQUEST_CANCELLED", events[-1]
        deadline = time.monotonic() + 20
        while busy_slots(llama) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert busy_slots(llama) == 0, "the engine stopped generating"
        state, code, _ = edgeway.wait_task_state(events[0]["task_id"], "CANCELLED")
        assert (state, code) == ("CANCELLED", "REQUEST_CANCELLED")
    finally:
        d.close()


def test_paho_mqtt311_resume_after_reconnect_misses_nothing(edgeway, llama):
    r = rid()
    topic = f"ai/v1/demo-device-1/res/{r}"
    d = Device(edgeway.mqtt_port, D1, v5=False)
    assert d.wait_connected() == 0
    d.subscribe("ai/v1/demo-device-1/res/#")
    d.publish("ai/v1/demo-device-1/req", request(r, max_tokens=48, coalesce_ms=0))
    events = []
    while len(events) < 3:
        events.append(d.next()[1])
    d.close()  # the device goes away; on_disconnect = continue keeps the task
    d = resumed(edgeway, D1, "ai/v1/demo-device-1/res/#", r, len(events))
    try:
        d.stream(topic, events)
    finally:
        d.close()
    check_stream(events)
    assert events[-1]["type"] == "done", events[-1]
    assert events[-1]["result"]["usage"]["output_tokens"] > 0


class CompactReader:
    """Reads one compact stream (topics/README.md "Compact streams") as a
    device must: the seq written, or counted from the message before."""

    def __init__(self):
        self.prev = None
        self.topic = None
        self.written = []

    def parse(self, m):
        p = m.payload.decode()
        digits = len(p) - len(p.lstrip("0123456789"))
        if self.topic is None:
            self.topic = m.topic
        assert m.topic == self.topic, (m.topic, p)
        if digits == 0:
            assert self.prev is not None, f"a first message without its seq: {p!r}"
            seq, ev = self.prev + 1, {"type": "delta", "text": p[1:] if p.startswith(":") else p}
        else:
            seq, kind, rest = int(p[:digits]), p[digits], p[digits + 1:]
            self.written.append(seq)
            if kind == ":":
                ev = {"type": "delta", "text": rest}
            elif kind == "+":
                ev = {"type": "accepted", "request_id": rest.split(" ")[0]}
            elif kind == ".":
                reason, inp, out, *flags = rest.split(" ")
                ev = {"type": "done", "finish_reason": reason, "input_tokens": int(inp), "output_tokens": int(out)}
            else:
                assert kind == "{", p
                ev = json.loads(p[digits:])
                jsonschema.validate(ev, schema("compact"))
        self.prev = seq
        ev["seq"] = seq
        return ev

    def until_end(self, d, events):
        while True:
            ev = self.parse(d.q.get(timeout=WAIT))
            events.append(ev)
            if ev["type"] in ("done", "error"):
                return events


def test_paho_compact_stream_counts_its_seqs_across_a_resume(edgeway, llama):
    """A paho device on a compact stream, dropped half-way: it counts the
    seqs that are not written, resumes from its count, and the text equals
    a whole replay of the finished stream."""
    r = rid()
    d = Device(edgeway.mqtt_port, D1, v5=False)
    assert d.wait_connected() == 0
    d.subscribe("ai/v1/demo-device-1/s/#")
    d.publish("ai/v1/demo-device-1/req", request(r, max_tokens=48, coalesce_ms=0, compact=True))
    reader = CompactReader()
    events = []
    while len(events) < 5:
        events.append(reader.parse(d.q.get(timeout=WAIT)))
    assert events[0] == {"type": "accepted", "request_id": r, "seq": 0}
    d.close()
    d = resumed(edgeway, D1, "ai/v1/demo-device-1/s/#", r, len(events))
    try:
        reader.until_end(d, events)
        assert [e["seq"] for e in events] == list(range(len(events))), events
        done = events[-1]
        assert done["type"] == "done" and done["output_tokens"] > 0, done
        text = "".join(e["text"] for e in events if e["type"] == "delta")
        # Written: accepted, the resume's first message, every 16th delta, done.
        assert 5 in reader.written and len(events) - 1 in reader.written, reader.written
        assert len(events) < 18 or 16 in reader.written, reader.written
        assert len(reader.written) < len(events) / 2, "most seqs are counted"
        again = CompactReader()
        d.publish("ai/v1/demo-device-1/resume", {"request_id": r, "from_seq": 1})
        replay = again.until_end(d, [])
        assert [e["seq"] for e in replay] == list(range(1, len(events))), replay
        assert "".join(e["text"] for e in replay if e["type"] == "delta") == text
    finally:
        d.close()


@pytest.mark.parametrize("v5", [False, True])
def test_paho_immediate_reconnects_keep_their_subscriptions(edgeway, v5):
    """DISCONNECT, then the same client id at once, many times: every new
    SUBSCRIBE is answered. (rumqttd alone lost about 1 in 20 of them: it
    let the old link's late "closed" report remove the new connection.)"""
    for i in range(40):
        d = Device(edgeway.mqtt_port, D1, v5=v5)
        try:
            assert d.wait_connected() == 0
            d.subscribed.clear()
            d.c.subscribe("ai/v1/demo-device-1/echo/#", qos=1)
            assert d.subscribed.wait(5), f"no SUBACK in round {i}"
        finally:
            d.close()


def test_abrupt_close_and_immediate_reconnect_always_gets_a_connack(edgeway):
    """A device whose socket closes without DISCONNECT and that connects
    again at once, 100 times: every CONNECT is answered. (rumqttd alone
    applied the old link's late "closed" report to the new connection about
    1 time in 20: no CONNACK.)"""
    import socket
    import struct

    def connect_packet():
        body = b"\x00\x04MQTT\x04\xc2\x00\x3c"
        for s in (D1[0], D1[0], D1[1]):
            body += struct.pack(">H", len(s)) + s.encode()
        return bytes([0x10, len(body)]) + body

    for i in range(100):
        with socket.create_connection(("127.0.0.1", edgeway.mqtt_port), timeout=5) as s:
            s.sendall(connect_packet())
            assert s.recv(4) == b"\x20\x02\x00\x00", f"no CONNACK in round {i}"


def test_paho_hostile_device_sees_nothing_of_another_device(edgeway):
    hostile = Device(edgeway.mqtt_port, D2, client_id="demo-device-2:spy")
    victim = Device(edgeway.mqtt_port, D1, client_id="demo-device-1:paho")
    try:
        assert hostile.wait_connected() == 0 and victim.wait_connected() == 0
        for f in ["#", "ai/v1/+/res/#", "ai/v1/demo-device-1/#", "$share/x/ai/v1/demo-device-1/#"]:
            hostile.subscribe(f)
        victim.subscribe("ai/v1/demo-device-1/res/#")
        r = rid()
        victim.publish("ai/v1/demo-device-1/req", request(r, max_tokens=8))
        check_stream(victim.stream(f"ai/v1/demo-device-1/res/{r}"))
        # A probe into the hostile device's own subtree arrives after
        # anything that could have leaked on the same filters.
        hostile.publish("ai/v1/demo-device-2/probe", {"probe": True})
        seen = []
        while True:
            m, _ = hostile.next(30)
            seen.append(m.topic)
            if m.topic == "ai/v1/demo-device-2/probe":
                break
        assert all(t.startswith("ai/v1/demo-device-2/") for t in seen), seen
    finally:
        hostile.close()
        victim.close()
    # Another device's password under a spoofed id is refused at CONNECT.
    spoof = Device(edgeway.mqtt_port, D1, client_id="demo-device-2")
    try:
        assert spoof.wait_connected() != 0
    finally:
        spoof.c.loop_stop()


def test_paho_reads_the_retained_model_catalogue(edgeway):
    d = Device(edgeway.mqtt_port, D1, client_id="demo-device-1:catalogue", v5=False)
    try:
        assert d.wait_connected() == 0
        d.subscribe("ai/v1/shared/models")
        m, cat = d.next(30)
        jsonschema.validate(cat, schema("models"))
        assert {x["id"] for x in cat["models"]} >= {"general-chat", "fast-chat"}
    finally:
        d.close()
