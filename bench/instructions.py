#!/usr/bin/env python3
"""Instructions edgeway executes per HTTP request, counted by callgrind.

Why instructions: on a shared 2-core machine wall-clock latency and CPU
seconds move with whatever else runs; the number of instructions a binary
executes for the same requests does not (to within a fraction of a percent),
so two binaries can be compared while other builds run.

Method: a fake OpenAI engine (this script, a thread; it answers 8 tokens "tok "
like edgeway::testing::FakeEngine's default, whole answers at once) and the
release edgeway binary under `valgrind --tool=callgrind`, with the test
configuration of src/testing (config_toml) and the overhead bench's limits.
After a warm-up the counters are zeroed (`callgrind_control -z`), N sequential
requests are sent on one keep-alive connection, and the counters are dumped
(`callgrind_control -d`): instructions of every edgeway thread / N. The same
is done for an idle pause, to show what background work (timers, health
probes; the probe interval is set to 10 minutes here) adds per second. The
dumps are kept, so `callgrind_annotate --inclusive=yes <dump>` shows where.

    python3 bench/instructions.py --edgeway-bin target/release/edgeway -n 1000
    python3 bench/instructions.py --edgeway-bin A --edgeway-bin B   # side by side
    python3 bench/instructions.py --log-level info --edgeway-bin A  # with the stage log lines

Prints a Markdown table; the dumps go to --out (default bench/results/callgrind-<time>).
"""

import argparse
import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEMO_KEY = "sk-edgeway-demo"
OPS_KEY = "sk-edgeway-ops"
TOKENS = 8
TOKEN_TEXT = "tok "


def sse(v):
    return ("data: " + json.dumps(v, separators=(",", ":")) + "\n\n").encode()


class FakeEngine(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, status, body, ctype="application/json"):
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            body = {"object": "list", "data": [{"id": "fake", "object": "model"}]}
        elif self.path.startswith("/health"):
            body = {"status": "ok"}
        elif self.path.startswith("/slots"):
            body = []
        else:
            self.reply(404, b"not found", "text/plain")
            return
        self.reply(200, json.dumps(body).encode())

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        req = json.loads(self.rfile.read(n) or b"{}")
        if not self.path.startswith("/v1/chat/completions"):
            self.reply(404, b"not found", "text/plain")
            return
        n = min(TOKENS, int(req.get("max_tokens") or TOKENS))
        model = req.get("model", "fake")
        finish = "length" if n < TOKENS else "stop"
        pt = sum(len(str(m.get("content", "")).split()) for m in req.get("messages", [])) + 1
        usage = {"prompt_tokens": pt, "completion_tokens": n, "total_tokens": pt + n}
        if not req.get("stream"):
            body = {
                "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": TOKEN_TEXT * n},
                             "finish_reason": finish}],
                "usage": usage,
            }
            self.reply(200, json.dumps(body).encode())
            return
        chunk = lambda delta, fin=None: {  # noqa: E731
            "id": "c", "object": "chat.completion.chunk", "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]}
        parts = [sse(chunk({"role": "assistant", "content": ""}))]
        parts += [sse(chunk({"content": TOKEN_TEXT})) for _ in range(n)]
        parts.append(sse(chunk({}, finish)))
        if (req.get("stream_options") or {}).get("include_usage"):
            parts.append(sse({"id": "c", "object": "chat.completion.chunk", "model": model,
                              "choices": [], "usage": usage}))
        parts.append(b"data: [DONE]\n\n")
        # Chunked, one chunk per SSE event, as a streaming engine sends it.
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for p in parts:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(p), p))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_toml(engine_url, data_dir, port, log_level="warn", log_format="text"):
    """src/testing::config_toml with bench/overhead.rs's edits (and the log
    level and format asked for: the overhead bench logs at `warn`, a
    default install at `info`, text)."""
    demo = hashlib.sha256(DEMO_KEY.encode()).hexdigest()
    ops = hashlib.sha256(OPS_KEY.encode()).hexdigest()
    return f"""
node_id = "test-node"
[http]
listen = "127.0.0.1:{port}"
[store]
data_dir = "{data_dir}"
[applications.demo]
tenant = "demo"
api_key_sha256 = ["{demo}"]
max_priority = "P1"
default_priority = "P2"
[applications.ops]
tenant = "demo"
api_key_sha256 = ["{ops}"]
max_priority = "P0"
default_priority = "P1"
admin = true
[engines.fake]
type = "openai"
base_url = "{engine_url}"
model = "fake-model"
max_concurrency = 512
health_interval_ms = 600000
[models.general-chat]
instances = ["fake"]
context_tokens = 2048
max_output_tokens = 256
queue_capacity = 100000

[log]
level = "{log_level}"
format = "{log_format}"
"""


