"""`python -m tools.bench.penalties` on the tiny checkpoint: every set of penalties
keeps `mtp`'s tokens those of `none`, and each one changes the output."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench.penalties import SETS, lines, parse_args, run


def test_every_set_is_lossless_and_changes_the_output(tiny_dir: Path) -> None:
    report = run(tiny_dir, parse_args(["--requests", "2", "--prompt", "40", "--tokens", "24"]))
    assert list(report) == list(SETS)
    for name, r in report.items():
        assert r["same_tokens"], f"{name}: mtp left none's tokens"
        assert r["changed"] == (name != "off"), f"{name}: changed is {r['changed']}"
        assert r["none_tok_s"] > 0 and r["mtp_tok_s"] > 0 and r["accepted_length"] >= 1
    text = "\n".join(lines(report))
    assert "presence 1.5" in text and " NO " not in text


def test_counts_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--tokens", "0"])
