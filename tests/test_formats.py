"""The format math against compressed-tensors as an independent oracle."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from quantize.formats import fp8, int4

SHAPES = [(16, 256), (96, 128), (7, 512), (128, 1024)]


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_equals_compressed_tensors(shape):
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    ours = int4.pack_int4(q)
    theirs = pack_to_int32(q, num_bits=4, packed_dim=1)
    assert ours.dtype == torch.int32 and torch.equal(ours, theirs)
    assert torch.equal(int4.unpack_int4(ours, shape[1]), unpack_from_int32(theirs, 4, torch.Size(shape)))


def test_pack_bit_order_documented_example():
    q = torch.arange(-8, 8, dtype=torch.int8).view(1, 16)
    words = int4.pack_int4(q).view(torch.uint32).tolist()[0]
    assert words == [0x76543210, 0xFEDCBA98]


def _ct_rtn(w_bf16, group):
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    out, k = w_bf16.shape
    wg = w_bf16.view(out, k // group, group)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    q = ct_quantize(w_bf16, scale, zp, args, dtype=torch.int8)
    return q, scale


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", [(64, 256), (96, 512)])
def test_minmax_bit_identical_to_compressed_tensors(group, shape):
    g = torch.Generator().manual_seed(group + shape[0])
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    w[0, :group] = 0  # an all-zero group: eps scale
    q, scale = int4.quantize_groups(w, group, "minmax")
    q_ct, scale_ct = _ct_rtn(w, group)
    assert scale.dtype == torch.bfloat16
    assert torch.equal(scale, scale_ct.to(torch.bfloat16))
    assert torch.equal(q, q_ct)


def test_mse_lowers_weight_error_and_never_raises_it():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 512, generator=g) ** 3 * 0.02).to(torch.bfloat16)  # heavy tails
    a = int4.quantize_pack(w, 32, "minmax")
    b = int4.quantize_pack(w, 32, "mse")
    assert b.rel_err < a.rel_err * 0.98


@pytest.mark.parametrize("group", [32, 128])
def test_dequantize_roundtrip(group):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(32, 256, generator=g)).to(torch.bfloat16)
    r = int4.quantize_pack(w, group)
    deq = int4.dequantize_int4(r.packed, r.scale, (32, 256))
    assert deq.shape == w.shape
    # half a quantization step per element, plus bf16 rounding of w/scale and of q*scale
    step = r.scale.float().repeat_interleave(group, 1)
    bound = step * 0.5 + w.float().abs() * 2**-7
    assert torch.all((deq.float() - w.float()).abs() <= bound)
    assert abs(r.rel_err - float((deq.float() - w.float()).norm() / w.float().norm())) < 1e-2


def test_group_divisibility_refused():
    with pytest.raises(ValueError, match="not a multiple of group size 128"):
        int4.quantize_groups(torch.zeros(4, 576), 128)


@pytest.mark.parametrize("shape", [(256, 256), (576, 256), (200, 300)])
def test_fp8_block_roundtrip_and_ceil_grid(shape):
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g) * 0.05
    q, s = fp8.quant_block(w)
    assert q.dtype == torch.float8_e4m3fn
    assert tuple(s.shape) == fp8.block_grid(shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    deq = fp8.dequant_block(q, s, dtype=torch.float32)
    assert (deq - w).norm() / w.norm() < 0.04


def test_fp8_block_matches_compressed_tensors_dequantizer():
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer

    g = torch.Generator().manual_seed(9)
    w = torch.randn(576, 384, generator=g) * 0.05
    q, s = fp8.quant_block(w)
    conv = FP8BlockDequantizer(targets=["re:.*"], weight_block_size=(128, 128), dtype=torch.bfloat16)
    out = conv.process({"x.weight": q, "x.weight_scale_inv": s})
    assert torch.equal(out["x.weight"], fp8.dequant_block(q, s))


def test_fp8_block_scale_shape_mismatch_refused():
    q, s = fp8.quant_block(torch.randn(576, 256))
    with pytest.raises(ValueError, match="ceil grid"):
        fp8.dequant_block(q, s[:4])


def test_observer_table_names_and_math_agree():
    """formats/layout.py names the observers (torch-free, for the options and the card);
    formats/int4.py's GRIDS holds their math: one key set, and each grid does what its name says."""
    from quantize.formats import int4, layout

    assert list(int4.GRIDS) == list(layout.OBSERVERS)
    w = torch.tensor([[1.0, -3.0, 2.0, 0.5] * 8])
    q, s = int4.quantize_groups(w, 32, "minmax")
    assert float(s[0, 0]) == pytest.approx(3.0 / 7.5, rel=1e-2) and int(q.max()) <= 7 and int(q.min()) >= -8
    q, s = int4.quantize_groups(w, 32, "fullrange")  # the signed extreme -3 lands on code -8: a positive scale
    assert float(s[0, 0]) == pytest.approx(3.0 / 8, rel=1e-2) and int(q.min()) == -8
    q, s = int4.quantize_groups(-w, 32, "fullrange")  # +3 on code -8: a negative scale
    assert float(s[0, 0]) < 0 and int(q.min()) == -8
    assert [n for n, g in int4.GRIDS.items() if g.signed] == ["fullrange", "fullrange-mse"]
    assert [n for n, g in int4.GRIDS.items() if g.search] == ["mse", "fullrange-mse"]


