"""`sarathi profile`: the iteration-time table of this machine and model, the SLOs it implies,
and a cost model fitted to it (sarathi.measure.costmodel).

Cases (each through executor.execute, so prepare + forward + sampling count):
* decode: B decodes of one token at context C (B in DECODE_BATCHES, C in {C_slo/4, C_slo});
* prefill: one chunk of N tokens after an empty prefix, and one after a prefix of C_slo;
* hybrid: HYBRID_DECODES decodes at context C_slo/2 plus one chunk of N tokens.
C_slo (`slo_context`) is the context of the SLO rule: the paper's rule is a decode-only batch
of 32 at 4k-token contexts; runs of a length-scaled trace scale that context by the same
factor (4096 x 0.125 = 512), and the result says which context was used.

SLOs (paper, Table 3): strict = 5x, relaxed = 25x the decode-only iteration of batch 32 at
C_slo. Each case runs `rounds` times (after one warm-up pass), all cases of a round back to
back; the median is kept. The KV cache holds whatever was there: attention cost depends on
lengths, not values.
"""
from __future__ import annotations

import statistics
from typing import Callable

from sarathi.measure.costmodel import CostModel, Shape, fit
from shared.messages import Batch, SeqChunk
from shared.sampling import SamplingParams

DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024)
HYBRID_TOKENS = (64, 256, 512)
HYBRID_DECODES = 32
SLO_BATCH = 32
STRICT, RELAXED = 5.0, 25.0
GREEDY = SamplingParams(temperature=0.0)


def cases(slo_context: int, quick: bool = False) -> list[dict]:
    """The profile's cases: kind, shapes (start_pos, tokens, is_decode) and labels."""
    c = slo_context
    out = []
    batches = (1, SLO_BATCH) if quick else DECODE_BATCHES
    for ctx in sorted({max(1, c // 4), c}):
        for b in batches:
            out.append({"kind": "decode", "batch": b, "context": ctx,
                        "shapes": [(ctx, 1, True)] * b})
    for n in ((16, 128, 512) if quick else PREFILL_TOKENS):
        out.append({"kind": "prefill", "tokens": n, "prefix": 0, "shapes": [(0, n, False)]})
    out.append({"kind": "prefill", "tokens": 256, "prefix": c, "shapes": [(c, 256, False)]})
    for n in ((256,) if quick else HYBRID_TOKENS):
        out.append({"kind": "hybrid", "decodes": HYBRID_DECODES, "context": c // 2, "tokens": n,
                    "shapes": [(c // 2, 1, True)] * HYBRID_DECODES + [(0, n, False)]})
    if not quick:
        out += serving_cases(c)
    return out


def serving_cases(c: int) -> list[dict]:
    """Batches real serving makes that the grid above lacks (their absence is why a model fitted
    to it under-predicted real runs' tails, bench/results/sim/README.md): whole prompts batched
    together (vllm, orca), a long single prefill, decodes with ragged contexts (same mean), and a
    chunk after a cached prefix next to decodes (sarathi's later chunks)."""
    out = [{"kind": "prefill", "tokens": n, "prefix": 0, "prompts": k, "shapes": [(0, n, False)] * k}
           for k, n in ((4, 256), (8, 256), (2, 1024))]
    out.append({"kind": "prefill", "tokens": 2048, "prefix": 0, "shapes": [(0, 2048, False)]})
    lo, hi = max(1, c // 8), 2 * c - max(1, c // 8)
    ragged = [(lo + (hi - lo) * i // (SLO_BATCH - 1), 1, True) for i in range(SLO_BATCH)]
    out.append({"kind": "decode", "batch": SLO_BATCH, "context": c, "ragged": True, "shapes": ragged})
    out.append({"kind": "hybrid", "decodes": HYBRID_DECODES, "context": c // 2, "tokens": 256, "prefix": c,
                "shapes": [(c // 2, 1, True)] * HYBRID_DECODES + [(c, 256, False)]})
    return out


def blocks_needed(all_cases: list[dict], block_size: int) -> int:
    return max(sum(-(-(s + n) // block_size) for s, n, _ in case["shapes"]) for case in all_cases)


def make_batch(shapes: list[Shape], block_size: int) -> Batch:
    """A batch of the given shapes over disjoint block ranges (ids from 0)."""
    seqs, next_block = [], 0
    for i, (start, n, decode) in enumerate(shapes):
        nb = -(-(start + n) // block_size)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        seqs.append(SeqChunk(f"p{i}", [100 + i % 1000] * n, start, table, True, GREEDY,
                             1 if decode else 0))
    return Batch(0, seqs)


def run_profile(execute: Callable[[Batch], object], clock: Callable[[], float], *,
                block_size: int, slo_context: int, rounds: int = 3, quick: bool = False,
                on_case: Callable[[], None] | None = None) -> dict:
    """Measure every case; returns {"points": [...], "slo": {...}, "cost_model": {...}}."""
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if slo_context < 4:
        raise ValueError(f"--slo-context must be >= 4 tokens, got {slo_context}")
    all_cases = cases(slo_context, quick)
    batches = [make_batch(c["shapes"], block_size) for c in all_cases]
    for b in batches:                     # warm-up: first touch of weights and KV pages
        execute(b)
        if on_case:
            on_case()
    samples = [[] for _ in all_cases]
    for _ in range(rounds):
        for i, b in enumerate(batches):
            t0 = clock()
            execute(b)
            samples[i].append(clock() - t0)
            if on_case:
                on_case()
    points = []
    for case, ts in zip(all_cases, samples):
        p = {k: v for k, v in case.items() if k != "shapes"}
        p.update(seconds=statistics.median(ts), samples_s=[round(t, 5) for t in ts])
        points.append(p)
    model = fit([(c["shapes"], p["seconds"]) for c, p in zip(all_cases, points)])
    for c, p in zip(all_cases, points):
        p["model_s"] = model.predict_shapes(c["shapes"])
    base = next(p["seconds"] for p in points if p["kind"] == "decode" and p["batch"] == SLO_BATCH
                and p["context"] == slo_context and not p.get("ragged"))
    slo = {"rule": f"strict = {STRICT:g}x, relaxed = {RELAXED:g}x a decode-only iteration of "
                   f"batch {SLO_BATCH} at {slo_context}-token contexts (measured)",
           "context": slo_context, "decode_b32_s": base,
           "strict_s": STRICT * base, "relaxed_s": RELAXED * base}
    return {"points": points, "slo": slo, "cost_model": model.to_dict()}


def load_cost_model(profile: dict) -> CostModel:
    try:
        return CostModel.from_dict(profile["cost_model"])
    except (KeyError, TypeError):
        raise ValueError("the profile file has no cost_model (write it with `sarathi profile`)") from None
