"""The pipeline config checked against `workflow/schemas/config.schema.yaml`, reported as one line.

Snakemake's own `validate` prints a multi-line schema dump; users need the file, the key and the
problem. The workflow calls `config_error` first, then fills in the defaults (`nvg.settings.with_schema_defaults`)."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

from nvg.errors import NvgError
from nvg.sources import text_files


def config_error(config: dict, schema_path: Path, files: list[str]) -> str | None:
    """`<files>: <dotted.key>: <problem>` for the most relevant schema violation, or None when valid."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(config))
    names = ", ".join(dict.fromkeys(str(Path(f).resolve()) for f in files)) or "config"
    if error is not None:
        key = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        return f"{names}: {key}: {error.message}"
    train, defaults = config.get("train", {}), schema["properties"]["train"]["properties"]
    batch, gpus = (train.get(k, defaults[k]["default"]) for k in ("batch", "gpus"))
    if batch % gpus:
        return f"{names}: train.gpus: {gpus} does not divide train.batch {batch}"
    # a text scored as unseen is never calibrated on: by the same spelling, or by a file that both read (a glob or
    # folder over an ood file)
    ood_default = schema["properties"]["evaluate"]["properties"]["ood"]["default"]
    unseen = list(config.get("evaluate", {}).get("ood", ood_default))
    unseen_files = {f: spec for spec in unseen for f in _files(spec)}
    sources = config.get("data", {}).get("sources", [])
    calibration = [(f"data.sources[{i}].path", src["path"]) for i, src in enumerate(sources)]
    calibration.append(("generate_corpus.prompts", config.get("generate_corpus", {}).get("prompts", "")))
    for key, path in calibration:
        if path in unseen:
            return f"{names}: {key}: {path} is also in evaluate.ood: a text scored as unseen must not be calibrated on"
        shared = sorted(f for f in _files(path) if f in unseen_files)
        if shared:
            return (f"{names}: {key}: {path} reads {shared[0]}, which evaluate.ood scores as unseen "
                    f"({unseen_files[shared[0]]}): a text scored as unseen must not be calibrated on")
    return None


def _files(spec: str) -> set[str]:
    """The resolved files a text source reads; none for a source that finds nothing (the workflow reports that
    one by its key before any job)."""
    try:
        return {str(f.resolve()) for f in text_files(spec)}
    except NvgError:
        return set()
