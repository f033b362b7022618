"""Legacy text completions (`client.completions.create`) with the official
openai Python SDK against edgeway in front of the real llama-server: the
prompt goes to the engine's /v1/completions as it is. The demo model is a
base model: the tests check the protocol, not the text."""
from openai import OpenAI

from conftest import DEMO_KEY


def client(edgeway):
    return OpenAI(base_url=edgeway.url + "/v1", api_key=DEMO_KEY, max_retries=0, timeout=120)


def test_completion_whole(edgeway):
    r = client(edgeway).completions.create(model="general-chat", prompt="Once upon a time", max_tokens=8,
                                           temperature=0, seed=1)
    assert r.object == "text_completion"
    assert r.model == "general-chat"
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.choices[0].index == 0
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    edge = r.model_extra["edge"]
    assert edge["status"] == "SUCCEEDED"
    assert edge["usage"].get("estimated") is None, "llama.cpp reports usage itself"
    state, _, _ = edgeway.wait_task_state(edge["task_id"], "SUCCEEDED")
    assert state == "SUCCEEDED"


def test_completion_streamed(edgeway):
    stream = client(edgeway).completions.create(model="general-chat", prompt="The sea", max_tokens=8, stream=True,
                                                stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(ch.object == "text_completion" for ch in chunks)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    last = chunks[-1]
    assert last.usage is not None and 0 < last.usage.completion_tokens <= 8
    assert last.model_extra["edge"]["status"] == "SUCCEEDED"
