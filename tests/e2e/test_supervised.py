"""The real llama-server run by edgeway itself (config/edgeway.toml's
[engines.llama-local.process], on a free port): edgeway starts it, is ready
once it is, restarts it after a kill -9, answers again after the restart,
and stops it on SIGTERM. The embeddings engine is the session's fixture
(not run by edgeway), so only one extra model load is paid (~2 s).
"""
import json
import os
import signal
import time
import urllib.error
import urllib.request

from conftest import DEMO_KEY, EDGEWAY_BIN, OPS_KEY, Proc, free_port, wait_http


def call(url, key, body=None, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def engine_process(base):
    _, ready = call(base + "/ready", OPS_KEY)
    return next(p for p in ready["engine_processes"] if p["instance"] == "llama-local")


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


CHAT = {"model": "general-chat", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def test_supervised_llama_server_is_restarted_after_kill_9(llama_embed, workdir):
    engine_port = free_port()
    port = free_port()
    d = workdir / f"supervised-{time.monotonic_ns()}"
    d.mkdir()
    # The example config's llama-local process, moved to a free port.
    args = ["-m", "${EDGEWAY_CACHE:-${HOME}/.cache/edgeway}/models/gemma-3-270m-q4_k_m.gguf",
            "--alias", "gemma-3-270m", "--host", "127.0.0.1", "--port", str(engine_port),
            "--parallel", "2", "--ctx-size", "4096", "--threads", "2", "--slots", "--no-webui",
            "--chat-template-file", "templates/gemma.jinja"]
    env = dict(os.environ)
    env.update({
        "EDGEWAY__HTTP__LISTEN": f"127.0.0.1:{port}",
        "EDGEWAY__MQTT__LISTEN": f"127.0.0.1:{free_port()}",
        "EDGEWAY__STORE__DATA_DIR": str(d / "data"),
        "EDGEWAY__ENGINES__LLAMA_LOCAL__BASE_URL": f"http://127.0.0.1:{engine_port}",
        "EDGEWAY__ENGINES__LLAMA_LOCAL__HEALTH_INTERVAL_MS": "500",
        "EDGEWAY__ENGINES__LLAMA_LOCAL__PROCESS__ARGS": json.dumps(args),
        "EDGEWAY__ENGINES__LLAMA_LOCAL__PROCESS__RESTART_BACKOFF_MS": "100",
        "EDGEWAY__ENGINES__LLAMA_EMBED__BASE_URL": llama_embed,
        "EDGEWAY__ENGINES__LLAMA_EMBED__PROCESS__ENABLED": "false",
    })
    env.pop("EDGEWAY__NATS__URL", None)
    base = f"http://127.0.0.1:{port}"
    gw = Proc([str(EDGEWAY_BIN), "serve", "--config", "config/edgeway.toml"], env, d / "edgeway.log")
    try:
        wait_http(base + "/ready", 120, gw.p, d / "edgeway.log")
        first = engine_process(base)
        assert first["state"] == "ready" and first["restarts"] == 0, first
        status, body = call(base + "/v1/chat/completions", DEMO_KEY, CHAT)
        assert status == 200, body
        assert "<|im_end|>" not in body["choices"][0]["message"]["content"]

        os.kill(first["pid"], signal.SIGKILL)
        # The model's only instance is down until the restart: its calls are
        # refused (503 MODEL_UNAVAILABLE, retry_after_ms), then answered.
        deadline = time.monotonic() + 120
        while True:
            status, body = call(base + "/v1/chat/completions", DEMO_KEY, CHAT)
            if status == 200:
                break
            assert status == 503 and body["error"]["code"] == "MODEL_UNAVAILABLE", body
            assert time.monotonic() < deadline, "no answer after the restart"
            time.sleep(0.1)
        after = engine_process(base)
        assert after["state"] == "ready" and after["restarts"] == 1, after
        assert after["pid"] != first["pid"] and not alive(first["pid"])
    finally:
        gw.stop()
    assert gw.p.returncode == 0
    assert not alive(after["pid"]), "edgeway's stop left llama-server running"
