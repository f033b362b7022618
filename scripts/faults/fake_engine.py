#!/usr/bin/env python3
"""A counting OpenAI-compatible engine for the fault runs, as its own
process (so a run can kill -9 it, or edgeway, and keep the count).

Serves POST /v1/chat/completions (streaming and not), GET /health,
/v1/models and /slots. Each chat request appends one line to --log: the
`nonce` the fault script put in the last message (`nonce=…` anywhere in
its text), so a script can tell how often the engine ran each task, across
edgeway restarts. Streams --tokens tokens, one every --delay-ms.

Tool calls: a request that declares `tools` and whose last message holds
`TOOL_CALLS=[["name", "arguments JSON"], …]` (to the end of its text) is
answered with those calls, streamed OpenAI-style in pieces of 5 characters
of arguments (the first piece of a call with its id, type and name) or
whole. --last-request PATH keeps the body of the latest chat request there
(for tests of what reached the engine).

Owns: the fake engine and its request log. Does not own: any judgement
(the fault scripts read the log).
"""
import argparse
import asyncio
import json
import re
import sys

NONCE = re.compile(r"nonce=([A-Za-z0-9_.:-]+)")
TOOL_CALLS = re.compile(r"TOOL_CALLS=(\[.*\])\s*$", re.S)
PIECE = 5


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--delay-ms", type=float, default=50)
    p.add_argument("--log", required=True)
    p.add_argument("--last-request", default=None)
    return p.parse_args()


ARGS = None
LOG = None
ACTIVE = 0


def chunk(delta, finish=None):
    return {"id": "c", "object": "chat.completion.chunk", "model": ARGS.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def write_json(w, status, obj):
    body = json.dumps(obj).encode()
    w.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body)
    await w.drain()


def requested_calls(body):
    """The [name, arguments] calls the request's last message asks for."""
    msgs = body.get("messages") or []
    if not body.get("tools") or not msgs or not isinstance(msgs[-1].get("content"), str):
        return None
    m = TOOL_CALLS.search(msgs[-1]["content"])
    return json.loads(m.group(1)) if m else None


async def tool_calls(w, body, calls):
    if not body.get("stream"):
        await write_json(w, "200 OK", {
            "id": "c", "object": "chat.completion", "model": ARGS.model,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None,
                "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                               for i, (n, a) in enumerate(calls)]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": len(calls), "total_tokens": 10 + len(calls)}})
        return
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

    async def send(obj):
        data = f"data: {obj}\n\n".encode() if isinstance(obj, str) else f"data: {json.dumps(obj)}\n\n".encode()
        w.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await w.drain()

    pieces = 0
    for i, (name, args) in enumerate(calls):
        first = {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": ""}}
        delta = {"tool_calls": [first]}
        if i == 0:
            delta.update({"role": "assistant", "content": None})
        await send(chunk(delta))
        for at in range(0, len(args), PIECE):
            await asyncio.sleep(ARGS.delay_ms / 1000)
            await send(chunk({"tool_calls": [{"index": i, "function": {"arguments": args[at:at + PIECE]}}]}))
            pieces += 1
    await send(chunk({}, "tool_calls"))
    if (body.get("stream_options") or {}).get("include_usage"):
        await send({"id": "c", "object": "chat.completion.chunk", "model": ARGS.model, "choices": [],
                    "usage": {"prompt_tokens": 10, "completion_tokens": pieces, "total_tokens": 10 + pieces}})
    await send("[DONE]")
    w.write(b"0\r\n\r\n")
    await w.drain()


async def chat(w, body):
    global ACTIVE
    text = json.dumps(body.get("messages", []))
    m = NONCE.search(text)
    LOG.write((m.group(1) if m else "-") + "\n")
    LOG.flush()
    if ARGS.last_request:
        with open(ARGS.last_request, "w") as f:
            json.dump(body, f)
    calls = requested_calls(body)
    if calls:
        await tool_calls(w, body, calls)
        return
    n = min(ARGS.tokens, int(body.get("max_tokens") or ARGS.tokens))
    delay = ARGS.delay_ms / 1000
    ACTIVE += 1
    try:
        if not body.get("stream"):
            await asyncio.sleep(delay * n)
            await write_json(w, "200 OK", {
                "id": "c", "object": "chat.completion", "model": ARGS.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok " * n},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}})
            return
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        async def send(obj):
            data = f"data: {obj}\n\n".encode() if isinstance(obj, str) else f"data: {json.dumps(obj)}\n\n".encode()
            w.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await w.drain()

        await send(chunk({"role": "assistant", "content": ""}))
        for _ in range(n):
            await asyncio.sleep(delay)
            await send(chunk({"content": "tok "}))
        await send(chunk({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"id": "c", "object": "chat.completion.chunk", "model": ARGS.model, "choices": [],
                        "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}})
        await send("[DONE]")
        w.write(b"0\r\n\r\n")
        await w.drain()
    finally:
        ACTIVE -= 1


async def handle(r, w):
    try:
        while True:
            line = await r.readline()
            if not line:
                return
            method, path, _ = line.decode().split(" ", 2)
            headers = {}
            while True:
                h = await r.readline()
                if h in (b"\r\n", b"\n", b""):
                    break
                k, v = h.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            body = await r.readexactly(int(headers.get("content-length", 0)))
            if method == "POST" and path.startswith("/v1/chat/completions"):
                await chat(w, json.loads(body or b"{}"))
            elif path.startswith("/health"):
                await write_json(w, "200 OK", {"status": "ok"})
            elif path.startswith("/v1/models"):
                await write_json(w, "200 OK", {"object": "list", "data": [{"id": ARGS.model, "object": "model"}]})
            elif path.startswith("/slots"):
                await write_json(w, "200 OK", [{"id": i, "is_processing": True} for i in range(ACTIVE)])
            else:
                await write_json(w, "404 Not Found", {"error": "not found"})
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        w.close()


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", ARGS.port, backlog=1024)
    print("fake engine ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ARGS = parse_args()
    LOG = open(ARGS.log, "a")
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
