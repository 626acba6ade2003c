"""The fused native CPU ops (backends/cpu/csrc/cpu_ops.c through backends.cpu.native and
NativeCpuOps) equal their torch reference (worker_svc.backends.base.Ops): bit-equal where the
same IEEE operations run in the same order (rotary, the residual add, the KV cast), within a few
ulp where the order or exp differ (RMSNorm's sum of squares, silu; in bf16 that ulp can flip a
rounding)."""
from __future__ import annotations

import pytest
import torch

from worker_svc.backends.base import Ops
from worker_svc.backends.cpu import NativeCpuOps, native, native_ops_enabled
from worker_svc.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")
REF = Ops()
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: float) -> None:
    """fp32: within `ulps` ulp of the row's scale. bf16: the fp32 intermediate (e.g. the row's
    rms) may differ by an ulp, which flips a bf16 rounding now and then: at most 1% of the
    elements differ, each by at most two bf16 ulp (h flips one ulp, the weight multiply rounds again)."""
    if dtype == torch.bfloat16:
        g, w = got.float(), want.float()
        assert (g != w).float().mean().item() <= 0.01
        assert ((g - w).abs() <= 2 ** -6 * w.abs()).all()
        return
    tol = ulps * torch.finfo(torch.float32).eps * want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    assert ((got - want).abs() <= tol).all(), (got - want).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 576), (3, 67), (32, 8), (2, 1), (200, 576)])
def test_rms_norm_equals_reference(dtype, T, H):
    g = torch.Generator().manual_seed(T * 1000 + H)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    w = torch.randn(H, generator=g).to(dtype)
    got, none = native.rms_norm(x, w, 1e-5)
    assert none is None
    _close(got, REF.rms_norm(x, w, 1e-5), dtype, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 576), (5, 67), (33, 13), (300, 576)])
def test_add_rms_norm_equals_reference_and_stores_the_sum(dtype, T, H):
    g = torch.Generator().manual_seed(T + H)
    x, res = (torch.randn(T, H, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(H, generator=g).to(dtype)
    want, want_r = REF.add_rms_norm(x, res, w, 1e-6)
    r = res.clone()
    got, got_r = native.rms_norm(x, w, 1e-6, r)
    assert got_r is r and torch.equal(got_r, want_r)       # the add: one rounding, like torch
    _close(got, want, dtype, 8)


def test_rms_norm_takes_strided_rows_and_rejects_strided_elements():
    base = torch.randn(4, 100)
    x = base[:, 10:74]                          # row stride 100, elements contiguous
    w = torch.randn(64)
    _close(native.rms_norm(x, w, 1e-5)[0], REF.rms_norm(x, w, 1e-5), torch.float32, 8)
    with pytest.raises(ValueError):
        native.rms_norm(base[:, ::2], torch.randn(50), 1e-5)
    with pytest.raises(ValueError):
        native.rms_norm(x, w.double(), 1e-5)
    with pytest.raises(ValueError):
        native.rms_norm(x.double(), w.double(), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hq,hkv,D", [(1, 9, 3, 64), (7, 4, 4, 6), (40, 2, 1, 18), (3, 8, 2, 128)])
def test_rotary_in_place_is_bit_equal_to_rotate_half(dtype, T, hq, hkv, D):
    g = torch.Generator().manual_seed(T * D)
    qkv = torch.randn(T, (hq + 2 * hkv) * D, generator=g).to(dtype)   # the model's fused qkv output
    q, k, _ = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
    q, k = q.view(T, hq, D), k.view(T, hkv, D)
    cos, sin = (torch.randn(T, 1, D, generator=g).to(dtype) for _ in range(2))
    want_q, want_k = REF.rotary(q.clone(), k.clone(), (cos, sin))
    untouched = qkv[:, (hq + hkv) * D:].clone()
    native.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (hq + hkv) * D:], untouched)   # v is not touched


def test_rotary_rejects_odd_dims_and_mismatched_tables():
    q, k = torch.randn(2, 2, 5), torch.randn(2, 1, 5)
    with pytest.raises(ValueError):
        native.rotary_(q, k, torch.randn(2, 1, 5), torch.randn(2, 1, 5))
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(ValueError):
        native.rotary_(q, k, torch.randn(2, 1, 8).bfloat16(), torch.randn(2, 1, 8).bfloat16())
    with pytest.raises(ValueError):
        native.rotary_(q.transpose(1, 2), k, torch.randn(2, 1, 8), torch.randn(2, 1, 8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 1536), (5, 13), (32, 1536), (2, 1)])
