"""Budget plans: how many bits per weight each body linear gets.

    # comment
    default 0.8
    layer 0 1.2          # one layer
    layer 10-19 0.6      # a range, inclusive
    tensor model.layers.*.mlp.down_proj.weight 1.0    # a name or a glob

A tensor rule beats a layer rule beats the default; among rules of one kind a later line beats an
earlier one. Every error carries its line number and is raised before any model is loaded.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from nvg.errors import NvgError
from nvg.settings import section_schema

# a plan line obeys the same bounds as config encode.bpw: the schema's
_BPW = section_schema("encode")["properties"]["bpw"]


@dataclass
class Plan:
    source: str
    default: float | None = None
    default_origin: str = "config encode.bpw"  # where the default came from, for error messages
    layers: list[tuple[int, int, float, int]] = field(default_factory=list)  # (first, last, bpw, line)
    tensors: list[tuple[str, float, int]] = field(default_factory=list)  # (pattern, bpw, line)

    def rule_for(self, name: str, layer: int | None, fallback: float) -> tuple[float, str]:
        """(bits per weight, where they come from: the plan line or the config key)."""
        for pattern, bpw, line in reversed(self.tensors):
            if fnmatch.fnmatchcase(name, pattern):
                return bpw, f"{self.source}: line {line}"
        if layer is not None:
            for first, last, bpw, line in reversed(self.layers):
                if first <= layer <= last:
                    return bpw, f"{self.source}: line {line}"
        if self.default is not None:
            return self.default, self.default_origin
        return fallback, "config encode.bpw"

    def check_against(self, num_layers: int, names: list[str]) -> None:
        """Layer rules in range and tensor rules that match something, else an error with the line."""
        for first, last, _, line in self.layers:
            if last >= num_layers:
                raise NvgError(f"{self.source}: line {line}: layer {last} is out of range (the model has {num_layers} layers)")
        for pattern, _, line in self.tensors:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise NvgError(f"{self.source}: line {line}: tensor rule {pattern!r} matches no body linear")


def _bpw(text: str, source: str, line: int) -> float:
    try:
        v = float(text)
    except ValueError:
        raise NvgError(f"{source}: line {line}: bits per weight {text!r} is not a number") from None
    if not _BPW["exclusiveMinimum"] < v <= _BPW["maximum"]:
        raise NvgError(f"{source}: line {line}: bits per weight {v} must be in ({_BPW['exclusiveMinimum']}, {_BPW['maximum']}]")
    return v


def parse_plan(text: str, source: str = "<plan>") -> Plan:
    plan = Plan(source)
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        kind = words[0]
        if kind == "default" and len(words) == 2:
            plan.default, plan.default_origin = _bpw(words[1], source, n), f"{source}: line {n}"
        elif kind == "layer" and len(words) == 3:
            first, sep, last = words[1].partition("-")
            if not first.isdigit() or (sep and not last.isdigit()):
                raise NvgError(f"{source}: line {n}: layer {words[1]!r} is not <n> or <a>-<b>")
            a, b = int(first), int(last) if sep else int(first)
            if b < a:
                raise NvgError(f"{source}: line {n}: layer range {words[1]!r} is empty")
            plan.layers.append((a, b, _bpw(words[2], source, n), n))
        elif kind == "tensor" and len(words) == 3:
            plan.tensors.append((words[1], _bpw(words[2], source, n), n))
        else:
            raise NvgError(f"{source}: line {n}: expected 'default <bpw>', 'layer <n>|<a>-<b> <bpw>' or 'tensor <name> <bpw>', got {raw.strip()!r}")
    return plan


def read_plan(path: str | Path | None, default_bpw: float) -> Plan:
    if path is None or str(path) == "":
        return Plan("<config>", default=default_bpw)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise NvgError(f"{path}: cannot read plan: {e.strerror}") from None
    plan = parse_plan(text, str(path))
    if plan.default is None:
        plan.default = default_bpw
    return plan
