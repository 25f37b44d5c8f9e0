"""The one quantization the engine serves: block-scaled FP8 as Qwen publishes it (the
DeepSeek-V3 layout, `quantization_config` `{"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`), and which tensors it covers.

A linear's `weight` is float8_e4m3fn with `weight_scale_inv` `[ceil(out / 128), ceil(in / 128)]`
beside it; the linears named by `modules_to_not_convert` stay in the checkpoint's dtype, as do
the embedding, the norms and the GDN's conv taps, A_log and dt_bias. The math lives in
`kernels/fp8/naive.py`; this module says what a config asks for and refuses what it cannot
serve."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.fp8.format import BLOCK

METHOD = "fp8"
FMT = "e4m3"
ACTIVATIONS = "dynamic"
SCALE_SUFFIX = "weight_scale_inv"
# The linears Qwen's FP8 checkpoints keep in bf16, by module name within a layer: the output
# head, the router and the shared expert's gate (tiny, and a flipped expert choice changes a
# token), and the GDN's b/a projection (it sets the decay and the write strength of the state).
# Qwen3.5's b and a are projections of their own.
PUBLISHED_NOT_CONVERTED = (
    "lm_head",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "in_proj_ba",
    "in_proj_b",
    "in_proj_a",
)
# Tensors never held in FP8 whatever the checkpoint lists: looked up, not multiplied.
NEVER_FP8 = "embed_tokens.weight"


@dataclass(frozen=True)
class Fp8Blocks:
    """A checkpoint's block FP8 `quantization_config`, as read."""

    not_converted: tuple[str, ...] = ()  # modules_to_not_convert

    @property
    def name(self) -> str:
        """How Capabilities and the plan name it."""
        return f"{METHOD}-{FMT}-block{BLOCK}"

    def to_dict(self) -> dict:
        return {
            "quant_method": METHOD,
            "fmt": FMT,
            "activation_scheme": ACTIVATIONS,
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": list(self.not_converted),
        }

    def keeps(self, weight_name: str) -> bool:
        """Whether `modules_to_not_convert` keeps the linear of `weight_name` unquantized. An
        entry names a module by whole dotted parts: `mlp.gate` matches
        `model.layers.3.mlp.gate`, not `mlp.gate_proj` nor `mlp.shared_expert_gate`."""
        parts = weight_name.removesuffix(".weight").split(".")
        for entry in self.not_converted:
            want = entry.split(".")
            if any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
                return True
        return False


# Keys of a supported config and the value each must have; any other key is refused.
_REQUIRED = {"quant_method": METHOD, "fmt": FMT, "activation_scheme": ACTIVATIONS}
_KNOWN = {*_REQUIRED, "weight_block_size", "modules_to_not_convert", "ignored_layers"}


def parse(config: dict | None) -> Fp8Blocks | None:
    """config.json's `quantization_config` -> what it asks for, or None without one. Anything
    this engine does not serve raises ValueError with a sentence naming it."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config is {config!r}; expected an object")
    method = config.get("quant_method")
    block = config.get("weight_block_size")
    if method != METHOD or block != [BLOCK, BLOCK]:
        raise ValueError(
            f"quantization_config asks for quant_method {method!r} with weight_block_size "
            f"{block!r}; this engine serves {METHOD!r} with [{BLOCK}, {BLOCK}] only"
        )
    for key, want in _REQUIRED.items():
        if config.get(key, want) != want:
            raise ValueError(
                f"quantization_config {key} is {config[key]!r}; this engine serves {want!r} only"
            )
    unknown = sorted(set(config) - _KNOWN)
    if unknown:
        raise ValueError(f"quantization_config has {unknown[0]!r}, which this engine does not read")
    # vLLM's FP8 configs name the kept modules `ignored_layers`; both mean the same.
    kept = [*(config.get("modules_to_not_convert") or ()), *(config.get("ignored_layers") or ())]
    if not all(isinstance(m, str) for m in kept):
        raise ValueError("quantization_config modules_to_not_convert must list module names")
    return Fp8Blocks(tuple(kept))


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the tensor `name` of `shape` is a linear's weight, which FP8 may hold."""
    return name.endswith(".weight") and len(shape) == 2 and not name.endswith(NEVER_FP8)


def fp8_names(quant: Fp8Blocks | None, shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """The weights a checkpoint quantized under `quant` holds in FP8 (what `met quantize`
    writes, and what a plan made from a bare config counts)."""
    if quant is None:
        return set()
    return {n for n, s in shapes.items() if quantizable(n, s) and not quant.keeps(n)}


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A weight [out, in]'s weight_scale_inv shape."""
    out, inp = shape
    return -(-out // BLOCK), -(-inp // BLOCK)
