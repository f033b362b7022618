"""Tool calling with the official openai Python SDK, unchanged: against
edgeway in front of a fake engine that makes the calls a test asks for
(scripts/faults/fake_engine.py; the demo model is too small to call tools
on purpose), and a plumbing check against the real llama-server (started
with its default --jinja), asserting the shape, never the content."""
import json
import os
import sys

import openai
import pytest
from openai import OpenAI

from conftest import DEMO_KEY, EDGEWAY_BIN, NO_ENGINE_PROCESSES, OPS_KEY, ROOT, Proc, free_port, wait_http

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather at a place",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
ARGS = '{"city": "Oslo", "days": 3}'


def ask(calls):
    """A user message that has the fake engine make `calls` ([name, args])."""
    return [{"role": "user", "content": "What is the weather? TOOL_CALLS=" + json.dumps(calls)}]


class FakeEdgeway:
    def __init__(self, url, last_request):
        self.url = url
        self.last_request = last_request

    def seen(self):
        with open(self.last_request) as f:
            return json.load(f)


@pytest.fixture(scope="module")
def fake_edgeway(workdir):
    """edgeway (config/edgeway.toml) with its engine replaced by the fake,
    the demo application limited to get_weather and ping, ping high-risk."""
    assert EDGEWAY_BIN.exists(), f"{EDGEWAY_BIN} missing: cargo build"
    d = workdir / "tools"
    d.mkdir(exist_ok=True)
    engine_port = free_port()
    last = d / "last-request.json"
    engine = Proc([sys.executable, str(ROOT / "scripts/faults/fake_engine.py"), "--port", str(engine_port),
                   "--log", str(d / "engine-requests.log"), "--last-request", str(last), "--delay-ms", "5"],
                  dict(os.environ), d / "fake-engine.log")
    port = free_port()
    env = dict(os.environ)
    env.update({
        "EDGEWAY__HTTP__LISTEN": f"127.0.0.1:{port}",
        "EDGEWAY__MQTT__LISTEN": f"127.0.0.1:{free_port()}",
        "EDGEWAY__STORE__DATA_DIR": str(d / "data"),
        "EDGEWAY__ENGINES__LLAMA_LOCAL__BASE_URL": f"http://127.0.0.1:{engine_port}",
        "EDGEWAY__ENGINES__LLAMA_LOCAL__HEALTH_INTERVAL_MS": "200",
        # /ready waits for every model of the config: the embedding model's
        # engine is the fake too (these tests never ask it for embeddings).
        "EDGEWAY__ENGINES__LLAMA_EMBED__BASE_URL": f"http://127.0.0.1:{engine_port}",
        "EDGEWAY__APPLICATIONS__DEMO__ALLOWED_TOOLS": '["get_weather", "ping"]',
        "EDGEWAY__APPLICATIONS__DEMO__HIGH_RISK_TOOLS": '["ping"]',
        **NO_ENGINE_PROCESSES,
    })
    gw = Proc([str(EDGEWAY_BIN), "serve", "--config", "config/edgeway.toml"], env, d / "edgeway.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", 60, gw.p, d / "edgeway.log")
        yield FakeEdgeway(f"http://127.0.0.1:{port}", last)
    finally:
        gw.stop()
        engine.stop()


def client(url, key=DEMO_KEY):
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_non_streamed_tool_call(fake_edgeway):
    r = client(fake_edgeway.url).chat.completions.create(
        model="general-chat", messages=ask([["get_weather", ARGS]]), tools=[WEATHER, PING], tool_choice="auto")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 3}
    edge = r.model_extra["edge"]
    assert edge["tool_calls_valid"] is True
    assert edge["tool_calls"][0]["id"] == call.id
    seen = fake_edgeway.seen()
    assert seen["tools"] == [WEATHER, PING] and seen["tool_choice"] == "auto"


def test_streamed_tool_call_accumulates_in_the_sdk(fake_edgeway):
    c = client(fake_edgeway.url)
    calls = [["get_weather", ARGS], ["ping", "{}"]]
    # The SDK's own accumulation of streamed tool-call deltas.
    with c.chat.completions.stream(model="general-chat", messages=ask(calls), tools=[WEATHER, PING]) as s:
        final = s.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    got = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    assert got == [tuple(x) for x in calls]
    # The same stream read chunk by chunk: arguments arrive in pieces.
    chunks = list(c.chat.completions.create(model="general-chat", messages=ask(calls), tools=[WEATHER, PING],
                                            stream=True))
    pieces = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
    assert len(pieces) > 4
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].function.arguments == ""
    args = "".join(p.function.arguments or "" for p in pieces if p.index == 0)
    assert json.loads(args) == {"city": "Oslo", "days": 3}
    edge = chunks[-1].model_extra["edge"]
    assert edge["tool_calls_valid"] is True
    # ping is high-risk for this application.
    assert [t.get("requires_confirmation", False) for t in edge["tool_calls"]] == [False, True]


def test_tool_result_turn_reaches_the_engine(fake_edgeway):
    turn = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp_c": 4}'},
    ]
    r = client(fake_edgeway.url).chat.completions.create(model="general-chat", messages=turn, tools=[WEATHER],
                                                        max_tokens=4)
    assert r.choices[0].message.content
    assert fake_edgeway.seen()["messages"] == turn


def test_schema_violation_is_marked_invalid(fake_edgeway):
    r = client(fake_edgeway.url).chat.completions.create(
        model="general-chat", messages=ask([["get_weather", '{"city": 5}']]), tools=[WEATHER])
    # Still given to the client, marked.
    assert r.choices[0].message.tool_calls[0].function.arguments == '{"city": 5}'
    edge = r.model_extra["edge"]
    assert edge["tool_calls_valid"] is False
    assert edge["tool_calls"][0]["valid"] is False
    assert edge["tool_calls"][0]["error"] == "schema_mismatch"


def test_forbidden_tool_is_refused(fake_edgeway):
    launch = {"type": "function", "function": {"name": "launch_rocket"}}
    with pytest.raises(openai.PermissionDeniedError) as e:
        client(fake_edgeway.url).chat.completions.create(model="general-chat", messages=ask([]),
                                                         tools=[WEATHER, launch])
    assert e.value.body["code"] == "PERMISSION_DENIED"
    assert "launch_rocket" in e.value.body["message"]
    # The ops application has no list.
    r = client(fake_edgeway.url, OPS_KEY).chat.completions.create(
        model="general-chat", messages=ask([["launch_rocket", "{}"]]), tools=[WEATHER, launch])
    assert r.choices[0].message.tool_calls[0].function.name == "launch_rocket"


def test_real_engine_takes_tools(edgeway):
    """Plumbing only: the tiny base model rarely calls a tool, so either
    answer shape passes; what matters is that llama-server accepted the
    tools and edgeway answered in OpenAI's form."""
    r = client(edgeway.url).chat.completions.create(
        model="general-chat", messages=[{"role": "user", "content": "Weather in Oslo? Use the tool."}],
        tools=[WEATHER], max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    edge = r.model_extra["edge"]
    assert edge["status"] == "SUCCEEDED"
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert isinstance(choice.message.tool_calls[0].function.arguments, str)
        assert isinstance(edge["tool_calls_valid"], bool)
    else:
        assert isinstance(choice.message.content, str)
