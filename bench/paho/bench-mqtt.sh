#!/usr/bin/env bash
# The MQTT benchmarks issue 16 compares before and after (BENCHMARKS.md):
# request → first delta (bench/mqtt.rs) and idle memory per connection
# (devices-sim/bench/connections.py), with the machine's load next to each.
#
#   bench/paho/bench-mqtt.sh OUT_PREFIX [N ...]     # N: connection counts (1000)
#
# Writes OUT_PREFIX-mqtt.{out,json,md} and OUT_PREFIX-connections-N.txt. Run
# from the repository root with CARGO_TARGET_DIR set as for any cargo command.
# connections.py measures the target/release/edgeway that `cargo bench`
# builds (release profile, bench's feature set), so that a later run on other
# code measures a binary built the same way; `cargo build --release` alone
# builds the dependencies again with other features.
set -euo pipefail
prefix=${1:?usage: bench-mqtt.sh OUT_PREFIX [N ...]}
shift
counts=${*:-1000}
target=${CARGO_TARGET_DIR:-target}
mkdir -p "$(dirname "$prefix")"

results=bench/results
before=$(ls "$results" 2>/dev/null || true)
{
  echo "git: $(git rev-parse --short HEAD) $(git status --porcelain | grep -c . || true) changed files"
  echo "load at start: $(uptime)"
} > "$prefix-mqtt.out"
nice -n 5 cargo bench --bench mqtt -- --requests 2000 --warmup 200 --tokens 8 >> "$prefix-mqtt.out" 2>&1
echo "load at end: $(uptime)" >> "$prefix-mqtt.out"
for f in $(ls "$results"); do
  if ! grep -qx "$f" <<< "$before"; then
    cp "$results/$f" "$prefix-mqtt.${f##*.}"
  fi
done

for n in $counts; do
  {
    echo "load at start: $(uptime)"
    python3 devices-sim/bench/connections.py --edgeway "$target/release/edgeway" -n "$n"
    echo "load at end: $(uptime)"
  } > "$prefix-connections-$n.txt" 2>&1
done
# The summary: first-delta table and per-connection rows.
sed -n '/^| path/,/^$/p' "$prefix-mqtt.md" 2>/dev/null || true
grep -h "^| edgeway\|^| mosquitto" "$prefix"-connections-*.txt || true
