"""One run's bytes, and how two runs compare: byte for byte first, then how far apart."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

_INT = {"float32": np.int32, "float16": np.int16, "bfloat16": np.int16}
_WIDTH = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Step:
    """One step of a run: the verify's logits rows (and, with the drafter, the propose's
    logits), the service's argmaxes, and the drafts with their confidences."""

    logits: bytes
    argmax: list[int]
    propose_logits: bytes = b""
    drafts: list[list[int]] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)
    # The sequence of each propose row, where only some of the batch proposed.
    proposers: list[int] = field(default_factory=list)

    def same(self, other: Step) -> bool:
        return (
            self.logits == other.logits
            and self.propose_logits == other.propose_logits
            and self.drafts == other.drafts
            and self.confidences == other.confidences
        )


@dataclass
class Run:
    prefill: bytes
    prefill_argmax: list[int]
    steps: list[Step]
    ks: list[int]
    dtype: str
    enqueue_ms: list[float]
    step_ms: list[float]


@dataclass
class Comparison:
    variant: str
    prefill_equal: bool
    steps: int
    mismatched_steps: int
    first_mismatch: int | None
    first_mismatch_sequence: int | None
    first_mismatch_row: int | None
    max_abs_diff: float
    max_ulp: int
    argmax_agreement: float

    def to_json(self) -> dict:
        return asdict(self)


def as_float(data: bytes, dtype: str) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8)
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float32 if dtype == "float32" else np.float16).astype(np.float32)


def _max_abs(x: np.ndarray, y: np.ndarray) -> float:
    """The largest |x - y|, equal elements (a masked row's -inf columns among them) 0."""
    with np.errstate(invalid="ignore"):  # -inf - -inf, where both rows mask a token
        return float(np.where(x == y, 0.0, np.abs(x - y)).max())


def ulp_distance(a: bytes, b: bytes, dtype: str) -> int:
    """Largest distance in representable values between matching elements."""
    if not a:
        return 0
    kind = _INT[dtype]
    x = np.frombuffer(a, dtype=kind).astype(np.int64)
    y = np.frombuffer(b, dtype=kind).astype(np.int64)
    bits = 8 * _WIDTH[dtype] - 1
    # Sign-magnitude to two's complement order, so adjacent floats are adjacent integers.
    x = np.where(x < 0, -(x & ((1 << bits) - 1)), x)
    y = np.where(y < 0, -(y & ((1 << bits) - 1)), y)
    return int(np.abs(x - y).max())


def _first_row(a: Step, b: Step, ks: list[int], row_bytes: int) -> tuple[int, int]:
    """(sequence, row within it) of the first differing verify row, else of the propose."""
    row = 0
    for i, k in enumerate(ks):
        for j in range(k):
            lo = (row + j) * row_bytes
            if a.logits[lo : lo + row_bytes] != b.logits[lo : lo + row_bytes]:
                return i, j
        row += k
    for j, i in enumerate(a.proposers or range(len(ks))):
        lo = j * row_bytes
        if a.propose_logits[lo : lo + row_bytes] != b.propose_logits[lo : lo + row_bytes]:
            return i, -1
    return -1, -1


def compare(variant: str, ref: Run, run: Run) -> Comparison:
    """`run` against `ref`, step by step. Row -1 means the propose differs, not the verify."""
    mismatched = [
        s for s, (a, b) in enumerate(zip(ref.steps, run.steps, strict=True)) if not a.same(b)
    ]
    max_abs, max_ulp = 0.0, 0
    agree = total = 0
    for a, b in [*zip(ref.steps, run.steps, strict=True)]:
        for x, y in ((a.logits, b.logits), (a.propose_logits, b.propose_logits)):
            if x != y and len(x) == len(y):
                max_abs = max(max_abs, _max_abs(as_float(x, ref.dtype), as_float(y, ref.dtype)))
                max_ulp = max(max_ulp, ulp_distance(x, y, ref.dtype))
        agree += sum(p == q for p, q in zip(a.argmax, b.argmax, strict=True))
        total += len(a.argmax)
    seq = row = None
    if mismatched:
        a, b = ref.steps[mismatched[0]], run.steps[mismatched[0]]
        vocab_bytes = len(a.logits) // max(1, sum(ref.ks))
        seq, row = _first_row(a, b, ref.ks, vocab_bytes)
    return Comparison(
        variant=variant,
        prefill_equal=ref.prefill == run.prefill,
        steps=len(ref.steps),
        mismatched_steps=len(mismatched),
        first_mismatch=mismatched[0] if mismatched else None,
        first_mismatch_sequence=seq,
        first_mismatch_row=row,
        max_abs_diff=max_abs,
        max_ulp=max_ulp,
        argmax_agreement=agree / total if total else 1.0,
    )
