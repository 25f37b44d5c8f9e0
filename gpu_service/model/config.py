"""Model configuration with HF `Qwen3NextConfig` field names, and the service's own settings.
A `config.json` is read as transformers reads it (`gpu_service/model/hf_config.py`)."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path

from gpu_service.model import hf_config
from gpu_service.model.quantization import Fp8Blocks
from gpu_service.model.quantization import parse as parse_quantization
from gpu_service.model.vision_config import VisionConfig
from kernels.attention.format import KEY_BLOCK
from protos import checks

LINEAR = hf_config.LINEAR
FULL = hf_config.FULL


# Qwen3-Next's layers repeat this: three Gated DeltaNet layers, then one gated attention layer.
LAYER_PATTERN = (LINEAR, LINEAR, LINEAR, FULL)


@dataclass(frozen=True)
class Yarn:
    """`rope_type: yarn`'s parameters, as transformers' `_compute_yarn_parameters` reads them."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.factor, (int, float)) or not self.factor >= 1:
            raise ValueError(f"rope_parameters.factor is {self.factor!r}; yarn needs one >= 1")
        if self.original_max_position_embeddings < 1:
            raise ValueError("rope_parameters.original_max_position_embeddings must be >= 1")

    @property
    def scale(self) -> float:
        """The factor on cos and sin (the paper's attention temperature)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ModelConfig:
    # The defaults are the bundled checkpoint's (trained by `met train`): Qwen3-Next's layer
    # pattern at 12 target layers, narrow enough to train on two CPU cores in under 3 hours.
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 12
    layer_types: tuple[str, ...] = LAYER_PATTERN * 3
    # gated full attention
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.5
    rope_theta: float = 10000.0
    # Gated DeltaNet
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1  # the first EOS id; `all_eos` has every one
    # EOS ids beyond the first: config.json's list, and generation_config.json's (a list in
    # Qwen checkpoints), which is where transformers' generate reads them.
    more_eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    model_type: str = "qwen3_next"
    # sparse MoE (Qwen3-Next): layers not in mlp_only_layers whose index + 1 is a multiple
    # of decoder_sparse_step use num_experts experts when num_experts > 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool = False  # not supported: no checkpoint of this family uses it
    rope_type: str = "default"  # or "yarn", with its parameters in `yarn`
    yarn: Yarn | None = None
    # config.json's `quantization_config`: block FP8 (gpu_service/model/quantization.py) or none.
    quantization: Fp8Blocks | None = None
    # Where the text model's tensors sit in the checkpoint: `model.`, or Qwen3.5's
    # `model.language_model.` beside its vision tower (`model.visual.`).
    weight_prefix: str = "model."
    # The vision tower beside the text model (Qwen3.5), and how its images' tokens are placed;
    # None: no tower (Qwen3-Next, or a checkpoint without `model.visual.*` tensors).
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(self, "more_eos_token_ids", tuple(self.more_eos_token_ids))
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok is {self.num_experts_per_tok}; it must be in "
                f"1 ..= num_experts ({self.num_experts})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in (LINEAR, FULL):
                raise ValueError(f"layer_types[{i}] is {kind!r}; expected {LINEAR!r} or {FULL!r}")
        if self.attention_bias:
            raise ValueError("attention_bias is true; this model has no attention biases")
        if (self.rope_type == "yarn") != (self.yarn is not None):
            raise ValueError(f"rope_type {self.rope_type!r} does not match its parameters")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def is_moe_layer(self, n: int) -> bool:
        return (
            self.num_experts > 0
            and n not in self.mlp_only_layers
            and (n + 1) % self.decoder_sparse_step == 0
        )

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def canonical(self, name: str) -> str:
        """A checkpoint tensor's name as the model knows it: the text model under `model.`."""
        if self.weight_prefix != "model." and name.startswith(self.weight_prefix):
            return "model." + name.removeprefix(self.weight_prefix)
        return name

    @property
    def separate_gdn_projections(self) -> bool:
        """Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` in place of
        Qwen3-Next's per-key-head interleaved `in_proj_qkvz` and `in_proj_ba`."""
        return self.model_type.startswith("qwen3_5")

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def vision_params(self) -> int:
        """Parameters of the vision tower (0 without one)."""
        return 0 if self.vision is None else self.vision.params

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A four-layer hybrid (three GDN, one attention) small enough for interpreter runs:
        the tests' model and the device check's."""
        return cls(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            layer_types=(LINEAR, LINEAR, LINEAR, FULL),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            partial_rotary_factor=0.25,
            tie_word_embeddings=False,
            max_position_embeddings=512,
            bos_token_id=256,
            eos_token_id=257,
        )

    @property
    def all_eos(self) -> tuple[int, ...]:
        """Every id that ends a sequence, the first EOS first, each once."""
        ids = (self.eos_token_id, *self.more_eos_token_ids)
        return tuple(i for i in dict.fromkeys(ids) if i is not None)

    def to_json(self) -> str:
        """A Qwen3-Next `config.json` of this config, as transformers 5 writes one."""
        if self.weight_prefix != "model." or self.separate_gdn_projections:
            raise ValueError(f"only a qwen3_next config is written, not {self.model_type!r}")
        d = asdict(self)
        more = d.pop("more_eos_token_ids")
        if more:
            d["eos_token_id"] = list(self.all_eos)
        d["layer_types"] = list(self.layer_types)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["architectures"] = ["Qwen3NextForCausalLM"]
        for key in ("quantization", "yarn", "weight_prefix", "rope_theta", "rope_type"):
            d.pop(key)
        d.pop("vision")
        d.pop("partial_rotary_factor")
        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        rope["partial_rotary_factor"] = self.partial_rotary_factor
        d["rope_parameters"] = rope | (self.yarn.to_dict() if self.yarn else {})
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_dict()
        return json.dumps(d, indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """config.json's object, read as transformers reads it (`gpu_service/model/hf_config.py`):
        what it leaves out takes transformers' default for its model type."""
        fields, prefix = hf_config.text_fields(d)
        vision = fields.pop("vision", None)
        eos, bos = fields.pop("eos_token_id"), fields.pop("bos_token_id")
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        yarn = fields.pop("yarn", None)
        quantization = parse_quantization(fields.pop("quantization_config", None))
        # Every field from the file or transformers' defaults, none from the bundled model's.
        unset = {f.name for f in dataclass_fields(cls)} - set(fields) - _FROM_DICT_OWN
        assert not unset, f"hf_config left {sorted(unset)} to the bundled model's defaults"
        return cls(
            **fields,
            eos_token_id=eos_ids[0] if eos_ids else None,
            more_eos_token_ids=tuple(eos_ids[1:]),
            bos_token_id=(bos or [None])[0] if isinstance(bos, list) else bos,
            yarn=Yarn(**yarn) if yarn is not None else None,
            quantization=quantization,
            weight_prefix=prefix,
            vision=None if vision is None else VisionConfig(**vision),
        )

    @classmethod
    def load(cls, directory: Path) -> ModelConfig:
        """config.json, with the EOS ids of every place a checkpoint writes one, as vLLM takes
        them: config.json's, generation_config.json's, and the tokenizer's `eos_token`."""
        cfg = cls.from_dict(read_json(directory / "config.json"))
        generation = directory / "generation_config.json"
        eos = read_json(generation).get("eos_token_id") if generation.exists() else None
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        ids.extend(tokenizer_eos(directory))
        every = tuple(dict.fromkeys((*cfg.all_eos, *ids)))
        if not every:
            return cfg
        first = cfg.eos_token_id if cfg.eos_token_id is not None else every[0]
        more = tuple(i for i in every if i != first)
        return replace(cfg, eos_token_id=first, more_eos_token_ids=more)