def test_weighted_scale_follows_the_importance():
    """int4.weighted_scale: zero importance gives the grid's RTN scale (p = 1 wins ties); importance on
    one column clips the group so that column is rounded best; near miss: without that importance the
    same group keeps a larger scale; shapes that do not fit are refused."""
    import pytest

    from quantize.formats import int4

    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 64, generator=g)
    for obs in ("minmax", "fullrange"):
        rtn_scale = int4.quantize_groups(w, 32, obs)[1]
        assert torch.equal(int4.weighted_scale(w, torch.zeros(64), 32, obs), rtn_scale)
        s = int4.weighted_scale(w, torch.ones(64), 32, obs)
        ratio = s.float() / rtn_scale.float()
        assert (ratio <= 1).all() and (ratio >= 0.8 * (1 - 2**-7)).all()
    # one column that matters: its own rounding error is (nearly) the group's weighted error
    imp = torch.zeros(64)
    imp[5] = 1.0
    s = int4.weighted_scale(w, imp, 32, "minmax")
    wb = w.to(torch.bfloat16).float()
    err = lambda sc: (wb[:, 5] - (wb[:, 5] / sc).clamp(-8, 7).round() * sc).abs()  # noqa: E731
    rtn_scale = int4.quantize_groups(w, 32, "minmax")[1]
    assert (err(s[:, 0].float()) <= err(rtn_scale[:, 0].float()) + 1e-7).all()
    assert not torch.equal(s, rtn_scale)
    with pytest.raises(ValueError):
        int4.weighted_scale(w, torch.ones(63), 32, "minmax")
    with pytest.raises(ValueError):
        int4.weighted_scale(w[:, :48], torch.ones(48), 32, "minmax")


@pytest.mark.parametrize("observer", ["minmax", "mse", "fullrange"])
def test_row_blocks_give_the_whole_tensor_result(observer):
    """``quantize_pack_rows`` / ``error_sums_rows`` (128-row blocks, a partial last one) against the
    whole-tensor functions: codes and scales equal, the max equal, the sums to ~1e-15 (another order
    of addition); fewer rows than a block is the whole-tensor call itself."""
    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    whole = int4.quantize_pack(w, 32, observer)
    rows = int4.quantize_pack_rows(w, 32, observer, rows=128)
    assert torch.equal(rows.packed, whole.packed) and torch.equal(rows.scale, whole.scale)
    assert rows.max_abs_err == whole.max_abs_err
    assert rows.sq_err == pytest.approx(whole.sq_err, rel=1e-12) and rows.sq_ref == pytest.approx(whole.sq_ref, rel=1e-12)
    sums = int4.error_sums(w, whole.packed, whole.scale)
    got = int4.error_sums_rows(w, whole.packed, whole.scale, rows=128)
    assert got[2] == sums[2] and got[:2] == pytest.approx(sums[:2], rel=1e-12)
    # the near miss: a block's codes changed is seen in the sums of the block it lies in
    bad = whole.packed.clone()
    bad[299, 0] ^= 0x1
    assert int4.error_sums_rows(w, bad, whole.scale, rows=128)[0] != pytest.approx(sums[0], rel=1e-12)
    small = int4.quantize_pack_rows(w[:100], 32, observer, rows=128)
    assert torch.equal(small.packed, whole.packed[:100])
