"""The server's choice (`auto`): each step, the strategy and width of every sequence whose
request left the method to the server, for the most tokens per millisecond of the batch.

An option is a method that drafts on the service at one width (`Method.widths`), or none.
Its worth for a batch is what steps under it delivered: the tokens its choosing sequences
gained over the milliseconds the steps took, over its last `SAMPLES` steps with a batch of the
same shape (its active sequences in the same bucket, `BUCKETS`, and a grammar constraining one
of them or none), timed as the scheduler saw them (pipelined steps included, so what overlaps
is not paid twice, and a switch that drains the pipeline is paid by the option that caused
it). Delivered, not modelled: a drafter's acceptance, its cost and the pipeline's gain are all
in it. A sequence's own record is weighed for it alone (below): `1 + a_1 + a_1 a_2 + ... +
a_1..a_w` tokens a step at width `w`, `a_j` the method's acceptance at draft position `j` over
every request that drafted with it (one that names the method teaches it too; kept apart for
sequences a grammar constrains), its drafts scaled by its own acceptance over every request's,
draft for draft, once it has verified `OWN_SEEN` of the method's.

A step is measured only as the `SETTLE`th or later of a run of its option at its shape: the
first steps after a switch deliver what the option before planned (a pipelined result comes
back a step after it was sent, its drafts were made a step before that).

Each shape has an incumbent, at first the K ladder's MTP width (what a request naming mtp
gets, the seeds' static choice), and it is served but for exploration: once it is measured,
another option is run until measured, and then one every `EXPLORE` steps, the least measured
first, in turn. An option measured `TIMED` times that delivered `MARGIN` more than the
incumbent takes its place. So the choice starts from the fixed method that is best on most
machines, pays a few percent to keep measuring the others, and follows a machine that gets
busier or quieter, or a drafter that does better than the head, once the evidence is clear.

The option is every choosing sequence's, but for one whose own record says it would give fewer
tokens than its share of the step costs over `none`'s: it sits the step out (plain),
and tries the option again every `PROBE` steps, so a request whose text turns predictable
drafts again. A request that names its method keeps it; `--num-drafts 0` leaves only none.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from control_plane.scheduler.methods import HEAD, HEADS, METHODS, PLAIN, Method
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.widths import Calibration
from protos.model import Capabilities

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a batch of n counts as the first bucket >= n
SAMPLES = 8  # what an option delivered: over its last this many steps at a batch shape
TIMED = 2  # measured steps an option needs before it may take the incumbent's place
SETTLE = 3  # an option's steps in a row before one measures it
EXPLORE = 48  # steps at a shape between two runs of an option other than its incumbent
MARGIN = 0.1  # how much more an option must deliver to take the incumbent's place
OWN_SEEN = 8  # drafts a sequence verified under a method before its own record counts
PROBE = 32  # steps a sequence sits out before it tries the option again


@dataclass(frozen=True)
class Option:
    method: Method
    width: int  # drafts a step (0: none)

    def __str__(self) -> str:
        return f"{self.method.name}:{self.width}" if self.width else self.method.name


NONE_OPTION = Option(PLAIN, 0)
# What a step's cost is kept by beside its option: the bucket of its active sequences, and
# whether a grammar constrains any of them (its rows' masks are made on the control plane, one
# per verified row, and a masked step takes two calls and never runs ahead).
Shape = tuple[int, bool]
# What acceptance is kept by: the method, and whether a grammar constrained the sequence (a
# drafter trained on free text guesses a forced format's tokens less often).
Kind = tuple[str, bool]


def bucket(n: int) -> int:
    return next((b for b in BUCKETS if b >= n), BUCKETS[-1])


@dataclass
class Chooser:
    """What the choice reads, learned over the server's life."""

    # Each option's last steps at each shape: (tokens its choosing sequences gained, ms).
    served: dict[tuple[Shape, Option], deque[tuple[int, float]]] = field(default_factory=dict)
    served_at: dict[tuple[Shape, Option], int] = field(default_factory=dict)
    # By method and whether a grammar constrained the sequence, over every request.
    acceptance: dict[Kind, Calibration] = field(default_factory=dict)
    per_draft: dict[Kind, tuple[int, int]] = field(default_factory=dict)  # drafted, accepted
    steps: int = 0
    current: Option | None = None  # the option of the step under way
    at: Shape = (0, False)  # its batch's shape
    before: list[tuple[ActiveSeq, int]] = field(default_factory=list)  # its choosers' lengths
    sat_out: dict[str, int] = field(default_factory=dict)  # request id -> step it sat out from
    incumbent: dict[Shape, Option] = field(default_factory=dict)  # each shape's option
    explored_at: dict[Shape, int] = field(default_factory=dict)  # the step it last explored
    exploring: tuple[Shape, Option, int] | None = None  # an option run until measured
    streak: tuple[tuple[Shape, Option] | None, int] = (None, 0)  # the step's key, its run
    mark: float | None = None  # when the step under way was chosen (`clock`, seconds)
    clock: Callable[[], float] = time.perf_counter

    def options(self, caps: Capabilities, num_drafts: int, n: int, most: int) -> list[Option]:
        """What a step of `n` may run: none, and each method that drafts on this service at
        each of its widths (chains only within `--mtp-max-seqs`, `most`)."""
        out = [NONE_OPTION]
        for m in METHODS.values():
            if not m.drafts or not m.ready(caps.drafters) or m.copies or m.chooses:
                continue
            if m.arm == HEADS and n > most:
                continue
            out += [Option(m, w) for w in m.widths(caps, num_drafts)]
        return out

    def choose(
        self,
        active: list[ActiveSeq],
        caps: Capabilities,
        num_drafts: int,
        most: int,
        ladder: int = 0,
    ) -> Option | None:
        """Each choosing sequence's strategy for this step (`ladder`: the K ladder's width for
        this batch). -> the step's option (None: no sequence chooses)"""
        self._measure()
        choosing = [a for a in active if a.chooses and a.finished is None]
        self.current, self.before = None, []
        if not choosing:
            return None
        self.steps += 1
        self.at = (bucket(len(active)), any(a.constrained for a in active))
        pick = self._pick(self.options(caps, num_drafts, len(active), most), choosing, ladder)
        self.current, self.before = pick, [(a, len(a.generated)) for a in choosing]
        key, run = self.streak
        self.streak = ((self.at, pick), run + 1 if key == (self.at, pick) else 1)
        for a in choosing:
            a.method = pick.method if self._joins(a, pick) else PLAIN
        return pick

    def _pick(self, options: list[Option], choosing: list[ActiveSeq], ladder: int) -> Option:
        """The shape's incumbent, first the ladder's MTP width (what a request naming mtp
        gets); every `EXPLORE` steps another option, the least measured first, run until it
        is measured; the incumbent gives way to an option measured `TIMED` times that
        delivered `MARGIN` more."""
        head = Option(HEAD, ladder)
        incumbent = self.incumbent.setdefault(self.at, head if head in options else NONE_OPTION)
        if incumbent not in options:  # the widths allowed changed (--mtp-max-seqs, the slots)
            incumbent = self.incumbent[self.at] = NONE_OPTION
        if self.exploring is not None:
            shape, o, before = self.exploring
            if shape == self.at and o in options and self._own(o) == before:
                return o
            self.exploring = None
        worth = {o: self.worth(o, choosing) for o in options if self._own(o) >= TIMED}
        rival = max(worth, key=worth.__getitem__, default=incumbent)
        if rival != incumbent and worth[rival] > (1 + MARGIN) * worth.get(incumbent, 0.0):
            incumbent = self.incumbent[self.at] = rival
        due = self.steps - self.explored_at.setdefault(self.at, self.steps) >= EXPLORE
        others = [o for o in options if o != incumbent]
        if others and (due or self._own(incumbent) >= TIMED and len(worth) < 2):
            o = min(others, key=self._own)
            self.exploring, self.explored_at[self.at] = (self.at, o, self._own(o)), self.steps
            return o
        return incumbent

    def _own(self, o: Option) -> int:
        return len(self.served.get((self.at, o), ()))

    def worth(self, o: Option, choosing: list[ActiveSeq]) -> float:
        """Tokens per millisecond steps under `o` delivered here."""
        return self._rate(o) or 0.0

    def tokens(self, a: ActiveSeq, o: Option, own: bool = True) -> float:
        """A step's expected tokens for `a` under `o` (`own`: its own record scaling its
        drafts)."""
        if not o.width:
            return 1.0
        rates = self._kind(self.acceptance, (o.method.name, a.constrained)) or Calibration()
        chain, extra = 1.0, 0.0
        for j in range(o.width):
            chain *= rates.rate(j)
            extra += chain
        return 1.0 + extra * (self._own_scale(a, o.method.name) if own else 1.0)

    def _own_scale(self, a: ActiveSeq, name: str) -> float:
        """Its drafts' acceptance over every request's, draft for draft (a verify's count
        depends on its width, which differs between them)."""
        own = a.stats.by_method.get(name)
        drafted, accepted = self._kind(self.per_draft, (name, a.constrained)) or (0, 0)
        if own is None or own.drafted < OWN_SEEN or not drafted or not accepted:
            return 1.0
        return (own.accepted / own.drafted) / (accepted / drafted)

    @staticmethod
    def _kind(table: dict, kind: Kind):
        """A kind's entry, else the same method's of the other kind (a first constrained
        request starts from the free text's figures)."""
        return table.get(kind) or table.get((kind[0], not kind[1]))

    def _rate(self, o: Option) -> float | None:
        """Tokens per millisecond its measured steps delivered at this shape."""
        return self._delivered(self.at, o)

    def _delivered(self, shape: Shape, o: Option) -> float | None:
        steps = self.served.get((shape, o))
        if not steps:
            return None
        return sum(t for t, _ in steps) / max(sum(ms for _, ms in steps), 1e-6)

    def _joins(self, a: ActiveSeq, pick: Option) -> bool:
        """Whether the sequence runs the step's option: unless its own record says it would
        gain less under it than the option's rate over none's asks; then it tries again every
        PROBE steps."""
        if not pick.width:
            return True  # a step of none (exploring it, say) keeps its count of steps out
        plain, rate = self._rate(NONE_OPTION), self._rate(pick)
        own = self.tokens(a, pick) / self.tokens(a, pick, own=False)
        # Only its own record sits it out: while the option is being timed, it runs it.
        if not plain or not rate or own >= 1.0 or own * rate >= plain:
            self.sat_out.pop(a.req.request_id, None)
            return True
        since = self.sat_out.setdefault(a.req.request_id, self.steps)
        if self.steps - since >= PROBE:
            self.sat_out[a.req.request_id] = self.steps
            return True
        return False

    def width(self, arm: str) -> int | None:
        """The step's width for an arm when its option drafts through it (None: the arm's own
        sources set it)."""
        o = self.current
        return o.width if o is not None and o.width and o.method.arm == arm else None

    def _measure(self) -> None:
        """What the step chosen last delivered, from its choice to this one: the whole of an
        iteration of the loop, its other work and the pipeline's overlap included."""
        now = self.clock()
        mark, self.mark = self.mark, now
        # Only a step of a run: the first steps after a switch deliver what the option before
        # planned (a pipelined result comes back a step after it was sent, its drafts a step
        # before that), and the first verify after none's steps holds no drafts.
        if self.current is None or mark is None or self.streak[1] < SETTLE:
            return
        key = (self.at, self.current)
        gained = sum(len(a.generated) - n for a, n in self.before)
        self.served.setdefault(key, deque(maxlen=SAMPLES)).append((gained, (now - mark) * 1e3))
        self.served_at[key] = self.steps

    def observe(self, active: list[ActiveSeq]) -> None:
        """A step served: every verdict of its sequences, for the acceptance (each request's,
        whichever method it names)."""
        for a in active:
            for name, drafted, accepted in a.verdicts:
                if drafted:
                    kind = (name, a.constrained)
                    self.acceptance.setdefault(kind, Calibration()).observe(drafted, accepted)
                    d, n = self.per_draft.get(kind, (0, 0))
                    self.per_draft[kind] = (d + drafted, n + accepted)
            a.verdicts.clear()
            if a.finished is not None:
                self.sat_out.pop(a.req.request_id, None)
        if all(a.finished is not None for a in active):
            self.mark = None  # the loop may idle before its next step: no step's time
