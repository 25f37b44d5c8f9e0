"""Benchmarks that print numbers.

`met bench` is `run`, its sections in `methods`, `split`, `tracing` and `baseline`, its
table, markdown and chart in `report`; `workload` serves requests through a scheduler for
all of them. `split`, `tracing` and `levers` also run alone with `python -m`.
"""
