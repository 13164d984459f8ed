"""The most epochs of a variant's training that end, evaluation included, before the device session's time does.
Session 61 started ten epochs by earlier sessions' stage times; that machine's host-bound stages were 16-59 % slower,
and its time ran out 354 steps from the end, with nothing evaluated. bench/ablation.sh (ABLATION_DEADLINE_S) runs
this once the stages before train_student are done, when what is left is known, and overlays what it writes: the
variant's own epochs, or fewer, never more. The lr and η schedules then span the epochs it trains, as any
`train.epochs` does; eval.json's training_tokens and the log say how many ran.

    python bench/fit_epochs.py --configs base.yaml A.yaml B.yaml --windows results/data/windows.h5 \
        --seconds-left 900 --step-s 0.33 --tail-s 130 --out epochs_fit.yaml [--late-step-s 0.27]

With `train.hidden_epochs` and a live teacher, the epochs after the hidden-state term are cheaper (the teacher's
final states read back, not run): `--late-step-s` is their step time, `--step-s` the first epochs'.
"""

import argparse
from pathlib import Path

import yaml
from snakemake.utils import update_config

from nvg.artifacts import read_windows
from nvg.errors import NvgError, exits_cleanly
from nvg.settings import with_schema_defaults


def merged(paths: list[Path]) -> dict:
    """The config the workflow builds from these files: merged in order as Snakemake merges them, then the schema's
    defaults for what they leave out."""
    config: dict = {}
    for p in paths:
        update_config(config, yaml.safe_load(p.read_text()) or {})
    return with_schema_defaults(config)


def fitting_epochs(planned: int, steps_per_epoch: int, seconds_left: float, step_s: float, tail_s: float,
                   early_epochs: int | None = None, late_step_s: float | None = None) -> int:
    """min(planned, whole epochs in what is left after `tail_s`): the first `early_epochs` (all, when None) at `step_s`
    seconds a step, any after them at `late_step_s`; 0 when none fits."""
    epochs, left = 0, seconds_left - tail_s
    while epochs < planned:
        cost = steps_per_epoch * (step_s if early_epochs is None or epochs < early_epochs or late_step_s is None else late_step_s)
        if cost > left:
            break
        epochs, left = epochs + 1, left - cost
    return epochs


@exits_cleanly
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", type=Path, required=True, help="the variant's config files, in Snakemake's order")
    ap.add_argument("--windows", type=Path, required=True, help="the variant's windows.h5 (its n_train)")
    ap.add_argument("--seconds-left", type=float, required=True, help="until the session's device time ends")
    ap.add_argument("--step-s", type=float, required=True, help="seconds a training step takes on this machine")
    ap.add_argument("--late-step-s", type=float,
                    help="seconds a step takes after train.hidden_epochs under the live teacher (default: --step-s)")
    ap.add_argument("--tail-s", type=float, required=True,
                    help="seconds for the training's first step (its compile), its evaluations and evaluate")
    ap.add_argument("--out", type=Path, required=True, help="the overlay written: train.epochs")
    a = ap.parse_args(argv)
    train = merged(a.configs)["train"]
    _, attrs = read_windows(a.windows)
    steps_per_epoch = int(attrs["n_train"]) // train["batch"]
    if steps_per_epoch < 1:
        raise NvgError(f"{a.windows}: {attrs['n_train']} training windows make no batch of train.batch {train['batch']}")
    early = train["hidden_epochs"] if train["targets"] == "live" else None
    epochs = fitting_epochs(train["epochs"], steps_per_epoch, a.seconds_left, a.step_s, a.tail_s, early, a.late_step_s)
    if epochs == 0:
        raise NvgError(f"--seconds-left {a.seconds_left:.0f}: not one epoch of {steps_per_epoch} steps at {a.step_s} s "
                       f"fits after {a.tail_s:.0f} s of first step and evaluation")
    late = f", after epoch {early} at {a.late_step_s} s" if early is not None and a.late_step_s is not None else ""
    a.out.write_text(f"# bench/fit_epochs.py: {epochs} of the variant's {train['epochs']} epochs fit {a.seconds_left:.0f} s "
                     f"({steps_per_epoch} steps each at {a.step_s} s{late}, {a.tail_s:.0f} s beside them)\n"
                     + yaml.safe_dump({"train": {"epochs": epochs}}))
    print(f"fit_epochs: {epochs} of {train['epochs']} epochs ({epochs * steps_per_epoch} steps) in {a.seconds_left:.0f} s")


if __name__ == "__main__":
    main()
