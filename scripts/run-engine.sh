#!/usr/bin/env bash
# Runs llama.cpp's llama-server with the Gemma 3 270M model, the way edgeway's
# example config expects it (alias gemma-3-270m, 2 slots, /slots on), for
# when edgeway does not run it itself (config/edgeway.toml does, through
# [engines.llama-local.process], with the same flags). The model file has no
# chat template: Gemma's comes from config/templates/gemma.jinja (without it
# llama-server falls back to ChatML, which Gemma does not know).
# Usage: scripts/run-engine.sh [PORT]   (default 8081; runs in the foreground)
set -euo pipefail
CACHE="${EDGEWAY_CACHE:-$HOME/.cache/edgeway}"
PORT="${1:-8081}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
exec "$CACHE/bin/llama-server" \
  -m "$CACHE/models/gemma-3-270m-q4_k_m.gguf" \
  --alias gemma-3-270m \
  --host 127.0.0.1 --port "$PORT" \
  --parallel 2 --ctx-size 8192 --threads "${LLAMA_THREADS:-2}" \
  --slots --no-webui \
  --chat-template-file "$ROOT/config/templates/gemma.jinja"
