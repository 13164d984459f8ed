"""The `nvg` command: file tools (`inspect`, `verify`) and every pipeline stage by name.

    nvg inspect FILE.cmf      header, tensors, dtypes, shapes, bits per weight
    nvg verify FILE.cmf       every hash; exit 1 on any mismatch
    nvg export-hf FILE OUT/   a Hugging Face folder (config, safetensors, tokenizer), dense or --packed
    nvg generate FILE PROMPT  text from any CMF, greedy or sampled, --chat for the chat template
    nvg progress [DIR]        each stage's status, time and latest progress line, from DIR/logs
    nvg <stage> ...           the same as `python -m nvg.<stage> ...`
    nvg --version             nvg's and torch's versions
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from importlib.metadata import version

from nvg.cmf import BLR, DTYPE_NAMES, read_cmf, verify
from nvg.errors import exits_cleanly
from nvg.layout import bits_summary

TOOLS = ["export_hf", "generate"]  # modules with their own CLI, run as `nvg export-hf …`, `nvg generate …`
STAGES = ["import_teacher", "generate_corpus", "tokenize_windows", "teacher_topk", "gram_capture", "budget_reencode",
          "dtgma_cut", "reconstruct_blocks", "train_student", "export", "evaluate", "report"]


def inspect(path: str) -> None:
    cmf = read_cmf(path)
    h = {k: v for k, v in cmf.header.items() if k not in ("tokenizer_config",)}
    if "nvg_blake2b" in h:  # one digest per tensor: the table below stands for them
        h["nvg_blake2b"] = {**h["nvg_blake2b"], "tensors": f"<{len(h['nvg_blake2b']['tensors'])} digests>"}
    print(f"{cmf.path}: CMF v2, features {cmf.features:#x}, {len(cmf.tensors)} tensors, vocab {len(cmf.vocab or b'')} bytes")
    print(json.dumps(h, indent=1))
    print(f"{'name':60s} {'dtype':8s} {'shape':16s} {'bytes':>10s} {'bpw':>7s}")
    for t in cmf.tensors.values():
        print(f"{t.name:60s} {DTYPE_NAMES[t.dtype]:8s} {str(list(t.shape)):16s} {len(t.data):10d} {8 * len(t.data) / t.numel:7.3f}")
    s = bits_summary(cmf)
    print(f"body linears: {s['body_bpw']:.4f} bpw over {s['body_weights']} weights; all tensors: {s['tensors_bpw']:.4f} bpw; "
          f"whole file: {s['file_bytes']:,} bytes = {s['file_bpw']:.4f} bpw over {s['all_weights']} weights; "
          f"blr tensors: {sum(t.dtype == BLR for t in cmf.tensors.values())}")


@exits_cleanly
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].replace("-", "_") in STAGES + TOOLS:
        importlib.import_module(f"nvg.{argv[0].replace('-', '_')}").cli(argv[1:])
        return
    ap = argparse.ArgumentParser(prog="nvg", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"nvg {version('nvg')} (torch {version('torch')})")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect", help="header, tensors and bits per weight of a CMF").add_argument("file", help="a CMF file")
    sub.add_parser("verify", help="check every hash of a CMF").add_argument("file", help="a CMF file (or the first shard)")
    sub.add_parser("progress", help="each stage's status, time and latest progress line (running or finished workflow)") \
        .add_argument("directory", nargs="?", default=".", help="the workflow's folder (default: here)")
    for s in STAGES:
        sub.add_parser(s.replace("_", "-"), help=f"pipeline stage {s} (python -m nvg.{s})")
    sub.add_parser("export-hf", help="a Hugging Face folder from a CMF, dense or --packed (BLR kept as bits)")
    sub.add_parser("generate", help="text from a CMF, greedy or sampled")
    a = ap.parse_args(argv)
    if a.cmd == "inspect":
        inspect(a.file)
    elif a.cmd == "progress":
        from pathlib import Path

        from nvg.progress import print_states

        print_states(Path(a.directory), STAGES)
    elif a.cmd == "verify":
        problems = verify(a.file)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            raise SystemExit(1)
        print(f"{a.file}: OK (header, directory, every tensor and section hash)")


if __name__ == "__main__":
    main()
