#!/usr/bin/env python3
"""Per-test tables of paho suite runs (the JSON that run_suite.py writes).

Each --run names a results directory of run-all.sh: NAME=DIR. For each
suite (client_test.py, client_test5.py) it prints a Markdown table with one
row per test and one column per (target, run name), targets in the order of
--targets (e edgeway two devices, o edgeway one device, m Mosquitto). A
directory holding several runs of a target (e5-run1.json, e5-run2.json)
gives one cell: the outcome if every run agreed, else every run's outcome
("pass, fail"). The last row counts passed / run per file, as in
topics/README.md. --why adds, under each table, the last line of the
failure text of every failed cell (the assertion or exception).

  bench/paho/compare.py --run base=/work/paho/results/base-run1 \\
      --run final=/work/paho/results/final [--targets e,o,m] [--why]

NAME=DIR1,DIR2 takes the runs of several directories as one column's runs.
A run given as NAME=FILE.json is a single column of its own.
"""

import argparse
import glob
import json
import os
import re
import sys

TARGETS = {"e": "edgeway", "o": "edgeway, one device", "m": "Mosquitto"}
SUITES = {"3": "client_test.py (MQTT 3.1.1)", "5": "client_test5.py (MQTT 5)"}


def load_runs(spec, targets):
    """(column title, suite) -> list of result docs."""
    name, _, path = spec.partition("=")
    if not path:
        sys.exit("--run wants NAME=DIR or NAME=FILE.json, got %r" % spec)
    cols = []
    if path.endswith(".json"):
        with open(path) as f:
            doc = json.load(f)
        suite = "3" if doc["mqtt"] == "3.1.1" else "5"
        cols.append((None, name, {suite: [doc]}))
        return cols
    for t in targets:
        per_suite = {}
        for s in SUITES:
            # NAME=DIR1,DIR2: the runs of every directory, in the order given.
            files = []
            for d in path.split(","):
                files += sorted(glob.glob(os.path.join(d, "%s%s-run*.json" % (t, s))),
                                key=lambda p: int(re.search(r"run(\d+)\.json$", p).group(1)))
            docs = []
            for p in files:
                with open(p) as f:
                    docs.append(json.load(f))
            if docs:
                per_suite[s] = docs
        if per_suite:
            cols.append((t, "%s %s" % (TARGETS[t], name), per_suite))
    return cols


def cell(docs, test):
    outs = [d["tests"].get(test, {}).get("status", "–") for d in docs]
    if len(set(outs)) == 1:
        return outs[0]
    return ", ".join(outs)


def last_line(detail):
    lines = [l.strip() for l in detail.strip().splitlines() if l.strip()]
    return lines[-1][:200] if lines else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="NAME=DIR or NAME=FILE.json")
    ap.add_argument("--targets", default="e,o,m", help="order of targets (e, o, m)")
    ap.add_argument("--why", action="store_true", help="list the failure text of every failed cell")
    args = ap.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    # Columns by target first, then by run, so that a target's runs sit
    # together; single-file columns last.
    loaded = [c for spec in args.run for c in load_runs(spec, targets)]
    order = {t: i for i, t in enumerate(targets)}
    loaded.sort(key=lambda c: order.get(c[0], len(order)))  # stable: runs keep their order
    columns = [(title, per_suite) for _, title, per_suite in loaded]

    for s, title in SUITES.items():
        cols = [(n, d[s]) for n, d in columns if s in d]
        if not cols:
            continue
        tests = []
        for _, docs in cols:
            for d in docs:
                for t in sorted(d["tests"]):
                    if t not in tests:
                        tests.append(t)
        print("%s\n" % title)
        print("| test | " + " | ".join(n for n, _ in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for t in tests:
            cells = [cell(docs, t) for _, docs in cols]
            print("| %s | %s |" % (t, " | ".join(cells)))
        totals = [", ".join("%d / %d" % (d["passed"], d["run"]) for d in docs) for _, docs in cols]
        print("| **passed / run** | %s |" % " | ".join(totals))
        print()
        if args.why:
            for n, docs in cols:
                for t in tests:
                    for i, d in enumerate(docs):
                        rec = d["tests"].get(t)
                        if rec and rec["status"] != "pass":
                            print("- %s, %s, run %d: %s (%s s) %s" % (
                                t, n, i + 1, rec["status"], rec.get("seconds"), last_line(rec.get("detail", ""))))
            print()


if __name__ == "__main__":
    main()
