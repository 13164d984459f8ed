"""Stage report: one HTML page with the numbers and every plot, from a real workflow run."""

from __future__ import annotations

import json


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
