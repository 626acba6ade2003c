"""The native CPU kernels: the C sources in csrc/ (beside this file), built into one shared
library (at install, per instruction-set level; or here, on first use), and their Python entry
points.

The sources, each bound in one place (EXPORTS: the functions it exports and their C types):
  paged_decode.c      decode attention on the paged KV cache (paged_decode_attention)
  chunk_attention.c   a prefill chunk's causal attention on the paged KV cache (chunk_attention)
  int8_linear.c       the weight-only int8 linear layer (int8_linear)
  cpu_ops.c           the fused elementwise ops of a layer (rms_norm, rotary_, silu_mul, write_kv)
  gguf_linear.c       linear layers on GGUF blocks, fp32 dots (gguf_linear, gguf_dequantize)
  gguf_q8.c           the same with integer dots, llama.cpp's method (gguf_linear_q8,
                      gguf_quantize_act), run by its kernel families: gguf_scalar.c (the scalar
                      reference of both GGUF paths), gguf_q8_tiles.c, gguf_q8_rowlane.c,
                      gguf_q8_toklane_avx2.c and gguf_q8_toklane_avx512.c (their own C
                      interface, hidden in the library)
  decode_stack.c      a decode step through every layer in one call (decode_stack)
common.h holds what the sources share (exp's polynomial, horizontal sums, the threads' split);
attention_simd.h what the two attention sources share; gguf_blocks.h and gguf_q8.h what the GGUF
sources share.

Arguments: every entry point checks what the C side cannot (dtypes, devices, layouts, shapes)
and raises ValueError before calling it. The checks are Python attribute reads, as costly as a
small kernel at decode sizes, so the entry points a layer calls per step take check=False: the
caller then guarantees the documented contract, having checked it once (the weights when a layer
is processed; the activations' layout by the backend's own cheaper guard). An argument outside
the contract with check=False is undefined behaviour (memory).

Builds (kernel_sources.py): the installed package carries one library per instruction-set level,
built at install (setup.py); _load() takes the best one this CPU runs, if it was built from the
sources beside it (version.c reports the sources' hash). Otherwise (a checkout without `make
kernels`, a developer's edit, or SARATHI_NATIVE_BUILD=jit) it builds one here: `$SARATHI_CC`
(default gcc) -O3 -march=native -fopenmp -fPIC, one compiler process per source, in parallel,
linked with -shared (-march=$SARATHI_NATIVE_MARCH when set: tests build the scalar path with
x86-64), into `$SARATHI_CACHE_DIR` (default `$XDG_CACHE_HOME/sarathi` or `~/.cache/sarathi`)
under a name keyed by a hash of the sources and headers, compiler, flags and this CPU's flags, so
a changed kernel or another machine never reuses a stale library. That library is built in a
temporary folder and renamed into place, so concurrent processes (parallel tests, several
workers) may race to build it safely: the loser's rename replaces an identical file.
build_note() says which build runs and why (the worker's backend line carries it).

OpenMP: the library needs libgomp.so.1; torch's wheel bundles one with the same soname and is
imported first, so the dynamic loader reuses torch's runtime: one thread pool, no two runtimes
spinning against each other.

Fallback: with neither a prebuilt library nor a compiler, a failed build or load, or SARATHI_NATIVE_ATTENTION=0,
available() returns False (the reason is logged once, and kept in unavailable_reason()) and
callers stay on the pure-torch paths. Nothing here raises at import time.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from worker_svc.backends.cpu import kernel_sources

log = logging.getLogger(__name__)

_P, _I, _L, _F, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_char_p
# Each C source, in link order, and the functions it exports: name -> (argument types, result
# type). The GGUF kernel families export nothing: gguf_linear_q8 calls them inside the library.
EXPORTS: dict[str, dict[str, tuple[list, type]]] = {
    "paged_decode.c": {
        "paged_decode_attention_split": ([_P, _I, _L, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _P, _I,
                                          _L, _I, _I], _I),
        "paged_decode_isa": ([], _S),
    },
    "int8_linear.c": {
        "int8_linear": ([_P, _L, _P, _P, _P, _P, _L, _I, _I, _I, _I], _I),
        "int8_linear_isa": ([], _S),
    },
    "cpu_ops.c": {
        "cpu_rms_norm": ([_P, _L, _P, _L, _P, _L, _P, _L, _P, _I, _I, _F, _I, _I], _I),
        "cpu_rotary": ([_P, _L, _P, _L, _P, _P, _I, _I, _I, _I, _I, _I], _I),
        "cpu_silu_mul": ([_P, _L, _P, _L, _I, _I, _I, _I], _I),
        "cpu_write_kv": ([_P, _L, _P, _L, _I, _P, _P, _I, _P, _L, _I, _I, _I], _I),
        "cpu_write_kv_supports": ([_I, _I], _I),
        "cpu_ops_isa": ([], _S),
    },
    "gguf_linear.c": {
        "gguf_linear": ([_I, _P, _L, _P, _L, _P, _P, _L, _I, _I, _I, _I, _I], _I),
        "gguf_dequantize": ([_I, _P, _L, _P, _I, _I, _I, _I], _I),
        "gguf_linear_supports": ([_I], _I),
        "gguf_linear_isa": ([], _S),
    },
    "gguf_scalar.c": {},
    "gguf_q8.c": {
        "gguf_linear_q8": ([_I, _P, _L, _P, _L, _P, _P, _L, _I, _I, _I, _I, _I, _I], _I),
        "gguf_quantize_act": ([_P, _L, _I, _I, _P, _L, _L, _P, _P, _I, _I], _I),
        "gguf_q8_lanes": ([], _I),
        "gguf_q8_isa": ([], _S),
    },
    "gguf_q8_tiles.c": {},
    "gguf_q8_rowlane.c": {},
    "gguf_q8_toklane_avx2.c": {},
    "gguf_q8_toklane_avx512.c": {},
    "decode_stack.c": {
        "cpu_decode_stack_fields": ([], _I),
        "cpu_decode_stack": ([_P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _P, _P, _P, _P, _I, _L, _I, _P, _I, _P, _P, _F,
                              _I, _I, _I, _P], _I),
    },
    "chunk_attention.c": {
        "paged_chunk_attention": ([_P, _I, _L, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _L, _I], _I),
    },
}
EXPORTS["version.c"] = {"sarathi_kernels_variant": ([], _S), "sarathi_kernels_source_hash": ([], _S)}
assert list(EXPORTS) == kernel_sources.SOURCE_NAMES, "kernel_sources.SOURCE_NAMES and EXPORTS list the same files"
CSRC = kernel_sources.CSRC
SOURCES = kernel_sources.SOURCES
HEADERS = kernel_sources.headers()          # internal headers: part of the build's key
PACKAGE_DIR = Path(__file__).resolve().parent

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None                  # why the library is unavailable; None = not tried yet
_tried = False
_build_note = ""                            # which build is loaded and why (build_note())


# ---------------------------------------------------------------------------------------------
# Build and load
# ---------------------------------------------------------------------------------------------
def _cache_dir() -> Path:
    if os.environ.get("SARATHI_CACHE_DIR"):
        return Path(os.environ["SARATHI_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sarathi"


def _cpu_flags() -> str:
    """-march=native code only runs on a CPU with the same features: they are part of the key."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _compiler() -> str:
    return os.environ.get("SARATHI_CC", "gcc")


