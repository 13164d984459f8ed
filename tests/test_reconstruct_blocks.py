"""Block-wise reconstruction: each block's error falls, only scales and gains move (and the signs, when
`reconstruct.signs` trains them), the layout is kept, the student it hands on is closer to the teacher,
and bad input fails cleanly."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open

import nvg.reconstruct_blocks
from nvg.artifacts import read_windows
from nvg.blockwise import block_trainable, reconstruct_block, run_block, token_error
from nvg.cmf import BLR, read_cmf, verify
from nvg.model import autocast, load_model, rotary_tables
from nvg.reconstruct_blocks import ReconstructSettings, block_sign_trainer, cli, main, run_state_file
from nvg.settings import load
from tests.conftest import fails_cleanly


def settings(state_root, **kw):
    return load(ReconstructSettings, **{"steps": 12, "windows": 16, "batch": 4, "lr": 0.02, "device": "cpu",
                                        "state_root": str(state_root), **kw})


def test_only_scales_and_norm_gains_are_trained(stage_inputs):
    model = load_model(stage_inputs / "student.cmf")
    names = sorted(block_trainable(model.model.layers[0]))
    assert names and all(n.endswith((".h", ".ell", ".g", "norm.weight")) for n in names)
    frozen = [n for n, p in model.model.layers[0].named_parameters() if not p.requires_grad]
    assert any(n.endswith((".su", ".sv")) for n in frozen)


def test_a_block_learns_to_reproduce_the_teachers_output(stage_inputs):
    teacher, student = load_model(stage_inputs / "teacher.cmf"), load_model(stage_inputs / "student.cmf")
    tokens, _ = read_windows(stage_inputs / "windows.h5")
    ids = torch.from_numpy(tokens[:16]).long()
    cos, sin = rotary_tables(student.cfg, ids.shape[1], ids.device)
    ctx = autocast(torch.device("cpu"), "fp32")
    with torch.no_grad():
        x_t, x_s = teacher.embed(ids), student.embed(ids)
    y = run_block(teacher.model.layers[0], x_t, cos, sin, 4, ctx)
    block = student.model.layers[0]
    signs = {n: p.detach().clone() for n, p in block.named_parameters() if n.endswith((".su", ".sv"))}
    stats, out = reconstruct_block(block, x_s, y, cos, sin, steps=30, batch=4, lr=0.02, autocast=ctx,
                                   generator=torch.Generator().manual_seed(0))
    assert stats["kept"] and stats["after"] < 0.8 * stats["before"]
    assert torch.equal(out, run_block(block, x_s, cos, sin, 4, ctx))  # the next block's input, the trained block's output
    assert stats["after"] == pytest.approx(float(token_error(out, y)))
    for n, p in block.named_parameters():  # the signs are untouched and nothing is left trainable
        assert not p.requires_grad
        if n in signs:
            assert torch.equal(p, signs[n])


def block_zero(stage_inputs, n=16):
    """Block 0's inputs and target: the student's stream, the teacher block's output, and the tables."""
    teacher, student = load_model(stage_inputs / "teacher.cmf"), load_model(stage_inputs / "student.cmf")
    tokens, _ = read_windows(stage_inputs / "windows.h5")
    ids = torch.from_numpy(tokens[:n]).long()
    cos, sin = rotary_tables(student.cfg, ids.shape[1], ids.device)
    ctx = autocast(torch.device("cpu"), "fp32")
    with torch.no_grad():
        x_t, x_s = teacher.embed(ids), student.embed(ids)
    return teacher, student, x_s, run_block(teacher.model.layers[0], x_t, cos, sin, 4, ctx), cos, sin, ctx


