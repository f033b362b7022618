#!/usr/bin/env bash
# What edgeway's task store writes, and where edgeway's CPU goes, per
# request at a fixed rate (BENCHMARKS.md, sessions 21 and 22).
#
#   bench/store_io.sh LABEL EDGEWAY_BIN [ENV=VALUE ...]
#
# Runs `overhead --soak` (non-streaming requests through edgeway only, the
# fake engine in the bench process) for SECONDS (default 40) at RATE
# (default 2000) requests a second, and over 30 s of it counts from /proc
# and `perf stat`: bytes written (`wchar`), `pwrite64` and `fsync` calls,
# the store's commits and the writes they held (edgeway_store_commits_total
# and edgeway_store_writes_total from /metrics), voluntary context switches
# and minor page faults of edgeway, and the CPU of the store's writer
# thread apart from all other threads. ENV=VALUE pairs go to edgeway's
# environment (e.g. MIMALLOC_PURGE_DELAY=10). Needs perf and the overhead
# bench built: `cargo bench --bench overhead --no-run` prints its path; set
# OVERHEAD to it. Prints one line; the bench's own report is kept in
# $OUT_DIR/store-io-LABEL.md (default /tmp).
set -euo pipefail
label=$1
bin=$2
shift 2
rate=${RATE:-2000}
secs=${SECONDS_RUN:-40}
window=30
out=${OUT_DIR:-/tmp}/store-io-$label
overhead=${OVERHEAD:?set OVERHEAD to the overhead bench binary}
env "$@" "$overhead" --soak --rates "$rate" --seconds "$secs" --warmup 5 --no-build --edgeway-bin "$bin" \
    > "$out.md" 2> "$out.err" &
bench=$!
for _ in $(seq 1 300); do grep -q "rate $rate" "$out.err" 2>/dev/null && break; sleep 0.1; done
pid=$(grep -o 'edgeway (pid [0-9]*' "$out.err" | grep -o '[0-9]*$')
url=$(grep -o 'ready at http[^ ]*' "$out.err" | awk '{print $3}')
sleep 6
metrics() {
    curl -s -H 'Authorization: Bearer sk-edgeway-ops' "$url/metrics" \
        | awk '/^edgeway_store_commits_total /{c=$2} /^edgeway_store_writes_total /{w=$2} END {print c+0, w+0}'
}
# CPU ticks of the writer thread and of all the others; voluntary switches.
threads() {
    for t in /proc/"$pid"/task/*; do
        sed -E 's/^[0-9]+ \(([^)]*)\) /\1 /' "$t"/stat | awk '{print $1, $13 + $14}'
        awk '/^voluntary_ctxt_switches/ {print "switches", $2}' "$t"/status
    done | awk '$1 == "edgeway-store" {s += $2} $1 == "switches" {v += $2} $1 != "edgeway-store" && $1 != "switches" {o += $2}
                END {print s + 0, o + 0, v + 0}'
}
faults() { sed -E 's/^.*\) //' /proc/"$pid"/stat | awk '{print $8}'; }
written() { awk '/^wchar/ {print $2}' /proc/"$pid"/io; }
read -r c0 w0 < <(metrics)
read -r s0 o0 v0 < <(threads)
f0=$(faults)
b0=$(written)
perf stat -x, -e 'syscalls:sys_enter_fsync,syscalls:sys_enter_pwrite64' -p "$pid" -- sleep "$window" 2> "$out.perf"
b1=$(written)
f1=$(faults)
read -r s1 o1 v1 < <(threads)
read -r c1 w1 < <(metrics)
wait "$bench"
n=$((rate * window))
tick_us=$((1000000 / $(getconf CLK_TCK)))
fsyncs=$(grep fsync "$out.perf" | cut -d, -f1)
pwrites=$(grep pwrite "$out.perf" | cut -d, -f1)
row=$(grep "^| $rate" "$out.md")
field() { echo "$row" | awk -F'|' -v i="$1" '{gsub(/ /, "", $i); print $i}'; }
awk -v l="$label" -v n="$n" -v w="$window" -v b="$((b1 - b0))" -v pw="$pwrites" -v fs="$fsyncs" \
    -v c="$((c1 - c0))" -v wr="$((w1 - w0))" -v v="$((v1 - v0))" -v f="$((f1 - f0))" \
    -v s="$(((s1 - s0) * tick_us))" -v o="$(((o1 - o0) * tick_us))" \
    -v cpu="$(field 12)" -v p99="$(field 8)" -v mx="$(field 9)" -v err="$(field 5)" 'BEGIN {
    printf "%s: KB/req %.0f pwrite/req %.1f fsync/s %.0f commits/s %.0f writes/commit %.1f vcsw/req %.2f minflt/req %.2f store_us/req %.0f other_us/req %.0f cpu_us/req %s p99 %s max %s errors %s\n",
        l, b / n / 1000, pw / n, fs / w, c / w, (c > 0 ? wr / c : 0), v / n, f / n, s / n, o / n, cpu, p99, mx, err
}'