def _arch_flags() -> list[str]:
    """-march for a build here: SARATHI_NATIVE_MARCH when set, else the flags of the variant
    SARATHI_NATIVE_VARIANT names (so a forced variant means the same code, prebuilt or not), else
    -march=native."""
    if os.environ.get("SARATHI_NATIVE_MARCH"):
        return [f"-march={os.environ['SARATHI_NATIVE_MARCH']}"]
    forced = os.environ.get("SARATHI_NATIVE_VARIANT")
    if forced in kernel_sources.variants():
        return kernel_sources.variants()[forced][0]
    return ["-march=native"]


def _flags() -> list[str]:
    """The compiler's flags, for compiling a source (with -c) and for linking the library (the
    flags of a one-command build of the sources into a library)."""
    return ["-O3", *_arch_flags(), "-fopenmp", "-shared", "-fPIC"]


def prebuilt_path(variant: str) -> Path | None:
    """The library of `variant` installed with the package (setup.py), None when not built."""
    found = sorted(PACKAGE_DIR.glob(f"_kernels_{variant.replace('-', '_')}.*so"))
    return found[0] if found else None


def library_path() -> Path:
    """Where the library built here for the current sources/compiler/flags/CPU lives (built or not)."""
    h = hashlib.sha256()
    for part in (*(p.read_bytes() for p in (*SOURCES, *HEADERS)), _compiler().encode(), " ".join(_flags()).encode(),
                 _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return _cache_dir() / f"paged_decode-{h.hexdigest()[:16]}.so"


def _compile(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")


def _build(target: Path) -> None:
    """Compile SOURCES (a compiler process each, as many at once as there are cores) and link them
    into target atomically; raises with the compiler's message on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    defines = kernel_sources.defines("native", kernel_sources.source_hash())
    with tempfile.TemporaryDirectory(prefix=target.name + ".", suffix=".tmp", dir=target.parent) as tmp:
        objects = [os.path.join(tmp, src.stem + ".o") for src in SOURCES]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(_compile, ([_compiler(), *_flags(), *defines, "-c", "-o", obj, str(src)]
                                     for src, obj in zip(SOURCES, objects))))
        lib = os.path.join(tmp, target.name)
        _compile([_compiler(), *_flags(), "-o", lib, *objects])
        os.replace(lib, target)


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))    # CDLL releases the GIL during calls
    for exports in EXPORTS.values():
        for name, (argtypes, restype) in exports.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    return lib


def _load() -> tuple[ctypes.CDLL, str]:
    """(library, what was loaded and why). The prebuilt variant for this CPU when one is installed
    and was built from these sources; else a build here into the cache. SARATHI_NATIVE_BUILD=jit
    (or an explicit SARATHI_NATIVE_MARCH) skips the prebuilt ones, =prebuilt refuses to build;
    SARATHI_NATIVE_VARIANT=NAME picks a variant (built here with its flags when not installed)."""
    mode = os.environ.get("SARATHI_NATIVE_BUILD", "auto")
    if mode not in ("auto", "jit", "prebuilt"):
        raise ValueError(f"SARATHI_NATIVE_BUILD={mode!r}: choose auto, prebuilt or jit")
    forced = os.environ.get("SARATHI_NATIVE_VARIANT")
    if forced and forced not in kernel_sources.variants():
        raise ValueError(f"SARATHI_NATIVE_VARIANT={forced!r}: choose one of {', '.join(kernel_sources.variants())}")
    stale = ""
    if mode != "jit" and not os.environ.get("SARATHI_NATIVE_MARCH"):
        flags = kernel_sources.cpu_flags()
        variant = forced or kernel_sources.select_variant(flags)
        path = prebuilt_path(variant)
        if path is not None:
            lib = _open(path)
            if lib.sarathi_kernels_source_hash().decode() == kernel_sources.source_hash():
                why = "asked for by SARATHI_NATIVE_VARIANT" if forced else _why(variant, flags)
                return lib, f"kernels: prebuilt {variant} variant ({why})"
            stale = f"the installed {variant} kernels are older than the sources"
        else:
            stale = f"no prebuilt {variant} kernels installed"
        if mode == "prebuilt":
            raise RuntimeError(f"{stale} and SARATHI_NATIVE_BUILD=prebuilt forbids a build here")
    path = library_path()
    if not path.exists():
        _build(path)
    what = f"the {forced} variant's flags" if forced and not os.environ.get("SARATHI_NATIVE_MARCH") \
        else " ".join(_arch_flags())
    return _open(path), f"kernels: built here ({what}" + (f"; {stale})" if stale else ")")


def _why(variant: str, flags: set[str]) -> str:
    """Why select_variant chose `variant`: what the CPU has, and what the next better one needs."""
    names = list(kernel_sources.variants())
    better = names[:names.index(variant)]
    lacking = [f"{b} needs {', '.join(sorted(kernel_sources.variants()[b][1] - flags))}" for b in better]
    return "the best this CPU runs" + (f": {'; '.join(lacking)}" if lacking else "")


def available() -> bool:
    """True when the library is built and loaded (first call builds; later calls are free)."""
    global _lib, _reason, _tried
    if _tried:
        return _lib is not None
    with _lock:
        if not _tried:
            if os.environ.get("SARATHI_NATIVE_ATTENTION", "1") == "0":
                _reason = "disabled by SARATHI_NATIVE_ATTENTION=0"
            else:
                try:
                    _lib, note = _load()
                    _set_build_note(note)
                except Exception as e:    # any build/load problem means: use the torch path
                    _reason = f"native kernels unavailable, using torch: {e}"
                    log.warning(_reason)
            _tried = True
    return _lib is not None


def _set_build_note(note: str) -> None:
    global _build_note
    _build_note = note


def build_note() -> str:
    """Which build of the kernels is loaded and why, e.g. "kernels: prebuilt avx2 variant (the
    best this CPU runs: avx512-vnni needs avx512_vnni, ...)" ("" before available())."""
    return _build_note


def unavailable_reason() -> str | None:
    """Why available() is False (None when it is True or was not called yet)."""
    return _reason


def _reset() -> None:
    """Forget the load result so the next available() tries again (tests only)."""
    global _lib, _reason, _tried
    global _build_note
    with _lock:
        _lib, _reason, _tried, _build_note = None, None, False, ""


def _require() -> None:
    if not available():
        raise RuntimeError(f"native kernels unavailable: {_reason}")


def _threads(num_threads: int | None) -> int:
    return num_threads or torch.get_num_threads()


# ---------------------------------------------------------------------------------------------
# Paged decode attention (csrc/paged_decode.c)
# ---------------------------------------------------------------------------------------------
MAX_D, MAX_G = 256, 64                      # MAX_D and MAX_ROWS of the kernel
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}                        # q and out
_KV_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the KV cache


