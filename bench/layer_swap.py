"""How much of a student's distance to its teacher one block holds: the full-vocabulary KL(teacher ‖ student) per
token with block L replaced by the teacher's own (dense) block, for every L, on the held-out windows and on each
out-of-domain text; also with every block replaced ("all": the student's embedding, head and final norm alone).
With `--by role` the unit is a role instead (q, k, v, o, gate, up, down): its linear in every block replaced by the
teacher's, and each gain also per million of the role's weights, where a bit spent buys the most (a plan's tensor lines
move bits between roles at an equal body).
A block made exact is the most that more bits in it could buy, if the other blocks stayed as they are; a trained
student's blocks have adapted to each other's errors, so a swap can also cost. Before training (the encoded or
reconstructed student) the gains say where the encoder's error sits.
    python bench/layer_swap.py --teacher results/teacher.cmf --student results/model.cmf \\
        --windows results/data/windows.h5 --ood python-docs --ood-tokens 4096 [--by role] --out swap.json
"""

from __future__ import annotations

import json

import torch

from nvg.layout import BODY_ROLES
from nvg.losses import student_scores
from nvg.model import autocast
from scored_texts import parsed_arguments, teacher_student_and_texts


@torch.no_grad()
def kl_per_token(teacher, student, sets: dict, t_hidden: dict, device, precision: str, batch: int) -> dict:
    """Mean full KL(teacher ‖ student) per token of each set, against the teacher's cached hidden states."""
    out = {}
    for label, windows in sets.items():
        total = 0.0
        for j, s in enumerate(range(0, len(windows), batch)):
            ids = torch.from_numpy(windows[s : s + batch]).to(device)
            with autocast(device, precision):
                h = student.hidden(ids)
                total += float(student_scores(t_hidden[label][j], h, teacher.head_weight, student.head_weight, ids)[1])
        out[label] = total / windows.size
    return out


def role_slot(block, role: str) -> tuple[torch.nn.Module, str]:
    """(the module holding `block`'s linear of `role`, its attribute name)."""
    parent, attr = BODY_ROLES[role].split(".")
    return getattr(block, parent), attr


def main():
    a = parsed_arguments(__doc__.splitlines()[0], ood=["python-docs"], ood_tokens=4096, batch=8,
                         extra=lambda ap: ap.add_argument("--by", choices=("block", "role"), default="block"))
    teacher, student, sets, device = teacher_student_and_texts(a)
    t_hidden = {}
    with torch.no_grad(), autocast(device, a.precision):
        for label, windows in sets.items():
            t_hidden[label] = [teacher.hidden(torch.from_numpy(windows[s : s + a.batch]).to(device))
                               for s in range(0, len(windows), a.batch)]
    score = lambda: kl_per_token(teacher, student, sets, t_hidden, device, a.precision, a.batch)  # noqa: E731
    blocks = student.model.layers
    report = {"none": score()}
    print("none:", report["none"], flush=True)
    if a.by == "role":
        for role in BODY_ROLES:
            slots = [role_slot(b, role) for b in blocks]
            own = [getattr(m, attr) for m, attr in slots]
            donors = [getattr(*role_slot(t, role)) for t in teacher.model.layers]
            for (m, attr), linear in zip(slots, donors):
                setattr(m, attr, linear)
            kl = score()
            for (m, attr), linear in zip(slots, own):
                setattr(m, attr, linear)
            weights = sum(d.weight.numel() for d in donors)
            gain = {k: 1 - v / report["none"][k] for k, v in kl.items()}
            per_million = {k: g / weights * 1e6 for k, g in gain.items()}
            report[role] = {"kl": kl, "weights": weights, "gain_per_million": per_million}
            print(f"{role} ({weights / 1e6:.2f}M weights): KL", {k: f"{-g:+.2%}" for k, g in gain.items()},
                  "per million:", {k: f"{-g:+.2%}" for k, g in per_million.items()}, flush=True)
    else:
        for i in range(len(blocks)):
            own, blocks[i] = blocks[i], teacher.model.layers[i]
            report[str(i)] = score()
            blocks[i] = own
            print(f"block {i}:", {k: f"{v / report['none'][k] - 1:+.2%}" for k, v in report[str(i)].items()}, flush=True)
    for i in range(len(blocks)):  # last: the student is not used after this
        blocks[i] = teacher.model.layers[i]
    report["all"] = score()
    print("all:", report["all"])
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