class Client:
    def __init__(self, port):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def chat(self, stream):
        body = json.dumps({
            "model": "general-chat", "messages": [{"role": "user", "content": "Say hello"}],
            "stream": stream, "max_tokens": TOKENS,
        })
        self.conn.request("POST", "/v1/chat/completions", body=body, headers={
            "content-type": "application/json", "authorization": f"Bearer {DEMO_KEY}"})
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
        if stream and b"[DONE]" not in data:
            raise RuntimeError(f"stream without [DONE]: {data[:300]!r}")
        if not stream and b"tok tok" not in data:
            raise RuntimeError(f"unexpected answer: {data[:300]!r}")


def wait_ready(port, proc, timeout):
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"edgeway exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/ready")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("edgeway not ready")


def dump_total(pid, out_dir, label, before):
    """Dumps the counters and returns the new dump's total instructions."""
    subprocess.run(["callgrind_control", "-d", label, str(pid)], check=True, capture_output=True)
    # The dump is written asynchronously by the next thread that runs.
    end = time.time() + 120
    while time.time() < end:
        files = set(os.listdir(out_dir)) - before
        for f in files:
            path = os.path.join(out_dir, f)
            text = open(path).read()
            if "\ntotals:" in text or "\nsummary:" in text:
                for line in text.splitlines():
                    if line.startswith(("summary:", "totals:")):
                        return int(line.split()[1]), path
        time.sleep(0.2)
    raise RuntimeError("no callgrind dump appeared")


PERF_EVENTS = "raw_syscalls:sys_enter,context-switches,task-clock,page-faults"


def perf_counts(pid, out_dir, label, work):
    """Runs work() with `perf stat` attached to pid; returns {event: count}."""
    path = os.path.join(out_dir, f"perf-{label}.csv")
    perf = subprocess.Popen(["perf", "stat", "-x", ",", "-e", PERF_EVENTS, "-p", str(pid), "-o", path])
    time.sleep(1.0)  # perf attaches asynchronously; the idle second is counted too (see idle)
    t0 = time.time()
    work()
    secs = time.time() - t0
    perf.send_signal(signal.SIGINT)
    perf.wait(30)
    counts = {}
    for line in open(path):
        f = line.strip().split(",")
        if len(f) > 3 and f[0] and f[0][0].isdigit():
            counts[f[2]] = float(f[0])
    return counts, path, secs


