"""What each format of the tied embedding / LM head costs the teacher alone (issue #19): the teacher with only
that matrix replaced, perplexity on held-out windows, python-docs and the 1911 Britannica article as a ratio to
the unchanged teacher; then with the matrix untied and replaced only as the LM head (the embedding kept f16).

    python bench/embedding_formats.py RESULTS [PREFIX]   (RESULTS: a default run's results/ folder; float32 on the
    CPU; PREFIX: only the rows whose format starts with it, or with one of several: "blr|q4tp, GPTQ")

The GPTQ rows use the head-input Gram of the run's Grams file (gram_capture's `head_in`, FIT windows); the
shrunk rows are what budget_reencode writes with `encode.embedding_shrink` (scales shrunk by the factor that
errs least on the SEL Gram), the refit rows GPTQ's tensor after `encode.embedding_refit` rounds (least-squares
group scales, then coordinate descent on the codes), the blr rows what it writes with `encode.embedding: blr`;
the last rows try a GPTQ damping per row by the token's frequency in the training windows (not in budget_reencode).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from nvg.artifacts import HEAD_INPUT, read_grams, read_windows
from nvg.budget_reencode import encode_blr_vocab_matrix, gptq_recoded, gptq_shrunk, refitted
from nvg.cmf import Q2TP, Q4_BLOCK, Q4TP, dense_tensor, read_verified, tensor_to_numpy
from nvg.encoder import EncodeSettings
from nvg.evaluate import ChatRenderer
from nvg.model import DenseLinear, load_model
from nvg.settings import load
from nvg.sources import source_tokens

WINDOWS = 8  # held-out windows scored


def perplexity(model, windows: np.ndarray) -> float:
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.from_numpy(w[None].astype(np.int64))
            logp = torch.log_softmax(model(ids)[0, :-1].float(), -1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            n += len(w) - 1
    return float(np.exp(nll / n))


def main(results: Path, only: str = "") -> None:
    cmf = read_verified(results / "teacher.cmf")
    tokens, attrs = read_windows(results / "data/windows.h5", cmf.arch["vocab_size"])
    held = tokens[int(attrs["n_train"]):][:WINDOWS]
    tok = Tokenizer.from_str(cmf.vocab.decode("utf-8"))

    def unseen(spec):  # 4,096 tokens from the text's start, in windows of the run's length
        ids = source_tokens(spec, 4096, tok, ChatRenderer(cmf, spec))
        return ids[: len(ids) // tokens.shape[1] * tokens.shape[1]].reshape(-1, tokens.shape[1])

    scored = held, unseen("python-docs"), unseen("pkg:shksprdata/ancillary/britannica-11th.txt")
    model = load_model(cmf)
    E = model.model.embed_tokens.weight.data.numpy().copy()
    H, H_sel = (g.astype(np.float64) for g in read_grams(results / "grams/teacher.h5", *HEAD_INPUT)[:2])
    base = [perplexity(model, windows) for windows in scored]
    print("teacher: held-out {:.2f}, python-docs {:.2f}, Britannica {:.2f}".format(*base))

    def quantised_tensor(dtype, hessian=None, damp=0.1):
        t = dense_tensor("e", E, dtype)
        return gptq_recoded(t, E, hessian, damp) if hessian is not None else t

    def quantised(dtype, hessian=None, damp=0.1):
        t = quantised_tensor(dtype, hessian, damp)
        return tensor_to_numpy(t), len(t.data)

    def blr_matrix(bpw):  # what budget_reencode writes for `encode.embedding: blr` at `embedding_bpw`
        t, _ = encode_blr_vocab_matrix("e", E, H, H_sel, bpw, load(EncodeSettings, device="cpu"), True, "cpu")
        return tensor_to_numpy(t), len(t.data)

    rows = {"q4_block (cortiq's rounding)": lambda: quantised(Q4_BLOCK), "q4_block, GPTQ λ 0.1": lambda: quantised(Q4_BLOCK, H),
            "q4tp, rounded": lambda: quantised(Q4TP), "q4tp, GPTQ λ 0.1": lambda: quantised(Q4TP, H),
            "q2tp, rounded": lambda: quantised(Q2TP)}
    rows |= {f"q2tp, GPTQ λ {d}": lambda d=d: quantised(Q2TP, H, d) for d in (0.01, 0.1, 1.0)}

    def shrunk(dtype):  # budget_reencode's choice with `encode.embedding_shrink`
        t, factor = gptq_shrunk(dense_tensor("e", E, dtype), E, H, H_sel, 0.1)
        return tensor_to_numpy(t), len(t.data), f"scales × {factor}"

    rows |= {f"{name}, GPTQ λ 0.1, shrunk scales (encode.embedding_shrink)": lambda dtype=dtype: shrunk(dtype)
             for name, dtype in (("q4_block", Q4_BLOCK), ("q4tp", Q4TP), ("q2tp", Q2TP))}

    refits = {}  # (shrink, rounds) → tensor: each row goes on from the one before it (the rounds are a loop)

    def refit(rounds, shrink):  # budget_reencode's head with `encode.embedding_refit` rounds
        done = max((r for s, r in refits if s == shrink), default=None)
        if done is None:
            done, refits[shrink, 0] = 0, (gptq_shrunk(dense_tensor("e", E, Q2TP), E, H, H_sel, 0.1)[0] if shrink
                                          else quantised_tensor(Q2TP, H))
        refits[shrink, rounds] = refitted(refits[shrink, done], E, H, 0.1, rounds - done)
        return tensor_to_numpy(refits[shrink, rounds]), len(refits[shrink, rounds].data)

    rows |= {f"q2tp, GPTQ λ 0.1{', shrunk scales' if shrink else ''}, {rounds} refit rounds (encode.embedding_refit)":
             lambda rounds=rounds, shrink=shrink: refit(rounds, shrink) for shrink in (False, True) for rounds in (1, 3, 5)}
    rows |= {f"blr {bpw} bpw (encode.embedding: blr, head Gram)": lambda bpw=bpw: blr_matrix(bpw) for bpw in (1.0, 2.0)}
    counts = np.bincount(tokens[: int(attrs["n_train"])].ravel(), minlength=E.shape[0])

    def by_frequency(damps):  # GPTQ's λ per row by how often its token occurs in the training windows
        W, size = np.empty_like(E), 0
        for rows, damp in zip((counts == 0, (counts > 0) & (counts < 4), counts >= 4), damps):
            t = gptq_recoded(dense_tensor("e", E[rows], Q2TP), E[rows], H, damp)
            W[rows], size = tensor_to_numpy(t), size + len(t.data)
        return W, size

    rows |= {f"q2tp, GPTQ λ {damps} for tokens seen 0 / 1–3 / ≥ 4 times": lambda damps=damps: by_frequency(damps)
             for damps in ((0.03, 0.3, 1.0), (0.1, 0.3, 1.0), (0.1, 1.0, 3.0), (0.03, 0.1, 0.3))}
    print("| format | MB | relative squared error | held-out | python-docs | Britannica | as the head only: held-out | "
          "python-docs | Britannica |\n|---|---|---|---|---|---|---|---|---|")
    for name, make in rows.items():
        if not name.startswith(tuple(only.split("|"))):
            continue
        W, size, *note = make()
        rel = float(((W - E) ** 2).sum() / (E ** 2).sum())
        ratios = []
        for head_only in (False, True):  # the tied matrix in both roles; then untied, the embedding kept f16
            model.model.embed_tokens.weight.data.copy_(torch.from_numpy(E if head_only else np.asarray(W, np.float32)))
            model.lm_head = DenseLinear(torch.from_numpy(np.asarray(W, np.float32)))
            ratios += [perplexity(model, windows) / b for windows, b in zip(scored, base)]
            del model.lm_head
        print(f"| {' '.join([name, *note])} | {size / 1e6:.2f} | {rel:.4f} | " + " | ".join(f"{r:.3f}×" for r in ratios) + " |",
              flush=True)

if __name__ == "__main__":
    torch.set_num_threads(2)
    main(Path(sys.argv[1]), *sys.argv[2:3])
