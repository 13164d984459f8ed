"""Stage settings: each step module's dataclass is built from the JSON its rule passes in `params:`.

The config schema (`workflow/schemas/config.schema.yaml`) is the one source of defaults and bounds:
`load` fills every key the JSON leaves out with the schema's default and checks every value against
the schema, so a step module run by hand behaves like the pipeline with those keys unset. Unknown
keys and out-of-range values are one error naming the config key. A dataclass states its config block
in `SECTION` and checks only what spans two keys in `__post_init__`."""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from pathlib import Path

import jsonschema
import yaml

from nvg.errors import NvgError

# The one source of every setting's default and bounds: the workflow validates config.yaml against it
# (nvg.config, which every stage need not import), and `load` builds each step module's settings from it.
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "workflow/schemas/config.schema.yaml"

SETTINGS_HELP = "this stage's config block as JSON (keys, defaults and bounds: workflow/schemas/config.schema.yaml)"


def check(cond: bool, section: str, key: str, problem: str) -> None:
    if not cond:
        raise NvgError(f"config {section}.{key}: {problem}")


@functools.cache
def _schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def section_schema(section: str) -> dict:
    """The schema of one config block (`train`, `train.signs`, …), its `$ref`s resolvable."""
    root = _schema()
    node = root
    for part in section.split("."):
        node = _resolved(node["properties"][part])  # a block may be a shared definition (`signs`)
    return {**node, "definitions": root["definitions"]}


def _resolved(spec: dict) -> dict:
    return _schema()["definitions"][spec["$ref"].rsplit("/", 1)[1]] if "$ref" in spec else spec


def with_defaults(schema: dict, data: dict) -> dict:
    """`data` with every key it leaves out set to the schema's default, nested blocks included."""
    out = dict(data)
    for key, spec in schema.get("properties", {}).items():
        spec = _resolved(spec)
        if key not in out and "default" in spec:
            out[key] = json.loads(json.dumps(spec["default"]))
        if "properties" in spec and isinstance(out.get(key), dict):
            out[key] = with_defaults(spec, out[key])
    return out


def with_schema_defaults(config: dict) -> dict:
    """The whole pipeline config with every key it leaves out set to the schema's default, through the
    schema's `$ref`s (which Snakemake's own `validate` does not follow)."""
    return with_defaults(_schema(), config)


def load(cls, values: str | dict | None = None, **overrides):
    """Settings `cls` from a JSON object (text or dict) plus `overrides`: schema defaults filled in,
    every value checked against the schema, nested blocks built as their own dataclasses."""
    section = cls.SECTION
    try:
        data = json.loads(values) if isinstance(values, str) else dict(values or {})
    except ValueError as e:
        raise NvgError(f"config {section}: settings are not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise NvgError(f"config {section}: settings must be a JSON object, got {type(data).__name__}")
    schema = section_schema(section)
    data = with_defaults(schema, {**data, **overrides})
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(data))
    if error is not None:
        path = [str(p) for p in error.absolute_path]
        if error.validator == "additionalProperties":
            known = error.schema.get("properties", {})
            unknown = sorted(set(error.instance) - set(known))[0]
            raise NvgError(f"config {'.'.join([section, *path, unknown])}: unknown key (known: {', '.join(sorted(known))})")
        raise NvgError(f"config {'.'.join([section, *path])}: {error.message}")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            data[f.name] = load(hints[f.name], data[f.name])
    return cls(**data)
