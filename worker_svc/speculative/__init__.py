"""Proposers of draft tokens that need torch (a draft model). Built by the process that serves
(the sarathi command registers them with scheduler_svc.speculative.register_proposer), so the
scheduler's package stays torch-free; they read a request's token ids like any proposer."""
