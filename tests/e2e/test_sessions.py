"""Sessions with the official openai SDK (the session named with
`extra_body={"session_id": …}`) against edgeway in front of the real
llama.cpp engine: two turns, and the second turn's prompt holds the first
(the engine's own prompt token count grows by at least the first turn's
answer, and the session counts four messages). A session of another user
is refused SESSION_NOT_FOUND before anything runs. The model is tiny:
these check plumbing, not answers."""
import json
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from conftest import DEMO_KEY

QUESTION = "Name a colour."


def client(edgeway):
    return OpenAI(base_url=edgeway.url + "/v1", api_key=DEMO_KEY, max_retries=0, timeout=120)


def api(edgeway, method, path, user=None, body=None):
    req = urllib.request.Request(edgeway.url + path, method=method,
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Authorization", f"Bearer {DEMO_KEY}")
    req.add_header("Content-Type", "application/json")
    if user:
        req.add_header("x-user-id", user)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def ask(edgeway, session_id, user):
    return client(edgeway).chat.completions.create(
        model="general-chat", messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0,
        user=user, extra_body={"session_id": session_id})


def test_a_second_turn_carries_the_first(edgeway):
    status, s = api(edgeway, "POST", "/v1/sessions", user="e2e-alice", body={"metadata": {"case": "e2e"}})
    assert status == 201, s
    first = ask(edgeway, s["id"], "e2e-alice")
    assert first.model_extra["edge"]["status"] == "SUCCEEDED"
    assert first.model_extra["edge"]["session_id"] == s["id"]
    second = ask(edgeway, s["id"], "e2e-alice")
    assert second.model_extra["edge"]["status"] == "SUCCEEDED"
    # The same question again, now after the first turn: the engine counted
    # the first question and its answer in the prompt.
    assert second.usage.prompt_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens, \
        (first.usage, second.usage)
    status, view = api(edgeway, "GET", f"/v1/sessions/{s['id']}", user="e2e-alice")
    assert status == 200, view
    assert view["message_count"] == 4 and view["tokens"] > 0, view

    # Another user of the same application does not see it.
    with pytest.raises(openai.NotFoundError) as e:
        ask(edgeway, s["id"], "e2e-bob")
    assert e.value.body["code"] == "SESSION_NOT_FOUND"
    status, _ = api(edgeway, "DELETE", f"/v1/sessions/{s['id']}", user="e2e-alice")
    assert status == 200
    status, gone = api(edgeway, "GET", f"/v1/sessions/{s['id']}", user="e2e-alice")
    assert (status, gone["error"]["code"]) == (404, "SESSION_NOT_FOUND")
