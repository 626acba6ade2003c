"""GGUF block kernels (worker_svc/backends/cpu/csrc/gguf_*.c) against the `gguf` package:
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


# --- the integer-dot path (gguf_linear_q8: llama.cpp's method) -----------------------------------
def quantize_act_reference(x: np.ndarray, parts: int = 1):
    """numpy's float32 version of the kernel's activation quantization (per token, blocks of 32):
    (q, d, s), or (q, q_lo, d, s) for parts=2; x ~ d * q, or d * (128 q + q_lo)."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    v = (xb * inv[:, :, None]).astype(np.float32)
    r = np.rint(v)
    q = r.astype(np.int8)
    d = (amax / np.float32(127)).astype(np.float32)
    if parts == 1:
        s = (d * q.astype(np.int32).sum(axis=2).astype(np.float32)).astype(np.float32)
        return q.reshape(T, K), d, s
    lo = np.rint((v - r) * np.float32(128)).astype(np.int8)
    d = (d / np.float32(128)).astype(np.float32)
    s = (d * (128 * q.astype(np.int32) + lo).sum(axis=2).astype(np.float32)).astype(np.float32)
    return q.reshape(T, K), lo.reshape(T, K), d, s


def dequantized_act(x: np.ndarray, parts: int) -> tuple[torch.Tensor, np.ndarray]:
    """(the activations the integer dots see, as float64 [T, K]; their scale d [T, K/32])"""
    T, K = x.shape
    ref = quantize_act_reference(x, parts)
    q = ref[0].astype(np.float64) if parts == 1 else 128 * ref[0].astype(np.float64) + ref[1]
    d = ref[-2]
    return torch.from_numpy((q.reshape(T, -1, 32) * d[:, :, None].astype(np.float64)).reshape(T, K)), d


