#!/usr/bin/env python3
"""Idle memory per connected MQTT device, for edgeway's embedded broker and
for Mosquitto (Debian package), in the same run.

Starts each broker on a free port, opens N idle MQTT 3.1.1 connections
(raw sockets, one CONNECT each, keep-alive 600 s), and reports the broker
process's resident memory before and after: (after - before) / N.

    python3 devices-sim/bench/connections.py --edgeway target/release/edgeway -n 1000 10000

edgeway gets a config with N registered devices (`bench-{i}` / `bench-pass-{i}`);
Mosquitto allows anonymous clients (it has no per-device topic isolation to
configure, so this is the lighter setup for it).

Where the heap goes (the RSS figures are then meaningless; Mosquitto is
skipped):

    python3 devices-sim/bench/connections.py --edgeway target/release/edgeway -n 1000 \
        --wrap 'valgrind --tool=dhat --dhat-out-file=/tmp/dhat.json'
    python3 devices-sim/bench/dhat_top.py /tmp/dhat.json --per 1000
"""
import argparse
import hashlib
import os
import resource
import selectors
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def mqtt_string(s):
    b = s.encode()
    return struct.pack("!H", len(b)) + b


def remaining_length(n):
    out = bytearray()
    while True:
        byte = n % 128
        n //= 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def connect_packet(client_id, user=None, password=None, keepalive=600):
    flags = 0x02
    payload = mqtt_string(client_id)
    if user is not None:
        flags |= 0x80 | 0x40
        payload += mqtt_string(user) + mqtt_string(password)
    var = mqtt_string("MQTT") + bytes([4, flags]) + struct.pack("!H", keepalive)
    body = var + payload
    return bytes([0x10]) + remaining_length(len(body)) + body


def wait_port(port, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("broker did not listen")


def open_connections(port, n, creds):
    """Opens n connections; returns the sockets once every CONNACK is 0."""
    sel = selectors.DefaultSelector()
    socks = []
    pending = 0
    batch = 200
    for start in range(0, n, batch):
        for i in range(start, min(n, start + batch)):
            s = socket.create_connection(("127.0.0.1", port))
            cid, user, pw = creds(i)
            s.sendall(connect_packet(cid, user, pw))
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            socks.append(s)
            pending += 1
        while pending > max(0, len(socks) - batch // 2) or (start + batch >= n and pending):
            events = sel.select(timeout=120)
            if not events:
                raise RuntimeError(f"{pending} CONNACKs missing")
            for key, _ in events:
                data = key.fileobj.recv(4)
                if len(data) < 4 or data[0] != 0x20 or data[3] != 0:
                    raise RuntimeError(f"refused or closed: {data!r}")
                sel.unregister(key.fileobj)
                pending -= 1
    return socks


def measure(name, proc, port, ns, creds):
    out = []
    time.sleep(1.0)
    for n in ns:
        base = rss_kib(proc.pid)
        socks = open_connections(port, n, creds)
        time.sleep(2.0)
        after = rss_kib(proc.pid)
        per = (after - base) * 1024 / n
        out.append((name, n, base, after, per))
        print(f"{name:10} {n:6} connections: RSS {base / 1024:.1f} MiB -> {after / 1024:.1f} MiB, "
              f"{per / 1024:.1f} KiB per connection", flush=True)
        for s in socks:
            s.close()
        time.sleep(2.0)
    return out


def edgeway_config(workdir, port, n):
    lines = [
        'node_id = "bench"', "[http]", f'listen = "127.0.0.1:{free_port()}"',
        "[store]", f'data_dir = "{workdir}/data"', "[log]", 'level = "warn"',
        "[applications.demo]", 'tenant = "demo"', "api_key_sha256 = []",
        "[engines.e]", 'type = "openai"', 'base_url = "http://127.0.0.1:9"', 'model = "m"',
        "[models.general-chat]", 'instances = ["e"]',
        "[mqtt]", f'listen = "127.0.0.1:{port}"', f"max_connections = {n + 100}",
    ]
    for i in range(n):
        h = hashlib.sha256(f"bench-pass-{i}".encode()).hexdigest()
        lines += [f"[devices.bench-{i}]", 'tenant = "demo"', 'application = "demo"', f'password_sha256 = "{h}"']
    path = Path(workdir) / "edgeway.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--edgeway", default=str(ROOT / "target" / "release" / "edgeway"))
    ap.add_argument("--mosquitto", default="mosquitto")
    ap.add_argument("--wrap", default="",
                    help="command line to run edgeway under (valgrind --tool=dhat ...); skips Mosquitto")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(args.n) + 1000
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    results = []
    with tempfile.TemporaryDirectory(prefix="edgeway-bench-mqtt-") as wd:
        port = free_port()
        cfg = edgeway_config(wd, port, max(args.n))
        proc = subprocess.Popen(args.wrap.split() + [args.edgeway, "serve", "--config", str(cfg)],
                                stdout=subprocess.DEVNULL, stderr=open(Path(wd) / "edgeway.log", "wb"))
        try:
            wait_port(port, proc)
            results += measure("edgeway", proc, port, args.n,
                               lambda i: (f"bench-{i}", f"bench-{i}", f"bench-pass-{i}"))
        finally:
            proc.terminate()
            proc.wait(600 if args.wrap else 10)
        if args.wrap:
            return print_results(results)
        port = free_port()
        conf = Path(wd) / "mosquitto.conf"
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_connections -1\n"
                        "persistence false\nlog_type error\n")
        proc = subprocess.Popen([args.mosquitto, "-c", str(conf)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            wait_port(port, proc)
            results += measure("mosquitto", proc, port, args.n, lambda i: (f"bench-{i}", None, None))
        finally:
            proc.terminate()
            proc.wait(10)
    print_results(results)


def print_results(results):
    print("\n| broker | connections | RSS before | RSS after | per connection |")
    print("|---|---|---|---|---|")
    for name, n, base, after, per in results:
        print(f"| {name} | {n} | {base / 1024:.1f} MiB | {after / 1024:.1f} MiB | {per / 1024:.1f} KiB |")


if __name__ == "__main__":
    sys.exit(main())
