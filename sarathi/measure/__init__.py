"""Measurement as a product feature: what `sarathi profile | plan | capacity | bench | simulate` run.

The subcommands themselves (commands, dispatched by sarathi.cli), the load generator (loadgen),
the metrics and the SLO test (metrics), the iteration-time profile and the cost model fitted to
it (profile, costmodel), the token-budget planner (plan), the capacity search (capacity), the
simulated GPU worker and its cost model (simulate, gpu_costmodel; the scheduler-side pieces it
drives, SimExecutor and SimClock, are scheduler_svc.sim_executor), request-length traces and
the ShareGPT-4 trace shipped as package data (trace, data/), the figures (plots) and the record
of where and when a result was measured (env). The benchmark scripts in the repository's bench/
folder use this package; it never imports them.
"""
