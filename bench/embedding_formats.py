"""What each format of the tied embedding / LM head costs the teacher alone (issue #19): the teacher with only
that matrix replaced, perplexity on held-out windows and on python-docs as a ratio to the unchanged teacher.

    python bench/embedding_formats.py RESULTS   (RESULTS: a default run's results/ folder; float32 on the CPU)

The GPTQ rows use the head-input Gram of the run's Grams file (gram_capture's `head_in`, FIT windows); the
last three rows are what budget_reencode writes with `encode.embedding_shrink` (scales shrunk by the factor
that errs least on the SEL Gram).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from nvg.artifacts import HEAD_INPUT, read_grams, read_windows
from nvg.budget_reencode import gptq_recoded, gptq_shrunk
from nvg.cmf import Q2TP, Q4_BLOCK, Q4TP, dense_tensor, read_verified, tensor_to_numpy
from nvg.encoder import EncodeSettings, encode_tensor
from nvg.evaluate import ChatRenderer
from nvg.model import load_model
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


def main(results: Path) -> None:
    cmf = read_verified(results / "teacher.cmf")
    tokens, attrs = read_windows(results / "data/windows.h5", cmf.arch["vocab_size"])
    held = tokens[int(attrs["n_train"]):][:WINDOWS]
    tok = Tokenizer.from_str(cmf.vocab.decode("utf-8"))
    docs = source_tokens("python-docs", 4096, tok, ChatRenderer(cmf, "python-docs"))
    docs = docs[: len(docs) // tokens.shape[1] * tokens.shape[1]].reshape(-1, tokens.shape[1])
    model = load_model(cmf)
    E = model.model.embed_tokens.weight.data.numpy().copy()
    H, H_sel = (g.astype(np.float64) for g in read_grams(results / "grams/teacher.h5", *HEAD_INPUT)[:2])
    base = perplexity(model, held), perplexity(model, docs)
    print(f"teacher: held-out {base[0]:.2f}, python-docs {base[1]:.2f}")

    def quantised(dtype, hessian=None, damp=0.1):
        t = dense_tensor("e", E, dtype)
        t = gptq_recoded(t, E, hessian, damp) if hessian is not None else t
        return tensor_to_numpy(t), len(t.data)

    def blr_matrix(bpw):
        s = EncodeSettings(bpw=bpw, method="nvg", paths="1", kv_factor=1.0, rowweight=False, damp=0.01, iters=2,
                           signs="u", embedding="f16", embedding_damp=0.1, embedding_shrink=False, device="cpu")
        Hn = (H / np.diag(H).mean()).astype(np.float32)
        b, _ = encode_tensor(E, Hn, Hn, bpw, "embed", cmf.arch["head_dim"], s, "cpu", "embed")
        return b.dequantize(), len(b.encode())

    rows = {"q4_block (cortiq's rounding)": quantised(Q4_BLOCK), "q4_block, GPTQ λ 0.1": quantised(Q4_BLOCK, H),
            "q4tp, rounded": quantised(Q4TP), "q4tp, GPTQ λ 0.1": quantised(Q4TP, H), "q2tp, rounded": quantised(Q2TP)}
    rows |= {f"q2tp, GPTQ λ {d}": quantised(Q2TP, H, d) for d in (0.01, 0.1, 1.0)}
    for name, dtype in (("q4_block", Q4_BLOCK), ("q4tp", Q4TP), ("q2tp", Q2TP)):  # budget_reencode's choice
        t, shrink = gptq_shrunk(dense_tensor("e", E, dtype), E, H, H_sel, 0.1)
        rows[f"{name}, GPTQ λ 0.1, scales × {shrink} (encode.embedding_shrink)"] = tensor_to_numpy(t), len(t.data)
    rows["blr 1.0 bpw (nvg encoder, head Gram)"] = blr_matrix(1.0)
    print("| format | MB | relative squared error | held-out | python-docs |\n|---|---|---|---|---|")
    for name, (W, size) in rows.items():
        model.model.embed_tokens.weight.data.copy_(torch.from_numpy(np.asarray(W, np.float32)))
        rel = float(((W - E) ** 2).sum() / (E ** 2).sum())
        print(f"| {name} | {size / 1e6:.2f} | {rel:.4f} | {perplexity(model, held) / base[0]:.3f}× | "
              f"{perplexity(model, docs) / base[1]:.3f}× |", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(Path(sys.argv[1]))