def isa() -> str:
    """The SIMD path the loaded decode kernel runs: "avx512", "avx2" or "scalar" (or "" when
    the library is not available)."""
    return _lib.paged_decode_isa().decode() if available() else ""


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention accepts this q [T, Hq, D] (and an out shaped like it) and
    cache: dtypes, devices, head counts, layout. No build is attempted."""
    if q.dim() != 3 or k_cache.dim() != 4:
        return False
    num_heads, dim = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    return (q.device.type == "cpu" and k_cache.device.type == "cpu"
            and q.dtype in _DTYPE_CODE and k_cache.dtype in _KV_DTYPE_CODE
            and k_cache.shape[3] == dim and 1 <= dim <= MAX_D and k_cache.is_contiguous()
            and num_heads % hkv == 0 and num_heads // hkv <= MAX_G
            and q.stride(2) == 1 and q.stride(1) == dim)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, rows: torch.Tensor | None = None,
                           num_threads: int | None = None, split_blocks: int = 0) -> torch.Tensor:
    """out[rows[b]] = softmax(scale * q[rows[b]] . K_b^T) V_b for every sequence b.

    q, out: [T, Hq, D] fp32 or bf16, heads/dims contiguous (any row stride); without rows,
    T == B and row b is sequence b. k_cache, v_cache: [num_blocks, bs, Hkv, D] contiguous, fp32,
    bf16 or fp16 (same dtype; independent of q's). block_tables [B, nb] int32: sequence b's keys are positions
    0 .. context_lens[b] - 1 in blocks block_tables[b, :ceil(len / bs)] (the rest is ignored).
    context_lens [B] int32. rows [B] int32 or None. scale: softmax scale (1/sqrt(D) usually).
    Accumulation is fp32. Threads: torch.get_num_threads() unless given (the kernel uses fewer
    on little K/V). split_blocks > 0 cuts every context into runs of that many blocks, merged
    after (tests; 0: the kernel splits only when threads outnumber sequences). Call available()
    first: this raises RuntimeError when the kernel is not loaded. Returns out.
    """
    if not available():
        raise RuntimeError(f"native attention unavailable: {_reason}")
    B = block_tables.shape[0]
    _, bs, hkv, dim = k_cache.shape
    num_heads = q.shape[1]
    if not supports(q, k_cache) or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"unsupported shapes/dtypes: q {tuple(q.shape)} {q.dtype}, "
                         f"k {tuple(k_cache.shape)} {k_cache.dtype}, v {tuple(v_cache.shape)} {v_cache.dtype}")
    if out.dtype not in _DTYPE_CODE or out.shape[1:] != q.shape[1:]:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match q {tuple(q.shape)}")
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != dim:
            raise ValueError(f"{name} must have contiguous heads and dims, strides {t.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens), ("rows", rows)):
        if t is not None and (t.dtype != torch.int32 or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous int32 tensor")
    if context_lens.shape != (B,) or (rows is not None and rows.shape != (B,)):
        raise ValueError("context_lens and rows must be [B]")
    if rows is None and q.shape[0] != B:
        raise ValueError(f"q has {q.shape[0]} rows for {B} sequences and no rows index")
    rc = _lib.paged_decode_attention_split(
        q.data_ptr(), _DTYPE_CODE[q.dtype], q.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), _KV_DTYPE_CODE[k_cache.dtype],
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
        rows.data_ptr() if rows is not None else None,
        B, num_heads, hkv, dim, bs, float(scale),
        out.data_ptr(), _DTYPE_CODE[out.dtype], out.stride(0),
        num_threads if num_threads is not None else torch.get_num_threads(), int(split_blocks))
    if rc != 0:
        raise ValueError(f"kernel rejected the shapes (rc={rc})")
    return out


# ---------------------------------------------------------------------------------------------
# Prefill-chunk attention (csrc/chunk_attention.c)
# ---------------------------------------------------------------------------------------------
def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    start_pos: int, scale: float, out: torch.Tensor, num_threads: int | None = None,
                    check: bool = True) -> bool:
    """out[i] = softmax(scale * q[i] . K^T) V over keys 0 .. start_pos + i, for the n = q.shape[0]
    tokens of one chunk (query i at position start_pos + i), K/V read from the paged cache.

    q, out: [n, Hq, D] fp32 or bf16, heads/dims contiguous (any row stride). k_cache, v_cache:
    [num_blocks, bs, Hkv, D] contiguous, fp32, bf16 or fp16 (same dtype). table: [>= ceil((start_pos
    + n) / bs)] int32 contiguous, the sequence's block ids. Accumulation is fp32. Returns False (out
    untouched) where this build's kernel does not take the layout (no SIMD path; D not a multiple
    of two vectors: 32 floats on AVX-512 builds, 16 on AVX2 ones): the caller runs its own path. check=False skips
    the argument checks (the caller guarantees the contract, see the module docstring)."""
    _require()
    n, hq, dim = q.shape
    _, bs, hkv, _ = k_cache.shape
    if check:
        if not supports(q, k_cache) or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype \
                or not v_cache.is_contiguous():
            raise ValueError(f"unsupported shapes/dtypes: q {tuple(q.shape)} {q.dtype}, "
                             f"k {tuple(k_cache.shape)} {k_cache.dtype}, v {tuple(v_cache.shape)} {v_cache.dtype}")
        if out.dtype not in _DTYPE_CODE or out.shape != q.shape or out.stride(2) != 1 or out.stride(1) != dim:
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match q {tuple(q.shape)}")
        if table.dtype != torch.int32 or not table.is_contiguous() or table.dim() != 1:
            raise ValueError("table must be a contiguous 1-D int32 tensor")
        if start_pos < 0 or table.shape[0] * bs < start_pos + n:
            raise ValueError(f"table of {table.shape[0]} blocks does not cover {start_pos + n} positions")
    rc = _lib.paged_chunk_attention(
        q.data_ptr(), _DTYPE_CODE[q.dtype], q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        _KV_DTYPE_CODE[k_cache.dtype], table.data_ptr(), int(start_pos), n, hq, hkv, dim, bs, float(scale),
        out.data_ptr(), _DTYPE_CODE[out.dtype], out.stride(0), _threads(num_threads))
    if rc == -2:
        raise MemoryError("chunk attention could not allocate its packed K/V")
    return rc == 0


# ---------------------------------------------------------------------------------------------
# Weight-only int8 linear layer (csrc/int8_linear.c)
# ---------------------------------------------------------------------------------------------
def int8_isa() -> str:
    """The path the loaded int8 linear kernel runs: "avx2" or "scalar" ("" when unavailable)."""
    return _lib.int8_linear_isa().decode() if available() else ""


def _check_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    _require()
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU fp32 [T, K] tensor with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    N, K = qweight.shape
    if (qweight.dtype != torch.int8 or not qweight.is_contiguous() or x.shape[1] != K
            or scale.dtype != torch.float32 or scale.shape != (N,) or not scale.is_contiguous()):
        raise ValueError(f"qweight must be contiguous int8 [N, K={x.shape[1]}] with fp32 scale [N], got "
                         f"{tuple(qweight.shape)} {qweight.dtype}, {tuple(scale.shape)} {scale.dtype}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous fp32 [{N}]")


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                num_threads: int | None = None, *, check: bool = True) -> torch.Tensor:
    """x [T, K] fp32 (rows may be strided, K contiguous) @ (qweight [N, K] int8 * scale [N, 1]).T
    (+ bias [N] fp32) -> [T, N] fp32 new tensor; fp32 accumulation (csrc/int8_linear.c).
    check=False: the caller guarantees that contract (cpu/quant.py: the weights made so by process())."""
    if check:
        _check_int8(x, qweight, scale, bias)
    N, K = qweight.shape
    out = torch.empty(x.shape[0], N, dtype=torch.float32)
    _lib.int8_linear(x.data_ptr(), x.stride(0), qweight.data_ptr(), scale.data_ptr(),
                     bias.data_ptr() if bias is not None else None, out.data_ptr(), N,
                     x.shape[0], N, K, _threads(num_threads))
    return out


# ---------------------------------------------------------------------------------------------
# Fused CPU ops (csrc/cpu_ops.c): RMSNorm (+ residual add), rotary in place, silu(gate) * up,
# the paged KV write. Used through worker_svc.backends.cpu.NativeCpuOps and NativeCpuAttention;
# each function equals the torch reference in worker_svc.backends.base.Ops (see cpu_ops.c for
# the exact numerics).
# ---------------------------------------------------------------------------------------------
_OPS_DTYPE = {torch.float32: 0, torch.bfloat16: 1}      # compute dtypes of the ops


def ops_isa() -> str:
    """The SIMD path of the fused ops: "avx2" or "scalar" ("" when the library is unavailable)."""
    return _lib.cpu_ops_isa().decode() if available() else ""


def _rows(t: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> None:
    """t is a CPU [T, N] tensor of an ops dtype with contiguous rows (any row stride)."""
    if (t.dim() != 2 or t.device.type != "cpu" or t.dtype not in _OPS_DTYPE
            or (dtype is not None and t.dtype != dtype) or (t.shape[1] > 1 and t.stride(1) != 1)):
        raise ValueError(f"{name} must be a CPU fp32/bf16 [T, N] tensor with contiguous rows"
                         f"{'' if dtype is None else f' of {dtype}'}, got {tuple(t.shape)} {t.dtype} "
                         f"strides {t.stride()}")


def _check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    _require()
    _rows(x, "x")
    T, H = x.shape
    if weight.dtype != x.dtype or weight.shape != (H,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{H}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if residual is not None:
        _rows(residual, "residual", x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             num_threads: int | None = None, *, check: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H] fp32/bf16 (contiguous rows, any row stride), weight [H] contiguous, same dtype.
    Without residual: (rmsnorm(x) * weight, None). With residual [T, H]: r = residual + x is
    written into residual (in place) and the result is (rmsnorm(r) * weight, residual).
    rmsnorm(r) = r / sqrt(mean(r^2) + eps), computed in fp32 like HF. Returns a new [T, H].
    check=False: the caller guarantees that contract (NativeCpuOps, after its own guard)."""
    if check:
        _check_rms_norm(x, weight, residual)
        eps = float(eps)
    T, H = x.shape
    out = torch.empty(T, H, dtype=x.dtype)
    if residual is None:
        _lib.cpu_rms_norm(x.data_ptr(), x.stride(0), None, 0, None, 0, out.data_ptr(), H,
                          weight.data_ptr(), T, H, eps, _OPS_DTYPE[x.dtype], _threads(num_threads))
        return out, None
    rp, rs = residual.data_ptr(), residual.stride(0)
    _lib.cpu_rms_norm(x.data_ptr(), x.stride(0), rp, rs, rp, rs, out.data_ptr(), H,
                      weight.data_ptr(), T, H, eps, _OPS_DTYPE[x.dtype], _threads(num_threads))
    return out, residual


