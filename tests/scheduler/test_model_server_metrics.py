"""The model-server protocol of Kubernetes' inference gateway: the scheduler's /metrics, scraped
over HTTP and parsed with Prometheus' own text parser, carries vLLM's metrics with vLLM's meaning
(queued and running requests, KV-cache usage as a fraction, prefix-cache tokens, the cache and
LoRA info gauges), agreeing with the scheduler's own numbers, beside its own metrics."""
from __future__ import annotations

import asyncio
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from shared.config import SchedulerConfig, SchedulerServiceConfig
from tests.support.sim_worker import BLOCK, NUM_BLOCKS, SimWorker, ThreadedStack, collect, eventually, request
from worker_svc.service import WorkerServer


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str | None = None) -> float:
    (s,) = [s for s in families[name] if s.name == (sample or name)]
    assert s.labels["model_name"] == "sim" and s.labels["engine"] == "0"
    return s.value


def test_vllm_named_metrics_follow_the_scheduler(tmp_path):
    server = WorkerServer(SimWorker(delay_s=0.02), f"ipc://{tmp_path}/w.sock")
    stack = ThreadedStack([server], SchedulerServiceConfig(
        SchedulerConfig(max_num_seqs=3, token_budget=16, enable_prefix_caching=True),
        worker_addrs=[server.address], metrics_port=0, metrics_host="127.0.0.1"))
    try:
        port = stack.service.http_port
        assert eventually(lambda: scrape(port)["vllm:cache_config_info"])   # after the first loop turn
        idle = scrape(port)
        assert value(idle, "vllm:num_requests_waiting") == 0 and value(idle, "vllm:num_requests_running") == 0
        assert value(idle, "vllm:kv_cache_usage_perc") == 0
        (info,) = idle["vllm:cache_config_info"]
        assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.value) == (
            str(BLOCK), str(NUM_BLOCKS), 1.0)
        (lora,) = idle["vllm:lora_requests_info"]
        assert lora.labels["max_lora"] == "0" and lora.labels["running_lora_adapters"] == "" and lora.value > 1e9
        assert "sarathi_scheduler_running_requests" in idle   # our own metrics stay beside them

        # 6 requests, 3 may run at once: the rest wait; what is scraped is what the scheduler holds
        done = threading.Thread(target=lambda: asyncio.run(collect(
            stack.gq, [request(f"r{i}", prompt_len=9, max_tokens=30) for i in range(6)])))
        done.start()
        seen = []

        def busy() -> bool:
            m = scrape(port)
            seen.append(m)
            return value(m, "vllm:num_requests_running") == 3 and value(m, "vllm:num_requests_waiting") >= 1

        assert eventually(busy, timeout=10)
        m = seen[-1]
        usage = value(m, "vllm:kv_cache_usage_perc")
        assert 0 < usage <= 1 and value(m, "vllm:gpu_cache_usage_perc") == usage
        assert value(m, "vllm:num_requests_waiting") + value(m, "vllm:num_requests_running") <= 6
        done.join(30)
        assert not done.is_alive()

        def settled() -> bool:
            m = scrape(port)
            return (value(m, "vllm:num_requests_running") == 0 and value(m, "vllm:num_requests_waiting") == 0
                    and value(m, "vllm:kv_cache_usage_perc") == 0)

        assert eventually(settled)
        end, stats = scrape(port), stack.service.snapshot
        # the same prompt six times: the later ones find its first two blocks cached
        assert value(end, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == \
            stats["prefix_cache_query_tokens"] == 6 * 9
        assert value(end, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == \
            stats["prefix_cache_hit_tokens"] > 0
        assert value(end, "vllm:num_preemptions", "vllm:num_preemptions_total") == stats["num_preemptions"]
    finally:
        stack.close()


def test_requests_queued_in_front_of_the_scheduler_count_as_waiting():
    """A replica's own queue (embedded mode) holds requests the scheduler has not pulled yet: the
    picker must see them as waiting too (backlog)."""
    from prometheus_client import CollectorRegistry

    from scheduler_svc.metrics import SchedulerMetrics

    metrics = SchedulerMetrics(CollectorRegistry())
    metrics.set_worker("m", "cpu", block_size=16)
    metrics.model_server.backlog = lambda: 5
    metrics.observe_stats(dict(running=2, waiting=1, kv_usage=0.25, num_free_blocks=3, num_total_blocks=4,
                               num_preemptions=0, prefix_cache_hit_tokens=0, prefix_cache_query_tokens=0))
    from prometheus_client import generate_latest

    fams = {f.name: f.samples for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    assert [s.value for s in fams["vllm:num_requests_waiting"]] == [6.0]
    assert [s.value for s in fams["vllm:num_requests_running"]] == [2.0]
    assert [s.value for s in fams["vllm:kv_cache_usage_perc"]] == [0.25]
