"""`nvg export-hf FILE.cmf OUT/`: a dense Hugging Face folder for other tools (lm-eval, vLLM, transformers).

Every tensor is written dense (BLR dequantised exactly as nvg computes it), with config.json,
tokenizer.json and tokenizer_config.json (chat template, special tokens). A DTG-MA student whose
layers have different MLP widths is padded to the widest layer with zero gate/up rows and zero down
columns, which leaves every output unchanged (silu(0) · 0 = 0).

    nvg export-hf results/model.cmf exported/ [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from nvg import blr as codec
from nvg.cmf import BLR, read_cmf, tensor_to_numpy
from nvg.errors import NvgError, exits_cleanly

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def dense_tensors(cmf) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in cmf.tensors.items():
        if t.dtype == BLR:
            out[name] = torch.from_numpy(codec.decode(bytes(t.data)).dequantize())
        else:
            out[name] = torch.from_numpy(tensor_to_numpy(t))
    return out


def pad_mlp(tensors: dict, num_layers: int) -> int:
    """Pad every layer's MLP to the widest one with zeros; returns that width."""
    widths = [tensors[f"model.layers.{i}.mlp.up_proj.weight"].shape[0] for i in range(num_layers)]
    width = max(widths)
    for i, w in enumerate(widths):
        if w == width:
            continue
        for role in ("gate_proj", "up_proj"):
            name = f"model.layers.{i}.mlp.{role}.weight"
            tensors[name] = torch.cat([tensors[name], tensors[name].new_zeros(width - w, tensors[name].shape[1])])
        name = f"model.layers.{i}.mlp.down_proj.weight"
        tensors[name] = torch.cat([tensors[name], tensors[name].new_zeros(tensors[name].shape[0], width - w)], dim=1)
    return width


def hf_config(arch: dict, intermediate: int, tensors: dict, tok_cfg: dict) -> dict:
    model_type = arch["arch_name"] if arch["arch_name"] in HF_ARCHITECTURES else "llama"
    if model_type == "llama" and "model.layers.0.self_attn.q_norm.weight" in tensors:
        model_type = "qwen3"
    cfg = {
        "architectures": [HF_ARCHITECTURES[model_type]], "model_type": model_type,
        "hidden_size": arch["hidden_size"], "intermediate_size": intermediate, "num_hidden_layers": arch["num_layers"],
        "num_attention_heads": arch["num_attention_heads"], "num_key_value_heads": arch["num_kv_heads"],
        "head_dim": arch["head_dim"], "vocab_size": arch["vocab_size"], "rms_norm_eps": arch["rms_norm_eps"],
        "rope_theta": arch["rope_theta"], "max_position_embeddings": arch["max_position_embeddings"],
        "tie_word_embeddings": arch["tie_word_embeddings"], "hidden_act": "silu",
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors, "mlp_bias": False,
    }
    if tok_cfg.get("bos_token_id") is not None:
        cfg["bos_token_id"] = tok_cfg["bos_token_id"]
    if tok_cfg.get("eos_token_ids"):
        cfg["eos_token_id"] = tok_cfg["eos_token_ids"][0]
    return cfg


def hf_tokenizer_config(vocab: bytes, tok_cfg: dict) -> dict:
    """tokenizer_config.json: special tokens by name and the chat template, from the CMF header."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(vocab.decode("utf-8"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if tok_cfg.get("eos_token_ids"):
        config["eos_token"] = tok.id_to_token(tok_cfg["eos_token_ids"][0])
    for key, name in (("bos_token_id", "bos_token"), ("pad_token_id", "pad_token")):
        if tok_cfg.get(key) is not None:
            config[name] = tok.id_to_token(tok_cfg[key])
    if tok_cfg.get("chat_template"):
        config["chat_template"] = tok_cfg["chat_template"]
    return config


def main(source: Path, out: Path, dtype: str = "float32") -> None:
    from safetensors.torch import save_file

    cmf = read_cmf(source)
    if not cmf.vocab:
        raise NvgError(f"{source}: vocab section is empty: no tokenizer to export")
    arch = cmf.arch
    tensors = dense_tensors(cmf)
    width = pad_mlp(tensors, arch["num_layers"])
    tok_cfg = cmf.header.get("tokenizer_config", {})
    if out.exists() and any(out.iterdir()):
        raise NvgError(f"{out}: exists and is not empty; export-hf writes a new folder")
    final, out = out, out.with_name(f".{out.name}.tmp{os.getpid()}")  # renamed into place when complete
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        save_file({n: t.to(getattr(torch, dtype)).contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**hf_config(arch, width, tensors, tok_cfg), "torch_dtype": dtype}, indent=1))
        (out / "tokenizer.json").write_bytes(cmf.vocab)
        (out / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer_config(cmf.vocab, tok_cfg), indent=1))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if final.exists():
        final.rmdir()
    os.replace(out, final)
    print(f"export-hf: {len(tensors)} dense tensors ({dtype}) → {final}", file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg export-hf", description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    a = ap.parse_args(argv)
    main(a.file, a.out, a.dtype)


if __name__ == "__main__":
    cli()
