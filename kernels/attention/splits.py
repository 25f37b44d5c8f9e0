"""The split rule of the attention kernels (`triton.py`), on the host: how many keys each split
of a row takes, how many splits a row has, and the workspace their partials take, which the
memory plan counts (`gpu_service/sizing/plan_graphs.py`). The kernels get the two constants at each
call (`triton._constants`), so a test may change them here."""

from __future__ import annotations

BN = 32  # keys a kernel block holds; a split is a whole number of them
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256  # a multiple of BN


def split_size(keys: int) -> int:
    """Keys in each split of a row that sees `keys` keys (the kernels' `_splits`): the least
    multiple of BN with which MAX_SPLITS splits cover them, and MIN_KEYS_PER_SPLIT at least.
    Rows a few positions apart share a size, and so their splits' bounds, except where it
    grows (every MAX_SPLITS * BN keys past MAX_SPLITS * MIN_KEYS_PER_SPLIT)."""
    need = -(-keys // MAX_SPLITS)
    return max(-(-need // BN) * BN, MIN_KEYS_PER_SPLIT)


def num_splits(keys: int) -> int:
    """Splits of a row that sees `keys` keys: its working programs per query head."""
    return -(-keys // split_size(keys))


def workspace_bytes(rows: int, heads: int, head_dim: int) -> int:
    """Bytes of the fp32 partials a `split_keys` call of `rows` query rows at `heads` query
    heads of `head_dim` allocates: accumulators, maxima and sums of MAX_SPLITS splits."""
    return rows * heads * MAX_SPLITS * (head_dim + 2) * 4
