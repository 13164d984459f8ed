"""Stage report: one HTML page with the numbers and every plot, from a real workflow run."""

from __future__ import annotations

import json
from pathlib import Path


def test_report_has_every_plot_and_the_numbers(finished_run):
    workdir, config = finished_run
    page = (workdir / "results/report.html").read_text()
    report = json.loads((workdir / "results/eval.json").read_text())
    assert page.count('src="data:image/png;base64,') == 4
    for title in ("Perplexity before and after training", "Training", "Bits per weight per layer", "Encoder error per layer"):
        assert f"<h2>{title}</h2>" in page
    assert f"{report['heldout']['final']['perplexity']:.3f}" in page
    assert f"{report['files']['final']['body_bpw']:.4f}" in page
    assert "<h2>Perplexity against the teacher</h2>" in page
    for model in ("encoded", "reconstructed"):  # both students before training, each with its held-out perplexity
        assert f"<th>{model} ppl (× teacher)</th>" in page and f"<td>{model}</td>" in page
        assert f"{report['heldout'][model]['perplexity']:.3f}" in page
    for source, scores in report["ood"].items():  # every out-of-domain set with its ratio to the teacher
        ratio = scores["final"]["perplexity"] / scores["teacher"]["perplexity"]
        assert f"OOD {source}" in page and f"({ratio:.2f}×)" in page
    # the verdict in words, the teacher, the size against the teacher's, the stage total
    ratios = [s["final"]["perplexity"] / s["teacher"]["perplexity"] for s in [report["heldout"], *report["ood"].values()]]
    word = "Close to the teacher" if max(ratios) <= 1.5 else "Usable, with a visible quality loss" if max(ratios) <= 3 \
        else "Far from the teacher"
    assert f"<b>{word}.</b>" in page
    assert config["teacher"] in page
    compression = report["files"]["teacher"]["bytes"] / report["files"]["final"]["bytes"]
    assert f"{compression:.1f}× smaller than" in page and "total (stages before evaluation)" in page


def test_the_reports_first_screen_is_also_a_png_with_the_verdict(finished_run, tmp_path):
    """results/report.png: the run's facts, the verdict and every scored text, drawn from the same context
    as the page (its text is checked by drawing it again with the text recorded)."""
    from matplotlib.figure import Figure

    from nvg import report

    workdir, config = finished_run
    png = (workdir / "results/report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    from matplotlib.axes import Axes

    drawn, cells = [], []
    original_text, original_table = Figure.text, Axes.table

    def record_text(self, x, y, s, *a, **kw):
        drawn.append(s)
        return original_text(self, x, y, s, *a, **kw)

    def record_table(self, *a, cellText=None, **kw):
        cells.extend(cellText)
        return original_table(self, *a, cellText=cellText, **kw)

    import matplotlib

    matplotlib.use("Agg")
    Figure.text, Axes.table = record_text, record_table
    try:
        report.main(workdir / "results/eval.json", workdir / "results/student/encode.json",
                    workdir / "results/train/metrics.jsonl", tmp_path / "r.html", config["teacher"], tmp_path / "r.png")
    finally:
        Figure.text, Axes.table = original_text, original_table
    page = (tmp_path / "r.html").read_text()
    word = next(s for s in drawn if s.endswith(".") and f"<b>{s}</b>" in page)  # the verdict, as the page has it
    assert word in ("Close to the teacher.", "Usable, with a visible quality loss.", "Far from the teacher.")
    text = " ".join(s.replace("\n", " ") for s in drawn)
    assert config["teacher"] in text and "smaller than the teacher's CMF" in text and "bits per weight over the whole file" in text
    scores = json.loads((workdir / "results/eval.json").read_text())
    by_source = scores["heldout_by_source"]  # the run calibrates on several sources: each one's held-out windows too
    assert len(by_source) > 1
    assert [row[0] for row in cells] == ["held-out", *(f"held-out {Path(s).name}" for s in by_source),
                                         *(f"OOD {Path(s).name}" for s in scores["ood"])]
    for row, s in zip(cells, [scores["heldout"], *by_source.values(), *scores["ood"].values()]):
        assert row[-1].endswith(f"({s['final']['ppl_ratio']:.2f}×)") and row[1] == f"{s['tokens']:,}"
        assert row[3].startswith(f"{s['reconstructed']['perplexity']:.4g} (")  # before training: what training started from
