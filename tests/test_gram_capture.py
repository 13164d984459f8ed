"""Stage gram_capture: the Grams are Σ x xᵀ of each linear's real input over disjoint FIT and SEL windows."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_head_contexts_are_each_tokens_probability_weighted_mean_hidden_state(tiny_stages, tiny_cmf, tmp_path, capsys):
    """`grams.head_contexts` N: over the first N training windows, m_j = Σ_t p_tj h_t / Σ_t p_tj with p_t the model's
    next-token distribution and h_t its final-normed hidden state, the mass Σ_t p_tj and mean ‖h_t‖², computed here
    in float64 from the file alone; more windows than the training windows is one line; without the setting the
    file has none, and reading them names the setting."""
    import torch

    from nvg.artifacts import read_head_contexts
    from nvg.model import load_model
    from nvg.settings import load

    out = tmp_path / "grams.h5"
    gram_capture.main(tiny_cmf, tiny_stages / "windows.h5", out, load(gram_capture.GramSettings, head_contexts=20, device="cpu"))
    tokens, _ = read_windows(tiny_stages / "windows.h5")
    model = load_model(tiny_cmf)
    with torch.no_grad():
        h = model.hidden(torch.from_numpy(tokens[:20])).double().reshape(-1, model.cfg.hidden_size)
        p = torch.softmax(h @ model.head_weight.double().T, -1)
    vocab, hidden = model.head_weight.shape
    c = read_head_contexts(out, vocab, hidden)
    assert c.tokens == 20 * 32 and c.mean_square == pytest.approx(float((h ** 2).sum(1).mean()), rel=1e-5)
    np.testing.assert_allclose(c.mass, p.sum(0).numpy(), rtol=1e-4)
    np.testing.assert_allclose(c.means, ((p.T @ h) / p.sum(0)[:, None]).numpy(), rtol=1e-3, atol=1e-4)
    assert np.array_equal(read_grams(out, 0, "attn_in")[0], read_grams(tiny_stages / "grams.h5", 0, "attn_in")[0])

    from nvg.errors import NvgError

    with pytest.raises(NvgError, match="no head_contexts .* set grams.head_contexts"):
        read_head_contexts(tiny_stages / "grams.h5", vocab, hidden)
    with pytest.raises(NvgError, match=r"head_contexts/means is \(\d+, 64\) and mass \(\d+,\), not the model's \(7, 64\)"):
        read_head_contexts(out, 7, hidden)
    fails_cleanly(gram_capture.cli, ["--model", tiny_cmf, "--windows", tiny_stages / "windows.h5", "--out", tmp_path / "g2.h5",
                                     "--settings", '{"head_contexts": 49}'],
                  capsys, "config grams", "head_contexts = 49 exceeds the 48 training windows", [tmp_path / "g2.h5"])
