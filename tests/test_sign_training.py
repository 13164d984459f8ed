"""Sign training: η = 0 changes nothing, a toy problem that needs flips is solved, each guard fires,
and kill-and-resume with signs on is bit-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from nvg import blr as codec
from nvg.cmf import BLR, read_cmf
from nvg.distill import lr_shape
from nvg.distributed import Group
from nvg.errors import NvgError
from nvg.model import BlrLinear
from nvg.settings import load
from nvg.sign_training import SignSettings, SignTrainer
from tests.conftest import TOPK_TARGETS, train

SIGNS = {"enabled": True, "warm": 0}


def bits(cmf) -> dict:
    out = {}
    for name, t in cmf.tensors.items():
        if t.dtype == BLR:
            p = codec.decode(bytes(t.data)).paths[0]
            out[name] = (p.u_bits.copy(), p.v_bits.copy())
    return out


def test_eta_zero_flips_nothing_and_equals_frozen_sign_training(stage_inputs):
    frozen = train(stage_inputs, "frozen", epochs=1)
    still = train(stage_inputs, "eta0", epochs=1, signs={**SIGNS, "eta": 0.0})
    prov = still.header["provenance"]["nvg_train"]["signs"]
    assert prov["flips"] == 0 and prov["distinct"] == 0 and prov["eta0"] == 0.0
    for name, t in frozen.tensors.items():
        assert bytes(still.tensors[name].data) == bytes(t.data), name


def toy(seed=0, d=32, r=16, flip=0.1):
    """A target BLR weight and a student with the same scales whose signs differ in `flip` of the entries."""
    rng = np.random.default_rng(seed)
    su, sv = np.sign(rng.standard_normal((d, r))), np.sign(rng.standard_normal((r, d)))
    h, g, ell = rng.uniform(0.5, 1.5, d), rng.uniform(0.5, 1.5, d), rng.uniform(0.5, 1.5, r)
    target = BlrLinear(codec.BlrTensor.from_factors([(h, g, ell, su, sv)]))
    wrong_u = np.where(rng.random(su.shape) < flip, -su, su)
    wrong_v = np.where(rng.random(sv.shape) < flip, -sv, sv)
    student = BlrLinear(codec.BlrTensor.from_factors([(h, g, ell, wrong_u, wrong_v)]))
    for p in (*student.parameters(), *target.parameters()):
        p.requires_grad_(False)
    return target, student


def toy_inputs(d: int, seed=1) -> torch.Tensor:
    return torch.randn(256, d, generator=torch.Generator().manual_seed(seed))


def run_toy(student, target, settings: SignSettings, steps: int, seed=1, reference=None):
    trainer = SignTrainer({"model.layers.0.mlp.up_proj.weight": student}, settings, steps, Group(), reference=reference)
    x = toy_inputs(student.g.shape[1], seed)
    with torch.no_grad():
        y = target(x)
    losses, notes = [], []
    for step in range(1, steps + 1):
        trainer.begin_step(lr_shape(step, steps), 1.0)
        loss = (student(x) - y).pow(2).mean()
        loss.backward()
        info = trainer.end_step()
        notes += trainer.step_guards(info)
        losses.append(float(loss.detach()))
    return trainer, losses, notes


@pytest.mark.parametrize("optimizer", ["factored", "plain"])
def test_a_toy_problem_that_needs_flips_is_solved(optimizer):
    target, student = toy()
    wrong = int((student.su != target.su).sum() + (student.sv != target.sv).sum())
    settings = load(SignSettings, enabled=True, optimizer=optimizer, eta=0.01, warm=2, max_step_flip=1.0, max_total_flip=1.0, spike_ratio=0.0)
    trainer, losses, _ = run_toy(student, target, settings, 400)
    still_wrong = int((student.su != target.su).sum() + (student.sv != target.sv).sum())
    assert wrong > 100 and still_wrong < 0.1 * wrong, (wrong, still_wrong)
    assert losses[-1] < 0.05 * losses[0]
    assert trainer.stats()["distinct"] > 0.8 * wrong


def test_a_dropped_trainer_is_freed_with_its_state():
    """The gradient hooks on the sign matrices do not keep their trainer alive: a tensor's hooks are out of the
    cyclic collector's sight, and a trainer they held (latents, optimizer state) stayed allocated for good."""
    target, student = toy()
    settings = load(SignSettings, enabled=True, eta=0.01, warm=0, max_step_flip=1.0, max_total_flip=1.0)
    trainer, _, _ = run_toy(student, target, settings, 3)  # trained a little, so its hooks have run
    trainer_ref, latent_ref = weakref.ref(trainer), weakref.ref(next(iter(trainer.latents.values()))["z"])
    trainer = None
    assert trainer_ref() is None and latent_ref() is None
    # its hooks went with it: a backward through the matrices still runs (it called a dead hook before)
    x = torch.randn(4, student.g.shape[1])
    (student(x) - target(x)).pow(2).mean().backward()
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)


