"""Bad input fails loudly, names the problem, and allocates nothing: unknown paths, corrupt or
truncated files, missing tensors, prompts longer than the context, empty prompts."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.messages import Batch
from shared.model_source import ModelNotFoundError, resolve_model
from tests.support.engine_helpers import blocks_for, chunk, make_executor, make_tiny_checkpoint, use_threads
from worker_svc import model_runner as model_runner_module
from worker_svc.loader import ModelLoadError
from worker_svc.model_runner import BatchError


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")


@pytest.fixture(scope="module")
def ex(ckpt):
    return make_executor(ckpt, num_blocks=64)


@pytest.fixture
def no_cache_allowed(monkeypatch):
    """Fails the test if the model runner gets as far as allocating its KV cache."""
    def refuse(*args, **kwargs):
        raise AssertionError("KV cache allocated although loading failed")
    monkeypatch.setattr(model_runner_module, "PagedKVCache", refuse)


def test_unknown_model_path_names_the_path(tmp_path, no_cache_allowed):
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        make_executor(tmp_path / "no-such-model")


def test_garbage_gguf_is_a_load_error_naming_the_file(tmp_path, no_cache_allowed):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a gguf file" * 100)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        make_executor(bad)


def test_truncated_gguf_is_a_load_error(tmp_path, no_cache_allowed):
    src = resolve_model(None).path
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(4_000_000))       # header intact, tensor data cut short
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        make_executor(cut)


def test_safetensors_missing_a_tensor_names_it(ckpt, tmp_path, no_cache_allowed):
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        make_executor(broken)


def test_truncated_safetensors_is_a_load_error(ckpt, tmp_path, no_cache_allowed):
    broken = tmp_path / "cut"
    shutil.copytree(ckpt, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut"):
        make_executor(broken)


def test_unknown_dtype_is_rejected(ckpt):
    with pytest.raises(ValueError, match="float64"):
        make_executor(ckpt, dtype="float64")


def test_prompt_longer_than_the_context_is_rejected(ex):
    n = ex.model_info.max_model_len + 1
    with pytest.raises(BatchError, match="max_model_len"):
        ex.execute(Batch(0, [chunk("long", [5] * n, 0, list(range(blocks_for(n, 16))), True)]))


def test_empty_prompt_is_rejected(ex):
    with pytest.raises(BatchError, match="empty"):
        ex.execute(Batch(0, [chunk("empty", [], 0, [0], True)]))


def test_block_table_too_short_is_rejected(ex):
    with pytest.raises(BatchError, match="block table"):
        ex.execute(Batch(0, [chunk("r", [5] * 40, 0, [0, 1], True)]))


def test_block_id_outside_the_cache_is_rejected(ex):
    with pytest.raises(BatchError, match="outside"):
        ex.execute(Batch(0, [chunk("r", [5] * 4, 0, [64], True)]))


def test_token_id_outside_the_vocabulary_is_rejected(ex):
    with pytest.raises(BatchError, match="vocabulary"):
        ex.execute(Batch(0, [chunk("r", [256], 0, [0], True)]))


def test_a_rejected_batch_leaves_the_cache_untouched(ex):
    before = [k.clone() for k in ex.cache.k]
    good = chunk("ok", [5, 6, 7], 0, [3], True)
    with pytest.raises(BatchError):
        ex.execute(Batch(0, [good, chunk("bad", [], 0, [4], True)]))
    assert all(torch.equal(a, b) for a, b in zip(before, ex.cache.k))


def test_free_accepts_unknown_request_ids(ex):
    ex.free(["never-seen"])
    assert ex.execute(Batch(0, [], freed_req_ids=["never-seen"])).sampled == {}
