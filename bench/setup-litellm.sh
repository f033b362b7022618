#!/usr/bin/env bash
# Installs LiteLLM's proxy (PyPI `litellm[proxy]`, a pinned version) into a
# virtual environment in the edgeway cache, for the overhead benchmark's
# third column (`cargo bench --bench overhead -- --litellm <path>`). Not
# part of the test suite (the install takes minutes). Prints the path of
# the `litellm` executable.
set -euo pipefail
CACHE="${EDGEWAY_CACHE:-$HOME/.cache/edgeway}"
VERSION="${LITELLM_VERSION:-1.108.7}"
VENV="$CACHE/litellm-venv"
if ! "$VENV/bin/python3" -c "import importlib.metadata as m, sys; sys.exit(m.version('litellm') != '$VERSION')" 2>/dev/null; then
  python3 -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q "litellm[proxy]==$VERSION" >&2
fi
echo "$VENV/bin/litellm"
