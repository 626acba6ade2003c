"""What each `sarathi` subcommand does, given its parsed arguments (see sarathi.cli)."""
from __future__ import annotations

import argparse
import sys

from shared.sampling import SamplingParams


def _llm_kwargs(a: argparse.Namespace) -> dict:
    return dict(dtype=a.dtype, threads=a.threads, num_blocks=a.num_blocks, block_size=a.block_size,
                policy=a.policy, token_budget=a.token_budget, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=a.prefix_caching)


def generate(a: argparse.Namespace) -> int:
    from sarathi.llm import LLM

    llm = LLM(a.model, **_llm_kwargs(a))
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            max_tokens=a.max_tokens, seed=a.seed)
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in a.prompt], params)
    else:
        outs = llm.generate(list(a.prompt), params)
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"--- [{i}] finish_reason={out.finish_reason}")
        print(out.text)
        if out.output.error:
            print(f"error: {out.output.error}", file=sys.stderr)
    return 0
