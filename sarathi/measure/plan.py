"""`sarathi plan`: the token budget tau for a TBT SLO, from a profile's cost model.

tau is the largest multiple of `tile` tokens such that a hybrid iteration of the decode batch
expected at the load (B decodes at context C) plus one prefill chunk filling the rest of the
budget (tau - B tokens, after a prefix of C/2) is predicted to take at most `margin` x the SLO.
A Sarathi iteration is never longer than that batch (the budget caps its tokens), so every
token gap of a running request stays within the SLO while no preemption happens.

The decode batch B: given, or (with qps and the trace's mean output length) the fixed point of
Little's law, B = qps x mean_output_tokens x iteration_time(tau, B), capped at max_num_seqs.

Disaggregation threshold (`disagg_threshold`, for `--disaggregation auto`): the largest prompt
length c (a multiple of `tile`) such that one iteration of the expected decode batch plus the whole
c-token prompt (from position 0) is predicted within the TBT SLO. A prompt up to c tokens then
costs the decode worker at most one SLO-compliant iteration when it runs colocated, so moving it
saves no TBT; a longer one needs several chunked iterations (or a stall) there, and disaggregating
it costs its KV transfer instead, reported beside it (c x KV bytes per token / link bandwidth)
so a reader sees what the prompts at the threshold pay on the link. Grows with the SLO; shrinks as
the decode batch grows; 0 when not even one tile fits beside the decode batch.

Reading a plan file back (`--token-budget auto|FILE`) is configuration: shared.config.resolve_token_budget.
"""
from __future__ import annotations

from sarathi.measure.costmodel import CostModel


def iteration_time(model: CostModel, tau: int, decodes: int, context: int) -> float:
    """Predicted seconds of `decodes` decodes at `context` + a chunk of tau - decodes tokens."""
    shapes = [(context, 1, True)] * decodes
    if tau > decodes:
        shapes.append((context // 2, tau - decodes, False))
    return model.predict_shapes(shapes)


def plan_token_budget(model: CostModel, tbt_slo_s: float, *, context: int, tile: int = 32,
                      decode_batch: int | None = 32, qps: float | None = None,
                      mean_output_tokens: float | None = None, max_num_seqs: int = 128,
                      max_tau: int = 8192, margin: float = 1.0) -> dict:
    """Returns {"token_budget": tau, "iteration_s": predicted time at tau, "decode_batch": B,
    ...}; raises ValueError if not even one tile fits the SLO."""
    if not tbt_slo_s > 0:
        raise ValueError(f"--tbt-slo must be > 0 seconds, got {tbt_slo_s}")
    if tile < 1:
        raise ValueError(f"--tile must be >= 1, got {tile}")
    if qps is not None and not qps > 0:
        raise ValueError(f"--qps must be > 0, got {qps}")
    target = tbt_slo_s * margin

    def batch_at(tau: int) -> int:
        if qps is None or mean_output_tokens is None:
            return min(decode_batch or 0, max_num_seqs, tau)
        b = 1
        for _ in range(50):   # fixed point of B = qps * L * t(tau, B); monotone, converges fast
            nb = min(max_num_seqs, tau, max(1, round(qps * mean_output_tokens
                                                     * iteration_time(model, tau, b, context))))
            if nb == b:
                break
            b = nb
        return b

    best = None
    for tau in range(tile, max_tau + 1, tile):
        b = batch_at(tau)
        t = iteration_time(model, tau, b, context)
        if t <= target:
            best = (tau, b, t)
    if best is None:
        b = batch_at(tile)
        raise ValueError(f"no token budget fits a {tbt_slo_s:.3g} s TBT SLO: even {tile} tokens "
                         f"with {b} decodes take {iteration_time(model, tile, b, context):.3g} s")
    tau, b, t = best
    return {"token_budget": tau, "iteration_s": t, "decode_batch": b, "context": context,
            "tile": tile, "tbt_slo_s": tbt_slo_s, "margin": margin, "qps": qps,
            "curve": [{"tau": x, "iteration_s": iteration_time(model, x, batch_at(x), context)}
                      for x in range(tile, min(max_tau, 4 * tau) + 1, tile)]}


def prompt_iteration_time(model: CostModel, prompt: int, decodes: int, context: int) -> float:
    """Predicted seconds of `decodes` decodes at `context` + a whole `prompt`-token prefill."""
    shapes = [(context, 1, True)] * decodes
    if prompt > 0:
        shapes.append((0, prompt, False))
    return model.predict_shapes(shapes)


def plan_disagg_threshold(model: CostModel, tbt_slo_s: float, *, context: int, decode_batch: int,
                          tile: int = 32, max_tokens: int = 8192, kv_bytes_per_token: int = 0,
                          kv_link_gbs: float = 25.0) -> dict:
    """The disaggregation threshold (see the module doc): {"disagg_threshold": tokens,
    "iteration_s": predicted iteration with a prompt of that length (or with the decodes alone
    when it is 0), "kv_bytes", "kv_transfer_s": that prompt's KV over the link (None without
    kv_bytes_per_token), "curve": [{"prompt", "iteration_s"}]}."""
    if not tbt_slo_s > 0:
        raise ValueError(f"--tbt-slo must be > 0 seconds, got {tbt_slo_s}")
    if tile < 1 or decode_batch < 0:
        raise ValueError("tile must be >= 1 and the decode batch >= 0")
    if not kv_link_gbs > 0:
        raise ValueError(f"--kv-link-gbs must be > 0, got {kv_link_gbs}")
    best, curve = 0, []
    for c in range(tile, max_tokens + 1, tile):
        t = prompt_iteration_time(model, c, decode_batch, context)
        curve.append({"prompt": c, "iteration_s": t})
        if t <= tbt_slo_s:
            best = c
        elif best and c > 4 * best:
            break
    nbytes = best * kv_bytes_per_token
    return {"disagg_threshold": best, "decode_batch": decode_batch, "context": context,
            "tbt_slo_s": tbt_slo_s, "iteration_s": prompt_iteration_time(model, best, decode_batch, context),
            "kv_bytes_per_token": kv_bytes_per_token or None, "kv_link_gbs": kv_link_gbs,
            "kv_bytes": nbytes if kv_bytes_per_token else None,
            "kv_transfer_s": nbytes / (kv_link_gbs * 1e9) if kv_bytes_per_token else None,
            "curve": curve}