# What from_dict sets itself, beside hf_config's fields.
_FROM_DICT_OWN = {
    "eos_token_id",
    "more_eos_token_ids",
    "bos_token_id",
    "yarn",
    "quantization",
    "weight_prefix",
    "vision",
}


def tokenizer_eos(directory: Path) -> list[int]:
    """The id of tokenizer_config.json's `eos_token` (a string, or an AddedToken as a dict) in
    tokenizer.json (its added tokens, then its vocabulary); none where either file lacks it."""
    config, tokenizer = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not config.exists() or not tokenizer.exists():
        return []
    token = read_json(config).get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if not isinstance(token, str):
        return []
    spec = read_json(tokenizer)
    added = {t.get("content"): t.get("id") for t in spec.get("added_tokens") or ()}
    vocab = (spec.get("model") or {}).get("vocab")
    found = added.get(token, vocab.get(token) if isinstance(vocab, dict) else None)
    return [found] if isinstance(found, int) else []


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file; ValueError naming it when it is not JSON or not an object."""
    try:
        body = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise ValueError(f"{path} holds {type(body).__name__}; expected a JSON object")
    return body


@functools.cache
def _slot_drafts(spec: str, slots: int | None) -> tuple[int, ...]:
    """Each slot's verify capacity: the tiers', the last one's past them (`slots`: how many;
    None: the tiers' own count). Cached: a step asks it of every sequence it verifies."""
    tiers = parse_tiers(spec)
    return tiers if slots is None else tiers[:slots] + tiers[-1:] * (slots - len(tiers))


