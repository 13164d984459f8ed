"""Stage export: the final file is the trained student's bytes plus the pipeline's provenance, verified."""

from __future__ import annotations

import json

from nvg import export
from nvg.cli import main as nvg_main
from nvg.cmf import read_cmf, verify


def test_export_keeps_every_payload_and_records_the_pipeline(tiny_stages, tmp_path, capsys):
    trained, out = tiny_stages / "student.cmf", tmp_path / "model.cmf"
    settings = {"encode": {"bpw": 2.0}, "train": {"lr": 0.01}}
    export.cli(["--trained", str(trained), "--out", str(out), "--settings", json.dumps(settings)])
    before, after = read_cmf(trained), read_cmf(out)
    assert [(t.name, t.dtype, t.shape, bytes(t.data)) for t in before.tensors.values()] == \
           [(t.name, t.dtype, t.shape, bytes(t.data)) for t in after.tensors.values()]
    assert after.vocab == before.vocab
    pipeline = after.header["provenance"]["nvg_pipeline"]
    assert pipeline["settings"] == settings and pipeline["versions"]["torch"] and pipeline["versions"]["nvg"]
    assert after.header["provenance"]["nvg_encode"] == before.header["provenance"]["nvg_encode"]
    assert verify(out) == []
    nvg_main(["verify", str(out)])
    assert "OK" in capsys.readouterr().out
