"""Where the engine's tensors live and what one step costs: every weight and state tensor on
the engine's device, a forward that makes no tensor of its own off that device (it runs on
`meta` tensors), an operator count for a greedy step that does not grow with the batch, and
at most one device-to-host transfer per operation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_service.engine.facade import Engine
from gpu_service.model.batch import Segment
from gpu_service.model.config import ModelConfig
from gpu_service.model.hybrid import PREFILL, VERIFY, HybridModel
from gpu_service.model.state import DeviceState
from gpu_service.model.weights import load_weights
from protos.defaults import DEFAULT_MODEL_DIR
from protos.model import SequenceHandle
from tests.conftest import TINY_SERVICE, TRAINED

PROMPT = [5, 9, 14, 3, 7, 7, 2, 8]
# Ops that read a tensor's values on the host (a synchronising copy on a GPU).
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero", "equal"}


def _tensors(obj: object, seen: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor an object holds in its attributes, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    items: dict = {}
    if isinstance(obj, torch.Tensor):
        yield "", obj
        return
    if isinstance(obj, dict):
        items = obj
    elif isinstance(obj, list | tuple):
        items = dict(enumerate(obj))
    elif hasattr(obj, "__dict__"):
        items = vars(obj)
    for key, value in items.items():
        for name, t in _tensors(value, seen):
            yield f"{key}.{name}".rstrip("."), t


def test_every_tensor_sits_on_the_engine_device(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, TINY_SERVICE, device="cpu")
    found = dict(_tensors(engine.model)) | {f"state.{k}": t for k, t in _tensors(engine.state)}
    assert len(found) > 60, "weights, derived weights and every state buffer"
    off = [name for name, t in found.items() if t.device != engine.device]
    assert off == [], f"tensors off {engine.device}: {off}"
    assert engine.capabilities().device == "cpu"


def test_the_forward_runs_on_meta_tensors(tiny_dir: Path) -> None:
    """Prefill, verify and the MTP head's pass with weights and state on `meta`: an op that
    reads values on the host, or a tensor made on the CPU, fails there."""
    cfg = ModelConfig.load(tiny_dir)
    weights, cfg = load_weights(cfg, tiny_dir, torch.float32)
    meta = torch.device("meta")
    model = HybridModel(cfg, {k: v.to(meta) for k, v in weights.items()}, 256)
    state = DeviceState(cfg, TINY_SERVICE, torch.float32, meta)
    tokens = torch.zeros(10, dtype=torch.long, device=meta)
    hidden = model.forward(tokens, [Segment(0, 0, 6, 0), Segment(1, 0, 4, 6)], state, PREFILL)
    assert hidden.device == meta and hidden.shape == (12, cfg.hidden_size)
    verify = [Segment(0, 6, 4, 0), Segment(1, 4, 2, 4)]
    hidden = model.forward(tokens[:6], verify, state, VERIFY, write_live=False)
    drafts = model.mtp_forward(
        tokens[:2], hidden[:2], [Segment(0, 9, 1, 0), Segment(1, 5, 1, 1)], state
    )
    assert drafts is not None and drafts.device == meta
    assert model.logits(drafts).device == meta


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _greedy_step_ops(engine: Engine, batch: int) -> int:
    """Non-view aten ops of one greedy `decode_step` (verify k = 4, settle, 3 drafts) over
    `batch` sequences, after a prefill and a first step that made their drafts."""
    seqs = [engine.alloc_sequence() for _ in range(batch)]
    first = engine.prefill(seqs, [PROMPT] * batch).argmax
    res = engine.decode_step(first, [1] * batch, seqs, [True] * batch, 3)
    rows = [[res.argmax[i], *res.proposal.drafts[i]] for i in range(batch)]
    with _OpCount() as count:
        engine.decode_step([t for r in rows for t in r], [4] * batch, seqs, [True] * batch, 3)
    for s in seqs:
        engine.free_sequence(s)
    return count.ops


@pytest.fixture(scope="module")
def default_engine() -> Engine:
    """The 4-layer trained fixture: the operation budget below is its step's."""
    return Engine(TRAINED)


