"""CMF v2: round trips of every dtype, shards, determinism, hashes, and one crafted bad file per hard error."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from nvg import blr as codec
from nvg.cmf import (BF16, BLR, ENVELOPE, F16, F32, Q2TP, Q4_BLOCK, Q4TP, Q8_2F, Q8_ROW, RECORD, Tensor, cmf_bytes, dense_tensor,
                     read_cmf, tensor_to_numpy, verify, write_cmf, write_cmf_shards)
from nvg.errors import NvgError
from nvg.hash64 import hash64

ARCH = {"arch_name": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 1, "num_attention_heads": 4,
        "num_kv_heads": 2, "head_dim": 16, "vocab_size": 300, "layer_types": ["FullAttention"], "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256}
HEADER = {"format": "cmf", "version": 2, "arch": ARCH, "quant_type": "F16"}


def random_blr(seed=0, paths=2, d_out=24, d_in=32, r=16) -> codec.BlrTensor:
    rng = np.random.default_rng(seed)
    return codec.BlrTensor.from_factors([
        (rng.normal(size=d_out), rng.normal(size=d_in), rng.normal(size=r),
         rng.choice([-1.0, 1.0], size=(d_out, r)), rng.choice([-1.0, 1.0], size=(r, d_in))) for _ in range(paths)])


def sample_tensors():
    rng = np.random.default_rng(0)
    big = rng.normal(size=(128, 96)).astype(np.float32)  # 24 KiB in f16: placed at a 4096 boundary
    return [
        dense_tensor("a.f32", rng.normal(size=(3, 5)), F32),
        dense_tensor("b.f16", big, F16),
        dense_tensor("c.bf16", rng.normal(size=(7,)), BF16),
        Tensor("d.blr", BLR, (24, 32), random_blr().encode()),
    ]


def test_round_trip_every_writable_dtype(tmp_path):
    tensors = sample_tensors()
    vocab = b'{"model": {}}'
    write_cmf(tmp_path / "m.cmf", HEADER, tensors, vocab)
    back = read_cmf(tmp_path / "m.cmf")
    assert list(back.tensors) == [t.name for t in tensors]
    for t in tensors:
        got = back.tensors[t.name]
        assert (got.dtype, got.shape, bytes(got.data)) == (t.dtype, t.shape, bytes(t.data))
    assert back.vocab == vocab
    assert back.header["section_hashes"]["vocab"] == f"{hash64(vocab):016x}"
    raw = (tmp_path / "m.cmf").read_bytes()
    data_off = struct.unpack_from("<Q", raw, 0x30)[0]
    assert data_off % 4096 == 0
    big_off = struct.unpack_from("<Q", raw, struct.unpack_from("<Q", raw, 0x20)[0] + 16 + RECORD.size + 32)[0]
    assert big_off % 4096 == 0
    assert verify(tmp_path / "m.cmf") == []
    np.testing.assert_allclose(tensor_to_numpy(back.tensors["b.f16"]), np.asarray(tensors[1].data and
                               np.frombuffer(bytes(tensors[1].data), "<f2").reshape(128, 96), np.float32))
    bf = tensor_to_numpy(back.tensors["c.bf16"])
    assert np.abs(bf - tensor_to_numpy(tensors[2])).max() == 0


def test_same_content_gives_same_bytes():
    assert cmf_bytes(HEADER, sample_tensors(), b"v") == cmf_bytes(HEADER, sample_tensors(), b"v")


def test_bf16_rounds_to_nearest_even():
    t = dense_tensor("x", np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8], np.float32), BF16)
    assert list(tensor_to_numpy(t)) == [1.0, 1.0 + 2**-6]


def test_quantised_teacher_dtypes_dequantise():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 64)).astype(np.float32)
    scale = (np.abs(w).max(1) / 127).astype(np.float16)
    q = np.round(w / scale.astype(np.float32)[:, None]).astype(np.int8)
    t = Tensor("q8", Q8_ROW, (4, 64), q.tobytes() + scale.tobytes())
    np.testing.assert_allclose(tensor_to_numpy(t), q * scale.astype(np.float32)[:, None])
    col = np.linspace(0.5, 1.5, 64).astype(np.float16)
    t2 = Tensor("q2f", Q8_2F, (4, 64), q.tobytes() + scale.tobytes() + col.tobytes())
    np.testing.assert_allclose(tensor_to_numpy(t2), q * scale.astype(np.float32)[:, None] * col.astype(np.float32)[None])
    flat = w.reshape(-1)
    groups = flat.reshape(-1, 32)
    s4 = (np.abs(groups).max(1) / 7).astype(np.float16)
    q4 = (np.clip(np.round(groups / s4.astype(np.float32)[:, None]), -8, 7) + 8).astype(np.uint8)
    nib = (q4[:, 0::2] | (q4[:, 1::2] << 4)).astype(np.uint8)
    t3 = Tensor("q4", Q4_BLOCK, (4, 64), nib.tobytes() + s4.tobytes())
    np.testing.assert_allclose(tensor_to_numpy(t3).reshape(-1, 32), (q4.astype(np.float32) - 8) * s4.astype(np.float32)[:, None])


@pytest.mark.parametrize("dtype, tolerance", [(Q8_ROW, 0.5 / 127), (Q4_BLOCK, 0.5 / 7)])
def test_q8_row_and_q4_block_are_written_as_cortiq_reads_them(tmp_path, dtype, tolerance):
    rng = np.random.default_rng(2)
    w = (rng.normal(size=(6, 80)) * rng.uniform(0.1, 3, size=(6, 1))).astype(np.float32)
    w[2] = 0.0  # an all-zero row (q8) and groups (q4): scale 0, values 0
    t = dense_tensor("e", w, dtype)
    n = w.size
    assert len(t.data) == (n + 2 * 6 if dtype == Q8_ROW else 18 * -(-n // 32))  # cortiq's expected_nbytes
    write_cmf(tmp_path / "q.cmf", HEADER, [t])
    back = tensor_to_numpy(read_cmf(tmp_path / "q.cmf").tensors["e"])
    if dtype == Q8_ROW:
        bound = np.abs(w).max(1, keepdims=True) * tolerance * 1.01
    else:
        groups = np.pad(w.reshape(-1), (0, -n % 32)).reshape(-1, 32)
        bound = np.repeat(np.abs(groups).max(1) * tolerance * 1.01, 32)[:n].reshape(w.shape)
    assert (np.abs(back - w) <= bound + 1e-7).all() and (back[2] == 0).all()
    assert verify(tmp_path / "q.cmf") == []


@pytest.mark.parametrize("dtype", [Q8_ROW, Q4_BLOCK])
def test_a_quantised_tensor_splits_into_codes_and_scales_and_takes_new_scales(dtype):
    from nvg.cmf import quant_groups, with_group_scales

    w = np.random.default_rng(3).normal(size=(6, 80)).astype(np.float32)  # 480 values: q4's last group padded
    t = dense_tensor("e", w, dtype)
    codes, scales = quant_groups(t)
    assert codes.dtype == np.int8 and codes.shape == ((6, 80) if dtype == Q8_ROW else (15, 32))
    assert codes.min() >= (-127 if dtype == Q8_ROW else -8) and codes.max() <= (127 if dtype == Q8_ROW else 7)
    assert np.array_equal((codes * scales[:, None]).reshape(-1)[: w.size].reshape(w.shape), tensor_to_numpy(t))
    assert with_group_scales(t, scales) == bytes(t.data)  # the same scales give the same bytes
    doubled = Tensor("e", dtype, t.shape, with_group_scales(t, 2 * scales))
    assert len(doubled.data) == len(t.data) and np.array_equal(quant_groups(doubled)[0], codes)
    assert np.allclose(tensor_to_numpy(doubled), 2 * tensor_to_numpy(t))
    with pytest.raises(ValueError, match="not one of"):
        quant_groups(dense_tensor("e", w, F16))


def test_shards_round_trip(tmp_path):
    tensors = sample_tensors()
    paths = write_cmf_shards(tmp_path / "m-00001-of-00003.cmf", HEADER, tensors, b"vocab", 3)
    assert [p.name for p in paths] == ["m-00001-of-00003.cmf", "m-00002-of-00003.cmf", "m-00003-of-00003.cmf"]
    merged = read_cmf(paths[0])
    assert sorted(merged.tensors) == sorted(t.name for t in tensors)
    assert merged.vocab == b"vocab"
    assert verify(paths[0]) == []
    with pytest.raises(NvgError, match="open the first shard"):
        read_cmf(paths[1])
    paths[2].unlink()
    with pytest.raises(NvgError, match="missing sibling shard 3 of 3"):
        read_cmf(paths[0])


def test_verify_reports_a_corrupt_payload(tmp_path):
    p = tmp_path / "m.cmf"
    write_cmf(p, HEADER, sample_tensors())
    raw = bytearray(p.read_bytes())
    data_off = struct.unpack_from("<Q", raw, 0x30)[0]
    raw[data_off] ^= 0xFF
    p.write_bytes(bytes(raw))
    problems = verify(p)
    assert len(problems) == 2 and "'a.f32' hash does not match" in problems[0]
    assert "'a.f32' BLAKE2b does not match its payload" in problems[1]


def test_swapped_rows_pass_hash64_but_not_blake2b(tmp_path):
    """cortiq's hash64 sums 8-byte words in an order-blind way; the BLAKE2b digests catch a swap."""
    p = tmp_path / "m.cmf"
    write_cmf(p, HEADER, sample_tensors())
    t = read_cmf(p).tensors["b.f16"]
    raw = bytearray(p.read_bytes())
    data_off = bytes(raw).find(bytes(t.data))
    row = 96 * 2
    raw[data_off : data_off + 2 * row] = raw[data_off + row : data_off + 2 * row] + raw[data_off : data_off + row]
    p.write_bytes(bytes(raw))
    assert hash64(read_cmf(p).tensors["b.f16"].data) == t.stored_hash
    assert verify(p) == [f"{p}: tensor 'b.f16' BLAKE2b does not match its payload"]