def test_activation_quantization_bit_identical_to_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 96)).astype(np.float32) * np.float32(3)
    x[1, 32:64] = 0.0                                  # an all-zero block: scale 0, quants 0
    x[2, 5] = 1e4                                      # an outlier: its block's others round to 0
    x[3, :32] = np.float32(0.5) * np.arange(-16, 16, dtype=np.float32)   # halves: round to even
    for parts in (1, 2):
        want = quantize_act_reference(x, parts)
        for scalar in paths():
            got = native.gguf_quantize_act(torch.from_numpy(x), force_scalar=scalar, parts=parts)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert np.array_equal(g.numpy(), w), (parts, scalar)
    q, lo, d, _ = quantize_act_reference(x, 2)
    assert np.abs(lo).max() <= 64                      # the remainder of a rounding: |v - q| <= 1/2
    xq = (128 * q.astype(np.float64) + lo).reshape(5, 3, 32) * d[:, :, None]
    # 8 + 7 bits: within amax / 127 / 256 of x
    assert (np.abs(xq.reshape(5, 96) - x) <= np.repeat(d, 32, axis=1) / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_q8_linear_equals_float_gemm_on_the_quantized_activations(qtype, parts_list=(1, 2)):
    """The integer dots compute exactly W_deq . (q_a * d_a) up to fp32 rounding of the scale
    products and the sums; and they differ from the exact F.linear by the activation rounding only."""
    rng = np.random.default_rng(200 + int(qtype))
    for (n, k), parts in ((s, p) for s in shapes(qtype) for p in parts_list):
        raw = random_blocks(qtype, n, k, rng)
        w = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32)).double()
        # tile kernels (lanes=False): 1-2 tokens the small-tile kernel, tiles of up to 8: 13 = 8 + 5, 9 = 8 + 1;
        # lane kernels (AVX-512 VNNI builds): 1-16 tokens in row octets (9, 13: two passes), token-lane tiles of
        # 16 above: 21 = 16 + 5
        for T in (1, 3, 6, 9, 13, 21):
            x = rng.standard_normal((T, k)).astype(np.float32)
            xq, d = dequantized_act(x, parts)
            bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
            want = F.linear(xq, w, bias.double())
            tol = 8 * k * 6e-8 * (xq.abs() @ w.abs().T) + 2 * 6e-8 * want.abs() + 1e-30
            # |x - xq| <= d_a / 2 per element: the bound of the difference from the exact product
            half = torch.from_numpy(np.repeat(d.astype(np.float64) / 2, 32, axis=1))
            exact = F.linear(torch.from_numpy(x).double(), w, bias.double())
            for scalar, lanes in ((s, tl) for s in paths() for tl in (False, True)):   # lanes: the lane kernels
                got = native.gguf_linear_q8(int(qtype), torch.from_numpy(raw), torch.from_numpy(x), bias,
                                            force_scalar=scalar, parts=parts, lanes=lanes).double()
                assert got.shape == (T, n)
                assert ((got - want).abs() <= tol).all(), (qtype.name, n, k, T, parts, scalar, lanes)
                assert ((got - exact).abs() <= half @ w.abs().T + tol).all(), (qtype.name, n, k, T, parts, scalar,
                                                                               lanes)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_q8_extreme_quants_do_not_saturate(qtype):
    """The largest products the 16-bit intermediate sums see: every quant byte 0xff (Q4 nibbles 15,
    Q5_K 31, K scales and mins 63) or 0x80 / 0x00 (Q8_0 -128; Q6_K -32), against activations all
    at +-127 (parts 1) or 128 * 127 + remainder (parts 2), in tiles of every kernel (T = 1, 2, 8, 16; lane
    kernels: 1-16 row-lane, 17 token-lane)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n, k = 16, 2 * 256
    for fill in (0xFF, 0x80, 0x00):
        raw = np.full((n, k // block, size), fill, dtype=np.uint8)
        halves = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}[qtype]
        for off in halves:
            raw[:, :, off:off + 2] = np.array([0.01], np.float16).view(np.uint8)
        if qtype in (Q.Q4_K, Q.Q5_K):
            raw[:, :, 4:16] = 0xFF                     # sub-block scales and mins 63 (not 0 with the quants)
        elif qtype == Q.Q6_K:
            raw[:, :, 192:208] = 1                     # int8 sub-block scales 1
        raw = raw.reshape(n, -1)
        w = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32)).double()
        for T in (1, 2, 8, 16, 17):
            x = np.full((T, k), 1.0, np.float32)
            x[1::2] = np.where(np.arange(k) % 2 == 0, 1.0, 0.3).astype(np.float32)   # remainders in parts 2
            x[::3] *= -1
            for parts in (1, 2):
                xq, _ = dequantized_act(x, parts)
                want = F.linear(xq, w)
                tol = 8 * k * 6e-8 * (xq.abs() @ w.abs().T) + 1e-30
                for scalar, lanes in ((s, tl) for s in paths() for tl in (False, True)):
                    got = native.gguf_linear_q8(int(qtype), torch.from_numpy(raw), torch.from_numpy(x),
                                                force_scalar=scalar, parts=parts, lanes=lanes).double()
                    assert ((got - want).abs() <= tol).all(), (qtype.name, fill, T, parts, scalar, lanes)


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "tiles"])
def test_q8_token_results_do_not_depend_on_the_batch_or_threads(lanes):
    """Activations are quantized per token, rows split over threads: a token's output is bit-identical
    alone, in any batch, at any position, with any thread count (the batch-independence rule), on
    the lane kernels (the default on AVX-512 VNNI builds: row octets for 1-16 tokens, token-lane tiles
    of 16 above; AVX2 builds, opt-in: row octets for 1-8, token-lane tiles of 8 above; one fp32 order) and
    on the 8-token tile kernels alike."""
    rng = np.random.default_rng(11)
    built = native.gguf_q8_lanes()
    for qtype in TYPES:
        k = 512
        raw = torch.from_numpy(random_blocks(qtype, 300, k, rng))       # 300 rows: 37 octets + 4
        # 37 tokens: 8-token tiles 8 x 4 + 5, or 16 + 16 + 5 token-lane tiles; alone: 1 token
        x = torch.from_numpy(rng.standard_normal((37, k)).astype(np.float32))
        for scalar, parts in ((s, p) for s in paths() for p in (1, 2)):
            def q8(xx, lanes=lanes, **kw):
                return native.gguf_linear_q8(int(qtype), raw, xx, force_scalar=scalar, parts=parts, lanes=lanes,
                                             **kw)
            full = q8(x, num_threads=2)
            alone = torch.cat([q8(x[t:t + 1], num_threads=1) for t in range(37)])
            assert torch.equal(alone, full), (qtype.name, scalar, parts)
            for perm in ([6, 2], [6, 2, 0, 5], [12, 3, 7, 1, 9, 4], list(range(12, 4, -1)),   # 2, 4, 6, 8
                         list(range(20, 2, -1)), list(range(36, 10, -2)) + [1],            # 18 (16 + 2), 14
                         list(range(30, 6, -2)) + [31, 0, 33]):                              # 15
                assert torch.equal(q8(x[perm]), full[perm]), (qtype.name, perm, scalar, parts)
            if lanes and built and not scalar:   # the lane kernels ran: another summation order than the tiles'
                tiles = q8(x, lanes=False)
                torch.testing.assert_close(full, tiles, rtol=2e-6, atol=2e-6 * float(tiles.abs().max()))
                assert not torch.equal(full, tiles)
                assert not torch.equal(full[:8], tiles[:8])                  # the row-lane kernel too


def test_q8_row_results_do_not_depend_on_the_other_rows():
    """A row's output is the same bits whatever rows share its call: the AVX2 token-lane kernel
    sweeps rows in pairs (two rows share each activation load), so dropping the first row moves
    every later row into another pair, and a call of one row has no partner at all."""
    rng = np.random.default_rng(12)
    for qtype in TYPES:
        raw = torch.from_numpy(random_blocks(qtype, 41, 512, rng))
        for T in (5, 37):                               # row-lane kernel; token-lane tiles
            x = torch.from_numpy(rng.standard_normal((T, 512)).astype(np.float32))
            for scalar, parts in ((s, p) for s in paths() for p in (1, 2)):
                def q8(w, threads=2):
                    return native.gguf_linear_q8(int(qtype), w, x, force_scalar=scalar, parts=parts,
                                                 num_threads=threads)
                full = q8(raw)
                assert torch.equal(q8(raw[1:]), full[:, 1:]), (qtype.name, T, scalar, parts)
                assert torch.equal(q8(raw[7:8], threads=1), full[:, 7:8]), (qtype.name, T, scalar, parts)


_ROWS16_PROBE = """
import sys, numpy as np, torch
from tests.worker.test_gguf_kernels import Q, random_blocks
from worker_svc.backends.cpu import native
rng = np.random.default_rng(13)
out = {}
for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K):
    raw = torch.from_numpy(random_blocks(qtype, 45, 512, rng))    # 2 x 16 rows, an octet, 5 rows
    for T in range(1, 8):
        x = torch.from_numpy(rng.standard_normal((T, 512)).astype(np.float32))
        for parts in (1, 2):
            out[f"{qtype.name} {T} {parts}"] = native.gguf_linear_q8(int(qtype), raw, x, parts=parts, num_threads=2)
