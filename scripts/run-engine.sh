#!/usr/bin/env bash
# Runs llama.cpp's llama-server with the Gemma 3 270M model, the way edgeway's
# example config expects it (alias gemma-3-270m, 2 slots, /slots on).
# Usage: scripts/run-engine.sh [PORT]   (default 8081; runs in the foreground)
set -euo pipefail
CACHE="${EDGEWAY_CACHE:-$HOME/.cache/edgeway}"
PORT="${1:-8081}"
exec "$CACHE/bin/llama-server" \
  -m "$CACHE/models/gemma-3-270m-q4_k_m.gguf" \
  --alias gemma-3-270m \
  --host 127.0.0.1 --port "$PORT" \
  --parallel 2 --ctx-size 8192 --threads "${LLAMA_THREADS:-2}" \
  --slots --no-webui
