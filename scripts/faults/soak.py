#!/usr/bin/env python3
"""Fault run (f): a soak of mixed load, watching edgeway's memory and
descriptors.

For --duration seconds (default 3600) --concurrency workers (default 12)
loop over calls: HTTP streams (half with an idempotency key, one in ten
abandoned mid-stream), MQTT device requests (some with an unknown-request
cancel and a resume), NATS requests. Every --every seconds (default 10) it
samples VmRSS, and of it RssAnon (the heap), from /proc/PID/status, and the
open descriptors (/proc/PID/fd); --progress prints each sample.

What edgeway keeps by design, and when it is full at this load (~50
calls/s): ended tasks' events for replay, [scheduler] and [mqtt]
replay_retention_ms (300 s; their 64 MiB byte budgets are not reached);
the broker's in-memory request log (see BROKER_ENV: full in about 330 s
with the soak's 16 kB max_packet_bytes); SQLite's page caches (2 MB per
connection, full in the first minutes). The warm-up must cover all of them.

Acceptance (exit 1 otherwise), over the samples after the warm-up (20 % of
the run, and at least 330 s when the run is long enough for that to leave
half of it): the least-squares RSS slope, extrapolated over that window,
is below max(4 MiB, 5 % of the mean RSS); descriptors end within 10 of
where they started; at least 95 % of the calls completed.

    $EDGEWAY_CACHE/venv/bin/python scripts/faults/soak.py [--duration 3600] [--concurrency 12]
"""
import argparse
import asyncio
import collections
import json
import random
import sys
import time

import harness as h


# The broker keeps the requests of all devices in one in-memory log of 16
# segments of 4 x max_packet_bytes (src/ingress/mqtt/broker.rs), whether
# they were read or not. At the default 1 MiB that is 64 MiB of payload,
# which this load (~3 kB/s of requests) would take about five hours to fill:
# a one-hour soak could not tell that filling from a leak. The soak's
# messages are under 1 kB, so it runs with 16 kB packets: a 1 MiB log, full
# within the warm-up. What the default costs once full is in RELIABILITY.md.
BROKER_ENV = {"EDGEWAY__MQTT__MAX_PACKET_BYTES": "16384", "EDGEWAY__MQTT__MAX_REQUEST_BYTES": "16384"}


def slope(points):
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


async def worker(w, run, client, nc, devs, deadline, outcomes):
    i = 0
    while time.monotonic() < deadline:
        i += 1
        rid = f"s{w}-{i}"
        kind = (w + i) % 3
        body = h.chat_body("model-a", rid, max_tokens=10)
        if kind == 0:
            if i % 10 == 0:
                # Abandoned mid-stream: the client goes away.
                try:
                    async with client.stream("POST", run.url + "/v1/chat/completions", json=body,
                                             headers={"authorization": f"Bearer {h.DEMO_KEY}"}) as r:
                        async for _ in r.aiter_lines():
                            break
                    outcomes["http:abandoned"] += 1
                except h.httpx.HTTPError:
                    outcomes["http:broken"] += 1
                continue
            r = await h.http_task(client, run.url, body, idem_key=f"soak-{rid}" if i % 2 else None, timeout=60)
            outcomes[f"http:{r['end']}"] += 1
        elif kind == 1:
            d = devs[w % len(devs)]
            r = await h.mqtt_task(d, rid, dict(body, request_id=rid), timeout=60)
            outcomes[f"mqtt:{r['end']}"] += 1
            if i % 5 == 0:
                d.c.publish(f"ai/v1/{d.device}/cancel", json.dumps({"request_id": "unknown"}), qos=1)
                d.c.publish(f"ai/v1/{d.device}/resume", json.dumps({"request_id": rid, "from_seq": 0}), qos=1)
        else:
            r = await h.nats_task(nc, body, timeout=60)
            outcomes[f"nats:{r['end']}"] += 1
        await asyncio.sleep(random.uniform(0, 0.05))


