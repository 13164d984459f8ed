"""nvg generate: greedy text from a CMF, the chat template applied on request."""

from __future__ import annotations

import pytest
import torch

from nvg.generate import generate, main
from nvg.model import load_model


def test_greedy_generation_matches_argmax_of_a_full_forward(tiny_cmf):
    model = load_model(tiny_cmf)
    prompt = [5, 17, 42, 7]
    new = generate(model, prompt, 6, 0.0, set(), 0, torch.device("cpu"))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert new == ids[len(prompt):]


def test_sampling_is_seeded_and_chat_uses_the_template(tiny_cmf):
    a = main(tiny_cmf, "the king", max_new_tokens=8, temperature=1.0, seed=3)
    b = main(tiny_cmf, "the king", max_new_tokens=8, temperature=1.0, seed=3)
    assert a == b and isinstance(a, str)
    from tokenizers import Tokenizer

    from nvg.cmf import read_cmf
    from nvg.generate import prompt_ids

    cmf = read_cmf(tiny_cmf)
    tok = Tokenizer.from_str(cmf.vocab.decode())
    chat = prompt_ids(cmf, tok, "the king", chat=True)
    assert chat[0] == tok.token_to_id("<|im_start|>") and tok.token_to_id("<|im_end|>") in chat
    assert prompt_ids(cmf, tok, "the king", chat=False) == tok.encode("the king", add_special_tokens=False).ids


@pytest.mark.slow
def test_real_teacher_continues_a_story(real_teacher_cmf):
    text = main(real_teacher_cmf, "Once upon a time, there was a little girl who", max_new_tokens=8)
    assert text.startswith(" loved to play")


def test_a_cuda_device_without_a_gpu_is_one_line(tiny_cmf, capsys, monkeypatch):
    import torch

    from nvg.generate import cli
    from tests.conftest import fails_cleanly

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails_cleanly(cli, [tiny_cmf, "Once", "--device", "cuda"], capsys, "device 'cuda'", "sees no CUDA GPU", [])


def test_the_command_echoes_a_plain_prompt_and_reports_its_speed(tiny_cmf, capsys):
    from nvg.generate import cli, main

    cli([str(tiny_cmf), "Once upon", "--max-new-tokens", "5"])
    out, err = capsys.readouterr()
    assert out == "Once upon" + main(tiny_cmf, "Once upon", 5) + "\n"
    assert "new tokens in" in err and "tok/s) on " in err
