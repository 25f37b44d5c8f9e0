"""The collectives of one tensor-parallel group: process groups built directly on a TCP store
(no process-global default group, so a test process can hold several), a compute group (NCCL on
CUDA, gloo on the CPU) and a gloo group for the operations rank 0 sends.

A row-parallel output is summed in rank order (`ordered`, the default): every rank's partial is
gathered and added p0 + p1 + ... on every rank, so a row's bytes depend on neither the batch nor
the message size. `nccl` hands the sum to the backend's all-reduce (NCCL's ring, or gloo's on the
CPU), which may pick its algorithm and chunking by size; the circuit diff would catch a row
changing with its batch."""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from gpu_service.tp import DEFAULT_REDUCE, DEFAULT_TIMEOUT_S, REDUCES

# How long the ranks may take to meet, and to load their shards: a rank that dies meanwhile is
# caught by its process ending (gpu_service/engine/ranks.py), so this only bounds a stuck start.
START_TIMEOUT = datetime.timedelta(minutes=30)
# What another rank waits for rank 0's next operation: the service may idle for days; rank 0's
# process ending ends it sooner.
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's TCP store."""

    host: str
    port: int
    size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


def _compute_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta
) -> Any:
    """A backend object used through its own calls (`allgather`, `allreduce`, `broadcast`),
    which torch's stubs do not type."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
    return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)


class TpGroup:
    def __init__(
        self,
        rank: int,
        meet: Rendezvous,
        device: torch.device,
        reduce: str = DEFAULT_REDUCE,
        store: dist.Store | None = None,
        expert_parallel: bool = False,
    ) -> None:
        """`expert_parallel`: the ranks place the routed experts rather than split them
        (`--expert-parallel`; `gpu_service/model/shard.py` says what each then holds)."""
        if reduce not in REDUCES:
            raise ValueError(f"--tp-reduce {reduce!r}: expected one of {', '.join(REDUCES)}")
        # Every collective once started waits this long for the other ranks (`--tp-timeout`).
        self.timeout = datetime.timedelta(seconds=meet.timeout_s)
        if store is None:
            store = dist.TCPStore(meet.host, meet.port, meet.size, False, timeout=START_TIMEOUT)
        self.rank, self.size, self.reduce_mode, self.device = rank, meet.size, reduce, device
        self.expert_parallel = expert_parallel
        self.store = store
        self.compute = _compute_group(store, rank, meet.size, device, START_TIMEOUT)
        self.control: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), rank, meet.size, START_TIMEOUT
        )

    @staticmethod
    def host_store(size: int) -> dist.TCPStore:
        """Rank 0's store on a free loopback port (its `.port`)."""
        return dist.TCPStore(
            "127.0.0.1", 0, size, True, timeout=START_TIMEOUT, wait_for_workers=False
        )

    def _gather_options(self, timeout: datetime.timedelta | None = None) -> Any:
        options = c10d.AllgatherOptions()
        options.timeout = timeout or self.timeout
        return options

    def _broadcast(self, t: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        self.control.broadcast(t, 0, timeout or self.timeout).wait()

    # -- the forward's collectives ----------------------------------------------------------

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape on each), in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.compute.allgather([parts], [x], self._gather_options()).wait()
        return parts

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x`, the same bytes on every rank."""
        if self.reduce_mode == "nccl":
            out = x.contiguous().clone()
            options = c10d.AllreduceOptions()
            options.timeout = self.timeout
            self.compute.allreduce([out], options).wait()
            return out
        parts = self.gather(x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total

    def exchange(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """An all-to-all of rows: x [sum(send), ...] holds `send[r]` rows for rank r, rank 0's
        first -> [sum(receive), ...], the `receive[r]` rows rank r sent here, in rank order.
        Every rank must know both counts (`receive[r]` is rank r's `send[rank]`). NCCL's
        all-to-all on CUDA; on the CPU gloo's, which torch's ProcessGroupGloo implements
        (`alltoall_base`, with uneven splits, in the torch this project pins)."""
        out = x.new_empty(sum(receive), *x.shape[1:])
        options = c10d.AllToAllOptions()
        options.timeout = self.timeout
        self.compute.alltoall_base(out, x.contiguous(), receive, send, options).wait()
        return out

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """x: [R, widths[rank]] -> [R, sum(widths)], rank 0's columns first (vocab-parallel
        logits: shards of unequal width are padded to the widest for the gather)."""
        widest = max(widths)
        padded = torch.nn.functional.pad(x, (0, widest - x.shape[1]))
        parts = self.gather(padded)
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    # -- rank 0's operations -------------------------------------------------------------

    def send(self, message: object) -> None:
        """Rank 0: one operation to every other rank (pickled; a length, then the bytes)."""
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()]))
        self._broadcast(data)

    def receive(self) -> object:
        """Another rank: the next operation rank 0 sent (waiting as long as rank 0 idles)."""
        length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length, IDLE_TIMEOUT)
        data = torch.empty(int(length), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    def gather_objects(
        self, value: object, timeout: datetime.timedelta | None = None
    ) -> list[object]:
        """Every rank's `value`, in rank order, on every rank (over the control group); the
        ranks may arrive `timeout` apart (default `--tp-timeout`)."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        options = self._gather_options(timeout)
        self.control.allgather([lengths], [torch.tensor([data.numel()])], options).wait()
        widest = int(max(lengths))
        parts = [torch.empty(widest, dtype=torch.uint8) for _ in range(self.size)]
        padded = torch.nn.functional.pad(data, (0, widest - data.numel()))
        self.control.allgather([parts], [padded], self._gather_options()).wait()
        return [
            pickle.loads(p[: int(n)].numpy().tobytes()) for p, n in zip(parts, lengths, strict=True)
        ]