def memory_kb(pid):
    """RssAnon and RssFile (kB): the heap is in the first; the binary's
    pages and SQLite's shared-memory index in the second."""
    m = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile", "RssShmem"):
            m[k] = int(v.split()[0])
    return m.get("RssAnon", 0), m.get("RssFile", 0) + m.get("RssShmem", 0)


async def sampler(pid, every, deadline, samples, t0, outcomes, progress):
    while True:
        anon, file_ = memory_kb(pid)
        samples.append((time.monotonic() - t0, h.rss_kb(pid), h.open_fds(pid), anon, file_))
        if progress:
            t, r, f, a, fl = samples[-1]
            print(f"{t:.0f}s rss={r} anon={a} file={fl} fds={f} calls={sum(outcomes.values())}",
                  file=sys.stderr, flush=True)
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(every, max(0.0, deadline - time.monotonic())))


async def main_async(args):
    import nats
    devices = [f"soak-{i}" for i in range(4)]
    with h.Run("soak") as run:
        run.start_nats()
        run.start_engine("a", "fake-a", tokens=10, delay_ms=20)
        run.start_edgeway(run.write_config(devices=devices), env=BROKER_ENV)
        pid = run.edgeway.p.pid
        nc = await nats.connect(run.nats_url)
        loop = asyncio.get_running_loop()
        devs = [h.Device(run, d, loop) for d in devices]
        outcomes, samples = collections.Counter(), []
        t0 = time.monotonic()
        deadline = t0 + args.duration
        async with h.httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(sampler(pid, args.every, deadline, samples, t0, outcomes, args.progress),
                                 *(worker(w, run, client, nc, devs, deadline, outcomes)
                                   for w in range(args.concurrency)))
        for d in devs:
            d.close()
        await nc.close()
    warmup = max(0.2 * args.duration, min(330.0, args.duration / 2))
    warm = [p for p in samples if p[0] >= warmup] or samples
    rss_slope = slope([(t, r) for t, r, *_ in warm])  # kB/s
    anon_slope = slope([(t, a) for t, _, _, a, _ in warm])
    window = warm[-1][0] - warm[0][0]
    growth_kb = rss_slope * window
    mean_rss = sum(r for _, r, *_ in warm) / len(warm)
    fds_start, fds_end = warm[0][2], warm[-1][2]
    total = sum(outcomes.values())
    done = sum(v for k, v in outcomes.items() if k.endswith(":done") or k.endswith(":abandoned"))
    figures = {
        "command": f"scripts/faults/soak.py --duration {args.duration} --concurrency {args.concurrency}",
        "calls": f"{total} ({total / args.duration:.1f}/s): {dict(sorted(outcomes.items()))}",
        "RSS first / after warm-up / last / max": (
            f"{samples[0][1]} / {warm[0][1]} / {samples[-1][1]} / {max(r for _, r, *_ in samples)} kB"),
        "of which anonymous (heap) first / after warm-up / last": (
            f"{samples[0][3]} / {warm[0][3]} / {samples[-1][3]} kB; slope after warm-up "
            f"{anon_slope * 3600 / 1024:.1f} MiB/hour"),
        "warm-up": f"{warmup:.0f} s",
        "RSS slope after warm-up": f"{rss_slope * 3600 / 1024:.1f} MiB/hour ({growth_kb / 1024:.2f} MiB over "
                                   f"{window:.0f} s)",
        "descriptors first / after warm-up / last / max": (
            f"{samples[0][2]} / {fds_start} / {fds_end} / {max(f for _, _, f, *_ in samples)}"),
        "samples (t s, RSS kB, fds, anonymous kB)": " ".join(f"{t:.0f}:{r}:{f}:{a}" for t, r, f, a, _ in samples),
    }
    checks = {
        "RSS flat after warm-up": growth_kb <= max(4096, 0.05 * mean_rss),
        "descriptors flat": fds_end <= fds_start + 10,
        ">= 95 % of calls completed": total > 0 and done >= 0.95 * total,
    }
    return h.verdict("soak", checks, figures)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=3600)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--every", type=float, default=10)
    p.add_argument("--progress", action="store_true", help="print each sample to stderr as it is taken")
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
