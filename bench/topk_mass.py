"""How much of the teacher's next-token probability lies outside its top-k, per text: what a student
distilled on cached top-k targets never sees (issue #17's first question). Runs anywhere; CPU is fine.

    python bench/topk_mass.py --teacher results/teacher.cmf --k 64 --tokens 4096 --window 256 \
        --source python-docs --source pkg:shksprdata/ancillary/britannica-11th.txt
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from nvg.cmf import read_cmf
from nvg.losses import topk_logprobs
from nvg.model import load_model
from nvg.sources import ChatRenderer, source_tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--source", action="append", required=True)
    ap.add_argument("--k", type=int, action="append", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    a = ap.parse_args()
    from tokenizers import Tokenizer

    cmf = read_cmf(a.teacher)
    tok = Tokenizer.from_str(cmf.vocab.decode())
    model = load_model(cmf)
    out = {}
    for source in a.source:
        ids = source_tokens(source, a.tokens, tok, ChatRenderer(cmf.header.get("tokenizer_config", {}).get("chat_template"), source))
        windows = torch.from_numpy(ids[: len(ids) // a.window * a.window].reshape(-1, a.window)).long()
        with torch.no_grad():
            hidden = torch.cat([model.hidden(windows[i : i + 4]) for i in range(0, len(windows), 4)])
        out[source] = {"tokens": int(windows.numel())}
        for k in a.k or [64]:
            mass = 1 - topk_logprobs(hidden, model.head_weight, k)[1].exp().sum(-1)
            out[source][f"outside_top{k}"] = {"mean": float(mass.mean()), "median": float(mass.median()),
                                              "p90": float(np.quantile(mass.numpy(), 0.9))}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
