"""The verifier: prefill, batched verify, fold, commit and stash over the target model. Each
operation checks everything before it touches state, runs one batched forward, and brings
its results to the host in one transfer."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from gpu_service.engine import images as vision
from gpu_service.engine.choice import Choice
from gpu_service.engine.logits import distribution, grammar_masks, log_softmax_top, process_rows
from gpu_service.engine.sampling import check_sampling, draw, row_draws
from gpu_service.memory.sequence import FOLDED, IDLE, VERIFIED, SeqState
from gpu_service.memory.slots import SlotTable, mirror
from gpu_service.model.backend import download, ints, upload
from gpu_service.model.batch import Segment
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.hybrid import PREFILL, VERIFY, HybridModel
from gpu_service.model.state import DeviceState
from protos import checks
from protos.handles import MAX_TOP, ImageInput, RowDraws, ScoreAsk, Scores
from protos.model import (
    FailedPrecondition,
    InvalidArgument,
    Prefilled,
    Sampling,
    SequenceHandle,
    Verified,
    batch_fits,
)
from protos.telemetry import traced

# Prompt rows scored at a time: their logits [rows, vocab] and fp32 log-softmax are what
# scoring holds beside the prefill (`memory.plan` counts them).
SCORE_ROWS = 64

# (sequences, their prompt chunks, their segments, the hidden rows) -> None
Prime = Callable[[list[SeqState], list[list[int]], list[Segment], torch.Tensor], None]


def segments(seqs: list[SeqState], counts: list[int], starts: list[int]) -> list[Segment]:
    segs, row = [], 0
    for s, n, start in zip(seqs, counts, starts, strict=True):
        segs.append(Segment(s.slot, start, n, row))
        row += n
    return segs


class Verifier:
    def __init__(
        self,
        cfg: ModelConfig,
        svc: ServiceConfig,
        model: HybridModel,
        state: DeviceState,
        slots: SlotTable,
        choice: Choice,
        prime: Prime,
    ) -> None:
        self.cfg, self.svc, self.model, self.state = cfg, svc, model, state
        self.slots, self.choice, self.prime = slots, choice, prime
        self.verify_calls = 0

    # -- forward -------------------------------------------------------------------------

    def run(self, fn: Callable[[list[int]], torch.Tensor], n: int) -> torch.Tensor:
        """fn(indices) -> hidden rows of those sequences; `*-serial` calls it one at a time."""
        if self.choice.serial:
            # Copied out: a replayed graph's rows are a view its next replay overwrites.
            return torch.cat([fn([i]).clone() for i in range(n)])
        return fn(list(range(n)))

    def _forward(
        self,
        states: list[SeqState],
        rows: list[list[int]],
        mode: str,
        write_live: bool = True,
        placed: list[vision.Placed] | None = None,
    ) -> torch.Tensor:
        """Every sequence's rows through the target -> their final hiddens [R, H]. `placed`:
        a prefill's images placed in each sequence's chunk (`engine/images.py`)."""

        graphs = self.choice.replayed() if mode == VERIFY else None
        self.slots.cover(states, [s.seq_len + len(r) for s, r in zip(states, rows, strict=True)])

        def fn(idx: list[int]) -> torch.Tensor:
            group, toks = [states[i] for i in idx], [rows[i] for i in idx]
            segs = segments(group, [len(t) for t in toks], [s.seq_len for s in group])
            flat = [t for ts in toks for t in ts]
            if graphs is not None and (out := graphs.verify(segs, flat, write_live)) is not None:
                return out
            tokens = torch.tensor(flat, device=self.model.device)
            extra = None
            if placed is not None:
                extra = vision.image_rows(self.model, [placed[i] for i in idx], segs)
            hidden = self.model.forward(tokens, segs, self.state, mode, write_live, extra)
            if mode == PREFILL:
                self.prime(group, toks, segs, hidden)
            return hidden[: len(flat)]

        return self.run(fn, len(states))

    # -- prefill -------------------------------------------------------------------------

    @traced("engine.prefill")
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
        checks.same_length("prefill", seqs=seqs, prompts=prompts)
        sent = [list(i) for i in images or [()] * len(prompts)]
        checks.same_length("prefill", prompts=prompts, images=sent)
        sampled = {i: s for i, s in enumerate(sampling or ()) if s is not None}
        check_sampling(sampled, {i: 1 for i in sampled}, len(prompts))
        row_masks = self.masks(dict(enumerate(masks or ())), len(prompts))
        states = self.slots.lookup("prefill", seqs)
        self._check_prefill(states, prompts)
        asks = self._check_scores(scores, len(prompts))
        tops = check_top("prefill", top, len(prompts))
        rows = [list(p) for p in prompts]
        placed = self._place(states, rows, sent)
        hidden = self._forward(states, rows, PREFILL, placed=placed)
        scored = self._score(hidden, rows, asks) if asks else []
        (ends,) = upload(hidden.device, [e - 1 for e in itertools.accumulate(map(len, rows))])
        for s, p in zip(states, rows, strict=True):
            s.tokens.extend(p)
        if placed is not None:
            vision.settle(self.state, states, placed)
        logits = self.model.logits(hidden[ends])
        before = [s.seq_len - 1 for s in states]
        last = [s.tokens[-1:] for s in states]
        process_rows(logits, self.model.vocab, states, before, last, range(len(states)), row_masks)
        out, logprobs = self.keep_logits(logits)
        ids, values = self._last_rows(out, logprobs, sampled, tops)
        mirror(seqs, states)
        return Prefilled(out, logprobs, scored, ids, values)

    def _place(
        self, states: list[SeqState], rows: list[list[int]], sent: list[list[ImageInput]]
    ) -> list[vision.Placed] | None:
        """Each chunk's images placed and the new ones embedded, the sequences' images then
        theirs (the drafter's priming reads them); None for a model without a tower."""
        vision.check_images(self.model, self.svc, states, sent)
        v = self.cfg.vision
        if v is None:
            return None
        placed = [vision.place(v, s, r, i) for s, r, i in zip(states, rows, sent, strict=True)]
        vision.embed_new(self.model, placed, sent)
        for s, p in zip(states, placed, strict=True):
            s.images = tuple(p.spans)
        return placed

    def _last_rows(
        self, out: list[int], logprobs: list[float], sampled: dict[int, Sampling], tops: list[int]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The sampling prompts' draws and their log-probabilities, into `out` and `logprobs`
        (a greedy prompt's are its argmax's already) -> each prompt's asked alternatives."""
        rows = [i for i in range(len(out)) if i in sampled or tops[i]]
        ids: list[list[int]] = [[] for _ in out]
        values: list[list[float]] = [[] for _ in out]
        if not rows:
            return ids, values
        (index,) = upload(self.model.device, rows)
        full = self.model.full_logits(self.state.logits[index])
        for n, i in enumerate(rows):
            if i in sampled:
                smp = sampled[i]
                out[i] = draw(distribution(full[n : n + 1], smp)[0], smp.uniforms[0])
        top = max(tops[i] for i in rows)
        _, chosen, top_values, top_ids = log_softmax_top(full, [out[i] for i in rows], top)
        host_chosen, host_ids, host_values = download(chosen, top_ids.float(), top_values)
        for n, i in enumerate(rows):
            if i in sampled:
                logprobs[i] = host_chosen[n]
            ids[i] = ints(host_ids[n * top : n * top + tops[i]])
            values[i] = host_values[n * top : n * top + tops[i]]
        return ids, values

    def _check_scores(
        self, scores: Sequence[ScoreAsk | None] | None, n: int
    ) -> dict[int, ScoreAsk]:
        asks = {i: a for i, a in enumerate(scores or ()) if a is not None}
        if scores is not None and len(scores) != n:
            raise InvalidArgument(f"prefill got {len(scores)} score asks for {n} prompts")
        for a in asks.values():
            if not 0 <= a.top <= MAX_TOP:
                raise InvalidArgument(f"a score's top is {a.top}; it must be from 0 to {MAX_TOP}")
            if a.next_token is not None:
                checks.tokens_in_vocab([a.next_token], self.cfg.vocab_size)
        return asks

    def _score(
        self, hidden: torch.Tensor, rows: list[list[int]], asks: dict[int, ScoreAsk]
    ) -> list[Scores | None]:
        """Each asked prompt's rows scored: the model's raw log-softmax (fp32) of the token
        after each row, its rank, and each row's top alternatives; `SCORE_ROWS` rows at a
        time, so that a long prompt's scores cost a tile's logits, not the prompt's."""
        starts = list(itertools.accumulate(map(len, rows), initial=0))
        out: list[Scores | None] = [None] * len(rows)
        for i, ask in asks.items():
            after = rows[i][1:] + ([] if ask.next_token is None else [ask.next_token])
            got = Scores([], [], [], [])
            for a in range(0, len(rows[i]), SCORE_ROWS):
                b = min(a + SCORE_ROWS, len(rows[i]))
                tile = hidden[starts[i] + a : starts[i] + b]
                self._score_tile(tile, after[a:b], ask.top, got)
            out[i] = got
        return out

    def _score_tile(self, hidden: torch.Tensor, after: list[int], top: int, into: Scores) -> None:
        logits = self.model.full_logits(self.model.logits(hidden))
        logp, chosen, top_values, top_ids = log_softmax_top(logits, after, top)
        ranks = (logp[: len(after)] > chosen[:, None]).sum(-1) + 1
        host_chosen, host_ranks, ids, values = download(
            chosen, ranks.float(), top_ids.float(), top_values
        )
        into.logprobs.extend(host_chosen)
        into.ranks.extend(ints(host_ranks))
        into.top_ids.extend(ints(ids[j * top : (j + 1) * top]) for j in range(len(hidden)))
        into.top_logprobs.extend(values[j * top : (j + 1) * top] for j in range(len(hidden)))

    def _check_prefill(self, states: list[SeqState], prompts: Sequence[Sequence[int]]) -> None:
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

    # -- verify --------------------------------------------------------------------------

    @traced("engine.verify")
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
        states = self.check_verify(tokens, ks, seqs)
        check_sampling(sampling or {}, dict(enumerate(ks)), len(ks))
        tops = check_top("decode_verify_batched", top, len(ks))
        row_masks = self.masks(masks or {}, sum(ks))
        tokens, ks = list(tokens), list(ks)
        logits = self.verify_logits(states, tokens, ks, write_on_accept, row_masks)
        argmax, logprob = self.model.argmax_logprob(logits)
        host_argmax, logprobs = download(argmax, logprob)
        scored = self._row_scores(states, tokens, ks, sampling or {}, tops)
        mirror(seqs, states)
        return Verified(ints(host_argmax), logprobs, *scored)

    def verify_logits(
        self,
        states: list[SeqState],
        tokens: list[int],
        ks: list[int],
        write_on_accept: bool = True,
        row_masks: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The verify forward and its bookkeeping, results left on the device -> the
        processed logits [R, V] (`process_rows`), also kept in the buffer."""
        starts = list(itertools.accumulate(ks, initial=0))
        rows = [tokens[a:b] for a, b in zip(starts, starts[1:], strict=False)]
        hidden = self._forward(states, rows, VERIFY, not write_on_accept)
        self.state.verify_hidden = hidden
        logits = self.model.logits(hidden)
        before = [s.seq_len for s in states]
        process_rows(logits, self.model.vocab, states, before, rows, starts, row_masks or {})
        self.state.logits = logits
        self.verify_calls += 1
        for s, k, lo in zip(states, ks, starts, strict=False):
            s.tokens.extend(tokens[lo : lo + k])
            s.phase, s.pending_k = VERIFIED, k
            s.verify_call, s.verify_row = self.verify_calls, lo
            self.state.mtp_carry_valid[s.slot] = False
        return logits

    def check_verify(
        self, tokens: Sequence[int], ks: Sequence[int], seqs: Sequence[SequenceHandle]
    ) -> list[SeqState]:
        checks.same_length("decode_verify_batched", seqs=seqs, ks=ks)
        states = self.slots.lookup("decode_verify_batched", seqs)
        if sum(ks) != len(tokens):
            raise InvalidArgument(f"ks sum to {sum(ks)} rows but {len(tokens)} tokens were given")
        if not batch_fits(ks, self.svc.max_batch, self.svc.max_rows):
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
            vision.check_not_mid_image(s, "a verify")
        return states

    # -- verdict -------------------------------------------------------------------------

    @traced("fold")
    def gdn_fold_accepted(self, seqs: Sequence[SequenceHandle], fold_rows: Sequence[int]) -> None:
        checks.same_length("gdn_fold_accepted", seqs=seqs, fold_rows=fold_rows)
        states = self.slots.lookup("gdn_fold_accepted", seqs)
        for s, a in zip(states, fold_rows, strict=True):
            checks.phase(s.seq_id, s.phase, VERIFIED, "fold")
            checks.within(f"fold_rows ({last_verify(s)})", a, 1, s.pending_k)
        slots, kept = upload(self.model.device, [s.slot for s in states], fold_rows)
        self.fold(states, slots, kept - 1)
        for s, a in zip(states, fold_rows, strict=True):
            s.folded_rows = a

    def fold(self, states: list[SeqState], slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """Each slot's state after its last accepted row becomes live. slots, accepted: [B]
        on the device (accepted: rows past the first)."""
        picks = self.state.verify_offset_t[slots] + accepted
        self.choice.ops.fold(self.state.gdn, self.state.verify_gdn, slots, picks)
        self.choice.ops.fold(self.state.conv, self.state.verify_conv, slots, picks)
        for s in states:
            s.phase = FOLDED
        if self.choice.after_fold is not None:
            self.choice.after_fold(self.state, [s.slot for s in states])

    @traced("commit")
    def commit_accepted_prefix(
        self, seqs: Sequence[SequenceHandle], kept_rows: Sequence[int], ks: Sequence[int]
    ) -> list[int]:
        checks.same_length("commit_accepted_prefix", seqs=seqs, kept_rows=kept_rows, ks=ks)
        states = self.slots.lookup("commit_accepted_prefix", seqs)
        for s, kept, k in zip(states, kept_rows, ks, strict=True):
            checks.phase(s.seq_id, s.phase, FOLDED, "commit")
            check_pending(s, k)
            if kept != s.folded_rows:
                raise InvalidArgument(
                    f"sequence {s.seq_id} was folded at {s.folded_rows} rows; it cannot keep {kept}"
                )
        self.commit(states, kept_rows)
        mirror(seqs, states)
        return [s.seq_len for s in states]

    def commit(self, states: list[SeqState], kept_rows: Sequence[int]) -> None:
        for s, kept in zip(states, kept_rows, strict=True):
            del s.tokens[len(s.tokens) - (s.pending_k - kept) :]
            s.phase, s.pending_k = IDLE, 0
        self.slots.shrink(states)

    @traced("stash")
    def stash_verify_hidden_rows(self, rows: Sequence[int]) -> None:
        have = self.state.verify_hidden.shape[0]
        if have == 0:
            raise FailedPrecondition("no verify has run, so there is no hidden row to stash")
        checks.within("the number of stash rows", len(rows), 1, self.svc.max_batch)
        for r in rows:
            checks.within("a stash row", r, 0, have - 1)
        (index,) = upload(self.model.device, rows)
        self.stash(index)

    def stash(self, rows: torch.Tensor) -> None:
        """Stash slot i takes the final hidden of verify row rows[i]. rows: [n] on the device"""
        n = rows.shape[0]
        self.state.stash[:n] = self.state.verify_hidden[rows]
        for i in range(n):
            self.state.stash_valid[i] = True

    # -- masks and sampling ----------------------------------------------------------------

    def masks(self, masks: dict[int, bytes], rows: int) -> dict[int, torch.Tensor]:
        """`grammar_masks`, each over the columns this rank holds."""
        full = grammar_masks(masks, rows, self.cfg.vocab_size)
        return {row: self.model.held_columns(allowed) for row, allowed in full.items()}

    def keep_logits(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Keep a prefill's processed logits -> each row's argmax and its log-probability."""
        self.state.logits = logits
        top, logprob = self.model.argmax_logprob(logits)
        host_top, logprobs = download(top, logprob)
        return ints(host_top), logprobs

    def _row_scores(
        self,
        states: list[SeqState],
        tokens: list[int],
        ks: list[int],
        sampling: dict[int, Sampling],
        tops: list[int],
    ) -> tuple[list[RowDraws | None], list[float], list[list[int]], list[list[float]]]:
        """The rows of the sequences that sample or ask alternatives, scored from one
        log-softmax of their logits, and rejection-sampling draws for the sampling ones (the
        draft distributions those used are spent) -> `Verified`'s draws, next_logprobs,
        top_ids and top_logprobs."""
        n = len(tokens)
        draws: list[RowDraws | None] = [None] * n
        nxt = [0.0] * n
        ids: list[list[int]] = [[] for _ in range(n)]
        values: list[list[float]] = [[] for _ in range(n)]
        spans = list(itertools.pairwise(itertools.accumulate(ks, initial=0)))
        asked = [i for i in range(len(ks)) if i in sampling or tops[i]]
        if asked:
            rows = [r for i in asked for r in range(*spans[i])]
            (index,) = upload(self.model.device, rows)
            full = self.model.full_logits(self.state.logits[index])
            # A sequence's last row has no next row: it reads another's token, then 0.
            after = [tokens[min(r + 1, n - 1)] for r in rows]
            top = max(tops[i] for i in asked)
            logp, chosen, top_values, top_ids = log_softmax_top(full, after, top)
            at = 0
            for i in asked:
                a, b = spans[i]
                if i in sampling:
                    mine = slice(at, at + b - a)
                    draws[a:b] = self._row_draws(
                        states[i], tokens[a:b], sampling[i], full[mine], logp[mine]
                    )
                at += b - a
            host_chosen, host_ids, host_values = download(chosen, top_ids.float(), top_values)
            at = 0
            for i in asked:
                a, b = spans[i]
                for r in range(a, b):
                    nxt[r] = host_chosen[at] if r + 1 < b else 0.0
                    ids[r] = ints(host_ids[at * top : at * top + tops[i]])
                    values[r] = host_values[at * top : at * top + tops[i]]
                    at += 1
        for s in states:
            s.draft_probs = None
        return draws, nxt, ids, values

    def _row_draws(
        self,
        s: SeqState,
        tokens: list[int],
        smp: Sampling,
        logits: torch.Tensor,
        logp: torch.Tensor,
    ) -> list[RowDraws | None]:
        """Rejection-sampling draws for every row of a sampling sequence. tokens: its k rows;
        logits, logp: [k, V], every column."""
        p = distribution(logits, smp)
        q = s.draft_probs
        k = len(tokens)
        out: list[RowDraws | None] = []
        for j in range(k):
            last = j == k - 1
            qj = q[j] if q is not None and not last and j < len(q) else None
            nxt = None if last else tokens[j + 1]
            out.append(row_draws(p[j], qj, nxt, smp.uniforms[j], logp[j]))
        return out


def check_top(operation: str, top: Sequence[int] | None, n: int) -> list[int]:
    """Alternatives asked per sequence, checked: one count each, 0 to `MAX_TOP`."""
    if top is None or len(top) == 0:
        return [0] * n
    if len(top) != n:
        raise InvalidArgument(f"{operation} got {len(top)} alternative counts for {n} sequences")
    for t in top:
        if not 0 <= t <= MAX_TOP:
            raise InvalidArgument(
                f"a sequence asked {t} alternatives; at most {MAX_TOP} are listed"
            )
    return list(top)


def last_verify(s: SeqState) -> str:
    return f"sequence {s.seq_id}'s last verify had {s.pending_k} rows"


def check_pending(s: SeqState, k: int) -> None:
    if k != s.pending_k:
        raise InvalidArgument(f"{last_verify(s)}, not {k}")
