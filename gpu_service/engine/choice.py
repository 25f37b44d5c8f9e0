"""The forward the engine's parts share (`Choice`): its ops, whether batched calls run one
sequence at a time, a fold hook, and the captured graphs it replays. Apart from the backends,
which the graphs are built over."""

from __future__ import annotations

from collections.abc import Callable

from gpu_service.engine.graphs import Graphs
from gpu_service.model.backend import EAGER, EagerOps
from gpu_service.model.state import DeviceState


class Choice:
    """The forward in use, shared by the engine's parts: its ops, whether batched calls run
    one sequence at a time (`*-serial`), and a hook run after every fold (tests plant faults
    the circuit diff must catch)."""

    def __init__(self) -> None:
        self.name = "eager"
        self.ops: EagerOps = EAGER
        self.serial = False
        self.after_fold: Callable[[DeviceState, list[int]], None] | None = None
        # The captured graphs (engine/graphs.py) the batched forwards replay; None: eager.
        self.graphs: Graphs | None = None

    def replayed(self) -> Graphs | None:
        """The graphs a forward replays: the serial forwards run eagerly against captured
        graphs (a PASS holds the graphs to the eager bytes), but replay compiled ones, whose
        fused arithmetic rounds otherwise: one sequence in the smallest bucket, so that the
        circuit diff compares compiled against compiled-serial."""
        if self.graphs is None or (self.serial and not self.graphs.compiled):
            return None
        return self.graphs
