"""Speculative decoding on the CPU, batch 1: decode tokens/s with and without n-gram drafts on
the default model, on an input-grounded workload (rewrite, summarize, extract, edit code from a
passage in the prompt), on plain chat, and on structured outputs (JSON schemas filled from a
passage or code in the prompt: every verified position is masked by the grammar).

Each prompt runs alone (batch-1 decode), greedy, without drafts then with, `--reps` times in
turn, so the two arms see the same machine state; each arm keeps its fastest repetition (other
load only ever slows a run down). The outputs must be identical (greedy speculation is exact),
which the script checks and records. Decode tokens/s of a request = (output tokens - 1) / (time
of its last token - time of its first), so prefill is left out; a workload's figure is the sum
of tokens over the sum of times of its prompts. Each run starts a fresh scheduler, so the cost
of a draft is measured anew (scheduler_svc/speculative/base.py).

    python -m bench.speculation_cpu OUT_PREFIX [--threads 1] [--max-tokens 80] [--k 6] [--reps 2] [--quick]
        [--proposer ngram|suffix]
        [--workloads grounded,chat,structured]

writes OUT_PREFIX.json and OUT_PREFIX.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from sarathi import LLM
from sarathi.measure.env import command_line, machine
from shared.constraints import grammar_for
from shared.sampling import SamplingParams

PASSAGE = (
    "The Harbor Street library opened in 1911 with four thousand books donated by the shipping "
    "families of the town. In 1954 a fire destroyed the east wing, and the reading room was rebuilt "
    "with tall windows facing the water. Today the library lends about ninety thousand items a year, "
    "runs a free coding club for teenagers every Thursday, and keeps the original 1911 ledger of "
    "borrowers in a glass case near the entrance. The head librarian, Maria Okafor, says the most "
    "borrowed book last year was a guide to repairing small boats.")
CODE = ("def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n\n\ndef describe(values):\n    avg = average(values)\n"
        "    print('count:', len(values))\n    print('average:', avg)\n    return avg\n")

GROUNDED = [
    "Rewrite the following passage in the past tense, keeping every fact:\n\n" + PASSAGE,
    "Summarize this passage in three sentences, reusing its wording:\n\n" + PASSAGE,
    "Extract every year, number and name from this passage, as a list with the sentence each "
    "comes from:\n\n" + PASSAGE,
    "Copy this passage and correct any spelling mistakes:\n\n" + PASSAGE,
    "Add a docstring to each function and return the full code:\n\n" + CODE,
    "Rename the variable `total` to `acc` in this code and return the whole code:\n\n" + CODE,
]
CHAT = [
    "Write a short poem about autumn.",
    "What are three tips for sleeping better?",
    "Explain what a black hole is to a ten-year-old.",
    "Give me an idea for a birthday party for a seven-year-old.",
    "Why is the sky blue?",
    "Suggest a name for a bakery and explain it.",
]

_STR = {"type": "string"}
# (prompt, JSON schema): the answer's values are mostly copied from the prompt
STRUCTURED = [
    ("Return the facts of this passage as JSON.\n\n" + PASSAGE,
     {"type": "object", "additionalProperties": False,
      "required": ["library", "opened", "books_donated", "fire_year", "librarian", "most_borrowed"],
      "properties": {"library": _STR, "opened": {"type": "integer"}, "books_donated": _STR,
                     "fire_year": {"type": "integer"}, "librarian": _STR, "most_borrowed": _STR}}),
    ("Split this passage into its sentences, as a JSON list of strings, word for word.\n\n" + PASSAGE,
     {"type": "array", "items": _STR}),
    ("Describe each function of this code as JSON: its name, its arguments and its body, "
     "copied exactly.\n\n" + CODE,
     {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                 "required": ["name", "arguments", "body"],
                                 "properties": {"name": _STR, "arguments": {"type": "array", "items": _STR},
                                                "body": _STR}}}),
    ("List every event in this passage as JSON objects with the year and what happened, in the "
     "passage's words.\n\n" + PASSAGE,
     {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["year", "event"],
                                 "properties": {"year": {"type": "integer"}, "event": _STR}}}),
]
WORKLOADS = ("grounded", "chat", "structured")


def decode_rate(out) -> tuple[int, float]:
    """(decode tokens, seconds) of one request: the tokens after its first, over their span."""
    t = out.token_times
    return len(t) - 1, (t[-1] - t[0]) if len(t) > 1 else 0.0


def run(args) -> dict:
    llm = LLM(threads=args.threads, num_blocks=512, max_num_seqs=4)
    off_cfg = llm.scheduler_config
    on_cfg = dataclasses.replace(off_cfg, speculative=args.proposer, num_speculative_tokens=args.k)
    arm_on = args.proposer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    every = {"grounded": [(t, None) for t in GROUNDED], "chat": [(t, None) for t in CHAT],
             "structured": STRUCTURED}
    workloads = {k: every[k] for k in args.workloads}
    if args.quick:
        workloads = {k: v[:2] for k, v in workloads.items()}
    warm = llm.tokenizer.encode_chat([{"role": "user", "content": CHAT[0]}])
    llm.make_engine(off_cfg).generate([warm], SamplingParams(temperature=0.0, max_tokens=8))
    result = {}
    for name, prompts in workloads.items():
        rows = []
        for text, schema in prompts:
            ids = llm.tokenizer.encode_chat([{"role": "user", "content": text}])
            row = {"prompt": text[:60], "prompt_tokens": len(ids)}
            request = params if schema is None else dataclasses.replace(
                params, constraint=grammar_for("json_schema", schema, "response_format"))
            outs = {}
            for _ in range(args.reps):
                for arm, cfg in (("off", off_cfg), (arm_on, on_cfg)):
                    engine = llm.make_engine(cfg)
                    t0 = time.perf_counter()
                    out = engine.generate([ids], request)[0]
                    n, secs = decode_rate(out)
                    outs.setdefault(arm, out.output_token_ids)
                    if outs[arm] != out.output_token_ids:
                        raise AssertionError(f"greedy output changed between repetitions ({arm})")
                    got = {"output_tokens": len(out.output_token_ids), "decode_tokens": n,
                           "decode_s": secs, "tok_per_s": n / secs if secs else 0.0,
                           "wall_s": time.perf_counter() - t0}
                    if arm == arm_on:
                        st = engine.stats()
                        got.update({k: st[k] for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                                       "spec_acceptance_rate", "spec_tokens_per_step",
                                                       "spec_draft_cost")})
                    row.setdefault(arm + "_runs", []).append(got)
                    if arm not in row or got["tok_per_s"] > row[arm]["tok_per_s"]:
                        row[arm] = got
            row["identical"] = outs["off"] == outs[arm_on]
            row["speedup"] = row[arm_on]["tok_per_s"] / row["off"]["tok_per_s"] if row["off"]["tok_per_s"] else 0.0
            print(f"{name:8s} {row['off']['tok_per_s']:7.1f} -> {row[arm_on]['tok_per_s']:7.1f} tok/s "
                  f"({row['speedup']:.2f}x, identical={row['identical']}) {row['prompt']!r}", flush=True)
            rows.append(row)
        agg = {}
        for arm in ("off", arm_on):
            n = sum(r[arm]["decode_tokens"] for r in rows)
            s = sum(r[arm]["decode_s"] for r in rows)
            agg[arm] = {"decode_tokens": n, "decode_s": s, "tok_per_s": n / s if s else 0.0}
        prop = sum(r[arm_on]["spec_proposed_tokens"] for r in rows)
        acc = sum(r[arm_on]["spec_accepted_tokens"] for r in rows)
        result[name] = {"prompts": rows, "total": agg,
                        "speedup": agg[arm_on]["tok_per_s"] / agg["off"]["tok_per_s"],
                        "acceptance_rate": acc / prop if prop else 0.0,
                        "all_identical": all(r["identical"] for r in rows)}
    return result


def plot(result: dict, path: Path, title: str, proposer: str = "ngram") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    w = 0.38
    for i, (arm, label) in enumerate((("off", "speculation off"), (proposer, f"{proposer} drafts"))):
        vals = [result[n]["total"][arm]["tok_per_s"] for n in names]
        bars = ax.bar([x + (i - 0.5) * w for x in range(len(names))], vals, w, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(names)),
                  [f"{n}\n({result[n]['speedup']:.2f}x, acceptance {result[n]['acceptance_rate']:.2f})"
                   for n in names])
    ax.set_ylabel("batch-1 decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=80)
    p.add_argument("--reps", type=int, default=2, help="runs per prompt and arm, fastest kept")
    p.add_argument("--k", type=int, default=6, help="--num-speculative-tokens")
    p.add_argument("--quick", action="store_true", help="two prompts per workload")
    p.add_argument("--proposer", default="ngram", choices=["ngram", "suffix"],
                   help="the drafts arm's --speculative (its key in the JSON)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    args = p.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown or not args.workloads:
        p.error(f"--workloads: choose from {', '.join(WORKLOADS)} (got {args.workloads})")
    started = machine()
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": command_line(prog="python -m bench.speculation_cpu"), "machine": started,
           "loadavg_after": machine()["loadavg"], "model": "SmolLM2-135M-Instruct (default GGUF)",
           "threads": args.threads, "proposer": args.proposer, "max_tokens": args.max_tokens,
           "num_speculative_tokens": args.k, "reps": args.reps,
           "results": result}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    plot(result, out.with_suffix(".png"),
         f"SmolLM2-135M, batch 1, {args.threads} threads, greedy, k <= {args.k}\n{started['cpu']}", args.proposer)
    for name, r in result.items():
        print(f"{name}: {r['total']['off']['tok_per_s']:.1f} -> {r['total'][args.proposer]['tok_per_s']:.1f} tok/s "
              f"= {r['speedup']:.2f}x, acceptance {r['acceptance_rate']:.2f}, identical {r['all_identical']}")


if __name__ == "__main__":
    main()
