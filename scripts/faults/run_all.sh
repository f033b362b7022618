#!/usr/bin/env bash
# Runs every fault run in turn (scripts/faults/*.py; README, "Fuzzing and
# fault runs") against the release binary and prints each verdict block.
#   scripts/faults/run_all.sh [soak seconds, default 3600]
# Exits 1 when any run failed its acceptance condition.
set -uo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-${EDGEWAY_CACHE:-$HOME/.cache/edgeway}/venv/bin/python}
failed=()
for run in kill9 engine_kill disk_full nats_bounce flood "soak --duration ${1:-3600}"; do
  echo "== $run"
  # shellcheck disable=SC2086
  set -- $run
  "$PY" "$1.py" "${@:2}" || failed+=("$1")
done
echo
if [ ${#failed[@]} -gt 0 ]; then echo "failed: ${failed[*]}"; exit 1; fi
echo "all fault runs passed"