torch.save(out, sys.argv[1])
"""


def _probe_in_fresh_processes(tmp_path, settings: dict) -> dict:
    """{name: _ROWS16_PROBE's outputs} with each setting's environment in a process of its own
    (the kernels read their switches once)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    got = {}
    for name, env in settings.items():
        path = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", _ROWS16_PROBE, str(path)], check=True, timeout=120,
                       env={**os.environ, **env, "PYTHONPATH": root}, cwd=root)
        got[name] = torch.load(path)
    return got


@pytest.mark.skipif(native.gguf_q8_isa() != "avx512vnni", reason="the 16-row kernel is in AVX-512 VNNI builds")
def test_q8_sixteen_row_threshold_leaves_the_bits(tmp_path):
    """Where the row-lane kernel starts taking 16 rows a vector (by CPU: from 1 token on Zen 4, from
    5 on the Xeons; the K-quants from 2 there) changes its speed only: 1-7 tokens of all six
    formats give the same bits with 16 rows a vector at every size as with octets only (each
    setting in a fresh process, as the kernel reads it once)."""
    got = _probe_in_fresh_processes(tmp_path, {"rows16": {"SARATHI_GGUF_ROWS16_MIN": "1"},
                                               "octets": {"SARATHI_GGUF_ROWS16": "0"}})
    assert got["rows16"].keys() == got["octets"].keys() and len(got["rows16"]) == 6 * 7 * 2
    for key, want in got["octets"].items():
        assert torch.equal(got["rows16"][key], want), key


