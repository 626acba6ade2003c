"""`sarathi plan`'s disaggregation threshold (sarathi.measure.plan.plan_disagg_threshold): the
longest whole prompt that fits one SLO-compliant iteration beside the expected decode batch."""
from __future__ import annotations

import json

import pytest

from sarathi.cli import main
from sarathi.measure.costmodel import CostModel
from sarathi.measure.gpu_costmodel import GPUCostModel
from sarathi.measure.plan import plan_disagg_threshold, prompt_iteration_time


class Linear(CostModel):
    """1 ms per iteration + 0.1 ms per prompt token + 1 ms per decode: exact answers."""

    def __init__(self):
        pass

    def predict_shapes(self, shapes):
        return 1e-3 + sum(1e-3 if dec else 1e-4 * n for _, n, dec in shapes)


def test_the_threshold_is_the_longest_prompt_that_fits_beside_the_decodes():
    # 1 ms + 10 decodes x 1 ms + c x 0.1 ms <= 50 ms  ->  c <= 390, a multiple of 32: 384
    r = plan_disagg_threshold(Linear(), 0.050, context=1024, decode_batch=10, tile=32)
    assert r["disagg_threshold"] == 384
    assert r["iteration_s"] == pytest.approx(0.011 + 0.0384) and r["iteration_s"] <= 0.050
    assert prompt_iteration_time(Linear(), 384 + 32, 10, 1024) > 0.050


@pytest.mark.parametrize("model", [Linear(), GPUCostModel("llama-3-8b", "a100")], ids=["linear", "a100"])
def test_the_threshold_grows_with_the_slo_and_shrinks_with_the_decode_batch(model):
    by_slo = [plan_disagg_threshold(model, s, context=2048, decode_batch=32)["disagg_threshold"]
              for s in (0.05, 0.1, 0.2, 0.4)]
    assert by_slo == sorted(by_slo) and by_slo[0] < by_slo[-1]
    by_batch = [plan_disagg_threshold(model, 0.1, context=2048, decode_batch=b)["disagg_threshold"]
                for b in (0, 32, 64)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[0] > by_batch[-1]


def test_no_room_beside_the_decodes_means_every_prompt_is_disaggregated():
    r = plan_disagg_threshold(Linear(), 0.010, context=1024, decode_batch=10)   # decodes alone: 11 ms
    assert r["disagg_threshold"] == 0


def test_the_transfer_time_of_a_threshold_prompt_is_reported_beside_it():
    r = plan_disagg_threshold(Linear(), 0.050, context=1024, decode_batch=10, kv_bytes_per_token=1000,
                              kv_link_gbs=2.0)
    assert r["kv_bytes"] == 384 * 1000 and r["kv_transfer_s"] == pytest.approx(384e3 / 2e9)
    assert plan_disagg_threshold(Linear(), 0.050, context=1024, decode_batch=10)["kv_transfer_s"] is None


def test_plan_cli_writes_and_prints_the_threshold(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--device", "a100", "--tbt-slo", "0.1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    m = GPUCostModel("llama-3-8b", "a100")
    assert res["disagg_threshold"] == res["disagg"]["disagg_threshold"] > 0
    assert res["disagg"]["kv_bytes"] == res["disagg_threshold"] * m.shape.kv_bytes_per_token(32, 1)
    assert f"disaggregation threshold {res['disagg_threshold']} tokens" in capsys.readouterr().out
    assert out.with_suffix(".png").exists()