def test_adam_moves_every_latent_at_the_same_speed_and_solves_less():
    """Per-sign second moments make every latent move by about η per step, noise or not: on the toy it
    lowers the loss but flips many correct bits too. This is why `factored` is the default."""
    target, student = toy()
    settings = load(SignSettings, enabled=True, optimizer="adam", eta=0.01, warm=2, max_step_flip=1.0, max_total_flip=1.0, spike_ratio=0.0)
    _, losses, _ = run_toy(student, target, settings, 400)
    assert 0.05 * losses[0] < losses[-1] < losses[0]


@pytest.mark.parametrize("optimizer", ["adam", "factored", "plain"])
def test_a_non_finite_sign_gradient_leaves_the_matrix_as_it_was(optimizer):
    target, student = toy()
    settings = load(SignSettings, enabled=True, optimizer=optimizer, eta=0.05, warm=0, max_step_flip=1.0, max_total_flip=1.0, spike_ratio=0.0)
    trainer, _, _ = run_toy(student, target, settings, 3)
    before = {k: {n: t.clone() for n, t in st.items()} for k, st in trainer.latents.items()}
    bits = trainer.snapshot()
    trainer.begin_step(1.0, 1.0)
    x = torch.randn(4, student.g.shape[1])
    x[0, 0] = float("inf")
    (student(x) - target(x)).pow(2).mean().backward()
    step = trainer.end_step()
    assert step["nonfinite"] > 0 and step["flips"] == 0
    assert all(torch.equal(bits[k], b) for k, b in trainer.snapshot().items())
    for key, st in trainer.latents.items():
        for name, t in st.items():
            assert torch.equal(t, before[key][name]), (key, name)


def test_the_flip_rate_guard_halves_eta_after_three_hot_steps():
    target, student = toy()
    settings = load(SignSettings, enabled=True, eta=0.5, warm=0, max_step_flip=1e-6, max_total_flip=1.0)
    trainer, _, notes = run_toy(student, target, settings, 7)
    assert notes and "flip rate" in notes[0]
    assert trainer.counters["eta_mul"] < 1.0


@pytest.mark.parametrize("optimizer", ["adam", "factored"])
def test_update_clip_bounds_the_step_when_the_gradients_jump(optimizer):
    """Moments settled on noise of RMS 1, then ten steps of one gradient 30× larger (the loss pulling all
    the latents one way): the second moment lags, the normalised step of a matrix grows far past η, and
    update_clip holds its RMS to η · update_clip."""
    from nvg.sign_training import latent_step

    gen = torch.Generator().manual_seed(0)
    bits = torch.ones(2, 24, 40)
    trainer = SignTrainer.__new__(SignTrainer)
    trainer.s = load(SignSettings, enabled=True, optimizer=optimizer)
    eta, b1, b2 = 0.01, 0.9, 0.999
    pull = torch.randn(bits.shape, generator=gen) * 30.0
    moves = {}
    for clip in (0.0, 1.0):
        st = trainer._fresh(bits)
        for t in range(1, 301):
            big = t > 290
            g = pull if big else torch.randn(bits.shape, generator=gen)
            before = st["z"].clone()
            scalars = torch.tensor([eta if big else 0.0, 1.0, 1 - b1**t, 1 - b2**t, 1 - b2**(t - 1)])
            _, step_rms = latent_step(optimizer, g, bits.clone(), st, scalars, b1, b2, 1e-8, 0.1, 2.0, clip, 0.0)
        moves[clip] = (st["z"] - before).pow(2).mean((1, 2)).sqrt()
        if clip == 0.0:  # the step RMS it reports is the move's, over η (the largest of the two matrices)
            assert float(step_rms) == pytest.approx(float(moves[0.0].max()) / eta, rel=1e-3)
        else:  # before the clip: past it, where the move is held to η
            assert float(step_rms) > 2 * clip
    assert bool((moves[0.0] > 2 * eta).all()), moves[0.0]
    assert bool((moves[1.0] <= eta * (1 + 1e-5)).all()) and bool((moves[1.0] > 0.9 * eta).all()), moves[1.0]


