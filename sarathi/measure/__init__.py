"""Measurement as a product feature: what `sarathi profile | plan | capacity | bench` run.

The load generator (loadgen), the metrics and the SLO test (metrics), the iteration-time
profile and the cost model fitted to it (profile, costmodel), the token-budget planner (plan),
the capacity search (capacity), request-length traces and the ShareGPT-4 trace shipped as
package data (trace, data/), the figures (plots) and the record of where and when a result was
measured (env). The benchmark scripts in the repository's bench/ folder use this package; it
never imports them.
"""
