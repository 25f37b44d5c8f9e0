"""A tensor-parallel engine: rank 0 in the service's process, the other ranks in processes it
spawns, one per device. Rank 0 owns the gRPC server, the sessions and the slot table; before
each operation that reads or writes device state it sends the operation and its arguments to the
other ranks, which run the same call on their shards, so every collective inside the forward
meets its peers in the same order. Reads of results (capabilities, logits, draws) stay on rank 0:
its logits are gathered whole and its slot table is every rank's.

Faults end the service, never hang it: rank 0 watches every other rank's process and exits
non-zero the moment one ends; each other rank exits when rank 0's process ends; a collective
that waits past `--tp-timeout` for a rank that hangs raises, which ends the service the same way.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from gpu_service.tp import DEFAULT_REDUCE, DEFAULT_TIMEOUT_S
from gpu_service.tp.group import START_TIMEOUT, Rendezvous, TpGroup
from kernels import configure_interpreter
from protos.model import ModelError
from protos.operations import mirrored

# Engine calls every rank runs, in rank 0's order (`protos.operations` marks the contract's);
# the rest read rank 0's results or, as `measure_costs` does, run these calls, each sent on its
# own (a measured time never steers what another rank runs).
MIRRORED = mirrored()
_STOP = "stop"


@dataclass(frozen=True)
class Launch:
    """What every rank is started with."""

    model_dir: Path
    svc: ServiceConfig
    dtype: str | None
    device: str  # "cpu", or "cuda" (rank r takes cuda:r)
    size: int
    reduce: str = DEFAULT_REDUCE
    timeout_s: float = DEFAULT_TIMEOUT_S
    threads: int = 1
    # A DFlash drafter's directory: every rank loads the whole drafter (it is small) and runs
    # its block forwards on its own copy, so that no collective waits on it.
    drafter: Path | None = None
    # `--expert-parallel`: the routed experts placed on the ranks, not split over them.
    expert_parallel: bool = False

    def device_of(self, rank: int) -> torch.device:
        return torch.device(f"cuda:{rank}" if self.device.startswith("cuda") else self.device)


def _failed_collective(e: BaseException) -> bool:
    """Whether `e` came from a collective whose peer died or hung (not from the operation)."""
    text = str(e)
    return isinstance(e, dist.DistError) or (
        type(e) is RuntimeError
        and any(mark in text for mark in ("gloo", "Gloo", "NCCL", "Timed out", "Connection closed"))
    )


def _exit_service(message: str) -> None:
    print(f"gpu-service: {message}; the service ends", file=sys.stderr, flush=True)
    os._exit(1)


class Followers:
    """Ranks 1 .. N-1's processes, watched from the moment they start: one that ends while not
    told to stop calls `on_fault`."""

    def __init__(
        self, processes: list[Any], pipes: list[Any], on_fault: Callable[[str], None]
    ) -> None:
        self.processes, self._pipes, self._on_fault = processes, pipes, on_fault
        self.stopping = False
        threading.Thread(target=self._watch, daemon=True, name="tp-watch").start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: r + 1 for r, p in enumerate(self.processes)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self.stopping:
            return
        rank = sentinels[ready[0]]
        process = self.processes[rank - 1]
        process.join(timeout=1)  # its sentinel fires before its status is read
        code = process.exitcode
        self._on_fault(f"tensor-parallel rank {rank} exited (status {code})")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def join(self) -> None:
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


class TpEngine(Engine):
    """Rank 0's engine. `close()` stops the other ranks; `on_fault` is what a failed collective
    does (the service: exit with status 1)."""

    def __init__(
        self,
        launch: Launch,
        group: TpGroup,
        followers: Followers,
        on_fault: Callable[[str], None] = _exit_service,
    ) -> None:
        self.followers, self._on_fault = followers, on_fault
        self._depth = threading.local()
        # Calls the engine makes on itself while loading are each rank's own.
        self._depth.n = 1
        try:
            super().__init__(
                launch.model_dir,
                launch.svc,
                launch.dtype,
                launch.device_of(0),
                group,
                launch.drafter,
            )
            error = None
        except (OSError, ValueError) as e:
            error = str(e)
        self._depth.n = 0
        errors = [m for m in group.gather_objects(error, START_TIMEOUT) if m]
        if errors:  # every other rank has seen them too, and ends
            self.followers.stopping = True
            self.followers.join()
            raise ValueError(errors[0])

    @property
    def _closing(self) -> bool:
        return self.followers.stopping

    def close(self) -> None:
        """Stop the other ranks (each ends its loop) and wait for them."""
        if self.followers.stopping:
            return
        self.followers.stopping = True
        if self.followers.alive() and self.tp is not None:
            try:
                with self._lock:
                    self.tp.send(_STOP)
            except RuntimeError:
                pass
        self.followers.join()

    def add_forward(self, name: str, after_fold: Callable[..., None]) -> None:
        raise ValueError("add_forward: a hook runs in one process; not under tensor parallelism")

    def _mirror(self, operation: str, /, *args: Any, **kwargs: Any) -> Any:
        # Positional only: an operation's own arguments may be called `name` (`set_forward`).
        method = getattr(Engine, operation)
        with self._lock:
            outer = not getattr(self._depth, "n", 0)
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
                if outer:
                    assert self.tp is not None
                    self.tp.send((operation, args, kwargs))
                return method(self, *args, **kwargs)
            except ModelError:
                raise
            except Exception as e:
                if outer and not self._closing and _failed_collective(e):
                    self._on_fault(f"a tensor-parallel collective failed in {operation}: {e}")
                raise
            finally:
                self._depth.n -= 1


def _mirrored(name: str) -> Callable[..., Any]:
    def call(self: TpEngine, *args: Any, **kwargs: Any) -> Any:
        return self._mirror(name, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = getattr(Engine, name).__doc__
    return call


for _name in MIRRORED:
    setattr(TpEngine, _name, _mirrored(_name))


def _watch_parent(conn: multiprocessing.connection.Connection) -> None:
    """Block until rank 0's process ends (its end of the pipe closes), then end this one."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def follow(
    rank: int, launch: Launch, meet: Rendezvous, conn: multiprocessing.connection.Connection
) -> None:
    """Rank `rank`'s process: load this rank's shard, then run rank 0's operations until told
    to stop."""
    threading.Thread(target=_watch_parent, args=(conn,), daemon=True).start()
    torch.set_num_threads(launch.threads)
    device = launch.device_of(rank)
    configure_interpreter(device.type)  # as rank 0's process did before its kernels loaded
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TpGroup(rank, meet, device, launch.reduce, expert_parallel=launch.expert_parallel)
    try:
        engine = Engine(launch.model_dir, launch.svc, launch.dtype, device, group, launch.drafter)
        error = None
    except (OSError, ValueError) as e:
        error = f"rank {rank}: {e}"
    if any(group.gather_objects(error, START_TIMEOUT)):
        return
    while True:
        message = group.receive()
        if message == _STOP:
            return
        name, args, kwargs = cast(tuple[str, tuple, dict], message)
        try:
            getattr(engine, name)(*args, **kwargs)
        except ModelError:
            pass  # rank 0 met the same and answered its caller
        except Exception as e:
            if _failed_collective(e):
                raise
            traceback.print_exc()


def launch(spec: Launch, on_fault: Callable[[str], None] = _exit_service) -> TpEngine:
    """Start ranks 1 .. N-1 and build rank 0 here; every rank loads only its shard."""
    store = TpGroup.host_store(spec.size)
    meet = Rendezvous("127.0.0.1", store.port, spec.size, spec.timeout_s)
    context = multiprocessing.get_context("spawn")
    followers, pipes = [], []
    for rank in range(1, spec.size):
        ours, theirs = context.Pipe()
        p = context.Process(
            target=follow, args=(rank, spec, meet, theirs), name=f"tp-rank-{rank}", daemon=True
        )
        p.start()
        theirs.close()
        followers.append(p)
        pipes.append(ours)
    watched = Followers(followers, pipes, on_fault)
    device = spec.device_of(0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        group = TpGroup(0, meet, device, spec.reduce, store, spec.expert_parallel)
    except Exception:
        watched.stopping = True
        watched.join()
        raise
    return TpEngine(spec, group, watched, on_fault)
