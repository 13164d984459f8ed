"""Budget plans, the rank rule, and the encoder: data-aware beats Dual-SVID; re-encoding keeps bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nvg import blr as codec
from nvg.budget_reencode import main
from nvg.encoder import EncodeSettings, encode_tensor
from nvg.cmf import BLR, read_cmf
from nvg.errors import NvgError
from nvg.plan import ends_raised, filled_budgets, parse_plan, read_plan
from nvg.settings import load
from tests.conftest import REPO

NAMES = [f"model.layers.{i}.{s}.weight" for i in range(4) for s in ("self_attn.q_proj", "mlp.down_proj")]


def test_plan_precedence():
    plan = parse_plan("# budgets\ndefault 0.8\nlayer 0-3 1.0\nlayer 2 0.5\ntensor model.layers.*.mlp.down_proj.weight 1.5\n"
                      "tensor model.layers.3.mlp.down_proj.weight 0.3  # later beats earlier\n")
    plan.check_against(4, NAMES, NAMES)
    assert plan.rule_for("model.layers.1.self_attn.q_proj.weight", 1, 9)[0] == 1.0
    assert plan.rule_for("model.layers.2.self_attn.q_proj.weight", 2, 9)[0] == 0.5
    assert plan.rule_for("model.layers.2.mlp.down_proj.weight", 2, 9)[0] == 1.5
    assert plan.rule_for("model.layers.3.mlp.down_proj.weight", 3, 9)[0] == 0.3
    assert parse_plan("layer 1 2.0").rule_for("x", 0, 0.7)[0] == 0.7
    assert read_plan(None, 0.9).rule_for("x", 0, 0.1)[0] == 0.9


@pytest.mark.parametrize("text, message", [
    ("default 0.8\nlayer x 1.0", "line 2: layer 'x' is not"),
    ("default abc", "line 1: bits per weight 'abc' is not a number"),
    ("\n\nlayer 3-1 1.0", "line 3: layer range '3-1' is empty"),
    ("default -1", "line 1: bits per weight -1.0 must be in"),
    ("bits 1.0", "line 1: expected 'default <bpw>'"),
    ("embedding q3", "line 1: embedding format 'q3' is not one of f16, q8_row"),
    ("\nlm_head q2tp 2.0", "line 2: lm_head q2tp takes no bits per weight"),
    ("embedding blr 40", "line 1: bits per weight 40.0 must be in"),
])
def test_plan_syntax_errors_have_line_numbers(text, message):
    with pytest.raises(NvgError, match=message):
        parse_plan(text, "plan.txt")


def test_plan_embedding_and_lm_head_lines_beat_config():
    plan = parse_plan("embedding q2tp\nlm_head blr 1.5\nlm_head blr  # a later line beats an earlier one", "p.txt")
    assert plan.vocab_rule("model.embed_tokens.weight", "f16", 1.0)[:2] == ("q2tp", 1.0)
    assert plan.vocab_rule("lm_head.weight", "f16", 1.0) == ("blr", 1.0, "config encode.embedding_bpw")
    assert parse_plan("lm_head blr 1.5", "p.txt").vocab_rule("lm_head.weight", "f16", 1.0) == ("blr", 1.5, "p.txt: line 1")
    assert parse_plan("default 1", "p").vocab_rule("lm_head.weight", "q4tp", 1.0)[:2] == ("q4tp", 1.0)  # config's
    plan.check_against(4, NAMES, [*NAMES, "model.embed_tokens.weight", "lm_head.weight"])
    with pytest.raises(NvgError, match="p.txt: line 2: the model has no lm_head.weight .its LM head is the tied embedding"):
        parse_plan("embedding q2tp\nlm_head q4tp", "p.txt").check_against(4, NAMES, [*NAMES, "model.embed_tokens.weight"])


def test_plan_errors_against_the_model():
    with pytest.raises(NvgError, match="line 2: layer 9 is out of range"):
        parse_plan("default 1\nlayer 5-9 1.0", "p").check_against(4, NAMES, NAMES)
    with pytest.raises(NvgError, match="line 1: tensor rule 'model.layers.0.mlp.up_proj.weight' matches no"):
        parse_plan("tensor model.layers.0.mlp.up_proj.weight 1.0", "p").check_against(4, NAMES, NAMES)


def correlated_problem(seed=0, d_out=96, d_in=128, tokens=2048):
    """A weight and Grams of inputs with a strongly non-isotropic covariance, as in a real model."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d_in, d_in, generator=g) * torch.logspace(0, -2, d_in)
    x = torch.randn(tokens, d_in, generator=g) @ mix.T
    w = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    h_fit = (x[: tokens // 2].T @ x[: tokens // 2]).numpy()
    h_sel = (x[tokens // 2 :].T @ x[tokens // 2 :]).numpy()
    return w.numpy(), h_fit, h_sel


@pytest.mark.parametrize("bpw", [1.0, 2.0])
def test_data_aware_encoder_beats_dual_svid(bpw):
    w, h_fit, h_sel = correlated_problem()
    errs = {}
    for method in ("dual-svid", "nvg"):
        blr, row = encode_tensor(w, h_fit, h_sel, bpw, "up", 16, load(EncodeSettings, method=method, device="cpu"), torch.device("cpu"), "t")
        assert row["bpw"] <= bpw and row["rank"] % 8 == 0
        assert len(blr.encode()) == codec.payload_nbytes(row["paths"], row["rank"], 96, 128)
        errs[method] = row["rel_sel_error"]
    assert errs["nvg"] < 0.7 * errs["dual-svid"]


@pytest.mark.parametrize("paths", ["1", "2"])
def test_refining_the_v_signs_too_lowers_the_error(paths):
    w, h_fit, h_sel = correlated_problem()
    errs = {}
    for signs in ("u", "uv"):
        s = load(EncodeSettings, paths=paths, signs=signs, device="cpu")
        errs[signs] = encode_tensor(w, h_fit, h_sel, 1.0, "up", 16, s, torch.device("cpu"), "t")[1]["rel_fit_error"]
    assert errs["uv"] < 0.97 * errs["u"], errs


def test_the_v_sweep_runs_in_the_configured_groups(monkeypatch):
    """encode.v_groups reaches every S_V sweep, and with 2 groups (the default job's) as with 8 the V signs
    still lower the error against refining S_U's alone."""
    import nvg.encoder as enc

    w, h_fit, h_sel = correlated_problem()
    seen, sweep = [], enc.flip_v_signs
    monkeypatch.setattr(enc, "flip_v_signs", lambda *a: seen.append(a[-1]) or sweep(*a))
    errs = {}
    for signs, groups in (("u", 8), ("uv", 8), ("uv", 2)):
        s = load(EncodeSettings, paths="2", signs=signs, v_groups=groups, device="cpu")
        errs[signs, groups] = encode_tensor(w, h_fit, h_sel, 1.0, "up", 16, s, torch.device("cpu"), "t")[1]["rel_fit_error"]
    assert seen and set(seen) == {8, 2} and seen.count(2) == seen.count(8)
    assert max(errs["uv", 8], errs["uv", 2]) < errs["u", 8], errs


def path_error(f, target, H, rho) -> torch.Tensor:
    """The encoder's objective E = Σ_o ρ_o (t_o − ŵ_o) H (t_o − ŵ_o)ᵀ of one path, directly."""
    from nvg.encoder import path_weight

    d = target - path_weight(f)
    return (rho[:, None] * (d @ H) * d).sum()


def test_the_v_sweep_change_is_the_change_of_the_objective():
    """refine_path keeps a V sweep by `v_sweep_change` (r · d_in² work): it equals E after − E before."""
    from nvg.encoder import damped, v_sweep_change, whitened_path

    w, h_fit, _ = correlated_problem()
    H, chol = damped(torch.from_numpy(h_fit).double(), 0.01)
    target = torch.from_numpy(w).double()
    h, ell, g, su, sv = whitened_path(target, 16, chol)
    rho = torch.rand(len(target), generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    flipped = torch.where(torch.rand(sv.shape, generator=torch.Generator().manual_seed(1)) < 0.1, -sv, sv).double()
    change = v_sweep_change(h[:, None] * su * ell[None, :], rho, target @ H, H, g, sv, flipped)
    direct = path_error([h, ell, g, su, flipped], target, H, rho) - path_error([h, ell, g, su, sv], target, H, rho)
    assert change.item() == pytest.approx(direct.item(), rel=1e-9) and direct != 0


def test_a_v_sign_sweep_one_row_at_a_time_never_raises_the_objective():
    from nvg.encoder import whitened_path, damped
    from nvg.sign_sweep import flip_v_signs

    w, h_fit, _ = correlated_problem()
    H, chol = damped(torch.from_numpy(h_fit).double(), 0.01)
    target = torch.from_numpy(w).double()
    h, ell, g, su, sv = whitened_path(target, 16, chol)
    rho = torch.ones(len(target), dtype=torch.float64)
    before = path_error([h, ell, g, su, sv], target, H, rho)
    swept = flip_v_signs(sv, h[:, None] * su * ell[None, :], g, target, H, rho, groups=len(sv))  # Gauss-Seidel: exact
    assert (swept != sv).any() and path_error([h, ell, g, su, swept], target, H, rho) < before


def test_two_paths_fall_back_to_one_where_the_budget_cannot_hold_two():
    w, h_fit, h_sel = correlated_problem()
    bpw = codec.bits_per_weight(1, 8, *w.shape)  # rank 8 with one path, exactly
    assert codec.max_rank(bpw, 2, *w.shape) < 8
    _, row = encode_tensor(w, h_fit, h_sel, bpw, "up", 16, load(EncodeSettings, paths="2", device="cpu"), torch.device("cpu"), "t")
    assert (row["paths"], row["rank"]) == (1, 8)
    _, row = encode_tensor(w, h_fit, h_sel, 1.0, "up", 16, load(EncodeSettings, paths="2", device="cpu"), torch.device("cpu"), "t")
    assert row["paths"] == 2


def test_a_budget_below_rank_8_names_the_minimum():
    w, h_fit, h_sel = correlated_problem()
    with pytest.raises(NvgError, match=r"t: 0.1000 bpw cannot hold even rank 8 \(the minimum is"):
        encode_tensor(w, h_fit, h_sel, 0.1, "up", 16, load(EncodeSettings, paths="1"), torch.device("cpu"), "t")


@pytest.fixture(scope="module")
def encoded(tiny_stages, tmp_path_factory):
    import shutil

    d = tmp_path_factory.mktemp("enc")
    shutil.copy(tiny_stages / "grams.h5", d / "grams.h5")
    shutil.copy(tiny_stages / "student.cmf", d / "enc.cmf")
    shutil.copy(tiny_stages / "student.json", d / "enc.json")
    return d


def test_encode_report_and_student_file(encoded, tiny_cmf):
    report = json.loads((encoded / "enc.json").read_text())
    assert len(report["tensors"]) == 14 and report["body_bpw"] <= 2.0
    for row in report["tensors"].values():
        assert {"method", "rank", "paths", "bpw", "rel_sel_error"} <= set(row)
    student, teacher = read_cmf(encoded / "enc.cmf"), read_cmf(tiny_cmf)
    assert sum(t.dtype == BLR for t in student.tensors.values()) == 14
    assert bytes(student.tensors["model.norm.weight"].data) == bytes(teacher.tensors["model.norm.weight"].data)
    assert student.vocab == teacher.vocab


def test_reencode_changes_only_planned_tensors(encoded, tiny_cmf):
    """Each tensor at its cap (fill false: with the fill, a budget raised in the plan moves the others' fills too)."""
    plan = encoded / "plan.txt"
    plan.write_text("default 2.0\ntensor model.layers.1.mlp.down_proj.weight 3.0\n")
    capped = load(EncodeSettings, bpw=2.0, fill=False, device="cpu")
    main(tiny_cmf, encoded / "grams.h5", encoded / "cap.cmf", encoded / "cap.json", capped)
    main(tiny_cmf, encoded / "grams.h5", encoded / "re.cmf", encoded / "re.json", capped, plan_path=plan, student=encoded / "cap.cmf")
    old, new = read_cmf(encoded / "cap.cmf"), read_cmf(encoded / "re.cmf")
    changed = [n for n in old.tensors if bytes(old.tensors[n].data) != bytes(new.tensors[n].data)]
    assert changed == ["model.layers.1.mlp.down_proj.weight"]
    assert codec.parse_header(bytes(new.tensors[changed[0]].data[:16])).rank > codec.parse_header(bytes(old.tensors[changed[0]].data[:16])).rank


SMOLLM2_BODY = {f"model.layers.{layer}.{role}.weight": shape for layer in range(30) for role, shape in {
    "self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
    "self_attn.o_proj": (576, 576), "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576), "mlp.down_proj": (576, 1536)}.items()}


def body_bits(budgets: dict, shapes: dict, paths: str) -> float:
    """Bits the body spends, each tensor at the path count that spends the most under its budget."""
    return sum(max(8 * codec.payload_nbytes(p, codec.max_rank(b, p, *shapes[n]), *shapes[n])
                   for p in codec.path_counts(b, paths, *shapes[n])) for n, b in budgets.items())


@pytest.mark.parametrize("paths", ["2", "auto"])
@pytest.mark.parametrize("plan", ["uniform 1.0", "layer 0 at 2.0, the rest 0.55"])
def test_filling_spends_the_bodys_bits_as_a_whole_and_never_more(paths, plan):
    """encode.fill on SmolLM2-135M's body: at 1.0 bpw each tensor's cap leaves it at 0.957 (rank 184 in the MLP,
    where 192 takes 1.0001); filled, it spends all but a rank step's bits of its budget and no more, and no tensor's
    rank falls."""
    shapes = SMOLLM2_BODY
    budgets = {n: 1.0 for n in shapes} if plan == "uniform 1.0" else {
        n: 2.0 if n.startswith("model.layers.0.") else 0.55 for n in shapes}
    allowance = sum(b * shapes[n][0] * shapes[n][1] for n, b in budgets.items())
    filled = filled_budgets(budgets, shapes, paths)
    before, after = body_bits(budgets, shapes, paths), body_bits(filled, shapes, paths)
    assert before < after <= allowance
    smallest_step = min(8 * codec.payload_nbytes(2, 8, o, i) - 8 * codec.payload_nbytes(2, 0, o, i) for o, i in shapes.values())
    assert allowance - after < smallest_step
    for n, (o, i) in shapes.items():
        for p in codec.path_counts(budgets[n], paths, o, i):
            assert codec.max_rank(filled[n], p, o, i) >= codec.max_rank(budgets[n], p, o, i)
    if plan == "uniform 1.0" and paths == "2":
        weights = sum(o * i for o, i in shapes.values())
        assert before / weights == pytest.approx(0.9571, abs=1e-4) and after / weights > 0.999
        assert {codec.max_rank(filled[n], 2, *shapes[n]) for n in shapes if ".mlp." in n} == {192}


def test_after_the_encoders_path_choices_the_fill_spends_what_they_left():
    """encode.paths auto: the fill counts each tensor at its dearer path count, and the encoder then keeps the
    one that errs least. Session 58's GPU recipe (blocks 0 and 29 at 2.0, the rest at 0.9286) came to 0.990 bpw.
    With every tensor at its cheaper count (the worst case, 0.959 bpw on SmolLM2's body here) the fill goes on from
    the encoded budgets at each tensor's own count: within a rank step of the budget, never over, no rank lower."""
    shapes = SMOLLM2_BODY
    given = {n: 2.0 if n.startswith(("model.layers.0.", "model.layers.29.")) else 0.9286 for n in shapes}
    allowance = sum(b * shapes[n][0] * shapes[n][1] for n, b in given.items())
    first = filled_budgets(given, shapes, "auto")

    def bits(p: int, bpw: float, n: str) -> int:
        return 8 * codec.payload_nbytes(p, codec.max_rank(bpw, p, *shapes[n]), *shapes[n])

    cheaper = {n: (b, min((1, 2), key=lambda p: bits(p, b, n))) for n, b in first.items()}
    spent_before = sum(bits(p, b, n) for n, (b, p) in cheaper.items())
    refilled = filled_budgets(given, shapes, "auto", cheaper)
    spent_after = sum(bits(p, refilled[n], n) for n, (_, p) in cheaper.items())
    weights = sum(o * i for o, i in shapes.values())
    assert spent_before / weights < 0.96 and spent_before < spent_after <= allowance
    smallest_step = min(8 * codec.payload_nbytes(1, 8, o, i) - 8 * codec.payload_nbytes(1, 0, o, i) for o, i in shapes.values())
    assert allowance - spent_after < smallest_step
    assert all(codec.max_rank(refilled[n], p, *shapes[n]) >= codec.max_rank(b, p, *shapes[n]) for n, (b, p) in cheaper.items())


def smollm2_ends(plan_text: str, factor: float) -> tuple[dict, str]:
    plan = parse_plan(plan_text, "plan.txt")
    plan.default = plan.default or 1.0
    layers = {n: int(n.split(".")[2]) for n in SMOLLM2_BODY}
    return ends_raised({n: plan.rule_for(n, layers[n], 1.0) for n in SMOLLM2_BODY}, SMOLLM2_BODY, layers, 30, factor,
                       plan.default_origin)


def test_the_ends_take_their_bits_from_the_blocks_between_and_the_body_keeps_its_total():
    """encode.ends_factor 2 on SmolLM2-135M at 1.0 bpw: blocks 0 and 29 at 2.0, the 28 between at 0.9286
    (bench/layer_swap.py found those two blocks holding the most of the distance before training)."""
    moved, line = smollm2_ends("", 2.0)
    size = {n: o * i for n, (o, i) in SMOLLM2_BODY.items()}
    assert sum(moved[n][0] * size[n] for n in moved) == pytest.approx(sum(size.values()))
    assert {moved[n][0] for n in moved if n.startswith(("model.layers.0.", "model.layers.29."))} == {2.0}
    between = {round(moved[n][0], 4) for n in moved if not n.startswith(("model.layers.0.", "model.layers.29."))}
    assert between == {0.9286}
    assert moved["model.layers.0.mlp.down_proj.weight"][1] == "config encode.bpw × config encode.ends_factor 2"
    assert "blocks 0 and 29 at 2.0000 bpw" in line and "0.9286" in line


def test_a_plans_lines_beat_the_ends_and_only_default_budgets_pay_for_them():
    moved, _ = smollm2_ends("default 1.0\nlayer 29 1.5\nlayer 10-19 0.8\n", 2.0)
    size = {n: o * i for n, (o, i) in SMOLLM2_BODY.items()}
    assert {moved[n] for n in moved if n.startswith("model.layers.29.")} == {(1.5, "plan.txt: line 2")}
    assert {moved[n][1] for n in moved if n.startswith("model.layers.15.")} == {"plan.txt: line 3"}
    assert {moved[n][0] for n in moved if n.startswith("model.layers.0.")} == {2.0}
    defaults = [n for n in moved if int(n.split(".")[2]) not in (0, 29) and not 10 <= int(n.split(".")[2]) <= 19]
    # block 0's extra bits come out of the 18 other blocks at the plan's default, and the body keeps its total
    assert sum(moved[n][0] * size[n] for n in defaults + [n for n in moved if n.startswith("model.layers.0.")]) == \
        pytest.approx(sum(size[n] for n in defaults) + sum(size[n] for n in moved if n.startswith("model.layers.0.")))


def test_a_plan_that_sets_both_ends_leaves_the_factor_nothing_to_move():
    """bench/plans/ends_first2_last3.txt: its layer lines for blocks 0 and 29 win, and its default is not lowered."""
    text = Path(__file__).parents[1].joinpath("bench/plans/ends_first2_last3.txt").read_text()
    moved, line = smollm2_ends(text, 2.0)
    assert {moved[n][0] for n in moved if n.startswith("model.layers.29.")} == {3.0}
    assert {moved[n][0] for n in moved if n.startswith("model.layers.0.")} == {2.0}
    assert {moved[n][0] for n in moved if n.startswith("model.layers.15.")} == {0.892857}
    assert "nothing moved" in line and "the plan's lines set the first and the last block" in line


def test_ends_factor_one_or_too_few_blocks_moves_nothing():
    budgets = {n: (1.0, "config encode.bpw") for n in SMOLLM2_BODY}
    assert smollm2_ends("", 1.0)[0] == budgets
    three = {n: s for n, s in SMOLLM2_BODY.items() if int(n.split(".")[2]) < 3}
    layers = {n: int(n.split(".")[2]) for n in three}
    budgets3 = {n: (1.0, "config encode.bpw") for n in three}
    moved, line = ends_raised(budgets3, three, layers, 3, 2.0, "config encode.bpw")
    assert moved == budgets3 and "nothing moved" in line and "below half" in line


def test_an_encoding_gives_the_first_and_last_blocks_more_rank_and_records_it(tiny_corpus, tmp_path):
    """A 4-block tiny Llama at 3.0 bpw, encode.ends_factor 1.5: blocks 0 and 3 at 4.5 bpw, blocks 1 and 2 at 1.5."""
    from nvg.import_teacher import main as import_teacher
    from tests.conftest import make_stages, make_tiny_llama

    import_teacher(str(make_tiny_llama(tmp_path / "hf", num_hidden_layers=4)), tmp_path / "t.cmf", "f16")
    d = make_stages(tmp_path / "t.cmf", tiny_corpus / "story.txt", tmp_path, bpw=3.0, ends_factor=1.5, fill=False)
    report = json.loads((d / "student.json").read_text())
    rank = {n: row["rank"] * row["paths"] for n, row in report["tensors"].items()}
    for role in ("self_attn.q_proj", "mlp.down_proj"):
        ends = [rank[f"model.layers.{b}.{role}.weight"] for b in (0, 3)]
        between = [rank[f"model.layers.{b}.{role}.weight"] for b in (1, 2)]
        assert min(ends) > max(between)
    assert report["body_bpw"] <= 3.0 and "blocks 0 and 3 at 4.5000 bpw" in report["ends"]
    assert read_cmf(d / "student.cmf").header["provenance"]["nvg_encode"]["ends_factor"] == 1.5


def test_filling_stops_at_full_rank():
    shapes = {"a": (16, 16), "b": (16, 32)}
    assert filled_budgets({"a": 16.0, "b": 16.0}, shapes, "2") == {"a": 16.0, "b": 16.0}


def test_a_filled_encoding_spends_more_of_its_budget_and_records_it(encoded, tiny_cmf):
    """encode.fill (the default) against each tensor at its cap (fill false, every run before session 50)."""
    for name, fill in (("capped", False), ("filled", True)):
        main(tiny_cmf, encoded / "grams.h5", encoded / f"{name}.cmf", encoded / f"{name}.json",
             load(EncodeSettings, bpw=2.0, fill=fill, device="cpu"))
    capped, filled = (json.loads((encoded / f"{name}.json").read_text()) for name in ("capped", "filled"))
    assert capped["body_bpw"] < filled["body_bpw"] <= 2.0
    # a budget raised past two paths of rank 8 takes them instead of one path (encode.paths "2"): paths × rank holds
    assert all(filled["tensors"][n]["paths"] * filled["tensors"][n]["rank"] >= row["paths"] * row["rank"]
               for n, row in capped["tensors"].items())
    assert [read_cmf(encoded / f"{name}.cmf").header["provenance"]["nvg_encode"]["fill"] for name in ("capped", "filled")] == [False, True]
    assert load(EncodeSettings).fill is True


def test_an_auto_paths_encoding_is_filled_again_at_the_path_counts_it_kept(encoded, tiny_cmf, capsys):
    """encode.paths auto with the fill: after the encoder's choices the body is within a rank step (at each tensor's
    kept path count) of its budget and never over it."""
    main(tiny_cmf, encoded / "grams.h5", encoded / "auto.cmf", encoded / "auto.json",
         load(EncodeSettings, bpw=2.0, paths="auto", device="cpu"))
    log = capsys.readouterr().err
    assert "encode.fill after encode.paths auto's choices:" in log
    report = json.loads((encoded / "auto.json").read_text())
    shapes = {n: read_cmf(tiny_cmf).tensors[n].shape for n in report["tensors"]}
    weights = sum(o * i for o, i in shapes.values())
    spent = sum(8 * codec.payload_nbytes(r["paths"], r["rank"], *shapes[n]) for n, r in report["tensors"].items())
    assert report["body_bpw"] == pytest.approx(spent / weights) and spent <= 2.0 * weights
    for n, r in report["tensors"].items():
        raise_bits = 8 * (codec.payload_nbytes(r["paths"], r["rank"] + 8, *shapes[n]) - codec.payload_nbytes(r["paths"], r["rank"], *shapes[n]))
        assert r["rank"] + 8 > min(shapes[n]) or spent + raise_bits > 2.0 * weights


def test_plan_error_comes_before_any_model_is_read(tmp_path):
    plan = tmp_path / "plan.txt"
    plan.write_text("default 1.0\nlayer one 2.0\n")
    with pytest.raises(NvgError, match="plan.txt: line 2"):
        main(tmp_path / "missing-teacher.cmf", tmp_path / "g.h5", tmp_path / "o.cmf", tmp_path / "o.json",
             load(EncodeSettings), plan_path=plan)
    assert not (tmp_path / "o.cmf").exists()


@pytest.mark.parametrize("o, r", [(300, 64), (97, 40), (16, 8), (6, 200)])
def test_blocked_cpu_sign_sweep_equals_the_plain_sweep(o, r):
    """The CPU sweep forms a column's G·s from its block's flips so far and brings G·s up to date once a
    block; it must flip exactly what the plain column-by-column sweep flips (6 × 200: an S_V group's shape,
    few rows and many columns; the CUDA kernel is checked against it on the device)."""
    import torch

    from nvg.sign_sweep import flip_u_signs

    g = torch.Generator().manual_seed(o)
    su = torch.sign(torch.randn(o, r, generator=g)).double()
    h, M = torch.rand(o, generator=g).double(), torch.randn(r, 50, generator=g).double()
    G, c = M @ M.T, torch.randn(o, r, generator=g).double() * 10
    plain, gs = su.clone(), su @ G
    for k in range(r):
        sk = plain[:, k].clone()
        flip = 4 * h * h * (G[k, k] - sk * gs[:, k]) + 4 * h * sk * c[:, k] < 0
        gs -= (2 * sk * flip)[:, None] * G[k][None, :]
        plain[:, k] = torch.where(flip, -sk, sk)
    assert (plain != su).any()
    assert torch.equal(flip_u_signs(su, h, G, c), plain)


def test_config_paths_reach_the_shell_as_one_quoted_word(tiny_hf, tiny_corpus, tmp_path):
    """A plan path with spaces, quotes and $(...) is passed to the step module verbatim and never run."""
    import shlex

    from tests.conftest import snakemake, tiny_config

    plan = tmp_path / "my plan $(touch INJECTED) 'q\".txt"
    plan.write_text("default 2.0\n")
    config = {**tiny_config(tiny_hf, tiny_corpus), "plan": str(plan)}
    out = snakemake(tmp_path, config, "-n", "-p", "results/student/encoded.cmf")
    commands = [line for line in out.stdout.splitlines() if "nvg.budget_reencode" in line]
    assert len(commands) == 1, out.stdout
    argv = shlex.split(commands[0].split("Shell command:", 1)[-1].split(">", 1)[0])
    assert argv[argv.index("--plan") + 1] == str(plan)
    assert not (tmp_path / "INJECTED").exists() and not (REPO / "INJECTED").exists()


@pytest.mark.parametrize("fmt", ["q8_row", "q4_block", "q4tp", "q2tp"])
def test_the_embedding_in_cortiqs_quantised_formats_trains_its_scales_and_exports(tiny_stages, tiny_cmf, tmp_path, fmt):
    """Encoded in q8_row / q4_block / q4tp / q2tp; the student computes the tied embedding and head from the file's codes
    and scales exactly, training moves the scales (nvg/model.py: GroupScaled), and every code stays."""
    import shutil

    import torch

    from nvg.cmf import CODE_RANGE, Q2TP, Q4_BLOCK, Q4TP, Q8_ROW, quant_groups, tensor_to_numpy, verify
    from nvg.distill import trainable
    from nvg.model import load_model
    from nvg.layout import bits_summary
    from tests.conftest import train

    for name in ("windows.h5", "topk.0.h5"):
        shutil.copy(tiny_stages / name, tmp_path / name)
    main(tiny_cmf, tiny_stages / "grams.h5", tmp_path / "student.cmf", tmp_path / "student.json",
         load(EncodeSettings, bpw=2.0, embedding=fmt, device="cpu"))
    name = "model.embed_tokens.weight"
    student, f16 = read_cmf(tmp_path / "student.cmf"), read_cmf(tiny_stages / "student.cmf")
    t = student.tensors[name]
    assert t.dtype == {"q8_row": Q8_ROW, "q4_block": Q4_BLOCK, "q4tp": Q4TP, "q2tp": Q2TP}[fmt]
    row = json.loads((tmp_path / "student.json").read_text())["tensors"][name]
    assert 0 < row["rel_logit_error"] < 0.2 and 0 < row["rel_error"] < (0.7 if fmt == "q2tp" else 0.2)
    assert row["method"] == fmt and row["bpw"] == pytest.approx(8 * len(t.data) / t.numel)
    assert bits_summary(student)["file_bpw"] < bits_summary(f16)["file_bpw"]
    assert student.header["provenance"]["nvg_encode"]["embedding"] == fmt
    model = load_model(tmp_path / "student.cmf")
    scales = model.group_scales()
    assert list(scales) == [name] and any(p is scales[name] for p in trainable(model).values())
    assert torch.equal(model.head_weight, torch.from_numpy(tensor_to_numpy(t)))  # tied: the head is the same matrix
    trained = train(tmp_path, "trained")
    assert trained.header["provenance"]["nvg_train"]["heldout_kl_best"] < trained.header["provenance"]["nvg_train"]["heldout_kl_start"]
    (codes, before), (codes_after, after) = quant_groups(t), quant_groups(trained.tensors[name])
    assert len(trained.tensors[name].data) == len(t.data) and np.array_equal(codes, codes_after)
    assert not np.array_equal(before, after)
    assert verify(tmp_path / "trained.cmf") == []
    frozen = train(tmp_path, "frozen", group_scale_lr=0.0)  # the scales as the encoder chose them, the body trained
    assert bytes(frozen.tensors[name].data) == bytes(t.data)
    assert frozen.header["provenance"]["nvg_train"]["heldout_kl_best"] < frozen.header["provenance"]["nvg_train"]["heldout_kl_start"]
    coded = train(tmp_path, "coded", group_code_lr=10.0)  # codes through straight-through latents, 0.1 code step a step: some move
    block = coded.header["provenance"]["nvg_train"]
    codes_coded, _ = quant_groups(coded.tensors[name])
    lo, hi, spacing = CODE_RANGE[t.dtype]
    changed = float((codes_coded != codes).mean())
    assert 0 < changed < 0.5 and changed == pytest.approx(block["group_codes_changed"][name], abs=1e-6)
    assert codes_coded.min() >= lo and codes_coded.max() <= hi and ((codes_coded - lo) % spacing == 0).all()
    assert block["heldout_kl_best"] < block["heldout_kl_start"] and verify(tmp_path / "coded.cmf") == []
    w = tensor_to_numpy(trained.tensors[name])
    assert np.isfinite(w).all() and w.shape == tuple(t.shape)
    from transformers import AutoModelForCausalLM

    from nvg.export_hf import main as export_hf

    export_hf(tmp_path / "trained.cmf", tmp_path / "hf")  # transformers gets the embedding dense, same logits
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        ours = load_model(tmp_path / "trained.cmf")(ids)
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_a_blr_embedding_looks_tokens_up_in_its_factors_trains_its_scales_and_exports(tiny_stages, tiny_cmf, tmp_path):
    """`encode.embedding: blr`: the tied embedding and head encoded by the body's encoder under the final hidden
    states' Gram, stored as a CMF blr tensor; the student's lookup (rows of S_U times S_V, the matrix never
    formed) and head are the payload's matrix; training moves its scales and keeps its signs; the trained
    file verifies and exports to transformers dense (same logits) and, packed, with the embedding dense."""
    import shutil

    import torch

    from nvg import blr as codec
    from nvg.cmf import BLR, verify
    from nvg.distill import trainable
    from nvg.export_hf import main as export_hf
    from nvg.layout import bits_summary
    from nvg.model import BlrVocab, load_model
    from tests.conftest import train

    for name in ("windows.h5", "topk.0.h5"):
        shutil.copy(tiny_stages / name, tmp_path / name)
    (tmp_path / "plan.txt").write_text("embedding blr 1.5\n")  # the plan's line beats config encode.embedding (f16)
    main(tiny_cmf, tiny_stages / "grams.h5", tmp_path / "student.cmf", tmp_path / "student.json",
         load(EncodeSettings, bpw=2.0, device="cpu"), tmp_path / "plan.txt")
    name = "model.embed_tokens.weight"
    student, f16 = read_cmf(tmp_path / "student.cmf"), read_cmf(tiny_stages / "student.cmf")
    t = student.tensors[name]
    assert t.dtype == BLR and tuple(t.shape) == tuple(f16.tensors[name].shape)
    payload = codec.decode(bytes(t.data))
    row = json.loads((tmp_path / "student.json").read_text())["tensors"][name]
    assert row["method"] == "blr" and row["rank"] == payload.rank and row["bpw"] <= 1.5
    assert 0 < row["rel_logit_error"] < 0.5 and 0 < row["rel_error"] < 1
    assert bits_summary(student)["file_bpw"] < bits_summary(f16)["file_bpw"]
    assert student.header["provenance"]["nvg_encode"]["embedding_bpw"] == 1.5
    model = load_model(tmp_path / "student.cmf")
    embedding = model.model.embed_tokens
    assert isinstance(embedding, BlrVocab) and name in model.blr_linears()
    assert all(any(p is q for q in trainable(model).values()) for p in (embedding.h, embedding.ell, embedding.g))
    dense = torch.from_numpy(payload.dequantize())
    ids = torch.randint(0, dense.shape[0], (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model.head_weight, dense)  # tied: the head is the same matrix
        torch.testing.assert_close(embedding(ids), dense[ids])
    trained = train(tmp_path, "trained")
    block = trained.header["provenance"]["nvg_train"]
    assert block["heldout_kl_best"] < block["heldout_kl_start"] and verify(tmp_path / "trained.cmf") == []
    after = codec.decode(bytes(trained.tensors[name].data))
    assert len(trained.tensors[name].data) == len(t.data) and not np.array_equal(after.paths[0].h, payload.paths[0].h)
    assert all(np.array_equal(a.u_bits, b.u_bits) and np.array_equal(a.v_bits, b.v_bits) for a, b in zip(after.paths, payload.paths))
    signed = train(tmp_path, "signed", epochs=1, signs={"enabled": True, "warm": 0, "eta": 0.3})  # its signs train with the body's
    flipped = codec.decode(bytes(signed.tensors[name].data)).paths[0].signs()[0] != payload.paths[0].signs()[0]
    assert 0 < flipped.mean() < 0.5 and verify(tmp_path / "signed.cmf") == []
    export_hf(tmp_path / "trained.cmf", tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        ours = load_model(tmp_path / "trained.cmf")(ids)
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    import nvg.hf_quantizer  # noqa: F401  (registers nvg's quantization_config with transformers)

    export_hf(tmp_path / "trained.cmf", tmp_path / "packed", packed=True)  # the body packed, the embedding dense
    packed = AutoModelForCausalLM.from_pretrained(tmp_path / "packed", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ours - packed(ids).logits).abs().max().item() <= 1e-4
    assert name.removesuffix(".weight") not in packed.config.quantization_config.linears


def test_a_blr_embedding_budget_too_small_for_rank_8_is_one_line(tiny_stages, tiny_cmf, tmp_path, capsys):
    from nvg.budget_reencode import cli
    from tests.conftest import fails_cleanly

    settings = json.dumps({"bpw": 2.0, "embedding": "blr", "embedding_bpw": 0.01, "device": "cpu"})
    argv = ["--teacher", tiny_cmf, "--grams", tiny_stages / "grams.h5", "--out", tmp_path / "s.cmf", "--report", tmp_path / "s.json"]
    fails_cleanly(cli, [*argv, "--settings", settings], capsys, "config encode.embedding_bpw",
                  "0.0100 bpw for model.embed_tokens.weight cannot hold even rank 8", [tmp_path / "s.cmf", tmp_path / "s.json"])
    (tmp_path / "plan.txt").write_text("default 2.0\nembedding blr 0.02\n")  # a plan line's budget, named by its line
    fails_cleanly(cli, [*argv, "--plan", tmp_path / "plan.txt", "--settings", json.dumps({"device": "cpu"})], capsys,
                  f"{tmp_path / 'plan.txt'}: line 2", "0.0200 bpw for model.embed_tokens.weight cannot hold even rank 8",
                  [tmp_path / "s.cmf", tmp_path / "s.json"])


@pytest.mark.parametrize("fmt", ["q8_row", "q4_block", "q4tp", "q2tp"])
def test_gptq_codes_lower_the_error_on_the_inputs_gram_at_the_same_scales(fmt):
    """nvg/gptq.py through `gptq_recoded`: the same scales as plain rounding, codes within the format's range
    that err less under H (the logits' error for the head) and more in plain terms; damp → ∞ is plain
    rounding again."""
    from nvg.budget_reencode import EMBEDDING_DTYPES, gptq_recoded
    from nvg.cmf import CODE_RANGE, dense_tensor, quant_groups

    rng = np.random.default_rng(7)
    W = rng.normal(size=(300, 96)).astype(np.float32)
    X = rng.normal(size=(2000, 96)) @ rng.normal(size=(96, 96))
    H = X.T @ X
    rounded = dense_tensor("e", W, EMBEDDING_DTYPES[fmt])

    def errors(t):
        codes, scales = quant_groups(t)
        D = (codes * scales[:, None]).reshape(W.shape) - W
        return np.trace(D @ H @ D.T) / np.trace(W @ H @ W.T), (D ** 2).sum() / (W ** 2).sum(), scales, codes

    plain, gptq = errors(rounded), errors(gptq_recoded(rounded, W, H, 0.1))
    lo, hi, spacing = CODE_RANGE[rounded.dtype]
    assert np.array_equal(plain[2], gptq[2]) and gptq[3].min() >= lo and gptq[3].max() <= hi and ((gptq[3] - lo) % spacing == 0).all()
    assert gptq[0] < 0.7 * plain[0] and gptq[1] > plain[1]
    assert bytes(gptq_recoded(rounded, W, H, 1e9).data) == bytes(rounded.data)


@pytest.mark.parametrize("plan_text, settings, origin", [
    ("default 2.0\ntensor model.layers.1.mlp.down_proj.weight 0.05\n", {}, "plan.txt: line 2: 0.0500 bpw for model.layers.1.mlp.down_proj.weight"),
    ("default 0.05\n", {}, "plan.txt: line 1: 0.0500 bpw for model.layers.0."),
    (None, {"bpw": 0.05}, "config encode.bpw: 0.0500 bpw for model.layers.0."),
    (None, {"bpw": 2.0, "kv_factor": 0.02}, "config encode.bpw × config encode.kv_factor 0.02: 0.0400 bpw for model.layers.0.self_attn.k_proj"),
])
def test_a_budget_too_small_names_its_plan_line_before_any_encoding(tiny_stages, tiny_cmf, tmp_path, capsys, monkeypatch,
                                                                    plan_text, settings, origin):
    from nvg import budget_reencode
    from nvg.budget_reencode import cli
    from tests.conftest import fails_cleanly

    def never(*args, **kwargs):
        raise AssertionError("a tensor was encoded before the budgets were checked")

    monkeypatch.setattr(budget_reencode, "encode_tensor", never)
    args = ["--teacher", tiny_cmf, "--grams", tiny_stages / "grams.h5", "--out", tmp_path / "s.cmf",
            "--report", tmp_path / "s.json", "--settings", json.dumps({"device": "cpu", **settings})]
    if plan_text:
        (tmp_path / "plan.txt").write_text(plan_text)
        args += ["--plan", tmp_path / "plan.txt"]
    fails_cleanly(cli, args, capsys, origin, "cannot hold even rank 8", [tmp_path / "s.cmf"])


@pytest.mark.parametrize("fmt", ["q8_row", "q4_block"])
def test_gptq_picks_the_heads_codes_only_where_groups_lie_within_rows(fmt, monkeypatch):
    """With 40 columns q4_block's groups of 32 run across rows, so the head is plainly rounded; with 64 GPTQ
    chooses its codes. (q8_row is kept to the same rule: the Gram's columns must make whole groups.)"""
    from pathlib import Path

    from nvg import budget_reencode
    from nvg.budget_reencode import EMBEDDING_DTYPES, encode_vocab_matrix
    from nvg.cmf import dense_tensor

    rng = np.random.default_rng(3)
    for cols, gptq in ((40, False), (64, True)):
        W = rng.normal(size=(50, cols)).astype(np.float32)
        X = rng.normal(size=(500, cols)) @ rng.normal(size=(cols, cols))
        monkeypatch.setattr(budget_reencode, "read_grams", lambda path, layer, name, H=X.T @ X: (H, H, 500, 500))
        q, row = encode_vocab_matrix("lm_head.weight", W, Path("grams.h5"), load(EncodeSettings), fmt, 1.0, True, "cpu")
        rounded = dense_tensor("lm_head.weight", W, EMBEDDING_DTYPES[fmt])
        assert (bytes(q.data) != bytes(rounded.data)) == gptq, cols
        assert 0 < row["rel_logit_error"] < 0.1 and row["method"] == fmt


def test_the_heads_scales_shrink_by_the_factor_that_errs_least_on_the_sel_logits(monkeypatch):
    """At 2 bits on heavy-tailed rows absmax wastes the outer codes: `gptq_shrunk` picks a factor below 1 whose
    codes err less on H_sel than GPTQ on the absmax scales, and no factor of its grid errs less."""
    from nvg.budget_reencode import SCALE_SHRINK, gptq_recoded, gptq_shrunk
    from nvg.cmf import Q2TP, Tensor, dense_tensor, quant_groups, tensor_to_numpy, with_group_scales

    rng = np.random.default_rng(11)
    W = rng.standard_t(3, size=(200, 64)).astype(np.float32)
    mix = rng.normal(size=(64, 64))

    def gram():  # of 1,000 correlated hidden states
        x = rng.normal(size=(1000, 64)) @ mix
        return x.T @ x

    H_fit, H_sel = gram(), gram()

    def err(t):
        D = tensor_to_numpy(t).astype(np.float64) - W
        return float(((D @ H_sel) * D).sum())

    q = dense_tensor("e", W, Q2TP)
    best, shrink = gptq_shrunk(q, W, H_fit, H_sel, 0.1)
    assert shrink < 1.0 and err(best) < err(gptq_recoded(q, W, H_fit, 0.1))
    scales = quant_groups(q)[1]
    others = [err(gptq_recoded(Tensor("e", Q2TP, q.shape, with_group_scales(q, scales * f)), W, H_fit, 0.1))
              for f in SCALE_SHRINK if f != 1.0]
    assert err(best) == pytest.approx(min(others))
    from pathlib import Path

    from nvg import budget_reencode

    monkeypatch.setattr(budget_reencode, "read_grams", lambda path, layer, name: (H_fit, H_sel, 1000, 1000))
    for on in (True, False):  # encode.embedding_shrink: the head is encoded so (then refitted, encode.embedding_refit)
        t, row = budget_reencode.encode_vocab_matrix("lm_head.weight", W, Path("grams.h5"),  # and the report says by what factor
                                                     load(EncodeSettings, embedding_shrink=on), "q2tp", 1.0, True, "cpu")
        start = best if on else gptq_recoded(q, W, H_fit, 0.1)
        assert bytes(t.data) == bytes(budget_reencode.refitted(start, W, H_fit, 0.1, 3).data) != bytes(start.data)
        assert row.get("scale_shrink") == (shrink if on else None)


@pytest.mark.parametrize("fmt", ["q2tp", "q4tp", "q4_block", "q8_row"])
def test_refitting_the_head_after_gptq_lowers_its_error_and_keeps_to_the_format(fmt):
    """nvg/gptq.py's refit through `refitted`: least-squares group scales, stored as the format stores them, then
    coordinate descent on the codes, lower the error GPTQ left on the damped Gram it fits, most at 2 bits; every
    code stays one the format allows; 0 rounds is GPTQ's tensor byte for byte."""
    from nvg.budget_reencode import EMBEDDING_DTYPES, gptq_recoded, refitted
    from nvg.cmf import CODE_RANGE, dense_tensor, quant_groups, tensor_to_numpy
    from nvg.gptq import damped

    rng = np.random.default_rng(5)
    W = rng.standard_t(3, size=(120, 64)).astype(np.float32)
    X = rng.normal(size=(800, 64)) @ rng.normal(size=(64, 64))
    H = X.T @ X
    Hd = damped(H, 0.1, "cpu").numpy()

    def err(t):
        D = tensor_to_numpy(t).astype(np.float64) - W
        return float(((D @ Hd) * D).sum() / ((W @ Hd) * W).sum())

    gptq = gptq_recoded(dense_tensor("e", W, EMBEDDING_DTYPES[fmt]), W, H, 0.1)
    refit = refitted(gptq, W, H, 0.1, 3)
    assert err(refit) < {"q2tp": 0.8, "q4tp": 0.95, "q4_block": 0.95, "q8_row": 1.0}[fmt] * err(gptq), (err(refit), err(gptq))
    codes = quant_groups(refit)[0]
    lo, hi, spacing = CODE_RANGE[EMBEDDING_DTYPES[fmt]]
    assert codes.min() >= lo and codes.max() <= hi and ((codes - lo) % spacing == 0).all()
    assert bytes(refitted(gptq, W, H, 0.1, 0).data) == bytes(gptq.data)


def test_coordinate_descent_never_raises_the_error_and_least_squares_scales_turn_negated_codes_back():
    """`descended_codes` from a random start: each sweep's error at most the last one's. `least_squares_scales`
    on a row's codes negated finds the negative scales and returns the codes turned back with scales ≥ 0."""
    from nvg.gptq import damped, descended_codes, least_squares_scales
    from nvg.model import nearest_code

    rng = np.random.default_rng(8)
    W = rng.normal(size=(40, 64))
    X = rng.normal(size=(400, 64)) @ rng.normal(size=(64, 64))
    H = X.T @ X
    Hd = damped(H, 0.1, "cpu").numpy()
    scales = np.abs(W).reshape(40, 2, 32).max(-1) / 3

    def err(codes):
        D = codes * np.repeat(scales, 32, axis=1) - W
        return float(((D @ Hd) * D).sum())

    odd = lambda x: nearest_code(x, (-3, 3, 2))  # noqa: E731
    codes = rng.choice([-3.0, -1.0, 1.0, 3.0], size=W.shape)
    errors = [err(codes)]
    for _ in range(3):
        codes = descended_codes(W, H, codes, scales, 32, odd, 0.1, 1)
        errors.append(err(codes))
    assert all(b <= a * (1 + 1e-12) for a, b in zip(errors, errors[1:])) and errors[-1] < 0.5 * errors[0]
    turned, fitted = least_squares_scales(W, H, -codes, 32, 0.1)
    assert (fitted >= 0).all() and np.array_equal(turned, codes)


def test_coordinate_descent_treats_each_row_alone_across_its_row_chunks():
    """`descended_codes` takes rows in chunks (`row_chunk`: 1,024 on a CPU); rows never interact, so 2,500 rows at
    once (three chunks, the last one short) give each row the codes it gets alone, and the caller's codes stay."""
    from nvg.gptq import descended_codes, row_chunk
    from nvg.model import nearest_code

    rng = np.random.default_rng(9)
    rows = 2500
    assert row_chunk(rows, "cpu") < rows
    W = rng.normal(size=(rows, 64))
    X = rng.normal(size=(400, 64)) @ rng.normal(size=(64, 64))
    H = X.T @ X
    scales = np.abs(W).reshape(rows, 2, 32).max(-1) / 3
    odd = lambda x: nearest_code(x, (-3, 3, 2))  # noqa: E731
    start = rng.choice([-3.0, -1.0, 1.0, 3.0], size=W.shape)
    kept = start.copy()
    together = descended_codes(W, H, start, scales, 32, odd, 0.1, 2)
    assert np.array_equal(start, kept)
    for r in (0, 1023, 1024, 2047, 2048, 2499):
        alone = descended_codes(W[r : r + 1], H, start[r : r + 1], scales[r : r + 1], 32, odd, 0.1, 2)
        assert np.array_equal(together[r], alone[0]), r
    assert (together != start).mean() > 0.1
