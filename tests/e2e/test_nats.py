"""edgeway as a NATS service, driven by nats-py (a client the project did not
write) against the real llama.cpp engine: streamed chat on ai.v1.chat,
cancel on ai.v1.cancel, a caller that goes away, $SRV discovery, and the
lifecycle events of every task on ai.v1.events.>.

Every message edgeway sends is checked against topics/schemas."""
import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import nats as natspy

from conftest import DEMO_KEY, OPS_KEY, busy_slots

SCHEMAS = Path(__file__).resolve().parents[2] / "topics" / "schemas"
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}


def validate(name: str, v: dict) -> None:
    jsonschema.validate(v, json.loads((SCHEMAS / f"{name}.json").read_text()))


def body(request_id: str, max_tokens: int, prompt: str = "Say hello") -> bytes:
    return json.dumps({
        "model": "general-chat", "request_id": request_id, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
    }).encode()


def wait_bus(edgeway) -> None:
    """edgeway connects to NATS in the background: wait for /ready to say so.
    /ready answers 503 while anything is not ready (an engine instance held
    out of dispatch a moment after an earlier test's cancel, say); its body
    still says what the bus is doing, and only that is waited for here."""
    deadline = time.monotonic() + 30
    while True:
        try:
            # The details (nats among them) need an admin key on this port.
            req = urllib.request.Request(edgeway.url + "/ready", headers={"Authorization": f"Bearer {OPS_KEY}"})
            with urllib.request.urlopen(req, timeout=5) as r:
                ready = json.load(r)
        except urllib.error.HTTPError as e:
            assert e.code == 503, e
            ready = json.load(e)
        if ready["nats"]["state"] == "connected":
            return
        assert time.monotonic() < deadline, "edgeway never connected to NATS"
        time.sleep(0.05)


class Call:
    """A streamed call: a dedicated inbox, subscribed before the request."""

    def __init__(self, nc, sub):
        self.nc, self.sub, self.pending = nc, sub, None

    @classmethod
    async def start(cls, nc, payload: bytes, headers=AUTH):
        for _ in range(100):
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish("ai.v1.chat", payload, reply=inbox, headers=headers)
            first = await sub.next_msg(timeout=30)
            if (first.headers or {}).get("Status") == "503":  # not subscribed yet: no responders
                await sub.unsubscribe()
                await asyncio.sleep(0.05)
                continue
            call = cls(nc, sub)
            call.pending = first
            return call
        raise AssertionError("the edgeway service never answered")

    async def next(self) -> dict:
        while True:
            msg, self.pending = self.pending or await self.sub.next_msg(timeout=60), None
            kind = (msg.headers or {}).get("Edgeway-Event")
            if kind == "keepalive":
                continue
            ev = json.loads(msg.data)
            assert ev["type"] == kind
            validate(f"event-{kind}", ev)
            return ev

    async def collect(self) -> list:
        events = []
        while not events or events[-1]["type"] not in ("done", "error"):
            events.append(await self.next())
        assert [e["seq"] for e in events] == list(range(len(events))), "contiguous seq from 0"
        return events


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_streamed_chat_through_the_real_engine(edgeway, nats):
    wait_bus(edgeway)

    async def main():
        nc = await natspy.connect(nats)
        try:
            call = await Call.start(nc, body("nats-e2e-1", 16))
            events = await call.collect()
        finally:
            await nc.close()
        return events

    events = run(main())
    assert events[0]["type"] == "accepted"
    assert any(e["type"] == "delta" and e["text"] for e in events)
    done = events[-1]
    assert done["type"] == "done", done
    assert done["result"]["status"] == "SUCCEEDED"
    assert done["result"]["usage"]["output_tokens"] > 0
    assert done["result"]["actual_model"] == "llama-local/gemma-3-270m"
    state, _, _ = edgeway.wait_task_state(events[0]["task_id"], "SUCCEEDED")
    assert state == "SUCCEEDED"


def wait_slots_idle(llama) -> None:
    t0 = time.monotonic()
    while busy_slots(llama) != 0:
        assert time.monotonic() - t0 < 10, "llama-server slot still busy 10 s later"
        time.sleep(0.01)


LONG = "Tell me a very long story about a lighthouse."