def test_silu_mul_equals_reference(dtype, T, I):
    g = torch.Generator().manual_seed(T + I)
    x = (torch.randn(T, 2 * I, generator=g) * 6).to(dtype)
    x[0, 0] = -100.0                          # exp overflow side: silu -> -0
    got, want = native.silu_mul(x), REF.silu_mul(x)
    if dtype == torch.float32:
        # elementwise: silu's exp is a different ~1-ulp approximation than torch's
        assert torch.allclose(got, want, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-30)
    else:
        # bf16 rounds silu(g) to 8 bits: an exp 1 ulp apart can round the other way, rarely
        mismatch = (got != want).float().mean().item()
        assert mismatch <= 0.01 and torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_equals_paged_cache_write(src, cache_dtype):
    if not native.write_kv_supports(src, cache_dtype):
        pytest.skip("no F16C on this build")
    T, hkv, D = 5, 3, 18
    g = torch.Generator().manual_seed(1)
    kv = (torch.randn(T, 4 * hkv * D, generator=g) * 100).to(src)    # k, v strided like the model's
    k, v = kv[:, :hkv * D].view(T, hkv, D), kv[:, 2 * hkv * D:3 * hkv * D].view(T, hkv, D)
    k[0, 0, 0] = float("nan")
    slots = torch.tensor([7, 0, 31, 12, 5])
    want, got = (PagedKVCache(1, 4, 8, hkv, D, cache_dtype) for _ in range(2))
    want.write(0, slots, k, v)
    native.write_kv(k, v, got.k[0], got.v[0], slots)
    assert torch.equal(got.k[0].nan_to_num(1.0), want.k[0].nan_to_num(1.0))
    assert torch.isnan(got.k[0].view(-1, hkv, D)[7, 0, 0])
    assert torch.equal(got.v[0], want.v[0])


def test_write_kv_checks_slots_before_writing():
    cache = PagedKVCache(1, 2, 4, 1, 8, torch.bfloat16)
    k = torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match="outside"):
        native.write_kv(k, k, cache.k[0], cache.v[0], torch.tensor([1, 8]))
    assert not cache.k[0].any()                       # slot 1 was not written either
    with pytest.raises(ValueError):
        native.write_kv(k, k, cache.k[0], cache.v[0], torch.tensor([1, 2], dtype=torch.int32))


@pytest.mark.skipif(not native_ops_enabled(), reason="native ops not enabled on this CPU")
def test_native_cpu_ops_fall_back_for_other_dtypes():
    """NativeCpuOps takes the reference for what the kernels do not do (fp16, fp64)."""
    ops = NativeCpuOps()
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5))
    assert torch.equal(ops.silu_mul(x), REF.silu_mul(x))
    q, k = torch.randn(2, 2, 8).half(), torch.randn(2, 1, 8).half()
    cs = (torch.randn(2, 1, 8).half(), torch.randn(2, 1, 8).half())
    want = REF.rotary(q, k, cs)
    got = ops.rotary(q.clone(), k.clone(), cs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_batches_split_across_threads_give_the_same_rows(dtype):
    """Above the OpenMP threshold rows go to several threads; each row's result is the one-thread
    result (no cross-row reduction)."""
    x = torch.randn(256, 576).to(dtype)
    w = torch.randn(576).to(dtype)
    one, two = native.rms_norm(x, w, 1e-5, num_threads=1)[0], native.rms_norm(x, w, 1e-5, num_threads=2)[0]
    assert torch.equal(one, two)
    gu = torch.randn(64, 2 * 1536).to(dtype)
    assert torch.equal(native.silu_mul(gu, num_threads=1), native.silu_mul(gu, num_threads=2))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_attention_fused_write_fills_the_cache_like_the_torch_path(cache_dtype):
    """A hybrid batch (a chunk with a cached prefix, two decodes) through NativeCpuAttention with
    the fused KV write and through TorchAttention: the same cache bytes and the same output."""
    from worker_svc.backends.cpu import NativeCpuAttention
    from worker_svc.backends.torch_attention import TorchAttention

    if not native.write_kv_supports(torch.float32, cache_dtype):
        pytest.skip("no F16C on this build")
    hq, hkv, D, bs = 4, 2, 16, 4
    seqs = [(3, 5, [6, 2, 9]), (10, 1, [1, 4, 7]), (0, 1, [3])]
    T = sum(n for _, n, _ in seqs)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (hq + 2 * hkv) * D, generator=g).view(T, -1, D)   # the model's views
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    caches, outs = [], []
    for att in (NativeCpuAttention(fused_write=True), TorchAttention()):
        cache = PagedKVCache(1, 10, bs, hkv, D, cache_dtype)
        cache.k[0].normal_(generator=torch.Generator().manual_seed(5))   # an earlier prefix
        cache.v[0].normal_(generator=torch.Generator().manual_seed(6))
        outs.append(att.forward(q, k, v, cache, 0, att.build_metadata(seqs, bs), D ** -0.5))
        caches.append(cache)
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)
