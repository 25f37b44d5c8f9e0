"""A `ServingModel` (protos/model.py) whose outputs the test chooses: the target's greedy
next token and the drafter's chain are functions of the history. It records every call, so a
test can see which path a step took. Its step stream runs the engine's plan rules (`run_plan`)
over its `decode_step`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from control_plane.text.tokenizer import TOKENIZER_FILE, ByteTokenizer
from gpu_service.engine.plans import PlanClock, plan_steps, run_plan
from protos.handles import Scores
from protos.model import (
    DFLASH,
    MTP_HEAD,
    Capabilities,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Penalties,
    Prefilled,
    Proposal,
    ResourceExhausted,
    SequenceHandle,
    StepResult,
    Verified,
    greedy_accepted,
    room_for_block,
    room_to_propose,
)
from protos.steps import PlanResult, StepPlan, StepStream

BYTE_FILES = {TOKENIZER_FILE: ByteTokenizer.default().to_json().encode()}
Oracle = Callable[[tuple[int, ...]], int]
Drafter = Callable[[tuple[int, ...], int], list[int]]  # (history incl. last, nd) -> drafts


def counting_oracle(history: tuple[int, ...]) -> int:
    """The next token is the last one plus one (mod 256)."""
    return (history[-1] + 1) % 256


def perfect_drafter(oracle: Oracle) -> Drafter:
    def draft(history: tuple[int, ...], nd: int) -> list[int]:
        out, h = [], history
        for _ in range(nd):
            out.append(oracle(h))
            h = (*h, out[-1])
        return out

    return draft


def _alternatives(token: int, n: int) -> tuple[list[int], list[float]]:
    """A row's `n` most probable tokens as the fake ranks them: its argmax (at -0.5, as every
    argmax's log-probability here), then the ids after it, each one less probable."""
    return [(token + j) % 256 for j in range(n)], [-0.5 - j for j in range(n)]


