"""`met train`: the training forward computes what the service computes, training is
deterministic given its seed and resumes exactly, and the evaluation's Python check can fail."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.hybrid import PREFILL, HybridModel, Segment
from gpu_service.model.state import DeviceState
from gpu_service.model.weights import init_weights
from training.corpus import Corpus, is_held_out
from training.distill import DISTILL_FILE, distill
from training.evaluate import looks_like_python, prompt_from
from training.forward import TrainForward
from training.options import TrainConfig, add_args
from training.run import STATE_FILE, model_config, prepare, train

TINY = ModelConfig.tiny()
SOURCE = '''"""A module."""

import os


class Thing:
    def __init__(self, name, size=0):
        self.name = name
        self.size = size

    def grow(self, by):
        self.size += by
        return self.size

    def path(self):
        return os.path.join("/tmp", self.name)


def helper(values):
    total = 0
    for v in values:
        if v > 0:
            total += v
    return total
'''


def _perturbed(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        n: w + 0.05 * torch.randn(w.shape, generator=gen) for n, w in init_weights(cfg, 1).items()
    }


# Slow: two forwards.
@pytest.mark.slow
def test_training_forward_matches_the_service_forward() -> None:
    """Main hidden, the MTP head's first pass and its second pass (on its own output, seeing
    the first pass's cache up to its row) against HybridModel: fp32, atol 2e-4."""
    weights, svc, length = _perturbed(TINY), ServiceConfig(), 40
    tokens = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(0))
    train_fwd = TrainForward(TINY, weights, length)
    hidden = train_fwd.hidden(tokens)
    first, second = train_fwd.mtp(tokens, hidden, second=True)
    model = HybridModel(TINY, weights, svc.max_context)
    for b in range(2):
        state = DeviceState(TINY, svc, torch.float32)
        h = model.forward(tokens[b], [Segment(0, 0, length, 0)], state, PREFILL)[:length]
        torch.testing.assert_close(hidden[b], h, atol=2e-4, rtol=1e-4)
        state = DeviceState(TINY, svc, torch.float32)
        rows = length - 2
        f = model.mtp_forward(tokens[b, 1 : rows + 1], h[:rows], [Segment(0, 0, rows, 0)], state)
        torch.testing.assert_close(first[b, :rows], f[:rows], atol=2e-4, rtol=1e-4)
        # the second draft after row rows - 1: its hidden, the next token, one position on
        s = model.mtp_forward(
            tokens[b, rows + 1 : rows + 2], f[rows - 1 : rows], [Segment(0, rows, 1, 0)], state
        )
        torch.testing.assert_close(second[b, rows - 1], s[0], atol=2e-4, rtol=1e-4)


def test_losses_are_the_shifted_cross_entropies() -> None:
    weights = _perturbed(TINY)
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    fwd = TrainForward(TINY, weights, 20)
    losses = fwd.losses(tokens)
    hidden = fwd.hidden(tokens)
    first, second = fwd.mtp(tokens, hidden, second=True)
    ce = torch.nn.functional.cross_entropy
    torch.testing.assert_close(losses["main"], ce((hidden[0, :-1] @ fwd.lm_head.T), tokens[0, 1:]))
    torch.testing.assert_close(losses["mtp"], ce(first[0, :-1] @ fwd.lm_head.T, tokens[0, 2:]))
    torch.testing.assert_close(losses["mtp2"], ce(second[0, :-1] @ fwd.lm_head.T, tokens[0, 3:]))


@pytest.fixture
def corpus(tmp_path: Path) -> Corpus:
    root = tmp_path / "lib"
    for i in range(12):
        d = root / ("pkg" if i % 3 else "") / ("test" if i == 5 else "")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_text(SOURCE.replace("Thing", f"Thing{i}") * (1 + i % 2))
    return Corpus.scan(root)


def test_corpus_skips_test_suites_and_holds_out_by_path(corpus: Corpus) -> None:
    names = corpus.relative(corpus.train) + corpus.relative(corpus.held_out)
    assert len(names) == 11 and not any("test/" in n for n in names)
    assert all(is_held_out(n) for n in corpus.relative(corpus.held_out))
    assert not any(is_held_out(n) for n in corpus.relative(corpus.train))


TC = TrainConfig(steps=6, batch=2, seq_len=32, vocab_size=300, save_every=100, warmup=2)


def _weights_bytes(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: w.numpy().tobytes() for n, w in weights.items()}