def test_with_signs_a_block_flips_some_and_a_block_made_worse_gets_its_signs_back_and_trains_its_scales_alone(stage_inputs):
    """reconstruct.signs: the block's sign matrices train through straight-through latents from the
    encoder's margins. At η 0.03 some flip and the error falls; at η 1.0 the flips make the block worse
    than it started, so its starting scales and signs are put back and the scales train again alone
    (`dropped`), which lowers the error as a block without sign training does. Either way the signs end
    frozen ±1 in their own dtype again, with no hook left on them. (On this tiny block the signs buy no
    measurable error over the scales alone: 0.0439 either way; the real model's gain is a device measurement.)"""
    from nvg.sign_training import sign_reference

    # η 0.2 made it worse until session 19; on session 20's fresh machine (its packages installed anew: a cause
    # not traced) it ends a hair better (0.06372 → 0.06328, 18 % of the signs flipped): 1.0 is far past that
    # edge (its last batch's loss 0.130 against a first of 0.053)
    for eta, dropped in ((0.03, False), (1.0, True)):
        teacher, student, x_s, y, cos, sin, ctx = block_zero(stage_inputs)
        block = student.model.layers[0]
        before = {n: p.detach().clone() for n, p in block.named_parameters() if n.endswith((".su", ".sv"))}
        s = settings("unused", steps=40, signs={"enabled": True, "init": "margin", "eta": eta, "warm": 2, "max_step_flip": 0.5})
        reference = sign_reference(stage_inputs / "grams.h5", read_cmf(stage_inputs / "teacher.cmf"), teacher)
        stats, out = reconstruct_block(block, x_s, y, cos, sin, steps=40, batch=4, lr=0.02, autocast=ctx,
                                       generator=torch.Generator().manual_seed(0), signs=block_sign_trainer(student, 0, s, reference))
        after = {n: p for n, p in block.named_parameters() if n.endswith((".su", ".sv"))}
        flipped = sum(int((after[n] != before[n]).sum()) for n in before)
        assert stats["kept"] and stats["after"] < stats["before"] and torch.equal(out, run_block(block, x_s, cos, sin, 4, ctx))
        assert stats["signs"]["dropped"] == dropped
        assert stats["signs"]["flipped_fraction"] == pytest.approx(flipped / sum(p.numel() for p in before.values()))
        assert (flipped == 0) == dropped
        assert all(not p.requires_grad and p.dtype == before[n].dtype and set(p.unique().tolist()) <= {-1.0, 1.0}
                   and not p._post_accumulate_grad_hooks for n, p in after.items())
    # the scales alone from the same start, as a block without sign training: lower, as the dropped block's ended
    _, student, x_s, y, cos, sin, ctx = block_zero(stage_inputs)
    alone, _ = reconstruct_block(student.model.layers[0], x_s, y, cos, sin, steps=40, batch=4, lr=0.02, autocast=ctx,
                                 generator=torch.Generator().manual_seed(0))
    assert alone["before"] == stats["before"] and alone["after"] < alone["before"]
    assert block_sign_trainer(student, 0, settings("unused"), None) is None  # signs off: scales alone


def test_the_sign_guards_lines_reach_the_blocks_record_and_log(stage_inputs, tmp_path, capsys):
    """A guard that fires while a block trains its signs (here the flip-rate guard, set to fire at any flip
    three steps running) is in the block's record, the provenance, and the stage's log under its block line."""
    inputs = (stage_inputs / "student.cmf", stage_inputs / "teacher.cmf", stage_inputs / "windows.h5")
    s = settings(tmp_path / "state", steps=8, signs={"enabled": True, "init": "margin", "eta": 0.2, "warm": 1, "max_step_flip": 1e-9})
    main(*inputs, tmp_path / "out.cmf", s, stage_inputs / "grams.h5")
    blocks = read_cmf(tmp_path / "out.cmf").header["provenance"]["nvg_reconstruct"]["blocks"]
    lines = [line for b in blocks for line in b["signs"]["guards"]]
    assert lines and all("flip rate" in line and "sign η halved" in line for line in lines)
    assert all(b["signs"]["spikes"] == 0 for b in blocks)
    log = capsys.readouterr().err
    assert f"    {lines[0]}" in log and log.index("  block 0:") < log.index(f"    {blocks[0]['signs']['guards'][0]}")


