"""Stage `budget_reencode`: encode every body linear into BLR at its planned bits per weight.

The driver: it reads the teacher, the Grams and the plan, asks the encoder (`nvg/encoder.py`, the
mathematics) for each body linear at its budget, and writes the student and a per-tensor report.
Given an existing student, only tensors whose planned (P, r) differs are re-encoded; every other
payload is copied byte for byte.

    python -m nvg.budget_reencode --teacher T.cmf --grams G.h5 [--plan P] [--student S.cmf] \
        --out encoded.cmf --report encode.json --settings JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from nvg import blr as codec
from nvg.artifacts import HEAD_INPUT, check_encoded_from, check_grams, model_hash, read_grams
from nvg.atomic import write_json
from nvg.cmf import (BLR, CODE_RANGE, Q2TP, Q4_BLOCK, Q4TP, Q8_ROW, Tensor, dense_tensor, quant_groups, read_cmf,
                     read_verified, tensor_to_numpy, with_group_codes, with_group_scales, write_cmf)
from nvg.encoder import EncodeSettings, encode_tensor
from nvg.gptq import descended_codes, gptq_codes, least_squares_scales
from nvg.errors import NvgError, exits_cleanly
from nvg.layout import ROLE_INPUT, bits_summary, parse_body_linear
from nvg.model import nearest_code, pick_device
from nvg.plan import VOCAB_LINES, ends_raised, filled_budgets, read_plan
from nvg.progress import bar
from nvg.settings import SETTINGS_HELP, load

VOCAB_MATRICES = tuple(VOCAB_LINES.values())  # `encode.embedding`, or a plan line, sets their format
EMBEDDING_DTYPES = {"q8_row": Q8_ROW, "q4_block": Q4_BLOCK, "q4tp": Q4TP, "q2tp": Q2TP}


def gptq_group_codes(q: Tensor, W: np.ndarray, H: np.ndarray, damp: float, device="cpu") -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's integer codes under H for `q`'s groups (groups within rows) on `q`'s own scales: codes [groups,
    group size] and scales [groups], as `quant_groups` gives them (w = code · scale)."""
    codes, scales = quant_groups(q)
    rows, cols = W.shape
    per_row = scales.reshape(rows, -1)
    new = gptq_codes(W, H, per_row, cols // per_row.shape[1], lambda x: nearest_code(x, CODE_RANGE[q.dtype]), damp, device)
    return new.reshape(codes.shape), scales


def gptq_recoded(q: Tensor, W: np.ndarray, H: np.ndarray, damp: float, device="cpu") -> Tensor:
    """`q` (group-scaled, groups within rows) with its scales kept and its codes chosen by GPTQ under H."""
    codes, _ = gptq_group_codes(q, W, H, damp, device)
    return Tensor(q.name, q.dtype, q.shape, with_group_codes(q, codes))


def refitted(q: Tensor, W: np.ndarray, H: np.ndarray, damp: float, rounds: int, device="cpu") -> Tensor:
    """`q` (group-scaled, groups within rows) after `rounds` of nvg/gptq.py's refit under H: its group scales
    by least squares (then as the format stores them: f16, or rungs of q4tp's / q2tp's refitted row ladders),
    then two sweeps of coordinate descent on its codes at those stored scales."""
    rows, cols = W.shape
    round_codes = lambda x: nearest_code(x, CODE_RANGE[q.dtype])  # noqa: E731
    for _ in range(rounds):
        codes, _ = quant_groups(q)
        group = codes.shape[1]
        flipped, scales = least_squares_scales(W, H, codes.reshape(rows, cols), group, damp, device)
        q = Tensor(q.name, q.dtype, q.shape, with_group_codes(q, np.rint(flipped).astype(np.int8).reshape(codes.shape)))
        q = Tensor(q.name, q.dtype, q.shape, with_group_scales(q, scales.reshape(-1).astype(np.float32)))
        _, stored = quant_groups(q)
        new = descended_codes(W, H, flipped, stored.reshape(rows, -1), group, round_codes, damp, 2, device)
        q = Tensor(q.name, q.dtype, q.shape, with_group_codes(q, np.rint(new).astype(np.int8).reshape(codes.shape)))
    return q


SCALE_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)  # the absmax scales × one of these


