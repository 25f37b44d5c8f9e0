"""`python -m tools.bench.pool` on the tiny checkpoint: four requests in half the
blocks they need all finish, with preemptions, where the full pool needs none. (The requests
that finish first are freed only once the step in flight beside them is back: until then their
blocks are not free, and the preempted requests' prefills waited for them.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench.pool import lines, parse_args, run


def test_four_requests_finish_in_half_their_blocks(tiny_dir: Path) -> None:
    args = parse_args(
        ["--requests", "4", "--prompt", "100", "--tokens", "120", "--fractions", "0.5"]
    )
    report = run(tiny_dir, args)
    assert report["need"] == 16
    full, half = report["runs"][0], report["runs"][8]
    assert (full["finished"], full["failed"], full["preemptions"]) == (4, 0, 0)
    assert (half["finished"], half["failed"]) == (4, 0) and half["preemptions"] > 0
    assert half["tok_s"] > 0 and half["ttft_median_s"] > 0
    text = "\n".join(lines(report))
    assert "need 16 blocks" in text and "8 (50%)" in text


@pytest.mark.parametrize("fractions", ["0", "1.5", "x"])
def test_fractions_are_between_0_and_1(fractions: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--fractions", fractions])
