"""The scheduler: the loop (admit, prefill, step, stream, retire) and `step_mtp`, one module
per concern, each driven in tests by a fake `Model`."""
