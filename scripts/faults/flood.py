#!/usr/bin/env python3
"""Fault run (e): one device floods edgeway with messages.

A raw MQTT 3.1.1 connection of device `flooder` publishes --rate messages
per second (default 10 000, QoS 0: half `cancel` of unknown requests, half
broken `req` payloads that edgeway must refuse), while three other devices
each send --requests sequential requests (5 tokens) and time their first
delta. The same is measured first without the flood.

Acceptance (exit 1 otherwise): under the flood the other devices' median
first-delta latency is within 2x its quiet value, and every one of their
requests completes.

    $EDGEWAY_CACHE/venv/bin/python scripts/faults/flood.py [--rate 10000] [--requests 20]
"""
import argparse
import asyncio
import socket
import statistics
import struct
import sys
import threading
import time

import harness as h


def frame(kind, flags, body):
    n, out = len(body), b""
    while True:
        b, n = n % 128, n // 128
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            break
    return bytes([(kind << 4) | flags]) + out + body


def s(x):
    x = x.encode() if isinstance(x, str) else x
    return struct.pack(">H", len(x)) + x


class Flooder(threading.Thread):
    """Publishes `rate` messages a second in 10 ms batches until stopped;
    counts what it managed to send."""

    def __init__(self, port, device, rate):
        super().__init__(daemon=True)
        self.rate, self.sent, self.stop = rate, 0, threading.Event()
        self.sock = socket.create_connection(("127.0.0.1", port))
        pw = h.device_password(device)
        self.sock.sendall(frame(1, 0, s("MQTT") + bytes([4, 0xC2]) + struct.pack(">H", 60) + s(device) + s(device)
                                + s(pw)))
        ack = self.sock.recv(4)
        assert ack[:2] == b"\x20\x02" and ack[3] == 0, f"flooder CONNACK {ack!r}"
        cancel = frame(3, 0, s(f"ai/v1/{device}/cancel") + b'{"request_id": "nope"}')
        broken = frame(3, 0, s(f"ai/v1/{device}/req") + b'{"request_id": "f-1", "messages": [')
        self.pair = cancel + broken
        threading.Thread(target=self.drain, daemon=True).start()

    def drain(self):
        try:
            while self.sock.recv(65536):
                pass
        except OSError:
            pass

    def run(self):
        per_batch = max(2, self.rate // 100)
        batch = self.pair * (per_batch // 2)
        next_at = time.monotonic()
        self.started = time.monotonic()
        try:
            while not self.stop.is_set():
                self.sock.sendall(batch)
                self.sent += per_batch
                next_at += 0.01
                time.sleep(max(0, next_at - time.monotonic()))
        except OSError as e:
            self.error = e
        self.ended = time.monotonic()

    def achieved(self):
        return self.sent / max(1e-9, self.ended - self.started)


async def latencies(devs, n):
    """Each device sends `n` requests one after the other; returns the
    first-delta latencies (s) and the outcomes."""
    lat, ends = [], []

    async def one_device(d, k):
        for i in range(n):
            r = await h.mqtt_task(d, f"{d.device}-{k}-{i}", h.chat_body("model-a", f"{d.device}-{k}-{i}",
                                                                         max_tokens=5), timeout=30)
            ends.append(r["end"])
            if r["first"] is not None:
                lat.append(r["first"])

    k = time.monotonic_ns()
    await asyncio.gather(*(one_device(d, k) for d in devs))
    return lat, ends


def handled(run):
    """Device messages edgeway has handled (`[edgeway_]mqtt_messages_in_total`)."""
    with run.admin_get("/metrics") as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(("mqtt_messages_in_total{", "edgeway_mqtt_messages_in_total{")))


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("inf")


async def main_async(args):
    quiet_devs = ["calm-1", "calm-2", "calm-3"]
    with h.Run("flood") as run:
        run.start_engine("a", "fake-a", tokens=5, delay_ms=10)
        run.start_edgeway(run.write_config(devices=quiet_devs + ["flooder"]))
        loop = asyncio.get_running_loop()
        devs = [h.Device(run, d, loop) for d in quiet_devs]
        await latencies(devs, 3)  # warm-up
        quiet, quiet_ends = await latencies(devs, args.requests)
        flooder = Flooder(run.mqtt_port, "flooder", args.rate)
        flooder.start()
        await asyncio.sleep(1.0)
        rss_before = h.rss_kb(run.edgeway.p.pid)
        handled_before, sent_before = handled(run), flooder.sent
        flooded, flood_ends = await latencies(devs, args.requests)
        flooder.stop.set()
        flooder.join()
        rss_after = h.rss_kb(run.edgeway.p.pid)
        # What edgeway had handled of the flood when it stopped, and after
        # it caught up (messages still in the broker's queues).
        handled_at_stop = handled(run) - handled_before
        await asyncio.sleep(2)
        handled_after = handled(run) - handled_before
        for d in devs:
            d.close()
    q50, f50 = statistics.median(quiet), statistics.median(flooded) if flooded else float("inf")
    figures = {
        "command": f"scripts/faults/flood.py --rate {args.rate} --requests {args.requests}",
        "flood rate achieved": f"{flooder.achieved():.0f} msg/s ({flooder.sent} messages)"
                               + (f", ended by {flooder.error!r}" if hasattr(flooder, "error") else ""),
        "flood messages edgeway handled while measuring / 2 s after": (
            f"{handled_at_stop:.0f} / {handled_after:.0f} (of {flooder.sent - sent_before} sent meanwhile)"),
        "quiet first delta p50 / p95": f"{q50 * 1000:.1f} / {pct(quiet, 0.95) * 1000:.1f} ms",
        "flooded first delta p50 / p95": f"{f50 * 1000:.1f} / {pct(flooded, 0.95) * 1000:.1f} ms",
        "ratio of medians": f"{f50 / q50:.2f}",
        "edgeway RSS at flood start / end": f"{rss_before} / {rss_after} kB",
        "other devices' outcomes (quiet / flooded)": (
            f"{quiet_ends.count('done')}/{len(quiet_ends)} / {flood_ends.count('done')}/{len(flood_ends)}"),
    }
    checks = {
        "the flood ran at >= 90 % of the asked rate": flooder.achieved() >= 0.9 * args.rate,
        "edgeway handled >= 90 % of the flood (else the latencies mean nothing)":
            handled_after >= 0.9 * (flooder.sent - sent_before),
        "flooded median first delta within 2x quiet": f50 <= 2 * q50,
        "every other device's request completed": flood_ends.count("done") == len(flood_ends),
    }
    return h.verdict("device flood", checks, figures)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=int, default=10_000)
    p.add_argument("--requests", type=int, default=20)
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
