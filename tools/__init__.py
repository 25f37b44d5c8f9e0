"""Tooling beside the serving packages, never imported by them: `bench` (`met bench` and the
benchmarks that run alone), `batch_invariance` (what batch invariance by construction costs),
`moe_bench` (what routing buys the MoE layers) and `kernel_report` with `compiling` (every
kernel compiled for a GPU on a CPU)."""