def test_the_matrix_steps_whose_sign_gradient_was_clipped_reach_the_blocks_record_and_log(stage_inputs, tmp_path, capsys):
    """grad_clip so small that it binds in every step that has a running RMS to compare with (all but the first):
    each block's record counts (steps − 1) × its sign matrices, and its log line says so; at 0 none."""
    inputs = (stage_inputs / "student.cmf", stage_inputs / "teacher.cmf", stage_inputs / "windows.h5")
    matrices = 2 * sum(n.startswith("model.layers.0.") for n in load_model(stage_inputs / "student.cmf").blr_linears())
    for grad_clip, expected in ((1e-3, 7 * matrices), (0.0, 0)):
        s = settings(tmp_path / f"state-{grad_clip}", steps=8, signs={"enabled": True, "init": "margin", "eta": 0.02, "warm": 1,
                                                                     "grad_clip": grad_clip})
        main(*inputs, tmp_path / f"out-{grad_clip}.cmf", s, stage_inputs / "grams.h5")
        blocks = read_cmf(tmp_path / f"out-{grad_clip}.cmf").header["provenance"]["nvg_reconstruct"]["blocks"]
        assert [b["signs"]["grad_clipped"] for b in blocks] == [expected] * len(blocks)
        log = capsys.readouterr().err
        assert (f"(sign gradients clipped in {expected} matrix-steps)" in log) == (expected > 0)


def test_a_step_that_would_raise_the_error_is_undone(stage_inputs):
    student = load_model(stage_inputs / "student.cmf")
    tokens, _ = read_windows(stage_inputs / "windows.h5")
    ids = torch.from_numpy(tokens[:8]).long()
    cos, sin = rotary_tables(student.cfg, ids.shape[1], ids.device)
    ctx = autocast(torch.device("cpu"), "fp32")
    block = student.model.layers[0]
    with torch.no_grad():
        x = student.embed(ids)
    y0 = run_block(block, x, cos, sin, 4, ctx)
    y = y0 * 1.001  # the block is already within 0.1 % of its target
    start = {n: p.detach().clone() for n, p in block.named_parameters()}
    stats, out = reconstruct_block(block, x, y, cos, sin, steps=5, batch=4, lr=1.0, autocast=ctx,  # steps of 100 %
                                   generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, y0)  # the output of the restored block
    assert not stats["kept"] and stats["after"] == stats["before"] < 1e-5
    for n, p in block.named_parameters():
        assert torch.equal(p, start[n])


def test_the_stage_writes_the_student_with_its_layout_and_a_smaller_error(stage_inputs, tmp_path):
    out = tmp_path / "reconstructed.cmf"
    main(stage_inputs / "student.cmf", stage_inputs / "teacher.cmf", stage_inputs / "windows.h5", out, settings(tmp_path / "state"))
    assert verify(out) == []
    before, after = read_cmf(stage_inputs / "student.cmf"), read_cmf(out)
    assert [(t.name, t.dtype, t.shape, len(t.data)) for t in before.tensors.values()] == \
           [(t.name, t.dtype, t.shape, len(t.data)) for t in after.tensors.values()]
    assert any(after.tensors[n].data != t.data for n, t in before.tensors.items() if t.dtype == BLR)
    prov = after.header["provenance"]["nvg_reconstruct"]
    assert len(prov["blocks"]) == before.arch["num_layers"] and prov["tokens_per_block"] == 12 * 4 * 32
    assert all(b["after"] <= b["before"] for b in prov["blocks"])
    _, attrs = read_windows(stage_inputs / "windows.h5")
    assert prov["windows_hash"] == attrs["tokens_blake2b"] and max(prov["rows"]) < attrs["n_train"]
    assert json.loads(json.dumps(prov["settings"]))["steps"] == 12
    # the whole student, on held-out windows it never saw, is closer to the teacher's last hidden state
    tokens, _ = read_windows(stage_inputs / "windows.h5")
    ids = torch.from_numpy(tokens[attrs["n_train"]:]).long()
    with torch.no_grad():
        want = load_model(stage_inputs / "teacher.cmf").hidden(ids)
        err = {name: float((load_model(p).hidden(ids) - want).pow(2).mean()) for name, p in
               (("encoded", stage_inputs / "student.cmf"), ("reconstructed", out))}
    assert err["reconstructed"] < err["encoded"]


def test_the_same_settings_write_the_same_file(stage_inputs, tmp_path):
    for name in ("a", "b"):
        main(stage_inputs / "student.cmf", stage_inputs / "teacher.cmf", stage_inputs / "windows.h5", tmp_path / f"{name}.cmf",
             settings(tmp_path / "state", steps=3))
    assert (tmp_path / "a.cmf").read_bytes() == (tmp_path / "b.cmf").read_bytes()