def _check_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _require()
    T, hq, D = q.shape
    for name, t in (("q", q), ("k", k)):
        if (t.dim() != 3 or t.device.type != "cpu" or t.dtype != q.dtype or q.dtype not in _OPS_DTYPE
                or t.shape[0] != T or t.shape[2] != D or t.stride(2) != 1 or t.stride(1) != D):
            raise ValueError(f"{name} must be a CPU fp32/bf16 [T={T}, H, D={D}] tensor with contiguous "
                             f"heads, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != q.dtype or t.numel() != T * D or t.shape[-1] != D or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [T, D] {q.dtype}, got {tuple(t.shape)} {t.dtype}")
    if D % 2:
        raise ValueError(f"rotary needs an even head dim, got {D}")


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            num_threads: int | None = None, *, check: bool = True) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (HF rotate_half: q * cos + rotate_half(q) *
    sin), heads and dims contiguous (any row stride); cos, sin [T, D] or [T, 1, D] contiguous of
    q's dtype (fp32/bf16), D even. check=False: the caller guarantees that contract."""
    if check:
        _check_rotary(q, k, cos, sin)
    T, hq, D = q.shape
    _lib.cpu_rotary(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
                    T, hq, k.shape[1], D, _OPS_DTYPE[q.dtype], _threads(num_threads))


