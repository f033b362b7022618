#!/usr/bin/env bash
# A soak of `overhead` with witnesses beside it, to tell where a slow
# second comes from (BENCHMARKS.md, session 24):
#
#   OVERHEAD=<overhead bench binary> bench/stalls/soak.sh LABEL EDGEWAY_BIN [SECONDS]
#
# - heartbeats (heartbeat.c: wake every 1 ms, print each gap over 5 ms):
#   one SCHED_FIFO 50 pinned to each CPU, which nothing delays but its CPU
#   not running (the VM's vCPU not scheduled by the host) or kernel code
#   that holds it without a preemption point, and one ordinary thread; a
#   gap on every CPU at once is the whole VM stopped;
# - three probes (probe.py, one request every 20 ms on a kept-alive
#   connection): edgeway's /health, a chat completion through edgeway, and
#   a chat completion straight to the fake engine (which lives in the load
#   generator's process);
# - the CPUs' ticks (/proc/stat) every 100 ms.
#
# Writes $OUT_DIR/stalls-LABEL.* (default /tmp); `python3
# bench/stalls/parse.py $OUT_DIR/stalls-LABEL` prints the run's worst
# seconds beside what each witness saw in them. Needs gcc, chrt (root for
# SCHED_FIFO), taskset and ss; run nothing else meanwhile.
set -euo pipefail
label=$1
bin=$2
secs=${3:-600}
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT_DIR:-/tmp}/stalls-$label
overhead=${OVERHEAD:?set OVERHEAD to the overhead bench binary}
py=${PYTHON:-python3}
rm -f "$out".*
gcc -O2 -o "$out.hb" "$here/heartbeat.c"
pids=()
for cpu in $(seq 0 $(($(nproc) - 1))); do
    taskset -c "$cpu" chrt -f 50 "$out.hb" > "$out.hbf$cpu" & pids+=($!)
done
"$out.hb" > "$out.hbo" & pids+=($!)
# Each line of the bench's stderr with the time it was read: the measured
# phase starts 5.5 s after its "rate" line (5 s of warm-up, 0.5 s pause).
"$overhead" --soak --rates 2000 --seconds "$secs" --warmup 5 --no-build --edgeway-bin "$bin" --timeline \
    > "$out.md" 2> >(while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done > "$out.err") &
bench=$!
for _ in $(seq 1 300); do grep -q "rate 2000" "$out.err" 2>/dev/null && break; sleep 0.1; done
gw=$(grep -o 'ready at http[^ ]*' "$out.err" | awk '{print $3}')
engine_port=$(ss -ltnp | grep "pid=$bench," | grep -o '127.0.0.1:[0-9]*' | head -1 | cut -d: -f2)
"$py" "$here/probe.py" "$gw/health" "$out.pgw" & pids+=($!)
"$py" "$here/probe.py" "$gw/v1/chat/completions" "$out.pgwchat" general-chat sk-edgeway-demo & pids+=($!)
"$py" "$here/probe.py" "http://127.0.0.1:$engine_port/v1/chat/completions" "$out.pengchat" fake-model & pids+=($!)
(while kill -0 "$bench" 2>/dev/null; do echo "T $(date +%s.%N)"; grep '^cpu[0-9]' /proc/stat; sleep 0.1; done) > "$out.stat" &
wait "$bench"
kill "${pids[@]}" 2>/dev/null || true
wait
