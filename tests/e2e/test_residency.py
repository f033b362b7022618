"""Model residency (FR-4.7) with the real llama-server in router mode: one
server, a models dir with the Gemma 3 270M file under four names
(demo-a … demo-d), --no-models-autoload so that only edgeway loads, and
edgeway's own config. What is loaded is read from llama-server's own
GET /models, never from edgeway.

- `always` (demo-a) is loaded before /ready answers 200;
- `on_demand` (demo-b, demo-c) loads on first request and unloads after
  idle_unload_s; with a budget for two models on the server (demo-a plus
  one), a request for demo-c unloads the least recently used demo-b first;
- `forbidden` (demo-d) is never loaded and its requests are refused
  POLICY_BLOCKED (there is no other step for it here).
"""
import hashlib
import json
import os
import time
import urllib.error
import urllib.request

import pytest

from conftest import DEMO_KEY, EDGEWAY_BIN, LLAMA_BIN, MODEL, OPS_KEY, ROOT, Proc, free_port, wait_http

IDLE_S = 3


def router_status(llama_url: str) -> dict:
    with urllib.request.urlopen(llama_url + "/models", timeout=5) as r:
        return {m["id"]: m["status"]["value"] for m in json.load(r)["data"]}


def wait_status(llama_url: str, model: str, want: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router_status(llama_url).get(model) == want:
            return True
        time.sleep(0.1)
    return router_status(llama_url).get(model) == want


def call(url: str, key: str, model: str):
    body = json.dumps({"model": model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Say hello"}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def ready(url: str):
    req = urllib.request.Request(url + "/ready", headers={"Authorization": f"Bearer {OPS_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
    except OSError:
        return None, None


def metrics(url: str) -> str:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {OPS_KEY}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def config(llama_url: str, port: int, data) -> str:
    demo = hashlib.sha256(DEMO_KEY.encode()).hexdigest()
    ops = hashlib.sha256(OPS_KEY.encode()).hexdigest()
    engines = ""
    for name in ["a", "b", "c", "d"]:
        engines += f"""
[engines.router-{name}]
type = "openai"
base_url = "{llama_url}"
model = "demo-{name}"
model_api = "llama-router"
memory_budget_mb = 600
health_interval_ms = 300
"""
    models = ""
    for name, keys in [("a", 'residency = "always"'),
                       ("b", f'residency = "on_demand"\nidle_unload_s = {IDLE_S}'),
                       ("c", f'residency = "on_demand"\nidle_unload_s = {IDLE_S}'),
                       ("d", 'residency = "forbidden"')]:
        models += f"""
[models.chat-{name}]
instances = ["router-{name}"]
context_tokens = 512
max_output_tokens = 64
weights_mb = 242
{keys}
"""
    return f"""
node_id = "e2e-residency"
[http]
listen = "127.0.0.1:{port}"
[store]
data_dir = "{data}"
[applications.demo]
tenant = "demo"
api_key_sha256 = ["{demo}"]
[applications.ops]
tenant = "demo"
api_key_sha256 = ["{ops}"]
admin = true
{engines}
{models}
"""


@pytest.fixture(scope="module")
def router_llama(workdir):
    """llama-server in router mode over demo-a … demo-d (links to the demo
    model file); loads nothing by itself."""
    assert LLAMA_BIN.exists(), f"{LLAMA_BIN} missing: run scripts/setup-deps.sh"
    models = workdir / "router-models"
    models.mkdir(exist_ok=True)
    for name in "abcd":
        link = models / f"demo-{name}.gguf"
        if not link.exists():
            link.symlink_to(MODEL)
    port = free_port()
    log = workdir / "llama-router.log"
    proc = Proc([str(LLAMA_BIN), "--models-dir", str(models), "--models-max", "0", "--no-models-autoload",
                 "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "512", "--threads", "1",
                 "--no-webui", "--chat-template-file", str(ROOT / "config" / "templates" / "gemma.jinja")],
                dict(os.environ), log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/models", 60, proc.p, log)
        assert set(router_status(url).values()) == {"unloaded"}
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def edgeway_res(router_llama, workdir):
    assert EDGEWAY_BIN.exists(), f"{EDGEWAY_BIN} missing: cargo build"
    port = free_port()
    cfg = workdir / "residency.toml"
    cfg.write_text(config(router_llama, port, workdir / "data-residency"))
    log = workdir / "edgeway-residency.log"
    proc = Proc([str(EDGEWAY_BIN), "serve", "--config", str(cfg)], dict(os.environ, EDGEWAY__LOG__FORMAT="json"), log)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        proc.stop()


def test_always_is_loaded_before_ready_answers_200(router_llama, edgeway_res):
    deadline = time.monotonic() + 120
    seen_503 = False
    while True:
        status, body = ready(edgeway_res)
        if status == 200:
            # The first 200: the engine itself says demo-a is loaded.
            assert router_status(router_llama)["demo-a"] == "loaded", body
            break
        if status == 503:
            seen_503 = True
        assert time.monotonic() < deadline, f"never ready: {body}"
        time.sleep(0.05)
    # (503 is seen unless the load beat edgeway's first answer.)
    print(f"saw 503 before the load: {seen_503}")
    st = router_status(router_llama)
    assert st["demo-b"] == st["demo-c"] == st["demo-d"] == "unloaded", st


def test_on_demand_loads_on_first_request_and_unloads_after_idle(router_llama, edgeway_res):
    assert router_status(router_llama)["demo-b"] == "unloaded"
    status, body = call(edgeway_res, DEMO_KEY, "chat-b")
    assert status == 200, body
    assert router_status(router_llama)["demo-b"] == "loaded"
    assert wait_status(router_llama, "demo-b", "unloaded", IDLE_S + 10), router_status(router_llama)
    # edgeway counts the unload once its call returns (it polls the list
    # until the model is gone, as llama-server unloads in the background).
    deadline = time.monotonic() + 5
    while metric(metrics(edgeway_res), "edgeway_model_unloads_total", model="chat-b", reason="idle") < 1:
        assert time.monotonic() < deadline, metrics(edgeway_res)
        time.sleep(0.05)


def test_a_budget_for_one_more_model_unloads_the_least_recently_used_first(router_llama, edgeway_res):
    status, body = call(edgeway_res, DEMO_KEY, "chat-b")
    assert status == 200, body
    status, body = call(edgeway_res, DEMO_KEY, "chat-c")
    assert status == 200, body
    st = router_status(router_llama)
    # demo-a (always) + one on-demand model fit the 600 MiB budget.
    assert st["demo-a"] == "loaded" and st["demo-c"] == "loaded" and st["demo-b"] == "unloaded", st
    m = metrics(edgeway_res)
    # (the unload for memory is done before demo-c's load starts)
    assert metric(m, "edgeway_model_unloads_total", model="chat-b", reason="memory") == 1, m
    assert wait_status(router_llama, "demo-c", "unloaded", IDLE_S + 10)


def test_forbidden_is_never_loaded_and_refused_without_another_step(router_llama, edgeway_res):
    status, body = call(edgeway_res, DEMO_KEY, "chat-d")
    assert status == 403, body
    assert body["error"]["code"] == "POLICY_BLOCKED", body
    assert router_status(router_llama)["demo-d"] == "unloaded"
    with urllib.request.urlopen(urllib.request.Request(
            edgeway_res + "/v1/models", headers={"Authorization": f"Bearer {DEMO_KEY}"}), timeout=5) as r:
        listed = {m["id"]: (m["residency"], m["state"]) for m in json.load(r)["data"]}
    assert listed["chat-d"] == ("forbidden", "forbidden"), listed
    assert listed["chat-a"] == ("always", "loaded"), listed
