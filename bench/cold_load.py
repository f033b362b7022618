#!/usr/bin/env python3
"""Cold-load time to first token versus warm, through edgeway and directly
against llama-server in router mode (issue 11's residency benchmark).

One llama-server in router mode (autoload on, so a direct request for an
unloaded model loads it, as a client without edgeway would see it) over a
models dir with the Gemma 3 270M file under three names:
- demo-cold: edgeway's `on_demand` model (idle_unload_s = 1): each cold run
  waits until llama-server's /models and edgeway's /v1/models both say
  unloaded, then streams one chat through edgeway;
- demo-warm: edgeway's `always` model: warm runs through edgeway;
- demo-direct: unloaded with POST /models/unload before each direct cold
  run; warm direct runs stream to demo-warm.
Time to first token = request sent -> first SSE chunk with content.

Usage: bench/cold_load.py [--edgeway target/debug/edgeway] [--runs 5]
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGEWAY_CACHE", Path.home() / ".cache" / "edgeway"))
LLAMA = CACHE / "bin" / "llama-server"
MODEL = CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"
KEY = "sk-bench"


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, key=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, json.load(r)


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def router_state(llama, model):
    return {m["id"]: m["status"]["value"] for m in get(llama + "/models")[1]["data"]}[model]


def edgeway_state(edgeway, model):
    return {m["id"]: m["state"] for m in get(edgeway + "/v1/models", KEY)[1]["data"]}[model]


def ttft(base, model, key=None):
    """Seconds from sending a streamed chat to its first content chunk."""
    body = {"model": model, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hello"}]}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 method="POST", headers=headers)
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            delta = (chunk.get("choices") or [{}])[0].get("delta", {})
            if delta.get("content"):
                took = time.monotonic() - t0
                for _ in r:  # read to the end: the engine slot is freed
                    pass
                return took
    raise SystemExit(f"{base} {model}: no content chunk")


def summary(xs):
    return {"median_ms": round(statistics.median(xs) * 1000, 1), "min_ms": round(min(xs) * 1000, 1),
            "max_ms": round(max(xs) * 1000, 1), "runs": [round(x * 1000, 1) for x in xs]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--edgeway", default=str(ROOT / "target" / "debug" / "edgeway"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", default="2")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgeway-cold-load-"))
    models = work / "models"
    models.mkdir()
    for n in ["demo-cold", "demo-warm", "demo-direct"]:
        (models / f"{n}.gguf").symlink_to(MODEL)
    lport, eport = free_port(), free_port()
    llama = f"http://127.0.0.1:{lport}"
    edgeway = f"http://127.0.0.1:{eport}"
    procs = []
    try:
        procs.append(subprocess.Popen(
            [str(LLAMA), "--models-dir", str(models), "--models-max", "0", "--host", "127.0.0.1",
             "--port", str(lport), "--ctx-size", "2048", "--threads", args.threads, "--no-webui",
             "--chat-template-file", str(ROOT / "config" / "templates" / "gemma.jinja")],
            stdout=open(work / "llama.log", "wb"), stderr=subprocess.STDOUT))
        wait(lambda: get(llama + "/models")[0] == 200, 60, "llama-server")
        digest = hashlib.sha256(KEY.encode()).hexdigest()
        cfg = f"""
node_id = "bench"
[http]
listen = "127.0.0.1:{eport}"
[store]
data_dir = "{work / 'data'}"
[applications.bench]
tenant = "bench"
api_key_sha256 = ["{digest}"]
admin = true
[engines.cold]
type = "openai"
base_url = "{llama}"
model = "demo-cold"
model_api = "llama-router"
health_interval_ms = 200
[engines.warm]
type = "openai"
base_url = "{llama}"
model = "demo-warm"
model_api = "llama-router"
health_interval_ms = 200
[models.cold]
instances = ["cold"]
residency = "on_demand"
idle_unload_s = 1
[models.warm]
instances = ["warm"]
"""
        (work / "edgeway.toml").write_text(cfg)
        procs.append(subprocess.Popen([args.edgeway, "serve", "--config", str(work / "edgeway.toml")],
                                      stdout=open(work / "edgeway.log", "wb"), stderr=subprocess.STDOUT))
        wait(lambda: get(edgeway + "/ready", KEY)[0] == 200, 120, "edgeway /ready (demo-warm loaded)")
        res = {"edgeway_cold": [], "edgeway_warm": [], "direct_cold": [], "direct_warm": []}
        for _ in range(args.runs):
            wait(lambda: router_state(llama, "demo-cold") == "unloaded"
                 and edgeway_state(edgeway, "cold") == "unloaded", 30, "demo-cold unloaded")
            res["edgeway_cold"].append(ttft(edgeway, "cold", KEY))
            res["edgeway_warm"].append(ttft(edgeway, "warm", KEY))
            post(llama + "/models/unload", {"model": "demo-direct"})
            wait(lambda: router_state(llama, "demo-direct") == "unloaded", 30, "demo-direct unloaded")
            res["direct_cold"].append(ttft(llama, "demo-direct"))
            res["direct_warm"].append(ttft(llama, "demo-warm"))
        out = {k: summary(v) for k, v in res.items()}
        out["load_avg"] = os.getloadavg()
        print(json.dumps(out, indent=2))
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
