"""The worst seconds of a `bench/stalls/soak.sh` run beside what each
witness saw in them.

    python3 bench/stalls/parse.py $OUT_DIR/stalls-LABEL

For each of the run's eight seconds with the highest maximum latency: the
bench's p50 / p99 / max for it, the longest gap of the SCHED_FIFO and of
the ordinary heartbeat (in that second or the next), the slowest answer of
each probe (from 0.3 s before the second to its end), and the CPUs' idle
and steal ticks in it. Then the largest heartbeat gaps of the run.
"""
import re
import sys

base = sys.argv[1]
start, timeline = None, {}
for line in open(base + ".err"):
    parts = line.split(None, 1)
    if len(parts) < 2:
        continue
    if start is None and "rate 2000/s:" in parts[1] and "edgeway" in parts[1]:
        start = float(parts[0]) + 5.5
    m = re.match(r"\s*second (\d+): (\d+) ok, p50 ([\d.]+) p99 ([\d.]+) max ([\d.]+)", parts[1])
    if m:
        timeline[int(m.group(1))] = tuple(float(m.group(i)) for i in (3, 4, 5))


def events(path, kind):
    try:
        return [(float(p[1]), float(p[2])) for p in (l.split() for l in open(path)) if p and p[0] == kind]
    except FileNotFoundError:
        return []


import glob

# One SCHED_FIFO heartbeat per CPU (.hbf0, .hbf1, ...; .hbf from before they were pinned).
per_cpu = {p[len(base) + 4:] or "-": events(p, "G") for p in sorted(glob.glob(base + ".hbf*"))}
fifo, other = sorted(g for gaps in per_cpu.values() for g in gaps), events(base + ".hbo", "G")
probes = {name: events(f"{base}.{name}", "L") for name in ("pgw", "pgwchat", "pengchat")}
stat, cur = [], None
for line in open(base + ".stat"):
    p = line.split()
    if p[0] == "T":
        cur = [float(p[1])]
        stat.append(cur)
    elif cur is not None:
        cur.append([int(x) for x in p[1:]])


def worst(ev, lo, hi):
    return max((ms for t, ms in ev if lo <= t < hi), default=0.0)


def ticks(lo, hi):
    rows = [r for r in stat if lo <= r[0] < hi + 0.1 and len(r) == len(stat[0])]
    if len(rows) < 2:
        return "-"
    a, b = rows[0], rows[-1]
    return " ".join(f"cpu{i}: idle {b[i + 1][3] - a[i + 1][3]} steal {b[i + 1][7] - a[i + 1][7]}" for i in range(len(a) - 1))


in_phase = lambda ev: [(t, ms) for t, ms in ev if t >= start]
print(f"phase start {start:.3f}; heartbeat gaps over 5 ms in the phase: FIFO {len(in_phase(fifo))} "
      f"(max {worst(fifo, start, 1e12):.1f} ms), ordinary {len(in_phase(other))} (max {worst(other, start, 1e12):.1f} ms)")
print("| second | p50 / p99 / max (ms) | FIFO gap per CPU | ordinary gap | /health | chat via edgeway | chat to the engine | ticks |")
print("|---|---|---|---|---|---|---|---|")
for s in sorted(sorted(timeline, key=lambda s: -timeline[s][2])[:8]):
    t0 = start + s
    p50, p99, mx = timeline[s]
    print(f"| {s} | {p50} / {p99} / {mx} | {' / '.join(f'{worst(g, t0, t0 + 2):.1f}' for g in per_cpu.values())} | {worst(other, t0, t0 + 2):.1f} | "
          + " | ".join(f"{worst(probes[n], t0 - 0.3, t0 + 1):.1f}" for n in ("pgw", "pgwchat", "pengchat"))
          + f" | {ticks(t0, t0 + 1)} |")
for cpu, gaps in per_cpu.items():
    print(f"largest FIFO gaps on CPU {cpu} (second of the phase, ms):",
          [(round(t - start, 3), ms) for t, ms in sorted(in_phase(gaps), key=lambda x: -x[1])[:10]])
