#!/usr/bin/env python3
"""Fault run (c): the store's disk fills up.

edgeway's data directory is a 16 MiB tmpfs (needs root: `mount -t tmpfs`),
nearly filled by a filler file once edgeway has created its database and
set aside its reserve (`[store] reserve_bytes`, 8 MiB by default). Then N
calls (default 400, 20 at a time, a few tokens each) run; afterwards
edgeway is stopped with the disk still full, the filler removed, edgeway
started again (its recovery ends what the store left unfinished) and the
store read back.

Acceptance (the issue's; exit 1 otherwise): the store ran out of space,
edgeway said so (`/ready` is not 200, or new calls are refused with a clear
code) rather than running work unrecorded, nothing acknowledged is lost
(every call a client saw complete is SUCCEEDED in the store after the
restart), and once there is room again edgeway is ready.

    $EDGEWAY_CACHE/venv/bin/python scripts/faults/disk_full.py [--calls 400] [--headroom-kb 96]
"""
import argparse
import asyncio
import collections
import os
import subprocess
import sys
import time

import harness as h


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


async def main_async(args):
    with h.Run("disk-full") as run:
        run.data_dir.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(run.data_dir)], check=True)
        try:
            return await scenario(run, args)
        finally:
            run.stop_all()
            subprocess.run(["umount", "-l", str(run.data_dir)], check=False)


async def scenario(run, args):
    run.start_engine("a", "fake-a", tokens=3, delay_ms=5)
    config = run.write_config()
    run.start_edgeway(config)
    ready_before = run.ready()[0]
    filler = run.data_dir / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free_bytes(run.data_dir) - args.headroom_kb * 1024))
    free_at_start = free_bytes(run.data_dir)
    results = {}
    readies = collections.Counter()
    sem = asyncio.Semaphore(20)
    async with h.httpx.AsyncClient(timeout=30) as client:
        async def one(i):
            rid = f"df-{i:04d}"
            async with sem:
                results[rid] = await h.http_task(client, run.url, h.chat_body("model-a", rid, request_id=rid),
                                                 timeout=30)
                if i % 20 == 0:
                    readies[run.ready()[0]] += 1
        await asyncio.gather(*(one(i) for i in range(args.calls)))
    ready_after = run.ready()
    log = run.edgeway.log
    free_at_end = free_bytes(run.data_dir)
    t0 = time.monotonic()
    run.edgeway.stop()
    stop_s = time.monotonic() - t0
    run.procs.remove(run.edgeway)
    # Read before the restart, whose log may take the same name.
    lines = log.read_text(errors="replace").splitlines()
    filler.unlink()
    run.start_edgeway(config)
    ready_restarted = run.ready()[0]
    tasks, _ = run.tasks()
    state_of = {rid: state for state, _, rid in tasks.values()}
    ok = [rid for rid, r in results.items() if r["end"] == "done"]
    refused = collections.Counter(r["code"] for r in results.values() if r["end"] != "done")
    lost = [rid for rid in ok if state_of.get(rid) != "SUCCEEDED"]
    store_errors = [line for line in lines
                    if ('"ERROR"' in line or '"WARN"' in line) and ("store" in line.lower() or "sqlite" in line.lower()
                                                                   or "disk" in line.lower())]
    hit_full = any("full" in line for line in store_errors)
    reserve_released = any("reserve released" in line for line in lines)
    lost_at_exit = [line for line in lines if "they are lost" in line]
    said_so = ready_after[0] != 200 or any(refused)
    figures = {
        "command": f"scripts/faults/disk_full.py --calls {args.calls} --headroom-kb {args.headroom_kb}",
        "free bytes on the store's tmpfs at the start / end of the load": f"{free_at_start} / {free_at_end}",
        "/ready before the load / sampled during it / after it": (
            f"{ready_before} / {dict(readies)} / {ready_after[0]} store={ready_after[1].get('store')}"),
        "calls completed for the client": len(ok),
        "calls refused or failed (code: count)": dict(refused),
        "reserve released / writes lost at the stop (log)": f"{reserve_released} / {lost_at_exit[:1] or 'none'}",
        "stop (SIGTERM to exit) with the disk still full": f"{stop_s:.2f} s",
        "/ready after the restart with room again": ready_restarted,
        "tasks in the store afterwards": len(tasks),
        "completed calls not SUCCEEDED in the store after the restart": f"{len(lost)} (first: {lost[:3]})",
        "store warnings/errors in edgeway's log": f"{len(store_errors)}; first: {store_errors[:1]}",
    }
    checks = {
        "the store ran out of space (its log says the disk is full)": hit_full,
        "edgeway reported the failing store (/ready or a refusal)": said_so,
        "nothing acknowledged was lost": not lost,
        "ready again after a restart with room": ready_restarted == 200,
    }
    return h.verdict("store disk full", checks, figures)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--headroom-kb", type=int, default=96, help="space left free after the filler")
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