@pytest.mark.parametrize("optimizer", ["adam", "factored"])
def test_grad_clip_holds_an_outlier_batch_to_twice_the_running_rms(optimizer):
    """Moments settled on noise of RMS 1, then one batch whose gradient is 10× that, in one direction, then
    noise again: unclipped, the outlier drives every latent the same way for as long as the first moment
    keeps it; with grad_clip 2 it enters the moments exactly as the same direction at twice the running
    RMS would, only that matrix-step is clipped, and the latents travel along it a fraction as far."""
    from nvg.sign_training import latent_step

    bits = torch.ones(2, 24, 40)
    trainer = SignTrainer.__new__(SignTrainer)
    trainer.s = load(SignSettings, enabled=True, optimizer=optimizer)
    eta, b1, b2, clip = 0.01, 0.9, 0.999, 2.0
    direction = torch.randn(bits.shape, generator=torch.Generator().manual_seed(1))

    def run(grad_clip: float, outlier_scale=None):
        gen = torch.Generator().manual_seed(0)
        st, clipped, seen = trainer._fresh(bits), [], None
        for t in range(1, 221):
            g = torch.randn(bits.shape, generator=gen)
            if t == 200:
                seen = (st["v"].mean((1, 2)) if optimizer == "adam" else st["v_row"].mean(-1)) / (1 - b2 ** (t - 1))
                g = direction * (10.0 if outlier_scale is None else outlier_scale.view(-1, 1, 1))
                start = st["z"].clone()
            scalars = torch.tensor([eta if t >= 200 else 0.0, 1.0, 1 - b1**t, 1 - b2**t, 1 - b2**(t - 1)])
            counts, _ = latent_step(optimizer, g, bits.clone(), st, scalars, b1, b2, 1e-8, 0.1, 2.0, 1.0, grad_clip)
            clipped.append(int(counts[4]))
        travel = ((st["z"] - start) * -direction.sign()).mean((1, 2))  # along the outlier's pull
        return st["z"], travel, clipped, seen

    z_free, travel_free, clipped_free, seen = run(0.0)
    z_clip, travel_clip, clipped, _ = run(clip)
    rms_outlier = direction.pow(2).mean((1, 2)).sqrt() * 10.0
    z_same, _, _, _ = run(0.0, outlier_scale=10.0 * clip * seen.sqrt() / rms_outlier)
    assert torch.allclose(z_clip, z_same, atol=1e-6, rtol=0)
    assert clipped[199] == 2 and sum(clipped) == 2 and sum(clipped_free) == 0, clipped
    assert bool((travel_free > 3 * eta).all()) and bool((travel_clip < travel_free / 3).all()), (travel_free, travel_clip)


def spiking(trainer, flips: list[int]) -> list[str]:
    """The step guards' lines for a run of steps with these flip counts, after the schedule's peak."""
    lines = []
    for n in flips:
        trainer.begin_step(1.0, 1.0)
        trainer.counters["sign_steps"] += 1
        lines += trainer.step_guards({"flips": n, "flip_rate": n / trainer.live, "eta": trainer.eta})
    return lines


