"""The in-process `Model`: owns the weights and every piece of device state, and executes one
batched operation per call. It never decides what runs next."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from gpu_service import checks, costs
from gpu_service.config import ModelConfig, ServiceConfig
from gpu_service.drafter import DrafterOps
from gpu_service.interface import (
    FORWARDS,
    Capabilities,
    FailedPrecondition,
    InvalidArgument,
    Logits,
    NotFound,
    ResourceExhausted,
    RowDraws,
    Sampling,
    SequenceHandle,
)
from gpu_service.model.hybrid import PREFILL, VERIFY, HybridModel, Segment
from gpu_service.model.weights import load_weights
from gpu_service.sampling import (
    check_sampling,
    distribution,
    draw,
    row_draws,
)
from gpu_service.sequence import FOLDED, IDLE, VERIFIED, SeqState
from gpu_service.state import DeviceState
from gpu_service.telemetry import traced
from kernels.argmax.naive import argmax_confidence as naive_argmax
from kernels.fold.naive import fold as naive_fold


def triton_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.argmax.triton import argmax_confidence

    return argmax_confidence(logits)


def triton_fold(live: torch.Tensor, rows: torch.Tensor, slots: list[int], picks: list[int]) -> None:
    from kernels.fold.triton import fold

    fold(live, rows, slots, picks)


class Engine(DrafterOps):
    def __init__(
        self, model_dir: Path, svc: ServiceConfig | None = None, dtype: str | None = None
    ) -> None:
        self.cfg = ModelConfig.load(model_dir)
        self.svc = svc or ServiceConfig()
        self.name = model_dir.resolve().name
        self.model_dir = model_dir
        names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
        torch_dtype = getattr(torch, names.get(dtype or "", dtype or self.cfg.torch_dtype))
        weights, self.cfg = load_weights(self.cfg, model_dir, torch_dtype)
        self.model = HybridModel(self.cfg, weights, self.svc.max_context)
        self.state = DeviceState(self.cfg, self.svc, torch_dtype)
        self.forward_name = "eager"
        # name -> hook run after every fold (None for the plain forwards); tests add more.
        self.forwards: dict[str, Callable[[DeviceState, list[int]], None] | None] = {
            name: None for name in FORWARDS
        }
        self._logprobs: list[float] = []
        self._draws: list[RowDraws | None] = []
        self._verify_calls = 0
        self._seqs: dict[int, SeqState] = {}
        self._next_id = 1
        self._free = set(range(self.svc.num_slots))
        # Reentrant: the fused verdict runs the single operations under the same hold.
        self._lock = threading.RLock()

    # -- slots ---------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return Capabilities(
            model_name=self.name,
            vocab_size=self.cfg.vocab_size,
            num_slots=self.svc.num_slots,
            free_slots=len(self._free),
            slot_verify_drafts=self.svc.slot_verify_drafts,
            max_rows=self.svc.max_rows,
            forwards=tuple(self.forwards),
            current_forward=self.forward_name,
            device="cpu",
            max_context=self.svc.max_context,
            dtype=str(self.model.dtype).removeprefix("torch."),
            hidden_size=self.cfg.hidden_size,
            eos_token_ids=(self.cfg.eos_token_id,),
            has_mtp=self.cfg.has_mtp,
            max_batch=self.svc.max_batch,
            max_prefill_tokens=self.svc.max_prefill_tokens,
        )

    def alloc_sequence(self) -> SequenceHandle:
        with self._lock:
            if not self._free:
                raise ResourceExhausted(f"all {self.svc.num_slots} slots are taken")
            slot = min(self._free)
            self._free.remove(slot)
            seq = SeqState(self._next_id, slot)
            self._next_id += 1
            self._seqs[seq.seq_id] = seq
            self.state.reset_slot(slot)
            return SequenceHandle(seq.seq_id, slot, 0)

    def free_sequence(self, seq: SequenceHandle) -> None:
        with self._lock:
            s = self._get(seq.seq_id)
            del self._seqs[s.seq_id]
            self._free.add(s.slot)

    def _get(self, seq_id: int) -> SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise NotFound(f"sequence {seq_id} is unknown or already freed") from None

    def _lookup(self, what: str, handles: Sequence[SequenceHandle]) -> list[SeqState]:
        checks.not_empty(what, handles)
        ids = [h.seq_id for h in handles]
        checks.distinct(what, ids)
        return [self._get(i) for i in ids]

    # -- target forward ------------------------------------------------------------------

    def _run(
        self, fn: Callable[[list[int]], torch.Tensor], groups: list[list[int]]
    ) -> torch.Tensor:
        """fn(indices) -> hidden rows of those sequences; `*-serial` calls it one at a time."""
        if self.forward_name.endswith("-serial"):
            return torch.cat([fn([i]) for i in range(len(groups))])
        return fn(list(range(len(groups))))

    def _segments(
        self, seqs: list[SeqState], counts: list[int], starts: list[int]
    ) -> list[Segment]:
        segs, row = [], 0
        for s, n, start in zip(seqs, counts, starts, strict=True):
            segs.append(Segment(s.slot, start, n, row))
            row += n
        return segs

    @traced("engine.prefill")
    def prefill(
        self,
        seqs: Sequence[SequenceHandle],
        prompts: Sequence[Sequence[int]],
        masks: Sequence[bytes] | None = None,
        sampling: Sequence[Sampling | None] | None = None,
    ) -> list[int]:
        with self._lock:
            checks.same_length("prefill", seqs=seqs, prompts=prompts)
            sampled = {i: s for i, s in enumerate(sampling or ()) if s is not None}
            check_sampling(sampled, {i: 1 for i in sampled}, len(prompts))
            row_masks = self._masks(dict(enumerate(masks or ())), len(prompts))
            states = self._lookup("prefill", seqs)
            total = 0
            for s, p in zip(states, prompts, strict=True):
                checks.phase(s.seq_id, s.phase, IDLE, "prefill")
                if not p:
                    raise InvalidArgument(f"the prompt for sequence {s.seq_id} is empty")
                checks.tokens_in_vocab(p, self.cfg.vocab_size)
                checks.fits_context(s.seq_id, s.seq_len, len(p), self.svc.max_context)
                total += len(p)
            if total > self.svc.max_prefill_tokens:
                raise InvalidArgument(
                    f"a prefill of {total} tokens exceeds the budget of "
                    f"{self.svc.max_prefill_tokens}; send it in chunks"
                )
            prompts = [list(p) for p in prompts]

            def run(idx: list[int]) -> torch.Tensor:
                group = [states[i] for i in idx]
                toks = [prompts[i] for i in idx]
                segs = self._segments(group, [len(t) for t in toks], [s.seq_len for s in group])
                flat = torch.tensor([t for ts in toks for t in ts])
                hidden = self.model.forward(flat, segs, self.state, PREFILL)
                self._prime_drafter(group, toks, segs, hidden)
                return hidden[[sg.row + sg.count - 1 for sg in segs]]

            last_hidden = self._run(run, [[i] for i in range(len(states))])
            for s, p in zip(states, prompts, strict=True):
                s.tokens.extend(p)
            out = self._keep_logits(self.model.logits(last_hidden), row_masks)
            for i, smp in sampled.items():
                out[i] = draw(distribution(self.state.logits[i : i + 1], smp)[0], smp.uniforms[0])
            self._mirror(seqs, states)
            return out

    @traced("engine.verify")
    def decode_verify_batched(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        write_on_accept: bool = True,
        masks: dict[int, bytes] | None = None,
        sampling: dict[int, Sampling] | None = None,
    ) -> list[int]:
        with self._lock:
            states = self._check_verify(tokens, ks, seqs)
            check_sampling(sampling or {}, dict(enumerate(ks)), len(ks))
            row_masks = self._masks(masks or {}, sum(ks))
            tokens, ks = list(tokens), list(ks)
            starts = [0]
            for k in ks:
                starts.append(starts[-1] + k)

            def run(idx: list[int]) -> torch.Tensor:
                group = [states[i] for i in idx]
                counts = [ks[i] for i in idx]
                segs = self._segments(group, counts, [s.seq_len for s in group])
                flat = torch.tensor([t for i in idx for t in tokens[starts[i] : starts[i + 1]]])
                hidden = self.model.forward(flat, segs, self.state, VERIFY, not write_on_accept)
                return hidden[: sum(counts)]

            hidden = self._run(run, [[i] for i in range(len(states))])
            self.state.verify_hidden = hidden
            out = self._keep_logits(self.model.logits(hidden), row_masks)
            self._draws = self._row_draws(states, tokens, ks, sampling or {})
            self._verify_calls += 1
            for s, k, lo in zip(states, ks, starts, strict=False):
                s.tokens.extend(tokens[lo : lo + k])
                s.phase, s.pending_k = VERIFIED, k
                s.verify_call, s.verify_row = self._verify_calls, lo
                self.state.mtp_carry_valid[s.slot] = False
            self._mirror(seqs, states)
            return out

    def _check_verify(
        self, tokens: Sequence[int], ks: Sequence[int], seqs: Sequence[SequenceHandle]
    ) -> list[SeqState]:
        checks.same_length("decode_verify_batched", seqs=seqs, ks=ks)
        states = self._lookup("decode_verify_batched", seqs)
        if sum(ks) != len(tokens):
            raise InvalidArgument(f"ks sum to {sum(ks)} rows but {len(tokens)} tokens were given")
        if not self.can_batch_verify(ks):
            raise InvalidArgument(
                f"a verify of {len(ks)} sequences and {sum(ks)} rows exceeds "
                f"the budget of {self.svc.max_batch} sequences and "
                f"{self.svc.max_rows} rows"
            )
        checks.tokens_in_vocab(tokens, self.cfg.vocab_size)
        for s, k in zip(states, ks, strict=True):
            cap = self.svc.slot_verify_drafts[s.slot]
            checks.within(
                f"k of sequence {s.seq_id} (slot {s.slot} verifies up to {cap} drafts)",
                k,
                1,
                cap + 1,
            )
            checks.phase(s.seq_id, s.phase, IDLE, "verify")
            checks.fits_context(s.seq_id, s.seq_len, k, self.svc.max_context)
        return states

    def can_batch_verify(self, ks: Sequence[int]) -> bool:
        return 1 <= len(ks) <= self.svc.max_batch and sum(ks) <= self.svc.max_rows

    # -- verdict -------------------------------------------------------------------------

    @traced("fold")
    def gdn_fold_accepted(self, seqs: Sequence[SequenceHandle], fold_rows: Sequence[int]) -> None:
        with self._lock:
            checks.same_length("gdn_fold_accepted", seqs=seqs, fold_rows=fold_rows)
            states = self._lookup("gdn_fold_accepted", seqs)
            for s, a in zip(states, fold_rows, strict=True):
                checks.phase(s.seq_id, s.phase, VERIFIED, "fold")
                checks.within(
                    f"fold_rows of sequence {s.seq_id} (its last verify had {s.pending_k} rows)",
                    a,
                    1,
                    s.pending_k,
                )
            slots = [s.slot for s in states]
            picks = [
                self.state.verify_offset[s.slot] + a - 1
                for s, a in zip(states, fold_rows, strict=True)
            ]
            fold = triton_fold if self.model.triton else naive_fold
            fold(self.state.gdn, self.state.verify_gdn, slots, picks)
            fold(self.state.conv, self.state.verify_conv, slots, picks)
            for s, a in zip(states, fold_rows, strict=True):
                s.phase, s.folded_rows = FOLDED, a
            hook = self.forwards[self.forward_name]
            if hook is not None:
                hook(self.state, [s.slot for s in states])

    @traced("commit")
    def commit_accepted_prefix(
        self, seqs: Sequence[SequenceHandle], kept_rows: Sequence[int], ks: Sequence[int]
    ) -> list[int]:
        with self._lock:
            checks.same_length("commit_accepted_prefix", seqs=seqs, kept_rows=kept_rows, ks=ks)
            states = self._lookup("commit_accepted_prefix", seqs)
            for s, kept, k in zip(states, kept_rows, ks, strict=True):
                checks.phase(s.seq_id, s.phase, FOLDED, "commit")
                if k != s.pending_k:
                    raise InvalidArgument(
                        f"sequence {s.seq_id}'s last verify had {s.pending_k} rows, not {k}"
                    )
                if kept != s.folded_rows:
                    raise InvalidArgument(
                        f"sequence {s.seq_id} was folded at {s.folded_rows} "
                        f"rows; it cannot keep {kept}"
                    )
            for s, kept in zip(states, kept_rows, strict=True):
                del s.tokens[len(s.tokens) - (s.pending_k - kept) :]
                s.phase, s.pending_k = IDLE, 0
            self._mirror(seqs, states)
            return [s.seq_len for s in states]

    @traced("stash")
    def stash_verify_hidden_rows(self, rows: Sequence[int]) -> None:
        with self._lock:
            have = self.state.verify_hidden.shape[0]
            if have == 0:
                raise FailedPrecondition("no verify has run, so there is no hidden row to stash")
            checks.within("the number of stash rows", len(rows), 1, self.svc.max_batch)
            for r in rows:
                checks.within("a stash row", r, 0, have - 1)
            self.state.stash[: len(rows)] = self.state.verify_hidden[list(rows)]
            for i in range(len(rows)):
                self.state.stash_valid[i] = True

    # -- misc ----------------------------------------------------------------------------

    def add_forward(self, name: str, after_fold: Callable[[DeviceState, list[int]], None]) -> None:
        """A forward that runs as `eager` (or batched-serial when `name` ends in `-serial`)
        and then calls `after_fold(state, slots)` after each fold: how a test plants a fault
        the circuit diff must catch."""
        self.forwards[name] = after_fold

    def measure_costs(
        self, widths: Sequence[int], max_depth: int, repeats: int = 5, refresh: bool = False
    ) -> tuple[list[costs.CostEntry], bool]:
        """Verify and propose costs by width and depth (see gpu_service/costs.py), from the
        cache next to the model unless `refresh` or the cache falls short. -> (entries, cached)"""
        with self._lock:
            path = costs.cache_path(self.model_dir, self.forward_name, self.svc.verify_tiers)
            if not refresh:
                entries = costs.load(path, list(widths), max_depth)
                if entries is not None:
                    return entries, True
            entries = costs.measure(self, list(widths), max_depth, repeats)
            try:
                costs.save(path, entries)
            except OSError:
                pass  # a read-only model directory: measured, not cached
            return entries, False

    def _argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.model.triton:
            return triton_argmax(logits)
        return naive_argmax(logits)

    def set_forward(self, name: str) -> None:
        if name not in self.forwards:
            raise InvalidArgument(
                f"unknown forward {name!r}; this service has {', '.join(self.forwards)}"
            )
        with self._lock:
            self.forward_name = name
            self.model.triton = name.startswith("triton")

    def read_logits(self) -> Logits:
        with self._lock:
            t = self.state.logits.contiguous()
            data = t.view(torch.uint8).numpy().tobytes()
            return Logits(data, str(t.dtype).removeprefix("torch."), tuple(t.shape))

    def _masks(self, masks: dict[int, bytes], rows: int) -> dict[int, torch.Tensor]:
        """Allowed-token bitmasks as bool rows, checked: one per row at most, the right size,
        at least one token allowed."""
        words = -(-self.cfg.vocab_size // 32)
        out = {}
        for row, bits in masks.items():
            if not bits:
                continue
            checks.within("a masked row", row, 0, rows - 1)
            # Grammar engines may round up to whole words past the vocabulary; ignored.
            if len(bits) < 4 * words or len(bits) % 4:
                raise InvalidArgument(
                    f"the mask of row {row} has {len(bits)} bytes; a vocabulary of "
                    f"{self.cfg.vocab_size} takes {4 * words} or more, whole 32-bit words"
                )
            allowed = torch.from_numpy(
                np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")
            )[: self.cfg.vocab_size].bool()
            if not allowed.any():
                raise InvalidArgument(f"the mask of row {row} allows no token")
            out[row] = allowed
        return out

    def _keep_logits(self, logits: torch.Tensor, masks: dict[int, torch.Tensor]) -> list[int]:
        """Keep a prefill's or verify's logits (masked rows with -inf outside their mask) and
        each row's argmax log-probability."""
        for row, allowed in masks.items():
            logits[row] = logits[row].masked_fill(~allowed.to(logits.device), float("-inf"))
        self.state.logits = logits
        top, conf = self._argmax(logits)
        self._logprobs = torch.log(conf).tolist()
        return top.tolist()

    def _row_draws(
        self,
        states: list[SeqState],
        tokens: list[int],
        ks: list[int],
        sampling: dict[int, Sampling],
    ) -> list[RowDraws | None]:
        """Rejection-sampling draws for every row of the sampling sequences; the draft
        distributions they used are spent."""
        draws: list[RowDraws | None] = [None] * sum(ks)
        off = 0
        for i, (s, k) in enumerate(zip(states, ks, strict=True)):
            smp = sampling.get(i)
            if smp is not None:
                p = distribution(self.state.logits[off : off + k], smp)
                q = s.draft_probs
                for j in range(k):
                    last = j == k - 1
                    qj = q[j] if q is not None and not last and j < len(q) else None
                    nxt = None if last else tokens[off + j + 1]
                    draws[off + j] = row_draws(p[j], qj, nxt, smp.uniforms[j])
            s.draft_probs = None
            off += k
        return draws

    def last_draws(self) -> list[RowDraws | None]:
        return list(self._draws)

    def last_logprobs(self) -> list[float]:
        return list(self._logprobs)

    def _mirror(self, handles: Sequence[SequenceHandle], states: list[SeqState]) -> None:
        for h, s in zip(handles, states, strict=True):
            h.seq_len = s.seq_len
