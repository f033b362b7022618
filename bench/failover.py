#!/usr/bin/env python3
"""Routing benchmarks against real llama-server processes (Gemma 3 270M)
and the release edgeway binary. Prints Markdown and writes it, with the raw
samples as JSON, to bench/results/ (not committed).

Failover (default): two llama-servers behind one logical model, a steady
load of streamed requests, and repeated `kill -9` of one engine (the two
take turns). Per kill:
  - new:       kill -> end of the first successful request sent after the
               kill (a prober sends short requests back to back from the
               moment of the kill; until the dead engine's breaker opens
               or a health check marks it down, routing may send one to
               it, and it is retried on the other: `attempts` 2);
  - new TTFT:  kill -> first token of that request;
  - in flight: kill -> end of the first call of the load sent before the
               kill, with no token before it, that succeeded (none in a
               round: "-"), and the same for such calls that were retried
               after an attempt on the killed engine;
  - no kill:   the prober's call just before the kill, for comparison;
then the killed engine is started again on its port and the round waits
until edgeway routes to it again (its breaker CLOSED in /ready: the
cool-down, then one trial call of the load that succeeds on it).

Preemption (--preemption): one llama-server, max_concurrency 2,
reserved_realtime_slots = 0. P0 time to first token idle, then under a
saturating P4 backlog of detached tasks (POST /v1/tasks), then under a
backlog of streamed P4 chat calls.

    $EDGEWAY_CACHE/venv/bin/python bench/failover.py --kills 10 [--clients 1]
    $EDGEWAY_CACHE/venv/bin/python bench/failover.py --preemption --samples 10

Needs `cargo build --release --bin edgeway` first (or --edgeway-bin) and
llama-server + the model under $EDGEWAY_CACHE (scripts/setup-deps.sh).
Stdlib and httpx only.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGEWAY_CACHE", Path.home() / ".cache" / "edgeway"))
LLAMA_BIN = CACHE / "bin" / "llama-server"
MODEL = CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
DEMO_KEY = "sk-edgeway-demo"  # priorities P1-P4
OPS_KEY = "sk-edgeway-ops"  # P0-P4
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
# The failover load's prompt with --long-prompt: some 450 tokens, so a call spends a while in
# prefill (on the engine, no token yet) as well as generating.
LONG_PROMPT = [{"role": "user", "content": "The lighthouse keeper wrote in his log every night about the ships, "
                "the weather and the gulls. " * 22 + "Tell me the story of his last night there."}]

APPS = """\
[applications.demo]
tenant = "demo"
api_key_sha256 = ["8c3a625c4e78630afa8fcb625fac7823bbd6589aba01957c3eb8afc8ff83bd1b"]
max_priority = "P1"
default_priority = "P2"
[applications.ops]
tenant = "demo"
api_key_sha256 = ["f8774f8bd241508434c3a5ffd8c869c2afad898211c5007971c23c38d4e8db7f"]
max_priority = "P0"
default_priority = "P1"
admin = true
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, p):
    """Nearest-rank percentile; None for no samples."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))]


def ms(x):
    return "-" if x is None else f"{x * 1000:.0f}"


def wait_http(url, timeout, proc, log):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited; log:\n{Path(log).read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout}s")


class Llama:
    def __init__(self, work, name, threads):
        self.work, self.name, self.threads = work, name, threads
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.starts = 0

    def start(self):
        self.starts += 1
        self.log = self.work / f"llama-{self.name}-{self.starts}.log"
        self.proc = subprocess.Popen(
            [str(LLAMA_BIN), "-m", str(MODEL), "--alias", "gemma-3-270m", "--host", "127.0.0.1",
             "--port", str(self.port), "--parallel", "2", "--ctx-size", "4096",
             "--threads", str(self.threads), "--slots", "--no-webui"],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        wait_http(self.url + "/health", 180, self.proc, self.log)

    def kill9(self):
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def engine(name, url, health_ms):
    return f"""[engines.{name}]
type = "openai"
base_url = "{url}"
model = "gemma-3-270m"
max_concurrency = 2
reserved_realtime_slots = 0
health_path = "/health"
health_interval_ms = {health_ms}
"""


class Edgeway:
    def __init__(self, binary, work, engines, instances, extra=""):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cfg = work / "edgeway.toml"
        cfg.write_text(f"""node_id = "bench"
