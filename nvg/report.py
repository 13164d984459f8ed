"""Stage `report`: one self-contained HTML page from eval.json, encode.json and metrics.jsonl, rendered
from the jinja2 template `nvg/templates/report.html.j2`: a verdict in words (the largest perplexity
ratio to the teacher against 1.5× and 3×), size and compression, every scored text, the stage times.

Plots (PNG, embedded): the training loss and held-out KL curves, bits per weight per layer and role,
the encoder's relative SEL error per layer and role, and perplexity before and after training.

    python -m nvg.report --eval eval.json --encode encode.json --metrics metrics.jsonl --out report.html
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import textwrap
import time
from collections import defaultdict
from pathlib import Path

from nvg.atomic import atomic_path
from nvg.errors import NvgError, exits_cleanly
from nvg.layout import BODY_ROLES, parse_body_linear

ROLES = list(BODY_ROLES)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def training_plot(metrics: list[dict]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    steps = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "heldout_kl" in m]
    ax.plot([m["step"] for m in steps], [m["loss"] for m in steps], lw=1, color="#8aa", label="training KL (batch)")
    ax.plot([m["step"] for m in evals], [m["heldout_kl"] for m in evals], "o-", color="#c33", label="held-out KL")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(teacher top-k ‖ student), nats/token")
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


def per_layer_plot(tensors: dict, key: str, ylabel: str) -> str:
    import matplotlib.pyplot as plt

    series = defaultdict(dict)
    for name, row in tensors.items():
        parsed = parse_body_linear(name)
        if parsed and key in row:
            series[parsed[1]][parsed[0]] = row[key]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    styles = ["-", "--", ":", "-."]
    for k, role in enumerate(ROLES):  # roles at equal budgets coincide: marker and dash tell them apart
        if series[role]:
            layers = sorted(series[role])
            ax.plot(layers, [series[role][i] for i in layers], marker="os^vD<>"[k], ms=4, ls=styles[k % 4],
                    alpha=0.8, label=role)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.legend(ncol=7, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.grid(alpha=0.3)
    return _png(fig)


def scored_sets(report: dict) -> list[tuple[str, dict]]:
    """(label, scores) of the held-out windows, of each calibration source's among them (when there are
    several) and of every out-of-domain source."""
    return ([("held-out", report["heldout"])] + [(f"held-out {src}", r) for src, r in report.get("heldout_by_source", {}).items()]
            + [(f"OOD {name}", r) for name, r in report.get("ood", {}).items()])


def scored_models(report: dict) -> list[str]:
    """The models eval.json scored, in pipeline order: teacher, encoded, reconstructed (when that stage ran), final."""
    return [m for m in ("teacher", "encoded", "reconstructed", "final") if m in report["files"]]


def perplexity_plot(report: dict) -> str:
    import matplotlib.pyplot as plt

    sets, models = scored_sets(report), scored_models(report)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(sets)
    for j, (label, scores) in enumerate(sets):
        vals = [scores[m]["perplexity"] for m in models]
        bars = ax.bar([i + j * width for i in range(len(models))], vals, width, label=label)
        ax.bar_label(bars, fmt="%.4g", fontsize=8)
    ax.set_xticks([i + width * (len(sets) - 1) / 2 for i in range(len(models))], models)
    ax.set_yscale("log")
    ax.set_ylabel("perplexity")
    ax.legend(fontsize=8)
    return _png(fig)


VERDICTS = [  # (largest perplexity ratio to the teacher, word, colour, meaning): issue #17's targets
    (1.5, "Close to the teacher", "#2a2", "Within 1.5× everywhere it was measured."),
    (3.0, "Usable, with a visible quality loss", "#c90", "Within 3× of the teacher: expect noticeably worse text."),
    (float("inf"), "Far from the teacher", "#c33",
     "More than 3× the teacher's perplexity somewhere: a smaller dense model may serve better at this size."),
]


def context(report: dict, encode: dict, metrics: list[dict], teacher: str) -> dict:
    """Everything the template shows, as plain values."""
    from importlib.metadata import version

    models = scored_models(report)
    sets = [{"label": label, "tokens": r["tokens"], **{m: r[m]["perplexity"] for m in models}} for label, r in scored_sets(report)]
    ood = [{"label": s["label"], "ratio": s["final"] / s["teacher"]} for s in sets if s["label"].startswith("OOD ")]
    heldout_ratio = sets[0]["final"] / sets[0]["teacher"]
    worst = max(ood, key=lambda o: o["ratio"]) if ood else None
    largest = max(s["final"] / s["teacher"] for s in sets)
    limit, word, colour, meaning = next(v for v in VERDICTS if largest <= v[0])
    files, held = report["files"], report["heldout"]
    stages = sorted(report.get("stage_seconds", {}).items(), key=lambda kv: -kv[1])
    final, compression = files["final"], files["teacher"]["bytes"] / files["final"]["bytes"]
    headline = (f"The final student stores {final['file_bpw']:.2f} bits per weight over the whole file (body "
                f"{final['body_bpw']:.3f}): {final['bytes'] / 1e6:,.1f} MB, {compression:.1f}× smaller than the teacher's CMF. "
                f"Its perplexity is {heldout_ratio:.2f}× the teacher's on held-out calibration text and "
                + (f"up to {worst['ratio']:.2f}× on text it never saw ({worst['label']}). " if worst else
                   "not measured on text it never saw. ") + meaning)
    return {
        "teacher": teacher or "(not named)", "nvg_version": version("nvg"), "date": time.strftime("%Y-%m-%d %H:%M"),
        "verdict": {"word": word, "colour": colour}, "headline": headline, "sets": sets,
        "models": [{"name": m, "perplexity": held[m]["perplexity"], "kl_full": held[m]["kl_full"],
                    "kl_topk": held[m].get("kl_topk", float("nan")), "top1": held[m]["top1_agreement"], **files[m]}
                   for m in models],
        "before_training": models[1:-1],
        "encode_method": encode["settings"].get("method"), "encode_error": encode.get("mean_rel_sel_error") or float("nan"),
        "stages": stages, "stage_total": sum(v for _, v in stages),
        "plots": {"perplexity": perplexity_plot(report), "training": training_plot(metrics),
                  "bpw": per_layer_plot(encode["tensors"], "bpw", "bits per weight"),
                  "error": per_layer_plot(encode["tensors"], "rel_sel_error", "relative SEL error")},
    }


def summary_png(ctx: dict, out: Path) -> None:
    """The report's first screen as one image, for places that show no HTML (docs, tickets, chats): the
    run's facts, the verdict and its sentence, and every scored text against the teacher."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(9.5, 2.9 + 0.3 * len(ctx["sets"])))
    fig.text(0.02, 0.97, f"nvg report · teacher {ctx['teacher']} · nvg {ctx['nvg_version']} · {ctx['date']}",
             fontsize=9, color="#555", va="top")
    fig.text(0.02, 0.88, ctx["verdict"]["word"] + ".", fontsize=17, weight="bold", color=ctx["verdict"]["colour"], va="top")
    fig.text(0.02, 0.74, textwrap.fill(ctx["headline"], 118), fontsize=10, va="top", linespacing=1.4)
    ax = fig.add_axes((0.02, 0.02, 0.96, 0.4))
    ax.axis("off")
    # a source by its file name, not its path
    start = ctx["before_training"][-1]  # the student training started from
    rows = [[re.sub(r"\S*/", "", s["label"]), f"{s['tokens']:,}", f"{s['teacher']:.2f}", f"{s[start]:.4g} ({s[start] / s['teacher']:.1f}×)",
             f"{s['final']:.4g} ({s['final'] / s['teacher']:.2f}×)"] for s in ctx["sets"]]
    table = ax.table(cellText=rows, colLabels=["text", "tokens", "teacher ppl", "before training (× teacher)",
                                                "final student (× teacher)"], loc="upper center", cellLoc="right",
                     colWidths=[0.3, 0.1, 0.12, 0.24, 0.24])
    table.auto_set_font_size(False)
    table.set_fontsize(9.5)
    table.scale(1, 1.5)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def main(eval_path: Path, encode_path: Path, metrics_path: Path, out: Path, teacher: str = "", png: Path | None = None) -> None:
    import jinja2
    import matplotlib

    matplotlib.use("Agg")
    try:
        report = json.loads(eval_path.read_text())
        encode = json.loads(encode_path.read_text())
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise NvgError(f"report inputs: {e}") from None
    env = jinja2.Environment(loader=jinja2.PackageLoader("nvg", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    ctx = context(report, encode, metrics, teacher)
    page = env.get_template("report.html.j2").render(ctx)
    with atomic_path(out) as tmp:
        tmp.write_text(page)
    if png is not None:
        summary_png(ctx, png)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg report", description=__doc__.splitlines()[0])
    ap.add_argument("--eval", required=True, type=Path, help="results/eval.json")
    ap.add_argument("--encode", required=True, type=Path, help="the encoder's report (results/student/encode.json)")
    ap.add_argument("--metrics", required=True, type=Path, help="the training metrics (results/train/metrics.jsonl)")
    ap.add_argument("--out", required=True, type=Path, help="the HTML report")
    ap.add_argument("--teacher-name", default="", help="the teacher as configured, shown in the page")
    ap.add_argument("--png", type=Path, help="also the report's first screen (verdict and scores) as a PNG")
    a = ap.parse_args(argv)
    main(a.eval, a.encode, a.metrics, a.out, a.teacher_name, a.png)


if __name__ == "__main__":
    cli()
