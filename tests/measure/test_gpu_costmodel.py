"""The profile-driven GPU cost model (sarathi.measure.gpu_costmodel) against the A100 profiles it
is built from. Stated errors: the measured shapes' per-layer linear time at every profiled token
count within 1e-6 (interpolation through the rows); a shape predicted by scaling another's profile
within 5% median / 12% P90 of its own measured rows; the collectives' alpha-beta fits within 15%
median relative error."""
from __future__ import annotations

import numpy as np
import pytest

from sarathi.measure.gpu_costmodel import (
    MODELS,
    OPS,
    GPUCostModel,
    fit_collective,
    interpolate,
    linear_profile,
    slo_decode_s,
)


@pytest.mark.parametrize("shape", ["llama-2-7b", "llama-3-8b"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_linear_terms_reproduce_the_profiled_rows(shape, tp):
    xs, ys = linear_profile(shape)[tp]
    model = GPUCostModel(shape, "a100", tp=tp)
    for n, row in zip(xs[::7], ys[::7]):
        got = model.breakdown([(0, n, False)])
        assert got["linear"] == pytest.approx(MODELS[shape].num_layers * row[1:].sum() / 1e3, rel=1e-6)
        assert got["embed"] == pytest.approx(row[0] / 1e3, rel=1e-6)


def test_between_rows_the_linear_time_lies_between_its_neighbours():
    xs, ys = linear_profile("llama-3-8b")[1]
    i = next(i for i in range(len(xs) - 1) if xs[i + 1] - xs[i] > 1)
    mid = interpolate(xs, ys, (xs[i] + xs[i + 1]) / 2)[1:].sum()
    lo, hi = sorted((ys[i][1:].sum(), ys[i + 1][1:].sum()))
    assert lo <= mid <= hi


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_scaling_a_measured_shape_predicts_another_measured_shape(tp):
    """The rule used for unprofiled models (op time x weight-size ratio), checked on the one pair
    we can check: Llama-3-8B's measured rows predicted from the Llama-2-7B profile."""
    base, target = MODELS["llama-2-7b"], MODELS["llama-3-8b"]
    scale = np.array([target.op_size(op) / base.op_size(op) for op in ("emb",) + OPS])
    bx, by = linear_profile("llama-2-7b")[tp]
    xs, ys = linear_profile("llama-3-8b")[tp]
    rel = [abs((interpolate(bx, by, n) * scale)[1:].sum() / y[1:].sum() - 1)
           for n, y in zip(xs, ys) if n <= bx[-1]]
    assert len(rel) > 200
    assert np.median(rel) < 0.05 and np.percentile(rel, 90) < 0.12


@pytest.mark.parametrize("collective,ranks", [("all_reduce", 2), ("all_reduce", 4), ("all_reduce", 8),
                                              ("send_recv", 2)])
def test_collective_fits_reproduce_the_network_profile(collective, ranks):
    fit = fit_collective("a100_dgx", collective, ranks)
    assert fit.fit_median_rel < 0.15
    assert fit(64 << 20) > fit(1 << 20) > fit(0) > 0


def test_breakdown_terms_add_up_and_the_kv_transfer_term_is_separate():
    m = GPUCostModel("llama-2-70b", "a100", tp=4, pp=2)
    shapes = [(2000, 1, True)] * 40 + [(512, 472, False)]
    b = m.breakdown(shapes)
    parts = sum(b[k] for k in ("linear", "attention", "tp_comm", "pp_comm", "embed", "lm_head", "cpu",
                               "kv_transfer"))
    assert b["total"] == pytest.approx(parts) == pytest.approx(sum(b["stages"]))
    assert len(b["stages"]) == 2 and b["tp_comm"] > 0 and b["pp_comm"] > 0 and b["kv_transfer"] == 0
    moved = m.breakdown(shapes, kv_transfer_tokens=2000)
    assert moved["kv_transfer"] > 0 and moved["total"] > b["total"]


def test_iteration_time_grows_with_decodes_context_and_chunk():
    m = GPUCostModel("llama-3-8b", "a100")
    t = m.predict_shapes
    assert t([(1024, 1, True)] * 8) < t([(1024, 1, True)] * 64) < t([(4096, 1, True)] * 64)
    assert t([(0, 256, False)]) < t([(0, 2048, False)]) < t([(4096, 2048, False)])


def test_h100_is_faster_than_a100_and_the_slo_base_is_in_the_papers_range():
    a100, h100 = GPUCostModel("mistral-7b", "a100"), GPUCostModel("mistral-7b", "h100")
    # the paper's strict SLO for Mistral-7B on an A100 is 0.1 s = 5x this decode (Table 3)
    assert 0.015 < slo_decode_s(a100) < 0.03
    assert slo_decode_s(h100) < slo_decode_s(a100)
    assert h100.predict_shapes([(0, 2048, False)]) < a100.predict_shapes([(0, 2048, False)]) / 2


def test_layouts_that_do_not_fit_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="does not fit"):
        GPUCostModel("llama-2-70b", "a100", tp=1).kv_blocks(16)
    with pytest.raises(ValueError, match="tp"):
        GPUCostModel("llama-3-8b", "a100", tp=3)
    assert GPUCostModel("llama-3-8b", "a100").kv_blocks(16) > 20000
