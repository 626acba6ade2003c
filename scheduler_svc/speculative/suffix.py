"""Suffix proposer: the longest suffix match over the request's own tokens *and* the outputs of
recently finished requests. Like prompt lookup (ngram.py), but it matches longer suffixes (up to
max_n tokens, so a longer shared context picks the continuation) and it also finds
continuations other requests produced: repeated answers, templated outputs, agents that call the
same tool the same way. The longest match wins; on a tie the request's own tokens do.

The shared corpus is an index n-gram -> the (up to max_k) tokens that followed it in a finished
request's output, newest first, bounded to `max_entries` n-grams (the oldest are dropped).
"""
from __future__ import annotations

from collections import OrderedDict

from scheduler_svc.request import Request
from scheduler_svc.speculative.ngram import NgramProposer


class SuffixProposer(NgramProposer):
    name = "suffix"

    def __init__(self, min_n: int = 2, max_n: int = 8, max_k: int = 16, max_entries: int = 200_000):
        super().__init__(min_n, max_n)
        self.max_k, self.max_entries = max_k, max_entries
        self.corpus: OrderedDict[tuple, list[int]] = OrderedDict()

    def propose(self, req: Request, k: int) -> list[int]:
        nxt = self._index(req)
        toks = req.token_ids
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            key = tuple(toks[len(toks) - n:])
            pos = nxt.get(key)
            if pos is not None:
                return toks[pos:pos + k]
            seen = self.corpus.get(key)
            if seen is not None:
                return seen[:k]
        return []

    def finish(self, req: Request) -> None:
        """Add a finished request's output to the shared corpus."""
        out = req.output_token_ids
        for j in range(len(out) - 1):
            follow = out[j + 1:j + 1 + self.max_k]
            for n in range(self.min_n, self.max_n + 1):
                if j + 1 >= n:
                    key = tuple(out[j + 1 - n:j + 1])
                    self.corpus[key] = follow
                    self.corpus.move_to_end(key)
        while len(self.corpus) > self.max_entries:
            self.corpus.popitem(last=False)
