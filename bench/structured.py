"""Structured outputs: what a constraint costs.

1. Schema compile time: every JSON schema of a set of real ones (the CI / config schemas
   check-jsonschema ships, the JSON Schema metaschemas, the OpenAI API's own types as pydantic
   emits them, this gateway's request bodies) through what the gateway does per request
   (shared.constraints.grammar_for + llguidance.LLMatcher on the SmolLM2 tokenizer), and the time
   to the first mask; p50 / p99 over schemas (each the median of `--repeats`).
2. Mask cost per decode step: the real ModelRunner (SmolLM2-135M, default CPU path) runs decode
   steps of `batch` requests at SHORT_CONTEXT, every request constrained to a nested schema (or
   none), sampling greedily; a request that completes its JSON starts again. Per step: the whole
   step, the mask fill (llguidance, on its thread while the forward pass runs), the wait for it
   after the forward pass, and the mask's application to the logits. Constrained and unconstrained
   blocks of steps alternate, so the load of the machine falls on both alike.
3. Decode throughput constrained vs unconstrained: batch / step time of the same runs.

  python -m bench.structured [--batches 1 32] [--steps 24] [--rounds 2] [--out bench/results/structured/structured.json]
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.common import BLOCK_SIZE, SHORT_CONTEXT, machine_line
from sarathi.measure.env import loadavg, machine, utc_now

NESTED = {   # an order with a customer, an address, lines and enums: 3 levels of objects / arrays
    "type": "object", "additionalProperties": False, "required": ["order_id", "customer", "items", "status"],
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email", "address"],
                     "properties": {"name": {"type": "string", "maxLength": 40},
                                    "email": {"type": "string", "format": "email"},
                                    "address": {"type": "object", "additionalProperties": False,
                                                "required": ["city", "zip"],
                                                "properties": {"city": {"type": "string", "maxLength": 30},
                                                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 5,
                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                            "properties": {"sku": {"type": "string", "maxLength": 12},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "price": {"type": "number"}}}},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"], "maxLength": 80}}}


# ---------------------------------------------------------------------------------------------
# 1. compile time
# ---------------------------------------------------------------------------------------------
def real_schemas() -> dict[str, dict]:
    """name -> schema, from packages installed with the test extra (nothing downloaded)."""
    import check_jsonschema
    import jsonschema_specifications
    import openai.types as ot
    import openai.types.chat as otc
    from pydantic import BaseModel, TypeAdapter

    out: dict[str, dict] = {}
    vendor = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor"
    for p in sorted(vendor.glob("*.json")):
        out[f"check-jsonschema/{p.stem}"] = json.loads(p.read_text())
    for uri, contents in jsonschema_specifications.REGISTRY.items():
        if isinstance(contents.contents, dict) and "draft-0" in uri:     # the single-file metaschemas
            out[f"metaschema/{uri.rsplit('/', 2)[-2]}"] = contents.contents
    for mod, names in ((otc, ["ChatCompletion", "ChatCompletionChunk", "ChatCompletionMessage",
                              "ChatCompletionMessageParam", "ChatCompletionToolParam", "CompletionCreateParams"]),
                       (ot, ["Completion", "CompletionCreateParams", "Model", "Embedding", "ModerationCreateResponse",
                             "Batch", "FileObject", "ImagesResponse"])):
        for n in names:
            t = getattr(mod, n, None)
            if t is None:
                continue
            try:
                schema = t.model_json_schema() if isinstance(t, type) and issubclass(t, BaseModel) \
                    else TypeAdapter(t).json_schema()
            except Exception:   # noqa: BLE001 - a type pydantic cannot express: skip it
                continue
            out[f"openai/{mod.__name__.rsplit('.', 1)[-1]}.{n}"] = schema
    from gateway.protocol import ChatCompletionRequest, CompletionRequest
    out["gateway/ChatCompletionRequest"] = ChatCompletionRequest.model_json_schema()
    out["gateway/CompletionRequest"] = CompletionRequest.model_json_schema()
    out["bench/nested_order"] = NESTED
    return out


def time_compiles(ll_tok, repeats: int) -> dict:
    import llguidance
    import numpy as np

    from shared.constraints import grammar_for

    rows = []
    mask = np.zeros(((ll_tok.vocab_size + 31) // 32,), dtype=np.int32)
    for name, schema in real_schemas().items():
        compile_s, first_mask_s, error = [], [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            try:
                grammar = grammar_for("json_schema", schema, "response_format")
                m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
            except Exception as exc:  # noqa: BLE001 - recorded as not compiled
                error = f"{type(exc).__name__}: {exc}"[:200]
                break
            t1 = time.perf_counter()
            if m.is_error():
                error = m.get_error()[:200]
                break
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            t2 = time.perf_counter()
            compile_s.append(t1 - t0)
            first_mask_s.append(t2 - t0)
        rows.append({"schema": name, "bytes": len(json.dumps(schema)), "error": error,
                     "compile_ms": statistics.median(compile_s) * 1e3 if compile_s else None,
                     "first_mask_ms": statistics.median(first_mask_s) * 1e3 if first_mask_s else None})
    ok = [r for r in rows if r["error"] is None]
    return {"schemas": rows, "compiled": len(ok), "total": len(rows),
            "compile_ms": _pcts([r["compile_ms"] for r in ok]),
            "first_mask_ms": _pcts([r["first_mask_ms"] for r in ok])}


def _pcts(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}

    def q(p):
        return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": xs[-1], "n": len(xs)}


# ---------------------------------------------------------------------------------------------
# 2, 3. decode steps
# ---------------------------------------------------------------------------------------------
class Probe:
    """Wall time of the mask's parts, per step (seconds): fill (on the mask thread), wait (the
    sampler blocked on it after the forward pass), apply (setting the logits to -inf)."""

    def __init__(self, ex):
        import worker_svc.sampling.sampler as sampler_mod

        self.fill, self.wait, self.apply = [], [], []
        guides, mod = ex.sampler.guides, sampler_mod
        masks, take, apply = guides.masks, guides.take, mod.apply_token_bitmask

        def timed_masks(due):
            t0 = time.perf_counter()
            try:
                return masks(due)
            finally:
                self.fill.append(time.perf_counter() - t0)

        def timed_take(due):
            t0 = time.perf_counter()
            try:
                return take(due)
            finally:
                self.wait.append(time.perf_counter() - t0)

        def timed_apply(logits, mask):
            t0 = time.perf_counter()
            apply(logits, mask)
            self.apply.append(time.perf_counter() - t0)

        guides.masks, guides.take, mod.apply_token_bitmask = timed_masks, timed_take, timed_apply

    def reset(self):
        self.fill, self.wait, self.apply = [], [], []


class DecodeRun:
    """`batch` requests decoding from position SHORT_CONTEXT on their own blocks (KV of zeros:
    cost depends on lengths), greedy, each constrained to `grammar` (None: free). A request that
    ends (EOS) starts again under a new id, so every step is a full batch."""

    def __init__(self, ex, batch: int, grammar: str | None, eos: set[int], tag: str):
        from shared.sampling import SamplingParams

        self.ex, self.batch, self.eos, self.tag = ex, batch, eos, tag
        self.params = SamplingParams(temperature=0.0, max_tokens=4096, constraint=grammar)
        per = 1024 // BLOCK_SIZE
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
        self.prompt = [200 + (i % 50) for i in range(SHORT_CONTEXT)]
        self.state = [self._fresh(i, 0) for i in range(batch)]
        self.next_id = 0
        self.batch_id = 0
        self.completed = 0

    def _fresh(self, i: int, gen: int) -> dict:
        return {"id": f"{self.tag}-{i}-{gen}", "gen": gen, "out": [], "last": self.prompt[-1]}

    def step(self) -> float:
        from shared.messages import Batch, SeqChunk

        seqs = []
        for i, st in enumerate(self.state):
            pos = SHORT_CONTEXT - 1 + len(st["out"])
            first = not st["out"]
            seqs.append(SeqChunk(st["id"], [st["last"]], pos, self.tables[i], True, self.params, len(st["out"]),
                                 prior_token_ids=self.prompt[:-1] if first else None))
        self.batch_id += 1
        freed = getattr(self, "_freed", [])
        t0 = time.perf_counter()
        out = self.ex.execute(Batch(self.batch_id, seqs, freed))
        dt = time.perf_counter() - t0
        self._freed = []
        for i, st in enumerate(self.state):
            tok = out.sampled[st["id"]]
            if tok in self.eos or len(st["out"]) + SHORT_CONTEXT >= 1000:
                self._freed.append(st["id"])
                self.completed += tok in self.eos
                self.state[i] = self._fresh(i, st["gen"] + 1)
            else:
                st["out"].append(tok)
                st["last"] = tok
        return dt


def time_decode(batches: list[int], steps: int, rounds: int, warmup: int) -> tuple[list[dict], dict]:
    from shared.config import CacheConfig, WorkerConfig
    from shared.constraints import grammar_for
    from worker_svc.model_runner import ModelRunner

    ex = ModelRunner(WorkerConfig(cache=CacheConfig(BLOCK_SIZE, max(batches) * (1024 // BLOCK_SIZE))))
    t0 = time.perf_counter()
    ex.sampler.guides.tokenizer()            # the lazy grammar tokenizer, once, outside the timings
    tokenizer_s = time.perf_counter() - t0
    probe = Probe(ex)
    grammar = grammar_for("json_schema", NESTED, "response_format")
    eos = set(ex.model_info.eos_token_ids)
    rows = []
    for b in batches:
        runs = {"free": DecodeRun(ex, b, None, eos, f"f{b}"), "constrained": DecodeRun(ex, b, grammar, eos, f"c{b}")}
        times: dict[str, list[float]] = {k: [] for k in runs}
        parts: dict[str, list[float]] = {"fill": [], "wait": [], "apply": []}
        for r in runs.values():
            for _ in range(warmup):
                r.step()
        for _ in range(rounds):
            for kind, run in runs.items():       # alternate: the machine's load hits both alike
                probe.reset()
                times[kind] += [run.step() for _ in range(steps)]
                if kind == "constrained":
                    parts["fill"] += probe.fill
                    parts["wait"] += probe.wait
                    parts["apply"] += probe.apply
        free, con = statistics.median(times["free"]), statistics.median(times["constrained"])
        med = {k: statistics.median(v) if v else 0.0 for k, v in parts.items()}
        rows.append({"batch": b, "steps": len(times["free"]),
                     "step_ms_free": free * 1e3, "step_ms_constrained": con * 1e3,
                     "overhead_fraction": (con - free) / free,
                     "mask_fill_ms": med["fill"] * 1e3, "mask_wait_ms": med["wait"] * 1e3,
                     "mask_apply_ms": med["apply"] * 1e3,
                     "mask_on_critical_path_fraction": (med["wait"] + med["apply"]) / con,
                     "mask_fill_fraction_if_serial": (med["fill"] + med["apply"]) / con,
                     "tokens_per_s_free": b / free, "tokens_per_s_constrained": b / con,
                     "json_completed": runs["constrained"].completed})
        print(json.dumps(rows[-1]), flush=True)
    return rows, {"grammar_tokenizer_s": tokenizer_s, "backend": ex.backend.describe()}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = report["decode"]
    xs = range(len(rows))
    a.bar([x - 0.2 for x in xs], [r["step_ms_free"] for r in rows], 0.4, label="unconstrained")
    a.bar([x + 0.2 for x in xs], [r["step_ms_constrained"] for r in rows], 0.4, label="constrained (nested schema)")
    a.bar([x + 0.2 for x in xs], [r["mask_wait_ms"] + r["mask_apply_ms"] for r in rows], 0.4,
          label="of which mask wait + apply", color="black")
    a.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    a.set_ylabel("decode step, ms (median)")
    a.legend(fontsize=8)
    a.set_title("decode step, SmolLM2-135M CPU")
    ok = [r["compile_ms"] for r in report["compile"]["schemas"] if r["compile_ms"] is not None]
    b.hist(ok, bins=30)
    b.set_xscale("log") if ok and max(ok) / max(min(ok), 1e-6) > 100 else None
    c = report["compile"]["compile_ms"]
    b.set_title(f"schema compile: p50 {c['p50']:.2f} ms, p99 {c['p99']:.1f} ms ({c['n']} schemas)")
    b.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _lscpu() -> dict:
    """lscpu's model name, CPU family and model (the machine record asks for all three)."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    keep = {"Model name": "model_name", "CPU family": "family", "Model": "model"}
    return {keep[k.strip()]: v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)
            if k.strip() in keep}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=24, help="steps per block (each kind, each round)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="compiles per schema (median kept)")
    ap.add_argument("--out", default="bench/results/structured/structured.json")
    args = ap.parse_args(argv)
    from shared.constraints import ll_tokenizer
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    report = {"command": shlex.join(["python", "-m", "bench.structured"] + (sys.argv[1:] if argv is None else argv)),
              "date": utc_now(), "machine": machine(), "machine_line": machine_line(), "lscpu": _lscpu(),
              "loadavg_start": loadavg()}
    tok = load_tokenizer(resolve_model(None))
    report["compile"] = time_compiles(ll_tokenizer(tok), args.repeats)
    print(json.dumps({k: v for k, v in report["compile"].items() if k != "schemas"}), flush=True)
    report["decode"], report["engine"] = time_decode(args.batches, args.steps, args.rounds, args.warmup)
    report["loadavg_end"] = loadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
