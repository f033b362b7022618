"""The shared scheduler against the real llama.cpp engine (2 slots):
priorities, cancelling queued and running work, each timeout, idempotency
across a restart, and recovery after kill -9."""
import json
import os
import time
import urllib.error
import urllib.request

import pytest

from conftest import DEMO_KEY, EDGEWAY_BIN, NO_ENGINE_PROCESSES, OPS_KEY, Proc, busy_slots, free_port, wait_http

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def call(method, url, key=DEMO_KEY, body=None, timeout=120):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def submit(base, key=DEMO_KEY, **fields):
    body = {"model": "general-chat", "messages": PROMPT, "max_tokens": 16, **fields}
    status, v = call("POST", base + "/v1/tasks", key, body)
    assert status == 202, v
    return v["task_id"]


def task(base, task_id, key=DEMO_KEY):
    return call("GET", f"{base}/v1/tasks/{task_id}", key)[1]


def wait_status(base, task_id, *want, timeout=60.0, key=DEMO_KEY):
    deadline = time.monotonic() + timeout
    while True:
        t = task(base, task_id, key)
        if t["status"] in want or time.monotonic() > deadline:
            return t
        time.sleep(0.05)


def at(t, state):
    return next((x["at_ms"] for x in t["transitions"] if x["state"] == state), None)


def idle(llama, timeout=30.0):
    """Waits until no slot has been busy for half a second. (A request that
    timed out before its first token may reach a slot just after edgeway
    hung up; llama-server then notices the closed connection at its first
    write, up to a second or two later.)"""
    deadline = time.monotonic() + timeout
    quiet_since = None
    while time.monotonic() < deadline:
        if busy_slots(llama):
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= 0.5:
            return
        time.sleep(0.02)
    raise AssertionError(f"llama-server slots still busy after {timeout}s")


def test_p0_overtakes_a_queue_of_p4_work(edgeway, llama):
    idle(llama)
    base = edgeway.url
    blockers = [submit(base, priority="P4", max_tokens=24) for _ in range(2)]
    for b in blockers:
        wait_status(base, b, "STREAMING")
    backlog = [submit(base, priority="P4", max_tokens=8) for _ in range(4)]
    alarm = submit(base, OPS_KEY, priority="P0", max_tokens=8)
    assert task(base, alarm).get("error", {}).get("code") == "INVALID_REQUEST", "other applications do not see it"
    a = wait_status(base, alarm, "SUCCEEDED", key=OPS_KEY)
    assert a["status"] == "SUCCEEDED", a
    started = at(a, "DISPATCHING")
    for b in backlog:
        t = task(base, b)
        d = at(t, "DISPATCHING")
        assert d is None or d >= started, f"P4 task {b} started before the P0 alarm"
    for t in blockers + backlog:
        call("DELETE", f"{base}/v1/tasks/{t}")
        wait_status(base, t, "CANCELLED", "SUCCEEDED")
    idle(llama)


def test_cancel_a_queued_and_a_running_task(edgeway, llama):
    idle(llama)
    base = edgeway.url
    running = [submit(base, max_tokens=2000) for _ in range(2)]
    for r in running:
        wait_status(base, r, "STREAMING")
    queued = submit(base, max_tokens=8)
    assert task(base, queued)["status"] == "QUEUED"
    assert call("DELETE", f"{base}/v1/tasks/{queued}")[0] == 202
    q = wait_status(base, queued, "CANCELLED")
    assert [x["state"] for x in q["transitions"]] == ["RECEIVED", "VALIDATING", "QUEUED", "CANCELLED"]
    assert busy_slots(llama) == 2
    assert call("DELETE", f"{base}/v1/tasks/{running[0]}")[0] == 202
    assert wait_status(base, running[0], "CANCELLED")["error_code"] == "REQUEST_CANCELLED"
    deadline = time.monotonic() + 10
    while busy_slots(llama) != 1:
        assert time.monotonic() < deadline, "the cancelled task's slot is still busy"
        time.sleep(0.01)
    call("DELETE", f"{base}/v1/tasks/{running[1]}")
    idle(llama)