def measure(binary, n, idle_s, out_dir, engine_url, tool="callgrind", log_level="warn", log_format="text"):
    os.makedirs(out_dir, exist_ok=True)
    data = os.path.join(out_dir, "data")
    os.makedirs(data, exist_ok=True)
    port = free_port()
    cfg = os.path.join(out_dir, "edgeway.toml")
    with open(cfg, "w") as f:
        f.write(config_toml(engine_url, data, port, log_level, log_format))
    log = open(os.path.join(out_dir, "edgeway.log"), "w")
    cmd = [binary, "serve", "--config", cfg]
    if tool == "callgrind":
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/cg.out"] + cmd
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    results = {}
    try:
        wait_ready(port, proc, 300)
        client = Client(port)
        for _ in range(50):  # warm-up: pools, lazy statics, prepared statements
            client.chat(False)
            client.chat(True)
        if tool == "perf":
            for label, stream in (("nonstream", False), ("stream", True)):
                results[label] = perf_counts(proc.pid, out_dir, label,
                                             lambda: [client.chat(stream) for _ in range(n)])
            results["idle"] = perf_counts(proc.pid, out_dir, "idle", lambda: time.sleep(idle_s))
            return results
        for label, stream in (("nonstream", False), ("stream", True)):
            before = set(os.listdir(out_dir))
            subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
            t0 = time.time()
            for _ in range(n):
                client.chat(stream)
            secs = time.time() - t0
            total, path = dump_total(proc.pid, out_dir, label, before)
            results[label] = (total, path, secs)
        before = set(os.listdir(out_dir))
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        time.sleep(idle_s)
        total, path = dump_total(proc.pid, out_dir, "idle", before)
        results["idle"] = (total, path, idle_s)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edgeway-bin", action="append", required=True)
    ap.add_argument("-n", type=int, default=1000, help="requests per measured phase")
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tool", choices=["callgrind", "perf"], default="callgrind",
                    help="perf: run natively and count syscalls, context switches and CPU time "
                         "per request with `perf stat -p` (kernel work callgrind does not see)")
    ap.add_argument("--log-level", default="warn",
                    help="[log] level (the overhead bench's warn by default; info writes the stage lines)")
    ap.add_argument("--log-format", choices=["text", "json"], default="text")
    args = ap.parse_args()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   time.strftime("callgrind-%Y%m%d-%H%M%S"))
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    engine_url = f"http://127.0.0.1:{srv.server_address[1]}"
    rows = []
    for i, b in enumerate(args.edgeway_bin):
        d = os.path.join(out, f"{i}-{os.path.basename(b)}")
        print(f"measuring {b} → {d}", file=sys.stderr)
        r = measure(os.path.abspath(b), args.n, args.idle_seconds, d, engine_url, args.tool,
                    args.log_level, args.log_format)
        if args.tool == "perf":
            row = {"binary": b, "dir": d}
            idle = r["idle"][0]
            for label in ("nonstream", "stream"):
                counts, _, secs = r[label]
                for ev, v in counts.items():
                    # minus the idle pause's rate over this phase's wall time (+1 s attach)
                    idle_part = idle.get(ev, 0) / (args.idle_seconds + 1.0) * (secs + 1.0)
                    row[f"{label}:{ev}"] = (v - idle_part) / args.n
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
            continue
        idle_rate = r["idle"][0] / r["idle"][2]
        row = {"binary": b, "dir": d}
        for label in ("nonstream", "stream"):
            total, path, secs = r[label]
            row[label] = total / args.n
            # What the idle pause would have counted over the phase's wall time.
            row[label + "_idle_share"] = idle_rate * secs / args.n
            row[label + "_dump"] = path
        row["idle_per_s"] = idle_rate
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    if args.tool == "perf":
        evs = PERF_EVENTS.split(",")
        print(f"\nPer request, perf stat -p, {args.n} sequential requests per phase, idle rate subtracted\n")
        print("| binary | phase | " + " | ".join(evs) + " |")
        print("|---|---|" + "---|" * len(evs))
        for row in rows:
            for label in ("nonstream", "stream"):
                print(f"| {row['binary']} | {label} | " + " | ".join(
                    f"{row.get(label + ':' + e, float('nan')):.2f}" for e in evs) + " |")
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return
    print(f"\nInstructions per request (callgrind, all edgeway threads, {args.n} sequential "
          f"requests per phase after 100 warm-up, log {args.log_level}/{args.log_format}; "
          f"idle = background work per second)\n")
    print("| binary | non-stream | streamed (8 tokens) | idle per s | idle share per request (non-stream / stream) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['binary']} | {row['nonstream']:,.0f} | {row['stream']:,.0f} | "
              f"{row['idle_per_s']:,.0f} | {row['nonstream_idle_share']:,.0f} / {row['stream_idle_share']:,.0f} |")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
