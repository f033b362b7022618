"""The WebSocket channel (/v1/ws) with a real WebSocket client library
(`websockets`) against edgeway in front of the real llama.cpp engine: a
streamed request, cancel, and resume after a dropped socket. Plumbing,
not answer quality."""
import json
import uuid

from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from conftest import DEMO_KEY

import pytest


def ws_url(edgeway):
    return edgeway.url.replace("http://", "ws://") + "/v1/ws"


def open_ws(edgeway):
    return connect(ws_url(edgeway), additional_headers={"Authorization": f"Bearer {DEMO_KEY}"}, open_timeout=10)


def request(rid, max_tokens=12, **extra):
    return json.dumps({
        "type": "request", "request_id": rid, "model": "general-chat", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Write one short sentence about the sea."}], **extra})


def until_end(ws, rid, timeout=120):
    evs = []
    while True:
        v = json.loads(ws.recv(timeout=timeout))
        if v.get("request_id") == rid:
            evs.append(v)
            if v["type"] in ("done", "error"):
                return evs


def test_ws_stream(edgeway):
    rid = "ws-" + uuid.uuid4().hex[:8]
    with open_ws(edgeway) as ws:
        ws.send(request(rid))
        evs = until_end(ws, rid)
    assert evs[0]["type"] == "accepted"
    assert [e["seq"] for e in evs] == list(range(len(evs)))
    assert "".join(e["text"] for e in evs if e["type"] == "delta")
    done = evs[-1]
    assert done["type"] == "done", evs[-1]
    assert done["result"]["status"] == "SUCCEEDED"
    assert 0 < done["result"]["usage"]["output_tokens"] <= 12
    edgeway.wait_task_state(done["result"]["task_id"], "SUCCEEDED")


def test_ws_cancel(edgeway):
    rid = "ws-" + uuid.uuid4().hex[:8]
    with open_ws(edgeway) as ws:
        ws.send(request(rid, max_tokens=400))
        task_id = json.loads(ws.recv(timeout=30))["task_id"]
        ws.send(json.dumps({"type": "cancel", "request_id": rid}))
        evs = until_end(ws, rid)
    assert evs[-1]["type"] == "error" and evs[-1]["code"] == "REQUEST_CANCELLED", evs[-1]
    edgeway.wait_task_state(task_id, "CANCELLED")


def test_ws_resume_after_a_dropped_socket(edgeway):
    rid = "ws-" + uuid.uuid4().hex[:8]
    with open_ws(edgeway) as ws:
        ws.send(request(rid, max_tokens=24, on_disconnect="continue"))
        first = [json.loads(ws.recv(timeout=60))]
    # The socket is closed; the task keeps running.
    with open_ws(edgeway) as ws:
        ws.send(json.dumps({"type": "resume", "request_id": rid, "from_seq": 1}))
        rest = until_end(ws, rid)
    assert [e["seq"] for e in rest] == list(range(1, 1 + len(rest)))
    assert rest[-1]["type"] == "done", rest[-1]
    assert rest[-1]["result"]["task_id"] == first[0]["task_id"]


def test_ws_needs_a_key(edgeway):
    with pytest.raises(InvalidStatus) as e:
        connect(ws_url(edgeway), open_timeout=10)
    assert e.value.response.status_code == 401
    # Browsers: the key as a subprotocol, next to "edgeway".
    with connect(ws_url(edgeway), subprotocols=["edgeway", f"bearer.{DEMO_KEY}"], open_timeout=10) as ws:
        assert ws.subprotocol == "edgeway"
        ws.send("not json")
        e = json.loads(ws.recv(timeout=10))
        assert e["type"] == "error" and e["code"] == "INVALID_REQUEST"
