"""A GGUF served as the file defines it (weight_quant "auto"): the linear layers run on the file's
own blocks (worker_svc/backends/cpu/gguf.py) for small batches and a float GEMM on their exact
dequantization above, so greedy output equals transformers on the same file. Tiny GGUFs written
here in each block format with a kernel, against transformers' own GGUF loader."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.support.engine_helpers import blocks_for, greedy_generate, hf_model_from_gguf, make_executor, use_threads
from worker_svc.backends.cpu import gguf as gguf_backend
from worker_svc.backends.cpu import native

pytestmark = pytest.mark.skipif(not native.available() or native.gguf_isa() == "scalar",
                                reason="GGUF block kernels need the native library with SIMD")

Q = gguf.GGMLQuantizationType
H, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 320    # K-quant rows: 256 | K


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


def write_tiny_gguf(path, qtype, seed: int = 0) -> None:
    """A 2-layer llama GGUF whose every matrix (the tied embedding too) is in `qtype`. Q4_0, Q4_1, Q5_0,
    Q8_0: gguf's own quantizer on N(0, 0.05) weights; K-quants (no quantizer in the gguf package):
    random quants with small random fp16 scales, which is still a valid file of that format."""
    g = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(H // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def matrix(name: str, n: int, k: int) -> None:
        elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0):
            raw = gguf.quants.quantize((g.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
        else:
            raw = g.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
            scale = 2e-4 if qtype == Q.Q6_K else 1e-3
            for off in ([208] if qtype == Q.Q6_K else [0, 2]):     # d (and dmin)
                raw[:, :, off:off + 2] = (g.standard_normal((n, k // elems, 1)) * scale) \
                    .astype(np.float16).view(np.uint8)
            raw = raw.reshape(n, -1)
        w.add_tensor(name, raw, raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * g.standard_normal(H)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, H)
    norm("output_norm.weight")
    kv = H // HEADS * KV_HEADS
    for i in range(LAYERS):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        for name, n, k in (("attn_q", H, H), ("attn_k", kv, H), ("attn_v", kv, H), ("attn_output", H, H),
                           ("ffn_gate", INTER, H), ("ffn_up", INTER, H), ("ffn_down", H, INTER)):
            matrix(p + name + ".weight", n, k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_tiny_gguf_default_greedy_equals_transformers(tmp_path, monkeypatch, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_gguf(path, qtype)
    ex = make_executor(path, num_blocks=24, weight_quant="auto")       # the default, fp32 KV
    # longer than the block kernel's range, where it has one: the prefill takes the float GEMM (on
    # VNNI builds the block kernel takes every call)
    every_t = ex.backend.linear.max_tokens == gguf_backend.EVERY_T
    n = 64 if every_t else max(64, ex.backend.linear.max_tokens + 8)
    prompt = torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(int(qtype))).tolist()
    hf = hf_model_from_gguf(str(path))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=1)[0, len(prompt):].tolist()
    assert ex.backend.linear.name.startswith("gguf blocks")
    lin = [m for m in ex.model.modules() if hasattr(m, "method")]
    assert len(lin) == 4 * LAYERS + 1                                  # qkv, o, gate_up, down; the head
    assert all(getattr(m, "gguf_type", None) == int(qtype) for m in lin), qtype.name
    calls = []
    kernel = "gguf_linear" if ex.backend.linear.dot == "fp32" else "gguf_linear_q8"
    real = getattr(native, kernel)
    monkeypatch.setattr(native, kernel, lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    got = greedy_generate(ex, prompt, 16, list(range(blocks_for(len(prompt) + 16, 16))))
    assert got == ref
    # decodes (1 row) ran the block kernel; the 64-token prefill the float GEMM, or the block kernel
    # where it has no range
    assert calls and set(calls) == ({1, n} if every_t else {1})


def test_lane_kernels_are_the_default_where_built(tmp_path, monkeypatch):
    """The integer dots run on the lane kernels by default wherever they are built (AVX-512 VNNI
    and AVX2 builds; the decode stack runs them too), at every call: no threshold, no float
    weights; SARATHI_GGUF_LANES=1 says the same explicitly; SARATHI_GGUF_LANES=0 keeps the
    8-token tile kernels with their threshold; another value is refused."""
    path = tmp_path / "tiny-Q4_1.gguf"
    write_tiny_gguf(path, Q.Q4_1)
    built = native.gguf_q8_lanes()
    default = make_executor(path, num_blocks=8, weight_quant="auto")
    assert default.backend.linear.lanes == built
    assert ("lane kernels" in default.backend.linear.name) == built
    assert default.model.stack is not None and default.model.stack.lanes == built
    monkeypatch.setenv("SARATHI_GGUF_LANES", "1")
    lanes = make_executor(path, num_blocks=8, weight_quant="auto")
    assert lanes.backend.linear.lanes == built and lanes.model.stack.lanes == built
    monkeypatch.setenv("SARATHI_GGUF_LANES", "0")
    tiles = make_executor(path, num_blocks=8, weight_quant="auto")
    assert not tiles.backend.linear.lanes and not tiles.model.stack.lanes
    every_t, tile_t = gguf_backend.EVERY_T, gguf_backend.GGUF_MAX_TOKENS["avx2"]
    assert default.backend.linear.max_tokens == (every_t if built else tile_t)
    assert tiles.backend.linear.max_tokens == tile_t
    # the lane kernels take every call with SARATHI_GGUF_LANES=1: one arithmetic at every batch size
    assert lanes.backend.linear.max_tokens == (every_t if built else tile_t)
    for ex in (default, lanes, tiles):
        lin = ex.backend.linear
        assert lin.large == ("dequant" if lin.max_tokens == every_t else "cached")
        assert ("at every batch size" in lin.name) == (lin.max_tokens == every_t)
        body = [m for m in ex.model.modules()
                if hasattr(m, "gguf_data") and not getattr(m, "full_precision_output", False)]
        assert body and all((m.weight.numel() == 0) == (lin.large == "dequant") for m in body)
    prompt = list(range(2, 22))
    table = list(range(blocks_for(len(prompt) + 12, 16)))
    assert greedy_generate(tiles, prompt, 12, table) == greedy_generate(lanes, prompt, 12, table)
    monkeypatch.setenv("SARATHI_GGUF_LANES", "yes")
    with pytest.raises(ValueError, match="SARATHI_GGUF_LANES must be 0, 1 or auto"):
        make_executor(path, num_blocks=8, weight_quant="auto")


def test_unsupported_format_is_dequantized_at_load_with_a_log_line(tmp_path, caplog):
    """A matrix in a format without a kernel (Q5_0) is served from its float dequantization."""
    path = tmp_path / "tiny-Q5_0.gguf"
    write_tiny_gguf(path, Q.Q5_0)
    with caplog.at_level("INFO", logger="worker_svc.loader"):
        ex = make_executor(path, num_blocks=8, weight_quant="auto")
    assert "GGUF format Q5_0 has no block kernel: dequantized to float32 at load" in caplog.text
    assert not any(hasattr(m, "gguf_data") for m in ex.model.modules())


def test_none_serves_float_weights_and_the_same_tokens(tmp_path):
    path = tmp_path / "tiny-Q4_1.gguf"
    write_tiny_gguf(path, Q.Q4_1)
    prompt = list(range(2, 22))
    table = list(range(blocks_for(len(prompt) + 12, 16)))
    auto = greedy_generate(make_executor(path, num_blocks=8, weight_quant="auto"), prompt, 12, table)
    ex = make_executor(path, num_blocks=8, weight_quant="none")
    assert not any(hasattr(m, "gguf_data") for m in ex.model.modules())
    assert greedy_generate(ex, prompt, 12, table) == auto


def _decode_then_replay(ex, prompt: list[int], n: int):
    """Greedy-decode n tokens one step at a time, then recompute prompt + all but the last of
    them in one prefill chunk, as a replay after a scheduler restart does. Returns, for layer 0's
    qkv and o_proj inputs (the attention's output) and for the logits, the decode steps' rows and
    the replay's rows at the same positions."""
    from shared.messages import Batch
    from tests.support.engine_helpers import chunk

    seen = {"qkv": [], "o_proj": []}
    hooks = [getattr(ex.model.layers[0], name).register_forward_hook(
        lambda m, args, out, name=name: seen[name].append(
            (out if name == "qkv" else args[0]).detach().clone())) for name in seen]
    table = list(range(blocks_for(len(prompt) + n, ex.block_size)))
    out = ex.compute_logits(Batch(0, [chunk("a", prompt, 0, table, True)]))["a"]
    toks, logits = [int(out.argmax())], [out]
    while len(toks) < n:
        out = ex.compute_logits(Batch(0, [chunk("a", [toks[-1]], len(prompt) + len(toks) - 1, table, True)]))["a"]
        toks.append(int(out.argmax()))
        logits.append(out)
    decoded = {k: torch.cat(v[1:]) for k, v in seen.items()}          # the n - 1 decode steps' rows
    for v in seen.values():
        v.clear()
    replay_table = [b + len(table) for b in table]
    replayed = ex.compute_logits(Batch(0, [chunk("b", prompt + toks[:-1], 0, replay_table, True)]))["b"]
    for h in hooks:
        h.remove()
    rows = {k: v[0][len(prompt):] for k, v in seen.items()}          # the same n - 1 positions
    return decoded, rows, logits[-1], replayed


def test_a_replay_repeats_the_decodes_linear_bits_only_without_a_threshold(tmp_path, monkeypatch):
    """Why a request replayed after a scheduler restart may end with another word than its first
    run: the replay recomputes the generated tokens in one prefill chunk. Without a threshold
    (lane kernels at every call) the chunk's linear layers give each token the bits its decode
    step got; with one (here the tile kernels: 63 tokens > 48, so the float GEMM) they do not.
    Either way attention is computed another way in a prefill chunk than by the decode kernel, so
    its output, and the logits, differ in the last bits: close, not identical."""
    if not native.gguf_q8_lanes():
        pytest.skip("no lane kernels in this build")
    path = tmp_path / "tiny-Q4_1.gguf"
    write_tiny_gguf(path, Q.Q4_1)
    monkeypatch.setenv("SARATHI_NATIVE_STACK", "0")     # layer by layer: the hooks see every call
    prompt, n = list(range(2, 10)), 56
    results = {}
    for lanes in ("1", "0"):
        monkeypatch.setenv("SARATHI_GGUF_LANES", lanes)
        ex = make_executor(path, num_blocks=16, weight_quant="auto")
        assert (ex.backend.linear.max_tokens == gguf_backend.EVERY_T) == (lanes == "1")
        results[lanes] = _decode_then_replay(ex, prompt, n)
    decoded, replayed, last_logits, replay_logits = results["1"]
    assert torch.equal(decoded["qkv"], replayed["qkv"])                 # linear: the decode's bits
    assert not torch.equal(decoded["o_proj"], replayed["o_proj"])       # attention: another order
    assert torch.allclose(decoded["o_proj"], replayed["o_proj"], atol=1e-5)
    assert torch.allclose(last_logits, replay_logits, atol=1e-2) and last_logits.argmax() == replay_logits.argmax()
    decoded, replayed, _, _ = results["0"]
    assert not torch.equal(decoded["qkv"], replayed["qkv"])             # the threshold: the float GEMM
