"""The device check behind scripts/gpu_check.sh: the serving pair started on the device
(greedy `none` and `mtp` generations, the circuit diff against it), the same over two ranks
(tensor parallelism, where there are two GPUs), the kernel tests, and one greedy step profiled
in process; one JSON report with a section per check and an overall `ok`. `--cpu` runs the same
checks, smaller, on the CPU."""
