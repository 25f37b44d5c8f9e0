"""Held-out evaluation of an exported checkpoint, as the service runs it: perplexity of the
main model and of the MTP head, the drafter's acceptance under the real scheduler (3 drafts,
greedy), and greedy samples; then the model card."""

from __future__ import annotations

import codeop
import json
import math
import textwrap
import warnings
from pathlib import Path

import torch

from training.corpus import Corpus, read_text

PROMPTS_FILE = "held_out_prompts.json"
PROMPT_LINES = 16


def prompt_from(text: str) -> str | None:
    """The lines before the first `def` past the file's first quarter, and that line without
    its newline: the model is asked for a function body. (The BPE merges a newline with the
    indentation after it, so a prompt ending in a bare newline ends on a token the model never
    saw there.) None when the file has no such line."""
    lines = text.splitlines(keepends=True)
    for k in range(max(PROMPT_LINES, len(lines) // 4), len(lines)):
        if lines[k].lstrip().startswith("def ") and lines[k].rstrip().endswith(":"):
            return "".join(lines[k - PROMPT_LINES : k + 1]).rstrip("\r\n")
    return None


def held_out_prompts(corpus: Corpus) -> list[dict]:
    out = []
    for path, rel in zip(corpus.held_out, corpus.relative(corpus.held_out), strict=True):
        prompt = prompt_from(read_text(path))
        if prompt is not None:
            out.append({"file": rel, "prompt": prompt})
    return out


def load_prompts(model_dir: Path) -> list[str]:
    return [p["prompt"] for p in json.loads((model_dir / PROMPTS_FILE).read_text())]


def looks_like_python(prompt: str, continuation: str, lines: int = 8) -> bool:
    """Whether the prompt's last line (a `def`) and the first `lines` complete lines of its
    continuation compile as Python, a statement left open at the cut allowed, with at least
    two non-blank lines of body."""
    text = (prompt + continuation).splitlines(keepends=True)
    if text and not text[-1].endswith("\n"):
        text.pop()  # the line the token budget cut, not the model
    head = len(prompt.splitlines()) - 1  # the def line, wherever the prompt's cut fell
    body = text[head + 1 : head + 1 + lines]
    if sum(1 for line in body if line.strip()) < 2:
        return False
    source = textwrap.dedent("".join(text[head : head + 1 + lines]))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. invalid escapes: still Python
            codeop.compile_command(source.rstrip() + "\n", symbol="exec")
    except (SyntaxError, ValueError, OverflowError):
        return False
    return True


def perplexity(model_dir: Path, stream: torch.Tensor, seq_len: int, windows: int) -> dict:
    """exp of the mean cross-entropy over non-overlapping held-out windows, bf16 weights as
    exported."""
    from gpu_service.model.config import ModelConfig
    from gpu_service.model.weights import load_weights
    from training.forward import TrainForward

    cfg = ModelConfig.load(model_dir)
    weights, cfg = load_weights(cfg, model_dir, torch.float32)
    model = TrainForward(cfg, weights, seq_len)
    n = min(windows, (stream.numel() - 1) // (seq_len + 1))
    batch = stream[: n * (seq_len + 1)].view(n, seq_len + 1).long()
    totals: dict[str, float] = {}
    with torch.no_grad():
        for i in range(0, n, 8):
            for k, v in model.losses(batch[i : i + 8, :-1]).items():
                totals[k] = totals.get(k, 0.0) + v.item() * batch[i : i + 8].shape[0]
    return {f"{k}_perplexity": round(math.exp(v / n), 3) for k, v in totals.items()}


def acceptance(model_dir: Path, prompts: list[str], tokens: int, concurrency: int) -> dict:
    """The MTP drafter under the real scheduler, in process, 3 drafts at every verify (no
    ladder, no D-Cut): mean accepted length per verify (bonus token included) and acceptance
    at each draft position, over all prompts."""
    from gpu_service.engine.facade import Engine
    from gpu_service.model.config import ServiceConfig
    from protos.params import MTP
    from tools.bench.workload import FIXED_DRAFTS, serve_texts

    torch.set_num_threads(1)
    engine = Engine(model_dir, ServiceConfig())
    stats, texts = None, []
    for i in range(0, len(prompts), concurrency):
        batch = prompts[i : i + concurrency]
        r = serve_texts(lambda: engine, model_dir, batch, MTP, tokens, FIXED_DRAFTS)
        texts.extend(r["texts"])
        if stats is None:
            stats = r["spec"]
        else:
            stats.merge(r["spec"])
    assert stats is not None
    return {
        "mean_accepted_length": round(stats.mean_accepted_length, 3),
        "acceptance_per_position": [round(a, 3) for a in stats.acceptance_at],
        "verifies": stats.verifies,
        "texts": texts,
    }


def evaluate(model_dir: Path, corpus: Corpus, work: Path) -> dict:
    prompts = held_out_prompts(corpus)
    (model_dir / PROMPTS_FILE).write_text(json.dumps(prompts, indent=2) + "\n")
    held = torch.load(work / "tokens.pt")["held_out"]
    report = perplexity(model_dir, held, 512, 64)
    acc = acceptance(model_dir, [p["prompt"] for p in prompts], 96, 8)
    texts = acc.pop("texts")
    report.update(acc)
    report["prompts"] = len(prompts)
    report["python_like"] = sum(
        looks_like_python(p["prompt"], t) for p, t in zip(prompts, texts, strict=True)
    )
    report["samples"] = [
        {"file": p["file"], "prompt_tail": p["prompt"].splitlines()[-1], "continuation": t}
        for p, t in list(zip(prompts, texts, strict=True))[:2]
    ]
    return report


def write_card(model_dir: Path, report: dict) -> None:
    card = _card_training(report) + _card_evaluation(report) + _card_samples(report)
    (model_dir / "README.md").write_text(card)


def _card_training(report: dict) -> str:
    """The model card's title and how the checkpoint was made."""
    tc = report["train_config"]
    held = ", ".join(f"`{f}`" for f in report["held_out_files"])
    return f"""# met default checkpoint

A {report["parameters"] / 1e6:.2f}M-parameter Qwen3-Next-style hybrid
({_layers(tc["layers"])}, one MTP layer; tied embeddings) trained by `met train` to be
the bundled model of this repository: small enough to serve and test on a CPU, trained well
enough that its MTP head's drafts are accepted, so speculative decoding has something to buy.
It is a test article, not a useful code model.

- Weights: `model.safetensors`, bf16 (trained in fp32). `config.json` says `float32`: the
  dtype the service computes in on a CPU, into which bf16 widens exactly.
- Tokenizer: byte-level BPE, {report["vocab_size"]} tokens, trained with `tokenizers` on the
  training files; `<|bos|>` is 0, `<|eos|>` is 1. Each file is `<|bos|>` + text + `<|eos|>`.
- Corpus: the Python {report["python"]} standard library's `.py` files, without test suites,
  `idlelib` and the generated `encodings` tables: {report["train_files"]} training files;
  {len(report["held_out_files"])} held out, chosen by a hash of their relative path:
  {held}.
- Training: {tc["steps"]} steps of {tc["batch"]} x {tc["seq_len"]} tokens, AdamW (lr
  {tc["lr"]}, warmup {tc["warmup"]}, cosine to {tc["min_lr_ratio"]}x, weight decay
  {tc["weight_decay"]}), seed {tc["seed"]}; loss = main + {tc["mtp_weight"]} x MTP (token
  t+2 from the hidden at t and the embedding of t+1) + {tc["mtp2_weight"]} x the MTP head run
  on its own output (token t+3), as it runs for a second draft. Final training losses:
  {report["final_losses"]}.{_card_distill(report)}
- Time: {report["train_minutes"]} minutes on 2 CPU cores in all, over every sitting (the
  state files keep the seconds each resume spent).

"""


def _layers(n: int) -> str:
    """The target's layers in words."""
    if n == 4:
        return "three Gated DeltaNet layers, one gated-attention layer"
    return (
        f"{n} target layers: three Gated DeltaNet layers then one gated-attention layer, {n // 4}x"
    )


def _card_distill(report: dict) -> str:
    tc = report["train_config"]
    if not tc.get("distill_steps"):
        return ""
    return f"""
- Then {tc["distill_steps"]} steps of the MTP head alone (every other weight frozen) learning
  the trained target's own distributions: KL divergence from the target's at the same
  position, weighted as above, AdamW at lr {tc["distill_lr"]} (`training/distill.py`).
  Final: {report["final_distill_losses"]}."""


def _card_evaluation(report: dict) -> str:
    """The model card's held-out measures and how they were taken."""
    accepted = report["mean_accepted_length"]
    python_like = f"{report['python_like']} of {report['prompts']}"
    per_pos = ", ".join(f"{a:.2f}" for a in report["acceptance_per_position"])
    return f"""## Held-out evaluation (bf16 weights, as served)

| measure | value |
|---|---|
| main model perplexity (64 windows of 512 tokens) | {report["main_perplexity"]} |
| MTP head perplexity, token t+2 (given token t+1) | {report["mtp_perplexity"]} |
| MTP head on its own output, token t+3 (given t+2) | {report["mtp2_perplexity"]} |
| mean accepted length per verify, 3 drafts, greedy, bonus included | {accepted} |
| acceptance at draft positions 1, 2, 3 | {per_pos} |
| continuations that compile as Python (the def and 8 lines) | {python_like} |

Acceptance: each of the {report["prompts"]} held-out prompts (`{PROMPTS_FILE}`: the 16 lines
before a `def` and that line) decoded for 96 tokens through the scheduler with `mtp`, 3 drafts
at every verify (the K ladder and D-Cut off), 8 at a time ({report["verifies"]} verify steps).
Acceptance at position j is the share of verifies whose first j drafts all stood. The MTP
head is given the true token t+1, so it predicts from the context the main model has one
position later: its perplexity is close to the main model's by construction. Greedy text
from a model this small repeats itself (the samples show it), which is also part of why
its drafts stand: the acceptance is of this model's own greedy text, as serving measures it.

"""


def _card_samples(report: dict) -> str:
    """The model card's greedy samples and how to reproduce the checkpoint."""
    samples = "\n".join(
        f"From held-out `{s['file']}`, after `{s['prompt_tail'].strip()}`:\n\n"
        f"```text\n{s['prompt_tail']}{s['continuation']}\n```\n"
        for s in report["samples"]
    )
    return f"""## Samples (greedy)

{samples}
Reproduce: `met train` (writes this directory; `--work` keeps the tokenizer, the token cache
and the resumable state).
"""
