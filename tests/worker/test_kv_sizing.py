"""KV-cache sizing arithmetic (the profiling pass itself needs a GPU: tests/gpu/test_backend.py)."""
from __future__ import annotations

import pytest
import torch

from worker_svc.backends.cuda.kv_sizing import block_bytes, blocks_that_fit, profile_sequences

GIB = 1 << 30


def test_block_bytes_of_llama3_8b():
    # 32 layers x (k + v) x 16 tokens x 8 kv heads x 128 dims x 2 bytes = 2 MiB
    assert block_bytes(32, 16, 8, 128, torch.bfloat16) == 2 * 1024 * 1024
    assert block_bytes(32, 16, 8, 128, torch.float32) == 4 * 1024 * 1024


def test_blocks_fill_what_utilization_leaves():
    per = 2 * 1024 * 1024
    # 80 GiB x 0.9 = 72 GiB; 16 GiB peak (weights + activations), 1 GiB context -> 55 GiB of KV
    assert blocks_that_fit(80 * GIB, 16 * GIB, 1 * GIB, 0.9, per) == 55 * GIB // per
    assert blocks_that_fit(80 * GIB, 16 * GIB, 1 * GIB, 0.5, per) == (40 - 17) * GIB // per


def test_no_room_is_a_clear_error():
    with pytest.raises(ValueError, match="no room for the KV cache"):
        blocks_that_fit(16 * GIB, 15 * GIB, 0, 0.9, 2 * 1024 * 1024)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        blocks_that_fit(16 * GIB, 0, 0, 1.5, 1024)


def test_profile_batch_splits_at_max_model_len():
    seqs = profile_sequences(5000, 2048, 16)
    assert [n for _, n, _ in seqs] == [2048, 2048, 904]
    assert all(s == 0 for s, _, _ in seqs)
    blocks = [b for _, _, t in seqs for b in t]
    assert blocks == list(range(len(blocks))) and len(blocks) == 128 + 128 + 57
