"""Stage `export`: the final `results/model.cmf`.

A copy of the trained student (same tensors, shapes, dtypes and payload bytes) whose provenance adds
the pipeline's settings and package versions; hashes are recomputed on write and the result must
pass `nvg verify` before it is renamed into place.

    python -m nvg.export --trained trained.cmf --out model.cmf --settings JSON
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from pathlib import Path

from nvg.atomic import atomic_path
from nvg.cmf import cmf_bytes, read_verified, verify
from nvg.errors import NvgError, exits_cleanly

PACKAGES = ("nvg", "torch", "numpy", "h5py", "snakemake", "transformers", "tokenizers", "safetensors")


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return out


def main(trained: Path, out: Path, pipeline_settings: dict) -> None:
    cmf = read_verified(trained)
    header = dict(cmf.header)
    header["provenance"] = {**header.get("provenance", {}),
                            "nvg_pipeline": {"settings": pipeline_settings, "versions": package_versions()}}
    with atomic_path(out) as tmp:
        tmp.write_bytes(cmf_bytes(header, list(cmf.tensors.values()), cmf.vocab))
        problems = verify(tmp)
        if problems:
            raise NvgError(f"{out}: verification failed: {problems[0]}")
    print(f"export: {len(cmf.tensors)} tensors, verified → {out}", file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg export", description=__doc__.splitlines()[0])
    ap.add_argument("--trained", required=True, type=Path, help="the trained student CMF")
    ap.add_argument("--out", required=True, type=Path, help="results/model.cmf: the trained student with the pipeline's provenance and fresh hashes")
    ap.add_argument("--settings", required=True, help="the pipeline's settings (JSON), recorded as provenance")
    a = ap.parse_args(argv)
    main(a.trained, a.out, json.loads(a.settings))


if __name__ == "__main__":
    cli()