@contextmanager
def _one_thread() -> Iterator[None]:
    """As the service runs its engine (see gpu_service/rpc/server.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_a_greedy_step_is_a_fixed_set_of_operations(default_engine: Engine) -> None:
    """The budget was set on the 4-layer model (the fixture), and raised by the eager
    attention's key-length-invariant reductions (per-block sums and ordered scans: about 16
    operations a call, six calls a step), then by the paged KV's block table lookups (where a
    forward's rows write and its tiles read: about 9 operations a forward, once for all its
    layers, five forwards a step, and the drafts' trim); the 12-layer default has three times
    its layers, and its count must not grow with the batch either."""
    with _one_thread():
        counts = {b: _greedy_step_ops(default_engine, b) for b in (1, 8)}
        deep = Engine(DEFAULT_MODEL_DIR)
        deep_counts = {b: _greedy_step_ops(deep, b) for b in (1, 8)}
    print(f"non-view aten ops of one greedy step (eager): 4 layers {counts}, default {deep_counts}")
    assert counts[1] <= 615
    assert counts[8] <= 1.15 * counts[1]
    assert deep_counts[8] <= 1.15 * deep_counts[1]


class _HostReads(TorchDispatchMode):
    """Counts every way a tensor's values reach the host: `tolist`, `item`, `numpy`, `cpu`,
    Python conversions, and the aten ops that read values to decide a shape."""

    NAMES = ("tolist", "item", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> _HostReads:
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(t: torch.Tensor, *a, _original=original, **k):  # noqa: ANN002, ANN003
                self.reads += 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = str(func.overloadpacket).removeprefix("aten.")
        if name in SYNCING or name.startswith("unique"):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_each_operation_reads_the_device_once(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, TINY_SERVICE)
    seqs = [engine.alloc_sequence() for _ in range(3)]
    calls: list[tuple[str, Callable[[], object]]] = []
    first: list[int] = []

    def prefill() -> None:
        first[:] = engine.prefill(seqs, [PROMPT, PROMPT[:3], PROMPT[:5]]).argmax

    def verify(model_seqs: list[SequenceHandle]) -> Callable[[], object]:
        return lambda: engine.decode_verify_batched(first + [1, 2], [2, 1, 2], model_seqs)

    calls.append(("prefill", prefill))
    calls.append(("decode_verify_batched", verify(seqs)))
    calls.append(("stash_verify_hidden_rows", lambda: engine.stash_verify_hidden_rows([1, 2])))
    calls.append(("gdn_fold_accepted", lambda: engine.gdn_fold_accepted(seqs, [2, 1, 1])))
    calls.append(
        (
            "commit_accepted_prefix",
            lambda: engine.commit_accepted_prefix(seqs, [2, 1, 1], [2, 1, 2]),
        )
    )
    calls.append(
        (
            "run_mtp_propose_batched",
            lambda: engine.run_mtp_propose_batched([3, 4], [0, 1], 3, seqs[:2]),
        )
    )
    calls.append(("trim_proposer_state", lambda: engine.trim_proposer_state(seqs[:2])))
    calls.append(("decode_verify_batched", verify(seqs)))
    calls.append(
        (
            "settle_verdict",
            lambda: engine.settle_verdict(seqs, [1, 1, 2], [2, 1, 2], [0, 2], [5, 6], 2),
        )
    )
    calls.append(
        (
            "decode_step",
            lambda: engine.decode_step([7, 8, 9, 1], [2, 1, 1], seqs, [True, False, True], 3),
        )
    )
    reads = {}
    for name, call in calls:
        with _HostReads() as host:
            call()
        reads[name] = max(reads.get(name, 0), host.reads)
    print(f"device-to-host reads per operation: {reads}")
    assert reads["prefill"] == reads["decode_step"] == 1
    assert all(n <= 1 for n in reads.values()), reads