def test_the_spike_guard_halves_eta_in_the_spiking_step_and_doubles_it_back_when_quiet():
    target, student = toy()
    settings = load(SignSettings, enabled=True, eta=0.02, warm=0, spike_ratio=3.0, max_step_flip=1.0, max_total_flip=1.0)
    trainer = SignTrainer({"model.layers.0.mlp.up_proj.weight": student}, settings, 100, Group())
    assert spiking(trainer, [100] * 10) == [] and trainer.counters["flip_means"] == []  # ten steps before the mean starts
    assert spiking(trainer, [10, 12, 9, 11, 10, 10, 11, 9, 10, 11, 35]) == []  # 10 steps of mean before the one compared with
    assert trainer.counters["spike_mul"] == 1.0
    lines = spiking(trainer, [40, 45])
    assert len(lines) == 2 and "flips > 3 × their mean" in lines[0] and trainer.counters["spike_mul"] == 0.25
    assert trainer.counters["spikes"] == 2
    trainer.begin_step(0.5, 1.0)
    assert trainer.eta == pytest.approx(0.02 * 0.25 * 0.5)  # η0 · spike multiplier · schedule shape
    assert trainer.counters["flip_means"][-1] < 14  # the spikes stay out of the mean
    assert spiking(trainer, [10] * 9) == [] and trainer.counters["spike_mul"] == 0.25
    lines = spiking(trainer, [10])  # the tenth quiet step
    assert len(lines) == 1 and "doubled back" in lines[0] and trainer.counters["spike_mul"] == 0.5
    spiking(trainer, [10] * 10)
    assert trainer.counters["spike_mul"] == 1.0
    assert spiking(trainer, [10] * 10) == []  # at 1 it stays


def test_the_spike_guard_waits_for_the_schedules_peak_and_the_first_flips():
    """Flips rise while η warms up with the schedule, and for some steps after the warm ones: no mean
    (so no spike) before the shape has reached 1 and ten steps have passed since the warm ones."""
    target, student = toy()
    settings = load(SignSettings, enabled=True, eta=0.02, warm=0, spike_ratio=3.0, max_step_flip=1.0, max_total_flip=1.0)
    trainer = SignTrainer({"model.layers.0.mlp.up_proj.weight": student}, settings, 100, Group())
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 1000):
        trainer.begin_step(0.5, 1.0)
        trainer.counters["sign_steps"] += 1
        assert trainer.step_guards({"flips": n, "flip_rate": n / trainer.live, "eta": trainer.eta}) == []
    assert trainer.counters["flip_means"] == [] and not trainer.counters["peaked"]
    trainer = SignTrainer({"model.layers.0.mlp.up_proj.weight": student}, load(SignSettings, **{**settings.__dict__, "warm": 5}), 100, Group())
    assert spiking(trainer, [0] * 5 + [0, 1, 3, 9, 20, 40, 80, 160, 320, 640]) == []  # warm, then ten rising steps
    assert trainer.counters["flip_means"] == []


# The H200's flips a step (session 23, train_student at η 0.04 on 91,699,200 signs, steps 31–115): the schedule's
# peak at step 30, a plateau, a rise from step 91 and an avalanche (held-out KL 1.037 at step 100, 1.473 at 200)
H200_FLIPS = [25609, 27611, 28605, 30406, 32539, 34534, 36025, 37422, 38477, 39723, 41182, 41401, 41682, 41614, 41017,
              40882, 41643, 41167, 40119, 39978, 39535, 39827, 40202, 39433, 38892, 38814, 38037, 38407, 38625, 38386,
              38032, 38073, 37874, 37109, 37184, 36163, 36665, 35644, 35992, 35505, 34601, 33743, 33675, 33811, 34847,
              34660, 34330, 34570, 34257, 34134, 33696, 33159, 32739, 33276, 32429, 32732, 32105, 32040, 31515, 31562,
              40685, 46184, 50172, 51393, 52400, 52678, 52486, 53832, 55429, 55718, 57279, 57396, 64095, 67076, 69415,
              70798, 72553, 72924, 81951, 112681, 140806, 166088, 190676, 214899, 250074]


def test_the_spike_guard_fires_in_the_third_step_of_the_h200s_gradual_avalanche():
    """Growing 15–30 % a step, the avalanche drags a current running mean up behind it (never 2.4 × it): the
    guard compares with the mean of ten quiet steps before, and fires at step 111, not in the plateau or the rise."""
    target, student = toy()
    settings = load(SignSettings, enabled=True, eta=0.04, warm=10, spike_ratio=3.0, max_step_flip=1.0, max_total_flip=1.0)
    trainer = SignTrainer({"model.layers.0.mlp.up_proj.weight": student}, settings, 1530, Group())
    trainer.live = 91_699_200  # the H200 run's sign count (the guard's floor is a fraction of it)
    trainer.counters["peaked"], trainer.counters["sign_steps"] = True, 20  # steps 11–30: warm, then the schedule's warm-up
    fired = []
    for step, n in enumerate(H200_FLIPS, start=31):
        trainer.begin_step(1.0, 1.0)
        trainer.counters["sign_steps"] += 1
        fired += [step] * len(trainer.step_guards({"flips": n, "flip_rate": n / trainer.live, "eta": trainer.eta}))
    assert fired[:3] == [111, 112, 113]
    assert trainer.counters["spike_mul"] == 0.5 ** len(fired)


