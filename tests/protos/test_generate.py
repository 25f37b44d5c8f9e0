"""The committed stubs are what `python -m protos.generate` makes from the .proto files."""

from __future__ import annotations

from pathlib import Path

from protos.generate import ROOT, generate


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert fresh, "the generator wrote nothing"
    for rel in fresh:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is not committed; run python -m protos.generate"
        assert committed.read_text() == (tmp_path / rel).read_text(), (
            f"{rel} is stale; run python -m protos.generate"
        )
