"""The llama.cpp comparison's rounds and lines on chosen arms: interleaved rounds after a
warm-up, medians, the per-round ratios, and whose tokens differ from ours."""

from __future__ import annotations

import itertools

from tools.bench.llama_cpp import _rows, lines


def test_rounds_medians_ratios_and_token_checks() -> None:
    order: list[str] = []
    settles = itertools.count()

    def arm(name: str, tokens: list[int]):
        def call(prompt):
            order.append(name)
            return tokens

        return call

    same, other = [1, 2, 3], [1, 2, 4]
    arms = {
        "llama.cpp none": arm("ln", same),
        "llama.cpp mtp": arm("lm", other),
        "ours none": arm("on", same),
        "ours mtp": arm("om", same),
    }
    row = _rows(arms, [(5,), (6,)], 2, lambda: next(settles))
    assert next(settles) == 1, "settled once, after the warm-up"
    assert order[:8] == ["ln", "ln", "lm", "lm", "on", "on", "om", "om"], "arm by arm, a round"
    assert len(order) == 3 * 8, "a warm-up and two counted rounds"
    assert set(row["tok_s"]) == set(arms) and all(v > 0 for v in row["tok_s"].values())
    assert row["same_tokens"] == {
        "llama.cpp none": True,
        "llama.cpp mtp": False,
        "ours none": True,
        "ours mtp": True,
    }
    assert set(row["llama_over_ours"]) == {"none", "mtp"}
    (line,) = lines([{**row, "concurrency": 16}])
    assert line.startswith(" 16 concurrent:") and "tokens differ: llama.cpp mtp" in line