[http]
listen = "127.0.0.1:{port}"
[store]
data_dir = "{work / 'data'}"
[log]
format = "json"
level = "warn"
[mqtt]
listen = "127.0.0.1:{free_port()}"
{APPS}{engines}
[models.general-chat]
instances = {json.dumps(instances)}
context_tokens = 2048
max_output_tokens = 512
queue_capacity = 256
{extra}""")
        self.log = work / "edgeway.log"
        self.proc = subprocess.Popen([str(binary), "serve", "--config", str(cfg)],
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, cwd=work)
        wait_http(self.url + "/ready", 60, self.proc, self.log)

    def ready(self):
        # The details need an admin key on the business port.
        return httpx.get(self.url + "/ready", timeout=5, headers={"Authorization": f"Bearer {OPS_KEY}"}).json()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def stream(client, base, key, max_tokens, priority=None, messages=PROMPT):
    """One streamed chat call: dict with t0, ttft, end (monotonic seconds),
    tokens, error, route."""
    body = {"model": "general-chat", "messages": messages, "max_tokens": max_tokens, "stream": True}
    if priority:
        body["priority"] = priority
    r = {"t0": time.monotonic(), "ttft": None, "end": None, "tokens": 0, "error": None, "route": None}
    try:
        with client.stream("POST", base + "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                v = json.loads(resp.read())
                r["error"], r["route"] = v.get("error", v), (v.get("edge") or {}).get("route")
            else:
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    v = json.loads(line[6:])
                    if "error" in v:
                        r["error"], r["route"] = v["error"], (v.get("edge") or {}).get("route")
                    elif "edge" in v:
                        r["route"] = v["edge"].get("route")
                    elif any(c.get("delta", {}).get("content") for c in v.get("choices", [])):
                        if r["ttft"] is None:
                            r["ttft"] = time.monotonic()
                        r["tokens"] += 1
    except httpx.HTTPError as e:
        r["error"] = {"transport": repr(e)}
    r["end"] = time.monotonic()
    return r


class Load:
    """`clients` threads streaming one call after another until stopped."""

    def __init__(self, base, clients, max_tokens, key=DEMO_KEY, priority=None, messages=PROMPT):
        self.base, self.max_tokens, self.key, self.priority = base, max_tokens, key, priority
        self.messages = messages
        self.stop_ev, self.done, self.lock = threading.Event(), [], threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def run(self):
        with httpx.Client(timeout=60) as c:
            while not self.stop_ev.is_set():
                r = stream(c, self.base, self.key, self.max_tokens, self.priority, self.messages)
                with self.lock:
                    self.done.append(r)

    def results(self):
        with self.lock:
            return list(self.done)

    def stop(self):
        self.stop_ev.set()
        for t in self.threads:
            t.join(90)


def machine_line(shares):
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    return (f"Machine: {os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}; "
            f"load average at start {load}. {shares}")


def breaker(ew, name):
    try:
        r = ew.ready()
    except (httpx.HTTPError, ValueError):
        return None
    return next((i for i in r["instances"] if i["name"] == name), None)


def failover(args, work):
    llamas = [Llama(work, n, args.threads) for n in ("a", "b")]
    for l in llamas:
        l.start()
    engines = "".join(engine(f"llama-{l.name}", l.url, args.health_ms) for l in llamas)
    ew = Edgeway(args.edgeway_bin, work, engines, ["llama-a", "llama-b"],
                 f"[routing.breaker]\nconsecutive_failures = 2\ncooldown_ms = {args.cooldown_ms}\n")
    rounds = []
    load = Load(ew.url, args.clients, args.max_tokens, messages=LONG_PROMPT if args.long_prompt else PROMPT)
    try:
        for k in range(args.kills):
            victim = llamas[k % 2]
            name = f"llama-{victim.name}"
            # The prober's call with both engines up, for comparison.
            with httpx.Client(timeout=60) as c:
                base = stream(c, ew.url, DEMO_KEY, 8)
            # Kill while the victim is generating for some client.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s = httpx.get(victim.url + "/slots", timeout=5).json()
                if any(x.get("is_processing") for x in s):
                    break
                time.sleep(0.01)
            killed = time.monotonic()
            victim.kill9()
            first = None
            with httpx.Client(timeout=60) as c:
                while time.monotonic() - killed < 30:
                    r = stream(c, ew.url, DEMO_KEY, 8)
                    if not r["error"]:
                        first = r
                        break
            time.sleep(1.0)  # let the calls in flight at the kill end
            after = [r for r in load.results() if r["end"] > killed]
            in_flight = [r for r in after if r["t0"] < killed]
            # Sent before the kill, no token before it, answered after it.
            unstarted = [r for r in in_flight if not r["error"] and (r["ttft"] is None or r["ttft"] > killed)]
            moved = [r for r in unstarted if r["route"] and r["route"]["attempts"] >= 2
                     and any(h.get("instance") == name for h in r["route"]["hops"])]
            rnd = {
                "victim": name,
                "baseline": base["end"] - base["t0"] if not base["error"] else None,
                "new": first and first["end"] - killed,
                "new_ttft": first and first["ttft"] and first["ttft"] - killed,
                "new_attempts": first and first["route"] and first["route"]["attempts"],
                "in_flight": min((r["end"] - killed for r in unstarted), default=None),
                "retried_in_flight": min((r["end"] - killed for r in moved), default=None),
                "partial_errors": sum(1 for r in in_flight if r["error"] and r["error"].get("partial")),
                "other_errors": sum(1 for r in after if r["error"] and not r["error"].get("partial")),
                "other_error_messages": sorted({r["error"].get("message", str(r["error"]))
                                                for r in after if r["error"] and not r["error"].get("partial")}),
                "retried_ok": len(moved),
            }
            victim.start()
            t = time.monotonic()
            while (breaker(ew, name) or {}).get("breaker") != "CLOSED" or not breaker(ew, name)["up"]:
                assert time.monotonic() - t < 60, f"{name} not back in rotation"
                time.sleep(0.05)
            rnd["back_after_restart"] = time.monotonic() - t
            rounds.append(rnd)
            print(f"kill {k + 1}/{args.kills} {name}: new {ms(rnd['new'])} ms (attempts {rnd['new_attempts']}), "
                  f"in flight {ms(rnd['in_flight'])} ms, partial {rnd['partial_errors']}, "
                  f"other errors {rnd['other_errors']} {rnd['other_error_messages']}", flush=True)
            time.sleep(1.0)
    finally:
        load.stop()
        ew.stop()
        for l in llamas:
            l.stop()
    rows = [("no kill: the same short request, both engines up", [r["baseline"] for r in rounds]),
            ("kill → first new request answered (end)", [r["new"] for r in rounds]),
            ("kill → first token of that request", [r["new_ttft"] for r in rounds]),
            ("kill → first call in flight without a token answered", [r["in_flight"] for r in rounds]),
            ("... of those, one retried after an attempt on the killed engine",
             [r["retried_in_flight"] for r in rounds]),
            ("restarted engine answers /health → its breaker CLOSED", [r["back_after_restart"] for r in rounds])]
    md = ["| measure | n | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    for label, xs in rows:
        n = sum(1 for x in xs if x is not None)
        md.append(f"| {label} | {n}/{len(xs)} | {ms(pct(xs, 50))} | {ms(pct(xs, 99))} | "
                  f"{ms(max((x for x in xs if x is not None), default=None))} |")
    md.append("")
    md.append(f"Calls in flight at the kills: {sum(r['partial_errors'] for r in rounds)} ended with a partial "
              f"error, {sum(r['retried_ok'] for r in rounds)} were answered by the other instance after an "
              f"attempt on the killed one, {sum(r['other_errors'] for r in rounds)} other errors "
              f"({sorted({m for r in rounds for m in r['other_error_messages']})}); first new request's "
              f"attempts: {[r['new_attempts'] for r in rounds]}.")
    return "Failover: kill -9 of one of two llama-servers", "\n".join(md), rounds


def preemption(args, work):
    l = Llama(work, "one", args.threads)
    l.start()
    ew = Edgeway(args.edgeway_bin, work, engine("llama-local", l.url, 2000), ["llama-local"])
    c = httpx.Client(timeout=120)
    phases, errors = {}, []

    def busy():
        return sum(1 for s in httpx.get(l.url + "/slots", timeout=5).json() if s.get("is_processing"))

    def idle():
        t = time.monotonic()
        while busy():
            assert time.monotonic() - t < 60, "llama-server still busy"
            time.sleep(0.05)

    def p0_samples():
        out = []
        for _ in range(args.samples):
            time.sleep(args.gap_ms / 1000)
            r = stream(c, ew.url, OPS_KEY, 8, "P0")
            if r["error"]:  # e.g. QUEUE_TIMEOUT: reported, not measured
                errors.append(r["error"].get("code", str(r["error"])))
                out.append(None)
            else:
                out.append(r["ttft"] - r["t0"])
        return out

    try:
        stream(c, ew.url, OPS_KEY, 8, "P0")  # warm-up
        idle()
        phases["idle"] = p0_samples()

        # Detached P4 tasks: two running, more waiting, topped up all along.
        submitted, stop = [], threading.Event()

        def feeder():
            with httpx.Client(timeout=30) as fc:
                while not stop.is_set():
                    q = ew.ready()["queues"][0]["waiting"]
                    for _ in range(max(0, args.backlog - q)):
                        v = fc.post(ew.url + "/v1/tasks", headers={"Authorization": f"Bearer {DEMO_KEY}"}, json={
                            "model": "general-chat", "messages": PROMPT, "max_tokens": args.p4_tokens,
                            "priority": "P4"}).json()
                        submitted.append(v["task_id"])
                    time.sleep(0.05)
        f = threading.Thread(target=feeder, daemon=True)
        f.start()
        t = time.monotonic()
        while busy() < 2:
            assert time.monotonic() - t < 30
            time.sleep(0.05)
        phases["detached P4 backlog"] = p0_samples()
        stop.set()
        f.join()
        for tid in submitted:
            c.delete(f"{ew.url}/v1/tasks/{tid}", headers={"Authorization": f"Bearer {DEMO_KEY}"})
        idle()

        # Streamed P4 chat calls: more callers than slots.
        load = Load(ew.url, args.backlog + 2, args.p4_tokens, DEMO_KEY, "P4")
        t = time.monotonic()
        while busy() < 2:
            assert time.monotonic() - t < 30
            time.sleep(0.05)
        phases["streamed P4 backlog"] = p0_samples()
        load.stop_ev.set()
        load.stop()
        metrics = httpx.get(ew.url + "/metrics", headers={"Authorization": f"Bearer {OPS_KEY}"}).text
        preempted = [l for l in metrics.splitlines() if l.startswith("edgeway_preemptions_total")]
    finally:
        c.close()
        ew.stop()
        l.stop()
    base = pct(phases["idle"], 50)
    md = ["| P0 TTFT | n | p50 ms | p95 ms | max ms | p50 / idle p50 | p95 / idle p95 |",
          "|---|---|---|---|---|---|---|"]
    for name, xs in phases.items():
        ok = [x for x in xs if x is not None]
        md.append(f"| {name} | {len(ok)}/{len(xs)} | {ms(pct(ok, 50))} | {ms(pct(ok, 95))} | "
                  f"{ms(max(ok, default=None))} | {pct(ok, 50) / base:.2f}× | "
                  f"{pct(ok, 95) / pct(phases['idle'], 95):.2f}× |")
    md.append("")
    md.append(f"P0 calls that failed: {errors or 'none'}.")
    md.append(f"Preemptions counted by edgeway: {preempted or 'none'}.")
    return "Preemption: P0 time to first token behind a P4 backlog", "\n".join(md), phases


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preemption", action="store_true", help="the P0-behind-P4 mode")
    ap.add_argument("--edgeway-bin", type=Path, default=TARGET / "release" / "edgeway")
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--clients", type=int, default=2,
                    help="failover: streaming clients of the steady load (more than the survivor's 2 slots "
                         "make the prober queue behind them)")
    ap.add_argument("--max-tokens", type=int, default=32, help="failover: max_tokens of the load's calls")
    ap.add_argument("--long-prompt", action="store_true",
                    help="failover: the load sends a ~450-token prompt (calls spend longer in prefill)")
    ap.add_argument("--health-ms", type=int, default=300)
    ap.add_argument("--cooldown-ms", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=None,
                    help="llama-server --threads (each; default 1 for failover's two, 2 for preemption's one)")
    ap.add_argument("--samples", type=int, default=10, help="preemption: P0 samples per phase")
    ap.add_argument("--backlog", type=int, default=4, help="preemption: P4 tasks waiting beyond the 2 slots")
    ap.add_argument("--p4-tokens", type=int, default=64, help="preemption: max_tokens of P4 work")
    ap.add_argument("--gap-ms", type=int, default=300, help="preemption: pause before each P0 sample")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, the task store)")
    args = ap.parse_args()
    if args.threads is None:
        args.threads = 2 if args.preemption else 1
    assert args.edgeway_bin.exists(), f"{args.edgeway_bin} missing: cargo build --release --bin edgeway"
    work = Path(tempfile.mkdtemp(prefix="edgeway-bench-"))
    try:
        title, table, raw = (preemption if args.preemption else failover)(args, work)
    except BaseException:
        print(f"work directory kept: {work}")
        raise
    if args.keep:
        print(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    shares = ("llama-server(s), edgeway and the load generator share these cores; "
              f"llama-server --parallel 2 --threads {args.threads}.")
    report = f"# {title}\n\n{machine_line(shares)}\n\n{table}\n"
    print("\n" + report)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = "preemption" if args.preemption else "failover"
    (out / f"{name}-{stamp}.md").write_text(report)
    (out / f"{name}-{stamp}.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                          "raw": raw}, indent=1))


if __name__ == "__main__":
    main()
