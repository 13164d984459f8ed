"""`nvg export-hf --packed` against the dense export, in transformers on one GPU (docs/benchmarks.md).

Both folders are written from one student CMF in bf16 and loaded with `AutoModelForCausalLM`; for each,
the folder's size, the GPU memory of the loaded model, forward tokens/s on `--batch` windows of
`--window` tokens (logits included; the median of timed windows) and the logits' agreement with the
other folder and with nvg's own model.

    python bench/export_hf_bench.py --student model.cmf --out export_hf.json [--batch 8] [--window 2048]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import nvg.hf_quantizer  # noqa: F401  (registers the nvg quantizer)
from nvg.export_hf import main as export_hf
from nvg.model import autocast, load_model


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def forward_rate(model, ids, iters: int, windows: int) -> float:
    """Tokens per second of `model(ids)`: the median of `windows` timed windows of `iters` calls."""
    with torch.no_grad():
        model(ids)  # warm-up (and the packed linears' one-time fold)
        rates = []
        for _ in range(windows):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                model(ids)
            torch.cuda.synchronize()
            rates.append(ids.numel() * iters / (time.perf_counter() - t))
    return float(np.median(rates))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--student", required=True, type=Path, help="a student CMF (BLR body)")
    ap.add_argument("--out", required=True, type=Path, help="the JSON to write")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--windows", type=int, default=3)
    a = ap.parse_args()
    device = torch.device("cuda")
    ids = torch.randint(0, 49152, (a.batch, a.window), generator=torch.Generator().manual_seed(0)).to(device)
    ids = ids % load_model(a.student).cfg.vocab_size
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
           "student": str(a.student), "student_bytes": a.student.stat().st_size, "batch": a.batch, "window": a.window}
    logits = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dense", "packed"):
            folder = Path(tmp) / kind
            export_hf(a.student, folder, "bfloat16", packed=kind == "packed")
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
            loaded = torch.cuda.memory_allocated()
            rate = forward_rate(model, ids, a.iters, a.windows)
            with torch.no_grad():
                logits[kind] = model(ids[:1]).logits.float().cpu()  # off the GPU: the next model's memory is its own
            out[kind] = {"folder_bytes": folder_bytes(folder), "model_gpu_bytes": loaded,
                         "peak_gpu_bytes": torch.cuda.max_memory_allocated(), "forward_tok_s": rate}
            del model
    ours = load_model(a.student, device)
    with torch.no_grad(), autocast(device, "bf16"):
        logits["nvg"] = ours(ids[:1]).float().cpu()
    scale = logits["nvg"].abs().max().item()
    for kind in ("dense", "packed"):
        out[kind]["max_abs_logit_diff_vs_nvg_over_max"] = (logits[kind] - logits["nvg"]).abs().max().item() / scale
        out[kind]["top1_agreement_vs_nvg"] = (logits[kind].argmax(-1) == logits["nvg"].argmax(-1)).float().mean().item()
    out["packed_over_dense_tok_s"] = out["packed"]["forward_tok_s"] / out["dense"]["forward_tok_s"]
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
