"""Embeddings with the official openai Python SDK, unchanged, against edgeway
in front of a real llama-server started with --embeddings (the `llama_embed`
fixture, config/edgeway.toml's model `embed`). The demo model is tiny: the
tests check the plumbing (shape, count, encodings, usage, the record), not
what the vectors mean."""
import base64
import json
import math
import struct
import urllib.request

import openai
import pytest
from openai import OpenAI

from conftest import DEMO_KEY


def client(edgeway):
    return OpenAI(base_url=edgeway.url + "/v1", api_key=DEMO_KEY, max_retries=0, timeout=120)


def engine_dimension(llama_embed) -> int:
    """The model's embedding size, as the engine itself reports it."""
    with urllib.request.urlopen(llama_embed + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["meta"]["n_embd"]


def test_two_inputs_give_two_vectors_of_the_models_dimension(edgeway, llama_embed):
    dim = engine_dimension(llama_embed)
    r = client(edgeway).embeddings.create(
        model="embed", input=["The sea is calm tonight.", "A second, different sentence."],
        encoding_format="float")
    assert r.object == "list"
    assert r.model == "embed"
    assert [d.index for d in r.data] == [0, 1]
    assert all(d.object == "embedding" and len(d.embedding) == dim for d in r.data)
    assert all(math.isfinite(x) for d in r.data for x in d.embedding)
    assert r.data[0].embedding != r.data[1].embedding
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens
    edge = r.model_extra["edge"]
    assert edge["status"] == "SUCCEEDED"
    assert edge["usage"]["input_tokens"] == r.usage.prompt_tokens
    assert edge["usage"].get("estimated") is None, "llama.cpp reports usage itself"
    state, code, states = edgeway.wait_task_state(edge["task_id"], "SUCCEEDED")
    assert states == ["RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"]


def test_base64_decodes_to_the_same_floats(edgeway):
    c = client(edgeway)
    text = "Lighthouses guide ships."
    floats = c.embeddings.create(model="embed", input=text, encoding_format="float").data[0].embedding
    # The SDK asks for base64 itself when no format is given, and decodes it.
    default = c.embeddings.create(model="embed", input=text).data[0].embedding
    raw = c.embeddings.with_raw_response.create(model="embed", input=text, encoding_format="base64")
    b64 = json.loads(raw.text)["data"][0]["embedding"]
    assert isinstance(b64, str)
    data = base64.b64decode(b64)
    decoded = list(struct.unpack(f"<{len(data) // 4}f", data))
    assert len(decoded) == len(floats)
    # Deterministic engine, and float32 both ways: the same numbers.
    assert max(abs(a - b) for a, b in zip(decoded, floats)) < 1e-6
    assert max(abs(a - b) for a, b in zip(default, floats)) < 1e-6


def test_a_chat_model_refuses_embeddings_by_name(edgeway):
    with pytest.raises(openai.BadRequestError) as e:
        client(edgeway).embeddings.create(model="general-chat", input="x", encoding_format="float")
    assert e.value.body["code"] == "INVALID_REQUEST"
    assert "general-chat" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client(edgeway).embeddings.create(model="embed", input="x", dimensions=64, encoding_format="float")
    assert "'embed' does not support 'dimensions'" in e.value.body["message"]


def test_a_long_list_is_split_into_calls_and_answers_as_one_by_one(edgeway):
    """150 inputs: more than config/edgeway.toml's `max_batch_inputs` (32), so
    edgeway sends the engine five calls within the one task; the answer is
    the same as 150 requests of one input each (order, vectors, usage)."""
    c = client(edgeway)
    texts = [f"Sentence number {i} about {'boats' if i % 2 else 'trees'}." for i in range(150)]
    r = c.embeddings.create(model="embed", input=texts, encoding_format="float")
    assert [d.index for d in r.data] == list(range(150))
    singles = [c.embeddings.create(model="embed", input=t, encoding_format="float") for t in texts]
    for i, (d, s) in enumerate(zip(r.data, singles)):
        one = s.data[0].embedding
        assert len(d.embedding) == len(one)
        # The same numbers up to float rounding (a batch may sum in another order).
        dot = sum(a * b for a, b in zip(d.embedding, one))
        norm = math.sqrt(sum(a * a for a in d.embedding) * sum(b * b for b in one))
        assert dot / norm > 0.9999, f"input {i}"
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    edge = r.model_extra["edge"]
    assert edge["route"]["attempts"] == 1
    state, _, _ = edgeway.wait_task_state(edge["task_id"], "SUCCEEDED")
    assert state == "SUCCEEDED"
