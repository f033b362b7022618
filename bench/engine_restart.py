#!/usr/bin/env python3
"""Time from an engine crash (kill -9 of the llama-server that edgeway runs)
to the first successful request through edgeway after the restart.

Starts `edgeway serve --config config/edgeway.toml` (both llama-servers run
by edgeway, [engines.*.process]) on free edgeway ports with its own data
directory, waits until /ready, then per run: kills llama-local's process
(pid from /ready's engine_processes) with SIGKILL and sends a one-token chat
request every 50 ms until one answers 200. Prints each run and the median.
Meanwhile requests are answered MODEL_UNAVAILABLE at once (the model's only
instance is down), which is what the retry loop sees.

Usage: bench/engine_restart.py [--edgeway target/release/edgeway] [--runs 5]
Needs scripts/setup-deps.sh (llama-server and the model in ~/.cache/edgeway)
and the engine ports 8081/8082 free.
Owns: this measurement. Does not own: any pass/fail judgement.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS_KEY = "sk-edgeway-ops"
DEMO_KEY = "sk-edgeway-demo"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, key=None, timeout=5):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def chat(base):
    body = json.dumps({"model": "general-chat", "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 1}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError):
        return 0


def process(base, name):
    _, ready = get(base + "/ready", OPS_KEY)
    return next(p for p in ready["engine_processes"] if p["instance"] == name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--edgeway", default=os.path.join(ROOT, "target", "release", "edgeway"))
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="edgeway-restart-bench-")
    port = free_port()
    env = dict(os.environ)
    env.update({
        "EDGEWAY__HTTP__LISTEN": f"127.0.0.1:{port}",
        "EDGEWAY__MQTT__LISTEN": f"127.0.0.1:{free_port()}",
        "EDGEWAY__STORE__DATA_DIR": os.path.join(work, "data"),
        "RUST_LOG": "warn",
    })
    base = f"http://127.0.0.1:{port}"
    log = open(os.path.join(work, "edgeway.log"), "w")
    gw = subprocess.Popen([args.edgeway, "serve", "--config", "config/edgeway.toml"], cwd=ROOT, env=env,
                          stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if get(base + "/ready")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            if gw.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"edgeway did not become ready; see {log.name}")
            time.sleep(0.1)
        assert chat(base) == 200
        times = []
        for run in range(args.runs):
            before = process(base, "llama-local")
            os.kill(before["pid"], signal.SIGKILL)
            t0 = time.monotonic()
            refused = 0
            while (code := chat(base)) != 200:
                refused += 1
                time.sleep(0.05)
            dt = time.monotonic() - t0
            after = process(base, "llama-local")
            times.append(dt)
            print(f"run {run + 1}: {dt:.2f} s from kill -9 to the first 200 "
                  f"({refused} requests refused meanwhile, last {code}; restarts {after['restarts']}, "
                  f"pid {before['pid']} -> {after['pid']})", flush=True)
        print(f"median {statistics.median(times):.2f} s, min {min(times):.2f} s, max {max(times):.2f} s "
              f"over {len(times)} runs")
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(timeout=60)


if __name__ == "__main__":
    main()
