#!/usr/bin/env python3
"""Fault run (a): `kill -9` of edgeway under concurrent mixed tasks.

N tasks (default 200) over HTTP, MQTT and NATS, half of the HTTP and NATS
ones with an idempotency key (a device's request id always is one), on one
counting fake engine that can run 32 at a time, so that at the kill some
tasks stream and the rest wait. edgeway is killed with SIGKILL mid-load and
started again on the same store.

Acceptance (exit 1 otherwise): after the restart every task in the store
reaches exactly one terminal state (within 60 s), every call a client saw
acknowledged has its task in the store, and the engine ran no request
twice (its own log of the nonce each request carries).

    $EDGEWAY_CACHE/venv/bin/python scripts/faults/kill9.py [--tasks 200] [--kill-after 2.0]
"""
import argparse
import asyncio
import collections
import sys
import time

import harness as h


async def load(run, n, devices, results):
    import nats
    nc = await nats.connect(run.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    loop = asyncio.get_running_loop()
    devs = [h.Device(run, d, loop) for d in devices]
    jobs = []
    async with h.httpx.AsyncClient(timeout=60, limits=h.httpx.Limits(max_connections=400)) as client:
        for i in range(n):
            rid = f"k9-{i:04d}"
            keyed = i % 2 == 0
            body = h.chat_body("model-a", rid, request_id=rid)
            kind = ("http", "mqtt", "nats")[i % 3]
            if kind == "http":
                coro = h.http_task(client, run.url, body, idem_key=f"key-{rid}" if keyed else None, timeout=30)
            elif kind == "mqtt":
                coro = h.mqtt_task(devs[i % len(devs)], rid, body, timeout=30)
            else:
                if keyed:
                    body["idempotency_key"] = f"key-{rid}"
                coro = h.nats_task(nc, body, timeout=30)
            jobs.append((rid, kind, keyed or kind == "mqtt", asyncio.ensure_future(coro)))
        done = await asyncio.gather(*(j[3] for j in jobs))
    for (rid, kind, keyed, _), r in zip(jobs, done):
        results[rid] = dict(r, kind=kind, keyed=keyed)
    for d in devs:
        d.close()
    await nc.close()


async def main_async(args):
    devices = [f"dev-{i:02d}" for i in range(10)]
    with h.Run("kill9") as run:
        run.start_nats()
        run.start_engine("a", "fake-a", tokens=40, delay_ms=50)
        cfg = run.write_config(devices=devices).read_text().replace("max_concurrency = 64", "max_concurrency = 32")
        (run.dir / "edgeway.toml").write_text(cfg)
        config = run.dir / "edgeway.toml"
        run.start_edgeway(config)
        results = {}
        loader = asyncio.ensure_future(load(run, args.tasks, devices, results))
        await asyncio.sleep(args.kill_after)
        before_kill = len(run.engine_requests("a"))
        run.kill_edgeway()
        killed_at = time.monotonic()
        run.start_edgeway(config)
        restart_s = time.monotonic() - killed_at
        await loader
        # Every task terminal, within 60 s of the restart.
        def settled():
            tasks, _ = run.tasks()
            return tasks and all(st in h.TERMINAL for st, _, _ in tasks.values())
        await asyncio.get_running_loop().run_in_executor(None, h.wait_for, settled, 60, 0.5)
        tasks, trans = run.tasks()
        ran = collections.Counter(run.engine_requests("a"))

    by_rid = collections.defaultdict(list)
    for tid, (st, code, rid) in tasks.items():
        by_rid[rid].append((tid, st, code))
    not_terminal = [t for t, (st, _, _) in tasks.items() if st not in h.TERMINAL]
    terminal_twice = [t for t, states in trans.items() if sum(s in h.TERMINAL for s in states) != 1]
    acked = [rid for rid, r in results.items() if r["acked"]]
    lost = [rid for rid in acked if rid not in by_rid]
    twice = {n: c for n, c in ran.items() if c > 1 and n != "-"}
    ends = collections.Counter(f"{r['kind']}:{r['end']}" for r in results.values())
    states = collections.Counter(st for st, _, _ in tasks.values())
    figures = {
        "command": f"scripts/faults/kill9.py --tasks {args.tasks} --kill-after {args.kill_after}",
        "tasks sent": f"{len(results)} ({sum(r['keyed'] for r in results.values())} with a key)",
        "engine requests before the kill / in all": f"{before_kill} / {sum(ran.values())}",
        "restart to /health": f"{restart_s:.2f} s",
        "client outcomes": dict(sorted(ends.items())),
        "store states after recovery": dict(sorted(states.items())),
        "acknowledged calls": len(acked),
        "acknowledged but missing from the store": f"{len(lost)} {lost[:5]}",
        "tasks not terminal": f"{len(not_terminal)} {not_terminal[:5]}",
        "tasks with != 1 terminal transition": f"{len(terminal_twice)} {terminal_twice[:5]}",
        "requests the engine ran more than once": f"{len(twice)} {dict(list(twice.items())[:5])}",
    }
    checks = {
        "every task terminal": not not_terminal,
        "exactly one terminal transition per task": not terminal_twice,
        "every acknowledged call has its task in the store": not lost,
        "no request ran twice at the engine": not twice,
    }
    return h.verdict("kill -9 under mixed load", checks, figures)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=200)
    p.add_argument("--kill-after", type=float, default=2.0, help="seconds after the load starts")
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
