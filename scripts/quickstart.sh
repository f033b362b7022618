#!/usr/bin/env bash
# Runs edgeway for real: installs what it needs (first time only: building
# llama.cpp and edgeway take about 20 minutes on 2 cores), builds edgeway, then runs
# `edgeway serve --config config/edgeway.toml`, which starts llama-server with
# Gemma 3 270M on 127.0.0.1:8081 (chat) and a second one on 127.0.0.1:8082
# (embeddings: a server started with --embeddings serves nothing else) as
# supervised child processes, and serves on 127.0.0.1:8080. Ctrl-C stops
# edgeway, which stops both engines. Engine logs: data/engines/*.log.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh >/dev/null
cargo build --release --bin edgeway
# config/edgeway.toml finds the engine and model under ${EDGEWAY_CACHE}
# (default ~/.cache/edgeway), where setup-deps.sh put them.
export EDGEWAY_CACHE="${EDGEWAY_CACHE:-$HOME/.cache/edgeway}"
echo "starting edgeway on http://127.0.0.1:8080 (API key sk-edgeway-demo); it starts both llama-servers" >&2
exec "${CARGO_TARGET_DIR:-target}/release/edgeway" serve --config config/edgeway.toml