def silu_mul(x: torch.Tensor, num_threads: int | None = None, *, check: bool = True) -> torch.Tensor:
    """x [T, 2 * I] fp32/bf16 (contiguous rows) -> silu(x[:, :I]) * x[:, I:], a new [T, I].
    check=False: the caller guarantees that contract."""
    if check:
        _require()
        _rows(x, "x")
        if x.shape[1] % 2:
            raise ValueError(f"x must have an even number of columns (gate, up), got {x.shape[1]}")
    T, two_i = x.shape
    out = torch.empty(T, two_i // 2, dtype=x.dtype)
    _lib.cpu_silu_mul(x.data_ptr(), x.stride(0), out.data_ptr(), two_i // 2, T, two_i // 2,
                      _OPS_DTYPE[x.dtype], _threads(num_threads))
    return out


def write_kv_supports(src_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether write_kv casts src_dtype (fp32/bf16) to cache_dtype on this build."""
    return (available() and src_dtype in _OPS_DTYPE and cache_dtype in _KV_DTYPE_CODE
            and bool(_lib.cpu_write_kv_supports(_OPS_DTYPE[src_dtype], _KV_DTYPE_CODE[cache_dtype])))


def _check_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor) -> None:
    if not write_kv_supports(k.dtype, k_cache.dtype):
        raise ValueError(f"write_kv does not cast {k.dtype} to {k_cache.dtype} here")
    T, hkv, D = k.shape
    for name, t in (("k", k), ("v", v)):
        if (t.dim() != 3 or t.dtype != k.dtype or t.shape != k.shape or t.stride(2) != 1
                or t.stride(1) != D or t.device.type != "cpu"):
            raise ValueError(f"{name} must be [T, Hkv, D] {k.dtype} with contiguous heads, got "
                             f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype != k_cache.dtype or c.shape != k_cache.shape or not c.is_contiguous() \
                or c.dim() != 4 or c.shape[2:] != (hkv, D):
            raise ValueError(f"{name} must be contiguous [blocks, bs, {hkv}, {D}], got {tuple(c.shape)}")
    if slots.dtype != torch.int64 or slots.shape != (T,) or not slots.is_contiguous():
        raise ValueError(f"slots must be contiguous int64 [{T}]")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, *, check: bool = True) -> None:
    """k_cache.view(-1, Hkv, D)[slots] = k.to(cache dtype), same for v (PagedKVCache.write):
    k, v [T, Hkv, D] fp32/bf16 with contiguous heads (any row stride); caches contiguous
    [num_blocks, bs, Hkv, D] fp32/bf16/fp16; slots [T] int64 contiguous. A slot outside the
    cache raises ValueError before anything is written (checked in C, with check=False too).
    check=False: the caller guarantees the rest of that contract (NativeCpuAttention)."""
    if check:
        _check_write_kv(k, v, k_cache, v_cache, slots)
    T, hkv, D = k.shape
    rc = _lib.cpu_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), _OPS_DTYPE[k.dtype],
                           k_cache.data_ptr(), v_cache.data_ptr(), _KV_DTYPE_CODE[k_cache.dtype],
                           slots.data_ptr(), k_cache.shape[0] * k_cache.shape[1], T, hkv, D)
    if rc == -2:
        raise ValueError("a slot is outside the KV cache")
    if rc != 0:
        raise ValueError(f"cpu_write_kv rejected the arguments (rc={rc})")


# ---------------------------------------------------------------------------------------------
# GGUF block kernels (csrc/gguf_*.c): linear layers on the file's own quantized blocks
# ---------------------------------------------------------------------------------------------
def gguf_isa() -> str:
    """The fastest path of the GGUF block kernels here: "avx2" or "scalar" ("" when unavailable)."""
    return _lib.gguf_linear_isa().decode() if available() else ""


def gguf_q8_isa() -> str:
    """The instructions of the integer-dot GGUF path here: "avx512vnni" (vpdpbusd), "avx2" (maddubs)
    or "scalar" ("" when the library is unavailable)."""
    return _lib.gguf_q8_isa().decode() if available() else ""


def gguf_q8_lanes() -> bool:
    """Whether gguf_linear_q8 has the lane kernels here (the row-lane kernel for small calls, a
    token-lane kernel above: AVX-512 VNNI or AVX2 builds, not the scalar one): one fp32 summation
    order for every call size and both builds, another than the 8-token tile kernels'
    (lanes=False). Either way a token's result does not depend on its batch. False: lanes changes
    nothing."""
    return bool(_lib.gguf_q8_lanes()) if available() else False


def gguf_supports(ggml_type: int) -> bool:
    """Whether the block kernels take this ggml type code (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)."""
    return available() and bool(_lib.gguf_linear_supports(int(ggml_type)))


def _check_blocks(ggml_type: int, w: torch.Tensor) -> None:
    _require()
    if not gguf_supports(ggml_type):
        raise ValueError(f"no GGUF block kernel for ggml type {ggml_type}")
    if w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous() or w.device.type != "cpu":
        raise ValueError(f"w must be contiguous uint8 [N, row_bytes] on the CPU, got {tuple(w.shape)} {w.dtype}")


def _check_linear(ggml_type: int, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor | None = None) -> None:
    """What both GGUF linear kernels take: x a CPU fp32 [T, K] with contiguous rows, the blocks,
    bias None or contiguous fp32 [N], out None or a CPU fp32 [T, N] with contiguous rows."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU fp32 [T, K] tensor with contiguous rows, got {tuple(x.shape)} {x.dtype}")
    _check_blocks(ggml_type, w)
    N = w.shape[0]
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous fp32 [{N}]")
    if out is not None and (out.dtype != torch.float32 or out.shape != (x.shape[0], N) or out.stride(1) != 1
                            or out.device.type != "cpu"):
        raise ValueError(f"out must be a CPU fp32 [{x.shape[0]}, {N}] tensor with contiguous rows")


def gguf_linear(ggml_type: int, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
                num_threads: int | None = None, force_scalar: bool = False, *, check: bool = True) -> torch.Tensor:
    """x [T, K] fp32 (contiguous elements) @ W.T (+ bias [N] fp32) -> [T, N] fp32, W the GGUF
    blocks w [N, row_bytes] uint8 of ggml type `ggml_type` (see csrc/gguf_linear.c): F.linear on
    gguf.quants.dequantize(w) up to fp32 summation order. force_scalar runs the scalar path.
    check=False: the caller guarantees the tensors' part of that contract (cpu/gguf.py: the
    blocks kept by process()); the kernel still checks the type against w's shape and K."""
    if check:
        _check_linear(ggml_type, w, x, bias)
    T, K = x.shape
    N = w.shape[0]
    out = torch.empty(T, N, dtype=torch.float32)
    rc = _lib.gguf_linear(ggml_type, w.data_ptr(), w.shape[1], x.data_ptr(), x.stride(0),
                          None if bias is None else bias.data_ptr(), out.data_ptr(), N, T, N, K,
                          _threads(num_threads), int(force_scalar))
    if rc != 0:
        raise ValueError(f"gguf_linear rejected type {ggml_type}, w {tuple(w.shape)}, K={K} (rc={rc})")
    return out


def gguf_dequantize(ggml_type: int, w: torch.Tensor, K: int, num_threads: int | None = None,
                    force_scalar: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """The GGUF blocks w [N, row_bytes] as fp32 [N, K]: bit-identical to gguf.quants.dequantize.
    out: an fp32 [N, K] contiguous tensor to write into (None: a new one)."""
    _check_blocks(ggml_type, w)
    N = w.shape[0]
    if out is None:
        out = torch.empty(N, K, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != (N, K) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous fp32 [{N}, {K}]")
    rc = _lib.gguf_dequantize(ggml_type, w.data_ptr(), w.shape[1], out.data_ptr(), N, K,
                              _threads(num_threads), int(force_scalar))
    if rc != 0:
        raise ValueError(f"gguf_dequantize rejected type {ggml_type}, w {tuple(w.shape)}, K={K} (rc={rc})")
    return out


def _q8_flags(force_scalar: bool, lanes: bool) -> int:
    """gguf_linear_q8's flags (csrc/gguf_q8.c: GG_Q8_SCALAR 1, GG_Q8_LANES 2)."""
    return int(bool(force_scalar)) | (2 if lanes else 0)


def gguf_linear_q8(ggml_type: int, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
                   num_threads: int | None = None, force_scalar: bool = False, parts: int = 1,
                   lanes: bool = True, out: torch.Tensor | None = None, *, check: bool = True) -> torch.Tensor:
    """gguf_linear on the integer-dot path (csrc/gguf_q8.c, gguf_linear_q8): each token's x
    quantized to 8-bit blocks of 32 (gguf_quantize_act; parts=2: a second 7-bit part of the
    rounding remainder, two integer dots per run), integer dots with the file's blocks, fp32
    scales. F.linear on the exact dequantization up to the activation rounding. lanes: the lane
    kernels where built (gguf_q8_lanes; the serving default), else the 8-token tile kernels.
    out: an fp32 [T, N] tensor with contiguous rows to write into (None: a new one).
    check=False: the caller guarantees the tensors' part of that contract and parts in (1, 2)
    (cpu/gguf.py: the blocks kept by process()); the kernel still checks the type against w's
    shape and K."""
    if check:
        _check_linear(ggml_type, w, x, bias, out)
        if parts not in (1, 2):
            raise ValueError(f"parts must be 1 or 2, got {parts}")
    T, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty(T, N, dtype=torch.float32)
    rc = _lib.gguf_linear_q8(ggml_type, w.data_ptr(), w.shape[1], x.data_ptr(), x.stride(0),
                             None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), T, N, K,
                             _threads(num_threads), parts, _q8_flags(force_scalar, lanes))
    if rc != 0:
        raise ValueError(f"gguf_linear_q8 rejected type {ggml_type}, w {tuple(w.shape)}, K={K} (rc={rc})")
    return out


def gguf_quantize_act(x: torch.Tensor, force_scalar: bool = False, parts: int = 1):
    """The integer-dot path's activation quantization of x [T, K] fp32 (K a multiple of 32), per
    block of 32 with v = x * (127 / amax) (fp32): parts=1 -> (q = rint(v) int8 [T, K],
    d = amax / 127, s = d * sum(q)) with d, s fp32 [T, K/32]; parts=2 -> (q, q_lo = rint((v - q) * 128),
    d = amax / 127 / 128, s = d * sum(128 q + q_lo)), so x ~ d (128 q + q_lo)."""
    _require()
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] % 32 or parts not in (1, 2):
        raise ValueError(f"x must be fp32 [T, K] with contiguous rows and K % 32 == 0, got {tuple(x.shape)}")
    T, K = x.shape
    q = torch.empty(T, parts, K, dtype=torch.int8)
    d = torch.empty(T, K // 32, dtype=torch.float32)
    s = torch.empty(T, K // 32, dtype=torch.float32)
    _lib.gguf_quantize_act(x.data_ptr(), x.stride(0), T, K, q.data_ptr(), parts * K, K if parts == 2 else 0,
                           d.data_ptr(), s.data_ptr(), parts, int(force_scalar))
    return (q[:, 0], d, s) if parts == 1 else (q[:, 0], q[:, 1], d, s)


# ---------------------------------------------------------------------------------------------
# The decode stack (csrc/decode_stack.c): a decode-only step through all decoder layers in one
# call, the same kernels as the per-layer path (used by worker_svc.backends.cpu.stack)
# ---------------------------------------------------------------------------------------------
# cpu_decode_stack's error codes (STACK_NOMEM, STACK_STEP in csrc/decode_stack.c) and its calls a
# layer, by the index an error code carries
_STACK_NOMEM, _STACK_STEP = -1000, 10000
_STACK_STEPS = {1: "input RMSNorm", 2: "QKV linear", 3: "rotary", 4: "KV write", 5: "decode attention",
                6: "O linear", 7: "post-attention RMSNorm", 8: "gate/up linear", 9: "silu * up", 10: "down linear"}


def decode_stack_fields() -> int:
    """int64 fields per layer of cpu_decode_stack's layer table (see csrc/decode_stack.c)."""
    return _lib.cpu_decode_stack_fields()


def decode_stack(fields: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, kv_dtype: torch.dtype,
                 num_slots: int, block_size: int, tables: torch.Tensor, lens: torch.Tensor,
                 rows: torch.Tensor, heads: tuple[int, int, int], intermediate: int, eps: float,
                 scale: float, parts: int, num_threads: int | None = None, lanes: bool = True) -> None:
    """cpu_decode_stack (csrc/decode_stack.c): fields int64 [L, fields] (the layer table: raw
    pointers), x / residual fp32 [T, H] contiguous (x: input, then the last MLP output; residual:
    written), cos / sin fp32 [T, D] contiguous, slots int64 [T], tables / lens / rows int32 as
    paged_decode_attention takes them, heads = (Hq, Hkv, D). Nothing is checked here: the caller
    (cpu/stack.py) builds every argument. Raises MemoryError when the kernel's buffer cannot be
    allocated, ValueError naming the layer and kernel that rejected the step."""
    T, H = x.shape
    hq, hkv, d = heads
    failed = ctypes.c_int(-1)
    rc = _lib.cpu_decode_stack(fields.data_ptr(), fields.shape[0], T, H, hq, hkv, d, intermediate, eps,
                               x.data_ptr(), residual.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                               slots.data_ptr(), _KV_DTYPE_CODE[kv_dtype], num_slots, block_size,
                               tables.data_ptr(), tables.shape[1], lens.data_ptr(), rows.data_ptr(),
                               scale, parts, _q8_flags(False, lanes), _threads(num_threads),
                               ctypes.byref(failed))
    if rc == 0:
        return
    if rc == _STACK_NOMEM:
        raise MemoryError("cpu_decode_stack: out of memory")
    step = -rc // _STACK_STEP
    code = rc + _STACK_STEP * step
    what = "a slot is outside the KV cache" if step == 4 and code == -2 else f"rc={code}"
    raise ValueError(f"cpu_decode_stack: layer {failed.value}: the {_STACK_STEPS.get(step, step)} "
                     f"kernel rejected the step ({what})")
