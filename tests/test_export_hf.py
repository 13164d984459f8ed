"""export-hf: transformers loads the dense and the packed folder with the same logits as nvg's BLR model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvg.cmf import read_cmf, write_cmf
from nvg.dtgma_cut import cut_tensor
from nvg.export_hf import main as export_hf
from nvg.model import load_model


@pytest.fixture(scope="module")
def blr_student(tiny_stages):
    return tiny_stages / "student.cmf"


def hf_logits(folder, ids):
    import nvg.hf_quantizer  # noqa: F401  (registers the nvg quantizer: packed folders load too)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def test_blr_student_logits_match_transformers(blr_student, tmp_path):
    export_hf(blr_student, tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        ours = load_model(blr_student)(ids)
    assert (ours - hf_logits(tmp_path / "hf", ids)).abs().max().item() <= 1e-4
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.chat_template and tok.eos_token == "<|im_end|>"


def test_the_folder_has_a_generation_config_a_model_card_and_ordinary_file_modes(blr_student, tiny_stages, tmp_path):
    import json
    import os

    from transformers import AutoConfig, GenerationConfig

    evaluation = {"heldout": {"teacher": {"perplexity": 10.0}, "final": {"perplexity": 25.0, "ppl_ratio": 2.5}},
                  "ood": {"python-docs": {"teacher": {"perplexity": 12.0}, "final": {"perplexity": 120.0, "ppl_ratio": 10.0}}}}
    (tmp_path / "eval.json").write_text(json.dumps(evaluation))
    export_hf(blr_student, tmp_path / "hf", "bfloat16", tmp_path / "eval.json")
    hf = tmp_path / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config  # the key today's transformers writes
    assert AutoConfig.from_pretrained(hf).eos_token_id == GenerationConfig.from_pretrained(hf).eos_token_id == 2
    card = (hf / "README.md").read_text()
    assert "2.0 bpw" in card and "| python-docs | 12.00 | 120.00 | 10.00× |" in card and "tiny_hf" in card
    umask = os.umask(0)
    os.umask(umask)
    assert {f.name: f.stat().st_mode & 0o777 for f in hf.iterdir()} == {f.name: 0o666 & ~umask for f in hf.iterdir()}


def test_an_eval_json_that_is_not_one_is_one_line(blr_student, tmp_path, capsys):
    from nvg.export_hf import cli
    from tests.conftest import fails_cleanly

    (tmp_path / "eval.json").write_text('{"heldout": {}}')
    fails_cleanly(cli, [blr_student, tmp_path / "hf", "--eval", tmp_path / "eval.json"], capsys, "eval.json",
                  "not an eval.json of nvg evaluate", [tmp_path / "hf"])


@pytest.mark.parametrize("packed", [False, True])
def test_uneven_mlp_widths_are_padded_exactly(blr_student, tmp_path, packed):
    cmf = read_cmf(blr_student)
    keep = np.arange(0, 128, 2)  # layer 0 keeps 64 of 128 neurons, layer 1 all 128
    tensors = [cut_tensor(t, keep, rows=".down_proj" not in n) if n.startswith("model.layers.0.mlp.") else t
               for n, t in cmf.tensors.items()]
    write_cmf(tmp_path / "cut.cmf", cmf.header, tensors, cmf.vocab)
    export_hf(tmp_path / "cut.cmf", tmp_path / "hf", packed=packed)
    ids = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        ours = load_model(tmp_path / "cut.cmf")(ids)
    assert (ours - hf_logits(tmp_path / "hf", ids)).abs().max().item() <= 1e-4


def test_a_packed_folder_loads_as_the_blr_student_with_its_logits_and_size(blr_student, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from nvg.hf_quantizer import BlrLinear

    export_hf(blr_student, tmp_path / "packed", packed=True)
    export_hf(blr_student, tmp_path / "dense")
    quant = json.loads((tmp_path / "packed" / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "nvg" and quant["format"] == "blr"
    from nvg.blr import parse_header

    cmf = read_cmf(blr_student)
    for module, shape in quant["linears"].items():  # each the CMF payload's own paths and rank
        head = parse_header(bytes(cmf.tensors[f"{module}.weight"].data))
        assert shape == {"paths": head.paths, "rank": head.rank}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "packed", dtype=torch.float32).eval()
    assert sum(isinstance(m, BlrLinear) for m in model.modules()) == len(quant["linears"]) == 14
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        ours, theirs = load_model(blr_student)(ids), model(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    # the signs stay bits: every BLR module's payload is stored at the CMF's size, not as a dense weight
    from safetensors import safe_open

    with safe_open(str(tmp_path / "packed" / "model.safetensors"), "pt") as f:
        for module in quant["linears"]:
            stored = sum(f.get_tensor(f"{module}.{p}").numel() * f.get_tensor(f"{module}.{p}").element_size()
                         for p in ("h", "ell", "g", "u_bits", "v_bits"))
            assert stored == len(cmf.tensors[f"{module}.weight"].data) - 16  # all but the 16-byte BLR header
            assert f"{module}.weight" not in f.keys()
    # transformers saves it again as it loaded it
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, theirs)


def test_a_packed_folder_of_another_format_version_is_refused(blr_student, tmp_path):
    import json

    import nvg.hf_quantizer  # noqa: F401
    from transformers import AutoModelForCausalLM

    export_hf(blr_student, tmp_path / "packed", packed=True)
    config = json.loads((tmp_path / "packed" / "config.json").read_text())
    config["quantization_config"]["version"] = 2
    (tmp_path / "packed" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="nvg format 'blr' version 2 is not 'blr' 1"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
