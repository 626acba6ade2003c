"""CUDA-graph batch sizes, the bucket a decode batch runs in, and the padding of its inputs:
plain code, checked on the CPU (capture and replay are GPU tests: tests/gpu/test_backend.py)."""
from __future__ import annotations

import pytest
import torch

from worker_svc.backends.cuda.cuda_graphs import bucket_for, capture_sizes, pad_decode_inputs
from worker_svc.backends.cuda.flashinfer_meta import build_paged_batch, pad_decode_batch


@pytest.mark.parametrize("max_num_seqs,sizes", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]),
    (128, [1, 2, 4, 8, 16, 32, 64, 128]), (100, [1, 2, 4, 8, 16, 32, 64, 100]),
])
def test_capture_sizes_double_up_to_max_num_seqs(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def test_capture_sizes_rejects_nonpositive():
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_every_batch_size_gets_the_smallest_bucket_that_holds_it():
    sizes = capture_sizes(100)
    for n in range(1, 101):
        b = bucket_for(n, sizes)
        assert b >= n and b in sizes
        assert all(s < n for s in sizes if s < b)          # no smaller size would do
        assert b < 2 * n or b == 1                         # padding wastes under half
    assert bucket_for(101, sizes) is None                  # too big: eager
    assert bucket_for(0, sizes) is None


def test_padded_inputs_keep_real_rows_and_point_padding_at_the_scratch_block():
    pb = build_paged_batch([(20, 1, [3, 9]), (4, 1, [5]), (31, 1, [1, 2])], 16)
    padded = pad_decode_batch(pb, 4, scratch_block=11)
    host = pad_decode_inputs([7, 8, 9], [20, 4, 31], padded.slot_mapping, 4)
    assert host.dtype == torch.int64 and host.shape == (3, 4)
    assert host[0].tolist() == [7, 8, 9, 0]
    assert host[1].tolist() == [20, 4, 31, 0]
    assert host[2].tolist() == [9 * 16 + 4, 5 * 16 + 4, 2 * 16 + 15, 11 * 16]


def test_pad_inputs_rejects_mismatched_lengths():
    pb = pad_decode_batch(build_paged_batch([(0, 1, [0])], 16), 2, 3)
    with pytest.raises(ValueError):
        pad_decode_inputs([1, 2], [0], pb.slot_mapping, 2)
    with pytest.raises(ValueError):
        pad_decode_inputs([1], [0], pb.slot_mapping, 4)
