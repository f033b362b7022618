#!/usr/bin/env python3
"""The heap live at its peak (t-gmax) in a `valgrind --tool=dhat` output
file, by allocation site: the first frame of each stack outside the
allocator and the standard library's containers, so a `Vec::reserve` is
charged to whoever grew the Vec. With `--per N`, also per connection (for
`connections.py --wrap`, whose peak is N idle connections).

    python3 devices-sim/bench/dhat_top.py dhat.json --per 1000 --top 25
"""
import argparse
import json
import re
from collections import defaultdict

# Frames that only say how memory was obtained, not for what.
PLUMBING = re.compile(
    r"\?\?\?|vgpreload|library/|\(alloc\.rs|\(unix\.rs|raw_vec|\(vec|boxed\.rs|bytes_mut\.rs|"
    r"\(mod\.rs:|UnknownInlinedFun \(library"
)


def site(frames, ftbl):
    for i in frames:
        f = ftbl[i]
        if not PLUMBING.search(f):
            return f
    return ftbl[frames[-1]] if frames else "[root]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--per", type=int, default=0, help="divide by this many connections")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sizes", metavar="REGEX",
                    help="also every allocation (live at the peak or not) whose site matches: "
                         "blocks and bytes per block (the size of a boxed future, a task)")
    args = ap.parse_args()
    d = json.load(open(args.file))
    ftbl = d["ftbl"]
    by = defaultdict(lambda: [0, 0])
    for pp in d["pps"]:
        if pp.get("gb", 0) == 0:
            continue
        s = site(pp["fs"], ftbl)
        # Keep the function and its file:line, without the address.
        s = re.sub(r"^0x[0-9A-Fa-f]+: ", "", s)
        by[s][0] += pp["gb"]
        by[s][1] += pp["gbk"]
    total = sum(b for b, _ in by.values())
    blocks = sum(k for _, k in by.values())
    per = args.per or 1
    print(f"heap at t-gmax: {total} bytes in {blocks} blocks"
          + (f"; per connection {total / per:.0f} bytes, {blocks / per:.1f} blocks" if args.per else ""))
    print(f"{'bytes':>10} {'blocks':>8} " + (f"{'B/conn':>8} {'blk/conn':>8} " if args.per else "") + "site")
    for s, (b, k) in sorted(by.items(), key=lambda kv: -kv[1][0])[: args.top]:
        extra = f"{b / per:8.0f} {k / per:8.2f} " if args.per else ""
        print(f"{b:10} {k:8} {extra}{s[:160]}")
    if args.sizes:
        sizes = defaultdict(lambda: [0, 0])
        for pp in d["pps"]:
            s = re.sub(r"^0x[0-9A-Fa-f]+: ", "", site(pp["fs"], ftbl))
            if re.search(args.sizes, s):
                sizes[s][0] += pp["tb"]
                sizes[s][1] += pp["tbk"]
        print(f"\n{'blocks':>8} {'B/block':>8} site (all allocations)")
        for s, (b, k) in sorted(sizes.items(), key=lambda kv: -kv[1][0]):
            print(f"{k:8} {b / max(k, 1):8.0f} {s[:160]}")


if __name__ == "__main__":
    main()
