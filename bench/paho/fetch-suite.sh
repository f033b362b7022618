#!/usr/bin/env bash
# Put the Eclipse paho interoperability suite (EPL/EDL code, never committed
# here) in DEST (default /work/paho/suite/head) at the commit of MANIFEST.txt,
# and check the SHA-256 of every file the runner loads.
#
#   bench/paho/fetch-suite.sh [DEST]
#
# Needs network access to GitHub, or SOURCE=<a clone or bare mirror of
# eclipse/paho.mqtt.testing> to take it from a local git directory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-/work/paho/suite/head}
commit=$(grep -o 'commit [0-9a-f]\{40\}' "$here/MANIFEST.txt" | head -1 | cut -d' ' -f2)
src=${SOURCE:-}
if [ -z "$src" ]; then
  src=$(mktemp -d)/paho.mqtt.testing
  git clone --quiet --filter=blob:none https://github.com/eclipse/paho.mqtt.testing "$src"
fi
mkdir -p "$dest"
git -C "$src" archive "$commit" interoperability | tar -x -C "$dest"
(cd "$dest" && grep -v '^#' "$here/MANIFEST.txt" | sha256sum --check --quiet)
echo "suite at $dest/interoperability (commit $commit), checksums match"
