"""The teacher pass: chunked top-k equals the full softmax; shards cover every window exactly once."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from nvg.losses import topk_kl, topk_last, topk_logprobs
from nvg.artifacts import read_topk, read_windows
from nvg.teacher_topk import TopkSettings, cli, main
from nvg.tokenize_windows import WindowSettings, main as make_windows
from nvg.settings import load
from tests.conftest import fails_cleanly


def test_chunked_topk_equals_full_log_softmax():
    torch.manual_seed(0)
    hidden, head = torch.randn(2, 7, 16), torch.randn(50, 16)
    ids, logp = topk_logprobs(hidden, head, k=5, chunk=3)
    full = torch.log_softmax(hidden @ head.T, -1)
    want_logp, want_ids = full.topk(5, -1)
    torch.testing.assert_close(logp, want_logp)
    assert torch.equal(ids.long(), want_ids)


@pytest.mark.parametrize("vocab", [49152, 40000, 300])
def test_two_stage_topk_equals_torch_topk(vocab):
    """Block maxima first, then the winners' blocks: same values and ids as a full sort (40000 is not a
    multiple of the block, 300 too small to use blocks)."""
    z = torch.randn(64, vocab, generator=torch.Generator().manual_seed(vocab))
    z[0, :] = torch.linspace(-1, 1, vocab)  # all winners in the last blocks
    z[1, ::997] += 10.0  # winners spread one per block
    vals, ids = topk_last(z, 64 if vocab > 300 else 5)
    want_vals, want_ids = z.topk(64 if vocab > 300 else 5, dim=-1)
    assert torch.equal(vals, want_vals)
    assert torch.equal(ids, want_ids)


def test_chunked_kl_equals_the_direct_formula_and_its_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 16, requires_grad=True)
    head = torch.randn(40, 16)
    t_logp, t_ids = torch.log_softmax(torch.randn(3, 5, 40), -1).topk(6, -1)
    got = topk_kl(hidden, head, t_ids, t_logp, chunk=4)
    log_q = torch.log_softmax(t_logp, -1)
    log_p = torch.log_softmax(hidden @ head.T, -1).gather(-1, t_ids)
    want = (log_q.exp() * (log_q - log_p)).sum()
    torch.testing.assert_close(got, want)
    g1, = torch.autograd.grad(got, hidden)
    g2, = torch.autograd.grad(want, hidden)
    torch.testing.assert_close(g1, g2)
    # the tail bucket: exact when k covers the whole vocabulary (tail mass 0 on both sides)
    full_logp, full_ids = torch.log_softmax(torch.randn(3, 5, 40), -1).topk(40, -1)
    tail = topk_kl(hidden, head, full_ids, full_logp, tail=True)
    exact = (full_logp.exp() * (full_logp - torch.log_softmax(hidden @ head.T, -1).gather(-1, full_ids))).sum()
    torch.testing.assert_close(tail, exact, rtol=1e-4, atol=1e-4)


def test_shards_cover_every_window(tiny_cmf, tiny_corpus, tmp_path):
    make_windows(tiny_cmf, tmp_path / "w.h5", load(WindowSettings, sources=[{"path": str(tiny_corpus / "story.txt")}],
                                                            tokens=512, window=32, eval_windows=4))
    settings = load(TopkSettings, k=8, shards=3, batch=2)
    paths = [tmp_path / f"topk.{s}.h5" for s in range(3)]
    for s, p in enumerate(paths):
        main(tiny_cmf, tmp_path / "w.h5", s, p, settings)
    with h5py.File(paths[0]) as f:
        assert f["ids"].dtype == np.int32 and f["logp"].dtype == np.float16 and f.attrs["k"] == 8
        assert f["ids"].chunks == (1, 32, 8)
    ids, logp = read_topk(paths, read_windows(tmp_path / "w.h5")[1], 20, 300)
    assert ids.shape == (20, 32, 8)
    mass = np.exp(logp.astype(np.float64)).sum(-1)
    assert (mass <= 1.0 + 1e-3).all() and (mass > 0).all()
    assert (np.diff(logp.astype(np.float32), axis=-1) <= 1e-3).all()  # sorted, best first


@pytest.mark.parametrize("settings, problem", [
    ({"k": 301}, "config teacher_topk.k: 301 exceeds the teacher's vocabulary of 300"),
    ({"shards": 25}, "config teacher_topk.shards: 25 shards for the 20 windows of"),
])
def test_settings_the_inputs_cannot_meet_fail_in_one_line(tiny_cmf, tiny_corpus, tmp_path, capsys, settings, problem):
    make_windows(tiny_cmf, tmp_path / "w.h5", load(WindowSettings, sources=[{"path": str(tiny_corpus / "story.txt")}],
                                                            tokens=512, window=32, eval_windows=4))
    text = json.dumps({"k": 8, "shards": 1, **settings})
    fails_cleanly(cli, ["--teacher", tiny_cmf, "--windows", tmp_path / "w.h5", "--shard", 0, "--out", tmp_path / "t.h5",
                        "--settings", text], capsys, problem.split(":")[0], problem, [tmp_path / "t.h5"])


def test_the_top_k_is_read_batch_by_batch_not_held_whole(tiny_cmf, tiny_stages, tmp_path, monkeypatch):
    """Memory for the targets is one batch, whatever the shard's size (numpy allocations traced)."""
    import tracemalloc

    from nvg.artifacts import TopkReader

    main(tiny_cmf, tiny_stages / "windows.h5", 0, tmp_path / "topk.0.h5", load(TopkSettings, k=256, shards=1, batch=8))
    tokens, attrs = read_windows(tiny_stages / "windows.h5")
    whole = len(tokens) * tokens.shape[1] * 256 * 6
    ids_all, logp_all = read_topk([tmp_path / "topk.0.h5"], attrs, len(tokens), 300)
    monkeypatch.setattr(TopkReader, "CHECK_BYTES", whole // 10)  # the opening check streams too
    tracemalloc.start()
    reader = TopkReader([tmp_path / "topk.0.h5"], attrs, len(tokens), 300)
    for s in range(0, len(tokens) - 8, 8):  # training batches, then the held-out rows in another order
        ids, logp = reader.read(list(range(s, s + 8)))
        assert (ids == ids_all[s : s + 8]).all() and (logp == logp_all[s : s + 8]).all()
    rows = [len(tokens) - 1, 3, len(tokens) - 5]
    ids, logp = reader.read(rows)
    assert (ids == ids_all[rows]).all() and (logp == logp_all[rows]).all()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    reader.close()
    assert peak < whole / 3, (peak, whole)
