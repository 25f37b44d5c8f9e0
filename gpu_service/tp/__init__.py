"""Tensor parallelism: one model over several ranks (`met gpu-service serve --tp N`).

The torch-free facts the flags need live here: `gpu_service/rpc/options.py` parses them without
importing torch."""

# How a row-parallel output is summed over ranks (gpu_service/tp/group.py says what each does).
REDUCES = ("ordered", "nccl")
DEFAULT_REDUCE = "ordered"
# How long a collective waits for a rank before the service ends (`--tp-timeout`).
DEFAULT_TIMEOUT_S = 60.0
