"""The kernels' builds: the variants built at install (setup.py), the choice among them at run
time (kernel_sources.select_variant, native._load), and what a worker does without a compiler or
a writable home directory."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.worker.test_gguf_kernels import TYPES, _lane_cases, random_blocks
from worker_svc.backends.cpu import kernel_sources, native

ZEN3 = {"sse2", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16"}
BEST = kernel_sources.select_variant(kernel_sources.cpu_flags())
installed = pytest.mark.skipif(native.prebuilt_path(BEST) is None,
                               reason="no prebuilt kernels in this checkout (make install or make kernels)")


@pytest.mark.parametrize("flags, machine, want", [
    (ZEN4, "x86_64", "avx512-vnni"),
    (ZEN3, "x86_64", "avx2"),
    (ZEN4 - {"avx512_vnni"}, "x86_64", "avx2"),         # Skylake-X: AVX-512 without VNNI
    (ZEN3 - {"fma"}, "x86_64", "portable"),             # AVX2 without FMA is not x86-64-v3
    ({"sse2"}, "x86_64", "portable"),
    (ZEN4, "aarch64", "portable"),                      # another architecture: the portable build
])
def test_select_variant_takes_the_best_the_cpu_runs(flags, machine, want):
    assert kernel_sources.select_variant(flags, machine) == want
    assert want in kernel_sources.variants(machine)


def test_every_variant_is_built_from_one_source_list():
    """setup.py and native.py read one table: the sources native.py binds are the ones built."""
    assert [p.name for p in native.SOURCES] == kernel_sources.SOURCE_NAMES == list(native.EXPORTS)
    assert all(p.exists() for p in native.SOURCES)
    assert len(kernel_sources.source_hash()) == 16


@installed
def test_installed_variant_is_loaded_and_named(fresh_native):
    assert native.available()
    note = native.build_note()
    assert f"prebuilt {BEST} variant" in note and "best this CPU runs" in note
    lib = native._lib
    assert lib.sarathi_kernels_variant().decode() == BEST
    assert lib.sarathi_kernels_source_hash().decode() == kernel_sources.source_hash()
    assert not list(native._cache_dir().glob("*.so"))        # nothing was built


@installed
def test_a_stale_prebuilt_build_is_not_loaded(fresh_native, monkeypatch):
    """A build older than the sources (a developer's edit) is never loaded: with builds here
    forbidden, the kernels are unavailable and the reason says why."""
    monkeypatch.setattr(kernel_sources, "source_hash", lambda: "0" * 16)
    monkeypatch.setenv("SARATHI_NATIVE_BUILD", "prebuilt")
    assert not native.available()
    assert "older than the sources" in native.unavailable_reason()


def test_bad_switches_are_refused_with_the_choices(fresh_native, monkeypatch):
    monkeypatch.setenv("SARATHI_NATIVE_VARIANT", "sse9")
    assert not native.available()
    assert "avx2" in native.unavailable_reason() and "sse9" in native.unavailable_reason()
    native._reset()
    monkeypatch.delenv("SARATHI_NATIVE_VARIANT")
    monkeypatch.setenv("SARATHI_NATIVE_BUILD", "sometimes")
    assert not native.available() and "prebuilt" in native.unavailable_reason()


@installed
def test_no_compiler_and_a_read_only_home_still_run_the_native_kernels(tmp_path):
    """What a container or a plain pip install gives: no compiler on PATH, a home directory that
    cannot be written, no cache dir set. The worker's backend line names the prebuilt variant."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARATHI_", "XDG_"))}
    env.update(HOME=str(home), PATH="/nonexistent", SARATHI_CC="/nonexistent/gcc")
    code = ("from worker_svc.backends.cpu.backend import cpu_backend; "
            "from worker_svc.backends.cpu import native; b = cpu_backend(); "
            "print(b.describe()); assert native.available(), native.unavailable_reason()")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"prebuilt {BEST} variant" in res.stdout and "attention native" in res.stdout, res.stdout
    assert not any(home.iterdir())


def _outputs() -> list[torch.Tensor]:
    """A fixed set of kernel outputs: the GGUF lane kernels at several batch sizes and the
    dequantization of every format."""
    out = [native.gguf_linear_q8(int(qtype), raw, x) for qtype, raw, x in _lane_cases()]
    rng = np.random.default_rng(5)
    for qtype in TYPES:
        raw = torch.from_numpy(random_blocks(qtype, 4, 256, rng))
        out.append(native.gguf_dequantize(int(qtype), raw, 256))
    return out


@pytest.mark.skipif(native.prebuilt_path("portable") is None, reason="no prebuilt portable kernels")
def test_installed_variant_computes_what_a_build_here_computes(fresh_native, monkeypatch):
    """The prebuilt portable variant and a build here with the same -march give the same bits:
    the install and the run-time build compile one source list with one set of flags. (The
    portable level: its build here takes a second; the SIMD variants are the same sources.)"""
    monkeypatch.setenv("SARATHI_NATIVE_VARIANT", "portable")
    assert native.available() and "prebuilt portable" in native.build_note()
    prebuilt = _outputs()
    native._reset()
    monkeypatch.setenv("SARATHI_NATIVE_BUILD", "jit")
    assert native.available() and "built here (the portable variant's flags" in native.build_note()
    for a, b in zip(prebuilt, _outputs(), strict=True):
        assert torch.equal(a, b)
