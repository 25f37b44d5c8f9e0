"""`python -m tools.moe_bench` at tiny sizes: every figure in its JSON, and the dense path
it swaps in giving the routed path's logits byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_service.engine.facade import Engine
from tests.steps import logit_rows, verify
from tools import moe_bench


def test_json_has_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert moe_bench.main(["--experts", "8,4", "--routed", "2", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["experts"] == [4, 8] and report["routed"] == 2 and report["device"] == "cpu"
    assert list(report["paths"]) == ["routed"]
    rows = report["paths"]["routed"]["experts"]
    assert list(rows) == ["4", "8"]
    for row in rows.values():
        assert set(row) == {"prefill_ms", "verify_ms", "prefill_ratio", "verify_ratio"}
        assert all(v > 0 for v in row.values()), row
    assert rows["4"]["prefill_ratio"] == rows["4"]["verify_ratio"] == 1.0
    assert isinstance(report["paths"]["routed"]["target_holds"], bool)


def test_dense_is_the_routed_paths_bytes(tmp_path: Path) -> None:
    cfg = moe_bench.moe_config(num_experts=8, routed=2)
    engine = Engine(moe_bench.write_checkpoint(tmp_path, cfg), moe_bench.SERVICE)
    prompt = [(5 * i + 1) % 251 for i in range(20)]
    runs = []
    for path in ("routed", "dense"):
        moe_bench.use_path(engine, path)
        seqs = [engine.alloc_sequence() for _ in range(2)]
        first = engine.prefill(seqs, [prompt, prompt[:13]]).argmax
        prefilled = logit_rows(engine)
        _, verified = verify(engine, seqs, [[first[0], 7, 9, 11], [first[1], 3]], [2, 1])
        runs.append((first, prefilled, verified))
        for seq in seqs:
            engine.free_sequence(seq)
    assert isinstance(engine.model.ops, moe_bench.DenseOps)
    assert runs[0] == runs[1]
