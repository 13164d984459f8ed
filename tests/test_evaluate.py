"""Stage evaluate: teacher, encoded and final student side by side, held out and out of domain."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from nvg import evaluate
from nvg.artifacts import read_windows
from nvg.model import load_model


@pytest.fixture(scope="module")
def evaluated(tiny_stages, tiny_cmf, tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "eval.json"
    settings = {"batch": 4, "ood": [str(tiny_corpus / "chat.jsonl"), str(tiny_corpus / "story.txt")], "ood_tokens": 256,
                "precision": "fp32"}
    evaluate.cli(["--teacher", str(tiny_cmf), "--encoded", str(tiny_stages / "student.cmf"),
                  "--reconstructed", str(tiny_stages / "student.cmf"), "--final", str(tiny_stages / "student.cmf"), "--windows", str(tiny_stages / "windows.h5"),
                  "--k", "8", "--out", str(out), "--settings", json.dumps(settings)])
    return json.loads(out.read_text())


def test_the_teacher_against_itself_and_the_student_against_the_teacher(evaluated):
    sets = [evaluated["heldout"], *evaluated["ood"].values()]
    assert len(sets) == 3
    for scores in sets:
        t, e, r, f = (scores[m] for m in ("teacher", "encoded", "reconstructed", "final"))
        assert abs(t["kl_full"]) < 1e-5 and t["top1_agreement"] == 1.0
        assert e == r == f  # the same file under three names scores the same
        assert e["kl_full"] > 0 and e["perplexity"] != t["perplexity"]
        assert e["ppl_ratio"] == pytest.approx(e["perplexity"] / t["perplexity"]) and t["ppl_ratio"] == 1.0
        assert scores["tokens"] == 256 or scores is evaluated["heldout"]
    assert evaluated["heldout"]["tokens"] == 8 * 32
    for scores in sets:  # the teacher's mass beyond its top-8, which top-k distillation never shows
        outside = scores["teacher_mass_outside_topk"]
        assert outside["k"] == 8 and 0 < outside["mean"] < 1
        # against its own renormalised top-8 the teacher's KL is the mean of −log(mass inside), and −log m ≥ 1 − m
        # (not the encoded student's KL, which a tiny random student can undercut: session 37's windows did)
        assert scores["teacher"]["kl_topk"] >= outside["mean"] and scores["encoded"]["kl_topk"] > 0
    assert 0 < evaluated["files"]["encoded"]["body_bpw"] <= 2.0 < evaluated["files"]["teacher"]["body_bpw"]


def test_the_top_k_kl_is_the_one_against_teacher_topks_cached_top_k(evaluated, tiny_stages, tiny_cmf):
    """evaluate takes the teacher's top-k itself (no teacher_topk stage when training runs the teacher live);
    on the held-out rows its top-k KL is the one against the shard teacher_topk wrote (f16 log-probs)."""
    from nvg.artifacts import TopkReader
    from nvg.losses import topk_kl

    tokens, attrs = read_windows(tiny_stages / "windows.h5")
    rows = np.arange(int(attrs["n_train"]), len(tokens))
    reader = TopkReader([tiny_stages / "topk.0.h5"], attrs, len(tokens), load_model(tiny_cmf).cfg.vocab_size)
    t_ids, t_logp = reader.read(rows)
    reader.close()
    student = load_model(tiny_stages / "student.cmf")
    with torch.no_grad():
        kl = topk_kl(student.hidden(torch.from_numpy(tokens[rows]).long()), student.head_weight,
                     torch.from_numpy(t_ids), torch.from_numpy(t_logp))
    assert evaluated["heldout"]["encoded"]["kl_topk"] == pytest.approx(float(kl) / tokens[rows].size, rel=1e-3)


def test_a_mix_of_sources_is_scored_held_out_whole_and_per_source(tiny_stages, tiny_cmf, tiny_corpus, tmp_path):
    """With a real source mixed in, the held-out windows are a mix: eval.json also scores each source's apart,
    and the whole is the pool of the parts (every score a sum over tokens)."""
    from nvg.settings import load
    from nvg.tokenize_windows import WindowSettings, main as tokenize

    story, chat = str(tiny_corpus / "story.txt"), str(tiny_corpus / "chat.jsonl")
    tokenize(tiny_cmf, tmp_path / "mix.h5", load(WindowSettings, sources=[{"path": story}, {"path": chat}],
                                                  tokens=1024, window=32, eval_windows=8, seed=3))
    evaluate.main(tiny_cmf, tiny_stages / "student.cmf", tiny_stages / "student.cmf", tmp_path / "mix.h5",
                  8, tmp_path / "eval.json", evaluate.load(evaluate.EvalSettings, batch=4, precision="fp32"), [])
    report = json.loads((tmp_path / "eval.json").read_text())
    parts = report["heldout_by_source"]
    assert list(parts) == [story, chat] and report["heldout"]["tokens"] == 8 * 32
    assert sum(p["tokens"] for p in parts.values()) == 8 * 32
    for model in ("teacher", "encoded"):
        nll = sum(math.log(p[model]["perplexity"]) * p["tokens"] * 31 / 32 for p in parts.values())
        assert math.exp(nll / (8 * 31)) == pytest.approx(report["heldout"][model]["perplexity"], rel=1e-5)
        assert parts[story][model]["perplexity"] != parts[chat][model]["perplexity"]
    # one source: no per-source block (the held-out windows are that source's)
    evaluate.main(tiny_cmf, tiny_stages / "student.cmf", tiny_stages / "student.cmf", tiny_stages / "windows.h5",
                  8, tmp_path / "one.json", evaluate.load(evaluate.EvalSettings, batch=4), [])
    assert "heldout_by_source" not in json.loads((tmp_path / "one.json").read_text())


def test_stage_seconds_read_the_last_row_and_leave_out_a_missing_file(tmp_path):
    """A stage run twice has two rows (the last is the run that made its outputs); a named file that does not exist
    (the stage's outputs came from elsewhere) gives no time."""
    (tmp_path / "train_student.tsv").write_text("s\th:m:s\n99.0\t0:01:39\n12.5\t0:00:12\n")
    assert evaluate.stage_seconds([tmp_path / "train_student.tsv", tmp_path / "reconstruct_blocks.tsv"]) == \
        {"train_student": 12.5}


def test_heldout_perplexity_is_the_teachers_own_next_token_loss(evaluated, tiny_stages, tiny_cmf):
    """Computed here with a plain log-softmax over the teacher's logits on the held-out windows."""
    tokens, attrs = read_windows(tiny_stages / "windows.h5")
    ids = torch.from_numpy(tokens[int(attrs["n_train"]):]).long()
    with torch.no_grad():
        logp = torch.log_softmax(load_model(tiny_cmf)(ids).double(), -1)
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    assert evaluated["heldout"]["teacher"]["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert np.isfinite(evaluated["heldout"]["encoded"]["perplexity"])


def test_one_model_is_in_memory_at_a_time(tiny_stages, tiny_cmf, tmp_path, monkeypatch):
    """The teacher leaves before the encoded student comes, and that one before the final (each student
    scores against the teacher's cached hidden states), so evaluate needs one model's memory, not three."""
    import gc
    import weakref

    loaded, alive_at_load = [], []

    def tracked(cmf, device):
        gc.collect()
        alive_at_load.append(sum(ref() is not None for ref in loaded))
        model = load_model(cmf, device)
        loaded.append(weakref.ref(model))
        return model

    monkeypatch.setattr(evaluate, "load_model", tracked)
    evaluate.main(tiny_cmf, tiny_stages / "student.cmf", tiny_stages / "student.cmf", tiny_stages / "windows.h5",
                  8, tmp_path / "eval.json", evaluate.load(evaluate.EvalSettings, batch=4), [])
    assert alive_at_load == [0, 0, 0]
    assert json.loads((tmp_path / "eval.json").read_text())["heldout"]["encoded"]["kl_full"] > 0
