#!/usr/bin/env python3
"""Fault run (d): NATS down and back.

A NATS request streams (100 tokens at 50 ms) when nats-server is stopped;
it stays down --down seconds (default 5), then starts again on the same
port.

Acceptance (exit 1 otherwise): while the bus is down, `/ready` reports it
(`nats.state` is not connected) and HTTP calls still complete; the task of
the NATS request that lost its bus ends (a terminal state in the store
within caller_timeout + 5 s) instead of running for nobody; after the
restart edgeway reconnects and a NATS request completes within 15 s.

    $EDGEWAY_CACHE/venv/bin/python scripts/faults/nats_bounce.py [--down 5]
"""
import argparse
import asyncio
import sys
import time

import harness as h


async def quiet(e):
    """nats-py logs every connection error with a traceback by default."""


async def nats_request(url, rid, tokens=None, timeout=20):
    import nats
    try:
        nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, error_cb=quiet)
    except Exception as e:  # noqa: BLE001
        return h.result("broken", type(e).__name__)
    try:
        return await h.nats_task(nc, h.chat_body("model-a", rid, request_id=rid, max_tokens=tokens), timeout)
    finally:
        try:
            await nc.close()
        except Exception:  # noqa: BLE001
            pass


async def main_async(args):
    with h.Run("nats-bounce") as run:
        run.start_nats()
        run.start_engine("a", "fake-a", tokens=100, delay_ms=50)
        run.start_edgeway(run.write_config())
        ok = await asyncio.get_running_loop().run_in_executor(
            None, h.wait_for, lambda: run.ready()[1].get("nats", {}).get("state") == "connected", 15)
        before = await nats_request(run.nats_url, "nb-before", tokens=5)
        inflight = asyncio.ensure_future(nats_request(run.nats_url, "nb-inflight", timeout=30))
        await asyncio.get_running_loop().run_in_executor(
            None, h.wait_for, lambda: "nb-inflight" in run.engine_requests("a"), 10)
        await asyncio.sleep(0.5)
        run.stop_nats()
        down_at = time.monotonic()
        await asyncio.sleep(1.0)
        state_down = run.ready()[1].get("nats", {})
        async with h.httpx.AsyncClient(timeout=30) as client:
            http_down = await h.http_task(client, run.url, h.chat_body("model-a", "nb-http", max_tokens=5))
        while_down = await nats_request(run.nats_url, "nb-down", tokens=5)
        await asyncio.sleep(max(0, args.down - (time.monotonic() - down_at)))
        run.start_nats(port=run.nats_port)
        back_at = time.monotonic()
        reconnected = await asyncio.get_running_loop().run_in_executor(
            None, h.wait_for, lambda: run.ready()[1].get("nats", {}).get("state") == "connected", 15)
        reconnect_s = time.monotonic() - back_at
        after = await nats_request(run.nats_url, "nb-after", tokens=5)
        inflight_r = await inflight

        def inflight_terminal():
            tasks, _ = run.tasks()
            return any(rid == "nb-inflight" and st in h.TERMINAL for st, _, rid in tasks.values())
        ended = await asyncio.get_running_loop().run_in_executor(None, h.wait_for, inflight_terminal, 15)
        tasks, _ = run.tasks()
        inflight_state = [(st, code) for st, code, rid in tasks.values() if rid == "nb-inflight"]
    figures = {
        "command": f"scripts/faults/nats_bounce.py --down {args.down}",
        "NATS request before": f"{before['end']} {before['code'] or ''}",
        "/ready's nats while down": state_down,
        "HTTP call while down": f"{http_down['end']} {http_down['code'] or ''}",
        "NATS client while down": f"{while_down['end']} {while_down['code'] or ''}",
        "in-flight NATS request (client / store)": f"{inflight_r['end']} {inflight_r['code'] or ''} / {inflight_state}",
        "reconnected after the restart in": f"{reconnect_s:.2f} s" if reconnected else "no (15 s)",
        "NATS request after": f"{after['end']} {after['code'] or ''}",
    }
    checks = {
        "connected at the start and a NATS request completed": ok and before["end"] == "done",
        "/ready reports the bus down": state_down.get("state") not in (None, "connected"),
        "HTTP works while the bus is down": http_down["end"] == "done",
        "the in-flight NATS task ended": ended,
        "reconnected and a NATS request completed after": reconnected and after["end"] == "done",
    }
    return h.verdict("NATS down and back", checks, figures)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--down", type=float, default=5.0)
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
