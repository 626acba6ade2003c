"""The native CPU kernels' sources and build variants: one table both builds read.

Torch-free and import-free on purpose: setup.py loads this file by path at install time (the
package itself imports torch), and native.py imports it at run time, so the two builds compile
the same sources with the same flags and agree on the sources' hash.

Builds:
* prebuilt variants, compiled at install by setup.py (setuptools' build_ext: the project is a
  setuptools project already and the kernels are plain C with one compiler and no configure
  step, so a CMake or Meson layer would add a tool and nothing else) into the package as
  `_kernels_<variant>.*.so`, one per instruction-set level; native.py loads the best one the CPU
  runs (select_variant), as llama.cpp's all-variants CPU build and PyTorch's CPU capability
  dispatch do. No compiler and no writable directory are needed at run time.
* a build here (-march=native) into the user's cache, as before the prebuilt variants: when none
  is installed (a checkout without `make kernels`), when the installed one is older than the
  sources (a developer's edit), or when SARATHI_NATIVE_BUILD=jit asks for it.

Variants (x86-64): "avx512-vnni" = x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) + AVX-512 VNNI: the lane
kernels' integer dots and the 16-wide attention and ops (Cascade Lake and later Xeons, Zen 4 and
later); "avx2" = x86-64-v3 (AVX2, FMA, F16C, BMI1/2): the 8-wide paths; "portable" = x86-64
(SSE2): the scalar reference paths, which run on any x86-64 CPU. Elsewhere (aarch64...) only
"portable", compiled without -march. -mtune=generic: the variants run on CPUs of several vendors.
The sources test the same macros (__AVX512VNNI__, __AVX512F__, __AVX2__, __FMA__, __F16C__).
"""
from __future__ import annotations

import hashlib
import platform
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
# link order; native.py's EXPORTS names each one's functions
SOURCE_NAMES = ["paged_decode.c", "int8_linear.c", "cpu_ops.c", "gguf_linear.c", "gguf_scalar.c", "gguf_q8.c",
                "gguf_q8_tiles.c", "gguf_q8_rowlane.c", "gguf_q8_toklane_avx2.c", "gguf_q8_toklane_avx512.c",
                "decode_stack.c", "chunk_attention.c", "version.c"]
SOURCES = [CSRC / name for name in SOURCE_NAMES]
COMMON_FLAGS = ["-O3", "-fopenmp", "-fPIC"]
_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# name -> (compiler flags, /proc/cpuinfo flags the CPU must have), best first
X86_VARIANTS = {
    "avx512-vnni": (["-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"], _V4 | {"avx512_vnni"}),
    "avx2": (["-march=x86-64-v3", "-mtune=generic"], _V3),
    "portable": (["-march=x86-64", "-mtune=generic"], set()),
}
OTHER_VARIANTS = {"portable": ([], set())}


def headers() -> list[Path]:
    return sorted(CSRC.glob("*.h"))


def variants(machine: str | None = None) -> dict[str, tuple[list[str], set[str]]]:
    """The variants built and chosen from on this machine's architecture, best first."""
    m = (machine or platform.machine()).lower()
    return X86_VARIANTS if m in ("x86_64", "amd64") else OTHER_VARIANTS


def cpu_flags() -> set[str]:
    """This CPU's feature flags as the kernel lists them (/proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and ":" in line:
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runnable_variants(cpu_flags: set[str], machine: str | None = None) -> list[str]:
    """The variants whose required CPU flags are all in cpu_flags, best first."""
    return [name for name, (_, needed) in variants(machine).items() if needed <= cpu_flags]


def select_variant(cpu_flags: set[str], machine: str | None = None) -> str:
    """The best variant whose required CPU flags are all in cpu_flags ("portable" always fits)."""
    return (runnable_variants(cpu_flags, machine) or ["portable"])[0]


def source_hash() -> str:
    """sha256 (16 hex digits) of the sources and headers: what a build was made from."""
    h = hashlib.sha256()
    for p in (*SOURCES, *headers()):
        h.update(p.name.encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def defines(variant: str, digest: str) -> list[str]:
    """What version.c reports back: the variant's name and the sources' hash."""
    return [f'-DSARATHI_KERNELS_VARIANT="{variant}"', f'-DSARATHI_KERNELS_SOURCE_HASH="{digest}"']