# ── one crafted bad file per hard error ──

def _file(tmp_path) -> tuple:
    p = tmp_path / "bad.cmf"
    write_cmf(p, HEADER, sample_tensors())
    raw = bytearray(p.read_bytes())
    fields = ENVELOPE.unpack_from(raw, 0)
    return p, raw, fields


def _record(raw, i):
    d_off = struct.unpack_from("<Q", raw, 0x20)[0]
    return d_off + 16 + RECORD.size * i


def _patch_record(raw, i, at, fmt, value):
    struct.pack_into(fmt, raw, _record(raw, i) + at, value)


@pytest.mark.parametrize("case, message", [
    ("truncated", "shorter than the 128-byte envelope"),
    ("magic", "magic at offset 0x0"),
    ("version", "version at offset 0x4: 3 is not 2"),
    ("feature", "required_features at offset 0xc: unknown feature bits 0x100"),
    ("data_align", "data_off at offset 0x30"),
    ("past_eof", "runs past the end"),
    ("tensor_past_blob", "runs past the"),
    ("tensor_align", "is not a multiple of 64"),
    ("duplicate", "duplicate tensor name"),
    ("nbytes", "nbytes at offset"),
    ("blr_header", "blr magic 0x0 is not 0x4c"),
    ("dtype", "unknown dtype id 42"),
    ("header_json", "header JSON at offset 0x80"),
])
def test_bad_file_is_one_clear_error(tmp_path, case, message):
    p, raw, _ = _file(tmp_path)
    if case == "truncated":
        raw = raw[:100]
    elif case == "magic":
        raw[0:4] = b"GGUF"
    elif case == "version":
        struct.pack_into("<I", raw, 4, 3)
    elif case == "feature":
        struct.pack_into("<I", raw, 12, 1 | 1 << 8)
    elif case == "data_align":
        struct.pack_into("<QQ", raw, 0x30, struct.unpack_from("<Q", raw, 0x30)[0] + 8, struct.unpack_from("<Q", raw, 0x38)[0] - 8)
    elif case == "past_eof":
        raw = raw[: len(raw) - 100]
    elif case == "tensor_past_blob":
        _patch_record(raw, 0, 32, "<Q", 1 << 30)
    elif case == "tensor_align":
        _patch_record(raw, 1, 32, "<Q", 4096 + 8)
    elif case == "duplicate":
        d_off = struct.unpack_from("<Q", raw, 0x20)[0]
        pool = d_off + struct.unpack_from("<Q", raw, d_off + 8)[0]
        name_off = struct.unpack_from("<I", raw, _record(raw, 1))[0]
        raw[pool + name_off : pool + name_off + 5] = b"a.f32"
    elif case == "nbytes":
        _patch_record(raw, 0, 40, "<Q", 56)
    elif case == "blr_header":
        off = struct.unpack_from("<Q", raw, _record(raw, 3) + 32)[0]
        raw[struct.unpack_from("<Q", raw, 0x30)[0] + off] = 0
    elif case == "dtype":
        _patch_record(raw, 0, 6, "<B", 42)
    elif case == "header_json":
        raw[128] = ord("[")
    p.write_bytes(bytes(raw))
    with pytest.raises(NvgError) as err:
        read_cmf(p)
    assert message in str(err.value)
    assert str(p) in str(err.value)


