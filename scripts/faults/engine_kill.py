#!/usr/bin/env python3
"""Fault run (b): an engine killed mid-stream.

Two fake engines, each the only instance of its model (model-a, model-b).
N streams on each (default 4, 100 tokens at 50 ms); once every stream has
its first delta, engine a gets SIGKILL.

Acceptance (exit 1 otherwise): every model-a stream ends with an error
event carrying a public error code within 1 s of the kill; every model-b
stream completes with all its text; a new model-b request right after the
kill completes.

    $EDGEWAY_CACHE/venv/bin/python scripts/faults/engine_kill.py [--streams 4]
"""
import argparse
import asyncio
import signal
import sys
import time

import harness as h

TOKENS = 100


async def follow(client, url, model, rid, firsts, ends):
    r = await h.http_task(client, url, h.chat_body(model, rid), timeout=60)
    ends[rid] = (time.monotonic(), r)
    return r


async def main_async(args):
    with h.Run("engine-kill") as run:
        run.start_engine("a", "fake-a", tokens=TOKENS, delay_ms=50)
        run.start_engine("b", "fake-b", tokens=TOKENS, delay_ms=50)
        run.start_edgeway(run.write_config())
        ends, firsts = {}, {}
        async with h.httpx.AsyncClient(timeout=60) as client:
            jobs = [asyncio.ensure_future(follow(client, run.url, f"model-{m}", f"{m}-{i}", firsts, ends))
                    for m in "ab" for i in range(args.streams)]
            # Wait until both engines stream every request.
            ok = await asyncio.get_running_loop().run_in_executor(None, h.wait_for, lambda: all(
                len(run.engine_requests(e)) >= args.streams for e in "ab"), 20)
            await asyncio.sleep(0.5)  # a few deltas each
            engine_a = run.engines["a"][0]
            engine_a.p.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            after = await h.http_task(client, run.url, h.chat_body("model-b", "b-after", max_tokens=10), timeout=30)
            await asyncio.gather(*jobs)
    a_ends = {rid: (t - killed, r) for rid, (t, r) in ends.items() if rid.startswith("a-")}
    b_ends = {rid: r for rid, (t, r) in ends.items() if rid.startswith("b-")}
    worst = max((dt for dt, _ in a_ends.values()), default=float("inf"))
    figures = {
        "command": f"scripts/faults/engine_kill.py --streams {args.streams}",
        "model-a streams: seconds from the kill to their end, and the code": {
            rid: f"{dt:.3f} s {r['end']} {r['code']}" for rid, (dt, r) in sorted(a_ends.items())},
        "model-b streams": {rid: f"{r['end']} {len(r['text'].split())} tokens" for rid, r in sorted(b_ends.items())},
        "model-b request after the kill": f"{after['end']} {after['code'] or ''}",
    }
    checks = {
        "both engines were streaming at the kill": ok,
        "every model-a stream ended with an error code": all(
            r["end"] == "error" and r["code"] for _, r in a_ends.values()),
        "within 1 s of the kill": worst <= 1.0,
        "every model-b stream completed": all(
            r["end"] == "done" and len(r["text"].split()) == TOKENS for r in b_ends.values()),
        "a model-b request after the kill completed": after["end"] == "done",
    }
    return h.verdict("engine killed mid-stream", checks, figures)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=4)
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
