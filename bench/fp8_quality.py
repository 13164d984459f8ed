"""train.fp8's cost in held-out KL at equal steps (issue #18 asks under 1 %): train_student twice on one finished
run's inputs, the BLR GEMMs as the config computes them and in fp8 (nvg/fp8.py), every other setting the same, and
the held-out KLs of both side by side: those train_student measured as it trained (the fp8 run's in fp8 too) and
each trained file's own, read back and scored the usual way (the GEMMs in bf16, the KL alone), as evaluate would.

    python bench/fp8_quality.py --folder /path/to/a/finished/run [--train '{"signs": {"enabled": true}}'] --out fp8.json

On a GPU with fp8 tensor cores this is the measurement itself. On a CPU, nvg/fp8.py's GEMMs are its float32
reference of the same roundings (e4m3 codes, per-row float32 scales, bf16 out), so the KL is the GPU's up to the
order of the sums; train_student refuses fp8 there (no speed to gain), so this script lifts that check for its own
process. The folder's config.yaml gives the train block (the schema's defaults under it); the student is the
one its train_student read (results/student/reconstructed.cmf), live targets from results/teacher.cmf."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from nvg import fp8
from nvg import train_student as ts
from nvg.cmf import read_verified
from nvg.distill import Distiller, Targets
from nvg.model import load_model
from nvg.settings import load


def trained_kls(folder: Path, train: dict, on: bool, work: Path) -> tuple[list[dict], float]:
    s = load(ts.TrainSettings, **{**train, "fp8": on, "state_root": str(work / f"state-{on}")})
    metrics, trained = work / f"metrics-{on}.jsonl", work / f"trained-{on}.cmf"
    student, windows, teacher = (folder / "results" / p for p in ("student/reconstructed.cmf", "data/windows.h5", "teacher.cmf"))
    ts.main(student, windows, [], "bench", trained, metrics, s, teacher)
    device = ts.pick_device(s.device)
    t_cmf, s_cmf = read_verified(teacher), read_verified(trained)
    scored = Distiller(load_model(s_cmf, device), Targets.from_files(windows, [], s_cmf.arch["vocab_size"]), device,
                       batch=s.batch, precision=s.precision, teacher=ts.live_teacher(t_cmf, s_cmf, device))
    return [m for m in map(json.loads, metrics.read_text().splitlines()) if "heldout_kl" in m], scored.heldout_kl()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, required=True, help="a finished run's folder (README command 1's)")
    ap.add_argument("--train", default="{}", help="JSON over the folder's train block (e.g. sign training)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    train = {**yaml.safe_load((a.folder / "config.yaml").read_text())["train"], **json.loads(a.train)}
    if not fp8.has_fp8_matmuls(ts.pick_device(train.get("device", "auto"))):
        fp8.has_fp8_matmuls = lambda device: True  # the CPU's reference GEMMs: see the docstring
    with tempfile.TemporaryDirectory() as work:
        (evals, final), (evals_fp8, final_fp8) = (trained_kls(a.folder, train, on, Path(work)) for on in (False, True))
    rows = [{"step": without["step"], "heldout_kl": without["heldout_kl"], "heldout_kl_fp8": with_fp8["heldout_kl"],
             "fp8_vs_without": round(with_fp8["heldout_kl"] / without["heldout_kl"] - 1, 5)}
            for without, with_fp8 in zip(evals, evals_fp8)]
    rows.append({"trained file, scored in bf16": True, "heldout_kl": final, "heldout_kl_fp8": final_fp8,
                 "fp8_vs_without": round(final_fp8 / final - 1, 5)})
    a.out.write_text(json.dumps({"folder": str(a.folder), "train": train, "evals": rows}, indent=1))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
