"""The C kernels equal the torch reference (itself tested against compressed-tensors) bit for bit,
directly and through the whole convert pipeline."""

import pytest
import torch

from quantize.convert import convert
from quantize.formats import fp8, int4, native

from .conftest import dir_bytes

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"native kernels unavailable: {native.why_unavailable()}")


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", [(256, 384), (576, 256), (130, 512)])
def test_fp8_block_minmax_bit_identical(shape, group):
    g = torch.Generator().manual_seed(shape[0] + group)
    w = torch.randn(shape, generator=g) * 0.03
    w[5, :group] = 0  # an all-zero group
    q, s = fp8.quant_block(w)
    ref = int4.quantize_pack(fp8.dequant_block(q, s), group)
    packed, scale, (se, sr, me), bad = native.quant_rows(q, s, "block", group, "minmax")
    assert not bad
    assert torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)
    assert se == pytest.approx(ref.sq_err, rel=1e-6) and sr == pytest.approx(ref.sq_ref, rel=1e-6)
    assert me == ref.max_abs_err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float_sources_bit_identical(dtype):
    w = (torch.randn(64, 512, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype)
    ref = int4.quantize_pack(w, 32)
    packed, scale, _, _ = native.quant_rows(w, None, None, 32, "minmax")
    assert torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)


def test_channel_fp8_and_dequant_bit_identical():
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    s = (w.abs().amax(1, keepdim=True) / 448).float()
    q = (w / s).to(torch.float8_e4m3fn)
    ref = int4.quantize_pack(fp8.dequant_channel(q, s), 64)
    packed, scale, _, _ = native.quant_rows(q, s, "channel", 64, "minmax")
    assert torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)
    qb, sb = fp8.quant_block(w)
    out, bad = native.dequant_rows(qb, sb, "block")
    assert torch.equal(out, fp8.dequant_block(qb, sb)) and not bad
    out, _ = native.dequant_rows(q, s, "channel")
    assert torch.equal(out, fp8.dequant_channel(q, s))


def test_mse_agrees_with_reference():
    w = (torch.randn(128, 512, generator=torch.Generator().manual_seed(3)) ** 3 * 0.02).to(torch.bfloat16)
    ref = int4.quantize_pack(w, 32, "mse")
    _, scale, (se, sr, _), _ = native.quant_rows(w, None, None, 32, "mse")
    # per-group error sums are reduced in another order: near-ties may pick the neighbouring shrink
    assert float((scale == ref.scale).float().mean()) > 0.999
    assert (se / sr) ** 0.5 == pytest.approx(ref.rel_err, rel=1e-3)


def test_nan_detected():
    q, s = fp8.quant_block(torch.randn(128, 128))
    q.view(torch.uint8)[3, 3] = 0x7F
    assert native.quant_rows(q, s, "block", 32, "minmax")[3]
    assert native.dequant_rows(q, s, "block")[1]


def test_pipeline_identical_without_native(tiny, tmp_path, monkeypatch):
    src = tiny("glm_moe_dsa")
    convert(src, tmp_path / "native")
    monkeypatch.setenv("QUANTIZE_NATIVE", "0")
    assert native.lib() is None
    convert(src, tmp_path / "torch")
    a, b = dir_bytes(tmp_path / "native"), dir_bytes(tmp_path / "torch")
    a.pop("quantize_manifest.json"), b.pop("quantize_manifest.json")
    assert a == b


def test_every_fp8_code_decodes_exactly():
    """All 256 e4m3 codes (subnormals, zeros, NaN) through both kernels."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    w = finite.repeat(1, 2)[:, :256].contiguous().view(torch.float8_e4m3fn)  # [1, 256]
    w = w.repeat(128, 1).contiguous()
    s = torch.full((1, 2), 0.5)
    out, bad = native.dequant_rows(w, s, "block")
    assert not bad and torch.equal(out, fp8.dequant_block(w, s))
    for group in (32, 128):
        ref = int4.quantize_pack(fp8.dequant_block(w, s), group)
        packed, scale, _, bad = native.quant_rows(w, s, "block", group, "minmax")
        assert not bad and torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)
    nan = torch.full((128, 128), 0xFF, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert native.dequant_rows(nan, torch.ones(1, 1), "block")[1]
