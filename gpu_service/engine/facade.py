"""The in-process `Model`: a thin facade over the engine's parts, each built here with what it
needs: the slot table (`slots.py`), the verifier (`verifier.py`: prefill, verify, fold,
commit, stash), the drafters (`drafters.py`: prime, propose, trim) and the fused steps
(`fused.py`). It owns the weights and every piece of device state, executes one batched
operation per call under one lock, and never decides what runs next."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import cast

import torch
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from gpu_service.engine import compiled, costs, graphs
from gpu_service.engine.block_drafter import BlockDrafter
from gpu_service.engine.choice import Choice
from gpu_service.engine.device import describe_device, resolve_device
from gpu_service.engine.drafters import Drafter, Drafters
from gpu_service.engine.fused import Steps
from gpu_service.engine.graphs import Capture, Graphs
from gpu_service.engine.head_drafter import HeadDrafter
from gpu_service.engine.plans import EngineSteps, run_plan
from gpu_service.engine.verifier import Verifier
from gpu_service.memory.kv_blocks import KvBlocks
from gpu_service.memory.prefixes import Prefixes
from gpu_service.memory.sequence import SeqState
from gpu_service.memory.slots import SlotTable, mirror
from gpu_service.model.backend import EAGER, EagerOps
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.digest import checkpoint_digest
from gpu_service.model.hybrid import HybridModel, held_bytes
from gpu_service.model.shard import Shard, rank_config
from gpu_service.model.state import DeviceState
from gpu_service.model.weights import serving_dtype, stream_weights
from gpu_service.tp.group import TpGroup
from kernels.attention.format import KEY_BLOCK
from protos import checks
from protos.handles import ImageInput
from protos.hub import model_name
from protos.model import (
    FORWARDS,
    MTP_HEAD,
    Capabilities,
    InvalidArgument,
    Logits,
    ModelError,
    NotFound,
    Penalties,
    Prefilled,
    Proposal,
    Sampling,
    ScoreAsk,
    SequenceHandle,
    StepResult,
    Verified,
    read_tokenizer_files,
)
from protos.steps import PlanResult, StepPlan, StepStream
from protos.telemetry import tracer

_TRACER = tracer("met.engine")


def _triton_ops() -> EagerOps:
    """Imported on first use: Triton decides interpreted or compiled when its kernels are
    decorated, after the process chose its device."""
    from gpu_service.model.triton_forward import TRITON

    return TRITON


class Engine:
    def __init__(
        self,
        model_dir: Path,
        svc: ServiceConfig | None = None,
        dtype: str | None = None,
        device: str | torch.device | None = None,
        tp: TpGroup | None = None,
        drafter: Path | None = None,
    ) -> None:
        """With `tp`, this process is one rank of a tensor-parallel group: it loads and holds
        only its part of the weights and state (`model/shard.py`), and every operation must be
        run by every rank in the same order (`ranks.py` sees to it). `drafter`: a DFlash
        drafter's directory (z-lab's layout), loaded beside the MTP head."""
        self.cfg = ModelConfig.load(model_dir)
        self.tp = tp
        self.svc = svc or ServiceConfig()
        self.name = model_name(model_dir)
        self.model_dir = model_dir
        # Read once, as the weights are: the files served stay those of the weights loaded.
        self._tokenizer_files = read_tokenizer_files(model_dir)
        torch_dtype = serving_dtype(self.cfg, dtype)
        self.device = resolve_device(device or "auto")
        shard = None if tp is None else Shard(tp.rank, tp.size, tp.expert_parallel)
        weights, self.cfg = stream_weights(self.cfg, model_dir, torch_dtype, self.device, shard)
        # Once, of the files just loaded: the engine never loads other weights.
        self.digest = checkpoint_digest(model_dir)
        # What this rank holds: heads and intermediates divided, ids and widths as served.
        size, placed = (1, False) if shard is None else (shard.size, shard.experts)
        held = rank_config(self.cfg, size, placed)
        self.model = HybridModel(held, weights, self.svc.max_context, tp)
        self.state = DeviceState(held, self.svc, torch_dtype, self.device)
        self.choice = Choice()
        # name -> hook run after every fold (None for the plain forwards); tests add more.
        self.forwards: dict[str, Callable[[DeviceState, list[int]], None] | None] = {
            name: None for name in FORWARDS
        }
        self.slots = SlotTable(self.svc.num_slots, self.state.reset_slot, KvBlocks(self.state))
        self.prefixes = Prefixes(
            self.state, self.slots, self.svc.prefix_snapshots, self.cfg.has_mtp
        )
        parts = (self.cfg, self.svc, self.model, self.state, self.slots, self.choice)
        self.blocks = None if drafter is None else BlockDrafter(drafter, held, *parts[1:])
        loaded: list[Drafter] = [HeadDrafter(*parts), *([self.blocks] if self.blocks else [])]
        self.drafters = Drafters(self.cfg, self.svc, self.state, self.slots, loaded)
        self.verifier = Verifier(*parts, prime=self.drafters.prime)
        self.steps = Steps(self.svc, self.verifier, self.drafters)
        # Reentrant: measuring costs runs the single operations under the same hold.
        self._lock = threading.RLock()
        # Under tensor parallelism each replay would hold collectives; graphs stay off there.
        if tp is None and graphs.wanted(self.svc.cuda_graphs, self.device, os.environ):
            self.use_graphs(graphs.cuda_capture)
        self.compiled_at_start: list[tuple[tuple, float]] = []  # (key, seconds) each
        if self.svc.compile:
            self.compile_step()

    def compile_step(self, later: bool = True) -> None:
        """The verify and chain compiled per bucket on the CPU (`engine/compiled.py`): one request's
        steps now (`Graphs.warm`), other keys at first call, in the background with `later`."""
        if self.device.type != "cpu" or self.tp is not None:
            raise ValueError("compile_step: the step is compiled on one CPU device only")
        compiled.use_cache(self.svc.compile_cache)
        self.use_graphs(graphs.compile_capture, compiled=True)
        assert self.choice.graphs is not None
        self.choice.graphs.later = self.choice.graphs.later if later else None
        with self._hold():
            drafts = max(self.svc.slot_verify_drafts)
            self.compiled_at_start = self.choice.graphs.warm(drafts, self.cfg.has_mtp)

    def use_graphs(self, capture: Capture | None, compiled: bool = False) -> None:
        """Replay the batched verify and the chain from graphs captured by `capture` (None:
        eager; `compiled`: see `Graphs`). Tests pass `graphs.replay_eagerly` to run the same
        buffers, padding and fallbacks without a capture."""
        if capture is not None and self.tp is not None:
            raise ValueError(
                "use_graphs: captured graphs are not replayed under tensor parallelism"
            )
        with self._lock:
            self.choice.graphs = None
            if capture is not None:
                sizes = (self.svc.max_batch, self.svc.max_context)
                self.choice.graphs = Graphs(self.model, self.state, *sizes, capture, compiled)

    @contextmanager
    def _hold(self) -> Iterator[None]:
        """One operation at a time, in inference mode: no autograd bookkeeping on any op
        (views and in-place writes of the state are cheaper)."""
        with self._lock, torch.inference_mode():
            yield

    @property
    def forward_name(self) -> str:
        return self.choice.name

    # -- slots ---------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return Capabilities(
            model_name=self.name,
            vocab_size=self.cfg.vocab_size,
            num_slots=self.svc.num_slots,
            free_slots=self.slots.num_free,
            slot_verify_drafts=self.svc.slot_verify_drafts,
            max_rows=self.svc.max_rows,
            forwards=tuple(self.forwards),
            current_forward=self.forward_name,
            device=describe_device(self.device),
            max_context=self.svc.max_context,
            dtype=str(self.model.dtype).removeprefix("torch."),
            hidden_size=self.cfg.hidden_size,
            eos_token_ids=self.cfg.all_eos,
            has_mtp=self.cfg.has_mtp,
            max_batch=self.svc.max_batch,
            max_prefill_tokens=self.svc.max_prefill_tokens,
            model_digest=self.digest,
            graphs=self.choice.graphs is not None,
            quantization=self.cfg.quantization.name if self.cfg.quantization else "",
            tensor_parallel_size=1 if self.tp is None else self.tp.size,
            kv_blocks=self.state.num_blocks,
            kv_block_size=KEY_BLOCK,
            kv_blocks_free=self.slots.blocks.num_free,
            prefix_snapshots=self.svc.prefix_snapshots,
            dflash_block=0 if self.blocks is None else self.blocks.block_size,
            compiled=self.choice.graphs is not None and self.choice.graphs.compiled,
            compiles_pending=0 if self.choice.graphs is None else self.choice.graphs.pending,
            vision_tower=self.model.vision is not None,
            max_images_per_prompt=self.svc.max_images_per_prompt if self.model.vision else 0,
            max_image_pixels=self.svc.max_image_pixels if self.model.vision else 0,
        )

    def tokenizer_files(self) -> dict[str, bytes]:
        return dict(self._tokenizer_files)

    def alloc_sequence(
        self, penalties: Penalties | None = None, drafter: str = MTP_HEAD
    ) -> SequenceHandle:
        problem = (
            None if penalties is None else checks.penalties_problem(penalties, self.cfg.vocab_size)
        )
        if problem:
            raise InvalidArgument(problem)
        self.drafters.get(drafter)
        with self._hold():
            seq = self.slots.alloc(
                penalties if penalties is not None and penalties.active else None, drafter
            )
            return SequenceHandle(seq.seq_id, seq.slot, 0)

    def free_sequence(self, seq: SequenceHandle) -> None:
        with self._hold():
            self.slots.free(seq.seq_id)

    def free_sequences(self, seq_ids: Sequence[int]) -> None:
        """Free what an ended session left (the servicer's call, not a `Model` operation);
        an id freed already is skipped."""
        with self._hold():
            for seq_id in seq_ids:
                with suppress(NotFound):
                    self.slots.free(seq_id)

    # -- prefix snapshots ----------------------------------------------------------------

    def snapshot_prefixes(self, seqs: Sequence[SequenceHandle]) -> list[int]:
        """A snapshot of each sequence as it stands, right after a prefill to a whole number of
        KV blocks (`gpu_service/memory/prefixes.py`) -> their ids. All or none: a refused one lets
        the others taken go."""
        with self._hold():
            states = self.slots.lookup("snapshot_prefixes", seqs)
            taken: list[int] = []
            try:
                for s in states:
                    taken.append(self.prefixes.snapshot(s))
            except ModelError:
                self.prefixes.drop(taken)
                raise
            return taken

    def restore_prefixes(self, seqs: Sequence[SequenceHandle], snapshots: Sequence[int]) -> None:
        """Each fresh sequence goes on from its snapshot: it holds the snapshot's tokens, and
        the rest of its prompt is what it prefills. All or none: a refused one leaves every
        sequence fresh."""
        checks.same_length("restore_prefixes", seqs=seqs, snapshots=snapshots)
        with self._hold():
            states = self.slots.lookup("restore_prefixes", seqs)
            done: list[SeqState] = []
            try:
                for s, snap in zip(states, snapshots, strict=True):
                    self.prefixes.restore(s, snap)
                    done.append(s)
            except ModelError:
                for s in done:
                    self.slots.renew(s)
                raise
            mirror(seqs, states)

    def drop_prefixes(self, snapshots: Sequence[int]) -> None:
        with self._hold():
            self.prefixes.drop(snapshots)

    # -- verifier ------------------------------------------------------------------------

    def prefill(
        self,
        seqs: Sequence[SequenceHandle],
        prompts: Sequence[Sequence[int]],
        masks: Sequence[bytes] | None = None,
        sampling: Sequence[Sampling | None] | None = None,
        scores: Sequence[ScoreAsk | None] | None = None,
        top: Sequence[int] | None = None,
        images: Sequence[Sequence[ImageInput]] | None = None,
    ) -> Prefilled:
        with self._hold():
            return self.verifier.prefill(seqs, prompts, masks, sampling, scores, top, images)

    def decode_verify_batched(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        write_on_accept: bool = True,
        masks: dict[int, bytes] | None = None,
        sampling: dict[int, Sampling] | None = None,
        top: Sequence[int] | None = None,
    ) -> Verified:
        with self._hold():
            return self.verifier.decode_verify_batched(
                tokens, ks, seqs, write_on_accept, masks, sampling, top
            )

    def gdn_fold_accepted(self, seqs: Sequence[SequenceHandle], fold_rows: Sequence[int]) -> None:
        with self._hold():
            self.verifier.gdn_fold_accepted(seqs, fold_rows)

    def commit_accepted_prefix(
        self, seqs: Sequence[SequenceHandle], kept_rows: Sequence[int], ks: Sequence[int]
    ) -> list[int]:
        with self._hold():
            return self.verifier.commit_accepted_prefix(seqs, kept_rows, ks)

    def stash_verify_hidden_rows(self, rows: Sequence[int]) -> None:
        with self._hold():
            self.verifier.stash_verify_hidden_rows(rows)

    # -- drafter -------------------------------------------------------------------------

    def run_mtp_propose_batched(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceHandle],
        sampling: Sequence[Sampling | None] | None = None,
        drafters: Sequence[str] = (),
    ) -> Proposal:
        with self._hold():
            return self.drafters.run_mtp_propose_batched(
                last, stash, num_drafts, seqs, sampling, drafters
            )

    def check_positions(self, seqs: Sequence[SequenceHandle], positions: Sequence[int]) -> None:
        with self._hold():
            self.drafters.check_positions(seqs, positions)

    def trim_proposer_state(self, seqs: Sequence[SequenceHandle], keep_own: int = 0) -> None:
        with self._hold():
            self.drafters.trim(self.slots.lookup("trim_proposer_state", seqs), keep_own)

    # -- fused steps ---------------------------------------------------------------------

    def settle_verdict(
        self,
        seqs: Sequence[SequenceHandle],
        kept_rows: Sequence[int],
        ks: Sequence[int],
        proposers: Sequence[int],
        last: Sequence[int],
        num_drafts: int,
        sampling: Sequence[Sampling | None] | None = None,
        drafters: Sequence[str] = (),
    ) -> Proposal:
        with self._hold():
            return self.steps.settle_verdict(
                seqs, kept_rows, ks, proposers, last, num_drafts, sampling, drafters
            )

    def decode_step(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        want_drafts: Sequence[bool],
        num_drafts: int,
        drafters: Sequence[str] = (),
        masks: dict[int, bytes] | None = None,
    ) -> StepResult:
        with self._hold():
            return self.steps.decode_step(
                tokens, ks, seqs, want_drafts, num_drafts, drafters, masks
            )

    def run_plan(self, plan: StepPlan) -> PlanResult:
        """One step plan (`StepPlan`), under the caller's trace context."""
        with (
            self._hold(),
            _TRACER.start_as_current_span(
                "engine.plan", context=propagate.extract(plan.trace), kind=SpanKind.SERVER
            ),
        ):
            return run_plan(
                plan, lambda h: self.slots.get(h.seq_id).continuation, self.steps.decode_step
            )

    def open_steps(self) -> StepStream:
        return EngineSteps(self.run_plan)

    # -- forwards and admin --------------------------------------------------------------

    def set_forward(self, name: str) -> None:
        """The backend is chosen here, once: an ops object the model and the parts use."""
        if name not in self.forwards:
            raise InvalidArgument(
                f"unknown forward {name!r}; this service has {', '.join(self.forwards)}"
            )
        with self._hold():
            self.choice.name = name
            self.choice.ops = _triton_ops() if name.startswith("triton") else EAGER
            self.choice.serial = name.endswith("-serial")
            self.choice.after_fold = self.forwards[name]
            self.model.ops = self.choice.ops

    def add_forward(self, name: str, after_fold: Callable[[DeviceState, list[int]], None]) -> None:
        """A forward that runs as `eager` (or batched-serial when `name` ends in `-serial`)
        and then calls `after_fold(state, slots)` after each fold: how a test plants a fault
        the circuit diff must catch."""
        self.forwards[name] = after_fold

    def measure_costs(
        self,
        widths: Sequence[int],
        max_depth: int,
        repeats: int = 5,
        refresh: bool = False,
        cached_only: bool = False,
    ) -> tuple[list[costs.CostEntry], bool]:
        """Verify and propose costs by width and depth (see gpu_service/engine/costs.py), from the
        cache unless `refresh` or the cache falls short. -> (entries, cached)"""
        with self._hold():
            job = costs.measurement(self, list(widths), max_depth, repeats, refresh, cached_only)
            return costs.run(job)

    def held_bytes(self) -> dict[str, dict[str, int]]:
        """The bytes of each tensor this rank holds, for its weights (`weights`, by where the
        model keeps each) and its device state (`state`, by `DeviceState` attribute)."""
        with self._hold():
            state = {n: v for n, v in vars(self.state).items() if isinstance(v, torch.Tensor)}
            weights = {n: held_bytes([t]) for n, t in self.model.named_held().items()}
            if self.blocks is not None:  # the DFlash drafter's, beside the target's
                weights |= {
                    f"dflash.{i}": held_bytes([t]) for i, t in enumerate(self.blocks.net.held)
                }
            return {"weights": weights, "state": {n: held_bytes([t]) for n, t in state.items()}}

    def held_bytes_by_rank(self) -> list[dict[str, dict[str, int]]]:
        """`held_bytes` of every rank, in rank order (one entry on one device)."""
        mine = self.held_bytes()
        if self.tp is None:
            return [mine]
        return [cast(dict[str, dict[str, int]], d) for d in self.tp.gather_objects(mine)]

    def read_logits(self) -> Logits:
        with self._hold():
            t = self.model.full_logits(self.state.logits).contiguous().cpu()
            data = t.view(torch.uint8).numpy().tobytes()
            return Logits(data, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def open_engine(
    model: Path, drafter: Path | None, prefix_snapshots: int, compile_step: bool
) -> Engine:
    """An `Engine` as `protos.model.OpenModel` asks for one."""
    engine = Engine(model, ServiceConfig(prefix_snapshots=prefix_snapshots), drafter=drafter)
    if compile_step:
        engine.compile_step(later=False)
    return engine
