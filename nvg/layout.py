"""Where the body linears are and how many bits a file spends: the names every stage shares.

A body linear is one of the seven projections of a decoder layer (q, k, v, o, gate, up, down); these
are what the encoder turns into BLR. Bits are counted from the stored bytes, headers and scales
included, never from a nominal rate."""

from __future__ import annotations

from nvg.cmf import SHARD_NAME

BODY_ROLES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}
# The activation each body linear reads: linears that share an input share one Gram.
ROLE_INPUT = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "attn_out", "gate": "mlp_in", "up": "mlp_in", "down": "mlp_down"}


def parse_body_linear(name: str) -> tuple[int, str] | None:
    """(layer, role) of a body linear's tensor name, else None."""
    parts = name.split(".")
    if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        for role, suffix in BODY_ROLES.items():
            if ".".join(parts[3:5]) == suffix:
                return int(parts[2]), role
    return None


def _file_bytes(cmf) -> int:
    """The file's size on disk, every shard of a sharded file included."""
    m = SHARD_NAME.match(cmf.path.name)
    if not m:
        return cmf.path.stat().st_size
    count = int(m["count"])
    return sum(cmf.path.with_name(f"{m['base']}-{k:05d}-of-{count:05d}.cmf").stat().st_size for k in range(1, count + 1))


def bits_summary(cmf) -> dict:
    """Bits per weight counted from stored bytes: of the body linears (`body_bpw`), of all tensors
    (`tensors_bpw`), and of the whole file, header, tokenizer and padding included (`file_bpw`: what a
    user's disk and download see), all over the model's weights."""
    body_bytes = body_weights = all_bytes = all_weights = 0
    for t in cmf.tensors.values():
        all_bytes += len(t.data)
        all_weights += t.numel
        if parse_body_linear(t.name):
            body_bytes += len(t.data)
            body_weights += t.numel
    file_bytes = _file_bytes(cmf)
    return {
        "body_bpw": 8 * body_bytes / max(1, body_weights),
        "tensors_bpw": 8 * all_bytes / max(1, all_weights),
        "file_bpw": 8 * file_bytes / max(1, all_weights),
        "file_bytes": file_bytes,
        "body_weights": body_weights,
        "all_weights": all_weights,
    }
