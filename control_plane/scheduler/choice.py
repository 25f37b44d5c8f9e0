"""The server's choice (`auto`): each step, the strategy of every sequence whose request left
the method to the server, for the most tokens per millisecond of the batch.

An option is none or a method that drafts on the service; a step under a method drafts at the
width a request naming it gets (MTP: the cost model's depth from the measured cost tables and
the acceptance, else the ladder; DFlash: its rung's gamma), so the choice weighs methods and
each method's width follows its own measured evidence. Its worth for a batch is what steps
under it delivered: the tokens its choosing sequences gained over the milliseconds the steps
took, over its last `SAMPLES` steps with a batch of the same shape (its active sequences in
the same bucket, `BUCKETS`, and a grammar constraining one of them or none), timed as the
scheduler saw them (pipelined steps included, so what overlaps is not paid twice, and a switch
that drains the pipeline is paid by the option that caused it). Delivered, not modelled: a
drafter's acceptance, its cost and the pipeline's gain are all in it. A sequence's own record
is weighed for it alone (below): `1 + a_1 + a_1 a_2 + ... + a_1..a_w` tokens a step at the
method's last width `w`, `a_j` the method's acceptance at draft position `j` over every
request that drafted with it (one that names the method teaches it too; kept apart for
sequences a grammar constrains), its drafts scaled by its own acceptance over every
request's, draft for draft, once it has verified `OWN_SEEN` of the method's.

A step is measured only once it delivers its own option's tokens: the `SETTLE`th or later of
a run of its option at its shape, no request joined it (that step paid a prefill), and every
choosing sequence's last verdict on drafts (held, or all cut by its grammar) came from what it
runs now (after a switch the pipeline returns what the option before planned for a step or
two, and a drafter's first verify holds no drafts). Counting steps instead measured MTP at one
token a step and handed one request's choice to none.

Each shape has an incumbent, at first the nearest known shape's (its options' waits too, so a
new batch size does not explore at once what its neighbour found worse; nor does a shape met
before its neighbours ran an option: an option it never ran waits as long as the nearest shape
that ran it found), else MTP (the best fixed method on most machines), but none where a grammar
constrains the batch (its masks cut drafts before the verify, and a drafter trained on free text
seldom guesses a forced format: MTP delivered 0.86-0.93 of none on short JSON answers at 8,
within the `MARGIN` that would keep it the incumbent there), and it is served but for
exploration: once it is measured, each other option is run until measured, then again when its
wait has passed, at first `EXPLORE` steps, doubled (to `EXPLORE` times `BACKOFF`) each time it
delivered less than the incumbent's `1 - MARGIN` and quadrupled below its `FAR` (a run of what
delivers far less costs more, and what delivers far less is further from taking over), so what
is clearly worse costs ever less to watch; two runs at a shape are half `EXPLORE` apart at
least; and a run of an option comes only while what its runs at a shape cost (the milliseconds
their steps took beyond what the incumbent would have taken for the same tokens) is within
`BUDGET` of the time served there, so that watching what delivers far less never costs a shape
more than that share (a short JSON answer at 8 requests paid 7% for a drafter it never chose),
while what delivers more costs nothing to watch. An option measured `TIMED` times that delivered
`MARGIN` more than the incumbent takes its place. So the choice starts from the fixed method
that is best on most machines, and follows a machine that gets busier or quieter, or a drafter
that does better than the head, once the evidence is clear. Widths are not options: exploring
each width of each method (nine options on the bundled model) cost a fifth of the tokens at one
request and a width's gain over its neighbour is within a step's noise here, while the cost
model weighs the widths from tables measured once.

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
SAMPLES = 16  # what an option delivered: over its last this many steps at a batch shape
TIMED = 3  # measured steps an option needs before it may take the incumbent's place
SETTLE = 2  # an option's steps in a row before one measures it
EXPLORE = 48  # steps at a shape between two runs of an option other than its incumbent
BACKOFF = 16  # the most an option's wait grows (in EXPLOREs) while it delivers less
MARGIN = 0.1  # how much more an option must deliver to take the incumbent's place
# Below this share of the incumbent's delivery an option's wait grows fourfold, not twofold: a
# run of it costs more, and it is further from taking over.
FAR = 0.75
BUDGET = 0.02  # the most of a shape's time its exploring runs may cost over the incumbent
OWN_SEEN = 8  # drafts a sequence verified under a method before its own record counts
PROBE = 32  # steps a sequence sits out before it tries the option again


@dataclass(frozen=True)
class Option:
    method: Method

    # By the method's name, its registry key: a Method's generated hash and equality read
    # every field, and the choice looks options up a dozen times a step.
    def __hash__(self) -> int:
        return hash(self.method.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Option) and other.method.name == self.method.name

    @property
    def drafts(self) -> bool:
        return self.method.drafts

    def __str__(self) -> str:
        return self.method.name


NONE_OPTION = Option(PLAIN)
# What a step's cost is kept by beside its option: the bucket of its active sequences, and
# whether a grammar constrains any of them (its rows' masks are made on the control plane, one
# per verified row, and a masked step never runs ahead).
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
    rates: dict[tuple[Shape, Option], float] = field(default_factory=dict)  # what `served` gave
    # By method and whether a grammar constrained the sequence, over every request.
    acceptance: dict[Kind, Calibration] = field(default_factory=dict)
    per_draft: dict[Kind, tuple[int, int]] = field(default_factory=dict)  # drafted, accepted
    last_width: dict[str, int] = field(default_factory=dict)  # a method's last step's drafts
    steps: int = 0
    current: Option | None = None  # the option of the step under way
    at: Shape = (0, False)  # its batch's shape
    before: list[tuple[ActiveSeq, int]] = field(default_factory=list)  # its choosers' lengths
    sat_out: dict[str, int] = field(default_factory=dict)  # request id -> step it sat out from
    incumbent: dict[Shape, Option] = field(default_factory=dict)  # each shape's option
    measured: dict[tuple[Shape, Option], int] = field(default_factory=dict)  # samples, ever
    shape_steps: dict[Shape, int] = field(default_factory=dict)  # steps served at each shape
    # Each option's last run's first step at a shape, in its steps (None: any option's).
    explored_at: dict[tuple[Shape, Option | None], int] = field(default_factory=dict)
    waits: dict[tuple[Shape, Option], int] = field(default_factory=dict)  # steps between runs
    # Each shape's ms served, and what each option's exploring runs there cost beyond the
    # incumbent's rate.
    spent: dict[Shape, float] = field(default_factory=dict)
    lost: dict[tuple[Shape, Option], float] = field(default_factory=dict)
    # An option run until measured: its shape, its samples and the step when it began.
    exploring: tuple[Shape, Option, int, int] | None = None
    streak: tuple[tuple[Shape, Option] | None, int] = (None, 0)  # the step's key, its run
    mark: float | None = None  # when the step under way was chosen (`clock`, seconds)
    batch: list[int] = field(default_factory=list)  # its active sequences (`id`)
    ran: dict[str, str] = field(default_factory=dict)  # request id -> its last verdict's method
    ready: bool = False  # the step's choosing sequences' verdicts come from what they run
    clock: Callable[[], float] = time.perf_counter

    def options(self, caps: Capabilities, num_drafts: int, n: int, most: int) -> list[Option]:
        """What a step of `n` may run: none, and each method that drafts on this service
        (chains only within `--mtp-max-seqs`, `most`; none alone under `--num-drafts 0`)."""
        out = [NONE_OPTION]
        for m in METHODS.values():
            if num_drafts < 1 or not m.drafts or not m.ready(caps.drafters) or m.copies:
                continue
            if m.chooses or m.arm == HEADS and n > most or not m.most_drafts(caps):
                continue
            out.append(Option(m))
        return out

    def choose(
        self,
        active: list[ActiveSeq],
        caps: Capabilities,
        num_drafts: int,
        most: int,
    ) -> Option | None:
        """Each choosing sequence's strategy for this step. -> the step's option (None: no
        sequence chooses)"""
        self._measure(active)
        choosing = [a for a in active if a.chooses and a.finished is None]
        self.current, self.before = None, []
        if not choosing:
            return None
        self.steps += 1
        self.at = (bucket(len(active)), any(a.constrained for a in active))
        self.shape_steps[self.at] = self._here() + 1
        pick = self._pick(self.options(caps, num_drafts, len(active), most), choosing)
        self.current, self.before = pick, [(a, len(a.generated)) for a in choosing]
        key, run = self.streak
        self.streak = ((self.at, pick), run + 1 if key == (self.at, pick) else 1)
        for a in choosing:
            a.method = pick.method if self._joins(a, pick) else PLAIN
        # Whether every one's verdicts already come from what it runs now: after a switch,
        # the pipeline returns what the option before planned for a step or two, and a
        # drafter's first drafts come a step after its first verify.
        self.ready = all(self.ran.get(a.req.request_id) == a.method.name for a in choosing)
        return pick

    def _pick(self, options: list[Option], choosing: list[ActiveSeq]) -> Option:
        """The shape's incumbent, first MTP; another option when its turn to be measured
        comes (`_explore`); the incumbent gives way to an option measured `TIMED` times that
        delivered `MARGIN` more."""
        incumbent = self.incumbent.get(self.at) or self._first(options)
        self.incumbent[self.at] = incumbent
        if incumbent not in options:  # the options allowed changed (--mtp-max-seqs, the slots)
            incumbent = self.incumbent[self.at] = NONE_OPTION
        if self.exploring is not None:
            shape, o, before, since = self.exploring
            runs = self.steps - since < TIMED * SETTLE * 2  # a batch that keeps changing
            if shape == self.at and o in options and self._seen(o) - before < TIMED and runs:
                return o
            self._explored(o, incumbent)
        worth = {o: self.worth(o, choosing) for o in options if self._own(o) >= TIMED}
        rival = max(worth, key=worth.__getitem__, default=incumbent)
        if rival != incumbent and worth[rival] > (1 + MARGIN) * worth.get(incumbent, 0.0):
            incumbent = self.incumbent[self.at] = rival
        if self._own(incumbent) < TIMED:
            return incumbent
        return self._explore([o for o in options if o != incumbent]) or incumbent

    def _first(self, options: list[Option]) -> Option:
        """A new shape's incumbent: the nearest known shape's (by its sequences, a grammar
        alike), whose options' waits and last runs it takes too, so what was clearly worse
        there is not explored at once here; else MTP where no grammar constrains the batch,
        else none."""
        size, grammar = self.at
        known = sorted((abs(s - size), s) for s, g in self.incumbent if g == grammar)
        for _, near in known:
            o = self.incumbent[(near, grammar)]
            if o not in options:
                continue
            since = self.shape_steps.get((near, grammar), 0)
            for x in options:
                if (at := self.explored_at.get(((near, grammar), x))) is not None:
                    self.explored_at[(self.at, x)] = self._here() - (since - at)
                    self.waits[(self.at, x)] = self.waits.get(((near, grammar), x), EXPLORE)
            return o
        return Option(HEAD) if Option(HEAD) in options and not grammar else NONE_OPTION

    def _explore(self, others: list[Option]) -> Option | None:
        """The option whose turn to be measured came, the longest overdue (None: none's):
        an option not measured yet at once, then one every `EXPLORE` steps, its wait doubled
        (to `EXPLORE` times `BACKOFF`) each time it delivered less than the incumbent's
        `1 - MARGIN`, quadrupled below its `FAR`, so what is clearly worse costs ever less to
        watch."""

        def overdue(o: Option) -> int:
            at = self.explored_at.get((self.at, o))
            if at is None and not self._inherit(o):
                return 1 << 30
            at = self.explored_at.get((self.at, o), 0)
            if self.lost.get((self.at, o), 0.0) > BUDGET * self._spent():
                return -1  # its runs here cost their share already
            return self._here() - at - self.waits.get((self.at, o), 0)

        due = max(others, key=overdue, default=None)
        if due is None or overdue(due) < 0:
            return None
        last = self.explored_at.get((self.at, None), -EXPLORE)
        if overdue(due) < 1 << 30 and self._here() - last < EXPLORE // 2:
            return None  # two measured options' runs half EXPLORE apart at least
        self.explored_at[(self.at, due)] = self.explored_at[(self.at, None)] = self._here()
        self.exploring = (self.at, due, self._seen(due), self.steps)
        return due

    def _inherit(self, o: Option) -> bool:
        """For an option never run at this shape: where the nearest shape that ran it (a
        grammar alike) found it worse (its wait grown), the same wait from now, so that each
        batch size does not pay a run of what its neighbours found worse. -> whether so"""
        size, grammar = self.at
        ran = sorted((abs(s - size), s) for (s, g), x in self.waits if x == o and g == grammar)
        if not ran or (wait := self.waits[((ran[0][1], grammar), o)]) <= EXPLORE:
            return False
        self.explored_at[(self.at, o)], self.waits[(self.at, o)] = self._here(), wait
        return True

    def _explored(self, o: Option, incumbent: Option) -> None:
        """An exploring run over: the option's next wait."""
        shape = self.exploring[0] if self.exploring is not None else self.at
        self.exploring = None
        key, wait = (shape, o), self.waits.get((shape, o), EXPLORE)
        mine, theirs = self._delivered(shape, o), self._delivered(shape, incumbent)
        if mine is None or theirs is None or mine >= (1 - MARGIN) * theirs:
            self.waits[key] = EXPLORE
            return
        self.waits[key] = min(wait * (2 if mine >= FAR * theirs else 4), EXPLORE * BACKOFF)

    def _here(self) -> int:
        """Steps served at the step's shape: what an option's wait counts, so that a shape
        seldom reached is explored no more often, step for step, than a busy one."""
        return self.shape_steps.get(self.at, 0)

    def _spent(self) -> float:
        return self.spent.get(self.at, 0.0)

    def _own(self, o: Option) -> int:
        return len(self.served.get((self.at, o), ()))

    def _seen(self, o: Option) -> int:
        return self.measured.get((self.at, o), 0)

    def worth(self, o: Option, choosing: list[ActiveSeq]) -> float:
        """Tokens per millisecond steps under `o` delivered here."""
        return self._rate(o) or 0.0

    def tokens(self, a: ActiveSeq, o: Option, own: bool = True) -> float:
        """A step's expected tokens for `a` under `o` (`own`: its own record scaling its
        drafts)."""
        if not o.drafts:
            return 1.0
        rates = self._kind(self.acceptance, (o.method.name, a.constrained)) or Calibration()
        chain, extra = 1.0, 0.0
        for j in range(self.last_width.get(o.method.name, 1)):
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
        return self.rates.get((shape, o))

    def _joins(self, a: ActiveSeq, pick: Option) -> bool:
        """Whether the sequence runs the step's option: unless its own record says it would
        gain less under it than the option's rate over none's asks; then it tries again every
        PROBE steps."""
        if not pick.drafts:
            return True  # a step of none (exploring it, say) keeps its count of steps out
        plain, rate = self._rate(NONE_OPTION), self._rate(pick)
        # Only its own record sits it out (an own acceptance at or above every request's
        # gives at least the option's tokens): while the option is being timed, it runs it.
        poorer = self._own_scale(a, pick.method.name) < 1.0
        own = self.tokens(a, pick) / self.tokens(a, pick, own=False) if poorer else 1.0
        if not plain or not rate or own >= 1.0 or own * rate >= plain:
            self.sat_out.pop(a.req.request_id, None)
            return True
        since = self.sat_out.setdefault(a.req.request_id, self.steps)
        if self.steps - since >= PROBE:
            self.sat_out[a.req.request_id] = self.steps
            return True
        return False

    def _measure(self, active: list[ActiveSeq]) -> None:
        """What the step chosen last delivered, from its choice to this one: the whole of an
        iteration of the loop, its other work and the pipeline's overlap included."""
        now = self.clock()
        mark, self.mark = self.mark, now
        batch, self.batch = self.batch, [id(a) for a in active]
        # Only a step of a run: the first steps after a switch deliver what the option before
        # planned (a pipelined result comes back a step after it was sent, its drafts a step
        # before that), and the first verify after none's steps holds no drafts. Not a step a
        # request joined: it paid the prefill.
        if self.current is None or mark is None:
            return
        ms, gained = (now - mark) * 1e3, sum(len(a.generated) - n for a, n in self.before)
        self._spend(ms, gained)
        if self.streak[1] < SETTLE or not set(self.batch) <= set(batch) or not self.ready:
            return
        key = (self.at, self.current)
        steps = self.served.setdefault(key, deque(maxlen=SAMPLES))
        steps.append((gained, ms))
        # Over the samples together: a pipelined step's results come back a step or more
        # after it was sent, so one step alone may hold none of them, or several steps'.
        self.rates[key] = sum(t for t, _ in steps) / max(sum(ms for _, ms in steps), 1e-6)
        self.measured[key] = self.measured.get(key, 0) + 1

    def _spend(self, ms: float, gained: int) -> None:
        """The step's time to its shape's, and, for a step of a run other than the
        incumbent's, what it took beyond the incumbent's rate for the same tokens."""
        self.spent[self.at] = self._spent() + ms
        incumbent = self.incumbent.get(self.at)
        rate = self._rate(incumbent) if incumbent is not None else None
        if self.current is not None and self.current != incumbent and rate:
            key = (self.at, self.current)
            self.lost[key] = self.lost.get(key, 0.0) + max(0.0, ms - gained / rate)

    def observe(self, active: list[ActiveSeq]) -> None:
        """A step served: every verdict of its sequences, for the acceptance (each request's,
        whichever method it names)."""
        for a in active:
            for name, drafted, accepted in a.verdicts:
                # A verify the room left without drafts says nothing of a switch.
                if name != PLAIN.name or not a.method.drafts:
                    self.ran[a.req.request_id] = name
                if drafted:
                    kind, self.last_width[name] = (name, a.constrained), drafted
                    self.acceptance.setdefault(kind, Calibration()).observe(drafted, accepted)
                    d, n = self.per_draft.get(kind, (0, 0))
                    self.per_draft[kind] = (d + drafted, n + accepted)
            a.verdicts.clear()
            if a.finished is not None:
                self.sat_out.pop(a.req.request_id, None)
                self.ran.pop(a.req.request_id, None)
        if all(a.finished is not None for a in active):
            self.mark = None  # the loop may idle before its next step: no step's time
