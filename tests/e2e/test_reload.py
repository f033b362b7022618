"""Configuration reload against the real llama-server: while a stream
runs, the config file gains an application (a new API key) and POST
/admin/reload puts it in force. The stream completes normally, the new key
answers, and /ready shows the new config_version. A broken file is then
refused (422 CONFIG_INVALID with key paths) and the new version stays.
A second test adds, at reload, a llama-server that edgeway runs itself and
a model on it: a request sent at once waits until the new engine is ready
and is answered by it; edgeway's stop stops the engine too.

edgeway runs here with a config of its own (one engine: the session's
llama-server), so the test does not depend on config/edgeway.toml's
engines.
"""
import hashlib
import json
import os
import threading
import time
import urllib.error
import urllib.request

from conftest import DEMO_KEY, EDGEWAY_BIN, LLAMA_BIN, MODEL, OPS_KEY, ROOT, Proc, free_port, wait_http

NEW_KEY = "sk-edgeway-added-by-reload"


def sha(key):
    return hashlib.sha256(key.encode()).hexdigest()


def config(port, data, llama, extra=""):
    return f"""
node_id = "e2e-reload"
[http]
listen = "127.0.0.1:{port}"
[store]
data_dir = "{data}"
[applications.demo]
tenant = "demo"
api_key_sha256 = ["{sha(DEMO_KEY)}"]
max_priority = "P1"
default_priority = "P2"
[applications.ops]
tenant = "demo"
api_key_sha256 = ["{sha(OPS_KEY)}"]
max_priority = "P0"
default_priority = "P1"
admin = true
[engines.llama-local]
type = "openai"
base_url = "{llama}"
model = "gemma-3-270m"
max_concurrency = 2
health_interval_ms = 500
[models.general-chat]
instances = ["llama-local"]
context_tokens = 4096
max_output_tokens = 256
{extra}
"""


def call(url, key, body=None, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                                 method="POST" if body is not None or url.endswith("/reload") else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_a_key_added_at_reload_answers_while_an_earlier_stream_completes(llama, workdir):
    port = free_port()
    d = workdir / f"reload-{time.monotonic_ns()}"
    d.mkdir()
    cfg = d / "edgeway.toml"
    cfg.write_text(config(port, d / "data", llama))
    base = f"http://127.0.0.1:{port}"
    gw = Proc([str(EDGEWAY_BIN), "serve", "--config", str(cfg)], {"PATH": "/usr/bin:/bin"}, d / "edgeway.log")
    try:
        wait_http(base + "/ready", 60, gw.p, d / "edgeway.log")
        _, ready = call(base + "/ready", OPS_KEY)
        before = ready["config_version"]
        assert call(base + "/v1/chat/completions", NEW_KEY, {"model": "general-chat", "messages": []})[0] == 401

        # A stream that runs across the reload.
        chunks, first, outcome = [], threading.Event(), {}

        def stream():
            body = {"model": "general-chat", "messages": [{"role": "user", "content": "Tell a story"}],
                    "max_tokens": 48, "stream": True}
            req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {DEMO_KEY}",
                                                  "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    line = line.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        outcome["done"] = True
                        break
                    chunks.append(json.loads(line[6:]))
                    if any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks):
                        first.set()
            outcome["ended_at"] = time.monotonic()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60), "the stream's first token"

        cfg.write_text(config(port, d / "data", llama,
                              f'[applications.added]\ntenant = "demo"\napi_key_sha256 = ["{sha(NEW_KEY)}"]\n'))
        reloaded_at = time.monotonic()
        status, body = call(base + "/admin/reload", OPS_KEY)
        assert status == 200, body
        assert body["changes"]["api_keys"]["added"] == 1, body
        after = body["config_version"]
        assert after != before

        status, answer = call(base + "/v1/chat/completions", NEW_KEY,
                              {"model": "general-chat", "messages": [{"role": "user", "content": "Hi"}],
                               "max_tokens": 4})
        assert status == 200, answer
        t.join(120)
        assert outcome.get("done"), chunks[-3:]
        assert outcome["ended_at"] > reloaded_at, "the stream was still running at the reload"
        assert not any("error" in c for c in chunks), chunks[-3:]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1]

        # A broken file: refused with key paths, and the new version stays.
        cfg.write_text(config(port, d / "data", llama).replace("max_concurrency = 2", "max_concurrency = 0"))
        status, body = call(base + "/admin/reload", OPS_KEY)
        assert status == 422 and body["error"]["code"] == "CONFIG_INVALID", body
        assert "engines.llama-local.max_concurrency" in [e["path"] for e in body["error"]["errors"]], body
        _, ready = call(base + "/ready", OPS_KEY)
        assert ready["config_version"] == after
        assert call(base + "/v1/chat/completions", NEW_KEY,
                    {"model": "general-chat", "messages": [{"role": "user", "content": "Hi"}],
                     "max_tokens": 2})[0] == 200
    finally:
        gw.stop()


def test_a_llama_server_added_at_reload_is_started_and_answers(llama, workdir):
    port, engine_port = free_port(), free_port()
    d = workdir / f"reload-added-{time.monotonic_ns()}"
    d.mkdir()
    cfg = d / "edgeway.toml"
    cfg.write_text(config(port, d / "data", llama))
    base = f"http://127.0.0.1:{port}"
    gw = Proc([str(EDGEWAY_BIN), "serve", "--config", str(cfg)], {"PATH": "/usr/bin:/bin"}, d / "edgeway.log")
    try:
        wait_http(base + "/ready", 60, gw.p, d / "edgeway.log")
        args = ["-m", str(MODEL), "--alias", "gemma-3-270m-added", "--host", "127.0.0.1",
                "--port", str(engine_port), "--parallel", "1", "--ctx-size", "2048", "--threads", "1",
                "--no-webui", "--chat-template-file", str(ROOT / "config" / "templates" / "gemma.jinja")]
        added = f"""
[engines.llama-added]
type = "openai"
base_url = "http://127.0.0.1:{engine_port}"
model = "gemma-3-270m-added"
max_concurrency = 1
health_interval_ms = 200
[engines.llama-added.process]
command = "{LLAMA_BIN}"
args = {json.dumps(args)}
ready_timeout_ms = 120000
[models.added-chat]
instances = ["llama-added"]
context_tokens = 2048
max_output_tokens = 64
"""
        cfg.write_text(config(port, d / "data", llama, added))
        status, body = call(base + "/admin/reload", OPS_KEY)
        assert status == 200, body
        assert body["changes"]["engines"]["added"] == 1, body
        # Sent at once: it waits for the new engine's process to be ready.
        status, answer = call(base + "/v1/chat/completions", DEMO_KEY,
                              {"model": "added-chat", "messages": [{"role": "user", "content": "Hi"}],
                               "max_tokens": 4})
        assert status == 200, answer
        _, ready = call(base + "/ready", OPS_KEY)
        proc = next(p for p in ready["engine_processes"] if p["instance"] == "llama-added")
        assert proc["state"] == "ready", proc
        pid = proc["pid"]
    finally:
        gw.stop()
    with open(f"/proc/{pid}/stat") if os.path.exists(f"/proc/{pid}/stat") else open(os.devnull) as f:
        stat = f.read()
    assert not stat or stat.rsplit(")", 1)[1].split()[0] == "Z", "edgeway's stop stopped the engine it added"
