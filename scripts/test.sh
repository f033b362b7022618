#!/usr/bin/env bash
# Runs the whole test suite: Rust unit and integration tests (fake engines,
# real sockets, real SQLite), then the end-to-end tests against the real
# llama.cpp engine with Python clients the project did not write (the
# official openai SDK). Installs what it needs first (cached; see
# scripts/setup-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="$(bash scripts/setup-deps.sh)"
export EDGEWAY_CACHE="$CACHE"

echo "== cargo test" >&2
# Benchmarks are not tests: `cargo bench` runs them (see BENCHMARKS.md).
cargo build --workspace --bins --tests
cargo test --workspace --lib --bins --tests -- --test-threads=2

echo "== end-to-end tests against llama-server + Gemma 3 270M" >&2
# Where cargo put it (CARGO_TARGET_DIR, when set, moves the build).
TARGET="${CARGO_TARGET_DIR:-target}"
case "$TARGET" in /*) ;; *) TARGET="$PWD/$TARGET" ;; esac
export EDGEWAY_BIN="$TARGET/debug/edgeway"
"$CACHE/venv/bin/python" -m pytest -q tests/e2e "$@"
