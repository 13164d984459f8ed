"""`nvg export-hf FILE.cmf OUT/`: a Hugging Face folder that transformers loads.

By default every tensor is written dense (BLR dequantised exactly as nvg computes it) to
model.safetensors, which any transformers loads. With `--packed` the BLR linears stay as the CMF
stores them (f16 scales, sign bits) and config.json gets an nvg `quantization_config`: the folder is
the student's own size, and `import nvg.hf_quantizer` lets `AutoModelForCausalLM.from_pretrained`
build it with nvg's BLR linear (nvg/hf_quantizer.py). Dense stays the default because it needs nothing
but transformers; packed is for keeping the compression. The
config, the generation config and the tokenizer (chat template and special tokens included) are
written by transformers' own `save_pretrained`, so their keys are the ones the installed transformers
reads. README.md is a model card: the teacher, the budgets, the training data and, with `--eval`, the
measured perplexity ratios. A DTG-MA student whose layers have different MLP widths is padded to the
widest layer with zero gate/up rows and zero down columns, which leaves every output unchanged
(silu(0) · 0 = 0).

    nvg export-hf results/model.cmf exported/ [--packed] [--dtype float32|bfloat16|float16] [--eval results/eval.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from nvg import blr as codec
from nvg.cmf import BLR, read_cmf, tensor_to_numpy
from nvg.errors import NvgError, exits_cleanly
from nvg.layout import bits_summary, parse_body_linear
from nvg.tokenizer import hf_tokenizer

PACKED_PARTS = ("h", "ell", "g", "u_bits", "v_bits")  # a packed BLR module's tensors (nvg/hf_quantizer.py)
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def dense_tensors(cmf) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in cmf.tensors.items():
        if t.dtype == BLR:
            out[name] = torch.from_numpy(codec.decode(bytes(t.data)).dequantize())
        else:
            out[name] = torch.from_numpy(tensor_to_numpy(t))
    return out


def packed_tensors(cmf) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Every BLR body linear `X.weight` as the CMF payload's own parts (nvg/hf_quantizer.py's BlrLinear):
    X.h [P, d_out], X.ell [P, r], X.g [P, d_in] in f16 and the sign bits X.u_bits [P, d_out, r/8],
    X.v_bits [P, r, d_in/8] in uint8; every other tensor dense (a BLR embedding or LM head too: transformers
    looks tokens up in its embedding's weight). Also each BLR module's {paths, rank}."""
    out, linears = {}, {}
    for name, t in cmf.tensors.items():
        if t.dtype != BLR:
            out[name] = torch.from_numpy(tensor_to_numpy(t))
            continue
        blr, module = codec.decode(bytes(t.data)), name.removesuffix(".weight")
        if not parse_body_linear(name):
            out[name] = torch.from_numpy(blr.dequantize())
            continue
        for part in PACKED_PARTS[:3]:
            out[f"{module}.{part}"] = torch.from_numpy(np.stack([getattr(p, part) for p in blr.paths])).half()
        out[f"{module}.u_bits"] = torch.from_numpy(np.stack([p.u_bits for p in blr.paths]))
        out[f"{module}.v_bits"] = torch.from_numpy(np.stack([p.v_bits for p in blr.paths]))
        linears[module] = {"paths": len(blr.paths), "rank": blr.rank}
    return out, linears


# Where each MLP tensor holds its neurons, dense or packed: (tensor suffix, axis, entries per neuron).
# Zero rows of gate/up (zero h) and zero columns of down (zero g; a zero byte is 8 columns of bits).
MLP_NEURON_AXES = {"gate_proj": [("weight", 0, 1), ("h", 1, 1), ("u_bits", 1, 1)],
                   "up_proj": [("weight", 0, 1), ("h", 1, 1), ("u_bits", 1, 1)],
                   "down_proj": [("weight", 1, 1), ("g", 1, 1), ("v_bits", 2, 8)]}


def pad_mlp(tensors: dict, num_layers: int) -> int:
    """Pad every layer's MLP to the widest one with zeros, dense or packed; returns that width. A zero
    neuron leaves every output unchanged (silu(0) · 0 = 0)."""
    def width(i):
        up = f"model.layers.{i}.mlp.up_proj"
        return tensors[f"{up}.weight"].shape[0] if f"{up}.weight" in tensors else tensors[f"{up}.h"].shape[1]

    widths = [width(i) for i in range(num_layers)]
    widest = max(widths)
    for i, w in enumerate(widths):
        for role, axes in MLP_NEURON_AXES.items():
            for suffix, axis, per_entry in axes:
                name = f"model.layers.{i}.mlp.{role}.{suffix}"
                if w == widest or name not in tensors:
                    continue
                t = tensors[name]
                shape = list(t.shape)
                shape[axis] = (widest - w) // per_entry
                tensors[name] = torch.cat([t, t.new_zeros(shape)], dim=axis)
    return widest


