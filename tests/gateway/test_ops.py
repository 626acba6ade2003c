"""Operations: health and readiness probes, Prometheus metrics, and a torch-free import."""
from __future__ import annotations

import subprocess
import sys

import httpx

from tests.support.gateway_fakes import Plan, metric


def test_health_answers_while_the_process_lives(make_stack):
    stack = make_stack()
    assert httpx.get(stack.url + "/health").json() == {"status": "ok"}


def test_ready_needs_a_live_scheduler(make_stack):
    stack = make_stack()
    assert httpx.get(stack.url + "/ready").status_code == 200
    stack.fake.close()  # its heartbeat goes away
    resp = httpx.get(stack.url + "/ready")
    assert resp.status_code == 503 and "scheduler" in resp.json()["reason"]


def test_the_readiness_check_is_injectable(make_stack):
    state = {"ok": False}

    async def check() -> bool:
        return state["ok"]

    stack = make_stack(ready_check=check)
    assert httpx.get(stack.url + "/ready").status_code == 503
    state["ok"] = True
    assert httpx.get(stack.url + "/ready").status_code == 200


def test_metrics_expose_latency_histograms_and_outcomes(make_stack):
    stack = make_stack(plan=lambda req: Plan("a b c d e f", interval_s=0.01))
    client = stack.client()
    client.completions.create(model="smol-test", prompt="x", max_tokens=50)
    client.completions.create(model="smol-test", prompt="x", max_tokens=2)
    httpx.post(stack.url + "/v1/completions", json={"prompt": "x", "n": 0})
    m = lambda name: metric(stack.url, name)  # noqa: E731
    assert m("sarathi_gateway_time_to_first_token_seconds_count") == 2
    assert m("sarathi_gateway_inter_token_latency_seconds_count") >= 5
    assert m("sarathi_gateway_queue_time_seconds_count") == 2
    assert m("sarathi_gateway_e2e_request_latency_seconds_count") == 2
    text = httpx.get(stack.url + "/metrics").text
    assert 'sarathi_gateway_requests_finished_total{reason="stop"} 1.0' in text
    assert 'sarathi_gateway_requests_finished_total{reason="length"} 1.0' in text
    assert m("sarathi_gateway_requests_accepted_total") == 2
    assert 'sarathi_gateway_requests_rejected_total{status="400"} 1.0' in text
    assert m("sarathi_gateway_requests_in_flight") == 0


def test_the_gateway_does_not_import_torch():
    code = ("import sys, gateway.app, gateway.server, shared.queue.redis_scheduler, shared.queue.local; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_an_unreachable_queue_gets_503_and_not_ready(tokenizer):
    from gateway.app import create_app
    from shared.config import ModelInfo
    from shared.queue import make_gateway_queue
    from tests.support.gateway_fakes import ServerThread
    from tests.support.redis_fixture import free_port

    queue = make_gateway_queue(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    info = ModelInfo("m", 256, tokenizer.vocab_size, tokenizer.eos_token_ids)
    server = ServerThread(create_app(tokenizer, info, queue))
    try:
        resp = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_unavailable"
        assert httpx.get(server.url + "/ready").status_code == 503
    finally:
        server.stop()


def test_model_info_comes_from_the_model_files(tokenizer, tmp_path):
    import json

    from gateway.server import model_info_from_source
    from shared.model_source import ModelSource, resolve_model

    info = model_info_from_source(resolve_model(None), tokenizer)
    assert (info.name, info.max_model_len, info.num_layers) == ("SmolLM2-135M-Instruct", 8192, 30)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "num_hidden_layers": 2}))
    hf = ModelSource("hf", tmp_path, "tiny")
    assert model_info_from_source(hf, tokenizer).max_model_len == 4096
    assert model_info_from_source(hf, tokenizer, max_model_len=1024).max_model_len == 1024  # scheduler's limit
