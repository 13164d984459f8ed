"""Student training: schedule, trainable set, KL goes down, best snapshot, bit-identical resume, export."""

from __future__ import annotations

import json
import os

import pytest
import torch

from nvg.cmf import BLR, read_cmf, verify
from nvg.errors import NvgError
from nvg.model import load_model
from nvg.settings import load
from nvg.distill import lr_shape, trainable
from nvg.train_student import TrainSettings, main
from tests.conftest import TOPK_TARGETS, train


def saved_counters(path) -> dict:
    """The JSON counters of a saved training state (safetensors metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["nvg_state"])["run"]


def test_schedule_warms_up_then_cosines_to_zero():
    total = 100
    assert lr_shape(1, total) == 0.5 and lr_shape(2, total) == 1.0
    assert lr_shape(51, total) == pytest.approx(0.5, abs=0.02)
    assert lr_shape(100, total) == pytest.approx(0.0, abs=1e-12)
    assert lr_shape(1, 10) == 1.0  # warm-up is max(1, steps/50)


def test_schedule_with_lr_decay_linear_falls_straight_to_zero():
    """The same warm-up, then a straight line to zero at the last step: below the cosine in the decay's first half,
    above it in its second."""
    total = 100
    assert lr_shape(1, total, "linear") == 0.5 and lr_shape(2, total, "linear") == 1.0
    assert lr_shape(51, total, "linear") == pytest.approx(0.5, abs=0.02)
    assert lr_shape(20, total, "linear") < lr_shape(20, total) and lr_shape(80, total, "linear") > lr_shape(80, total)
    assert lr_shape(100, total, "linear") == 0.0
    steps = [lr_shape(k, total, "linear") for k in range(2, 101)]
    assert all(a - b == pytest.approx(1 / 98) for a, b in zip(steps, steps[1:]))


def test_only_scales_and_norm_gains_train(stage_inputs):
    names = sorted(trainable(load_model(stage_inputs / "student.cmf")))
    assert names and all(n.endswith((".h", ".ell", ".g", "norm.weight")) for n in names)
    assert not any("embed" in n for n in names)


def test_training_lowers_heldout_kl_and_keeps_the_layout(stage_inputs):
    out = train(stage_inputs, "plain")
    block = out.header["provenance"]["nvg_train"]
    assert block["heldout_kl_best"] < block["heldout_kl_start"]
    assert block["steps"] == 2 * (1536 // 32 // 8) and block["evals"][0]["step"] == 0
    student = read_cmf(stage_inputs / "student.cmf")
    assert [(t.name, t.dtype, t.shape, len(t.data)) for t in student.tensors.values()] == \
           [(t.name, t.dtype, t.shape, len(t.data)) for t in out.tensors.values()]
    blr = [n for n, t in out.tensors.items() if t.dtype == BLR]
    assert any(bytes(out.tensors[n].data) != bytes(student.tensors[n].data) for n in blr)
    # only scale bytes change: each payload's sign bits are the student's
    from nvg import blr as codec
    for n in blr:
        a, b = codec.decode(bytes(student.tensors[n].data)), codec.decode(bytes(out.tensors[n].data))
        assert all((pa.u_bits == pb.u_bits).all() and (pa.v_bits == pb.v_bits).all() for pa, pb in zip(a.paths, b.paths))
    assert verify(stage_inputs / "plain.cmf") == []
    lines = [json.loads(x) for x in (stage_inputs / "plain.jsonl").read_text().splitlines()]
    assert any("loss" in x and "grad_norm" in x and "tok_s" in x for x in lines)
    assert not (stage_inputs / "state-plain").exists() or not any((stage_inputs / "state-plain").iterdir())


@pytest.mark.parametrize("lr_relative", [False, True])
def test_resume_after_a_stop_is_bit_identical(stage_inputs, lr_relative):
    whole = train(stage_inputs, f"uninterrupted-{lr_relative}", lr_relative=lr_relative).path.read_bytes()
    train(stage_inputs, f"resumed-{lr_relative}", stop_after=5, lr_relative=lr_relative)  # state saved at step 4; the run ends at 5
    states = list((stage_inputs / f"state-resumed-{lr_relative}").glob("*/state.safetensors"))
    assert len(states) == 1 and saved_counters(states[0])["done"] == 4
    resumed = train(stage_inputs, f"resumed-{lr_relative}", lr_relative=lr_relative)  # same settings: resumes from step 4
    assert resumed.path.read_bytes() == whole


def test_a_changed_setting_never_resumes_stale_state(stage_inputs):
    train(stage_inputs, "stale", stop_after=3)
    out = train(stage_inputs, "stale", lr=0.02)
    assert out.header["provenance"]["nvg_train"]["evals"][0]["step"] == 0
    assert out.header["provenance"]["nvg_train"]["lr"] == 0.02
    assert len(list((stage_inputs / "state-stale").iterdir())) == 1  # the lr=0.01 state is left alone


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_saves_the_state_at_its_step_and_the_rerun_ends_bit_identical(stage_inputs, monkeypatch, signum):
    """SIGTERM (a scheduler's time limit or preemption) or SIGINT (Ctrl-C) mid-training: the step under way
    ends, the state is saved at that step (with `state_every: 0`, none would be), the job stops with one line
    and writes no student; the rerun resumes there and writes the bytes of an uninterrupted run."""
    import signal

    from nvg.distill import Distiller

    whole = train(stage_inputs, f"unsignalled-{signum}", state_every=0).path.read_bytes()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    step, steps = Distiller.step, []

    def step_then_signal(self, *a, **kw):
        out = step(self, *a, **kw)
        steps.append(1)
        if len(steps) == 3:
            os.kill(os.getpid(), getattr(signal, signum))
        return out
    monkeypatch.setattr(Distiller, "step", step_then_signal)
    with pytest.raises(NvgError, match=rf"state-signalled-{signum}/[0-9a-f]+/state.safetensors: {signum} at step 3 "
                                       r"of 12; the state is saved, rerun to resume"):
        train(stage_inputs, f"signalled-{signum}", state_every=0)
    monkeypatch.undo()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
    state = next((stage_inputs / f"state-signalled-{signum}").glob("*/state.safetensors"))
    assert saved_counters(state)["done"] == 3 and not (stage_inputs / f"signalled-{signum}.cmf").exists()
    assert train(stage_inputs, f"signalled-{signum}", state_every=0).path.read_bytes() == whole


def test_a_second_run_on_a_state_in_use_stops_with_one_line(stage_inputs):
    """A second Snakemake started with --unlock while the first one's train_student still runs starts the same
    job on the same state: it stops, naming the state and the process that holds it, and writes nothing."""
    from nvg.resume import one_run

    train(stage_inputs, "held", stop_after=3)  # state saved at step 2
    state = next((stage_inputs / "state-held").glob("*/state.safetensors"))
    before = state.read_bytes(), (stage_inputs / "held.cmf").read_bytes()  # a stopped run writes its best so far
    with one_run(state, "training"):  # the first run, still going
        with pytest.raises(NvgError, match=r"state-held/[0-9a-f]+: a training run on these inputs and settings is "
                                           rf"running now \(process {os.getpid()}\); one run at a time"):
            train(stage_inputs, "held")
    assert (state.read_bytes(), (stage_inputs / "held.cmf").read_bytes()) == before
    out = train(stage_inputs, "held")  # once it has ended, the next run resumes
    assert out.header["provenance"]["nvg_train"]["steps"] == 2 * (1536 // 32 // 8)


@pytest.mark.parametrize("relative", [False, True])
def test_relative_lr_moves_every_tensor_by_the_same_fraction_of_its_size(stage_inputs, relative):
    """Adam's first step moves every entry by about lr; with `lr_relative` by about lr × its tensor's
    starting RMS, so the small g and the large h move at the same relative rate."""
    from nvg.distill import Distiller, Targets, param_groups

    model = load_model(stage_inputs / "student.cmf")
    d = Distiller(model, Targets.from_files(stage_inputs / "windows.h5", [stage_inputs / "topk.0.h5"], model.cfg.vocab_size),
                  torch.device("cpu"), batch=8, precision="fp32")
    before = {n: p.detach().clone() for n, p in d.params.items()}
    opt = torch.optim.Adam(param_groups(d.params, relative), lr=0.01)
    assert d.step(list(range(8)), opt, 1.0, 1.0, lr=0.01, clip=1.0)["skipped"] is False
    moved = {n: float((p.detach() - before[n]).abs().max()) for n, p in d.params.items()}
    rms = {n: float(before[n].pow(2).mean().sqrt()) for n in before}
    if relative:
        assert all(moved[n] == pytest.approx(0.01 * rms[n], rel=1e-3) for n in moved), moved
    else:
        assert all(moved[n] == pytest.approx(0.01, rel=1e-3) for n in moved), moved
        fractions = [moved[n] / rms[n] for n in moved]
        assert max(fractions) > 3 * min(fractions)  # one lr: the tensors move at very different rates


@pytest.mark.parametrize("relative", [False, True])
def test_a_multiplier_scales_only_the_step_of_the_tensors_it_names(relative):
    """`train.group_scale_lr` and `group_code_lr` reach Adam as multipliers of the named tensors' lr_scale; code
    latents move in code steps."""
    from nvg.distill import param_groups

    params = {"a.h": torch.nn.Parameter(torch.full((4,), 2.0)), "embed.scales": torch.nn.Parameter(torch.full((4,), 0.5)),
              "embed.latent": torch.nn.Parameter(torch.full((4,), 3.0))}
    groups = param_groups(params, relative, {"embed.scales": 0.1, "embed.latent": 0.5}, {"embed.latent": 2.0})
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    assert scale[id(params["a.h"])] == pytest.approx(2.0 if relative else 1.0)
    assert scale[id(params["embed.scales"])] == pytest.approx(0.1 * (0.5 if relative else 1.0))
    assert scale[id(params["embed.latent"])] == pytest.approx(0.5 * 2.0)  # in code steps (q2tp's is 2), either way


VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def test_embedding_lr_trains_a_dense_embedding_whole_and_writes_it_in_its_format(stage_inputs):
    """`train.embedding_lr` > 0: the f16 embedding and head train with the scales and are written in their own
    dtype and size; at 0 (the default) their bytes stay the student's."""
    student = read_cmf(stage_inputs / "student.cmf")
    names = [n for n in VOCAB_TENSORS if n in student.tensors]
    frozen = train(stage_inputs, "vocab-frozen", epochs=1)
    trained = train(stage_inputs, "vocab-trained", epochs=1, embedding_lr=1.0)
    for name in names:
        before, after = student.tensors[name], trained.tensors[name]
        assert bytes(frozen.tensors[name].data) == bytes(before.data)
        assert (after.dtype, after.shape, len(after.data)) == (before.dtype, before.shape, len(before.data))
        assert bytes(after.data) != bytes(before.data)
    block = trained.header["provenance"]["nvg_train"]
    assert block["embedding_lr"] == 1.0 and block["heldout_kl_best"] < block["heldout_kl_start"]
    assert verify(stage_inputs / "vocab-trained.cmf") == []


def test_adam_beta2_reaches_adam_and_the_provenance(stage_inputs):
    """`train.adam_beta2` is Adam's second-moment decay: another value trains other scales, and the file records it."""
    default = train(stage_inputs, "beta2-default", epochs=1)
    fast = train(stage_inputs, "beta2-05", epochs=1, adam_beta2=0.5)
    assert default.header["provenance"]["nvg_train"]["adam_beta2"] == 0.999
    assert fast.header["provenance"]["nvg_train"]["adam_beta2"] == 0.5
    blr = [n for n, t in default.tensors.items() if t.dtype == BLR]
    assert blr and any(bytes(default.tensors[n].data) != bytes(fast.tensors[n].data) for n in blr)


def test_embedding_lr_on_a_quantised_embedding_is_refused(stage_inputs, tmp_path):
    from nvg.cmf import Q2TP, dense_tensor, tensor_to_numpy, write_cmf

    for name in ("windows.h5", "topk.0.h5"):
        (tmp_path / name).write_bytes((stage_inputs / name).read_bytes())
    src = read_cmf(stage_inputs / "student.cmf")
    write_cmf(tmp_path / "student.cmf", src.header, [dense_tensor(n, tensor_to_numpy(t), Q2TP) if n in VOCAB_TENSORS else t
                                                    for n, t in src.tensors.items()], src.vocab)
    with pytest.raises(NvgError, match="train.embedding_lr: 0.5, but .*student.cmf's embedding and LM head are not dense"):
        train(tmp_path, "q2tp", epochs=1, embedding_lr=0.5)
    assert not (tmp_path / "q2tp.cmf").exists()


def test_fp16_and_tail_modes_run(stage_inputs):
    out = train(stage_inputs, "fp16tail", precision="fp16", tail=True, epochs=1)
    block = out.header["provenance"]["nvg_train"]
    assert block["tail"] is True and block["precision"] == "fp16"
    assert block["heldout_kl_best"] <= block["heldout_kl_start"]


def test_two_processes_under_torchrun_match_one(stage_inputs):
    """Data parallel on the CPU (gloo): each process takes half of every batch; the losses and the trained
    scales equal one process's up to the order of the gradient reduction."""
    import subprocess
    import sys

    from nvg import blr as codec

    one = train(stage_inputs, "one-process", epochs=1, precision="fp32")  # float32: equal up to reduction order
    d = stage_inputs
    settings = {"epochs": 1, "batch": 8, "lr": 0.01, "eval_every": 3, "state_every": 2, "gpus": 2,
                **TOPK_TARGETS,
                "precision": "fp32", "state_root": str(d / "state-two")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "nvg.train_student", "--student", str(d / "student.cmf"), "--windows", str(d / "windows.h5"),
                           "--topk", str(d / "topk.0.h5"), "--out", str(d / "two.cmf"), "--metrics", str(d / "two.jsonl"),
                           "--settings", json.dumps(settings)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "× 2 processes" in proc.stderr
    read = lambda name: [json.loads(x) for x in (d / name).read_text().splitlines()]  # noqa: E731
    a, b = read("one-process.jsonl"), read("two.jsonl")
    assert [sorted(x) for x in a] == [sorted(x) for x in b]
    for x, y in zip(a, b):
        for key in ("loss", "heldout_kl", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-4), (key, x, y)
    two = read_cmf(d / "two.cmf")
    assert two.header["provenance"]["nvg_train"]["processes"] == 2
    for name, t in one.tensors.items():
        if t.dtype == BLR:
            pa, pb = codec.decode(bytes(t.data)).paths[0], codec.decode(bytes(two.tensors[name].data)).paths[0]
            for va, vb in ((pa.h, pb.h), (pa.g, pb.g), (pa.ell, pb.ell)):
                assert torch.allclose(torch.from_numpy(va), torch.from_numpy(vb), rtol=2e-3, atol=1e-4), name


def test_sigterm_to_torchrun_stops_both_processes_at_one_step_and_the_rerun_ends_identical(stage_inputs):
    """A scheduler's SIGTERM to torchrun, which passes it on to its two processes, mid-training: both stop
    after the same step, process 0 saves the state there (`state_every: 0`, so no other save exists), the job
    fails with one line; the rerun resumes there and writes the bytes of an uninterrupted two-process run."""
    import signal
    import subprocess
    import sys

    d = stage_inputs

    def torchrun(name):
        settings = {"epochs": 4, "batch": 8, "lr": 0.01, "eval_every": 3, "state_every": 0, "gpus": 2,
                    "precision": "fp32", **TOPK_TARGETS, "state_root": str(d / f"state-{name}")}
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                 "-m", "nvg.train_student", "--student", str(d / "student.cmf"), "--windows", str(d / "windows.h5"),
                                 "--topk", str(d / "topk.0.h5"), "--out", str(d / f"{name}.cmf"), "--metrics",
                                 str(d / f"{name}.jsonl"), "--settings", json.dumps(settings)],
                                stderr=subprocess.PIPE, text=True)

    whole = torchrun("two-whole")
    assert whole.wait(600) == 0, whole.stderr.read()[-3000:]
    signalled = torchrun("two-signalled")
    for line in signalled.stderr:
        if " step 2/24 " in line:
            signalled.send_signal(signal.SIGTERM)
            break
    err = signalled.stderr.read()
    assert signalled.wait(600) != 0 and not (d / "two-signalled.cmf").exists()
    state = next((d / "state-two-signalled").glob("*/state.safetensors"))
    done = saved_counters(state)["done"]
    assert 2 <= done < 24 and f"SIGTERM at step {done} of 24; the state is saved, rerun to resume" in err, err[-3000:]
    rerun = torchrun("two-signalled")
    assert rerun.wait(600) == 0, rerun.stderr.read()[-3000:]
    assert (d / "two-signalled.cmf").read_bytes() == (d / "two-whole.cmf").read_bytes()