def gptq_shrunk(q: Tensor, W: np.ndarray, H_fit: np.ndarray, H_sel: np.ndarray, damp: float,
                device="cpu") -> tuple[Tensor, float]:
    """GPTQ's codes (`gptq_recoded`, under H_fit) on the format's absmax scales times the factor of
    SCALE_SHRINK whose codes err least on the logits of the SEL hidden states (tr(D H_sel Dᵀ)). At 2 bits
    absmax spends the outer codes on a few large entries: SmolLM2's teacher alone with a q2tp head and
    embedding has 3.27× / 3.30× its held-out / python-docs perplexity at absmax, 2.52× / 2.53× at 0.8, the
    factor this picks. A factor per row erred less on SEL but not on python-docs (2.44× / 2.73×), so one
    factor for the tensor (docs/quality.md). `encode.embedding_shrink`; returns the tensor and the factor.
    Each factor's error is taken from its codes and scales as numbers; only the chosen one's codes are packed
    (on a 2-core CPU, a random matrix of SmolLM2's head's shape: 78 s, where packing and decoding all nine took 86)."""
    _, scales = quant_groups(q)
    W64 = W.astype(np.float64)
    best_err, best = np.inf, None
    for shrink in SCALE_SHRINK:
        scaled = q if shrink == 1.0 else Tensor(q.name, q.dtype, q.shape, with_group_scales(q, scales * shrink))
        codes, rung_scales = gptq_group_codes(scaled, W, H_fit, damp, device)
        D = (codes * rung_scales[:, None].astype(np.float64)).reshape(W.shape) - W64
        err = float(((D @ H_sel) * D).sum())
        if err < best_err:
            best_err, best = err, (scaled, codes, shrink)
    scaled, codes, shrink = best
    return Tensor(q.name, q.dtype, q.shape, with_group_codes(scaled, codes)), shrink


def encode_vocab_matrix(name: str, W: np.ndarray, grams: Path, settings: EncodeSettings, fmt: str, bpw: float,
                        is_head: bool, device) -> tuple[Tensor, dict]:
    """The embedding or LM head in format `fmt` (blr at `bpw`: `encode_blr_vocab_matrix`). Else scales and
    first codes as the format rounds them; the head (the embedding too when tied) then takes its codes from
    GPTQ (nvg/gptq.py) under the Gram of the hidden states it multiplies, on those scales (with
    `embedding_shrink`, shrunk by the factor that errs least on the logits: `gptq_shrunk`), damped by
    `embedding_damp` for its role as the embedding (teacher alone, SmolLM2: q2tp 15.3× / 9.2× held-out /
    python-docs perplexity rounded, 3.2× / 3.2× with GPTQ), then refitted (`embedding_refit` rounds, `refitted`).
    Its error is reported on the logits of the SEL hidden states."""
    H_fit, H_sel, _, _ = read_grams(grams, *HEAD_INPUT)
    if fmt == "blr":
        return encode_blr_vocab_matrix(name, W, H_fit, H_sel, bpw, settings, is_head, device)
    q = dense_tensor(name, W, EMBEDDING_DTYPES[fmt])
    shrink = {}
    if is_head and W.shape[1] % 32 == 0:  # row-aligned groups (q4_block's run over the flattened matrix)
        if settings.embedding_shrink:
            q, shrink["scale_shrink"] = gptq_shrunk(q, W, H_fit, H_sel, settings.embedding_damp, device)
        else:
            q = gptq_recoded(q, W, H_fit, settings.embedding_damp, device)
        q = refitted(q, W, H_fit, settings.embedding_damp, settings.embedding_refit, device)
    D = tensor_to_numpy(q).astype(np.float64) - W
    # tr(D H Dᵀ) through one GEMM: a three-operand np.einsum runs a plain C loop (12.5 s against 0.67 s on a
    # 2-core CPU at SmolLM2's 49152 × 576, float64)
    logit_err = float(((D @ H_sel) * D).sum() / ((W @ H_sel) * W).sum())
    return q, {"method": fmt, "bpw": 8.0 * len(q.data) / W.size,
               "rel_error": float(np.linalg.norm(D) / np.linalg.norm(W)), "rel_logit_error": logit_err, **shrink}


def encode_blr_vocab_matrix(name: str, W: np.ndarray, H_fit: np.ndarray, H_sel: np.ndarray, bpw: float,
                            settings: EncodeSettings, is_head: bool, device) -> tuple[Tensor, dict]:
    """The embedding or LM head in BLR at `bpw`, by the body's encoder: as a linear from the final
    hidden states to the logits, so the head (the embedding too when tied) is fitted under those states' Gram
    and its error is the logits'. An untied embedding feeds no logits: it is fitted under the identity
    (every coordinate alike). Token frequencies do not weigh the rows yet."""
    if not is_head:
        H_fit = H_sel = np.eye(W.shape[1], dtype=H_fit.dtype)
    blr, row = encode_tensor(W, H_fit, H_sel, bpw, "vocab", 0, settings, device, name)
    D = blr.dequantize().astype(np.float64) - W
    row["rel_error"] = float(np.linalg.norm(D) / np.linalg.norm(W))
    row["rel_logit_error"] = float(((D @ H_sel) * D).sum() / ((W @ H_sel) * W).sum())
    return Tensor(name, BLR, W.shape, blr.encode()), {**row, "method": "blr"}