def test_a_killed_run_resumes_at_the_next_block_and_writes_the_same_bytes(stage_inputs, tmp_path, monkeypatch):
    inputs = (stage_inputs / "student.cmf", stage_inputs / "teacher.cmf", stage_inputs / "windows.h5")
    s = settings(tmp_path / "state", steps=3)
    main(*inputs, tmp_path / "whole.cmf", s)
    assert list((tmp_path / "state").iterdir()) == []  # a finished run leaves no state behind
    trained = []

    def reconstruct_or_die(*a, **kw):  # the job is killed while it trains the second block
        trained.append(kw["steps"])
        if len(trained) == 2:
            raise KeyboardInterrupt
        return reconstruct_block(*a, **kw)
    monkeypatch.setattr(nvg.reconstruct_blocks, "reconstruct_block", reconstruct_or_die)
    with pytest.raises(KeyboardInterrupt):
        main(*inputs, tmp_path / "resumed.cmf", s)
    assert not (tmp_path / "resumed.cmf").exists() and len(list((tmp_path / "state").glob("*/state.safetensors"))) == 1
    trained.clear()
    monkeypatch.setattr(nvg.reconstruct_blocks, "reconstruct_block", lambda *a, **kw: trained.append(1) or reconstruct_block(*a, **kw))
    main(*inputs, tmp_path / "resumed.cmf", s)
    assert len(trained) == read_cmf(inputs[0]).arch["num_layers"] - 1  # block 0 is not trained again
    assert (tmp_path / "resumed.cmf").read_bytes() == (tmp_path / "whole.cmf").read_bytes()
    assert list((tmp_path / "state").iterdir()) == []


def test_a_second_run_while_the_first_holds_its_state_stops_with_one_line(stage_inputs, tmp_path):
    """Two reconstruct_blocks jobs on the same inputs and settings (a second Snakemake after --unlock): the
    second stops, naming the state folder and the process that holds it, and writes nothing."""
    from nvg.errors import NvgError
    from nvg.resume import one_run

    inputs = (stage_inputs / "student.cmf", stage_inputs / "teacher.cmf", stage_inputs / "windows.h5")
    s = settings(tmp_path / "state", steps=2)
    with one_run(run_state_file(s, *inputs, None), "reconstruction"):  # the first job, still running
        with pytest.raises(NvgError, match=r"state/[0-9a-f]+: a reconstruction run on these inputs and settings is "
                                           r"running now \(process \d+\); one run at a time"):
            main(*inputs, tmp_path / "second.cmf", s)
    assert not (tmp_path / "second.cmf").exists()
    main(*inputs, tmp_path / "second.cmf", s)  # once it has ended, the next run goes ahead
    assert verify(tmp_path / "second.cmf") == [] and list((tmp_path / "state").iterdir()) == []


