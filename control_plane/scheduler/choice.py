"""The server's choice (`auto`): each step, the strategy and width of every sequence whose
request left the method to the server, for the most tokens per millisecond of the batch.

An option is a method that drafts on the service at one width (`Method.widths`), or none.
Its worth for a batch of `n` active sequences is the tokens it is expected to give, summed
over the choosing sequences, over what a step under it costs at `n`:

- tokens: a sequence gains `1 + a_1 + a_1 a_2 + ... + a_1..a_w` per step at width `w`, `a_j`
  the method's acceptance at draft position `j`, observed over every verify of every request
  that drafted with it (a request that names the method teaches it too), kept apart for
  sequences a grammar constrains (until they have their own, they start from the others';
  until a position is seen `widths.Calibration` takes the shallower one's rate, or its
  prior). A sequence's own record scales it: once it has verified `OWN_SEEN` drafts of the
  method, by its own mean accepted drafts per verify over the service's.
- cost: the mean of the last `SAMPLES` steps served under the option with a batch of the
  same shape: its active sequences in the same bucket (`BUCKETS`), and a grammar constraining
  one of them or none; timed as the scheduler saw them (pipelined steps included, so what
  overlaps is not paid twice; a mean, since a plan of two steps comes back whole, one step
  waiting for both and the next for none). Before an option has steps of its own at a
  shape: at a shape first seen, none is served `TIMED` times; an option that another shape
  timed beside none costs none's cost here times its multiple of none's there (the nearest
  such shape), one that no shape timed is served `TIMED` times (cheapest first: the narrower
  widths); once weighed, the best by its estimate is served (and so timed here), and an
  option is served again once `REVISIT` steps passed since it last was (`FAR` times that for
  one worth less than `NEAR` of the best), so the table follows a machine that gets busier or
  quieter.

The best option is every choosing sequence's, but for one whose own record says it would give
fewer tokens than its share of the step costs over `none`'s: it sits the step out (plain),
and tries the option again every `PROBE` steps, so a request whose text turns predictable
drafts again. A request that names its method keeps it; `--num-drafts 0` leaves only none.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from control_plane.scheduler.methods import HEADS, METHODS, PLAIN, Method
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.widths import Calibration
from protos.model import Capabilities

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a batch of n counts as the first bucket >= n
SAMPLES = 8  # a cost is the mean of an option's last this many steps at a batch shape
TIMED = 2  # steps none, or an option no other shape timed, is served before it is weighed
REVISIT = 128  # steps after which an option near the best is served again to time it
NEAR, FAR = 0.8, 4  # one worth less than NEAR of the best is timed again FAR times as rarely
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
    """The costs and acceptance the choice reads, learned over the server's life."""

    costs: dict[tuple[Shape, Option], deque[float]] = field(default_factory=dict)
    served_at: dict[tuple[Shape, Option], int] = field(default_factory=dict)
    # By method and whether a grammar constrained the sequence, over every request.
    acceptance: dict[Kind, Calibration] = field(default_factory=dict)
    per_verify: dict[Kind, tuple[int, int]] = field(default_factory=dict)  # verifies, accepted
    steps: int = 0
    current: Option | None = None  # the option of the step under way
    at: Shape = (0, False)  # its batch's shape
    sat_out: dict[str, int] = field(default_factory=dict)  # request id -> step it sat out from
    first_seen: dict[Shape, int] = field(default_factory=dict)  # the step a shape was first

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
        self, active: list[ActiveSeq], caps: Capabilities, num_drafts: int, most: int
    ) -> Option | None:
        """Each choosing sequence's strategy for this step. -> the step's option (None: no
        sequence chooses)"""
        choosing = [a for a in active if a.chooses and a.finished is None]
        self.current = None
        if not choosing:
            return None
        self.steps += 1
        self.at = (bucket(len(active)), any(a.constrained for a in active))
        options = self.options(caps, num_drafts, len(active), most)
        pick = self._pick(options, choosing)
        self.current = pick
        base = self._cost(NONE_OPTION)
        for a in choosing:
            a.method = pick.method if self._joins(a, pick, base) else PLAIN
        return pick

    def _pick(self, options: list[Option], choosing: list[ActiveSeq]) -> Option:
        """None until timed at this shape; then an option that has no cost here or at another
        shape; then the best, or one due to be timed again."""
        self.first_seen.setdefault(self.at, self.steps)
        untimed = [o for o in options if self._own(o) < TIMED and self._borrowed(o) is None]
        if self._own(NONE_OPTION) < TIMED or untimed:
            return NONE_OPTION if self._own(NONE_OPTION) < TIMED else untimed[0]
        worth = {o: self.worth(o, choosing) for o in options}
        best = max(worth.values())

        def since(o: Option) -> int:
            return self.steps - self.served_at.get((self.at, o), self.first_seen[self.at])

        due = [
            o
            for o in options
            if since(o) >= (REVISIT if worth[o] >= NEAR * best else FAR * REVISIT)
        ]
        if due:
            return max(due, key=since)
        return max(options, key=worth.__getitem__)

    def _own(self, o: Option) -> int:
        return len(self.costs.get((self.at, o), ()))

    def worth(self, o: Option, choosing: list[ActiveSeq]) -> float:
        """Expected tokens per millisecond of a step under `o`."""
        return sum(self.tokens(a, o) for a in choosing) / self._cost(o)

    def tokens(self, a: ActiveSeq, o: Option) -> float:
        if not o.width:
            return 1.0
        rates = self._kind(self.acceptance, (o.method.name, a.constrained)) or Calibration()
        chain, extra = 1.0, 0.0
        for j in range(o.width):
            chain *= rates.rate(j)
            extra += chain
        return 1.0 + extra * self._own_scale(a, o.method.name)

    def _own_scale(self, a: ActiveSeq, name: str) -> float:
        own = a.stats.by_method.get(name)
        verifies, accepted = self._kind(self.per_verify, (name, a.constrained)) or (0, 0)
        if own is None or own.drafted < OWN_SEEN or not verifies or not accepted:
            return 1.0
        return (own.accepted / own.verifies) / (accepted / verifies)

    @staticmethod
    def _kind(table: dict, kind: Kind):
        """A kind's entry, else the same method's of the other kind (a first constrained
        request starts from the free text's figures)."""
        return table.get(kind) or table.get((kind[0], not kind[1]))

    def _cost(self, o: Option) -> float:
        return max(self._cost_of(o) or 0.0, 1e-6)

    def _cost_of(self, o: Option) -> float | None:
        """Its cost at this shape: its own steps' mean, else `_borrowed`; None where nothing
        says."""
        seen = self.costs.get((self.at, o))
        return statistics.fmean(seen) if seen else self._borrowed(o)

    def _borrowed(self, o: Option) -> float | None:
        """None's cost here scaled by `o`'s over none's at the nearest shape that timed both (a
        grammar's alike first): a drafting step costs about the same multiple of a plain one at
        a neighbouring batch size."""
        here = self.costs.get((self.at, NONE_OPTION))
        timed = [
            shape
            for (shape, x) in self.costs
            if x == o and shape != self.at and self.costs.get((shape, NONE_OPTION))
        ]
        if not here or not timed:
            return None
        n, constrained = self.at

        def distance(shape: Shape) -> tuple[bool, int]:
            return shape[1] != constrained, abs(shape[0].bit_length() - n.bit_length())

        near = min(timed, key=distance)
        ratio = statistics.fmean(self.costs[(near, o)]) / statistics.fmean(
            self.costs[(near, NONE_OPTION)]
        )
        return statistics.fmean(here) * ratio

    def _joins(self, a: ActiveSeq, pick: Option, base: float) -> bool:
        """Whether the sequence runs the step's option: unless its own record says it gives
        fewer tokens than the option costs it over none's; then it tries again every PROBE."""
        if not pick.width or self.tokens(a, pick) * base >= self._cost(pick):
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

    def observe(self, active: list[ActiveSeq], ms: float) -> None:
        """A step served in `ms`: its option's cost in its bucket, and every verdict of its
        sequences for the acceptance (each request's, whichever method it names)."""
        for a in active:
            for name, drafted, accepted in a.verdicts:
                if drafted:
                    kind = (name, a.constrained)
                    self.acceptance.setdefault(kind, Calibration()).observe(drafted, accepted)
                    v, n = self.per_verify.get(kind, (0, 0))
                    self.per_verify[kind] = (v + 1, n + accepted)
            a.verdicts.clear()
            if a.finished is not None:
                self.sat_out.pop(a.req.request_id, None)
        if self.current is not None:
            key = (self.at, self.current)
            self.costs.setdefault(key, deque(maxlen=SAMPLES)).append(ms)
            self.served_at[key] = self.steps
