"""export-hf: transformers loads the dense folder with the same logits as nvg's BLR model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvg.budget_reencode import EncodeSettings, main as encode
from nvg.cmf import read_cmf, write_cmf
from nvg.dtgma_cut import cut_tensor
from nvg.export_hf import main as export_hf
from nvg.gram_capture import GramSettings, main as capture
from nvg.model import load_model
from nvg.tokenize_windows import WindowSettings, main as make_windows


@pytest.fixture(scope="module")
def blr_student(tiny_cmf, tiny_corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    make_windows(tiny_cmf, d / "w.h5", WindowSettings(sources=[{"path": str(tiny_corpus / "story.txt")}],
                                                      tokens=1024, window=32, eval_windows=4))
    capture(tiny_cmf, d / "w.h5", d / "g.h5", GramSettings(fit_windows=16, sel_windows=8))
    encode(tiny_cmf, d / "g.h5", d / "s.cmf", d / "s.json", EncodeSettings(bpw=2.0, device="cpu"))
    return d / "s.cmf"


def hf_logits(folder, ids):
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


def test_uneven_mlp_widths_are_padded_exactly(blr_student, tmp_path):
    cmf = read_cmf(blr_student)
    keep = np.arange(0, 128, 2)  # layer 0 keeps 64 of 128 neurons, layer 1 all 128
    tensors = [cut_tensor(t, keep, rows=".down_proj" not in n) if n.startswith("model.layers.0.mlp.") else t
               for n, t in cmf.tensors.items()]
    write_cmf(tmp_path / "cut.cmf", cmf.header, tensors, cmf.vocab)
    export_hf(tmp_path / "cut.cmf", tmp_path / "hf")
    ids = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        ours = load_model(tmp_path / "cut.cmf")(ids)
    assert (ours - hf_logits(tmp_path / "hf", ids)).abs().max().item() <= 1e-4