def test_the_total_flip_and_heldout_guards():
    target, student = toy()
    trainer, _, _ = run_toy(student, target, load(SignSettings, enabled=True, eta=0.5, warm=0, max_step_flip=1.0, max_total_flip=1e-4), 5)
    guards = lambda kl: [n for n in trainer.after_eval(heldout_kl=kl, best_kl=1.0)[1] if n.startswith("guard")]  # noqa: E731
    notes = guards(1.0)
    assert any("of signs flipped" in n for n in notes) and trainer.counters["eta_mul"] == 0.5
    trainer.s.max_total_flip = 1.0
    assert guards(1.2) == []  # above 1.05 × best once
    assert guards(1.0) == []  # back under: the count restarts
    guards(1.2)
    notes = guards(1.3)
    assert any("1.05× best twice" in n for n in notes) and trainer.counters["eta_mul"] == 0.25


def test_guards_fire_in_a_training_run(stage_inputs, capsys):
    out = train(stage_inputs, "guards", epochs=1, signs={**SIGNS, "eta": 0.5, "max_step_flip": 1e-6, "max_total_flip": 1e-6})
    err = capsys.readouterr().err
    assert "sign η halved" in err and "flip rate" in err and "of signs flipped" in err
    prov = out.header["provenance"]["nvg_train"]["signs"]
    assert prov["eta_final_multiplier"] < 1.0
    assert set(prov["per_role"]) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert {"flipped_fraction", "churn", "saturated_fraction", "clamped_fraction"} <= set(prov)


def test_exported_bits_are_the_best_snapshots(stage_inputs):
    out = train(stage_inputs, "best", epochs=1, signs={**SIGNS, "eta": 0.3})
    prov = out.header["provenance"]["nvg_train"]
    student = read_cmf(stage_inputs / "student.cmf")
    changed = sum(int((a[0] != b[0]).sum() + (a[1] != b[1]).sum()) for a, b in zip(bits(student).values(), bits(out).values()))
    assert (changed > 0) == (prov["signs"]["distinct"] > 0)  # the written bits are the ones the stats describe
    assert prov["heldout_kl_best"] <= prov["heldout_kl_start"]


def test_resume_with_signs_is_bit_identical(stage_inputs):
    kw = {"signs": {**SIGNS, "eta": 0.05, "optimizer": "factored"}}
    whole = train(stage_inputs, "signs-whole", **kw).path.read_bytes()
    train(stage_inputs, "signs-resumed", stop_after=5, **kw)
    state = next((stage_inputs / "state-signs-resumed").glob("*/state.safetensors"))
    with safe_open(str(state), "pt") as f:
        assert json.loads(f.metadata()["nvg_state"])["modes"]["signs"]["counters"]["sign_steps"] == 4
    assert train(stage_inputs, "signs-resumed", **kw).path.read_bytes() == whole


@pytest.mark.parametrize("text, message", [
    ('{"optimizer": "lion"}', "train.signs.optimizer: 'lion' is not one of"),
    ('{"hyst": 2.0}', "train.signs.hyst: must be in [0, tau"),
    ('{"clamp": 0.5}', "train.signs.clamp: must be >= tau"),
    ('{"typo": 1}', "train.signs.typo: unknown key"),
])
def test_bad_sign_settings(text, message):
    with pytest.raises(NvgError, match=message.replace("[", r"\[")):
        load(SignSettings, text)


def toy_reference(target, seed=1):
    """The toy's `reference`: the target's dense weight and the input Gram of the batch `run_toy` trains on."""
    x = toy_inputs(target.g.shape[1], seed)
    return lambda name: (target.dense_weight(), x.T @ x)


