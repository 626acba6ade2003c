"""sarathi.measure.scrape: a /metrics page read with prometheus_client's parser, as the benchmarks
read the replicas' pages."""
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sarathi.measure.scrape import summed


def page() -> str:
    reg = CollectorRegistry()
    waiting = Gauge("vllm:num_requests_waiting", "queued", ["model_name", "engine"], registry=reg)
    waiting.labels("m", "0").set(3)
    waiting.labels("m", "1").set(2)
    drafts = Counter("sarathi_scheduler_spec_draft_tokens", "drafts", registry=reg)
    drafts.inc(7)
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", buckets=[0.1, 1.0], registry=reg)
    ttft.observe(0.5)
    return generate_latest(reg).decode()


def test_samples_are_summed_over_label_sets_by_their_exported_names():
    s = summed(page())
    assert s["vllm:num_requests_waiting"] == 5.0
    assert s["sarathi_scheduler_spec_draft_tokens_total"] == 7.0       # counters keep _total
    assert s["vllm:time_to_first_token_seconds_count"] == 1.0
    assert s["vllm:time_to_first_token_seconds_sum"] == 0.5


def test_a_prefix_keeps_only_its_samples():
    s = summed(page(), "vllm:")
    assert "sarathi_scheduler_spec_draft_tokens_total" not in s
    assert s["vllm:num_requests_waiting"] == 5.0


def test_a_page_that_is_not_prometheus_text_is_an_error():
    with pytest.raises(ValueError):
        summed("<html>502 Bad Gateway</html>\n")
