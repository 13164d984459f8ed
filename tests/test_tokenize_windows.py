"""Calibration windows: every source kind, weights, chat rendering, determinism, hold-out, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from nvg.cmf import read_cmf
from nvg.errors import NvgError
from nvg.artifacts import read_windows
from nvg.sources import source_tokens, split_budget
from nvg.tokenize_windows import WindowSettings, main, source_windows
from nvg.tokenizer import cmf_tokenizer
from nvg.settings import load


def run(tiny_cmf, tmp_path, name="w.h5", **kw):
    settings = load(WindowSettings, **{"tokens": 1024, "window": 32, "eval_windows": 4, **kw})
    main(tiny_cmf, tmp_path / name, settings)
    return read_windows(tmp_path / name)


def test_sources_weights_holdout_and_determinism(tiny_cmf, tiny_corpus, tmp_path):
    sources = [{"path": str(tiny_corpus / "story.txt"), "weight": 3.0}, {"path": str(tiny_corpus / "chat.jsonl"), "weight": 1.0}]
    tokens, attrs = run(tiny_cmf, tmp_path, sources=sources)
    assert tokens.dtype == np.int32 and tokens.shape[1] == 32
    assert attrs["n_eval"] == 4 and attrs["n_train"] == len(tokens) - 4
    assert json.loads(attrs["sources"]) == sources
    again, _ = run(tiny_cmf, tmp_path, "again.h5", sources=sources)
    np.testing.assert_array_equal(tokens, again)
    other, _ = run(tiny_cmf, tmp_path, "other.h5", sources=sources, seed=99)
    assert not np.array_equal(tokens, other)
    # chat messages are rendered with the teacher's template: <|im_start|> gets its real special id
    tok = Tokenizer.from_str(read_cmf(tiny_cmf).vocab.decode())
    start = tok.token_to_id("<|im_start|>")
    windows_with_chat = sum(start in row for row in tokens)
    assert 0 < windows_with_chat < len(tokens)


def test_a_source_shorter_than_its_share_is_taken_once_and_said(tiny_cmf, tiny_corpus, tmp_path, capsys):
    story = tiny_corpus / "story.txt"
    (tmp_path / "short.txt").write_text(story.read_text()[:600])
    tok = cmf_tokenizer(read_cmf(tiny_cmf), tiny_cmf, "tokenize with")
    short = len(source_tokens(str(tmp_path / "short.txt"), 10**9, tok, None)) // 32
    tokens, _ = run(tiny_cmf, tmp_path, sources=[{"path": str(story)}, {"path": str(tmp_path / "short.txt"), "weight": 3.0}])
    assert len(tokens) == (1024 + 4 * 32) // 4 // 32 + short  # the story's quarter, and every short window once
    assert f"short.txt: all of it, {short * 32} tokens, short of its 864-token share" in capsys.readouterr().out


def test_a_short_source_with_repeat_fills_its_share_with_copies_of_its_training_windows(tiny_cmf, tiny_corpus, tmp_path):
    """`repeat: r` upsamples a short source (the GPU recipe's 16.7M tokens against 798k of real manuals): its
    training windows come back up to r times each, its held-out ones never, so no held-out window is trained on."""
    from collections import Counter

    from nvg.artifacts import read_window_origins

    story = tiny_corpus / "story.txt"
    (tmp_path / "short.txt").write_text(story.read_text()[:600])
    sources = [{"path": str(story)}, {"path": str(tmp_path / "short.txt"), "weight": 3.0, "repeat": 3}]
    once, _ = run(tiny_cmf, tmp_path, "once.h5", sources=[{**s, "repeat": 1} for s in sources])
    tokens, attrs = run(tiny_cmf, tmp_path, sources=sources)
    origin = read_window_origins(tmp_path / "w.h5", len(tokens), 2)
    n_train = int(attrs["n_train"])
    assert len(tokens) - n_train == 4 == attrs["n_eval"]
    short_once = int((read_window_origins(tmp_path / "once.h5", len(once), 2) == 1).sum())
    counts = Counter(row.tobytes() for row, src in zip(tokens[:n_train], origin[:n_train]) if src == 1)
    held = {row.tobytes() for row in tokens[n_train:]}
    assert max(counts.values()) == 3 and not held & set(counts)  # copies of training windows only
    # the share (864 tokens: 27 windows) is filled, or every training window is there three times
    assert (origin == 1).sum() == min(27, short_once + 2 * len(counts))
    again, _ = run(tiny_cmf, tmp_path, "again.h5", sources=sources)
    np.testing.assert_array_equal(tokens, again)


def test_each_window_keeps_its_source_through_the_shuffle(tiny_cmf, tiny_corpus, tmp_path):
    """`origin` names each window's source, so that evaluate can score a mix's held-out windows apart."""
    from nvg.artifacts import read_window_origins

    story, chat = str(tiny_corpus / "story.txt"), str(tiny_corpus / "chat.jsonl")
    tokens, attrs = run(tiny_cmf, tmp_path, sources=[{"path": story, "weight": 3.0}, {"path": chat, "weight": 1.0}])
    origin = read_window_origins(tmp_path / "w.h5", len(tokens), 2)
    tok = cmf_tokenizer(read_cmf(tiny_cmf), tiny_cmf, "tokenize with")
    story_ids = source_tokens(story, 10**9, tok, None)
    story_windows = {story_ids[i : i + 32].tobytes() for i in range(0, len(story_ids) - 31, 32)}
    for row, src in zip(tokens, origin):
        assert (row.astype(story_ids.dtype).tobytes() in story_windows) == (src == 0)
    assert 0 < origin.mean() < 0.5  # both sources, the story three times the chat's share
    with pytest.raises(NvgError, match="must give each of the"):
        read_window_origins(tmp_path / "w.h5", len(tokens), 1)
    with pytest.raises(NvgError, match="is listed twice"):
        run(tiny_cmf, tmp_path, "twice.h5", sources=[{"path": story}, {"path": story, "weight": 2.0}])
    assert not (tmp_path / "twice.h5").exists()


def test_budget_split_follows_weights():
    assert split_budget([3.0, 1.0], 1000) == [750, 250]
    assert sum(split_budget([1.0, 1.0, 1.0], 1000)) == 1000


def test_folder_json_pairs_and_pkg_sources(tiny_cmf, tiny_corpus, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.md").write_text((tiny_corpus / "story.txt").read_text()[:3000])
    (folder / "pairs.json").write_text(json.dumps([["a prompt", "an answer " * 50]] * 5))
    (folder / "skip.bin").write_bytes(b"\0" * 10)
    tokens, _ = run(tiny_cmf, tmp_path, sources=[{"path": str(folder)}], tokens=256, window=16)
    assert len(tokens) > 4
    pkg, _ = run(tiny_cmf, tmp_path, "pkg.h5", sources=[{"path": "pkg:shksprdata/texts/hamlet_gut.txt"}], tokens=256)
    assert len(pkg) == 256 // 32 + 4
    docs, _ = run(tiny_cmf, tmp_path, "docs.h5", sources=[{"path": "python-docs"}], tokens=256)
    assert len(docs) == 256 // 32 + 4 and not np.array_equal(docs[:4], pkg[:4])


def test_gzipped_and_texinfo_sources_read_as_their_plain_text(tiny_cmf, tiny_corpus, tmp_path):
    """`/usr/share/info/*.gz` as a source: gzip is undone, a Texinfo part (`.info-2`) is text, a gzipped .jsonl is
    still parsed, an archive (`.tar.gz`) is not text, and a broken gzip file is one clear error."""
    import gzip

    tok = cmf_tokenizer(read_cmf(tiny_cmf), tiny_cmf, "tokenize with")
    story = (tiny_corpus / "story.txt").read_text()
    folder = tmp_path / "info"
    folder.mkdir()
    (folder / "story.info-2.gz").write_bytes(gzip.compress(story.encode()))
    (folder / "records.jsonl.gz").write_bytes(gzip.compress((json.dumps({"text": "a record"}) + "\n").encode()))
    (folder / "archive.tar.gz").write_bytes(gzip.compress(b"\0" * 512))
    plain = [*tok.encode("a record\n").ids, *source_tokens(str(tiny_corpus / "story.txt"), 10**9, tok, None)]
    got = source_tokens(str(folder / "*.gz"), 10**9, tok, None)  # a glob: records.jsonl.gz, then story.info-2.gz
    np.testing.assert_array_equal(got, plain)
    np.testing.assert_array_equal(source_tokens(str(folder), 10**9, tok, None), plain)  # a folder: the same two
    (folder / "broken.txt.gz").write_bytes(b"not gzip")
    with pytest.raises(NvgError, match="broken.txt.gz: not a readable gzip file"):
        source_tokens(str(folder / "broken.txt.gz"), 10**9, tok, None)


def test_a_source_longer_than_its_share_gives_a_seeded_draw_of_windows_from_across_it(tiny_cmf, tiny_corpus):
    """Not its first pages: a share of a folder of manuals once went to the first manual alone (session 37)."""
    tok = cmf_tokenizer(read_cmf(tiny_cmf), tiny_cmf, "tokenize with")
    story = str(tiny_corpus / "story.txt")
    ids = source_tokens(story, 10**9, tok, None)
    every = ids[: len(ids) // 32 * 32].reshape(-1, 32)
    assert len(every) > 40  # the draw below has many more windows than it keeps to choose from

    def rows(drawn):
        return [next(i for i, w in enumerate(every) if np.array_equal(w, d)) for d in drawn]

    drawn = rows(source_windows(story, 4 * 32, 32, tok, None, None, np.random.default_rng(7)))
    assert len(drawn) == 4 and drawn == sorted(drawn) and drawn != [0, 1, 2, 3] and max(drawn) >= len(every) // 2
    assert drawn == rows(source_windows(story, 4 * 32, 32, tok, None, None, np.random.default_rng(7)))
    assert drawn != rows(source_windows(story, 4 * 32, 32, tok, None, None, np.random.default_rng(8)))
    # a source within its share gives every window, in order
    whole = source_windows(story, len(ids) + 100, 32, tok, None, None, np.random.default_rng(7))
    np.testing.assert_array_equal(whole, every)


@pytest.mark.parametrize("kw, message", [
    ({"sources": [{"path": "/nonexistent/file.txt"}]}, "calibration source not found"),
    ({"sources": [{"path": "EMPTY"}]}, "not one 32-token window"),
    ({"sources": [{"path": "STORY"}], "window": 512}, "exceeds the teacher's max_position_embeddings 256"),
    ({"sources": [{"path": "STORY"}], "tokens": 16, "eval_windows": 4}, "too few windows"),
    ({"sources": [{"path": "BADJSONL"}]}, "line 1: needs a 'text' string"),
])
def test_bad_sources_are_one_clear_error(tiny_cmf, tiny_corpus, tmp_path, kw, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"title": "x"}) + "\n")
    names = {"EMPTY": tmp_path / "empty.txt", "STORY": tiny_corpus / "story.txt", "BADJSONL": tmp_path / "bad.jsonl"}
    kw["sources"] = [{"path": str(names.get(s["path"], s["path"]))} for s in kw["sources"]]
    with pytest.raises(NvgError, match=message):
        run(tiny_cmf, tmp_path, "bad.h5", **kw)
    assert not (tmp_path / "bad.h5").exists()


@pytest.mark.parametrize("text, message", [
    ('{"sources": [{"path": "a"}], "tokens": "many"}', "data.tokens: 'many' is not of type 'integer'"),
    ('{"sources": [{"path": "a"}], "window": 4}', "data.window: 4 is less than the minimum of 8"),
    ('{"sources": [], "tokens": 10}', r"data.sources: \[\] should be non-empty"),
    ('{"sources": [{"path": "a", "weight": 0}]}', "data.sources.0.weight: 0 is less than or equal to the minimum of 0"),
    ('{"sources": [{"path": "a", "repeat": 0}]}', "data.sources.0.repeat: 0 is less than the minimum of 1"),
    ('{"sources": [{"path": "a"}], "windw": 4}', "data.windw: unknown key"),
])
def test_settings_are_validated_with_the_key_named(text, message):
    with pytest.raises(NvgError, match=message):
        load(WindowSettings, text)


def test_chat_records_render_through_the_tokenizers_own_template_with_bos_and_eos(tiny_cmf, tmp_path):
    """A Llama-3-style template that names `bos_token` and `eos_token` (the old hand-rolled renderer
    gave both as empty strings): the tokens appear, as transformers renders them."""
    from nvg.cmf import write_cmf
    from nvg.sources import ChatRenderer

    cmf = read_cmf(tiny_cmf)
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    header = {**cmf.header, "tokenizer_config": {**cmf.header["tokenizer_config"], "chat_template": template}}
    write_cmf(tmp_path / "llama3.cmf", header, list(cmf.tensors.values()), cmf.vocab)
    render = ChatRenderer(read_cmf(tmp_path / "llama3.cmf"), "chat.jsonl")
    assert render([{"role": "user", "content": "hi"}]) == "<|im_start|>user: hi<|im_end|>"
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "the cat sat " * 40}]}) + "\n")
    main(tmp_path / "llama3.cmf", tmp_path / "w.h5", load(WindowSettings, sources=[{"path": str(tmp_path / "chat.jsonl")}],
                                                           tokens=256, window=32, eval_windows=1))
    tokens, _ = read_windows(tmp_path / "w.h5")
    bos = Tokenizer.from_str(cmf.vocab.decode("utf-8")).token_to_id("<|im_start|>")
    assert bos in tokens  # the special token's own id, not its characters
