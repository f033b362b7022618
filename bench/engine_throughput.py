#!/usr/bin/env python3
"""Output tokens per second through edgeway against straight to the engine,
with the real llama-server at saturation (issue 18 "Engine throughput").

One llama-server (Gemma 3 270M, `--parallel 2`) and the release edgeway
binary in front of it (one instance, `max_concurrency = 2`). `--clients`
closed-loop clients (more than the two slots, so the engine never idles)
stream the same chat call, `--max-tokens` tokens, one after another, for
`--seconds`; a phase straight to llama-server and a phase
through edgeway alternate, `--rounds` times each, in one run, after a
warm-up of each. Output tokens per second = the content chunks received
within the phase / its length (one token each: the `chunks per token`
column checks it against the usage of the calls that ended). edgeway, llama-server and the
clients share the machine's cores, so what edgeway's own work takes from the
engine shows in the ratio.

    ~/.cache/edgeway/venv/bin/python bench/engine_throughput.py --edgeway-bin target/release/edgeway

Needs `cargo build --release --bin edgeway` (or --edgeway-bin) and
llama-server + the model under $EDGEWAY_CACHE (scripts/setup-deps.sh).
Prints Markdown and writes it, with the raw numbers, to bench/results/.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from failover import DEMO_KEY, ROOT, TARGET, Edgeway, Llama, engine  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the ships he saw."}]


def phase(url, model, key, clients, seconds, max_tokens):
    """Runs `clients` closed-loop streamed callers for `seconds`; returns
    (content chunks received in the window, calls ended in it, errors,
    elapsed, chunks per token of the calls that ended: 1.0 when each chunk
    carries one token, as the usage at the end of each call tells)."""
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    totals = {"chunks": 0, "calls": 0, "errors": 0, "call_chunks": 0, "call_tokens": 0}
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def run():
        with httpx.Client(timeout=300) as c:
            while time.monotonic() < stop:
                chunks, usage, ok = 0, None, False
                try:
                    with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
                        ok = r.status_code == 200
                        for line in r.iter_lines():
                            if time.monotonic() > stop:
                                break
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            v = json.loads(line[6:])
                            if v.get("usage"):
                                usage = v["usage"]["completion_tokens"]
                            if any((ch.get("delta") or {}).get("content") for ch in v.get("choices") or []):
                                chunks += 1
                                with lock:
                                    totals["chunks"] += 1
                except (httpx.HTTPError, ValueError) as e:
                    ok, why = False, repr(e)
                else:
                    why = f"HTTP {r.status_code}"
                with lock:
                    if not ok:
                        totals["errors"] += 1
                        print(f"{url}: call failed: {why}", file=sys.stderr)
                    elif usage is not None:
                        totals["calls"] += 1
                        totals["call_chunks"] += chunks
                        totals["call_tokens"] += usage

    t0 = time.monotonic()
    threads = [threading.Thread(target=run) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = min(time.monotonic() - t0, seconds)
    per = totals["call_chunks"] / totals["call_tokens"] if totals["call_tokens"] else 0
    return totals["chunks"], totals["calls"], totals["errors"], elapsed, per


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edgeway-bin", default=str(TARGET / "release" / "edgeway"))
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="llama-server --threads")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgeway-throughput-"))
    llama = Llama(work, "a", a.threads)
    llama.start()
    gw = None
    try:
        gw = Edgeway(a.edgeway_bin, work, engine("llama", llama.url, 1000), ["llama"])
        paths = {
            "direct": (llama.url, "gemma-3-270m", None),
            "edgeway": (gw.url, "general-chat", DEMO_KEY),
        }
        for name, (url, model, key) in paths.items():
            phase(url, model, key, a.clients, 5, a.max_tokens)  # warm-up
        rows = {name: [] for name in paths}
        for r in range(a.rounds):
            for name, (url, model, key) in paths.items():
                tokens, calls, errors, secs, per = phase(url, model, key, a.clients, a.seconds, a.max_tokens)
                rows[name].append({"tokens_per_s": tokens / secs, "calls": calls, "errors": errors,
                                   "chunks_per_token": per})
                print(f"round {r + 1} {name}: {tokens / secs:.1f} tokens/s, {calls} calls, {errors} errors",
                      file=sys.stderr)
    finally:
        if gw:
            gw.stop()
        llama.stop()
    load = os.getloadavg()
    out = [
        "# Engine throughput: llama-server at saturation, direct and through edgeway\n",
        f"{os.cpu_count()} cores, llama-server `--parallel 2 --threads {a.threads}` (Gemma 3 270M Q4_K_M), "
        f"{a.clients} closed-loop clients, streamed calls of {a.max_tokens} tokens at most, "
        f"{a.rounds} alternated rounds of {a.seconds} s per path; load average at the end {load[0]:.2f}.\n",
        "| round | direct tokens/s | edgeway tokens/s | edgeway / direct | chunks per token (direct / edgeway) | errors |",
        "|---|---|---|---|---|---|",
    ]
    for i in range(a.rounds):
        d, e = rows["direct"][i], rows["edgeway"][i]
        out.append(f"| {i + 1} | {d['tokens_per_s']:.1f} | {e['tokens_per_s']:.1f} | "
                   f"{e['tokens_per_s'] / d['tokens_per_s']:.3f} | {d['chunks_per_token']:.3f} / "
                   f"{e['chunks_per_token']:.3f} | {d['errors']} / {e['errors']} |")
    dm = statistics.mean(r["tokens_per_s"] for r in rows["direct"])
    em = statistics.mean(r["tokens_per_s"] for r in rows["edgeway"])
    out.append(f"| mean | {dm:.1f} | {em:.1f} | {em / dm:.3f} | | |")
    report = "\n".join(out) + "\n"
    print(report)
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    stem = results / f"engine-throughput-{int(time.time())}"
    stem.with_suffix(".md").write_text(report)
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(a), "rounds": rows}, indent=1))
    print(f"results written to {stem}.md")


if __name__ == "__main__":
    main()
