"""Read a Prometheus text page (a replica's /metrics) with prometheus_client's own parser.

summed(text, prefix) -> {sample name: value summed over its label sets}: what the benchmarks
compare across arms and replicas (a gauge of one replica has one label set per model/engine; a
counter's sample is named with its _total suffix, as exported). Histogram buckets are summed like
any sample: read them by name only where that sum means something."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def summed(text: str, prefix: str = "") -> dict[str, float]:
    """Every sample whose name starts with `prefix`, summed over its label sets. Raises
    ValueError on text that is not the Prometheus exposition format."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out