def _masked(token: int, bits: bytes) -> int:
    """The oracle's token, or the first allowed one when a mask forbids it."""
    if not bits:
        return token
    allowed = [t for t in range(len(bits) * 8) if bits[t // 8] >> (t % 8) & 1]
    return token if token in allowed else allowed[0]


def _scores(prompts, asks) -> list[Scores | None]:
    """A row's score in the fake: every token -1, ids from 0 its alternatives."""
    out: list[Scores | None] = []
    for p, ask in zip(prompts, asks or [None] * len(prompts), strict=True):
        if ask is None:
            out.append(None)
            continue
        after = len(p) - 1 + (ask.next_token is not None)
        top = [list(range(ask.top)) for _ in p]
        out.append(Scores([-1.0] * after, top, [[-1.0] * ask.top for _ in p], [1] * after))
    return out if any(out) else []


def _check_masks(masks: dict[int, bytes]) -> None:
    """The service's check, made before any of a call runs."""
    for row, bits in masks.items():
        if bits and not any(bits):
            raise InvalidArgument(f"the mask of row {row} allows no token")


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)
    pending: int = 0
    folded: int = 0
    row: int = 0  # first row in the last verify
    continuation: list[int] | None = None  # as the engine's `SeqState.continuation`
    drafter: str = MTP_HEAD


class FakeModel:
    def __init__(
        self,
        caps: Sequence[int] = (3, 3, 3, 3, 2, 2, 1, 1),
        max_rows: int = 64,
        max_batch: int = 8,
        max_context: int = 512,
        oracle: Oracle = counting_oracle,
        drafter: Drafter | None = None,
        files: dict[str, bytes] | None = None,
        name: str = "fake",
        digest: str = "fake",
        dflash_block: int = 0,
    ) -> None:
        self.caps, self.max_rows, self.max_batch = tuple(caps), max_rows, max_batch
        # The checkpoint's tokenizer files: the byte tokenizer unless the test chooses.
        self.files = BYTE_FILES if files is None else files
        self.name, self.digest = name, digest
        self.max_context = max_context
        self.dflash_block = dflash_block  # a DFlash drafter's block; its drafts are `drafter`'s
        self.oracle = oracle
        self.drafter = drafter or perfect_drafter(oracle)
        self.seqs: dict[int, _Seq] = {}
        self.slots: dict[int, int] = {}
        self.next_id = 1
        self.snapshots: dict[int, list[int]] = {}  # snapshot id -> the tokens it holds
        self.calls: list[tuple] = []  # (name, details)
        # Each prefill item that sent images: (sequence id, its length before the chunk, the
        # images' digests).
        self.images: list[tuple[int, int, list[bytes]]] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(
            model_name=self.name,
            vocab_size=320,
            num_slots=len(self.caps),
            free_slots=len(self.caps) - len(self.slots),
            slot_verify_drafts=self.caps,
            max_rows=self.max_rows,
            forwards=("eager",),
            current_forward="eager",
            device="cpu",
            max_context=self.max_context,
            dtype="float32",
            hidden_size=8,
            eos_token_ids=(257,),
            has_mtp=True,
            max_batch=self.max_batch,
            max_prefill_tokens=4096,
            model_digest=self.digest,
            dflash_block=self.dflash_block,
        )

    def tokenizer_files(self) -> dict[str, bytes]:
        self.calls.append(("tokenizer_files",))
        return dict(self.files)

    def alloc_sequence(
        self, penalties: Penalties | None = None, drafter: str = MTP_HEAD
    ) -> SequenceHandle:
        if penalties is not None:
            raise InvalidArgument("the fake model applies no penalties")
        if drafter == DFLASH and not self.dflash_block:
            raise FailedPrecondition("this service has no DFlash drafter")
        free = set(range(len(self.caps))) - set(self.slots.values())
        if not free:
            raise ResourceExhausted(f"all {len(self.caps)} slots are taken")
        h = SequenceHandle(self.next_id, min(free))
        self.next_id += 1
        self.seqs[h.seq_id], self.slots[h.seq_id] = _Seq(drafter=drafter), h.slot
        return h

    def free_sequence(self, seq: SequenceHandle) -> None:
        if seq.seq_id not in self.seqs:
            raise NotFound(f"sequence {seq.seq_id} is not allocated")
        del self.seqs[seq.seq_id], self.slots[seq.seq_id]

    def _moved(self, seqs: Sequence[SequenceHandle]) -> None:
        """A call names these sequences: each must be allocated, and what its last step left
        to continue from is gone."""
        for h in seqs:
            if h.seq_id not in self.seqs:
                raise NotFound(f"sequence {h.seq_id} is not allocated")
        for h in seqs:
            self.seqs[h.seq_id].continuation = None

    def prefill(
        self, seqs, prompts, masks=None, sampling=None, scores=None, top=None, images=None
    ) -> list[int]:
        self.calls.append(("prefill", [len(p) for p in prompts]))
        self._moved(seqs)
        for h, sent in zip(seqs, images or [()] * len(seqs), strict=True):
            if sent:
                self.images.append((h.seq_id, h.seq_len, [i.digest for i in sent]))
        _check_masks(dict(enumerate(masks or ())))
        out = []
        for h, p in zip(seqs, prompts, strict=True):
            s = self.seqs[h.seq_id]
            s.tokens.extend(p)
            h.seq_len = len(s.tokens)
            out.append(
                _masked(self.oracle(tuple(s.tokens)), (masks or [b""] * len(seqs))[len(out)])
            )
        tops = [_alternatives(t, n) for t, n in zip(out, top or [0] * len(out), strict=True)]
        ids, values = [list(i) for i, _ in tops], [list(v) for _, v in tops]
        return Prefilled(out, [-0.5] * len(out), _scores(prompts, scores), ids, values)

    def decode_verify_batched(
        self, tokens, ks, seqs, write_on_accept=True, masks=None, sampling=None, top=None
    ) -> Verified:
        self.calls.append(("verify", list(ks), [h.slot for h in seqs]))
        self._moved(seqs)
        _check_masks(masks or {})
        out, lo = [], 0
        for h, k in zip(seqs, ks, strict=True):
            s = self.seqs[h.seq_id]
            assert s.pending == 0, "verify with a verify pending"
            assert 1 <= k <= self.caps[h.slot] + 1, f"k={k} over slot {h.slot}'s capacity"
            for t in tokens[lo : lo + k]:
                s.tokens.append(t)
                bits = (masks or {}).get(len(out), b"")
                out.append(_masked(self.oracle(tuple(s.tokens)), bits))
            s.pending, s.row, lo = k, lo, lo + k
            h.seq_len = len(s.tokens)
        counts = [n for k, n in zip(ks, top or [0] * len(ks), strict=True) for _ in range(k)]
        tops = [_alternatives(t, n) for t, n in zip(out, counts, strict=True)]
        # The next row's token: the argmax's -0.5 when it is the argmax, else -3; 0 on a
        # sequence's last row.
        last = {sum(ks[: i + 1]) - 1 for i in range(len(ks))}
        nxt = [
            0.0 if r in last else -0.5 if tokens[r + 1] == a else -3.0 for r, a in enumerate(out)
        ]
        ids, values = [list(i) for i, _ in tops], [list(v) for _, v in tops]
        return Verified(out, [-0.5] * len(out), [None] * len(out), nxt, ids, values)

    # The verdict's single steps, which `settle_verdict` runs in order: not operations of the
    # serving contract, so private, but logged by name as the engine's spans name them.

    def _fold(self, seqs, fold_rows) -> None:
        self.calls.append(("fold", list(fold_rows)))
        self._moved(seqs)
        for h, a in zip(seqs, fold_rows, strict=True):
            s = self.seqs[h.seq_id]
            if not 1 <= a <= s.pending:
                raise FailedPrecondition("bad fold")
            s.folded = a

    def _commit(self, seqs, kept_rows, ks) -> list[int]:
        self.calls.append(("commit", list(kept_rows)))
        self._moved(seqs)
        for h, kept, k in zip(seqs, kept_rows, ks, strict=True):
            s = self.seqs[h.seq_id]
            assert s.pending == k and s.folded == kept
            del s.tokens[len(s.tokens) - (k - kept) :]
            s.pending = s.folded = 0
            h.seq_len = len(s.tokens)
        return [h.seq_len for h in seqs]

    def _stash(self, rows) -> None:
        self.calls.append(("stash", list(rows)))

    def _propose(self, last, num_drafts, seqs) -> Proposal:
        self.calls.append(("propose", len(seqs), num_drafts))
        self._moved(seqs)
        drafts = [
            self.drafter((*self.seqs[h.seq_id].tokens, t), num_drafts)
            for h, t in zip(seqs, last, strict=True)
        ]
        return Proposal(drafts, [[0.9] * num_drafts for _ in seqs])

    def _trim(self, seqs) -> None:
        self.calls.append(("trim", len(seqs)))
        self._moved(seqs)

    def _drafters(self, seqs, names) -> list[str]:
        """Each sequence's drafter for a call, refused as the service refuses a name."""
        out = []
        for h, name in zip(seqs, list(names) or [""] * len(seqs), strict=True):
            name = name or self.seqs[h.seq_id].drafter
            if name not in (MTP_HEAD, DFLASH):
                raise InvalidArgument(f"drafter {name!r} is unknown")
            if name == DFLASH and not self.dflash_block:
                raise FailedPrecondition("this service has no DFlash drafter")
            out.append(name)
        return out

    def _room(self, drafter: str, seq_len: int, num_drafts: int) -> bool:
        if drafter == DFLASH:
            return room_for_block(seq_len, self.dflash_block, self.max_context)
        return room_to_propose(seq_len, num_drafts, self.max_context)

    def settle_verdict(
        self, seqs, kept_rows, ks, proposers, last, num_drafts, sampling=None, drafters=()
    ) -> Proposal:
        chosen = self._drafters([seqs[p] for p in proposers], drafters)
        if DFLASH in chosen and num_drafts > self.dflash_block - 1:
            raise InvalidArgument(f"a DFlash block gives at most {self.dflash_block - 1}")
        if proposers:
            self._stash([self.seqs[seqs[p].seq_id].row + kept_rows[p] - 1 for p in proposers])
        self._fold(seqs, kept_rows)
        self._commit(seqs, kept_rows, ks)
        if not proposers:
            return Proposal([], [])
        chosen = [seqs[p] for p in proposers]
        proposal = self._propose(last, num_drafts, chosen)
        self._trim(chosen)
        return proposal

    def decode_step(
        self, tokens, ks, seqs, want_drafts, num_drafts, drafters=(), masks=None
    ) -> StepResult:
        """The engine's greedy step, made of this fake's own calls so a test sees the same
        verify, stash, fold, commit, propose and trim either way; `step` marks the one call."""
        self.calls.append(("step", list(ks), [h.slot for h in seqs]))
        for h in seqs:
            if h.seq_id not in self.seqs:
                raise NotFound(f"sequence {h.seq_id} is not allocated")
        chosen = self._drafters(seqs, drafters)
        wanted = [d for d, w in zip(chosen, want_drafts, strict=True) if w]
        if DFLASH in wanted and num_drafts > self.dflash_block - 1:
            raise InvalidArgument(f"a DFlash block gives at most {self.dflash_block - 1}")
        before = [h.seq_len for h in seqs]
        verified = self.decode_verify_batched(tokens, ks, seqs, masks=masks)
        argmax = verified.argmax
        accepted, lo = [], 0
        for k in ks:
            accepted.append(greedy_accepted(tokens[lo : lo + k], argmax[lo : lo + k]))
            lo += k
        kept = [n + 1 for n in accepted]
        proposers = [
            i
            for i, want in enumerate(want_drafts)
            if want and self._room(chosen[i], before[i] + kept[i], num_drafts)
        ]
        last = [argmax[sum(ks[:i]) + accepted[i]] for i in proposers]
        proposal = self.settle_verdict(
            seqs, kept, ks, proposers, last, num_drafts, drafters=[chosen[i] for i in proposers]
        )
        drafts = dict(zip(proposers, proposal.drafts, strict=True))
        for i, h in enumerate(seqs):  # what a plan continuing it verifies: bonus, then drafts
            bonus = argmax[sum(ks[:i]) + accepted[i]]
            self.seqs[h.seq_id].continuation = [bonus, *drafts.get(i, [])]
        return StepResult(argmax, verified.logprobs, accepted, proposers, proposal)

    def open_steps(self) -> StepStream:
        """Each plan runs as it is sent, on the sender's thread, so a test's call log keeps
        one order: the order the service would run them in. The fake never waits for a
        plan (`waited_s` 0)."""
        return _InlineSteps(lambda plan: run_plan(plan, self._continuation, self.decode_step))

    def _continuation(self, h: SequenceHandle) -> list[int] | None:
        s = self.seqs.get(h.seq_id)
        if s is None:
            raise NotFound(f"sequence {h.seq_id} is not allocated")
        return None if s.continuation is None else list(s.continuation)

    def snapshot_prefixes(self, seqs) -> list[int]:
        """A snapshot is the sequence's tokens (the fake serves no prefix cache by its
        capabilities, but a test may take one)."""
        self.calls.append(("snapshot", len(seqs)))
        self._moved(seqs)
        ids = []
        for h in seqs:
            self.snapshots[self.next_id] = list(self.seqs[h.seq_id].tokens)
            ids.append(self.next_id)
            self.next_id += 1
        return ids

    def restore_prefixes(self, seqs, snapshots) -> None:
        self.calls.append(("restore", len(seqs)))
        self._moved(seqs)
        for h, snap in zip(seqs, snapshots, strict=True):
            if snap not in self.snapshots:
                raise NotFound(f"snapshot {snap} is unknown or dropped")
            if self.seqs[h.seq_id].tokens:
                raise FailedPrecondition(f"sequence {h.seq_id} is not fresh")
        for h, snap in zip(seqs, snapshots, strict=True):
            self.seqs[h.seq_id].tokens = list(self.snapshots[snap])
            h.seq_len = len(self.snapshots[snap])

    def drop_prefixes(self, snapshots) -> None:
        self.calls.append(("drop", len(snapshots)))
        missing = [s for s in snapshots if s not in self.snapshots]
        if missing:
            raise NotFound(f"snapshot {missing[0]} is unknown or dropped")
        for s in snapshots:
            del self.snapshots[s]

    def measure_costs(self, widths, max_depth, repeats=5, refresh=False, cached_only=False):
        """A chosen table: verifies cost 1 ms + 0.1 per row, proposes 0.5 ms per draft. Like a
        fresh service, it has none cached until a test sets `cached`: a `cached_only` call
        (the default `auto` cost model) gets none, and the K ladder sets the width."""
        from protos.model import CostEntry

        self.calls.append(("measure_costs", list(widths), max_depth))
        if cached_only and not getattr(self, "cached", False):
            return [], False
        return [
            CostEntry(w, d, 1.0 + 0.1 * w * (d + 1), 0.5 * d)
            for w in widths
            for d in range(max_depth + 1)
        ], False

    def names(self) -> list[str]:
        """The calls made, by name, but `step` (the fused call's mark)."""
        return [c[0] for c in self.calls if c[0] != "step"]

    def steps(self) -> list[tuple]:
        return [c for c in self.calls if c[0] == "step"]

    def verify_calls(self) -> list[tuple]:
        return [c for c in self.calls if c[0] == "verify"]


class _InlineSteps:
    """A step stream that runs each plan when it is sent; results, or the exception a plan
    raised, come back in order."""

    def __init__(self, run: Callable[[StepPlan], PlanResult]) -> None:
        self._run = run
        self._results: deque[PlanResult | Exception] = deque()

    def send(self, plan: StepPlan) -> None:
        try:
            self._results.extend(plan_steps(plan, [], self._run, PlanClock(), 0.0))
        except Exception as e:  # handed to the reader, as the engine's stream hands it
            self._results.append(e)

    def recv(self) -> PlanResult:
        assert self._results, "recv with every plan's result read already"
        result = self._results.popleft()
        if isinstance(result, Exception):
            raise result
        return result

    def close(self) -> None:
        self._results.clear()
