"""Prompt lookup (n-gram) proposer: the drafts are the tokens that followed the most recent
earlier occurrence of the request's last n tokens in its own tokens (prompt and output), for the
longest n in [min_n, max_n] that occurs. No model: strong wherever the output copies from the
input (summaries, edits, extraction, code, answers grounded in a passage), useless elsewhere,
where it proposes nothing and so costs nothing.

Per request it keeps an index n-gram -> the position after its latest occurrence, extended
incrementally as tokens are appended (tokens are never taken back: a preempted request keeps
them), so a proposal costs O(new tokens + max_n), not a scan of the whole sequence.
"""
from __future__ import annotations

from scheduler_svc.request import Request


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def _index(self, req: Request) -> dict:
        """The request's index, brought up to date with all but its last token (an n-gram is
        indexed once a token follows it)."""
        st = req.spec_state.get(self.name)
        if st is None:
            st = req.spec_state[self.name] = {"upto": 0, "next": {}}
        toks, nxt = req.token_ids, st["next"]
        end = len(toks) - 1         # positions whose following token exists
        for j in range(st["upto"], end):
            for n in range(self.min_n, self.max_n + 1):
                if j + 1 >= n:
                    nxt[tuple(toks[j + 1 - n:j + 1])] = j + 1
        st["upto"] = max(st["upto"], end)
        return nxt

    def propose(self, req: Request, k: int) -> list[int]:
        nxt = self._index(req)
        toks = req.token_ids
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            pos = nxt.get(tuple(toks[len(toks) - n:]))
            if pos is not None:
                return toks[pos:pos + k]
        return []