def test_the_margin_is_the_encoders_objective_change_when_one_sign_flips():
    from nvg.sign_training import gram_margin

    target, student = toy(flip=0.05, r=8)
    student.h.data[0] *= 1.3  # not the target's scales either: D H has no special structure
    w, H = toy_reference(target)("")
    H64, w64 = H.double(), w.double()
    objective = lambda lin: float(((w64 - lin.dense_weight().double()) @ H64 * (w64 - lin.dense_weight().double())).sum())  # noqa: E731
    mu, mv = gram_margin(student, w, H)
    before = objective(student)
    for part, margin, entries in (("su", mu, [(0, 3, 5), (0, 17, 2), (0, 31, 7)]), ("sv", mv, [(0, 6, 7), (0, 1, 30), (0, 7, 0)])):
        for idx in entries:
            signs = getattr(student, part)
            signs.data[idx] *= -1
            change = objective(student) - before
            signs.data[idx] *= -1
            assert float(margin[idx]) == pytest.approx(change, rel=1e-4, abs=1e-6 * before), (part, idx)
    wrong_u, wrong_v = student.su != target.su, student.sv != target.sv
    assert (mu[wrong_u] < 0).float().mean() > 0.9 and (mu[~wrong_u] > 0).float().mean() > 0.9
    assert (mv[wrong_v] < 0).float().mean() > 0.9 and (mv[~wrong_v] > 0).float().mean() > 0.9


def test_margin_initialised_latents_flip_the_wrong_bits_first():
    results = {}
    for init in ("uniform", "margin"):
        target, student = toy(flip=0.05)
        wrong = int((student.su != target.su).sum() + (student.sv != target.sv).sum())
        settings = load(SignSettings, enabled=True, init=init, eta=0.01, warm=2, max_step_flip=1.0, max_total_flip=1.0, spike_ratio=0.0)
        _, losses, _ = run_toy(student, target, settings, 100, reference=toy_reference(target) if init == "margin" else None)
        results[init] = (wrong, int((student.su != target.su).sum() + (student.sv != target.sv).sum()), losses[0], losses[-1])
    (wrong, still, first, last), (_, still_uniform, _, last_uniform) = results["margin"], results["uniform"]
    assert still < 0.5 * wrong and last < 0.3 * first, results
    assert still < 0.6 * still_uniform and last < 0.3 * last_uniform, results  # the same η from τ: fewer, later flips


def test_margin_initialised_signs_train_with_the_live_teacher_and_its_grams(stage_inputs):
    out = train(stage_inputs, "signs-margin", epochs=1, targets="live", signs={**SIGNS, "init": "margin", "eta": 0.05})
    prov = out.header["provenance"]["nvg_train"]["signs"]
    assert prov["init"] == "margin" and prov["flips"] > 0
    steps = [r for r in map(json.loads, (stage_inputs / "signs-margin.jsonl").read_text().splitlines()) if "sign_flips" in r]
    assert steps and all(r["sign_step_rms"] > 0 for r in steps)  # each step's largest matrix step RMS, before the clip


def test_margin_initialisation_refuses_grams_of_another_model(stage_inputs, tmp_path):
    import shutil

    import h5py

    from nvg.train_student import TrainSettings, main

    grams = tmp_path / "grams.h5"
    shutil.copy(stage_inputs / "grams.h5", grams)
    with h5py.File(grams, "r+") as f:
        f.attrs["model_hash"] = "0" * 16
    s = load(TrainSettings, epochs=1, batch=8, targets="live", state_root=str(tmp_path / "state"), signs={**SIGNS, "init": "margin"})
    out = tmp_path / "out.cmf"
    with pytest.raises(NvgError, match=r"grams\.h5: Grams of model 0{16}, not of .*teacher\.cmf"):
        main(stage_inputs / "student.cmf", stage_inputs / "windows.h5", [], "tiny", out, tmp_path / "m.jsonl", s,
             stage_inputs / "teacher.cmf", grams)
    assert not out.exists()


def test_margin_initialised_signs_need_the_live_teacher():
    from nvg.train_student import TrainSettings

    with pytest.raises(NvgError, match=r"train.*signs\.init.*margin needs targets: live"):
        load(TrainSettings, **TOPK_TARGETS, signs={"enabled": True, "init": "margin"})