def test_the_stage_with_signs_writes_flipped_signs_and_resumes_to_the_same_bytes(stage_inputs, tmp_path, monkeypatch):
    """With reconstruct.signs (margins from --grams) the written student's sign bits differ from the encoder's,
    each block records its flipped fraction, and a run killed in block 1 resumes (block 0's signs put back from
    the state's bits) to the bytes of one that was not."""
    inputs = (stage_inputs / "student.cmf", stage_inputs / "teacher.cmf", stage_inputs / "windows.h5")
    s = settings(tmp_path / "state", steps=6, signs={"enabled": True, "init": "margin", "eta": 0.2, "warm": 1, "max_step_flip": 0.5})
    main(*inputs, tmp_path / "whole.cmf", s, stage_inputs / "grams.h5")
    prov = read_cmf(tmp_path / "whole.cmf").header["provenance"]["nvg_reconstruct"]
    assert all("signs" in b for b in prov["blocks"]) and any(b["signs"]["flipped_fraction"] > 0 for b in prov["blocks"])
    encoded, whole = load_model(inputs[0]), load_model(tmp_path / "whole.cmf")
    assert any(not torch.equal(m.su, whole.blr_linears()[n].su) for n, m in encoded.blr_linears().items())

    calls = []

    def reconstruct_or_die(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return reconstruct_block(*a, **kw)
    monkeypatch.setattr(nvg.reconstruct_blocks, "reconstruct_block", reconstruct_or_die)
    with pytest.raises(KeyboardInterrupt):
        main(*inputs, tmp_path / "resumed.cmf", s, stage_inputs / "grams.h5")
    with safe_open(str(run_state_file(s, *inputs, stage_inputs / "grams.h5")), "pt") as f:  # block 0's signs, as bits
        signs = {k: f.get_tensor(k) for k in f.keys() if k.endswith((".su", ".sv"))}
    su = encoded.blr_linears()["model.layers.0.self_attn.q_proj.weight"].su
    assert signs and all(v.dtype == torch.uint8 for v in signs.values())
    assert signs["0.self_attn.q_proj.su"].shape == (*su.shape[:-1], (su.shape[-1] + 7) // 8)
    monkeypatch.setattr(nvg.reconstruct_blocks, "reconstruct_block", reconstruct_block)
    main(*inputs, tmp_path / "resumed.cmf", s, stage_inputs / "grams.h5")
    assert (tmp_path / "resumed.cmf").read_bytes() == (tmp_path / "whole.cmf").read_bytes()


def test_margin_signs_without_grams_fail_cleanly(stage_inputs, tmp_path, capsys):
    s = settings(tmp_path / "state", steps=2, signs={"enabled": True, "init": "margin"})
    inputs = [stage_inputs / "student.cmf", stage_inputs / "teacher.cmf", stage_inputs / "windows.h5"]
    out = tmp_path / "r.cmf"
    fails_cleanly(cli, ["--student", inputs[0], "--teacher", inputs[1], "--windows", inputs[2], "--out", out,
                        "--settings", json.dumps(asdict(s))], capsys, "config reconstruct.signs", "init: margin needs --grams", [out])


def test_a_damaged_state_fails_cleanly(stage_inputs, tmp_path, capsys):
    s = settings(tmp_path / "state", steps=2)
    inputs = [stage_inputs / "student.cmf", stage_inputs / "teacher.cmf", stage_inputs / "windows.h5"]
    state = run_state_file(s, *inputs, None)
    state.parent.mkdir(parents=True)
    state.write_bytes(b"not a state")
    out = tmp_path / "r.cmf"
    fails_cleanly(cli, ["--student", inputs[0], "--teacher", inputs[1], "--windows", inputs[2], "--out", out,
                        "--settings", json.dumps(asdict(s))], capsys, str(state), "not a readable reconstruction state", [out])


@pytest.mark.parametrize("problem, names, message", [
    ({"windows": 10_000}, "config reconstruct.windows", "exceeds the"),
    ({"batch": 32, "windows": 16}, "config reconstruct.batch", "exceeds reconstruct.windows"),
    ({"lr": 0}, "config reconstruct.lr", "less than or equal to the minimum"),
])
def test_bad_settings_fail_cleanly(stage_inputs, tmp_path, capsys, problem, names, message):
    out = tmp_path / "r.cmf"
    fails_cleanly(cli, ["--student", stage_inputs / "student.cmf", "--teacher", stage_inputs / "teacher.cmf",
                        "--windows", stage_inputs / "windows.h5", "--out", out,
                        "--settings", json.dumps({"steps": 2, "windows": 16, "batch": 4, "device": "cpu", **problem})],
                  capsys, names, message, [out])


def test_a_student_of_another_teacher_fails_cleanly(stage_inputs, tiny_hf, tmp_path, capsys):
    from nvg.import_teacher import main as import_teacher
    from tests.conftest import make_tiny_llama

    other = tmp_path / "other.cmf"
    import_teacher(str(make_tiny_llama(tmp_path / "hf", seed=5)), other, "f16")
    out = tmp_path / "r.cmf"
    fails_cleanly(cli, ["--student", stage_inputs / "student.cmf", "--teacher", other, "--windows", stage_inputs / "windows.h5",
                        "--out", out, "--settings", json.dumps({"steps": 2, "device": "cpu"})],
                  capsys, "student.cmf", "encoded from teacher", [out])