def check_room(name: str, shape, bpw: float, origin: str) -> None:
    """A BLR budget must hold rank 8 at one path; else one error line naming where the budget came from."""
    if codec.max_rank(bpw, 1, *shape) == 0:
        need = codec.bits_per_weight(1, 8, *shape)
        raise NvgError(f"{origin}: {bpw:.4f} bpw for {name} cannot hold even rank 8 (the minimum is {need:.4f} bpw)")


def main(teacher: Path, grams: Path, out: Path, report: Path, settings: EncodeSettings,
         plan_path: Path | None = None, student: Path | None = None) -> None:
    plan = read_plan(plan_path, settings.bpw)  # plan errors come before any model is read
    t_cmf = read_verified(teacher)
    arch = t_cmf.arch
    body = [n for n in t_cmf.tensors if parse_body_linear(n)]
    plan.check_against(arch["num_layers"], body, t_cmf.tensors)
    shapes = {n: t_cmf.tensors[n].shape for n in body}
    layers = {n: parse_body_linear(n)[0] for n in body}
    planned, ends_line = ends_raised({n: plan.rule_for(n, layers[n], settings.bpw) for n in body}, shapes, layers,
                                     arch["num_layers"], settings.ends_factor, plan.default_origin)
    print(f"budget_reencode: {ends_line}", file=sys.stderr)
    budgets = {}  # every budget settled and checked before any encoding, naming the plan line that set it
    for name in body:
        role = parse_body_linear(name)[1]
        bpw, origin = planned[name]
        if role in ("k", "v") and settings.kv_factor != 1.0:
            bpw, origin = bpw * settings.kv_factor, f"{origin} × config encode.kv_factor {settings.kv_factor}"
        check_room(name, t_cmf.tensors[name].shape, bpw, origin)
        budgets[name] = bpw
    given = dict(budgets)
    if settings.fill:
        budgets = filled_budgets(given, shapes, settings.paths)
    vocab = {}  # the embedding's and LM head's (format, bpw if blr), settled and checked as the budgets are
    for name in (n for n in VOCAB_MATRICES if n in t_cmf.tensors):
        fmt, bpw, origin = plan.vocab_rule(name, settings.embedding, settings.embedding_bpw)
        if fmt == "blr":
            check_room(name, t_cmf.tensors[name].shape, bpw, origin)
        vocab[name] = fmt, bpw
    s_cmf = read_verified(student) if student else None
    if s_cmf is not None:
        check_encoded_from(s_cmf, t_cmf)
    check_grams(grams, t_cmf, *([s_cmf] if s_cmf else []))
    device = pick_device(settings.device)
    t0 = time.perf_counter()
    payloads, rows = {}, {}

    def encode_body(names: list[str], label: str, paths: dict[str, int] | None = None) -> None:
        """Each of `names` at its budget into `payloads` and `rows`, at its path count in `paths` where given."""
        pb = bar(len(names), label, "tensor", names)
        for name in pb:
            layer, role = parse_body_linear(name)
            bpw = budgets[name]
            shape = t_cmf.tensors[name].shape
            if s_cmf is not None and s_cmf.tensors.get(name) is not None and s_cmf.tensors[name].dtype == BLR:
                cur = codec.parse_header(bytes(s_cmf.tensors[name].data[:16]))
                if codec.max_rank(bpw, cur.paths, *shape) == cur.rank:
                    payloads[name] = s_cmf.tensors[name].data  # budget unchanged: byte-identical
                    rows[name] = {"method": "kept", "rank": cur.rank, "paths": cur.paths,
                                  "bpw": codec.bits_per_weight(cur.paths, cur.rank, *shape), "planned_bpw": bpw}
                    continue
            H_fit, H_sel, _, _ = read_grams(grams, layer, ROLE_INPUT[role])
            W = tensor_to_numpy(t_cmf.tensors[name])
            at = settings if paths is None else dataclasses.replace(settings, paths=str(paths[name]))
            blr, row = encode_tensor(W, H_fit, H_sel, bpw, role, arch["head_dim"], at, device, name)
            payloads[name] = blr.encode()
            rows[name] = row
            pb.write(f"  {name}: P={row['paths']} r={row['rank']} {row['bpw']:.4f} bpw, rel SEL error {row['rel_sel_error']:.4f}",
                     file=sys.stderr)
        pb.close()

    encode_body(body, "budget_reencode")
    if settings.fill and settings.paths == "auto":
        # the fill above counted each tensor at its dearer path count; what the encoder's choices left is spent now
        chosen = {n: (budgets[n], rows[n]["paths"]) for n in body}
        refilled = filled_budgets(given, shapes, settings.paths, chosen)
        raised = [n for n in body if codec.max_rank(refilled[n], rows[n]["paths"], *shapes[n]) > rows[n]["rank"]]
        body_bpw = lambda: sum(rows[n]["bpw"] * o * i for n, (o, i) in shapes.items()) / sum(o * i for o, i in shapes.values())  # noqa: E731
        before = body_bpw()
        budgets.update(refilled)
        encode_body(raised, "budget_reencode (fill)", {n: rows[n]["paths"] for n in raised})
        print(f"budget_reencode: encode.fill after encode.paths auto's choices: {len(raised)} linears raised, "
              f"body {before:.4f} → {body_bpw():.4f} bpw", file=sys.stderr)
    base = s_cmf or t_cmf
    tensors = []
    for name, t in base.tensors.items():
        if name in payloads:
            tensors.append(Tensor(name, BLR, t.shape, payloads[name]))
        elif name in vocab and vocab[name][0] != "f16":
            q, rows[name] = encode_vocab_matrix(name, tensor_to_numpy(t_cmf.tensors[name]), grams, settings, *vocab[name],
                                                is_head=name == "lm_head.weight" or arch.get("tie_word_embeddings", False),
                                                device=device)
            print(f"  {name}: {vocab[name][0]} {rows[name]['bpw']:.3f} bpw, rel error {rows[name]['rel_error']:.4f}, "
                  f"logits' rel error {rows[name]['rel_logit_error']:.4f}"
                  + (f", scales × {rows[name]['scale_shrink']:g}" if "scale_shrink" in rows[name] else ""), file=sys.stderr)
            tensors.append(q)
        else:
            tensors.append(Tensor(name, t.dtype, t.shape, t.data))
    header = dict(base.header)
    prov = dict(header.get("provenance", {}))
    blr_bpw = {name: bpw for name, (fmt, bpw) in vocab.items() if fmt == "blr"}
    prov["nvg_encode"] = {"teacher_hash": model_hash(t_cmf), "method": settings.method, "bpw": settings.bpw, "ends_factor": settings.ends_factor, "fill": settings.fill,
                          "paths": settings.paths, "iters": settings.iters, "signs": settings.signs, "v_groups": settings.v_groups, "embedding": vocab["model.embed_tokens.weight"][0], "embedding_bpw": blr_bpw.get("model.embed_tokens.weight"), "lm_head": vocab.get("lm_head.weight", (None,))[0], "lm_head_bpw": blr_bpw.get("lm_head.weight"), "embedding_damp": settings.embedding_damp, "kv_factor": settings.kv_factor, "plan": str(plan_path) if plan_path else None,
                          "reencoded": sum(r["method"] != "kept" for r in rows.values())}
    header["provenance"] = prov
    header["quant_type"] = "BLR"
    write_cmf(out, header, tensors, base.vocab)
    totals = bits_summary(read_cmf(out))
    errs = [r["rel_sel_error"] for r in rows.values() if "rel_sel_error" in r]
    write_json(report, {
        "settings": vars(settings), "plan": str(plan_path) if plan_path else None, "ends": ends_line,
        "seconds": time.perf_counter() - t0, "device": str(device),
        "mean_rel_sel_error": float(np.mean(errs)) if errs else None,
        "body_bpw": totals["body_bpw"], "tensors_bpw": totals["tensors_bpw"], "file_bpw": totals["file_bpw"], "tensors": rows,
    })
    print(f"budget_reencode: {len(rows)} linears, body {totals['body_bpw']:.4f} bpw, file {totals['file_bpw']:.4f} bpw, "
          f"mean rel SEL error {np.mean(errs) if errs else float('nan'):.4f}, {time.perf_counter() - t0:.0f}s → {out}",
          file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg budget-reencode", description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, type=Path, help="the teacher CMF (results/teacher.cmf)")
    ap.add_argument("--grams", required=True, type=Path, help="the input Grams (results/grams/teacher.h5, or student.h5 when re-encoding a student)")
    ap.add_argument("--plan", type=Path, default=None, help="a budget plan: per-layer / per-tensor bits per weight (README, 'Your own budget')")
    ap.add_argument("--student", type=Path, default=None, help="a student CMF to re-encode: tensors whose budget is unchanged are kept byte for byte")
    ap.add_argument("--out", required=True, type=Path, help="the encoded student CMF")
    ap.add_argument("--report", required=True, type=Path, help="the per-tensor encoding report (JSON: rank, paths, bpw, SEL error)")
    ap.add_argument("--settings", required=True, help=SETTINGS_HELP)
    a = ap.parse_args(argv)
    main(a.teacher, a.grams, a.out, a.report, load(EncodeSettings, a.settings), a.plan, a.student)


if __name__ == "__main__":
    cli()
