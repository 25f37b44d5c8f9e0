"""Tensor parallelism's rank group: the collectives one model's ranks meet in (`group.py`),
and the torch-free facts the flags need (here: `gpu_service/rpc/options.py` parses them without
importing torch). Which part of each tensor a rank holds is the model's (`model/shard.py`); the
engine over several rank processes is the engine's (`engine/ranks.py`).

The lowest floor of the service: imports nothing of `gpu_service` but itself."""

# How a row-parallel output is summed over ranks (gpu_service/tp/group.py says what each does).
REDUCES = ("ordered", "nccl")
DEFAULT_REDUCE = "ordered"
# How long a collective waits for a rank before the service ends (`--tp-timeout`).
DEFAULT_TIMEOUT_S = 60.0
# The tensor-parallel sizes tried where a size is refused, as the devices of one machine come:
# the plan tries those above its own, and a refused FP8 split names those that would work.
SIZES = (1, 2, 4, 8, 16)