def parse_tiers(spec: str) -> tuple[int, ...]:
    """`"8:3,8:2,16:1"` -> per-slot verify capacity in drafts: (3,)*8 + (2,)*8 + (1,)*16."""
    pairs = checks.parse_pairs(spec, "verify tier", "SLOTS", "DRAFTS")
    return tuple(drafts for count, drafts in pairs for _ in range(count))


# The verify tiers a service with a DFlash drafter takes unless told otherwise: a whole block's
# drafts (15) on the low slots, which serve the few-request steps the gamma resolver drafts
# widest at; every row a slot can verify holds its GDN state (the plan counts them).
DFLASH_VERIFY_TIERS = "4:15,4:7,8:3,16:1"


@dataclass(frozen=True)
class ServiceConfig:
    verify_tiers: str = "8:3,8:2,16:1"  # DFLASH_VERIFY_TIERS when a DFlash drafter serves
    max_context: int = 1024  # a multiple of the attention key block (64); a per-sequence limit
    # Blocks of the paged attention KV pool (target and drafter), each KEY_BLOCK positions of
    # every attention layer; 0: enough for every slot's whole context.
    kv_blocks: int = 0
    # Prefix snapshots the service can hold: each a copy of every GDN layer's state and conv
    # window, and the drafter's carry, at a block boundary of a sequence (0: no prefix cache).
    prefix_snapshots: int = 0
    max_rows: int = 64  # row budget of one batched call
    max_batch: int = 32  # sequences in one batched verify or propose (stash width)
    max_prefill_tokens: int = 4096  # tokens in one prefill call, over all sequences
    cuda_graphs: bool = (
        True  # replay captured graphs on a CUDA device (gpu_service/engine/graphs.py)
    )
    # Compile the step on the CPU (gpu_service/engine/compiled.py): the library's engines stay
    # eager unless asked; `met gpu-service serve` asks by default where a C++ compiler is.
    compile: bool = False
    compile_cache: str = ""  # inductor's cache directory ("": `compiled.cache_dir()`)
    # --num-slots: None gives one slot per tier entry; N gives the tiers' capacities to the
    # first N slots and the last tier's to any beyond them.
    num_slots_override: int | None = None
    # The images a prompt may hold (vLLM's --limit-mm-per-prompt, whose V1 default is 999) and
    # the pixels one may cover, t * h * w patches of patch_size ** 2 (Qwen3-VL's processor's
    # size.longest_edge, 4096 x 4096, which vLLM takes from it): a prefill past either is
    # refused, and the plan counts the tower's activations at the largest image.
    max_images_per_prompt: int = 999
    max_image_pixels: int = 16777216

    def __post_init__(self) -> None:
        if self.num_slots_override is not None and self.num_slots_override < 1:
            raise ValueError(f"num_slots_override is {self.num_slots_override}; it must be >= 1")
        if self.kv_blocks < 0:
            raise ValueError(f"kv_blocks is {self.kv_blocks}; it must be >= 0 (0: every context)")
        if self.prefix_snapshots < 0:
            raise ValueError(f"prefix_snapshots is {self.prefix_snapshots}; it must be >= 0")
        if min(self.max_images_per_prompt, self.max_image_pixels) < 1:
            raise ValueError("max_images_per_prompt and max_image_pixels must be >= 1")

    @property
    def slot_verify_drafts(self) -> tuple[int, ...]:
        return _slot_drafts(self.verify_tiers, self.num_slots_override)

    @property
    def num_slots(self) -> int:
        return len(self.slot_verify_drafts)

    @property
    def blocks_per_sequence(self) -> int:
        """KV blocks that hold one sequence's whole context: a block table's width."""
        return -(-self.max_context // KEY_BLOCK)

    @property
    def num_kv_blocks(self) -> int:
        """The KV pool's blocks: `kv_blocks`, or every slot's whole context."""
        return self.kv_blocks or self.num_slots * self.blocks_per_sequence
