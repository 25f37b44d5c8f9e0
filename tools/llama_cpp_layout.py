"""A checkpoint of the bundled model's kind (Qwen3-Next's layout, a dense MLP) as llama.cpp
converts it, for `tools/bench/llama_cpp.py`: llama.cpp's `qwen3next` takes only the routed-MoE
form, while its `qwen35` (Qwen3.5, dense) is the same network with the Gated DeltaNet's input
projections unfused. So:

    python -m tools.llama_cpp_layout MODEL DIR          # the Qwen3.5-layout copy, in DIR
    python -m tools.llama_cpp_layout --convert LLAMA_CPP DIR OUT.gguf

The copy splits each `in_proj_qkvz` into `in_proj_qkv` and `in_proj_z`, and each `in_proj_ba`
into `in_proj_b` and `in_proj_a`, per key-head group as Qwen3-Next fuses them; every other
tensor is copied as it is. Its config names the Qwen3.5 text model, whose rotary embedding is
sectioned (M-RoPE, interleaved): with text alone every section reads the same position, so
any sections that cover the rotary half give the plain rotary embedding the model was trained
with. `--convert` runs llama.cpp's own `convert_hf_to_gguf.py` from a llama.cpp checkout,
telling it the pre-tokenizer is GPT-2's (the bundled tokenizer is a byte-level BPE with GPT-2's
split pattern; the converter knows tokenizers by a hash of their output, and ours is not in its
table)."""

from __future__ import annotations

import argparse
import json
import runpy
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def split_tensors(tensors: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Qwen3-Next's fused GDN input projections as Qwen3.5's four."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, hidden = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    per = hv // hk  # value heads per key head
    out = {}
    for name, w in tensors.items():
        if name.endswith("in_proj_qkvz.weight"):
            base = name.removesuffix("qkvz.weight")
            q, k, v, z = w.view(hk, 2 * dk + 2 * per * dv, hidden).split(
                [dk, dk, per * dv, per * dv], dim=1
            )
            qkv = [q.reshape(hk * dk, hidden), k.reshape(hk * dk, hidden), v.reshape(-1, hidden)]
            out[base + "qkv.weight"] = torch.cat(qkv).contiguous()
            out[base + "z.weight"] = z.reshape(hv * dv, hidden).contiguous()
        elif name.endswith("in_proj_ba.weight"):
            base = name.removesuffix("ba.weight")
            b, a = w.view(hk, 2 * per, hidden).split([per, per], dim=1)
            out[base + "b.weight"] = b.reshape(hv, hidden).contiguous()
            out[base + "a.weight"] = a.reshape(hv, hidden).contiguous()
        else:
            out[name] = w
    return out


def qwen35_config(cfg: dict) -> dict:
    """The config llama.cpp's converter reads as `qwen35`."""
    if cfg.get("num_experts"):
        raise ValueError(
            "a routed-MoE checkpoint converts as llama.cpp's qwen3next as it is; this layout "
            "is for a dense one"
        )
    rope = dict(cfg["rope_parameters"])
    half = int(cfg["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
    rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    rope["mrope_interleaved"] = True
    kinds = cfg["layer_types"]
    every = kinds.index("full_attention") + 1
    if any(((i + 1) % every == 0) != (k == "full_attention") for i, k in enumerate(kinds)):
        raise ValueError(f"layer_types {kinds} are not one full-attention layer every {every}")
    return {
        **cfg,
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "rope_parameters": rope,
        "full_attention_interval": every,
        "mtp_num_hidden_layers": cfg.get("num_nextn_predict_layers", 0),
    }


def write(model: Path, out: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(qwen35_config(cfg), indent=2))
    tensors = split_tensors(load_file(model / "model.safetensors"), cfg)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in COPIED:
        if (model / name).is_file():
            shutil.copy(model / name, out / name)


def convert(llama_cpp: Path, layout: Path, gguf: Path) -> None:
    """llama.cpp's converter on `layout`, in fp32, the pre-tokenizer named GPT-2's."""
    sys.path.insert(0, str(llama_cpp))
    import conversion.base as base  # llama.cpp's converter package, from the checkout

    for cls in vars(base).values():
        if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
            setattr(cls, "get_vocab_base_pre", lambda self, tokenizer: "gpt-2")  # noqa: B010
    script = llama_cpp / "convert_hf_to_gguf.py"
    sys.argv = [str(script), str(layout), "--outfile", str(gguf), "--outtype", "f32"]
    runpy.run_path(str(script), run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--convert", type=Path, metavar="LLAMA_CPP", default=None)
    parser.add_argument("source", type=Path, help="the model (or, with --convert, the copy)")
    parser.add_argument("out", type=Path, help="the copy's directory (with --convert, the GGUF)")
    args = parser.parse_args(argv)
    if args.convert is None:
        write(args.source, args.out)
    else:
        convert(args.convert, args.source, args.out)


if __name__ == "__main__":
    main()
