"""Stage gram_capture: the Grams are Σ x xᵀ of each linear's real input over disjoint FIT and SEL windows."""

from __future__ import annotations

import numpy as np

from nvg import gram_capture
from nvg.artifacts import read_grams, read_windows
from nvg.cmf import read_cmf, tensor_to_numpy
from tests.conftest import fails_cleanly


def test_layer0_attention_gram_equals_the_normed_embeddings(tiny_stages, tiny_cmf):
    """Layer 0's attn_in is RMSNorm(embedding) · gain: computed here in float64 from the file alone."""
    cmf = read_cmf(tiny_cmf)
    tokens, _ = read_windows(tiny_stages / "windows.h5")
    embed = tensor_to_numpy(cmf.tensors["model.embed_tokens.weight"]).astype(np.float64)
    gain = tensor_to_numpy(cmf.tensors["model.layers.0.input_layernorm.weight"]).astype(np.float64)
    h_fit, h_sel, count_fit, count_sel = read_grams(tiny_stages / "grams.h5", 0, "attn_in")

    def gram(rows):
        x = embed[tokens[rows].reshape(-1)]
        x = x / np.sqrt((x * x).mean(-1, keepdims=True) + cmf.arch["rms_norm_eps"]) * gain
        return x.T @ x

    assert (count_fit, count_sel) == (16 * 32, 8 * 32)
    np.testing.assert_allclose(h_fit, gram(slice(0, 16)), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(h_sel, gram(slice(16, 24)), rtol=1e-4, atol=1e-3)  # the next 8: disjoint
    for layer in range(cmf.arch["num_layers"]):
        for name in ("attn_in", "attn_out", "mlp_in", "mlp_down"):
            h = read_grams(tiny_stages / "grams.h5", layer, name)[0]
            assert np.allclose(h, h.T) and (np.linalg.eigvalsh(h.astype(np.float64)) > -1e-3 * np.trace(h)).all()


def test_the_head_input_gram_is_that_of_the_final_hidden_states(tiny_stages, tiny_cmf):
    """`head_in`, one per model: Σ hᵀh of the final-normed hidden states the LM head multiplies."""
    import torch

    from nvg.artifacts import HEAD_INPUT
    from nvg.model import load_model

    tokens, _ = read_windows(tiny_stages / "windows.h5")
    with torch.no_grad():
        h = load_model(tiny_cmf).hidden(torch.from_numpy(tokens[:16])).double().reshape(-1, read_cmf(tiny_cmf).arch["hidden_size"])
    h_fit, _, count_fit, _ = read_grams(tiny_stages / "grams.h5", *HEAD_INPUT)
    assert count_fit == 16 * 32
    np.testing.assert_allclose(h_fit, (h.T @ h).numpy(), rtol=1e-4, atol=1e-3)


def test_more_fit_and_sel_windows_than_training_windows_is_one_line(tiny_stages, tiny_cmf, tmp_path, capsys):
    out = tmp_path / "grams.h5"
    fails_cleanly(gram_capture.cli, ["--model", tiny_cmf, "--windows", tiny_stages / "windows.h5", "--out", out,
                                     "--settings", '{"fit_windows": 40, "sel_windows": 20}'],
                  capsys, "config grams", "exceeds the 48 training windows", [out])
