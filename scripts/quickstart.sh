#!/usr/bin/env bash
# Runs edgeway for real: installs what it needs (first time only: building
# llama.cpp takes about 20 minutes on 2 cores), starts llama-server with Gemma 3
# 270M on 127.0.0.1:8081 (chat) and a second one on 127.0.0.1:8082
# (embeddings: a server started with --embeddings serves nothing else), then
# edgeway with config/edgeway.toml on 127.0.0.1:8080. Ctrl-C stops all three.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh >/dev/null
cargo build --release --bin edgeway

LOG="${TMPDIR:-/tmp}/edgeway-llama-server.log"
EMBED_LOG="${TMPDIR:-/tmp}/edgeway-llama-embed.log"
echo "starting llama-server on 127.0.0.1:8081 (log: $LOG)" >&2
bash scripts/run-engine.sh 8081 >"$LOG" 2>&1 &
ENGINE_PID=$!
echo "starting the embeddings llama-server on 127.0.0.1:8082 (log: $EMBED_LOG)" >&2
bash scripts/run-embed-engine.sh 8082 >"$EMBED_LOG" 2>&1 &
EMBED_PID=$!
trap 'kill $ENGINE_PID $EMBED_PID 2>/dev/null || true' EXIT INT TERM
for port_pid_log in "8081 $ENGINE_PID $LOG" "8082 $EMBED_PID $EMBED_LOG"; do
  read -r port pid log <<<"$port_pid_log"
  for _ in $(seq 1 240); do
    if curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$pid" 2>/dev/null; then echo "llama-server on $port exited; see $log" >&2; exit 1; fi
    sleep 0.5
  done
done
echo "llama-servers are up; starting edgeway on http://127.0.0.1:8080 (API key sk-edgeway-demo)" >&2
"${CARGO_TARGET_DIR:-target}/release/edgeway" serve --config config/edgeway.toml
