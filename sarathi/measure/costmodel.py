"""An iteration-time cost model fitted to a profile of the real engine (`sarathi profile`).

The paper's scale-out method (DESIGN.md "Scale-out"): run the real scheduler against a
simulated worker whose iteration time comes from a model fitted to measured iterations, after
checking the model against measured runs. The model is linear in a few batch features, each
with a physical reason:

    t = c0                       fixed cost: read all weights once, launch, sample  (s)
      + c1 * T                   linear layers, per token in the batch (T tokens)
      + c2 * max(0, T - knee)    above the knee the linear layers are compute bound
      + c3 * decode_kv / 1e3     decode attention: KV tokens read by the decodes
      + c4 * prefill_pairs / 1e6 prefill attention: query x key pairs of the chunks
      + c5 * S                   per-sequence overhead (metadata, sampling), S sequences

fitted by least squares on relative error (every point counts alike whether 30 ms or 3 s),
the knee picked from a small grid by the same error. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from shared.messages import Batch

KNEES = (16, 32, 64, 128, 256)
FEATURES = ("fixed", "tokens", "tokens_above_knee", "decode_kv_k", "prefill_pairs_m", "seqs")

# A chunk shape: (start_pos, num_tokens, is_decode), tokens.
Shape = tuple[int, int, bool]


def batch_shapes(batch: Batch) -> list[Shape]:
    return [(s.start_pos, len(s.token_ids), s.is_decode) for s in batch.seqs]


def aggregates(shapes: Iterable[Shape]) -> tuple[int, int, float, int]:
    """(tokens, decode KV tokens read, prefill query x key pairs, sequences) of a batch."""
    shapes = list(shapes)
    tokens = sum(n for _, n, _ in shapes)
    kv = sum(start + 1 for start, _, dec in shapes if dec)
    pairs = sum(n * (start + (n + 1) / 2) for start, n, dec in shapes if not dec)
    return tokens, kv, pairs, len(shapes)


def features_of(tokens: int, kv: int, pairs: float, seqs: int, knee: int) -> list[float]:
    return [1.0, float(tokens), float(max(0, tokens - knee)), kv / 1e3, pairs / 1e6, float(seqs)]


def features(shapes: Iterable[Shape], knee: int) -> list[float]:
    return features_of(*aggregates(shapes), knee)


@dataclass
class CostModel:
    """Iteration time in seconds of a batch of chunk shapes; coefs in FEATURES order."""

    coefs: list[float]
    knee: int
    fit_error: dict = field(default_factory=dict)   # relative errors on the fitted points

    def predict_shapes(self, shapes: Iterable[Shape]) -> float:
        return max(0.0, float(np.dot(self.coefs, features(shapes, self.knee))))

    def predict(self, tokens: int, kv: int, pairs: float, seqs: int) -> float:
        """From a batch's aggregates (e.g. a logged iteration, sarathi.measure.metrics.IterationRecord)."""
        return max(0.0, float(np.dot(self.coefs, features_of(tokens, kv, pairs, seqs, self.knee))))

    def __call__(self, batch: Batch) -> float:
        """SimExecutor's cost_model interface."""
        return self.predict_shapes(batch_shapes(batch))

    def to_dict(self) -> dict:
        return {"features": list(FEATURES), "coefs": self.coefs, "knee": self.knee,
                "fit_error": self.fit_error}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        if list(d.get("features", FEATURES)) != list(FEATURES) or len(d["coefs"]) != len(FEATURES):
            raise ValueError("cost model in the profile has other features than this version's")
        return cls([float(c) for c in d["coefs"]], int(d["knee"]), d.get("fit_error", {}))


def fit(points: list[tuple[list[Shape], float]]) -> CostModel:
    """Fit to (shapes, measured seconds) points; needs >= len(FEATURES) points."""
    return fit_aggregates([(*aggregates(shapes), t) for shapes, t in points])


def fit_aggregates(rows: list[tuple[int, int, float, int, float]]) -> CostModel:
    """Fit to (tokens, decode KV tokens, prefill pairs, sequences, measured seconds) rows: the
    profile's cases, or iterations logged by a real run (sarathi.measure.metrics.IterationRecord)."""
    if len(rows) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} profile points to fit, got {len(rows)}")
    y = np.array([r[4] for r in rows])
    if not (y > 0).all():
        raise ValueError("measured iteration times must be > 0")
    best = None
    for knee in KNEES:
        X = np.array([features_of(*r[:4], knee) for r in rows])
        w = 1.0 / y                                  # relative error
        coefs, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
        rel = np.abs(X @ coefs - y) / y
        if best is None or rel.mean() < best[0]:
            best = (rel.mean(), knee, coefs, rel)
    _, knee, coefs, rel = best
    return CostModel([float(c) for c in coefs], knee,
                     {"mean_rel": float(rel.mean()), "max_rel": float(rel.max()),
                      "points": len(rows)})
