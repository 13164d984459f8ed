"""The bench scripts that run on the CPU, each as a user runs it (its own process), on the tiny teacher, its encoded
student and the stage outputs: it runs to its end, and what it reports holds together. A script that nothing runs
breaks unnoticed when the library under it changes (bench/generate_bench.py did, session 48)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args) -> str:
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_excess_by_entropy_splits_the_ratio_it_reports(stage_inputs, tiny_corpus, tmp_path):
    """Its bins and its copy classes partition every predicted position, and their excess NLL, weighted by their
    shares, is the log of the ratio it reports for the text."""
    import h5py

    d, essay = stage_inputs, str(tiny_corpus / "essay.txt")
    out = tmp_path / "excess.json"
    run_bench("excess_by_entropy.py", "--teacher", d / "teacher.cmf", "--student", d / "student.cmf", "--windows",
              d / "windows.h5", "--ood", essay, "--ood-tokens", 512, "--device", "cpu", "--precision", "fp32", "--out", out)
    report = json.loads(out.read_text())
    assert list(report) == ["held-out", essay]
    with h5py.File(d / "windows.h5") as f:
        held_out, window = len(f["tokens"]) - int(f.attrs["n_train"]), f["tokens"].shape[1]
    assert sum(b["positions"] for b in report["held-out"]["bins"]) == held_out * (window - 1)
    for entry in report.values():
        bins, copies = entry["bins"], entry["copies"]
        assert sum(b["share"] for b in bins) == pytest.approx(1.0)
        assert copies["copy"]["positions"] + copies["other"]["positions"] == sum(b["positions"] for b in bins)
        assert sum(b["share"] * b["mean_excess_nll"] for b in bins if b["positions"]) == pytest.approx(
            math.log(entry["ppl_ratio"]), rel=1e-6, abs=1e-9)
        assert entry["ppl_ratio"] != pytest.approx(1.0, abs=1e-4)  # two models (the tiny teacher is near uniform:
        # its encoded student may even score a hair better on an unseen text)
    assert report[essay]["mix_predicted_ppl_ratio"] > 0


def test_ood_sample_and_score_students_give_the_teacher_ratio_one(stage_inputs, tiny_corpus, tmp_path):
    """Scored as its own student, the teacher is at exactly 1× on every sample either script takes; its encoded
    student is not."""
    d, essay = stage_inputs, str(tiny_corpus / "essay.txt")
    ratios = {}
    for name, student in (("teacher", d / "teacher.cmf"), ("student", d / "student.cmf")):
        out = tmp_path / f"ood-{name}.json"
        run_bench("ood_sample.py", "--teacher", d / "teacher.cmf", "--student", student, "--source", essay,
                  "--window", 32, "--windows", 16, "--out", out)
        ratios[name] = json.loads(out.read_text())[essay]
    sample = ratios["teacher"]
    assert sample["windows_in_text"] >= 16 and len(sample["first_blocks_of_8"]) == 2
    for key in ("first_8", "first_16", "drawn_16"):
        assert sample[key] == pytest.approx(1.0, abs=1e-12)
        assert ratios["student"][key] != pytest.approx(1.0, abs=1e-4)
    out = tmp_path / "scores.json"
    run_bench("score_students.py", "--teacher", d / "teacher.cmf", "--student", f"teacher={d / 'teacher.cmf'}",
              "--student", f"student={d / 'student.cmf'}", "--source", essay, "--tokens", 1024, "--window", 32,
              "--out", out)
    scores = json.loads(out.read_text())[essay]
    assert scores["teacher"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert scores["student"]["ppl_ratio"] != pytest.approx(1.0, abs=1e-4)


def test_layer_swap_gives_the_teacher_back_with_every_block_swapped(stage_inputs, tiny_corpus, tmp_path):
    """The encoded student (its f16 embedding, head and norms the teacher's) is the teacher again with every block
    swapped, at KL 0 on every text; each single swap moves its KL, and none of them to 0."""
    d, essay = stage_inputs, str(tiny_corpus / "essay.txt")
    out = tmp_path / "swap.json"
    run_bench("layer_swap.py", "--teacher", d / "teacher.cmf", "--student", d / "student.cmf", "--windows",
              d / "windows.h5", "--ood", essay, "--ood-tokens", 512, "--device", "cpu", "--precision", "fp32",
              "--out", out)
    report = json.loads(out.read_text())
    from nvg.cmf import read_cmf

    blocks = [str(i) for i in range(read_cmf(d / "teacher.cmf").arch["num_layers"])]
    assert list(report) == ["none", *blocks, "all"] and len(blocks) >= 2
    for label, kl in report["none"].items():
        assert kl > 1e-4
        assert report["all"][label] == pytest.approx(0.0, abs=1e-5)
        for b in blocks:
            assert report[b][label] != pytest.approx(kl, rel=1e-6) and report[b][label] > 1e-5


def test_layer_swap_by_role_moves_each_role_and_puts_the_student_back(stage_inputs, tiny_corpus, tmp_path):
    """With --by role each role's linears in every block are the teacher's at once: every role moves the KL and is
    counted by its own weights; none brings the teacher back alone (as the seven together would, were each not put
    back before the next), and every block swapped still does."""
    d, essay = stage_inputs, str(tiny_corpus / "essay.txt")
    out = tmp_path / "swap.json"
    run_bench("layer_swap.py", "--teacher", d / "teacher.cmf", "--student", d / "student.cmf", "--windows",
              d / "windows.h5", "--ood", essay, "--ood-tokens", 512, "--device", "cpu", "--precision", "fp32",
              "--by", "role", "--out", out)
    report = json.loads(out.read_text())
    from nvg.cmf import read_cmf
    from nvg.layout import BODY_ROLES, parse_body_linear

    teacher = read_cmf(d / "teacher.cmf")
    assert list(report) == ["none", *BODY_ROLES, "all"]
    for role in BODY_ROLES:
        weights = sum(math.prod(t.shape) for n, t in teacher.tensors.items() if (parse_body_linear(n) or (0, ""))[1] == role)
        assert report[role]["weights"] == weights
        for label, kl in report["none"].items():
            gain = 1 - report[role]["kl"][label] / kl
            assert report[role]["kl"][label] != pytest.approx(kl, rel=1e-6) and report[role]["kl"][label] > 1e-5
            assert report[role]["gain_per_million"][label] == pytest.approx(gain / weights * 1e6)
    for label in report["none"]:
        assert report["all"][label] == pytest.approx(0.0, abs=1e-5)


def test_topk_mass_outside_the_top_k_shrinks_as_k_grows(tiny_cmf, tiny_corpus):
    essay = str(tiny_corpus / "essay.txt")
    report = json.loads(run_bench("topk_mass.py", "--teacher", tiny_cmf, "--source", essay, "--k", 2, "--k", 8,
                                  "--k", 32, "--tokens", 512, "--window", 64))[essay]
    means = [report[f"outside_top{k}"]["mean"] for k in (2, 8, 32)]
    assert report["tokens"] == 512 and 1 > means[0] > means[1] > means[2] >= 0


def test_replaying_the_sign_guards_finds_session_22s_avalanche_and_nothing_in_a_guarded_run():
    """Session 22's five epochs diverged at step 240 (docs/quality.md): the spike guard, replayed on its recorded
    flips, fires from step 239; on session 49's run, trained with the guards, it would not have fired."""
    runs = REPO / "docs" / "runs"
    avalanche = run_bench("replay_sign_guards.py", runs / "metrics-s22-live_uv_bsigns_max.jsonl.gz", "--signs", 91699200,
                          "--steps", 2550, "--set", "max_step_flip=0.01", "--first", 3).splitlines()
    assert [line.split(" (")[0] for line in avalanche] == ["step 239", "step 240", "step 241"]
    assert all("sign η halved" in line for line in avalanche)
    guarded = run_bench("replay_sign_guards.py",
                        runs / "metrics-s49-live_uv_bsigns_wide-hidden03-manuals30-embedding_lr01-batch64-9ep.jsonl.gz",
                        "--signs", 91699200, "--steps", 2286, "--set", "grad_clip=2")
    assert guarded.strip() == "no guard would have fired"


def test_adam_groups_times_each_optimizer_over_train_students_tensors():
    """Its student's trainable tensors are train_student's on SmolLM2's shape, a group each: h, ℓ and g of each of the
    210 BLR linears (one tensor each, its paths stacked) and the 61 norm gains; each of the three optimizers reports
    a time."""
    out = run_bench("adam_groups.py").splitlines()
    assert out[0] == f"{3 * 210 + 61} tensors, one group each, on cpu"
    times = {line.split(":")[0].strip(): line.split(":")[1] for line in out[1:]}
    assert list(times) == ["torch Adam, foreach", "torch Adam, fused", "nvg OnePassAdam"]
    for reported in times.values():
        ms, unit = reported.split(maxsplit=1)
        assert unit == "ms an update" and math.isfinite(float(ms)) and float(ms) > 0


def test_cpu_step_times_train_students_step_on_the_stage_outputs(stage_inputs):
    """The step train_student takes, live teacher (the default) and cached top-k alike: each round's median step, and
    one held-out pass."""
    import h5py

    d = stage_inputs
    with h5py.File(d / "windows.h5") as f:
        window = f["tokens"].shape[1]
    for targets, inputs in (("live", ["--teacher", d / "teacher.cmf"]), ("topk", ["--topk", d / "topk.0.h5"])):
        settings = {"targets": targets, "batch": 2, "precision": "fp32"}
        report = json.loads(run_bench("cpu_step.py", d / "student.cmf", d / "windows.h5", *inputs, "--settings",
                                      json.dumps(settings)).strip().splitlines()[-1])
        assert report["targets"] == targets and report["batch"] == 2 and report["tokens"] == 2 * window
        assert report["hidden_weight"] == (0.3 if targets == "live" else None)
        assert all(report[k] > 0 for k in ("step_s_first_round", "step_s_second_round", "heldout_kl_pass_s"))


def test_fp8_quality_trains_both_ways_and_scores_both_files(stage_inputs, tmp_path):
    """bench/fp8_quality.py on a run folder's layout (config.yaml's train block, the reconstructed student, the
    windows, the teacher): both trainings reach their end, their held-out KLs step by step and the trained files'
    are reported side by side, the fp8 ones off by its rounding (not zero, a few per cent at most)."""
    import shutil

    import yaml

    d, folder = stage_inputs, tmp_path / "run"
    for source, place in (("student.cmf", "student/reconstructed.cmf"), ("windows.h5", "data/windows.h5"), ("teacher.cmf", "teacher.cmf")):
        (folder / "results" / place).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(d / source, folder / "results" / place)
    train = {"epochs": 1, "batch": 4, "lr": 0.01, "eval_every": 2, "state_every": 100, "precision": "bf16", "device": "cpu"}
    (folder / "config.yaml").write_text(yaml.safe_dump({"train": train}))
    out = tmp_path / "fp8.json"
    run_bench("fp8_quality.py", "--folder", folder, "--out", out)
    rows = json.loads(out.read_text())["evals"]
    steps, final = rows[:-1], rows[-1]
    assert steps[0]["step"] == 0 and len(steps) >= 2 and final["trained file, scored in bf16"]
    for row in rows:
        assert row["heldout_kl_fp8"] != row["heldout_kl"]
        assert row["fp8_vs_without"] == round(row["heldout_kl_fp8"] / row["heldout_kl"] - 1, 5)
        assert abs(row["fp8_vs_without"]) < 0.05


def test_fit_epochs_writes_the_epochs_that_fit_and_refuses_when_none_does(stage_inputs, tmp_path):
    """bench/fit_epochs.py (ablation.sh's ABLATION_DEADLINE_S): the variant's files merged as Snakemake merges
    them, its windows' training rows in batches, whole epochs of the given step time after the tail; never more
    than the variant's own epochs; those after train.hidden_epochs at --late-step-s; one error line and no overlay
    when not one epoch fits."""
    import h5py
    import yaml

    n_train = int(h5py.File(stage_inputs / "windows.h5", "r").attrs["n_train"])
    base, over = tmp_path / "base.yaml", tmp_path / "over.yaml"
    base.write_text(yaml.safe_dump({"train": {"epochs": 4, "batch": 32, "lr": 0.002}}))
    over.write_text(yaml.safe_dump({"train": {"epochs": 12, "batch": 2}}))
    steps = n_train // 2
    out = tmp_path / "fit.yaml"
    common = ["--configs", base, over, "--windows", stage_inputs / "windows.h5", "--step-s", 0.5, "--tail-s", 10, "--out", out]
    run_bench("fit_epochs.py", *common, "--seconds-left", 10 + 3.5 * steps * 0.5)
    assert yaml.safe_load(out.read_text()) == {"train": {"epochs": 3}}
    run_bench("fit_epochs.py", *common, "--seconds-left", 10 + 100 * steps * 0.5)
    assert yaml.safe_load(out.read_text()) == {"train": {"epochs": 12}}  # the variant's own, not more
    # after train.hidden_epochs the KL-alone epochs at their own step time: one at 0.5 s, then 2.5 at 0.2 s fit 3
    over.write_text(yaml.safe_dump({"train": {"epochs": 12, "batch": 2, "hidden_epochs": 1}}))
    run_bench("fit_epochs.py", *common, "--late-step-s", 0.2, "--seconds-left", 10 + steps * 0.5 + 2.5 * steps * 0.2)
    assert yaml.safe_load(out.read_text()) == {"train": {"epochs": 3}}
    over.write_text(yaml.safe_dump({"train": {"epochs": 12, "batch": 2}}))
    out.unlink()
    done = subprocess.run([sys.executable, str(REPO / "bench" / "fit_epochs.py"), *map(str, common), "--seconds-left", "10"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "not one epoch" in done.stderr and not out.exists()


def test_the_compiled_draw_decoder_traces_the_draw_apart_and_draws_as_the_stages_decoder(tiny_cmf, monkeypatch):
    """bench/decode_compile.py's CompiledDrawDecoder, the candidate decoder: on the CPU with a recording backend
    (dynamo alone, the traced graphs run as they are) it traces two regions, a block with its two cache writes and the
    draw, and its draws are the stage decoder's from one seed, past a cache bucket."""
    import torch

    from nvg import decoding
    from nvg.model import load_model

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from decode_compile import CompiledDrawDecoder

    monkeypatch.setattr(decoding, "KV_BUCKET", 64)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    runs = {}
    for cls in (decoding.Decoder, CompiledDrawDecoder):
        graphs.clear()
        decoder = cls(load_model(tiny_cmf), 4, 100, torch.device("cpu"), "fp32", backend=record)
        torch.manual_seed(1234)
        ids, out = torch.arange(4) + 5, []
        for pos in range(99):
            ids = decoder.next_ids(ids, pos, greedy=pos < 3)
            out.append(ids)
        runs[cls] = torch.stack(out, 1)
        traced = [str(gm.graph) for gm in graphs]
        torch.compiler.reset()
        blocks = [g for g in traced if "index_copy" in g]
        assert len(blocks) == 1 and len(traced) == (1 if cls is decoding.Decoder else 2), traced
    assert torch.equal(runs[decoding.Decoder], runs[CompiledDrawDecoder])
