"""Teacher-forced agreement with Hugging Face (transformers' own GGUF loader) of each
--weight-quant choice on the default SmolLM2 GGUF: a chat prompt and HF's 32-token greedy
continuation, fp32 KV, per choice the top-1 agreement over the 33 positions and the max logit
error as a fraction of the logit range. Not a timing: the README's --weight-quant table.

    python -m bench.weight_quant_agreement [--choices auto,none,int8,int8-bf16] [--dots int8x2,int8,fp32]
                                           [--out bench/results/kernels/weight_quant_agreement.json]

--dots: the GGUF block kernels' small-batch arithmetic (SARATHI_GGUF_DOT, worker_svc/backends/cpu/gguf.py)
under which each choice that runs them (auto, int8) is measured; the first is the default, recorded
under the choice's bare name, the others as "choice/dot".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

from bench.common import (
    Layout,
    agreement,
    hf_greedy_reference,
    hf_model_from_gguf,
    machine_line,
    make_executor,
    teacher_forced_logits,
)

# the chat prompt the tests' SmolLM2 agreement check uses (tests/support/engine_helpers.PROMPT)
PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--choices", default="auto,none,int8,int8-bf16")
    ap.add_argument("--dots", default="int8x2,int8,fp32")
    ap.add_argument("--out", default="bench/results/kernels/weight_quant_agreement.json")
    args = ap.parse_args(argv)
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    torch.set_num_threads(2)
    source = resolve_model(None)
    tok = load_tokenizer(source)
    prompt = tok.encode(tok.apply_chat_template(PROMPT), add_special_tokens=False)
    seq, ref = hf_greedy_reference(hf_model_from_gguf(str(source.path)), prompt, 32)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res = {"machine": machine_line(), "date": now,
           "command": "python -m bench.weight_quant_agreement " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": source.path.name, "positions": len(seq) - len(prompt) + 1, "kv": "float32", "choices": {}}
    dots = args.dots.split(",")
    runs = [(c, d) for c in args.choices.split(",") for d in (dots if c in ("auto", "int8") else dots[:1])]
    for choice, dot in runs:
        os.environ["SARATHI_GGUF_DOT"] = dot
        ex = make_executor(f"float32:float32:{choice}", Layout(decodes=0, chunk=64 * 16))   # 64 KV blocks
        got = teacher_forced_logits(ex, seq, prefix=len(prompt))
        top1, err = agreement(got, ref[:len(got)])
        key = choice if dot == dots[0] else f"{choice}/{dot}"
        res["choices"][key] = {"backend": ex.model_info.backend, "top1_agreement": round(top1, 4),
                               "max_logit_error_of_range": round(err, 5)}
        print(key, res["choices"][key], flush=True)
        del ex
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
