"""The Responses API (`client.responses.create`, streamed and not) with the
official openai SDK, unchanged, against edgeway in front of the real
llama.cpp engine. The demo model is tiny: these check plumbing, not answers."""
import openai
import pytest
from openai import OpenAI

from conftest import DEMO_KEY, OPS_KEY


def client(edgeway, key=DEMO_KEY):
    return OpenAI(base_url=edgeway.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_responses_create(edgeway):
    r = client(edgeway).responses.create(
        model="general-chat", instructions="Answer in one short sentence.",
        input="What is the sea?", max_output_tokens=16, temperature=0)
    assert r.object == "response"
    assert r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message"
    assert isinstance(r.output_text, str) and r.output_text
    assert 0 < r.usage.output_tokens <= 16
    assert r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    edge = r.model_extra["edge"]
    assert edge["status"] == "SUCCEEDED"
    assert r.id == "resp_" + edge["task_id"]
    edgeway.wait_task_state(edge["task_id"], "SUCCEEDED")


def test_responses_message_items(edgeway):
    r = client(edgeway).responses.create(
        model="general-chat", max_output_tokens=8,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}])
    assert r.output_text


def test_responses_stream(edgeway):
    stream = client(edgeway).responses.create(
        model="general-chat", input="Write one short sentence about the sea.", max_output_tokens=12, stream=True)
    events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert done and done[0].text == text
    final = events[-1].response
    assert final.output_text == text
    assert 0 < final.usage.output_tokens <= 12


def test_responses_stream_helper_accumulates(edgeway):
    with client(edgeway).responses.stream(
            model="general-chat", input="Say hello.", max_output_tokens=8) as stream:
        events = list(stream)
        # The SDK keeps a final response only for `response.completed`; a
        # tiny model often stops at the token limit (`response.incomplete`,
        # as OpenAI sends it too).
        if events[-1].type == "response.completed":
            final = stream.get_final_response()
        else:
            assert events[-1].type == "response.incomplete"
            final = events[-1].response
    assert final.output_text
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text


def test_responses_previous_response_id_continues_the_conversation(edgeway):
    """A stored response continued twice: the engine is given the earlier
    input and output each time (its prompt grows by at least both), and an
    unknown or unstored one is not found."""
    c = client(edgeway)
    first = c.responses.create(model="general-chat", input="Name a colour.", max_output_tokens=8, store=True)
    second = c.responses.create(model="general-chat", input="And another one, please.", max_output_tokens=8,
                                previous_response_id=first.id, store=True)
    assert second.previous_response_id == first.id
    assert second.output_text
    alone = c.responses.create(model="general-chat", input="And another one, please.", max_output_tokens=8)
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.input_tokens \
        + first.usage.output_tokens - 4, (first.usage, second.usage, alone.usage)
    third = c.responses.create(model="general-chat", input="Thanks.", max_output_tokens=8,
                               previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    for missing in ["resp_x", alone.id]:
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(model="general-chat", input="hi", previous_response_id=missing)
        assert e.value.body["code"] == "INVALID_REQUEST"
        assert "previous_response_id" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client(edgeway, OPS_KEY).responses.create(model="general-chat", input="hi", previous_response_id=first.id)


def test_responses_retrieve_and_delete(edgeway):
    """`store=True`: the SDK's retrieve gives back the object create
    returned; another application gets 404; delete forgets it."""
    c = client(edgeway)
    r = c.responses.create(model="general-chat", input="Say hi.", max_output_tokens=8, store=True)
    assert r.store is True
    again = c.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    assert again.output_text == r.output_text and again.usage == r.usage
    with pytest.raises(openai.NotFoundError):
        client(edgeway, OPS_KEY).responses.retrieve(r.id)
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    # Not stored: not retrievable.
    gone = c.responses.create(model="general-chat", input="Say hi.", max_output_tokens=8, store=False)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(gone.id)