def test_cancel_on_ai_v1_cancel_stops_the_engine(edgeway, nats, llama):
    wait_bus(edgeway)

    async def main():
        nc = await natspy.connect(nats)
        try:
            call = await Call.start(nc, body("nats-e2e-cancel", 2000, LONG))
            accepted = await call.next()
            for _ in range(3):
                assert (await call.next())["type"] == "delta"
            assert busy_slots(llama) == 1
            # Another application cannot cancel it.
            r = await nc.request("ai.v1.cancel", json.dumps({"request_id": "nats-e2e-cancel"}).encode(),
                                 timeout=10, headers={"Authorization": f"Bearer {OPS_KEY}"})
            assert json.loads(r.data)["code"] == "INVALID_REQUEST"
            r = await nc.request("ai.v1.cancel", json.dumps({"request_id": "nats-e2e-cancel"}).encode(),
                                 timeout=10, headers=AUTH)
            answer = json.loads(r.data)
            validate("cancel-reply", answer)
            assert answer["cancelled"] is True and answer["task_id"] == accepted["task_id"]
            while (ev := await call.next())["type"] == "delta":
                pass
            return accepted["task_id"], ev
        finally:
            await nc.close()

    task_id, end = run(main())
    assert end["type"] == "error" and end["code"] == "REQUEST_CANCELLED"
    wait_slots_idle(llama)
    state, code, _ = edgeway.wait_task_state(task_id, "CANCELLED")
    assert (state, code) == ("CANCELLED", "REQUEST_CANCELLED")


def test_a_caller_that_goes_away_frees_the_engine(edgeway, nats, llama):
    wait_bus(edgeway)

    async def main():
        nc = await natspy.connect(nats)
        try:
            call = await Call.start(nc, body("nats-e2e-gone", 2000, LONG))
            task_id = (await call.next())["task_id"]
            for _ in range(3):
                assert (await call.next())["type"] == "delta"
            assert busy_slots(llama) == 1
            await call.sub.unsubscribe()  # stops listening, keeps the connection
            return task_id
        finally:
            await nc.close()

    task_id = run(main())
    wait_slots_idle(llama)
    state, code, states = edgeway.wait_task_state(task_id, "CANCELLED")
    assert state == "CANCELLED", states


def test_service_discovery(edgeway, nats):
    wait_bus(edgeway)

    async def main():
        nc = await natspy.connect(nats)
        try:
            info = json.loads((await nc.request("$SRV.INFO.edgeway", b"", timeout=10)).data)
            ping = json.loads((await nc.request("$SRV.PING.edgeway", b"", timeout=10)).data)
            return info, ping
        finally:
            await nc.close()

    info, ping = run(main())
    assert ping["name"] == info["name"] == "edgeway"
    assert {e["subject"] for e in info["endpoints"]} == {"ai.v1.chat", "ai.v1.cancel", "ai.v1.resume"}


def test_lifecycle_events_of_an_http_task(edgeway, nats):
    wait_bus(edgeway)

    async def main():
        nc = await natspy.connect(nats)
        try:
            sub = await nc.subscribe("ai.v1.events.>")
            await nc.flush()
            req = urllib.request.Request(
                edgeway.url + "/v1/chat/completions", data=body("http-events-1", 8, "Say hello over HTTP"),
                headers={**AUTH, "Content-Type": "application/json"})
            # urllib blocks: run it beside the subscriber.
            resp = await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=60))
            task_id = resp.headers["x-task-id"]
            seen = []
            while not seen or seen[-1][1]["state"] != "SUCCEEDED":
                msg = await sub.next_msg(timeout=30)
                assert b"Say hello over HTTP" not in msg.data, "no prompt text in lifecycle events"
                ev = json.loads(msg.data)
                validate("lifecycle-event", ev)
                if ev["task_id"] == task_id:
                    seen.append((msg.subject, ev))
            return seen
        finally:
            await nc.close()

    seen = run(main())
    assert [e["state"] for _, e in seen] == [
        "RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"]
    assert all(s == f"ai.v1.events.demo.{e['state'].lower()}" for s, e in seen)
    assert all(e["ingress"] == "http" for _, e in seen)
    assert seen[-1][1]["result"]["usage"]["output_tokens"] > 0


def test_the_readme_nats_py_example_runs(edgeway, nats):
    """The README's nats-py example, as written, against this edgeway."""
    import re
    import subprocess
    import sys
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## NATS (internal services)"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "nats://127.0.0.1:4222" in code
    wait_bus(edgeway)
    out = subprocess.run([sys.executable, "-c", code.replace("nats://127.0.0.1:4222", nats)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "output_tokens" in out.stdout.splitlines()[-1], out.stdout
