#!/usr/bin/env python3
"""Time to first token of a session's turn N+1 with and without KV-cache
slot affinity, against the real llama-server (issue 12 benchmark).

What slot affinity buys is measured at the engine, where it acts: turn N
of a session with a long shared prefix (system prompt and history) runs in
slot 0 with `cache_prompt: true`; then turn N+1 (the same prefix, turn N's
answer and a new question) goes

- `same slot`: back to slot 0, as edgeway's affinity sends it
  (`id_slot` of the last turn): only the new tokens are prefilled;
- `other slot`: to slot 1, which holds another session's prompt (what
  happens when the turn lands wherever a slot is free): the whole prompt
  is prefilled;
- `engine's pick`: with no `id_slot` (edgeway without `slot_affinity`):
  llama-server chooses by prompt similarity, which on an idle engine
  often finds slot 0 itself, and on a busy one cannot.

Each round uses a fresh prefix (a new session), so no round reuses an
earlier one's cache. edgeway's own added latency is not in these figures
(see `bench/overhead.rs`).

    python3 bench/affinity_ttft.py --server ~/.cache/edgeway/bin/llama-server \
        --model ~/.cache/edgeway/models/gemma-3-270m-q4_k_m.gguf --rounds 10 --prefix-words 1500
"""

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import time


def post(port, path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        raise RuntimeError(f"{path}: {r.status} {data[:200]!r}")
    return json.loads(data)


def ttft(port, messages, slot, max_tokens=8):
    """Seconds to the first streamed content, and the answer's text."""
    body = {"messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": True}
    if slot is not None:
        body["id_slot"] = slot
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    first = None
    text = []
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for ch in chunk.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece:
                if first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
    c.close()
    return first if first is not None else time.perf_counter() - t0, "".join(text)


WORDS = ("pump valve sensor pressure flow tank motor line shift operator alarm reading level "
         "maintenance filter inlet outlet temperature gauge report hall east west north south").split()


def prefix(rng, words):
    """A session's long shared prefix: a system prompt and a history."""
    sys_text = "You are the plant assistant. " + " ".join(rng.choice(WORDS) for _ in range(words // 2))
    history = []
    for i in range(4):
        history.append({"role": "user", "content": f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(words // 10))})
        history.append({"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(words // 40))})
    return [{"role": "system", "content": sys_text}] + history


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default=os.path.expanduser("~/.cache/edgeway/bin/llama-server"))
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/edgeway/models/gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("--port", type=int, default=18941)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prefix-words", type=int, default=1500)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    cmd = [args.server, "-m", args.model, "--port", str(args.port), "-c", str(args.ctx), "--parallel", "2",
           "-t", str(args.threads), "--no-kv-unified"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                c = http.client.HTTPConnection("127.0.0.1", args.port, timeout=1)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            sys.exit("llama-server did not become ready")
        rng = random.Random(7)
        results = {"same slot": [], "other slot": [], "engine's pick": [], "turn N (cold)": []}
        prompt_tokens = []
        for r in range(args.rounds):
            for mode in ("same slot", "other slot", "engine's pick"):
                base = prefix(rng, args.prefix_words)
                other = prefix(rng, args.prefix_words)
                # Slot 1 holds another session; slot 0 this one's turn N.
                ttft(args.port, other, 1)
                cold, answer = ttft(args.port, base, 0)
                results["turn N (cold)"].append(cold)
                nxt = base + [{"role": "assistant", "content": answer or "ok"},
                              {"role": "user", "content": "And the next step?"}]
                slot = {"same slot": 0, "other slot": 1, "engine's pick": None}[mode]
                t, _ = ttft(args.port, nxt, slot)
                results[mode].append(t)
            if r == 0:
                p = post(args.port, "/apply-template", {"messages": nxt})["prompt"]
                prompt_tokens.append(len(post(args.port, "/tokenize", {"content": p, "add_special": True, "parse_special": True})["tokens"]))
        print(f"prompt of turn N+1: about {prompt_tokens[0]} tokens; {args.rounds} rounds; llama-server --parallel 2 -t {args.threads}")
        print("| turn N+1 goes to | TTFT p50 ms | p90 ms | max ms |")
        print("|---|---|---|---|")
        for k, v in results.items():
            v = sorted(v)
            p90 = v[min(len(v) - 1, int(len(v) * 0.9))]
            print(f"| {k} | {statistics.median(v) * 1000:.0f} | {p90 * 1000:.0f} | {v[-1] * 1000:.0f} |")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
