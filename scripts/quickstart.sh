#!/usr/bin/env bash
# Runs edgeway for real: installs what it needs (first time only: building
# llama.cpp takes about 20 minutes on 2 cores), starts llama-server with Gemma 3
# 270M on 127.0.0.1:8081, then edgeway with config/edgeway.toml on
# 127.0.0.1:8080. Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh >/dev/null
cargo build --release --bin edgeway

LOG="${TMPDIR:-/tmp}/edgeway-llama-server.log"
echo "starting llama-server on 127.0.0.1:8081 (log: $LOG)" >&2
bash scripts/run-engine.sh 8081 >"$LOG" 2>&1 &
ENGINE_PID=$!
trap 'kill $ENGINE_PID 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 1 240); do
  if curl -fsS http://127.0.0.1:8081/health >/dev/null 2>&1; then break; fi
  if ! kill -0 $ENGINE_PID 2>/dev/null; then echo "llama-server exited; see $LOG" >&2; exit 1; fi
  sleep 0.5
done
echo "llama-server is up; starting edgeway on http://127.0.0.1:8080 (API key sk-edgeway-demo)" >&2
"${CARGO_TARGET_DIR:-target}/release/edgeway" serve --config config/edgeway.toml
