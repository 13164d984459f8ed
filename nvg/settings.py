"""Stage settings: each step module's dataclass is built from the JSON its rule passes in `params:`.

Unknown keys and wrong types are rejected here with the config key named, so a typo never silently
falls back to a default."""

from __future__ import annotations

import dataclasses
import json
import typing

from nvg.errors import NvgError


def check(cond: bool, section: str, key: str, problem: str) -> None:
    if not cond:
        raise NvgError(f"config {section}.{key}: {problem}")


def from_json(cls, text: str | dict, section: str):
    """Build settings `cls` from a JSON object; `section` names the config block in messages."""
    try:
        data = json.loads(text) if isinstance(text, str) else dict(text)
    except ValueError as e:
        raise NvgError(f"config {section}: settings are not valid JSON: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise NvgError(f"config {section}.{unknown[0]}: unknown key (known: {', '.join(sorted(fields))})")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise NvgError(f"config {section}.{missing[0]}: required")
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        _check_type(section, key, value, hints[key])
    return cls(**data)


def _check_type(section, key, value, hint):
    origin = typing.get_origin(hint)
    options = typing.get_args(hint) if origin in (typing.Union, getattr(__import__("types"), "UnionType")) else (hint,)
    for opt in options:
        base = typing.get_origin(opt) or opt
        if opt is type(None) and value is None:
            return
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if base in (str, bool, list, dict) and isinstance(value, base):
            return
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise NvgError(f"config {section}.{key}: expected {names}, got {type(value).__name__} {value!r}")
