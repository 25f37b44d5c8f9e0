"""The committed default checkpoint, trained by `met train`: it loads with no download, its
greedy text from held-out prompts is Python, and its MTP head's drafts are accepted; the
4-layer trained fixture's drafts too, as the tests that use it rely on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from control_plane.text.tokenizer import HFTokenizer, load_tokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.weights import WEIGHTS_FILE
from protos.defaults import DEFAULT_MODEL_DIR
from protos.params import MTP, NONE
from tests.conftest import TRAINED
from tools.bench.workload import FIXED_DRAFTS, serve_texts
from training.evaluate import PROMPTS_FILE, load_prompts, looks_like_python

# Slow: serves the bundled checkpoint end to end.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(DEFAULT_MODEL_DIR, ServiceConfig())


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return load_prompts(DEFAULT_MODEL_DIR)


def test_the_checkpoint_is_committed_small_and_bf16() -> None:
    path = DEFAULT_MODEL_DIR / WEIGHTS_FILE
    assert path.stat().st_size < 8 * 2**20
    with safe_open(str(path), "pt") as f:
        assert {str(f.get_tensor(n).dtype) for n in f.keys()} == {"torch.bfloat16"}
        assert any(n.startswith("mtp.") for n in f.keys())
    for name in ("config.json", "tokenizer.json", "README.md", PROMPTS_FILE):
        assert (DEFAULT_MODEL_DIR / name).exists(), name


def test_it_loads_with_its_bpe_tokenizer(engine: Engine) -> None:
    caps = engine.capabilities()
    cfg = ModelConfig.load(DEFAULT_MODEL_DIR)
    assert caps.has_mtp and caps.vocab_size == cfg.vocab_size == 4096
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    assert isinstance(tok, HFTokenizer)
    text = "    def grow(self, by):\n        return self.size + by\n"
    ids = tok.encode(text)
    assert len(ids) < len(text) / 2, "merges learnt from the corpus"
    assert tok.decode(ids) == text
    assert tok.special_tokens == {"<|bos|>": cfg.bos_token_id, "<|eos|>": cfg.eos_token_id}


def test_greedy_text_from_held_out_prompts_is_python(engine: Engine, prompts: list[str]) -> None:
    """Most continuations of a `def` compile as Python; a 1.6M-parameter model repeats
    itself and sometimes writes nonsense (the card reports the whole count)."""
    held = json.loads((DEFAULT_MODEL_DIR / PROMPTS_FILE).read_text())
    assert len(prompts) >= 16 and all(p["file"].endswith(".py") for p in held)
    sample = prompts[:8]
    texts = serve_texts(lambda: engine, DEFAULT_MODEL_DIR, sample, NONE, 48)["texts"]
    good = [looks_like_python(p, t) for p, t in zip(sample, texts, strict=True)]
    assert sum(good) >= 6, texts


@pytest.mark.parametrize("model_dir", [DEFAULT_MODEL_DIR, TRAINED], ids=["default", "fixture"])
def test_mtp_drafts_are_accepted_and_lossless(model_dir: Path) -> None:
    engine = Engine(model_dir, ServiceConfig())
    sample = load_prompts(model_dir)[4:12]
    plain = serve_texts(lambda: engine, model_dir, sample, NONE, 48)
    spec = serve_texts(lambda: engine, model_dir, sample, MTP, 48, FIXED_DRAFTS)
    stats = spec["spec"]
    # 3 drafts at every verify but each sequence's first (it bootstraps the drafter) and
    # its last (cut to the tokens left)
    assert stats.drafted_at[2] >= stats.verifies - 2 * len(sample)
    assert spec["texts"] == plain["texts"]
    assert spec["accepted_length"] > 1.5, spec["acceptance"]