def hf_config(arch: dict, intermediate: int, tensors: dict, tok_cfg: dict, dtype: str):
    """The transformers config of this architecture."""
    from transformers import AutoConfig

    model_type = arch["arch_name"] if arch["arch_name"] in HF_ARCHITECTURES else "llama"
    if model_type == "llama" and "model.layers.0.self_attn.q_norm.weight" in tensors:
        model_type = "qwen3"
    cfg = {
        "architectures": [HF_ARCHITECTURES[model_type]],
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
    if tok_cfg.get("pad_token_id") is not None:
        cfg["pad_token_id"] = tok_cfg["pad_token_id"]
    return AutoConfig.for_model(model_type, **cfg, dtype=dtype)


def model_card(cmf, source: Path, evaluation: dict | None, packed: bool) -> str:
    """README.md: what this model is, where it came from and how close it is to its teacher."""
    prov = cmf.header.get("provenance", {})
    enc, train = prov.get("nvg_encode", {}), prov.get("nvg_train", {})
    bits = bits_summary(cmf)
    teacher = train.get("teacher") or prov.get("nvg_import", {}).get("source", "?")
    lines = ["---", "library_name: transformers", "tags: [nvg, binary-low-rank, distillation]", "---", "",
             f"# {Path(str(teacher)).name} at {enc.get('bpw', '?')} bits per weight (nvg)", "",
             f"Exported by `nvg export-hf` from `{source.name}` ({bits['file_bytes']:,} bytes as CMF: "
             f"{bits['body_bpw']:.3f} bits per weight in the body linears, {bits['file_bpw']:.3f} over the whole file). "
             + ("The binary low-rank linears are packed as in the CMF (scales in f16, signs as bits). Load with "
                "`import nvg.hf_quantizer` before `AutoModelForCausalLM.from_pretrained(folder)`."
                if packed else "The weights here are dense: every binary low-rank linear expanded exactly as nvg computes it."),
             "",
             "| | |", "|---|---|",
             f"| teacher | `{teacher}` (content hash {enc.get('teacher_hash', '?')}) |",
             f"| budget | {enc.get('bpw', '?')} bpw, encoder {enc.get('method', '?')}, embedding {enc.get('embedding', 'f16')}"
             f"{', plan ' + enc['plan'] if enc.get('plan') else ''} |"]
    if train:
        lines.append(f"| training | {train.get('steps')} steps, {train.get('tokens'):,} tokens of {train.get('window')}-token "
                     f"windows, targets {train.get('targets')}, held-out KL {train.get('heldout_kl_start', 0):.4f} → "
                     f"{train.get('heldout_kl_best', 0):.4f} |")
    if evaluation:
        sets = {"held-out calibration text": evaluation["heldout"],
                **{f"held-out {src}": r for src, r in evaluation.get("heldout_by_source", {}).items()}, **evaluation.get("ood", {})}
        lines += ["", "Perplexity against the teacher (`nvg evaluate`):", "",
                  "| text | teacher | this model | ratio |", "|---|---|---|---|"]
        lines += [f"| {name} | {s['teacher']['perplexity']:.2f} | {s['final']['perplexity']:.2f} | {s['final']['ppl_ratio']:.2f}× |"
                  for name, s in sets.items()]
    return "\n".join(lines) + "\n"


def main(source: Path, out: Path, dtype: str = "float32", evaluation: Path | None = None, packed: bool = False) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    cmf = read_cmf(source)
    if not cmf.vocab:
        raise NvgError(f"{source}: vocab section is empty: no tokenizer to export")
    arch = cmf.arch
    tensors, linears = packed_tensors(cmf) if packed else (dense_tensors(cmf), {})
    width = pad_mlp(tensors, arch["num_layers"])
    tok_cfg = cmf.header.get("tokenizer_config", {})
    report = None
    if evaluation is not None:
        try:
            report = json.loads(evaluation.read_text())
            report["heldout"]["final"]["ppl_ratio"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise NvgError(f"{evaluation}: not an eval.json of nvg evaluate ({type(e).__name__}: {e})") from None
    if out.exists() and any(out.iterdir()):
        raise NvgError(f"{out}: exists and is not empty; export-hf writes a new folder")
    final, out = out, out.with_name(f".{out.name}.tmp{os.getpid()}")  # renamed into place when complete
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        packed_parts = {f"{m}.{part}" for m in linears for part in PACKED_PARTS}  # kept as stored: f16 scales, uint8 bits
        save_file({n: (t if n in packed_parts else t.to(getattr(torch, dtype))).contiguous() for n, t in tensors.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        config = hf_config(arch, width, tensors, tok_cfg, dtype)
        if packed:
            from nvg.hf_quantizer import NvgConfig

            config.quantization_config = NvgConfig(linears).to_dict()
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        hf_tokenizer(cmf, source, "export").save_pretrained(out)
        (out / "README.md").write_text(model_card(cmf, source, report, packed))
        umask = os.umask(0)
        os.umask(umask)
        for f in out.iterdir():  # as any other file the user writes (safetensors' writer makes 0600)
            f.chmod(0o666 & ~umask)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if final.exists():
        final.rmdir()
    os.replace(out, final)
    what = f"{len(linears)} packed BLR linears and {len(tensors) - len(PACKED_PARTS) * len(linears)} dense tensors" if packed else f"{len(tensors)} dense tensors"
    print(f"export-hf: {what} ({dtype}) → {final}", file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg export-hf", description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path, help="the CMF to export (a student or a teacher)")
    ap.add_argument("out", type=Path, help="a new folder (must not exist or be empty)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="of the written weights and config.json's dtype (default: %(default)s)")
    ap.add_argument("--eval", type=Path, help="an eval.json of this model: its perplexity ratios go into the model card")
    ap.add_argument("--packed", action="store_true",
                    help="keep the BLR linears packed (signs as bits, the CMF's size) with an nvg quantization_config; "
                         "load with `import nvg.hf_quantizer` (default: dense weights any transformers loads)")
    a = ap.parse_args(argv)
    main(a.file, a.out, a.dtype, a.eval, a.packed)


if __name__ == "__main__":
    cli()