def test_cli_inspect_and_verify(tmp_path, capsys):
    from nvg.cli import main

    p = tmp_path / "m.cmf"
    write_cmf(p, HEADER, sample_tensors(), b"{}")
    big = {**HEADER, "provenance": {"notes": ["x" * 100] * 60}}  # a header past the old 4,000-character cut
    write_cmf(p, big, sample_tensors(), b"{}")
    main(["inspect", str(p)])
    out = capsys.readouterr().out
    assert "d.blr" in out and "blr" in out and json.dumps(ARCH["arch_name"]) in out
    header_text = out[out.index("{") : out.index("\nname ")]
    assert json.loads(header_text)["nvg_blake2b"]["tensors"] == "<4 digests>"  # whole, valid JSON
    weights = sum(t.numel for t in read_cmf(p).tensors.values())
    size = p.stat().st_size  # header, directory, vocab and padding included
    assert f"whole file: {size:,} bytes = {8 * size / weights:.4f} bpw over {weights} weights" in out
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("nvg 0.1.0 (torch ")
    main(["verify", str(p)])
    assert "OK" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tmp_path / "missing.cmf")])
    assert e.value.code == 2
    assert "cannot read" in capsys.readouterr().err


def cortiq_dequant_tiled(buf: bytes, bits: int, rows: int, cols: int) -> np.ndarray:
    """cortiq-core 0.5.100 `dequant_q4tp` / `dequant_q2tp` (quant.rs), transcribed loop for loop."""
    gpr, tile = cols // 32, 16 if bits == 4 else 8
    stride = (gpr * 5 + 7) // 8
    params_off, codes_off = rows * gpr * tile, rows * gpr * tile + rows * 4
    out = np.zeros((rows, cols), np.float32)
    for r in range(rows):
        lo, st = np.frombuffer(buf, "<f2", 2, params_off + 4 * r).astype(np.float32)
        ratio, t = np.float32(np.exp2(st)), [np.float32(np.exp2(lo))]
        for _ in range(31):
            t.append(np.float32(t[-1] * ratio))
        if bits == 2:
            t = [np.float32(0)] + t[:31]
        codes = buf[codes_off + r * stride: codes_off + (r + 1) * stride]
        for g in range(gpr):
            b, sh = g * 5 // 8, g * 5 % 8
            lo_b, hi_b = codes[b], codes[b + 1] if sh > 3 and b + 1 < len(codes) else 0
            s = t[((lo_b | (hi_b << 8)) >> sh) & 0x1F]
            chunk = buf[(r * gpr + g) * tile:(r * gpr + g + 1) * tile]
            for k, byte in enumerate(chunk):
                if bits == 4:
                    out[r, g * 32 + 2 * k] = ((byte & 0x0F) - 8.0) * s
                    out[r, g * 32 + 2 * k + 1] = (((byte >> 4) & 0x0F) - 8.0) * s
                else:
                    for j in range(4):
                        out[r, g * 32 + 4 * k + j] = (((byte >> (2 * j)) & 3) - 1.5) * s
    return out


