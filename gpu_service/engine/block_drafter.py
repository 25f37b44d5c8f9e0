"""The DFlash drafter's part of the engine: loading it beside the target (`--drafter PATH`),
and proposing for the sequences a call gives it (allocated to it, or named per call): one
batched block forward, drafts by argmax, or for sampled sequences drawn from the drafter's
distribution q with the caller's uniforms (kept for the verify's rejection sampling)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpu_service.dflash.config import DFlashConfig, read_config
from gpu_service.dflash.model import DFlashModel
from gpu_service.dflash.weights import load_tensors
from gpu_service.engine.choice import Choice
from gpu_service.engine.drafters import Drafted, StepDrafts, StepView
from gpu_service.engine.logits import distribution
from gpu_service.engine.sampling import draw
from gpu_service.memory.sequence import SeqState
from gpu_service.memory.slots import SlotTable
from gpu_service.model.backend import download, upload
from gpu_service.model.batch import Layout, Segment, build
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.hybrid import HybridModel
from gpu_service.model.ops import ROW_TILE
from gpu_service.model.state import DeviceState
from kernels.attention.naive import KEY_BLOCK
from protos.model import DFLASH, InvalidArgument, Proposal, Sampling, room_for_block

# The block's rows per attention tile: a whole block of 16 in one.
BLOCK_TILE = 16


class BlockDrafter:
    """A DFlash drafter as a `Drafter`: one block forward gives a sequence's drafts."""

    name = DFLASH

    def __init__(
        self,
        directory: Path,
        cfg: ModelConfig,
        svc: ServiceConfig,
        model: HybridModel,
        state: DeviceState,
        slots: SlotTable,
        choice: Choice,
    ) -> None:
        self.dcfg: DFlashConfig = read_config(directory, cfg)
        weights = load_tensors(self.dcfg, directory, model.dtype)
        self.svc, self.model, self.state, self.choice = svc, model, state, choice
        self.slots = slots
        self.net = DFlashModel(
            self.dcfg, weights, model.embed_rows, model.dtype, model.device, svc.max_context
        )
        state.add_dflash_pool(
            self.dcfg.num_hidden_layers, self.dcfg.num_key_value_heads, self.dcfg.head_dim
        )
        model.attach_taps(self.dcfg.target_layer_ids, self.write_context)

    @property
    def block_size(self) -> int:
        return self.dcfg.block_size

    def write_context(self, taps: torch.Tensor, batch, state: DeviceState) -> None:
        self.net.ops = self.choice.ops
        self.net.write_context(taps, batch, state)

    @property
    def available(self) -> bool:
        return True

    def prime(
        self,
        group: list[SeqState],
        toks: list[list[int]],
        segs: list[Segment],
        hidden: torch.Tensor,
    ) -> None:
        """Nothing: every prefill and verify writes its context from the target's taps."""

    def check(self, s: SeqState, seq_len: int, num_drafts: int, stash: int | None) -> None:
        """`InvalidArgument` unless a block from `seq_len` fits and gives `num_drafts`."""
        self.check_count(num_drafts)
        b = self.dcfg.block_size
        if not room_for_block(seq_len, b, self.svc.max_context):
            raise InvalidArgument(
                f"sequence {s.seq_id} holds {seq_len} tokens; a DFlash block of {b} from "
                f"position {seq_len} exceeds the context of {self.svc.max_context}"
            )

    def check_count(self, num_drafts: int) -> None:
        b = self.dcfg.block_size
        if num_drafts > b - 1:
            raise InvalidArgument(
                f"num_drafts is {num_drafts}; a DFlash block of {b} gives at most {b - 1}"
            )

    def step_extent(self, num_drafts: int) -> int:
        return self.dcfg.block_size

    def propose(
        self,
        states: list[SeqState],
        last: list[int],
        stash: list[int],
        num_drafts: int,
        sampled: dict[int, Sampling],
    ) -> tuple[Proposal, torch.Tensor]:
        self.slots.cover(states, [s.seq_len + self.dcfg.block_size for s in states])
        drafts, confs, logits = self._blocks(states, last, num_drafts, sampled)
        for s in states:
            s.own_drafts = []  # the block's keys are rewritten by the verify: nothing to trim
        return Proposal(drafts, confs), logits

    def step_drafts(
        self, step: StepView, rows: list[int], where: torch.Tensor, num_drafts: int
    ) -> StepDrafts:
        """A block needs the committed lengths on the host to lay out its rows: it proposes
        once the step is committed, for the sequences with room for a whole block."""

        def finish(values: list[list[float]], bonus: list[int]) -> Drafted:
            ctx, b = self.svc.max_context, self.dcfg.block_size
            room = [i for i in rows if room_for_block(step.states[i].seq_len, b, ctx)]
            if not room:
                return [], Proposal([], []), self.state.logits[:0]
            proposal, logits = self.propose(
                [step.states[i] for i in room], [bonus[i] for i in room], [], num_drafts, {}
            )
            return room, proposal, logits

        return StepDrafts([], finish)

    def trim(self, states: list[SeqState], keep_own: int) -> None:
        """Nothing: a block keeps no entries of its own past the verify that follows it."""

    def _blocks(
        self,
        states: list[SeqState],
        last: list[int],
        num_drafts: int,
        sampled: dict[int, Sampling],
    ) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
        """Drafts and confidences of each sequence, and the logits of each one's last draft
        row ([n, vocab], the logits buffer's)."""
        self.net.ops = self.choice.ops
        b = self.dcfg.block_size
        parts = (
            [[i] for i in range(len(states))] if self.choice.serial else [list(range(len(states)))]
        )
        drafts: list[list[int]] = [[] for _ in states]
        confs: list[list[float]] = [[] for _ in states]
        lasts: list[torch.Tensor] = []
        for part in parts:
            segs = [
                Segment(states[i].slot, states[i].seq_len, b, j * b) for j, i in enumerate(part)
            ]
            layout = Layout(
                BLOCK_TILE, KEY_BLOCK, self.model.cfg.linear_conv_kernel_dim, 0, causal=False
            )
            batch = build(segs, layout, ROW_TILE, self.model.device)
            (tok,) = upload(self.model.device, [last[i] for i in part])
            hidden = self.net.block(tok, batch, self.state)
            rows = [j * b + 1 + d for j in range(len(part)) for d in range(num_drafts)]
            (index,) = upload(self.model.device, rows)
            logits = self.model.logits(hidden.index_select(0, index), ROW_TILE)
            top, conf = self.model.draft_argmax(logits)
            top_h, conf_h = download(top, conf)
            for j, i in enumerate(part):
                span = slice(j * num_drafts, (j + 1) * num_drafts)
                drafts[i] = [int(t) for t in top_h[span]]
                confs[i] = list(conf_h[span])
                if i in sampled:
                    drafts[i], confs[i] = self._sample(states[i], logits[span], sampled[i])
                else:
                    states[i].draft_probs = None
                lasts.append(logits[(j + 1) * num_drafts - 1])
        return drafts, confs, torch.stack(lasts)

    def _sample(
        self, s: SeqState, logits: torch.Tensor, smp: Sampling
    ) -> tuple[list[int], list[float]]:
        """Each draft drawn from the drafter's distribution with the caller's uniform; the
        distributions kept for the verify's residuals."""
        q = distribution(self.model.full_logits(logits), smp)
        toks = [draw(q[d], smp.uniforms[d]) for d in range(q.shape[0])]
        s.draft_probs = q
        return toks, [float(np.float32(q[d, t])) for d, t in enumerate(toks)]
