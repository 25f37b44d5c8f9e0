"""The control plane: the process that drives the GPU service. Its folders, by concern:
`fronts` (the gRPC generation API and the OpenAI-compatible HTTP front), `text` (tokenizer,
detokenizer, chat templates, grammars), `admission` (the door every request passes, and API
keys), `scheduler` (continuous batching and `step_mtp`, its options, metrics and environment),
`replicas` (the GPU services it dials, and the router over several), `circuit` (the
verify-batch circuit diff), `benchmarks` (`met bench`), and `cli` (the `met` command, the
processes it starts, and the control plane's server)."""
