"""The official openai Python SDK, unchanged, against edgeway in front of
the real llama.cpp engine."""
import openai
import pytest
from openai import OpenAI

from conftest import DEMO_KEY, OPS_KEY

MSG = [{"role": "user", "content": "Write one short sentence about the sea."}]


def client(edgeway, key=DEMO_KEY):
    return OpenAI(base_url=edgeway.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_non_streaming_completion(edgeway):
    c = client(edgeway)
    r = c.chat.completions.create(model="general-chat", messages=MSG, max_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    assert r.model == "general-chat"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.prompt_tokens > 0
    edge = r.model_extra["edge"]
    assert edge["status"] == "SUCCEEDED"
    assert edge["actual_model"] == "llama-local/gemma-3-270m"
    assert edge["usage"]["output_tokens"] == r.usage.completion_tokens
    assert edge["usage"].get("estimated") is None, "llama.cpp reports usage itself"
    state, code, states = edgeway.wait_task_state(edge["task_id"], "SUCCEEDED")
    assert states == ["RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"]


def test_streaming_completion(edgeway):
    c = client(edgeway)
    stream = c.chat.completions.create(
        model="general-chat", messages=MSG, max_tokens=12, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    last = chunks[-1]
    assert last.usage is not None and 0 < last.usage.completion_tokens <= 12
    assert last.model_extra["edge"]["status"] == "SUCCEEDED"


def test_raw_response_headers_carry_ids(edgeway):
    c = client(edgeway)
    raw = c.chat.completions.with_raw_response.create(
        model="fast-chat", messages=MSG, max_tokens=4, extra_body={"request_id": "e2e-ids-1"})
    assert raw.headers["x-request-id"] == "e2e-ids-1"
    assert raw.headers["x-task-id"] == raw.parse().model_extra["edge"]["task_id"]


def test_models_list(edgeway):
    ids = sorted(m.id for m in client(edgeway).models.list())
    assert ids == ["embed", "fast-chat", "general-chat"]


def test_bad_key_is_authentication_error(edgeway):
    with pytest.raises(openai.AuthenticationError) as e:
        client(edgeway, key="sk-nope").chat.completions.create(model="general-chat", messages=MSG, max_tokens=4)
    assert e.value.body["code"] == "AUTH_FAILED"


def test_forbidden_priority_is_permission_denied(edgeway):
    with pytest.raises(openai.PermissionDeniedError) as e:
        client(edgeway).chat.completions.create(
            model="general-chat", messages=MSG, max_tokens=4, extra_body={"priority": "P0"})
    assert e.value.body["code"] == "PERMISSION_DENIED"
    r = client(edgeway, OPS_KEY).chat.completions.create(
        model="general-chat", messages=MSG, max_tokens=4, extra_body={"priority": "P0"})
    assert r.model_extra["edge"]["status"] == "SUCCEEDED"


def test_unknown_model_and_bad_body_are_invalid_request(edgeway):
    with pytest.raises(openai.BadRequestError) as e:
        client(edgeway).chat.completions.create(model="no-such-model", messages=MSG)
    assert e.value.body["code"] == "INVALID_REQUEST"
    with pytest.raises(openai.BadRequestError) as e:
        client(edgeway).chat.completions.create(model="general-chat", messages=[])
    assert e.value.body["code"] == "INVALID_REQUEST"


def test_first_token_timeout_through_the_sdk(edgeway):
    with pytest.raises(openai.APIStatusError) as e:
        client(edgeway).chat.completions.create(
            model="general-chat", messages=MSG, max_tokens=64,
            extra_body={"timeouts": {"first_token_ms": 1}})
    assert e.value.status_code == 504
    assert e.value.body["code"] == "FIRST_TOKEN_TIMEOUT"
