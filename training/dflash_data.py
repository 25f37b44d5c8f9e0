"""`met train dflash`'s data: the target's own greedy continuations of the training corpus,
made by the engine (DFlash's data choice: a draft stands when it is the target's choice), and
the target's tapped layer outputs over each whole sequence, computed once (the target is
frozen, so no training step runs it again).

Prompts are windows of the corpus's training stream drawn from `seed`; continuations are made
in rounds of `ROUND` concurrent requests, each round saved, so an interrupted run resumes at
the round it stopped in."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gpu_service.model.config import ModelConfig
from training.corpus import Corpus, encode_files
from training.dflash_options import DFlashTrainConfig
from training.forward import TrainForward

ROUND = 32  # requests served at once while generating
DATA_FILE = "data.pt"
TAPS_BATCH = 8


def prompts(stream: torch.Tensor, tc: DFlashTrainConfig) -> list[tuple[int, ...]]:
    """`tc.sequences` windows of `tc.prompt_len` tokens of `stream`, at offsets from `seed`."""
    gen = torch.Generator().manual_seed(tc.seed * 7919 + 1)
    starts = torch.randint(0, stream.numel() - tc.prompt_len, (tc.sequences,), generator=gen)
    return [tuple(stream[s : s + tc.prompt_len].tolist()) for s in starts.tolist()]


def continue_greedily(
    model_dir: Path, batch: list[tuple[int, ...]], tokens: int
) -> list[list[int]]:
    """The target's greedy continuation of each prompt, `tokens` long (past any EOS), served
    in process with MTP drafts (lossless: the tokens are plain greedy decoding's)."""
    from control_plane.scheduler.seq import GenRequest
    from control_plane.text.tokenizer import load_tokenizer
    from gpu_service.engine.facade import Engine
    from gpu_service.model.config import ServiceConfig
    from protos.params import MTP
    from tools.bench.workload import serve

    engine = Engine(model_dir, ServiceConfig())
    reqs = [
        GenRequest(f"dflash-data-{i}", p, tokens, method=MTP, ignore_eos=True)
        for i, p in enumerate(batch)
    ]
    out = serve(lambda: engine, reqs, load_tokenizer(model_dir))
    if out["failed"]:
        raise RuntimeError(f"generating the data, requests failed: {out['failed']}")
    return [out["tokens"][r.request_id][:tokens] for r in reqs]


def sequences(model_dir: Path, corpus: Corpus, work: Path, tc: DFlashTrainConfig) -> torch.Tensor:
    """Prompt and continuation of every sequence: int64 [N, prompt_len + gen_len], resumed
    from the rounds already saved in `work`."""
    path = work / "sequences.pt"
    done: list[list[int]] = torch.load(path)["rows"] if path.exists() else []
    stream = encode_files(model_dir / "tokenizer.json", corpus.train)
    todo = prompts(stream, tc)
    while len(done) < len(todo):
        batch = todo[len(done) : len(done) + ROUND]
        made = continue_greedily(model_dir, batch, tc.gen_len)
        done.extend(list(p) + m for p, m in zip(batch, made, strict=True))
        torch.save({"rows": done}, path)
        print(f"generated {len(done)}/{len(todo)} sequences", file=sys.stderr)
    return torch.tensor(done, dtype=torch.long)


def taps_of(target: TrainForward, tokens: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The drafter's context over every sequence: [N, T, K * H] bf16."""
    out = []
    with torch.no_grad():
        for i in range(0, tokens.shape[0], TAPS_BATCH):
            out.append(target.taps(tokens[i : i + TAPS_BATCH], layer_ids).bfloat16())
    return torch.cat(out)


def build(
    model_dir: Path,
    cfg: ModelConfig,
    params: dict[str, torch.Tensor],
    corpus: Corpus,
    work: Path,
    tc: DFlashTrainConfig,
) -> dict[str, torch.Tensor]:
    """{"tokens": [N, T], "taps": [N, T, K * H]}, cached in `work` for these settings."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / DATA_FILE
    key = [tc.sequences, tc.prompt_len, tc.gen_len, tc.seed, list(tc.taps)]
    if path.exists():
        saved = torch.load(path)
        if saved.pop("key") == key:
            return saved
    tokens = sequences(model_dir, corpus, work, tc)
    target = TrainForward(cfg, params, tc.seq_len)
    data = {"tokens": tokens, "taps": taps_of(target, tokens, tc.taps)}
    torch.save({"key": key, **data}, path)
    return data