@pytest.mark.parametrize("dtype, bits, max_rel", [(Q4TP, 4, 0.02), (Q2TP, 2, 0.45)])
def test_q4tp_and_q2tp_are_written_as_cortiq_reads_them(tmp_path, dtype, bits, max_rel):
    """The payload decodes to the same values through cortiq's decoder transcribed above; the sizes are
    cortiq's sections; a zero group stays exactly zero; the group view takes trained scales back."""
    from nvg.cmf import quant_groups, with_group_scales

    rng = np.random.default_rng(5)
    rows, cols = 7, 96  # 3 groups a row: the 5-bit codes straddle a byte
    w = (rng.normal(size=(rows, cols)) * rng.uniform(0.01, 2, size=(rows, 1))).astype(np.float32)
    w[1, 32:64] = 0.0  # a zero group
    t = dense_tensor("e", w, dtype)
    assert len(t.data) == rows * 3 * (16 if bits == 4 else 8) + rows * 4 + rows * 2
    write_cmf(tmp_path / "t.cmf", HEADER, [t])
    back = tensor_to_numpy(read_cmf(tmp_path / "t.cmf").tensors["e"])
    np.testing.assert_allclose(back, cortiq_dequant_tiled(bytes(t.data), bits, rows, cols), rtol=1e-6, atol=0)
    assert (back[1, 32:64] == 0).all() and verify(tmp_path / "t.cmf") == []
    rel = ((back - w) ** 2).sum(1) / (w ** 2).sum(1)
    assert (rel < max_rel).all(), rel
    codes, scales = quant_groups(t)
    assert np.allclose((codes * scales[:, None]).reshape(rows, cols), back)
    scaled = Tensor("e", dtype, t.shape, with_group_scales(t, scales * 1.3))
    assert np.array_equal(quant_groups(scaled)[0], codes)
    np.testing.assert_allclose(tensor_to_numpy(scaled), 1.3 * back, rtol=0.03, atol=1e-6)  # on the refitted ladders
    with pytest.raises(ValueError, match="cols a multiple of 32"):
        dense_tensor("e", w[:, :40], dtype)
