"""Stage generate_corpus: the teacher's own text, LLM-QAT style, decoded with a static KV cache."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from nvg import generate_corpus, tokenize_windows
from nvg.artifacts import read_windows
from nvg.cmf import read_cmf
from nvg.decoding import Decoder, gumbel_argmax, sample
from nvg.generate_corpus import CorpusSettings
from nvg.model import load_model
from nvg.settings import load
from nvg.tokenizer import cmf_tokenizer
from tests.conftest import fails_cleanly


def test_cached_decoding_equals_the_full_forward(tiny_cmf, monkeypatch):
    """Greedy decoding through the KV cache picks, at every step, the argmax of a full forward over the
    prefix, also when attention reads the cache in buckets (of 8 here)."""
    from nvg import decoding

    monkeypatch.setattr(decoding, "KV_BUCKET", 8)
    model = load_model(tiny_cmf)
    decoder = Decoder(model, 3, 24, torch.device("cpu"), "fp32")
    tok, seq = torch.tensor([5, 17, 40]), [torch.tensor([5, 17, 40])]
    for t in range(23):
        tok = decoder.next_ids(tok, t, greedy=True)
        seq.append(tok)
    seq = torch.stack(seq, 1)
    with torch.no_grad():
        full = load_model(tiny_cmf)(seq[:, :-1])
    assert torch.equal(full.argmax(-1), seq[:, 1:])


def test_cached_attention_equals_sdpa_under_the_cache_mask():
    """The decoder's attention (two GEMMs and a softmax, for one order of addition on the GPU) is SDPA's
    arithmetic: SmolLM2's shape (9 query heads on 3 K/V heads), three new tokens against a cache of ten."""
    from nvg.model import cached_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, t, 64, generator=gen) for h, t in ((9, 3), (3, 10), (3, 10)))
    pos = torch.tensor([4, 5, 6])
    visible = torch.arange(10)[None, :] <= pos[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    torch.testing.assert_close(cached_attention(q, k, v, pos), expected)


def test_sampling_restrictions():
    torch.manual_seed(0)
    logits = torch.randn(64, 300)
    best = logits.argmax(-1)
    assert torch.equal(sample(logits, 0.0, 0, 1.0), best)
    assert torch.equal(sample(logits, 1.0, 1, 1.0), best)  # top-k 1
    assert torch.equal(sample(logits, 1.0, 0, 1e-6), best)  # top-p below the best id's mass
    in_top5 = sample(logits, 1.0, 5, 1.0)
    assert (logits.gather(-1, in_top5[:, None]) >= logits.topk(5, -1).values[:, -1:]).all()
    for temperature in (1.0, 0.5):  # Gumbel-max follows softmax(logits / T)
        draws = torch.stack([gumbel_argmax(logits[:1], temperature) for _ in range(4000)])
        freq = torch.bincount(draws[:, 0], minlength=300).float() / 4000
        assert (freq - (logits[0] / temperature).softmax(-1)).abs().max() < 0.04


def test_the_decoder_draws_inside_top_k_and_top_p(tiny_cmf):
    """The decoding step applies top-k / top-p itself (in its compiled graph on CUDA): top-k 1, or a top-p
    below any token's mass, decodes exactly as greedy does at every position."""
    def decode(greedy=False, **draw):
        decoder, ids, out = Decoder(load_model(tiny_cmf), 6, 24, torch.device("cpu"), "fp32", **draw), torch.arange(6) + 5, []
        for pos in range(23):
            ids = decoder.next_ids(ids, pos, greedy=greedy)
            out.append(ids)
        return torch.stack(out, 1)

    greedy = decode(greedy=True)
    torch.manual_seed(0)
    assert torch.equal(decode(temperature=1.0, top_k=1), greedy)
    assert torch.equal(decode(temperature=1.0, top_p=1e-6), greedy)
    assert not torch.equal(decode(temperature=1.0, top_k=50), greedy)  # a wider top-k does sample


def test_the_decoders_blocks_compile_once_over_four_cache_buckets(tiny_cmf, monkeypatch):
    """The decoder compiles a block, not the whole step (regional compilation: the whole step's compile took
    about 70 s of each corpus shard on the GPU). The tiny model's two blocks share one graph, and the cache length
    is symbolic in it from the first bucket on (a dynamic tensor size, not an int), so one compile serves every
    bucket, the last (the whole cache) included. Counted with dynamo alone (a backend that runs the traced graph),
    on the CPU: one graph, holding one block's two cache writes (keys and values)."""
    import nvg.decoding

    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(nvg.decoding, "KV_BUCKET", 64)
    decoder = Decoder(load_model(tiny_cmf), 4, 256, torch.device("cpu"), "fp32", backend=count)
    ids = torch.arange(4) + 5
    for pos in range(255):  # cache lengths 64, 128, 192 and 256
        ids = decoder.next_ids(ids, pos, greedy=pos < 3)
    torch.compiler.reset()
    assert len(graphs) == 1
    cache_writes = [n for n in graphs[0].graph.nodes if "index_copy" in str(n.target)]
    assert len(cache_writes) == 2, graphs[0].graph


@pytest.fixture(scope="module")
def corpus(tiny_cmf, tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    s = load(CorpusSettings, sequences=12, length=40, shards=2, batch=4, greedy_prefix=3)
    for shard in range(2):
        generate_corpus.main(tiny_cmf, shard, d / f"generated.{shard}.h5", s)
    return d, s


def test_shards_hold_llm_qat_sequences(corpus, tiny_cmf, capsys):
    d, s = corpus
    parts = [h5py.File(d / f"generated.{i}.h5", "r")["tokens"][...] for i in range(2)]
    tokens = np.concatenate(parts)
    assert [len(p) for p in parts] == [6, 6] and tokens.shape == (12, 40)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(read_cmf(tiny_cmf).vocab.decode())
    special = set(tok.get_added_tokens_decoder())
    firsts = tokens[:, 0]
    assert len(set(firsts.tolist())) == 12 and not special & set(firsts.tolist())  # a walk over the vocabulary
    assert np.array_equal(firsts, generate_corpus.first_tokens(cmf_tokenizer(read_cmf(tiny_cmf), tiny_cmf, "test"), 300, s))
    model = load_model(tiny_cmf)
    with torch.no_grad():  # the greedy prefix: argmax continuations of the first token
        logits = model(torch.from_numpy(tokens[:, :4]).long())
    assert np.array_equal(logits[:, :3].argmax(-1).numpy(), tokens[:, 1:4])
    with h5py.File(d / "generated.1.h5", "r") as f:
        assert json.loads(f.attrs["settings"])["length"] == 40 and int(f.attrs["shard"]) == 1
    again = d / "again.h5"
    capsys.readouterr()
    generate_corpus.main(tiny_cmf, 1, again, s)  # seeded: the same shard twice is the same text
    assert np.array_equal(h5py.File(again, "r")["tokens"][...], parts[1])
    with h5py.File(d / "generated.1.h5", "r") as f:  # and the log names its digest, to compare runs by
        assert f"tokens blake2b {f.attrs['tokens_blake2b']} " in capsys.readouterr().err


def test_tokenize_windows_cuts_generated_sequences_into_windows(corpus, tiny_cmf, tiny_corpus, tmp_path, capsys):
    d, _ = corpus
    shards = [d / "generated.0.h5", d / "generated.1.h5"]
    generated = np.concatenate([h5py.File(p, "r")["tokens"][...] for p in shards])
    out = tmp_path / "w.h5"
    settings = load(tokenize_windows.WindowSettings, sources=[{"path": "generated"}], tokens=320, window=16, eval_windows=2)
    tokenize_windows.main(tiny_cmf, out, settings, shards)
    windows, attrs = read_windows(out)
    assert windows.shape == (22, 16)
    expected = {tuple(w) for w in generated[:, :32].reshape(-1, 16)[:22]}  # two windows per 40-token sequence
    assert {tuple(w) for w in windows} == expected
    # sequences shorter than a window are packed end to end: a 64-token window holds one and a half of them
    settings = load(tokenize_windows.WindowSettings, sources=[{"path": "generated"}], tokens=384, window=64, eval_windows=1)
    tokenize_windows.main(tiny_cmf, out, settings, shards)
    windows, _ = read_windows(out)
    assert {tuple(w) for w in windows} == {tuple(w) for w in generated.reshape(-1)[: 7 * 64].reshape(7, 64)}
    # a corpus written by another teacher is refused, naming the shard
    other = tmp_path / "other.h5"
    shutil.copy(shards[0], other)
    with h5py.File(other, "r+") as f:
        f.attrs["teacher_hash"] = "0000000000000000"
    args = lambda *shards: ["--teacher", tiny_cmf, "--out", tmp_path / "x.h5", "--generated", *shards,  # noqa: E731
                            "--settings", json.dumps({"sources": [{"path": "generated"}], "window": 16})]
    fails_cleanly(tokenize_windows.cli, args(other), capsys, str(other), "is not this teacher's", [tmp_path / "x.h5"])
    # shards given out of order, and a shard whose tokens are not those its digest names, are refused too
    fails_cleanly(tokenize_windows.cli, args(shards[1], shards[0]), capsys, str(shards[1]), "shard 1 given as shard 0",
                  [tmp_path / "x.h5"])
    edited = tmp_path / "edited.h5"
    shutil.copy(shards[0], edited)
    with h5py.File(edited, "r+") as f:
        f["tokens"][0, 5] = (f["tokens"][0, 5] + 1) % 300
    fails_cleanly(tokenize_windows.cli, args(edited), capsys, str(edited), "does not match its tokens", [tmp_path / "x.h5"])


def test_a_chat_opening_conditions_the_text_and_is_not_written(tiny_cmf, tmp_path, capsys):
    """With `chat`, the teacher reads its template up to a user's words (Magpie) before the first token:
    the greedy prefix is then the argmax after opening + first token, and only the `length` tokens from
    the first token on are written. A teacher without a template is refused, naming the setting."""
    from nvg.cmf import write_cmf

    s = load(CorpusSettings, sequences=4, length=24, batch=4, greedy_prefix=3, chat=True)
    out = tmp_path / "chat.h5"
    generate_corpus.main(tiny_cmf, 0, out, s)
    tokens = h5py.File(out, "r")["tokens"][...]
    cmf = read_cmf(tiny_cmf)
    opening = generate_corpus.chat_opening(cmf, cmf_tokenizer(cmf, tiny_cmf, "test"), tiny_cmf)
    tok = Tokenizer.from_str(cmf.vocab.decode())
    assert tok.decode(opening, skip_special_tokens=False) == "<|im_start|>user\n"
    assert tok.token_to_id("<|im_start|>") in opening  # the special token's own id, not its characters
    assert tokens.shape == (4, 24) and np.array_equal(tokens[:, 0], generate_corpus.first_tokens(cmf_tokenizer(cmf, tiny_cmf, "test"), 300, s))
    with torch.no_grad():
        context = torch.cat([torch.tensor(opening).expand(4, -1), torch.from_numpy(tokens[:, :4]).long()], 1)
        after_opening = load_model(tiny_cmf)(context)[:, len(opening):]
    assert np.array_equal(after_opening[:, :3].argmax(-1).numpy(), tokens[:, 1:4])
    plain = tmp_path / "plain.h5"
    generate_corpus.main(tiny_cmf, 0, plain, load(CorpusSettings, sequences=4, length=24, batch=4, greedy_prefix=3))
    assert not np.array_equal(h5py.File(plain, "r")["tokens"][...], tokens)  # the opening changed what the teacher wrote
    no_template = {k: v for k, v in cmf.header["tokenizer_config"].items() if k != "chat_template"}
    header = {**cmf.header, "tokenizer_config": no_template}
    write_cmf(tmp_path / "base.cmf", header, list(cmf.tensors.values()), cmf.vocab)
    fails_cleanly(generate_corpus.cli, ["--teacher", tmp_path / "base.cmf", "--shard", 0, "--out", tmp_path / "x.h5",
                                        "--settings", json.dumps({"chat": True})],
                  capsys, "generate_corpus.chat", "has no chat_template", [tmp_path / "x.h5"])


def test_prompts_open_each_sequence_with_real_text_the_teacher_continues(tiny_cmf, tiny_corpus, tmp_path, capsys):
    """With `prompts`, every sequence opens with `prompt_tokens` consecutive tokens of that text from a seeded
    place (the same places in every shard split), then `greedy_prefix` argmax continuations of the whole prompt,
    then draws. A source shorter than a prompt, and a prompt as long as the sequence, are refused by name."""
    story = tiny_corpus / "story.txt"
    s = load(CorpusSettings, sequences=6, length=24, batch=4, greedy_prefix=3, prompts=str(story), prompt_tokens=8)
    cmf = read_cmf(tiny_cmf)
    text = cmf_tokenizer(cmf, tiny_cmf, "test").encode(story.read_text(), add_special_tokens=False).ids
    shards = []
    for shard in range(2):
        generate_corpus.main(tiny_cmf, shard, tmp_path / f"p.{shard}.h5", load(CorpusSettings, **{**s.__dict__, "shards": 2}))
        shards.append(h5py.File(tmp_path / f"p.{shard}.h5", "r")["tokens"][...])
    tokens = np.concatenate(shards)
    whole = tmp_path / "whole.h5"
    generate_corpus.main(tiny_cmf, 0, whole, s)
    assert np.array_equal(h5py.File(whole, "r")["tokens"][:, :8], tokens[:, :8])  # the places do not depend on shards
    joined = " ".join(map(str, text))
    for row in tokens:
        assert " ".join(map(str, row[:8])) in joined  # a run of the text's own tokens
    assert len({tuple(r[:8]) for r in tokens}) == 6
    with torch.no_grad():  # the greedy prefix continues the prompt
        logits = load_model(tiny_cmf)(torch.from_numpy(tokens[:, :11]).long())
    assert np.array_equal(logits[:, 7:10].argmax(-1).numpy(), tokens[:, 8:11])
    short = tmp_path / "short.txt"
    short.write_text("A few words.")
    fails_cleanly(generate_corpus.cli, ["--teacher", tiny_cmf, "--shard", 0, "--out", tmp_path / "x.h5", "--settings",
                                        json.dumps({"prompts": str(short), "prompt_tokens": 64})],
                  capsys, "generate_corpus.prompts", "fewer than prompt_tokens 64", [tmp_path / "x.h5"])
    fails_cleanly(generate_corpus.cli, ["--teacher", tiny_cmf, "--shard", 0, "--out", tmp_path / "x.h5", "--settings",
                                        json.dumps({"prompts": str(story), "prompt_tokens": 24, "length": 24})],
                  capsys, "generate_corpus.prompt_tokens", "leaves nothing", [tmp_path / "x.h5"])
