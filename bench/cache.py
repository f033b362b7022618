#!/usr/bin/env python3
"""Response cache: latency of a cache hit against a live answer (issue 14).

The edgeway binary with `[cache] enabled = true` in front of one engine:
  - fake (default): a tiny OpenAI-compatible engine in this process
    (stdlib HTTP server) that streams `--tokens` tokens at once;
  - --llama: llama-server with Gemma 3 270M from $EDGEWAY_CACHE (CPU).
For each of `--prompts` distinct deterministic prompts (temperature 0), the
first call is a live answer (a cache miss: the engine answers) and the next
`--repeats` calls are hits. Measured per call, from the request sent:
non-streamed, the whole response; streamed, the first SSE chunk with
content (time to first token). Every hit is checked to say
`edge.cache_hit: true` and to repeat the live answer's text.

    python3 bench/cache.py [--edgeway-bin $CARGO_TARGET_DIR/debug/edgeway] \
        [--prompts 20 --repeats 5] [--llama --prompts 5 --repeats 3]

Prints Markdown. Stdlib only.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGEWAY_CACHE", Path.home() / ".cache" / "edgeway"))
LLAMA_BIN = CACHE / "bin" / "llama-server"
MODEL = CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
DEMO_KEY = "sk-edgeway-demo"
DEMO_SHA = "8c3a625c4e78630afa8fcb625fac7823bbd6589aba01957c3eb8afc8ff83bd1b"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} not ready after {timeout} s")


class FakeEngine:
    """OpenAI chat completions, streamed or not: `tokens` x "tok ", no delay."""

    def __init__(self, tokens):
        tokens_ = tokens

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                body = b'{"data": [{"id": "fake-model"}]}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                usage = {"prompt_tokens": 5, "completion_tokens": tokens_, "total_tokens": 5 + tokens_}
                if not req.get("stream"):
                    body = json.dumps({"id": "x", "object": "chat.completion", "model": "fake-model",
                                       "choices": [{"index": 0, "finish_reason": "stop",
                                                    "message": {"role": "assistant", "content": "tok " * tokens_}}],
                                       "usage": usage}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for i in range(tokens_):
                    chunk = {"choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
                self.wfile.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()


def start_llama(work):
    port = free_port()
    log = open(work / "llama.log", "wb")
    proc = subprocess.Popen([str(LLAMA_BIN), "-m", str(MODEL), "--alias", "gemma-3-270m", "--host", "127.0.0.1",
                             "--port", str(port), "--parallel", "2", "--ctx-size", "4096", "--threads", "2",
                             "--no-webui"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 180, proc)
    return proc, url


def start_edgeway(binary, work, engine_url, model):
    port = free_port()
    cfg = work / "edgeway.toml"
    cfg.write_text(f"""node_id = "bench"
[http]
listen = "127.0.0.1:{port}"
[store]
data_dir = "{work / 'data'}"
[log]
format = "json"
level = "warn"
[cache]
enabled = true
[applications.demo]
tenant = "demo"
api_key_sha256 = ["{DEMO_SHA}"]
max_priority = "P1"
default_priority = "P2"
[engines.engine]
type = "openai"
base_url = "{engine_url}"
model = "{model}"
max_concurrency = 2
health_interval_ms = 1000
[models.general-chat]
instances = ["engine"]
context_tokens = 2048
max_output_tokens = 256
""")
    proc = subprocess.Popen([str(binary), "serve", "--config", str(cfg)],
                            stdout=open(work / "edgeway.log", "wb"), stderr=subprocess.STDOUT, cwd=work)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/ready", 120, proc)
    return proc, url


def call(base, prompt, stream, max_tokens):
    """One call: (seconds to the whole answer or to the first content chunk, text, edge)."""
    body = {"model": "general-chat", "temperature": 0, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": prompt}]}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {DEMO_KEY}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            v = json.load(r)
            return time.perf_counter() - t0, v["choices"][0]["message"]["content"], v["edge"]
        first, text, edge = None, "", None
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            v = json.loads(line[6:])
            piece = (v.get("choices") or [{}])[0].get("delta", {}).get("content")
            if piece:
                first = first or time.perf_counter() - t0
                text += piece
            edge = v.get("edge") or edge
        return first, text, edge


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))]


def row(name, xs):
    return (f"| {name} | {len(xs)} | {pct(xs, 50) * 1000:.2f} | {pct(xs, 95) * 1000:.2f} | "
            f"{statistics.mean(xs) * 1000:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edgeway-bin", type=Path, default=TARGET / "debug" / "edgeway")
    ap.add_argument("--llama", action="store_true", help="llama-server (Gemma 3 270M) instead of the fake")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="answer tokens (fake; max_tokens with --llama)")
    args = ap.parse_args()
    assert args.edgeway_bin.exists(), f"{args.edgeway_bin} missing: cargo build --bin edgeway"
    work = Path(tempfile.mkdtemp(prefix="edgeway-cache-bench-"))
    engine, llama = None, None
    if args.llama:
        llama, engine_url = start_llama(work)
        model = "gemma-3-270m"
    else:
        engine = FakeEngine(args.tokens)
        engine_url, model = engine.url, "fake-model"
    ew, base = start_edgeway(args.edgeway_bin, work, engine_url, model)
    try:
        samples = {}
        for stream in (False, True):
            live, hits = [], []
            for i in range(args.prompts):
                prompt = f"Question {i} ({'stream' if stream else 'whole'}): name a colour of the sea."
                t, text, edge = call(base, prompt, stream, args.tokens)
                assert not (edge or {}).get("cache_hit"), edge
                live.append(t)
                for _ in range(args.repeats):
                    t, again, edge = call(base, prompt, stream, args.tokens)
                    assert edge.get("cache_hit") is True, edge
                    assert again == text, (again, text)
                    hits.append(t)
            samples[stream] = (live, hits)
        load = open("/proc/loadavg").read().split()[:3]
        engine_name = "llama-server, Gemma 3 270M Q4_K_M, CPU" if args.llama else "fake engine (in the script)"
        print(f"Engine: {engine_name}; edgeway: {args.edgeway_bin}; {os.cpu_count()} cores, "
              f"load average at the end {' '.join(load)}; {args.tokens} tokens per answer.\n")
        print("| call | n | p50 ms | p95 ms | mean ms |\n|---|---|---|---|---|")
        for stream, label in ((False, "whole answer"), (True, "streamed, time to first token")):
            live, hits = samples[stream]
            print(row(f"live ({label})", live))
            print(row(f"cache hit ({label})", hits))
    finally:
        ew.terminate()
        ew.wait(10)
        if engine:
            engine.stop()
        if llama:
            llama.terminate()
            llama.wait(10)


if __name__ == "__main__":
    sys.exit(main())