# Slow: trains twice.
@pytest.mark.slow
def test_training_is_deterministic_and_resumes_exactly(
    corpus: Corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    straight, cfg, log = train(corpus, tmp_path / "a", TC, TINY)
    progress = capsys.readouterr().err
    assert "step     6/6" in progress and "tok/s" in progress and "main " in progress
    again, _, log_again = train(corpus, tmp_path / "b", TC, TINY)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
    assert _weights_bytes(straight) == _weights_bytes(again) and log == log_again
    assert cfg.vocab_size == 300 and (cfg.bos_token_id, cfg.eos_token_id) == (0, 1)
    assert log[-1]["main"] < log[0]["main"]  # it learns the repeated file

    partial, _, _ = train(corpus, tmp_path / "c", TC, TINY, stop_at=3)
    assert (tmp_path / "c" / STATE_FILE).exists()
    assert _weights_bytes(partial) != _weights_bytes(straight)
    resumed, _, resumed_log = train(corpus, tmp_path / "c", TC, TINY)
    assert "resuming at step 3" in capsys.readouterr().err
    assert _weights_bytes(resumed) == _weights_bytes(straight)
    assert resumed_log == log

    with pytest.raises(ValueError, match="other training settings"):
        train(corpus, tmp_path / "c", replace(TC, lr=1e-4), TINY)


def test_prompts_end_at_a_def_past_the_first_quarter() -> None:
    prompt = prompt_from(SOURCE * 2)
    assert prompt is not None and prompt.splitlines()[-1].lstrip().startswith("def ")
    assert len(prompt.splitlines()) == 17
    assert prompt_from("x = 1\n" * 40) is None


@pytest.mark.parametrize(
    ("continuation", "ok"),
    [
        ("        self.size = 0\n        return self.size\n", True),
        ("        if by:\n            return self.grow(\n                by,\n", True),
        ('        """Grow.\n\n        More.\n', True),  # open docstring at the cut
        ("04_____0404\n0404____\n", False),
        ("        x = = 1\n        y = 2\n", False),
        ("        return 1\n    x\n  y\n", False),  # a dedent to no enclosing level
        ("\n\n", False),
    ],
)
def test_looks_like_python(continuation: str, ok: bool) -> None:
    assert looks_like_python("class A:\n    def grow(self, by):\n", continuation) is ok


def test_layers_repeat_the_qwen3_next_pattern() -> None:
    cfg = model_config(300, 0, 1, layers=12)
    assert cfg.num_hidden_layers == 12 and cfg.num_nextn_predict_layers == 1
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + cfg.layer_types[:8]
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7, 11]
    parser = argparse.ArgumentParser()
    add_args(parser)
    assert parser.parse_args(["--layers", "12"]).layers == 12
    for bad in ("6", "0", "-4"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--layers", bad])


def test_distillation_moves_only_the_head_and_resumes_exactly(
    corpus: Corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tc = replace(TC, distill_steps=4)
    trained, cfg, _ = train(corpus, tmp_path / "main", tc, TINY)
    tokens = prepare(corpus, tmp_path / "main", tc)[0]

    def run(work: Path, stop_at: int | None = None) -> tuple[dict[str, bytes], list[dict]]:
        model = TrainForward(cfg, {n: w.clone() for n, w in trained.items()}, tc.seq_len)
        log, seconds = distill(tokens, work, tc, model, stop_at)
        assert seconds > 0
        return _weights_bytes({n: w.detach() for n, w in model.p.items()}), log

    straight, log = run(tmp_path / "a")
    before = _weights_bytes(trained)
    moved = {n for n in before if before[n] != straight[n]}
    assert moved and all(n.startswith("mtp.") for n in moved), moved
    assert len(log) == 4 and set(log[0]) == {"step", "distill_mtp", "distill_mtp2"}
    run(tmp_path / "b", stop_at=2)
    assert (tmp_path / "b" / DISTILL_FILE).exists()
    resumed, resumed_log = run(tmp_path / "b")
    assert "resuming distillation at step 2" in capsys.readouterr().err
    assert resumed == straight and resumed_log == log
    with pytest.raises(ValueError, match="other training settings"):
        run_other = TrainForward(cfg, dict(trained), tc.seq_len)
        distill(tokens, tmp_path / "b", replace(tc, distill_lr=1e-5), run_other)
    # The main run's state ignores the distillation's settings.
    again, _, _ = train(corpus, tmp_path / "main", replace(tc, distill_steps=9), TINY)
    assert _weights_bytes(again) == before


def test_distillation_pairs_each_head_row_with_the_targets_next_position() -> None:
    """Row t of the head's first pass and the target at t + 1 both predict token t + 2."""
    params = init_weights(TINY, 5)
    model = TrainForward(TINY, params, 16)
    tokens = torch.randint(0, TINY.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    losses = model.distill_losses(tokens)
    with torch.no_grad():
        hidden = model.hidden(tokens)
        first, second = model.mtp(tokens, hidden, True)
        teacher = torch.log_softmax(hidden @ model.lm_head.T, -1)
        assert first is not None and second is not None

        def kl(h: torch.Tensor, rows: range, shift: int) -> float:
            student = torch.log_softmax(h @ model.lm_head.T, -1)
            total = sum(
                (teacher[0, t + shift].exp() * (teacher[0, t + shift] - student[0, t])).sum()
                for t in rows
            )
            return float(total) / len(rows)

    assert float(losses["mtp"]) == pytest.approx(kl(first, range(10), 1), rel=1e-4)
    assert float(losses["mtp2"]) == pytest.approx(kl(second, range(9), 2), rel=1e-4)
    # `hard` adds the cross-entropy on the target's argmax at the same pairing.
    with torch.no_grad():
        student = torch.log_softmax(first @ model.lm_head.T, -1)
        nll = -sum(float(student[0, t, teacher[0, t + 1].argmax()]) for t in range(10)) / 10
    hard = model.distill_losses(tokens, hard=0.5)
    assert float(hard["mtp"]) == pytest.approx(float(losses["mtp"]) + 0.5 * nll, rel=1e-4)
