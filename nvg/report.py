"""Stage `report`: one self-contained HTML page from eval.json, encode.json and metrics.jsonl.

Plots (PNG, embedded): the training loss and held-out KL curves, bits per weight per layer and role,
the encoder's relative SEL error per layer and role, and perplexity before and after training.

    python -m nvg.report --eval eval.json --encode encode.json --metrics metrics.jsonl --out report.html
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
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
    for role in ROLES:
        if series[role]:
            layers = sorted(series[role])
            ax.plot(layers, [series[role][i] for i in layers], marker=".", label=role)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.legend(ncol=7, fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def scored_sets(report: dict) -> list[tuple[str, dict]]:
    """(label, scores) of the held-out windows and of every out-of-domain source."""
    return [("held-out", report["heldout"])] + [(f"OOD {name}", r) for name, r in report.get("ood", {}).items()]


def perplexity_plot(report: dict) -> str:
    import matplotlib.pyplot as plt

    sets = scored_sets(report)
    models = ["teacher", "encoded", "final"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(sets)
    for j, (label, scores) in enumerate(sets):
        vals = [scores[m]["perplexity"] for m in models]
        bars = ax.bar([i + j * width for i in range(3)], vals, width, label=label)
        ax.bar_label(bars, fmt="%.4g", fontsize=8)
    ax.set_xticks([i + width * (len(sets) - 1) / 2 for i in range(3)], ["teacher", "encoded (before training)", "final"])
    ax.set_yscale("log")
    ax.set_ylabel("perplexity")
    ax.legend(fontsize=8)
    return _png(fig)


def ratio_table(report: dict) -> str:
    """Perplexity against the teacher's on every scored set: the verdict in one table."""
    rows = "".join(
        f"<tr><td>{html.escape(label)}</td><td>{r['tokens']:,}</td><td>{r['teacher']['perplexity']:.3f}</td>"
        f"<td>{r['encoded']['perplexity']:.4g} ({r['encoded']['perplexity'] / r['teacher']['perplexity']:.2f}×)</td>"
        f"<td>{r['final']['perplexity']:.4g} ({r['final']['perplexity'] / r['teacher']['perplexity']:.2f}×)</td></tr>"
        for label, r in scored_sets(report))
    head = "<tr><th>text</th><th>tokens</th><th>teacher ppl</th><th>encoded ppl (× teacher)</th><th>final ppl (× teacher)</th></tr>"
    return f"<table>{head}{rows}</table>"


def summary_table(report: dict) -> str:
    rows = []
    for m in ("teacher", "encoded", "final"):
        h = report["heldout"][m]
        f = report["files"][m]
        rows.append(f"<tr><td>{m}</td><td>{h['perplexity']:.3f}</td><td>{h['kl_full']:.4f}</td>"
                    f"<td>{h.get('kl_topk', float('nan')):.4f}</td><td>{h['top1_agreement']:.3f}</td>"
                    f"<td>{f['body_bpw']:.4f}</td><td>{f['file_bpw']:.4f}</td><td>{f['bytes']:,}</td></tr>")
    head = ("<tr><th>model</th><th>held-out ppl</th><th>KL full vocab</th><th>KL top-k</th><th>top-1 agreement</th>"
            "<th>body bpw</th><th>file bpw</th><th>bytes</th></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def main(eval_path: Path, encode_path: Path, metrics_path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    try:
        report = json.loads(eval_path.read_text())
        encode = json.loads(encode_path.read_text())
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise NvgError(f"report inputs: {e}") from None
    stages = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.1f}</td></tr>" for k, v in report.get("stage_seconds", {}).items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>nvg report</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}td:first-child,th:first-child{{text-align:left}}img{{max-width:100%}}</style>
</head><body><h1>nvg report</h1>
<p>Teacher vs the encoded student (before training) vs the final student, on {report['heldout']['tokens']:,} held-out tokens.
Bits per weight are counted from the stored bytes, headers and scales included.</p>
{summary_table(report)}
<h2>Perplexity against the teacher</h2>{ratio_table(report)}
<h2>Perplexity before and after training</h2><img alt="perplexity" src="{perplexity_plot(report)}">
<h2>Training</h2><img alt="training curves" src="{training_plot(metrics)}">
<h2>Bits per weight per layer</h2><img alt="bits per weight" src="{per_layer_plot(encode['tensors'], 'bpw', 'bits per weight')}">
<h2>Encoder error per layer</h2><p>Relative output error on the SEL calibration tokens, tr((W−Ŵ)H(W−Ŵ)ᵀ)/tr(WHWᵀ),
method {html.escape(str(encode['settings'].get('method')))}, mean {encode.get('mean_rel_sel_error') or float('nan'):.4f}.</p>
<img alt="encoder error" src="{per_layer_plot(encode['tensors'], 'rel_sel_error', 'relative SEL error')}">
<h2>Stage wall time (s)</h2><table>{stages}</table>
</body></html>
"""
    with atomic_path(out) as tmp:
        tmp.write_text(page)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg report", description=__doc__.splitlines()[0])
    ap.add_argument("--eval", required=True, type=Path)
    ap.add_argument("--encode", required=True, type=Path)
    ap.add_argument("--metrics", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    main(a.eval, a.encode, a.metrics, a.out)


if __name__ == "__main__":
    cli()
