#!/usr/bin/env python3
"""Where two callgrind dumps of bench/instructions.py differ, per request.

bench/instructions.py keeps one dump per phase (`cg.out.<n>` in the
binary's folder; its summary.json names them). This reads two of them with
`callgrind_annotate` (self cost, or inclusive with --inclusive), divides each
function's count by the requests of its phase, and prints the functions
whose per-request count moved most between A and B. Rust symbol hashes
(`::h0123456789abcdef`) are dropped so that the same function of two builds
matches; a function present in one build only shows its whole count.

    python3 bench/cgdiff.py A.dump B.dump -n 1000            # self cost
    python3 bench/cgdiff.py A.dump B.dump -n 1000 --inclusive --top 60
    python3 bench/cgdiff.py A.dump -n 1000 --grep tracing     # one dump, filtered
    python3 bench/cgdiff.py A.dump B.dump -n 1000 --group     # by crate / module

Instructions of a function, not time: see bench/instructions.py for why.
Self cost caveat: a function still running when the dump was taken (a
thread's root, a runtime's worker loop) is written by callgrind as a call
without return, which callgrind_annotate counts as its own; --skip-roots
leaves out functions whose count is over a third of the phase's total.
"""

import argparse
import re
import subprocess
import sys
from collections import defaultdict

HASH = re.compile(r"::h[0-9a-f]{16}")
LINE = re.compile(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(?:\*\s+)?(.*)$")


def counts(dump, inclusive):
    # callgrind_annotate 3.19 reads `--inclusive=no` as yes: self cost is
    # asked for by leaving the option out.
    out = subprocess.run(
        ["callgrind_annotate", "--threshold=100", "--auto=no", "--show-percs=no"]
        + (["--inclusive=yes"] if inclusive else []) + [dump],
        check=True, capture_output=True, text=True).stdout
    res = defaultdict(int)
    started = False
    for line in out.splitlines():
        if not started:
            # The function table follows the header line naming file:function.
            if "file:function" in line:
                started = True
            continue
        m = LINE.match(line)
        if not m:
            continue
        n = int(m.group(1).replace(",", ""))
        name = m.group(2).strip()
        # "file:function [object]": keep the function.
        name = re.sub(r"\s+\[[^\]]*\]$", "", name)
        if ":" in name and not name.startswith("0x"):
            fname, _, func = name.partition(":")
            if "/" in fname or fname.startswith("???") or fname.endswith((".rs", ".c", ".h")):
                name = func
        res[HASH.sub("", name)] += n
    return res


def group_of(name):
    """A function's crate or edgeway module: what a line of --group sums."""
    n = name.lstrip("<&*( ")
    n = re.sub(r"^(impl\s+)", "", n)
    if n.startswith("edgeway::"):
        return "::".join(n.split("::")[:2])
    return n.split("::")[0].split("<")[0] or name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dumps", nargs="+", help="one or two callgrind dumps (A, then B)")
    ap.add_argument("-n", type=int, required=True, help="requests in each dump's phase")
    ap.add_argument("--inclusive", action="store_true")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--grep", default=None, help="only functions whose name contains this (regex)")
    ap.add_argument("--group", action="store_true", help="sum by crate / edgeway module")
    ap.add_argument("--skip-roots", action="store_true", help="leave out functions over 1/3 of the total")
    args = ap.parse_args()
    per = []
    for d in args.dumps:
        c = counts(d, args.inclusive)
        if args.skip_roots:
            total = max(c.values())
            c = {k: v for k, v in c.items() if v < total / 3}
        per.append({k: v / args.n for k, v in c.items()})
    if args.group:
        grouped = []
        for p in per:
            g = defaultdict(float)
            for k, v in p.items():
                g[group_of(k)] += v
            grouped.append(g)
        per = grouped
    a = per[0]
    b = per[1] if len(per) > 1 else {}
    keys = set(a) | set(b)
    if args.grep:
        rx = re.compile(args.grep)
        keys = {k for k in keys if rx.search(k)}
    if len(per) > 1:
        rows = sorted(keys, key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))[: args.top]
        print(f"| function | A per request | B per request | B − A |")
        print("|---|---|---|---|")
        for k in rows:
            print(f"| `{k[:140]}` | {a.get(k, 0):,.0f} | {b.get(k, 0):,.0f} | {b.get(k, 0) - a.get(k, 0):+,.0f} |")
        if not args.inclusive:
            ta, tb = sum(a.values()), sum(b.values())
            print(f"\nself cost in total: A {ta:,.0f}, B {tb:,.0f}, B − A {tb - ta:+,.0f} per request",
                  file=sys.stderr)
    else:
        rows = sorted(keys, key=lambda k: -a.get(k, 0))[: args.top]
        print("| function | per request |")
        print("|---|---|")
        for k in rows:
            print(f"| `{k[:140]}` | {a.get(k, 0):,.0f} |")


if __name__ == "__main__":
    main()
