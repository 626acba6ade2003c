"""Serving metrics of one load-generator run (definitions: DESIGN.md "Metrics", the paper's).

A run produces one RequestRecord per request it issued, finished or not, and one IterationRecord
per engine iteration (in-process targets only). Times are seconds on the run's clock.

Invariant: a request that did not finish is never absent from a metric. Every token it was due
(its trace output length, EOS ignored) and did not get by the end of the run is a missing
sample, counted as +inf:
* TTFT: +inf if no first token;
* TBT: one +inf sample per token gap that never closed (expected gaps - observed gaps);
* scheduling delay: +inf if never scheduled; end-to-end latency: +inf if unfinished.
So a run that leaves more than 1% of its token gaps open has P99 TBT = inf (an SLO miss).

Percentiles are nearest-rank (the smallest sample with at least p% of samples at or below it):
exact on small inputs and well defined with +inf samples.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

INF = float("inf")


@dataclass
class RequestRecord:
    """One issued request. arrival: when it was due to arrive (open loop: not when the
    target accepted it). first_scheduled: None when unknown (HTTP) or never scheduled.
    token_times: arrival time of each output token (in HTTP mode, of the SSE chunk that
    carried it). expected_tokens: output tokens the request asks for (EOS ignored)."""

    req_id: str
    arrival: float
    prompt_tokens: int
    expected_tokens: int
    token_times: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    finished: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival if self.token_times else INF

    @property
    def tbts(self) -> list[float]:
        """Observed gaps between consecutive tokens (the first token is not a sample)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def missing_gaps(self) -> int:
        """Token gaps the request was due and never got (0 when finished)."""
        if self.finished:
            return 0
        return max(0, self.expected_tokens - 1 - max(0, len(self.token_times) - 1))

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival if self.finished and self.token_times else INF

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class IterationRecord:
    """One engine iteration: start time (s, run clock), duration (s), prefill tokens
    (prompt and recompute tokens), decodes (1-token sampled steps), sequences in the batch,
    decode_kv (KV tokens the decodes read), prefill_pairs (query x key pairs of the prefill
    chunks): enough to evaluate a cost model (sarathi.measure.costmodel) on the real batch."""

    start: float
    duration: float
    prefill_tokens: int
    decodes: int
    num_seqs: int
    decode_kv: int = 0
    prefill_pairs: float = 0.0


def percentile(samples: list[float], p: float) -> float:
    """Nearest-rank p-th percentile (0 < p <= 100); nan for no samples."""
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    if not samples:
        return math.nan
    s = sorted(samples)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def summarize(records: list[RequestRecord], iterations: list[IterationRecord] | None = None,
              end_time: float | None = None) -> dict:
    """The run's metrics (seconds; tok/s). end_time: when the run stopped waiting (defaults
    to the last token seen); output throughput counts tokens over first arrival .. end."""
    if not records:
        raise ValueError("no requests in the run")
    ttft = [r.ttft for r in records]
    tbt = [g for r in records for g in r.tbts] + [INF] * sum(r.missing_gaps for r in records)
    sched = [INF if r.first_scheduled is None else r.first_scheduled - r.arrival
             for r in records]
    known_sched = any(r.first_scheduled is not None for r in records)
    e2e = [r.e2e for r in records]
    start = min(r.arrival for r in records)
    last = max((r.token_times[-1] for r in records if r.token_times), default=start)
    end = max(end_time if end_time is not None else last, last)
    out_tokens = sum(len(r.token_times) for r in records)
    finished = sum(r.finished for r in records)
    out = {
        "requests": len(records), "finished": finished, "unfinished": len(records) - finished,
        "errors": sum(r.error is not None for r in records),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "tbt_p50_s": percentile(tbt, 50), "tbt_p99_s": percentile(tbt, 99),
        "tbt_max_s": max(tbt) if tbt else math.nan,
        "tbt_samples": len(tbt), "tbt_missing": sum(r.missing_gaps for r in records),
        "sched_delay_p50_s": percentile(sched, 50) if known_sched else None,
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "output_tokens": out_tokens, "duration_s": end - start,
        "output_tok_per_s": out_tokens / (end - start) if end > start else 0.0,
        "finished_req_per_s": finished / (end - start) if end > start else 0.0,
    }
    if iterations:
        times = [it.duration for it in iterations]
        out.update(iterations=len(iterations), iteration_p50_s=percentile(times, 50),
                   iteration_max_s=max(times))
    return out


def windowed_tbt_p99(records: list[RequestRecord], start: float, end: float, windows: int) -> list[dict]:
    """P99 TBT per equal time window of [start, end): each observed gap counts in the window its
    second token falls in (gaps that never closed are not in any window; the whole-run P99 has
    them). [{"start", "end", "tbt_p99_s", "samples"}], nan for a window without gaps."""
    if windows < 1 or not end > start:
        return []
    width = (end - start) / windows
    gaps: list[list[float]] = [[] for _ in range(windows)]
    for r in records:
        t = r.token_times
        for a, b in zip(t, t[1:]):
            i = int((b - start) // width)
            if 0 <= i < windows:
                gaps[i].append(b - a)
    return [{"start": start + i * width, "end": start + (i + 1) * width,
             "tbt_p99_s": percentile(g, 99), "samples": len(g)} for i, g in enumerate(gaps)]


def meets_slo(summary: dict, tbt_slo_s: float, max_sched_delay_s: float = 2.0,
              max_ttft_p50_s: float | None = None) -> bool:
    """The paper's capacity criterion: P99 TBT <= SLO and P50 scheduling delay <= 2 s. When
    the target cannot report scheduling delay (HTTP), that condition is skipped; an optional
    P50 TTFT bound applies on top. Unfinished requests are already +inf samples; a run with
    no token gaps at all (one-token outputs) has nothing to miss on TBT."""
    tbt = summary["tbt_p99_s"]
    ok = math.isnan(tbt) or tbt <= tbt_slo_s
    if summary.get("sched_delay_p50_s") is not None:
        ok = ok and summary["sched_delay_p50_s"] <= max_sched_delay_s
    if max_ttft_p50_s is not None:
        ok = ok and summary["ttft_p50_s"] <= max_ttft_p50_s
    return ok


def json_safe(x):
    """inf/nan -> strings, so results are strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
