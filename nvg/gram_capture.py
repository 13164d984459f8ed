"""Stage `gram_capture`: per layer and linear input, the input Grams H = Σ x xᵀ over FIT and SEL tokens.

Inputs: `attn_in` (feeds q/k/v), `attn_out` (feeds o), `mlp_in` (feeds gate/up), `mlp_down` (feeds
down), and once per model `head_in`, the final-normed hidden states the LM head multiplies (the encoder
of a quantised head, nvg/gptq.py, measures its error on the logits through it). FIT windows are the
first `fit_windows` training windows, SEL the next `sel_windows` (disjoint); held-out windows are never
used. Grams accumulate in float32 on the device through forward hooks.
Output `grams/{model}.h5` (format in `nvg/artifacts.py`).

    python -m nvg.gram_capture --model M.cmf --windows W.h5 --out grams/teacher.h5 --settings JSON
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from nvg.artifacts import HEAD_INPUT, model_hash, read_windows, write_grams
from nvg.cmf import read_verified
from nvg.errors import NvgError, exits_cleanly
from nvg.layout import BODY_ROLES, ROLE_INPUT
from nvg.model import autocast, computing_in, load_model, pick_device
from nvg.progress import bar
from nvg.settings import SETTINGS_HELP, load

# one hook per distinct input: the first role that reads it (linears sharing an input share its Gram)
INPUT_LEAD = {name: next(r for r, n in ROLE_INPUT.items() if n == name) for name in dict.fromkeys(ROLE_INPUT.values())}


@dataclass
class GramSettings:
    """Config block `grams` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "grams"
    fit_windows: int
    sel_windows: int
    batch: int
    device: str
    precision: str


def capture(model, tokens: np.ndarray, device, batch: int, precision: str, label: str) -> tuple[dict, int]:
    """{(layer, input): H float32 [n, n]} over all tokens (the head's input under (None, "head_in")), and
    the token count."""
    grams: dict = {}

    def accumulate(key, x):
        x = x.reshape(-1, x.shape[-1]).float()
        if key not in grams:
            grams[key] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
        grams[key].addmm_(x.T, x)

    hooks = [model.model.norm.register_forward_hook(lambda _mod, _args, out: accumulate(HEAD_INPUT, out))]
    for i, layer in enumerate(model.model.layers):
        for name, role in INPUT_LEAD.items():
            module = layer.get_submodule(BODY_ROLES[role])
            hooks.append(module.register_forward_pre_hook(lambda _mod, args, key=(i, name): accumulate(key, args[0])))
    try:
        with torch.no_grad(), autocast(device, precision), bar(len(tokens), label, "window") as pb:
            for s in range(0, len(tokens), batch):
                model.hidden(torch.from_numpy(tokens[s : s + batch]).to(device))
                pb.update(len(tokens[s : s + batch]))
    finally:
        for h in hooks:
            h.remove()
    return {k: v.cpu().numpy() for k, v in grams.items()}, int(tokens.size)


def main(model_path: Path, windows: Path, out: Path, settings: GramSettings) -> None:
    cmf = read_verified(model_path)
    tokens, attrs = read_windows(windows, cmf.arch["vocab_size"])
    n_train = int(attrs["n_train"])
    if settings.fit_windows + settings.sel_windows > n_train:
        raise NvgError(f"config grams: fit_windows + sel_windows = {settings.fit_windows + settings.sel_windows} "
                       f"exceeds the {n_train} training windows")
    device = pick_device(settings.device)
    model = load_model(cmf, device)
    print(f"gram_capture: {computing_in(device, 'grams.precision', settings.precision)}", file=sys.stderr)
    fit = tokens[: settings.fit_windows]
    sel = tokens[settings.fit_windows : settings.fit_windows + settings.sel_windows]
    g_fit, c_fit = capture(model, fit, device, settings.batch, settings.precision, "gram_capture FIT")
    g_sel, c_sel = capture(model, sel, device, settings.batch, settings.precision, "gram_capture SEL")
    write_grams(out, g_fit, g_sel, c_fit, c_sel, {"model": str(model_path), "model_hash": model_hash(cmf), "windows_hash": attrs["tokens_blake2b"],
                                                  "inputs": sorted(set(ROLE_INPUT.values())) + [HEAD_INPUT[1]]})
    print(f"gram_capture: {len(g_fit)} Grams ({c_fit} FIT + {c_sel} SEL tokens) on {device} → {out}", file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg gram-capture", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path, help="the model whose layer inputs are captured (the teacher, or a student to re-encode)")
    ap.add_argument("--windows", required=True, type=Path, help="the token windows (results/data/windows.h5)")
    ap.add_argument("--out", required=True, type=Path, help="the Grams (HDF5, one FIT and one SEL matrix per layer input)")
    ap.add_argument("--settings", required=True, help=SETTINGS_HELP)
    a = ap.parse_args(argv)
    main(a.model, a.windows, a.out, load(GramSettings, a.settings))


if __name__ == "__main__":
    cli()
