"""GGUF block kernels (worker_svc/backends/cpu/csrc/gguf_linear.c) against the `gguf` package:
dequantization bit-identical to gguf.quants.dequantize, and the linear layer equal to F.linear
on those weights up to fp32 summation order, on random blocks, odd shapes, every SIMD path."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from worker_svc.backends.cpu import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def paths() -> list[bool]:
    """force_scalar values to run: the scalar path always, the SIMD one when built."""
    return [True] + ([False] if native.gguf_isa() != "scalar" else [])


def random_blocks(qtype, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row_bytes] uint8 of random quants with finite, varied fp16 scales: random bytes
    everywhere, then each block's fp16 scale fields overwritten by sane values (random bytes
    would give inf/nan scales)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    halves = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}[qtype]
    for off in halves:
        h = (rng.standard_normal((n, k // block)) * 0.02).astype(np.float16)
        if off == halves[0]:
            h[0, 0] = np.float16(3e-7)     # a subnormal scale: the exact widening is tested too
        raw[:, :, off:off + 2] = h.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def shapes(qtype) -> list[tuple[int, int]]:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return [(1, block), (7, 3 * block), (13, 5 * block)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_bit_identical_to_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    for n, k in shapes(qtype):
        raw = random_blocks(qtype, n, k, rng)
        ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32))
        for scalar in paths():
            got = native.gguf_dequantize(int(qtype), torch.from_numpy(raw), k, force_scalar=scalar)
            assert torch.equal(got, ref), (qtype.name, n, k, scalar)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_matches_float_gemm_on_dequantized(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    for n, k in shapes(qtype):
        raw = random_blocks(qtype, n, k, rng)
        w = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32))
        for T in (1, 2, 5):
            x = torch.from_numpy(rng.standard_normal((T, k)).astype(np.float32))
            bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
            ref = F.linear(x.double(), w.double(), bias.double())
            for scalar in paths():
                for b in (None, bias):
                    got = native.gguf_linear(int(qtype), torch.from_numpy(raw), x, b, force_scalar=scalar)
                    want = ref if b is not None else ref - bias.double()
                    # fp32 accumulation of k products (~ k * eps * sum |x w|), then the bias add
                    tol = 4 * k * 6e-8 * (x.abs().double() @ w.abs().double().T) + 2 * 6e-8 * want.abs()
                    assert got.shape == (T, n)
                    assert ((got.double() - want).abs() <= tol).all(), (qtype.name, n, k, T, scalar)


def test_strided_rows_and_multithreaded_split():
    """x rows with a stride (a view), and enough rows for the OpenMP split to engage."""
    rng = np.random.default_rng(7)
    qtype, n, k = Q.Q4_1, 300, 512
    raw = torch.from_numpy(random_blocks(qtype, n, k, rng))
    w = native.gguf_dequantize(int(qtype), raw, k)
    x = torch.from_numpy(rng.standard_normal((3, 2 * k)).astype(np.float32))[:, :k]
    got = native.gguf_linear(int(qtype), raw, x, num_threads=2)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_rejects_bad_shapes():
    raw = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(ValueError):
        native.gguf_linear(int(Q.Q4_1), raw, torch.zeros(1, 64))      # 64 columns need 40 bytes a row
    with pytest.raises(ValueError):
        native.gguf_linear(int(Q.F16), raw, torch.zeros(1, 32))       # no kernel for F16
