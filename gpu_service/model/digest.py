"""The digest that names a checkpoint (`Capabilities.model_digest`): a control plane driving
several GPU services refuses a replica whose digest differs from the others'.

It is the first 16 hex digits of a SHA-256 over:
- config.json's bytes;
- for each safetensors file the loader reads (`weights.shard_paths`: the index's shards in name
  order, or model.safetensors), its name, its size, its header as stored (every tensor's name,
  dtype, shape and byte offsets, and the file's metadata) and its data bytes: all of them when
  the file is at most `full_bytes` (64 MiB), else `num_samples` runs of `SAMPLE_BYTES` evenly
  spaced from the first data byte to the file's end (2 MiB read per file, however big).

Why sample: a checkpoint of 160 GB in shards of a few GB costs some tens of MiB of scattered
reads, not a second pass over every byte. The price: in a file above `full_bytes`, a changed
weight outside the sampled runs goes unseen. A retrained or fine-tuned checkpoint changes
nearly every tensor and another architecture changes config.json and the headers, so those are
caught; an edit of a few weights in a big file may not be. The same weights saved another way
(other metadata, tensor order or sharding) digest differently: such a replica is refused, the
safe side. The dtype the service casts to is not covered (`Capabilities.dtype` reports it).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from gpu_service.model.weights import shard_paths

FULL_BYTES = 64 << 20  # a file up to this size is hashed whole
SAMPLE_BYTES = 4 << 10
NUM_SAMPLES = 512  # runs per sampled file: 2 MiB read
DIGEST_HEX = 16


def checkpoint_digest(
    directory: Path, full_bytes: int = FULL_BYTES, num_samples: int = NUM_SAMPLES
) -> str:
    """The digest of the checkpoint in `directory`, as the module docstring defines it."""
    h = hashlib.sha256()
    _frame(h, (directory / "config.json").read_bytes())
    for shard in shard_paths(directory):
        _frame(h, shard.name.encode())
        with shard.open("rb") as f:
            _hash_safetensors(h, f, shard.stat().st_size, full_bytes, num_samples)
    return h.hexdigest()[:DIGEST_HEX]


def sampled_runs(data_start: int, size: int, num_samples: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the runs hashed in a big file whose data spans `data_start ..
    size`: `num_samples` runs of `SAMPLE_BYTES` evenly spaced, the first at `data_start`, the
    last ending at `size` (all of the data when the runs would cover it)."""
    span = size - data_start
    if span <= num_samples * SAMPLE_BYTES:
        yield data_start, span
        return
    last = span - SAMPLE_BYTES
    for i in range(num_samples):
        yield data_start + i * last // max(num_samples - 1, 1), SAMPLE_BYTES


def _hash_safetensors(
    h: hashlib._Hash, f: BinaryIO, size: int, full_bytes: int, num_samples: int
) -> None:
    # Layout: u64 little-endian header length n, n bytes of JSON header, then the data.
    (n,) = struct.unpack("<Q", f.read(8))
    if 8 + n > size:
        raise ValueError(f"{f.name} has a header of {n} bytes in a file of {size}")
    _frame(h, struct.pack("<Q", size))
    _frame(h, f.read(n))
    if size <= full_bytes:
        _frame(h, f.read())
        return
    for offset, length in sampled_runs(8 + n, size, num_samples):
        f.seek(offset)
        _frame(h, f.read(length))


def _frame(h: hashlib._Hash, data: bytes) -> None:
    """Length first, so that no two sequences of parts hash the same bytes."""
    h.update(struct.pack("<Q", len(data)))
    h.update(data)
