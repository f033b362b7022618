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
# is fixed: one input per distinct place, named after it. Runs on after a
# crash (libFuzzer fork mode), so a known bug does not hide the next one.
# Exits 1 when any target found a crash, a leak or a timeout.
set -euo pipefail

SECS=${1:-60}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(mqtt_packets device_payload request_body nats_message)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/fuzz
OUT=${FUZZ_OUT:-$(mktemp -d /tmp/edgeway-fuzz.XXXXXX)}
JOBS=${FUZZ_JOBS:-1}   # parallel fuzzing processes per target

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
  # Fork mode with -ignore_crashes: a known crash does not stop the run
  # (the other paths keep being fuzzed). -rss_limit_mb: a target that grows
  # past it is a finding (leak / OOM); -timeout: an input taking longer
  # than 10 s is a finding (hang).
  set +e
  (cd "$work" && "$BIN/$t" "$work/corpus" -fork="$JOBS" -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
    -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/" >"$log" 2>&1)
  rc=$?
  set -e
  last=$(grep -E '^#[0-9]+: cov:' "$log" | tail -1 || true)
  execs=$(sed -E 's/^#([0-9]+):.*/\1/' <<<"$last")
  cov=$(grep -oE 'cov: [0-9]+' <<<"$last" | awk '{print $2}')
  corpus=$(ls "$work/corpus" | wc -l)
  found=$(ls "$work/artifacts" | wc -l)
  # Findings grouped by where they panic (or how they end), one kept input
  # per place in fuzz/crashes/<target>/ (the name says where).
  declare -A where=()
  for f in "$work/artifacts/"*; do
    [ -e "$f" ] || continue
    place=$("$BIN/$t" "$f" 2>&1 | grep -oE 'panicked at [^ ]+|ERROR: libFuzzer: [a-z -]+' | head -1 \
      | sed -E 's#^panicked at ##; s#.*/registry/src/[^/]+/##; s#^/[^ ]*/wt/[^/]+/##; s#^\./##; s#:$##' || true)
    place=${place:-$(basename "$f" | cut -d- -f1)}
    if [ -z "${where[$place]:-}" ]; then
      where[$place]=$f
      slug=$(tr -c 'A-Za-z0-9_.' '_' <<<"$place" | sed 's/_*$//')
      mkdir -p "$ROOT/fuzz/crashes/$t"
      [ -e "$ROOT/fuzz/crashes/$t/$slug" ] || cp "$f" "$ROOT/fuzz/crashes/$t/$slug"
      echo "   finding at $place: fuzz/crashes/$t/$slug ($(head -c 48 "$f" | base64 -w0))"
    fi
  done
  distinct=${#where[@]}
  unset where
  line="$t: ${SECS}s, ${execs:-0} executions, coverage ${cov:-?} edges, corpus $corpus, findings $found ($distinct distinct)"
  summary+=("$line")
  if [ "$found" -gt 0 ] || { [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ]; }; then
    failed=1
  fi
done

echo
echo "fuzzing summary ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$ROOT" rev-parse --short HEAD)):"
printf '  %s\n' "${summary[@]}"
if [ "${FUZZ_KEEP:-0}" = 1 ]; then echo "work directory kept: $OUT"; else rm -rf "$OUT"; fi
exit $failed