def test_a_live_teacher_gives_full_vocabulary_and_hidden_state_targets(stage_inputs):
    out = train(stage_inputs, "live", targets="live", hidden_weight=1.0)
    block = out.header["provenance"]["nvg_train"]
    assert block["targets"] == "live" and block["hidden_weight"] == 1.0 and "topk" not in block
    assert block["heldout_kl_best"] < block["heldout_kl_start"]
    lines = [json.loads(x) for x in (stage_inputs / "live.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    evals = [x["heldout_kl"] for x in lines if "heldout_kl" in x]
    # the training loss carries the hidden-state term; the held-out KL is the KL alone
    assert losses[0] > evals[0] > 0


def test_hidden_decay_weighs_the_hidden_term_by_the_schedule(stage_inputs, monkeypatch):
    """train.hidden_decay: each step's hidden-state term is hidden_weight × the lr schedule's shape, so the last
    step trains on the KL alone; the loss is linear in that factor and at 0 is the held-out measure (the KL)."""
    from nvg.distill import Distiller, Targets

    teacher, student = load_model(stage_inputs / "teacher.cmf"), load_model(stage_inputs / "student.cmf")
    targets = Targets.from_files(stage_inputs / "windows.h5", [], student.cfg.vocab_size)
    d = Distiller(student, targets, torch.device("cpu"), batch=2, precision="fp32", teacher=teacher, hidden_weight=0.5)
    losses = {}
    for factor in (0.0, 0.5, 1.0):
        d.hidden_factor = factor
        losses[factor] = d.loss([0, 1]).item()
    with torch.no_grad():
        kl = d.loss([0, 1]).item()
    assert losses[0.0] == pytest.approx(kl, rel=1e-6) and losses[1.0] > losses[0.0]
    assert losses[1.0] - losses[0.0] == pytest.approx(2 * (losses[0.5] - losses[0.0]), rel=1e-4)

    factors = []
    step = Distiller.step
    monkeypatch.setattr(Distiller, "step", lambda self, *a, **k: (step(self, *a, **k), factors.append(self.hidden_factor))[0])
    out = train(stage_inputs, "decay", targets="live", hidden_weight=0.5, hidden_decay=True)
    total = len(factors)
    assert factors == pytest.approx([lr_shape(i, total) for i in range(1, total + 1)]) and factors[-1] == 0.0
    assert out.header["provenance"]["nvg_train"]["hidden_decay"] is True


@pytest.mark.parametrize("hidden_weight", [0.0, 0.5])
def test_a_live_teachers_outputs_are_kept_per_window_and_read_back_exactly(stage_inputs, monkeypatch, hidden_weight):
    """The teacher runs once per window while its outputs fit in `teacher_memo_bytes`; a later batch, in any
    order or mix of windows, gets the loss a teacher run anew gives."""
    from nvg.distill import Distiller, Targets

    teacher, student = load_model(stage_inputs / "teacher.cmf"), load_model(stage_inputs / "student.cmf")
    targets = Targets.from_files(stage_inputs / "windows.h5", [], student.cfg.vocab_size)
    runs = []
    residuals = teacher.residuals
    monkeypatch.setattr(teacher, "residuals", lambda ids, *a: runs.append(ids.shape[0]) or residuals(ids, *a))
    kept = Distiller(student, targets, torch.device("cpu"), batch=2, precision="fp32", teacher=teacher,
                     hidden_weight=hidden_weight)
    anew = Distiller(student, targets, torch.device("cpu"), batch=2, precision="fp32", teacher=teacher,
                     hidden_weight=hidden_weight, teacher_memo_bytes=0)
    for rows, teacher_runs, grad in (([0, 1], 1, True), ([1, 2], 1, True), ([2, 0], 0, True), ([1, 0], 0, False)):
        before = len(runs)
        with torch.set_grad_enabled(grad):  # a training step, then a held-out pass (the KL alone)
            loss = kept.loss(rows).item()
            assert len(runs) - before == teacher_runs
            assert loss == pytest.approx(anew.loss(rows).item(), rel=1e-6)
        assert len(runs) - before == teacher_runs + 1  # with no room for them, the teacher runs every time


def test_after_the_hidden_epochs_the_teachers_final_states_are_read_back_exactly(stage_inputs, monkeypatch):
    """With KL-alone steps ahead (`train.hidden_epochs`) and room for the teacher's final-normed hidden states but not
    for its residual stream, the hidden-state steps run the teacher every time and keep those states; a KL-alone step
    then reads them back, with the loss a teacher run anew gives, and runs the teacher only for a window not yet seen.
    Without KL-alone steps ahead nothing is kept."""
    from nvg.distill import Distiller, Targets

    teacher, student = load_model(stage_inputs / "teacher.cmf"), load_model(stage_inputs / "student.cmf")
    targets = Targets.from_files(stage_inputs / "windows.h5", [], student.cfg.vocab_size)
    runs = []
    residuals = teacher.residuals
    monkeypatch.setattr(teacher, "residuals", lambda ids, *a: runs.append(ids.shape[0]) or residuals(ids, *a))
    n, window = targets.tokens.shape
    room = n * window * teacher.head_weight.shape[1] * 4  # every window's final states in float32, not two layers'
    assert len(teacher.model.layers) > 1

    def distiller(**kw):
        return Distiller(student, targets, torch.device("cpu"), batch=2, precision="fp32", teacher=teacher,
                         hidden_weight=0.5, **kw)

    kept, anew = distiller(kl_alone_ahead=True, teacher_memo_bytes=room), distiller(teacher_memo_bytes=0)
    assert kept.keeps_teacher_hidden() and not distiller(teacher_memo_bytes=room).keeps_teacher_hidden()
    for rows in ([0, 1], [1, 0]):  # the hidden-state term needs every block's output: the teacher runs each time
        before = len(runs)
        assert kept.loss(rows).item() == pytest.approx(anew.loss(rows).item(), rel=1e-6)
        assert len(runs) - before == 2
    kept.hidden_on = anew.hidden_on = False
    for rows, teacher_runs in (([1, 0], 0), ([2, 1], 1), ([2, 0], 0)):
        before = len(runs)
        loss = kept.loss(rows).item()
        assert len(runs) - before == teacher_runs
        assert loss == pytest.approx(anew.loss(rows).item(), rel=1e-6)


def test_hidden_epochs_trains_the_hidden_term_in_the_first_epochs_only(stage_inputs, monkeypatch):
    """`train.hidden_epochs` 1 of 2: every step of the first epoch has the hidden-state term, none of the second; the
    file records the setting."""
    from nvg.distill import Distiller

    terms = []
    step = Distiller.step
    monkeypatch.setattr(Distiller, "step", lambda self, *a, **k: (terms.append(self.hidden_on), step(self, *a, **k))[1])
    out = train(stage_inputs, "hidden-epochs", targets="live", hidden_weight=0.5, hidden_epochs=1)
    per_epoch = len(terms) // 2
    assert per_epoch > 0 and terms == [True] * per_epoch + [False] * per_epoch
    assert out.header["provenance"]["nvg_train"]["hidden_epochs"] == 1


def test_a_tied_group_scaled_embedding_is_built_once_a_step_with_the_same_gradient(stage_inputs, monkeypatch):
    """The lookup and the logits share one build of a q2tp embedding's weight per loss (`parametrize.cached`
    in `Distiller.loss`), and its scales get the gradient of both uses, as when each builds its own."""
    from nvg import tiled
    from nvg.cmf import Q2TP, Tensor
    from nvg.distill import Distiller, Targets
    from nvg.losses import topk_kl
    from nvg.model import GroupScaled, group_scaled

    model = load_model(stage_inputs / "student.cmf")
    embed = model.model.embed_tokens
    w = embed.weight.detach().numpy()
    group_scaled(embed, Tensor("model.embed_tokens.weight", Q2TP, w.shape, tiled.encode(w, 2)))
    targets = Targets.from_files(stage_inputs / "windows.h5", [stage_inputs / "topk.0.h5"], w.shape[0])
    d = Distiller(model, targets, torch.device("cpu"), batch=2, precision="fp32")
    builds = []
    forward = GroupScaled.forward
    monkeypatch.setattr(GroupScaled, "forward", lambda self, s: builds.append(1) or forward(self, s))
    d.loss([0, 1]).backward()
    scale = embed.parametrizations.weight.original
    assert len(builds) == 1 and scale.grad is not None and scale.grad.abs().sum() > 0
    cached_grad, scale.grad = scale.grad.clone(), None
    ids = torch.from_numpy(targets.tokens[[0, 1]])
    t_ids, t_logp = (torch.from_numpy(a) for a in targets.topk.read([0, 1]))
    (topk_kl(model.hidden(ids), model.head_weight, t_ids, t_logp) / ids.numel()).backward()  # uncached: two builds
    assert len(builds) == 3 and torch.allclose(scale.grad, cached_grad, rtol=1e-5, atol=1e-9)


def test_the_full_kl_is_the_exact_kl_and_the_hidden_loss_is_scale_free():
    from nvg.losses import full_kl, hidden_mse

    torch.manual_seed(0)
    hidden, t_hidden, head = torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(40, 8)
    exact = torch.nn.functional.kl_div((hidden @ head.T).log_softmax(-1), (t_hidden @ head.T).log_softmax(-1),
                                       log_target=True, reduction="sum")
    assert full_kl(hidden, head, t_hidden, head, chunk=3) == pytest.approx(float(exact), rel=1e-5)
    assert float(full_kl(t_hidden, head, t_hidden, head)) == pytest.approx(0.0, abs=1e-5)
    layers = [torch.randn(2, 5, 8) for _ in range(3)]
    assert float(hidden_mse(layers, [3.0 * x for x in layers])) == pytest.approx(0.0, abs=1e-6)
    assert float(hidden_mse(layers, [-x for x in layers])) == pytest.approx(3 * 4.0, rel=1e-5)


def test_a_live_teacher_the_student_was_not_encoded_from_is_refused(stage_inputs, tmp_path):
    from nvg.cmf import write_cmf

    student = read_cmf(stage_inputs / "student.cmf")
    header = json.loads(json.dumps(student.header))
    header["provenance"]["nvg_encode"]["teacher_hash"] = "0123456789abcdef"
    other = tmp_path / "other"
    other.mkdir()
    for name in ("windows.h5", "teacher.cmf"):
        os.symlink(stage_inputs / name, other / name)
    write_cmf(other / "student.cmf", header, list(student.tensors.values()), student.vocab)
    with pytest.raises(NvgError, match=r"student.cmf: encoded from teacher 0123456789abcdef, not from .*teacher.cmf \([0-9a-f]{16}\)"):
        train(other, "wrong", targets="live")
    assert not (other / "wrong.cmf").exists()


@pytest.mark.parametrize("text, message", [
    ('{"lr": 0}', "train.lr: 0 is less than or equal to the minimum of 0"),
    ('{"gpus": 3, "batch": 4}', "train.gpus: must divide train.batch 4, got 3"),
    ('{"device": "gpu0"}', "train.device: 'gpu0' does not match"),
    ('{"gpus": 2, "batch": 4, "device": "cuda:1"}', "train.device: cuda:1 names one GPU, but train.gpus 2 runs one process"),
    ('{"precision": "int8"}', "train.precision: 'int8' is not one of"),
    ('{"epochs": 1.5}', "train.epochs: 1.5 is not of type 'integer'"),
    ('{"stop_after": 0}', "train.stop_after: 0 is less than the minimum of 1"),
    ('{"adam_beta2": 1.0}', "train.adam_beta2: 1.0 is greater than or equal to the maximum of 1"),
    ('{"hidden_epochs": 0}', "train.hidden_epochs: 0 is less than the minimum of 1"),
    ('{"signs": {"tau": 0}}', "train.signs.tau: 0 is less than or equal to the minimum of 0"),
    ('{"signz": {}}', "train.signz: unknown key"),
    ('{"targets": "live", "tail": true}', "train.tail: applies to targets: topk only"),
    ('{"fp8": true, "precision": "fp32"}', "train.fp8: needs train.precision bf16"),
])
def test_bad_settings(text, message):
    with pytest.raises(NvgError, match=message):
        load(TrainSettings, text)


def test_a_non_finite_step_is_skipped_counted_and_logged(stage_inputs, monkeypatch):
    """A step whose loss is not finite (fp16 overflow, say) is skipped, counted and logged; training
    goes on. The loss of every batch holding training window 0 is made NaN here."""
    from nvg.distill import Distiller

    d = stage_inputs
    clean = Distiller.loss

    def poisoned(self, rows):
        loss = clean(self, rows)
        return loss * float("nan") if torch.is_grad_enabled() and 0 in rows else loss

    monkeypatch.setattr(Distiller, "loss", poisoned)
    s = load(TrainSettings, epochs=2, batch=8, lr=0.01, eval_every=100, state_every=0, precision="fp16", **TOPK_TARGETS,
             state_root=str(d / "state-nan"))
    main(d / "student.cmf", d / "windows.h5", [d / "topk.0.h5"], "tiny", d / "nan.cmf", d / "nan.jsonl", s)
    block = read_cmf(d / "nan.cmf").header["provenance"]["nvg_train"]
    assert block["skipped"] == 2 and block["steps"] == 2 * (1536 // 32 // 8) - 2
    assert any(json.loads(x).get("skipped") for x in (d / "nan.jsonl").read_text().splitlines())
    model = load_model(d / "nan.cmf")
    assert all(torch.isfinite(p).all() for p in model.parameters())


class Planted:
    """Unpickling this runs a command: what a state file must never be able to do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_as_training_state_is_refused_and_never_run(stage_inputs, tmp_path):
    train(stage_inputs, "planted", stop_after=2)  # leaves a state at step 2
    (state,) = (stage_inputs / "state-planted").glob("*/state.safetensors")
    marker = tmp_path / "INJECTED"
    torch.save({"done": 2, "evil": Planted(marker)}, state)
    with pytest.raises(NvgError, match=f"{state}: not a readable training state"):
        train(stage_inputs, "planted")
    assert not marker.exists()


def test_the_next_batch_is_read_ahead_in_a_thread_and_trains_the_same(stage_inputs, monkeypatch):
    import threading

    from nvg.distill import Distiller

    readers = []
    read_targets = Distiller._read_targets

    def spy(self, rows):
        readers.append(threading.current_thread().name)
        return read_targets(self, rows)

    monkeypatch.setattr(Distiller, "_read_targets", spy)
    ahead = train(stage_inputs, "read-ahead", epochs=1)
    assert sum(name.startswith("topk") for name in readers) >= 4, readers  # the next batch came from the thread
    monkeypatch.setattr(Distiller, "prefetch", lambda self, rows: None)
    inline = train(stage_inputs, "read-inline", epochs=1)
    for name, t in inline.tensors.items():
        assert bytes(ahead.tensors[name].data) == bytes(t.data), name


def test_training_memory_for_targets_stays_one_batch_on_a_shard_far_larger(tiny_cmf, stage_inputs, tmp_path):
    """The top-k shard (k 256) is three times the cap; numpy's traced peak over the whole training loop
    (each batch's targets, read ahead, and the evaluations' held-out rows) stays under the cap. The
    shard's opening check streams in slices too (tests/test_teacher_topk.py)."""
    import shutil
    import tracemalloc

    from nvg.artifacts import read_windows
    from nvg.teacher_topk import TopkSettings, main as topk
    from nvg.train_student import finish, fit, setup

    for name in ("windows.h5", "student.cmf"):
        shutil.copy(stage_inputs / name, tmp_path / name)
    topk(tiny_cmf, tmp_path / "windows.h5", 0, tmp_path / "topk.0.h5", load(TopkSettings, k=256, shards=1, batch=8))
    tokens, _ = read_windows(tmp_path / "windows.h5")
    shard = tokens.size * 256 * 6
    run = setup(tmp_path / "student.cmf", tmp_path / "windows.h5", [tmp_path / "topk.0.h5"],
                load(TrainSettings, epochs=2, batch=8, eval_every=3, state_every=0, **TOPK_TARGETS,
                               state_root=str(tmp_path / "state")))
    tracemalloc.start()
    with run.lock:
        fit(run)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    finish(run, "tiny", tmp_path / "out.cmf", tmp_path / "m.jsonl")
    assert run.state.done == 2 * run.n_batches
    assert peak < shard / 3, (peak, shard)
