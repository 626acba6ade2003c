"""Weights are read one tensor at a time and converted as they are read (so an 8B model goes to
the GPU in bf16 without an fp32 copy of the whole model on the host); the values are exactly
those of reading everything first and converting afterwards."""
from __future__ import annotations

import pytest
import torch

from shared.model_source import resolve_model
from tests.support.engine_helpers import make_tiny_checkpoint
from worker_svc.loader import LazyWeights, ModelLoadError, check_weights, load_weights


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lazy"), "qwen2_bias")


def test_names_and_shapes_are_checked_without_reading_a_tensor(ckpt):
    cfg, weights = load_weights(resolve_model(str(ckpt)))
    reads = []
    counting = LazyWeights(weights.shapes, lambda n: reads.append(n) or weights[n], weights.path)
    check_weights(cfg, counting, weights.path)
    assert reads == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_converted_on_read_equals_read_then_converted(ckpt, dtype):
    _, raw = load_weights(resolve_model(str(ckpt)))
    _, conv = load_weights(resolve_model(str(ckpt)), dtype, "cpu")
    assert set(raw) == set(conv)
    for name in raw:
        got = conv[name]
        assert got.dtype == dtype and torch.equal(got, raw[name].to(dtype))
    # the model's fused q/k/v: concatenating converted parts == converting the concatenation
    p = "model.layers.0.self_attn."
    assert torch.equal(torch.cat([conv[p + f"{x}_proj.weight"] for x in "qkv"]),
                       torch.cat([raw[p + f"{x}_proj.weight"] for x in "qkv"]).to(dtype))


def test_a_tensor_that_cannot_be_read_is_named():
    def broken(name):
        raise OSError("short read")

    weights = LazyWeights({"a.weight": (2,)}, broken, __import__("pathlib").Path("/m"))
    with pytest.raises(ModelLoadError, match="'a.weight'.*short read"):
        weights["a.weight"]
    with pytest.raises(KeyError):
        weights["b.weight"]
