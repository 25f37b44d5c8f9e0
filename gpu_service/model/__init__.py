"""The model: its config and the service's settings, its weights and how they load and shard
over ranks, the batched forward over every sequence's rows (eager and Triton ops), and the
device state that forward reads and writes (`state.py`: plain storage, filled as the engine
says).

May import `gpu_service.tp` (the rank group a row-parallel output is summed over), the
kernels and torch."""
