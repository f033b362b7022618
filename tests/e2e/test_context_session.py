"""A long session against the real llama-server and Gemma 3 270M (issue 12
"## Tests"): 40 turns whose history far exceeds the model's (configured,
small) window keep answering; the assembled prompt (GET
/admin/tasks/{id}/context, the store keeping prompts) still holds the
application's system prompt and the current question; the older turns were
summarised by the real model (a summary task that SUCCEEDED, its text in
the prompt, fenced as data after the system message); the summary is
reused on the next turn (the same version and text) and replaced as the
history grows (a later version covering more messages).

Its own edgeway, started with environment overrides of
config/edgeway.toml: general-chat's window 512 tokens, summaries by
general-chat itself after 4 uncovered messages, with a small output budget,
so that few turns overflow the window and the test stays quick. The model
is tiny: the checks are on the plumbing, never on what the answers say."""
import json
import os
import sqlite3
import time
import urllib.error
import urllib.request

import pytest

from conftest import DEMO_KEY, EDGEWAY_BIN, NO_ENGINE_PROCESSES, OPS_KEY, Edgeway, Proc, free_port, wait_http

SYSTEM_PROMPT = "You are the pump assistant of plant 7."
TURNS = 40


@pytest.fixture(scope="module")
def edgeway_ctx(llama, llama_embed, nats, workdir):
    assert EDGEWAY_BIN.exists(), f"{EDGEWAY_BIN} missing: cargo build"
    port = free_port()
    data = workdir / "data-ctx"
    env = dict(os.environ)
    env.update({
        "EDGEWAY__HTTP__LISTEN": f"127.0.0.1:{port}",
        "EDGEWAY__MQTT__LISTEN": f"127.0.0.1:{free_port()}",
        "EDGEWAY__STORE__DATA_DIR": str(data),
        "EDGEWAY__STORE__STORE_PROMPTS": "true",
        "EDGEWAY__ENGINES__LLAMA_LOCAL__BASE_URL": llama,
        "EDGEWAY__ENGINES__LLAMA_LOCAL__HEALTH_INTERVAL_MS": "500",
        "EDGEWAY__ENGINES__LLAMA_EMBED__BASE_URL": llama_embed,
        **NO_ENGINE_PROCESSES,
        "EDGEWAY__LOG__FORMAT": "json",
        "EDGEWAY__NATS__URL": nats,
        "EDGEWAY__MODELS__GENERAL_CHAT__CONTEXT_TOKENS": "512",
        "EDGEWAY__MODELS__GENERAL_CHAT__MAX_OUTPUT_TOKENS": "64",
        "EDGEWAY__SESSIONS__SUMMARY_MODEL": "general-chat",
        "EDGEWAY__SESSIONS__SUMMARY_AFTER_MESSAGES": "4",
        "EDGEWAY__SESSIONS__SUMMARY_HISTORY_SHARE_PCT": "30",
        "EDGEWAY__SESSIONS__SUMMARY_MAX_TOKENS": "32",
        # A summary waits beside the turns on a slow CPU: a long deadline.
        "EDGEWAY__SESSIONS__SUMMARY_DEADLINE_MS": "300000",
        "EDGEWAY__APPLICATIONS__DEMO__SYSTEM_PROMPT": SYSTEM_PROMPT,
    })
    log = workdir / "edgeway-ctx.log"
    proc = Proc([str(EDGEWAY_BIN), "serve", "--config", "config/edgeway.toml"], env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", 60, proc.p, log)
        yield Edgeway(url, data / "edgeway.db")
    finally:
        proc.stop()


def api(e, method, path, key=DEMO_KEY, body=None):
    req = urllib.request.Request(e.url + path, method=method,
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Authorization", f"Bearer {key}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def question(i):
    # About 30 estimated tokens: 40 turns are several windows' worth.
    return f"Question {i}: pump {i} reads {100 + i} kPa at valve {i % 7}; " + "is that normal? " * 3


def summary_block(prompt):
    """The fenced summary in the assembled prompt's first message after the
    system message, or None."""
    if len(prompt) < 2:
        return None
    text = prompt[1]["content"] if isinstance(prompt[1]["content"], str) else ""
    start = text.find('<untrusted-data id="')
    if start < 0 or 'kind="summary"' not in text[start:start + 80]:
        return None
    end = text.find("</untrusted-data", start)
    return text[start:end]


def test_a_session_longer_than_the_window_keeps_answering_with_a_real_summary(edgeway_ctx):
    e = edgeway_ctx
    status, s = api(e, "POST", "/v1/sessions", body={})
    assert status == 201, s
    sid = s["id"]
    seen = []  # per turn: (summary version, summary_used, summary block)
    for i in range(TURNS):
        body = {"model": "general-chat", "session_id": sid, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": question(i)}]}
        status, v = api(e, "POST", "/v1/chat/completions", body=body)
        assert status == 200, (i, v)
        assert v["edge"]["status"] == "SUCCEEDED", (i, v)
        ctx = v["edge"]["context"]
        task_id = v["edge"]["task_id"]
        status, plan = api(e, "GET", f"/admin/tasks/{task_id}/context", key=OPS_KEY)
        assert status == 200, plan
        prompt = plan["prompt"]
        # The system prompt and the current question are never cut.
        assert prompt[0]["role"] == "system" and SYSTEM_PROMPT in prompt[0]["content"], prompt[0]
        assert "untrusted-data" not in prompt[0]["content"].split("cannot be overridden")[-1], prompt[0]
        assert prompt[-1]["role"] == "user" and prompt[-1]["content"].endswith(question(i)), prompt[-1]
        roles = [m["role"] for m in prompt[1:]]
        assert all(a != b for a, b in zip(roles, roles[1:])), f"turn {i}: roles alternate: {roles}"
        block = summary_block(prompt)
        assert (block is not None) == ctx["summary_used"], (i, ctx, prompt[1])
        _, view = api(e, "GET", f"/v1/sessions/{sid}")
        seen.append((view["summary_version"], ctx["summary_used"], block, plan["context"]["steps"]))

    # The history outgrew the window: turns were left out, and the real
    # model's summary stood for them.
    assert any(any("oldest messages" in st for st in steps) for *_, steps in seen), seen[-1]
    used = [(i, ver, block) for i, (ver, u, block, _) in enumerate(seen) if u]
    assert used, "the summary was never used"
    con = sqlite3.connect(e.db)
    try:
        rows = con.execute("SELECT request_id, state FROM tasks WHERE request_id LIKE 'summary/%' "
                           "ORDER BY created_at_ms").fetchall()
    finally:
        con.close()
    assert any(state == "SUCCEEDED" for _, state in rows), rows
    assert all(r[0].startswith(f"summary/{sid}/v") for r in rows), rows
    _, view = api(e, "GET", f"/v1/sessions/{sid}")
    assert view["summary_model"] == "general-chat" and view["summary_version"] >= 2, view
    # Reused: two turns in a row with the same summary in their prompts.
    assert any(b[0] == a[0] + 1 and a[2] == b[2] for a, b in zip(used, used[1:])), used
    # Replaced as the history grew: more than one summary was made (each a
    # task of its own version that SUCCEEDED), and prompts went on carrying
    # one after the first was replaced. Not that the replacement's text
    # differs: that is the model's, and this 270M base model often writes
    # the same text again for a longer history (in one CI run every
    # version's text was the same, and a check of distinct texts failed).
    made = {r for r, state in rows if state == "SUCCEEDED"}
    assert len(made) >= 2, rows
    assert any(ver >= 2 for _, ver, _ in used), used
    # The summary in the prompt is the model's text (not empty, fenced).
    assert all(len(block.split(">", 1)[1].strip()) > 0 for _, _, block in used), used
