"""A draft model's proposals batched across the decodes of a scheduler batch, against asking one
request at a time: the draft model's time a scheduler step and the decode rate, at 1 to 8
requests decoding together.

`--speculative draft` runs the draft model in the scheduler's process
(worker_svc/speculative/draft.py). Asked one request at a time, a batch of B decodes with k
drafts each costs B x k forward passes of one row; batched, k passes of up to B rows, which on a
CPU (a step reads the weights once for 1 or for 8 rows) cost little more than one. SmolLM2-135M
is its own draft here, the one model with its tokenizer at hand (the drafts are the target's own
greedy tokens: every one is accepted until the answers end, and a draft step costs as much as a
target step, so speculation itself cannot pay with this draft; a real draft model is several
times smaller): what is measured is the proposing, batched or not. k is fixed (every decode
drafts `--k`; the measured-cost rule is off) so both arms ask for the same drafts, and their
outputs must be identical to speculation off (checked).

Each size runs B short prompts together (greedy, `--max-tokens` tokens each: EOS ignored, so
every request decodes that long), the two arms in turn `--reps` times (ABBA), each arm keeping
its fastest repetition; at 1 request both arms run the same code (a control). The steps'
proposing includes each request's first proposal, the draft model's prefill of its prompt
(batched across the requests too).

    python -m bench.draft_batching OUT_PREFIX [--sizes 1,2,4,8] [--k 3] [--max-tokens 64] [--reps 4]
        [--threads 1]

writes OUT_PREFIX.json and OUT_PREFIX.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from sarathi import LLM
from sarathi.cli_config import enable_draft_model
from sarathi.measure.env import command_line, machine
from shared.model_source import resolve_model
from shared.sampling import SamplingParams

PROMPTS = [
    "Rewrite this sentence in the past tense: the library opens at nine and lends books to everyone.",
    "Summarize in one sentence: the town built a bridge over the river in 1911 and rebuilt it in 1954.",
    "List the numbers in this text: 4000 books, 90000 loans, 12 rooms and 3 floors.",
    "Correct the spelling: the libary opend in nineteen-eleven with four thousnd books.",
    "Give the plural of each word: book, shelf, child, mouse, leaf, city.",
    "Translate to French: the reading room has tall windows facing the water.",
    "Name the capital of each country: France, Italy, Spain, Portugal.",
    "Write the days of the week in order, starting on Monday.",
]


def run(args) -> dict:
    enable_draft_model()
    llm = LLM(threads=args.threads, num_blocks=1024, max_num_seqs=max(args.sizes))
    off = llm.scheduler_config
    on = dataclasses.replace(off, speculative="draft", draft_model=str(resolve_model(None).path),
                             num_speculative_tokens=args.k)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)   # every answer that long
    ids = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    llm.make_engine(off).generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=4))   # warm-up
    rows = []
    for b in args.sizes:
        batch = [ids[i % len(ids)] for i in range(b)]
        want = [o.output_token_ids for o in llm.make_engine(off).generate(batch, params)]
        row = {"requests": b}
        for rep in range(args.reps):
            for arm in ("batched", "one at a time")[::1 if rep % 2 == 0 else -1]:   # ABBA: either goes first
                got = measure(llm, on, batch, params, batched=arm == "batched", k=args.k)
                if got.pop("outputs") != want:
                    raise AssertionError(f"{b} requests, {arm}: output differs from speculation off")
                if arm not in row or got["decode_tok_per_s"] > row[arm]["decode_tok_per_s"]:
                    row[arm] = got
        row["draft_time_ratio"] = row["batched"]["draft_s"] / row["one at a time"]["draft_s"]
        row["decode_rate_ratio"] = row["batched"]["decode_tok_per_s"] / row["one at a time"]["decode_tok_per_s"]
        print(f"{b} requests: draft model {row['one at a time']['draft_ms_per_step']:.1f} -> "
              f"{row['batched']['draft_ms_per_step']:.1f} ms a step (x{row['draft_time_ratio']:.2f}), "
              f"decode {row['one at a time']['decode_tok_per_s']:.0f} -> {row['batched']['decode_tok_per_s']:.0f} "
              f"tok/s (x{row['decode_rate_ratio']:.2f})", flush=True)
        rows.append(row)
    return {"rows": rows}


def measure(llm, cfg, batch, params, *, batched: bool, k: int) -> dict:
    """One run of `batch` together: the seconds spent proposing (the draft model's passes), the
    scheduler steps that proposed, the draft model's passes and rows, decode tokens / s over the
    run, and the outputs."""
    engine = llm.make_engine(cfg)
    spec = engine.scheduler.speculator
    spec.cost, spec.observe_batch = 0.0, lambda *a: None   # k fixed: every decode drafts k
    spec.k_for = lambda req, num_decodes=1: min(k, max(0, req.sampling.max_tokens - req.num_output_tokens - 1))
    prop = spec.proposer
    if not batched:
        prop.propose_batch = None                          # Speculator.propose_many asks one at a time
    timing = {"s": 0.0, "steps": 0, "passes": 0, "rows": 0}
    propose_many, execute = spec.propose_many, prop.runner.execute

    def timed(asks):                                       # one scheduler step's proposing
        t0 = time.perf_counter()
        try:
            return propose_many(asks)
        finally:
            timing["s"] += time.perf_counter() - t0
            timing["steps"] += any(k > 0 for _, k in asks)

    def counted(b):
        timing["passes"] += 1
        timing["rows"] += len(b.seqs)
        return execute(b)
    engine.generate(batch, dataclasses.replace(params, max_tokens=k + 2))   # warm: the draft model's first passes
    timing.update(s=0.0, steps=0, passes=0, rows=0)
    spec.proposed = spec.accepted = 0
    spec.propose_many, prop.runner.execute = timed, counted
    t0 = time.perf_counter()
    outs = engine.generate(batch, params)
    wall = time.perf_counter() - t0
    decode = sum(len(o.token_times) - 1 for o in outs)
    span = max(o.token_times[-1] for o in outs) - min(o.token_times[0] for o in outs)
    return {"draft_s": timing["s"], "draft_steps": timing["steps"], "draft_passes": timing["passes"],
            "draft_rows": timing["rows"], "draft_ms_per_step": 1e3 * timing["s"] / max(1, timing["steps"]),
            "decode_tokens": decode, "decode_tok_per_s": decode / span if span > 0 else 0.0, "wall_s": wall,
            "accepted": engine.stats()["spec_accepted_tokens"], "proposed": engine.stats()["spec_proposed_tokens"],
            "outputs": [o.output_token_ids for o in outs]}


def plot(res: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    sizes = [r["requests"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for arm, color in (("one at a time", "tab:gray"), ("batched", "tab:green")):
        axes[0].plot(sizes, [r[arm]["draft_ms_per_step"] for r in rows], "o-", color=color, label=arm)
        axes[1].plot(sizes, [r[arm]["decode_tok_per_s"] for r in rows], "o-", color=color, label=arm)
    axes[0].set_ylabel("draft model, ms per scheduler step")
    axes[1].set_ylabel("decode tokens/s, all requests")
    for ax in axes:
        ax.set_xlabel("requests decoding together")
        ax.set_xticks(sizes)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--sizes", default="1,2,4,8", help="comma-separated numbers of requests decoding together")
    p.add_argument("--k", type=int, default=3, help="drafts every decode asks for")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=4, help="runs per size and arm (ABBA), fastest kept")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",") if x]
    if not args.sizes or min(args.sizes) < 1 or max(args.sizes) > len(PROMPTS):
        p.error(f"--sizes: 1 to {len(PROMPTS)} requests")
    started = machine()
    res = run(args)
    doc = {"command": command_line(prog="python -m bench.draft_batching"), "machine": started,
           "loadavg_after": machine()["loadavg"], "model": "SmolLM2-135M-Instruct (default GGUF), its own draft",
           "threads": args.threads, "k": args.k, "max_tokens": args.max_tokens, "reps": args.reps, **res}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    plot(res, out.with_suffix(".png"), f"draft model proposals, k = {args.k}, {args.threads} thread(s)\n"
                                       f"{started['cpu']}")


if __name__ == "__main__":
    main()
