#!/usr/bin/env bash
# Runs a second llama-server for embeddings with the same Gemma 3 270M model,
# the way edgeway's example config expects it (engine llama-embed, alias
# gemma-3-270m-embed). A server started with --embeddings serves embeddings
# only (recent llama.cpp refuses chat on it), hence its own process. Gemma is
# a causal model without a pooling of its own: --pooling mean makes one
# vector per input, which /v1/embeddings needs. Each input must fit one
# physical batch (--ubatch-size), so it matches the per-slot context.
# config/edgeway.toml runs the same server through edgeway
# ([engines.llama-embed.process]); this script is for running it yourself.
# Usage: scripts/run-embed-engine.sh [PORT]   (default 8082; runs in the foreground)
set -euo pipefail
CACHE="${EDGEWAY_CACHE:-$HOME/.cache/edgeway}"
PORT="${1:-8082}"
exec "$CACHE/bin/llama-server" \
  -m "$CACHE/models/gemma-3-270m-q4_k_m.gguf" \
  --alias gemma-3-270m-embed \
  --host 127.0.0.1 --port "$PORT" \
  --embeddings --pooling mean \
  --parallel 2 --ctx-size 4096 --batch-size 2048 --ubatch-size 2048 \
  --threads "${LLAMA_THREADS:-2}" \
  --no-webui
