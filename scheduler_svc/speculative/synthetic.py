"""The simulator's proposer: it always proposes the k drafts asked for (copies of the last
token), and the simulated worker accepts each with a given probability
(scheduler_svc.sim_executor.SimExecutor's spec_acceptance). The simulated tokens are hashes
that no real proposer could guess, so acceptance is a parameter of the simulation, not a
property of the text."""
from __future__ import annotations

from scheduler_svc.request import Request


class SyntheticProposer:
    name = "synthetic"

    def propose(self, req: Request, k: int) -> list[int]:
        return [req.token_ids[-1]] * k
