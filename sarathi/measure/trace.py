"""Request-length traces: (prompt tokens, output tokens) per request.

The default is the ShareGPT-4 length trace of the paper's evaluation, shipped as package data
(sarathi/measure/data/sharegpt_8k_filtered_stats_llama2_tokenizer.csv: 30,731 rows, Llama-2
tokenizer, prompt median 1730, output median 415, prompt + output <= 8192). A CPU serves a 135M
model orders of magnitude slower than an A100 serves Mistral-7B, so runs here scale both lengths
by a stated factor (`length_scale`): every length is rounded and kept >= 1 token.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
DEFAULT_TRACE = DATA / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
PROMPT_COLUMN = "num_prefill_tokens"
OUTPUT_COLUMN = "num_decode_tokens"


@dataclass(frozen=True)
class Trace:
    """Lengths in tokens, one (prompt, output) pair per row; `source` says where from and how
    it was scaled."""

    prompt_lens: list[int]
    output_lens: list[int]
    source: str

    def __len__(self) -> int:
        return len(self.prompt_lens)


def load_trace(path: str | Path | None = None, *, prompt_column: str = PROMPT_COLUMN,
               output_column: str = OUTPUT_COLUMN, length_scale: float = 1.0,
               max_total_len: int | None = None) -> Trace:
    """Read a CSV trace. length_scale multiplies both lengths (rounded, >= 1); rows whose
    scaled prompt + output exceed max_total_len (tokens) are dropped. Raises ValueError /
    FileNotFoundError with one clear line on a missing file, a missing column or a bad row."""
    p = DEFAULT_TRACE if path is None else Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file not found: {p}")
    if not length_scale > 0:
        raise ValueError(f"--length-scale must be > 0, got {length_scale}")
    with p.open(newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        for c in (prompt_column, output_column):
            if c not in cols:
                raise ValueError(f"trace {p.name} has no column {c!r} (columns: {', '.join(cols)})")
        prompts, outputs = [], []
        for i, row in enumerate(reader, start=2):
            try:
                pl, ol = int(float(row[prompt_column])), int(float(row[output_column]))
            except (TypeError, ValueError):
                raise ValueError(f"trace {p.name} line {i}: lengths must be numbers, got "
                                 f"{row[prompt_column]!r}, {row[output_column]!r}") from None
            pl, ol = max(1, round(pl * length_scale)), max(1, round(ol * length_scale))
            if max_total_len is not None and pl + ol > max_total_len:
                continue
            prompts.append(pl)
            outputs.append(ol)
    if not prompts:
        raise ValueError(f"trace {p.name} has no usable rows (after scaling and the "
                         f"{max_total_len}-token limit)")
    return Trace(prompts, outputs, f"{p.name} x{length_scale:g}")
