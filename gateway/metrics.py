"""The gateway's Prometheus metrics (one registry per app, so several apps can live in one
process, as in tests). Times are seconds; token counts are tokens.

Names:
  sarathi_gateway_time_to_first_token_seconds   histogram: first token - arrival at the gateway
  sarathi_gateway_inter_token_latency_seconds   histogram: gap between consecutive tokens (TBT)
  sarathi_gateway_queue_time_seconds            histogram: taken by a scheduler - arrival
  sarathi_gateway_e2e_request_latency_seconds   histogram: end - arrival, finished requests
  sarathi_gateway_requests_finished_total{reason}  stop | length | abort | error | cancelled
  sarathi_gateway_requests_accepted_total       requests queued
  sarathi_gateway_requests_rejected_total{status}  answered with an error before queueing
  sarathi_gateway_prompt_tokens_total, sarathi_gateway_generation_tokens_total
  sarathi_gateway_duplicate_events_dropped_total  token events already seen (after a replay)
  sarathi_gateway_streams_dropped_total         streams cut because their client stopped reading
  sarathi_gateway_requests_in_flight            gauge: accepted and not finished
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        p, reg = "sarathi_gateway_", self.registry
        self.ttft = Histogram(p + "time_to_first_token_seconds", "First token time minus arrival",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Gap between consecutive tokens",
                             buckets=_TOKEN_GAP_BUCKETS, registry=reg)
        self.queue_time = Histogram(p + "queue_time_seconds", "Time from arrival to being taken by a scheduler",
                                    buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End minus arrival of finished requests",
                             buckets=_E2E_BUCKETS, registry=reg)
        self.finished = Counter(p + "requests_finished", "Finished requests by reason", ["reason"], registry=reg)
        self.accepted = Counter(p + "requests_accepted", "Requests accepted into the queue", registry=reg)
        self.rejected = Counter(p + "requests_rejected", "Requests answered with an error before queueing",
                                ["status"], registry=reg)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of accepted requests", registry=reg)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens received", registry=reg)
        self.duplicates = Counter(p + "duplicate_events_dropped", "Token events dropped as already seen",
                                  registry=reg)
        self.streams_dropped = Counter(p + "streams_dropped", "Streams cut because their client stopped reading",
                                       registry=reg)
        self.in_flight = Gauge(p + "requests_in_flight", "Accepted requests not yet finished", registry=reg)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the /metrics answer."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