@pytest.mark.skipif(native.gguf_q8_isa() != "avx2", reason="the Q8_0 row dots are in AVX2 builds without VNNI")
def test_q8_0_row_dots_leave_the_bits(tmp_path):
    """AVX2 builds run Q8_0 passes of 1-4 tokens (the LM head of a decode step, a verification's
    few rows) as per-row dots whose partial sums are transposed at the end, more tokens through the
    weight pairs: a change of speed only. 1-7 tokens of every format (Q8_0 with octets and a
    remainder of 5 rows) give the same bits as with the pairs at every size (each setting in a
    fresh process, as the kernel reads it once)."""
    got = _probe_in_fresh_processes(tmp_path, {"row dots": {"SARATHI_GGUF_Q8_ROWDOT": "1"},
                                               "pairs": {"SARATHI_GGUF_Q8_ROWDOT": "0"}})
    assert got["row dots"].keys() == got["pairs"].keys() and len(got["pairs"]) == 6 * 7 * 2
    for key, want in got["pairs"].items():
        assert torch.equal(got["row dots"][key], want), key


def test_q8_strided_rows_and_rejects_bad_shapes():
    rng = np.random.default_rng(8)
    raw = torch.from_numpy(random_blocks(Q.Q4_0, 40, 256, rng))
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))[:, :256]
    q4_0 = int(Q.Q4_0)
    assert torch.equal(native.gguf_linear_q8(q4_0, raw, x), native.gguf_linear_q8(q4_0, raw, x.contiguous()))
    with pytest.raises(ValueError):
        native.gguf_linear_q8(int(Q.Q4_0), raw, torch.zeros(1, 64))
    with pytest.raises(ValueError):
        native.gguf_quantize_act(torch.zeros(1, 48))


def _lane_cases():
    """(qtype, blocks, x) of every format at 1, 5, 8, 13 and 21 tokens (both builds' row-lane and
    token-lane kernels and their splits)."""
    rng = np.random.default_rng(21)
    for qtype in TYPES:
        raw = torch.from_numpy(random_blocks(qtype, 72, 512, rng))
        for T in (1, 5, 8, 13, 21):
            yield qtype, raw, torch.from_numpy(rng.standard_normal((T, 512)).astype(np.float32))


@pytest.fixture
def vnni_lane_results():
    """The default (AVX-512 VNNI) build's lane-kernel outputs of _lane_cases, parts 1 and 2: taken
    before fresh_native swaps the library."""
    return [(qtype, raw, x, {p: native.gguf_linear_q8(int(qtype), raw, x, parts=p) for p in (1, 2)})
            for qtype, raw, x in _lane_cases()]


@pytest.mark.skipif(native.gguf_q8_isa() != "avx512vnni", reason="the AVX2 build is the second SIMD path on "
                    "an AVX-512 VNNI machine (elsewhere the default build is the AVX2 or scalar one)")
def test_avx2_build_on_an_avx512_machine(vnni_lane_results, fresh_native, monkeypatch):
    """Every SIMD path this machine runs: the AVX2 variant (maddubs, no VNNI) of both GGUF paths; its
    lane kernels give the VNNI lane kernels' bits (the same integer dots, the same fp32 steps)."""
    monkeypatch.setenv("SARATHI_NATIVE_VARIANT", "avx2")
    assert native.available() and native.gguf_isa() == "avx2" and native.gguf_q8_isa() == "avx2"
    for qtype in TYPES:
        test_dequantize_bit_identical_to_gguf(qtype)
        test_linear_matches_float_gemm_on_dequantized(qtype)
        test_q8_linear_equals_float_gemm_on_the_quantized_activations(qtype)
    test_activation_quantization_bit_identical_to_numpy()
    assert native.gguf_q8_lanes()
    test_q8_token_results_do_not_depend_on_the_batch_or_threads(lanes=True)
    test_q8_row_results_do_not_depend_on_the_other_rows()
    for qtype, raw, x, want in vnni_lane_results:
        for parts, w in want.items():
            got = native.gguf_linear_q8(int(qtype), raw, x, parts=parts)
            assert torch.equal(got, w), (qtype.name, x.shape[0], parts, float((got - w).abs().max()))