@pytest.mark.parametrize("timeouts,code,busy", [
    ({"queue_ms": 200}, "QUEUE_TIMEOUT", True),
    ({"first_token_ms": 1}, "FIRST_TOKEN_TIMEOUT", False),
    ({"idle_ms": 1}, "IDLE_TIMEOUT", False),
    ({"inference_ms": 400}, "INFERENCE_TIMEOUT", False),
    ({"total_ms": 400}, "TOTAL_TIMEOUT", False),
])
def test_each_timeout(edgeway, llama, timeouts, code, busy):
    idle(llama)
    base = edgeway.url
    blockers = [submit(base, max_tokens=2000) for _ in range(2)] if busy else []
    for b in blockers:
        wait_status(base, b, "STREAMING")
    body = {"model": "general-chat", "messages": PROMPT, "max_tokens": 500, "timeouts": timeouts}
    status, v = call("POST", base + "/v1/chat/completions", DEMO_KEY, body)
    assert v["error"]["code"] == code, v
    assert status in (503, 504)
    assert v["edge"]["status"] == "TIMED_OUT"
    for b in blockers:
        call("DELETE", f"{base}/v1/tasks/{b}")
    idle(llama)


def start_own(llama, llama_embed, workdir, data, port):
    env = dict(os.environ)
    env.update({
        "EDGEWAY__HTTP__LISTEN": f"127.0.0.1:{port}",
        "EDGEWAY__STORE__DATA_DIR": str(data),
        "EDGEWAY__ENGINES__LLAMA_LOCAL__BASE_URL": llama,
        # /ready waits for every model of the config, embeddings included.
        "EDGEWAY__ENGINES__LLAMA_EMBED__BASE_URL": llama_embed,
        "EDGEWAY__ENGINES__LLAMA_LOCAL__HEALTH_INTERVAL_MS": "500",
        **NO_ENGINE_PROCESSES,
    })
    # Its own broker port; no NATS.
    env["EDGEWAY__MQTT__LISTEN"] = f"127.0.0.1:{free_port()}"
    env.pop("EDGEWAY__NATS__URL", None)
    log = workdir / f"edgeway-own-{time.monotonic_ns()}.log"
    p = Proc([str(EDGEWAY_BIN), "serve", "--config", "config/edgeway.toml"], env, log)
    wait_http(f"http://127.0.0.1:{port}/ready", 60, p.p, log)
    return p


def test_idempotency_across_restart_and_recovery_after_kill_9(llama, llama_embed, workdir):
    idle(llama)
    data = workdir / "own-data"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    p = start_own(llama, llama_embed, workdir, data, port)
    try:
        first = call("POST", base + "/v1/chat/completions", DEMO_KEY, {
            "model": "general-chat", "messages": PROMPT, "max_tokens": 8, "idempotency_key": "e2e-key-1"})[1]
        assert first["edge"]["status"] == "SUCCEEDED"
        running = [submit(base, max_tokens=2000) for _ in range(2)]
        for r in running:
            wait_status(base, r, "STREAMING")
        keyed = submit(base, max_tokens=8, idempotency_key="e2e-key-2")
        plain = submit(base, max_tokens=8)
        assert task(base, plain)["status"] == "QUEUED"
        p.p.kill()  # SIGKILL: no shutdown, no goodbye
        p.p.wait()
    finally:
        p.stop()
    idle(llama)  # llama-server notices the dropped connections
    p = start_own(llama, llama_embed, workdir, data, port)
    try:
        for r in running:
            t = task(base, r)
            assert t["status"] == "FAILED", t
            assert t["transitions"][-1]["reason"] == "gateway restarted while the task was STREAMING"
        assert task(base, plain)["status"] == "FAILED"
        k = wait_status(base, keyed, "SUCCEEDED")
        assert k["status"] == "SUCCEEDED", k
        again = call("POST", base + "/v1/chat/completions", DEMO_KEY, {
            "model": "general-chat", "messages": PROMPT, "max_tokens": 8, "idempotency_key": "e2e-key-1"})[1]
        assert again["edge"]["task_id"] == first["edge"]["task_id"]
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    finally:
        p.stop()
