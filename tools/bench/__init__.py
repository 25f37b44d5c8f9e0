"""Benchmarks that print numbers.

`met bench` is `run`, its sections in `methods`, `split`, `tracing`, `baseline` and (with
`--replicas`) `replicas`, its table, markdown and chart in `report`; `workload` serves
requests through a scheduler, or a router over several, for all of them. `split`,
`tracing`, `replicas` and `levers` also run alone with `python -m`.
"""