@pytest.mark.parametrize("optimizer", ["adam", "factored", "plain"])
def test_bucketed_updates_equal_one_update_per_matrix(stage_inputs, monkeypatch, optimizer):
    """Stacking same-shaped matrices of consecutive layers into one update changes nothing: the bits,
    latents and counts after six steps equal those of one update per matrix (CPU, bit for bit)."""
    from nvg import sign_training

    keys = {}

    def one_per_matrix(where):
        keys.update(where)
        return [[k] for k in where]

    signs = {**SIGNS, "optimizer": optimizer, "eta": 1.0}
    bucketed = train(stage_inputs, f"bucketed-{optimizer}", epochs=1, stop_after=6, signs=signs)
    by_shape_and_layers = sign_training.buckets
    monkeypatch.setattr(sign_training, "buckets", one_per_matrix)
    single = train(stage_inputs, f"single-{optimizer}", epochs=1, stop_after=6, signs=signs)
    assert len(by_shape_and_layers(keys)) < len(keys) / 2  # the tiny student's two layers share their buckets
    prov = [c.header["provenance"]["nvg_train"]["signs"] for c in (bucketed, single)]
    assert prov[0]["flips"] > 0 and prov[0] == prov[1]
    for name, t in single.tensors.items():
        assert bytes(bucketed.tensors[name].data) == bytes(t.data), name


def test_the_fused_sign_steps_kernels_compile_for_the_h200_here():
    """The interpreter runs Python, not Triton's compiler: every kernel of `nvg.fused_sign_step` is also compiled
    to an sm_90 (H200) binary here, with no GPU, so that a kernel the device would refuse fails in CI. Arguments
    typed by their names: pointers are upper case (float32, but the bf16 moment M and the int64 COUNTS), the
    sizes R, C and the lower-case ones int32 but the thresholds and rates (float32), the widths constexpr."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nvg import fused_sign_step

    floats = {"b1", "b2", "eps", "hyst", "clamp", "grad_clip", "update_clip"}
    widths = {"BLOCK": fused_sign_step.BLOCK_LINE, "BLOCK_R": fused_sign_step.BLOCK_R, "BLOCK_C": fused_sign_step.BLOCK_C}
    kernels = [fused_sign_step._square_sums, fused_sign_step._moments, fused_sign_step._moment_rms,
               fused_sign_step._update_clip, fused_sign_step._latent_update]
    for kernel in kernels:
        names = kernel.arg_names
        signature = {a: "constexpr" if a in widths else "fp32" if a in floats else "i32" if a in ("R", "C") or a.islower()
                     else {"M": "*bf16", "COUNTS": "*i64"}.get(a, "*fp32") for a in names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs={a: widths[a] for a in names if a in widths}),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], kernel.__name__


def test_the_fused_cuda_sign_step_equals_the_tensor_ops_in_tritons_interpreter():
    """The factored optimizer's fused step (`nvg.fused_sign_step`, five Triton launches, what CUDA runs) against
    `latent_step`'s tensor ops, run here on the CPU by Triton's interpreter (a fresh process: the interpreter
    is chosen when the kernels are defined). Both clips bind, then both are off; one matrix's gradient is not
    finite. On the device tests/test_gpu_fast_paths.py compares the compiled kernels the same way."""
    # the clipped run with the matrix programs' lines 4 lanes wide: their loops over rows, columns and tiles run
    # many times, as they do at real sizes (the default line, 1024, covers these shapes in one)
    code = ("import json; from tests.conftest import compare_fused_sign_step; "
            "print(json.dumps([compare_fused_sign_step('cpu', 1.0, 2.0, block_line=4), compare_fused_sign_step('cpu', 0.0, 0.0)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for worst, clips_on in zip(json.loads(proc.stdout.splitlines()[-1]), (True, False)):
        flips, saturated, clamped, nonfinite, clipped = worst["counts_total"]
        assert flips > 100 and saturated > 100 and clamped > 100 and nonfinite == 2, worst
        assert (clipped > 0) == clips_on, worst
        # the moment is kept in bf16: where the two round a value apart it is one bf16 step (at most 2^-7 of it), and
        # the latents inherit that through the step; no bit or count differs
        assert worst["bits"] == 0 and worst["counts"] == 0, worst
        assert worst["m"] <= 2**-7 and worst["z"] < 2e-3 and worst["v"] < 1e-5 and worst["rms"] < 1e-4, worst
