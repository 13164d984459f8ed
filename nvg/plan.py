"""Budget plans: how many bits per weight each body linear gets, and the format of the embedding and LM head.

    # comment
    default 0.8
    layer 0 1.2          # one layer
    layer 10-19 0.6      # a range, inclusive
    tensor model.layers.*.mlp.down_proj.weight 1.0    # a name or a glob
    embedding q2tp       # the token embedding (and the LM head when tied): a format of config encode.embedding
    lm_head blr 1.5      # an untied LM head; blr takes its bits per weight (else config encode.embedding_bpw)

A tensor rule beats a layer rule beats the default; among rules of one kind a later line beats an
earlier one. Without an embedding / lm_head line both follow config encode.embedding. Every error carries
its line number and is raised before any model is loaded. The first and the last block's linears at the
default then get config encode.ends_factor × its bits, paid for by the other linears at the default
(`ends_raised`); `filled_budgets` spends what rank rounding leaves (config encode.fill).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from nvg import blr as codec
from nvg.errors import NvgError
from nvg.settings import section_schema

# a plan line obeys the same bounds as config encode.bpw, and names the formats of encode.embedding: the schema's
_BPW = section_schema("encode")["properties"]["bpw"]
_VOCAB_FORMATS = section_schema("encode")["properties"]["embedding"]["enum"]
VOCAB_LINES = {"embedding": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}  # plan keyword → tensor


@dataclass
class Plan:
    source: str
    default: float | None = None
    default_origin: str = "config encode.bpw"  # where the default came from, for error messages
    layers: list[tuple[int, int, float, int]] = field(default_factory=list)  # (first, last, bpw, line)
    tensors: list[tuple[str, float, int]] = field(default_factory=list)  # (pattern, bpw, line)
    vocab: dict[str, tuple[str, float | None, int]] = field(default_factory=dict)  # tensor → (format, blr bpw, line)

    def vocab_rule(self, name: str, fmt: str, blr_bpw: float) -> tuple[str, float, str]:
        """(format, bits per weight if blr, where those bits come from) of the embedding or LM head `name`;
        `fmt` and `blr_bpw` are config encode.embedding and encode.embedding_bpw."""
        line_fmt, line_bpw, line = self.vocab.get(name, (fmt, None, None))
        if line_bpw is not None:
            return line_fmt, line_bpw, f"{self.source}: line {line}"
        return line_fmt, blr_bpw, "config encode.embedding_bpw"

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

    def check_against(self, num_layers: int, names: list[str], tensors) -> None:
        """Layer rules in range, tensor rules that match a body linear and embedding / lm_head lines that
        name a tensor of the model (`tensors`: all its names), else an error with the line."""
        for name, (_, _, line) in self.vocab.items():
            if name not in tensors:
                tied = " (its LM head is the tied embedding: use an embedding line)" if name == "lm_head.weight" else ""
                raise NvgError(f"{self.source}: line {line}: the model has no {name}{tied}")
        for first, last, _, line in self.layers:
            if last >= num_layers:
                raise NvgError(f"{self.source}: line {line}: layer {last} is out of range (the model has {num_layers} layers)")
        for pattern, _, line in self.tensors:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise NvgError(f"{self.source}: line {line}: tensor rule {pattern!r} matches no body linear")


def ends_raised(budgets: dict[str, tuple[float, str]], shapes: dict[str, tuple[int, int]], layers: dict[str, int],
                num_layers: int, factor: float, default_origin: str) -> tuple[dict[str, tuple[float, str]], str]:
    """The first and the last block's budgets × `factor` (config encode.ends_factor), the other blocks' lowered so that
    the body keeps its bits: before training those two blocks hold the most of a 1-bit student's distance to its
    teacher (SmolLM2-135M at 1.0 bpw: made exact alone, block 0 takes 15 % off the held-out KL and block 29 32 %; no
    other block more than 6 %; docs/quality.md, session 54). Only budgets that come from the default
    (`default_origin`) move: a plan's layer and tensor lines beat this. `budgets`: name → (bpw, origin); returns the
    new budgets and one line that says what moved. Where the other blocks would give up more than half their bits
    (a model of a few blocks) nothing moves."""
    if factor == 1.0:
        return budgets, "encode.ends_factor 1.0: every block at its plan's budget"
    ends = {0, num_layers - 1}
    moving = {n: b for n, (b, origin) in budgets.items() if origin == default_origin}
    end_names = [n for n in moving if layers[n] in ends]
    rest_names = [n for n in moving if layers[n] not in ends]
    size = {n: shapes[n][0] * shapes[n][1] for n in moving}
    if not end_names:
        return budgets, f"encode.ends_factor {factor:g}: nothing moved (the plan's lines set the first and the last block)"
    if not rest_names:
        return budgets, f"encode.ends_factor {factor:g}: nothing moved (no block between the first and the last at the default budget)"
    default = moving[end_names[0]]
    raised = min(factor * default, _BPW["maximum"])
    end_extra = sum((raised - moving[n]) * size[n] for n in end_names)
    lowered = default - end_extra / sum(size[n] for n in rest_names)
    if lowered < default / 2:
        return budgets, (f"encode.ends_factor {factor:g}: nothing moved (the other blocks would fall from {default:.4f} "
                         f"to {lowered:.4f} bpw, below half)")
    origin_end = f"{default_origin} × config encode.ends_factor {factor:g}"
    origin_rest = f"{default_origin} less the first and last blocks' extra bits (config encode.ends_factor {factor:g})"
    moved = dict(budgets)
    moved.update({n: (raised, origin_end) for n in end_names})
    moved.update({n: (lowered, origin_rest) for n in rest_names})
    return moved, (f"encode.ends_factor {factor:g}: blocks 0 and {num_layers - 1} at {raised:.4f} bpw, "
                   f"the other default-budget tensors at {lowered:.4f}")


def filled_budgets(budgets: dict[str, float], shapes: dict[str, tuple[int, int]], paths: str,
                   chosen: dict[str, tuple[float, int]] | None = None) -> dict[str, float]:
    """The body linears' budgets raised so that the body spends the bits it was given as a whole (config
    encode.fill). Each budget alone is a cap that the rank rounds down under, 8 at a time: at 1.0 bpw SmolLM2's MLP
    matrices keep rank 184 (0.962 bpw), as 192 would take 1.0001, and its body comes to 0.957 bpw. Here, in rounds,
    each tensor in turn, the smallest raise first (ties in body order), gets the budget of its next rank while the
    body's bits, counted for the path count that spends the most (`paths`: config encode.paths), stay within the sum
    of the budgets given: the body's bits per weight never exceed their mean.

    `chosen` (name → the budget it was encoded at and the path count the encoder kept) goes on from an encoding:
    under encode.paths auto the encoder keeps the path count that errs least, often the one that spends less than
    the fill counted (session 58's GPU recipe: body 0.990 bpw), so the fill starts again from those budgets with
    each tensor's bits counted at its own path count, and raises only at that count."""
    def counts(name: str, bpw: float) -> tuple[int, ...]:
        return (chosen[name][1],) if chosen else codec.path_counts(bpw, paths, *shapes[name])

    def spent(name: str, bpw: float) -> int:
        o, i = shapes[name]
        return max(8 * codec.payload_nbytes(p, codec.max_rank(bpw, p, o, i), o, i) for p in counts(name, bpw))

    def next_budget(name: str, bpw: float) -> float | None:
        """The least budget that holds 8 more rank for some path count (half a bit over its payload, so that
        rounding in max_rank cannot fall back), or None where every path count is at full rank."""
        o, i = shapes[name]
        raises = [(8 * codec.payload_nbytes(p, r + 8, o, i) + 0.5) / (o * i) for p in counts(name, bpw)
                  if (r := codec.max_rank(bpw, p, o, i)) + 8 <= min(o, i)]
        return min(raises, default=None)

    allowance = sum(b * shapes[n][0] * shapes[n][1] for n, b in budgets.items())
    filled = {n: chosen[n][0] for n in budgets} if chosen else dict(budgets)
    used = sum(spent(n, b) for n, b in filled.items())
    raised = True
    while raised:
        raised = False
        steps = sorted((nb - filled[n], k, n, nb) for k, n in enumerate(filled) if (nb := next_budget(n, filled[n])) is not None)
        for _, _, name, nb in steps:
            extra = spent(name, nb) - spent(name, filled[name])
            if used + extra <= allowance:
                filled[name], used, raised = nb, used + extra, True
    return filled


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
        elif kind in VOCAB_LINES and len(words) in (2, 3):
            fmt = words[1]
            if fmt not in _VOCAB_FORMATS:
                raise NvgError(f"{source}: line {n}: {kind} format {fmt!r} is not one of {', '.join(_VOCAB_FORMATS)}")
            if len(words) == 3 and fmt != "blr":
                raise NvgError(f"{source}: line {n}: {kind} {fmt} takes no bits per weight (only blr does)")
            plan.vocab[VOCAB_LINES[kind]] = (fmt, _bpw(words[2], source, n) if len(words) == 3 else None, n)
        else:
            raise NvgError(f"{source}: line {n}: expected 'default <bpw>', 'layer <n>|<a>-<b> <bpw>', 'tensor <name> <bpw>' "
                           f"or 'embedding|lm_head <format> [<bpw>]', got {raw.strip()!r}")
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
