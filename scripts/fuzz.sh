#!/usr/bin/env bash
# Coverage-guided fuzzing of edgeway's hostile-input paths (fuzz/, see the
# README's "Fuzzing and fault runs"): builds the targets with libFuzzer and
# SanitizerCoverage on the stable toolchain, runs each for a fixed time from
# the kept corpus, and prints executions and findings per target.
#
#   scripts/fuzz.sh [seconds per target] [target…]
#
# Targets: mqtt_packets device_payload request_body nats_message (default:
# all). New corpus entries and crash files go to $FUZZ_OUT (default a fresh
# /tmp dir, removed at the end unless FUZZ_KEEP=1); a crash is copied to
# fuzz/crashes/<target>/ so that `cargo test` in fuzz/ replays it until it
# is fixed. Exits 1 when any target found a crash, a leak or a timeout.
set -euo pipefail

SECS=${1:-60}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(mqtt_packets device_payload request_body nats_message)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/fuzz
OUT=${FUZZ_OUT:-$(mktemp -d /tmp/edgeway-fuzz.XXXXXX)}
JOBS=${FUZZ_JOBS:-1}

# cargo-fuzz's instrumentation, without its nightly-only sanitizers: inline
# 8-bit counters and comparison tracing for libFuzzer; debug assertions and
# overflow checks on, so arithmetic bugs panic. `--target` keeps the flags
# off build scripts and proc-macros.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
echo "building fuzz targets (target dir $CARGO_TARGET_DIR)…"
(cd "$ROOT/fuzz" && nice -n 5 cargo build --release --features libfuzzer --target "$TRIPLE" \
  $(printf -- '--bin %s ' "${TARGETS[@]}"))
BIN=$CARGO_TARGET_DIR/$TRIPLE/release

failed=0
summary=()
for t in "${TARGETS[@]}"; do
  work=$OUT/$t
  mkdir -p "$work/corpus" "$work/artifacts"
  cp "$ROOT/fuzz/corpus/$t/"* "$work/corpus/"
  log=$work/fuzz.log
  echo "== $t: ${SECS}s"
  # -rss_limit_mb: a target that grows past it is a finding (leak / OOM);
  # -timeout: one input taking longer than 10 s is a finding (hang).
  set +e
  "$BIN/$t" "$work/corpus" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$work/artifacts/" -jobs="$JOBS" -workers="$JOBS" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | awk '{s+=$1} END {print s+0}')
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | awk '{print $2}')
  corpus=$(ls "$work/corpus" | wc -l)
  found=$(ls "$work/artifacts" | wc -l)
  line="$t: ${SECS}s, $execs executions, coverage ${cov:-?} edges, corpus $corpus, findings $found (exit $rc)"
  summary+=("$line")
  if [ "$found" -gt 0 ] || [ "$rc" -ne 0 ]; then
    failed=1
    mkdir -p "$ROOT/fuzz/crashes/$t"
    for f in "$work/artifacts/"*; do
      [ -e "$f" ] || continue
      cp "$f" "$ROOT/fuzz/crashes/$t/"
      echo "   finding: fuzz/crashes/$t/$(basename "$f") ($(head -c 64 "$f" | base64 -w0))"
    done
    grep -E "panicked at|ERROR: libFuzzer|SUMMARY" "$log" | head -5 | sed 's/^/   /'
  fi
done

echo
echo "fuzzing summary ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$ROOT" rev-parse --short HEAD)):"
printf '  %s\n' "${summary[@]}"
if [ "${FUZZ_KEEP:-0}" = 1 ]; then echo "work directory kept: $OUT"; else rm -rf "$OUT"; fi
exit $failed
