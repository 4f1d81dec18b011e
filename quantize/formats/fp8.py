"""FP8 (e4m3) weights: block dequant (DeepSeek/GLM ``weight_scale_inv``), compressed-tensors
channel/tensor/block dequant, and block quantization (what vendors ship; used to make test inputs).

Pure tensor math. Semantics (docs/formats.md#block-fp8-scales): ``weight_scale_inv`` is a MULTIPLIER on a
ceil grid, ``W[r, c] = W_fp8[r, c] * s[r // B, c // B]``, computed in fp32 then cast.
"""

from __future__ import annotations


import torch

from .layout import DEFAULT_BLOCK, block_grid  # noqa: F401

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    s = scale.float()
    return s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequant_block(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """w fp8 [rows, cols], scale_inv fp32 (or e8m0/uint8 exponent) on the ceil grid -> dtype."""
    rows, cols = w.shape
    expect = block_grid((rows, cols), block)
    if tuple(scale_inv.shape) != expect:
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)} does not match the ceil grid {expect} "
            f"of a {rows}x{cols} weight with {block[0]}x{block[1]} blocks"
        )
    s = scale_as_float(scale_inv)
    br, bc = block
    if rows % br == 0 and cols % bc == 0:
        out = w.float().view(rows // br, br, cols // bc, bc) * s.view(rows // br, 1, cols // bc, 1)
        return out.view(rows, cols).to(dtype)
    return (w.float() * _expand(s, (rows, cols), block)).to(dtype)


def scale_as_float(scale: torch.Tensor) -> torch.Tensor:
    """fp32/bf16 scales as they are; ue8m0 scales (float8_e8m0fnu, or uint8 exponent
    ``2**(b-127)``) as powers of two."""
    if scale.dtype == torch.uint8:
        return torch.pow(2.0, scale.float() - 127.0)
    return scale.float()


def dequant_channel(w: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """compressed-tensors float-quantized, channel ([out, 1]) or tensor ([1] / []) strategy."""
    s = scale.float()
    if s.numel() == 1:
        return (w.float() * s.reshape(())).to(dtype)
    if tuple(s.shape) not in ((w.shape[0], 1), (w.shape[0],)):
        raise ValueError(
            f"channel scale shape {tuple(s.shape)} does not fit a weight of shape {tuple(w.shape)}"
        )
    return (w.float() * s.reshape(w.shape[0], 1)).to(dtype)


def quant_block(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [rows, cols] -> (fp8 [rows, cols], scale_inv fp32 on the ceil grid), as the vendors
    do: per block ``scale_inv = absmax / 448``, ``fp8 = w / scale_inv``."""
    rows, cols = w.shape
    gr, gc = block_grid((rows, cols), block)
    br, bc = block
    pad = torch.zeros(gr * br, gc * bc, dtype=torch.float32)
    pad[:rows, :cols] = w.float()
    blocks = pad.view(gr, br, gc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv.view(gr, 1, gc, 1)).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(gr * br, gc * bc)[:rows, :cols].to(FP8_DTYPE)
    return q.contiguous(), scale_inv.float()


def quant_block_ct(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK, fp32_quotient: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [rows, cols] -> (e4m3 [rows, cols], weight_scale [ceil(rows/B), ceil(cols/B)] in
    w's dtype): compressed-tensors' ``float-quantized`` block strategy as llm-compressor's
    ``model_free_ptq(scheme="FP8_BLOCK")`` writes it (docs/formats.md#fp8-block-output-prefill-artifact).

    Zero-padded to whole blocks; ``scale = dtype(absmax / 448)`` (a zero scale becomes the dtype's
    eps); ``code = e4m3(clamp(dtype(w / scale), -448, 448))`` — the quotient rounded to w's dtype
    first, as the eager torch path (CPU) does. ``fp32_quotient`` keeps the quotient in fp32, as
    compressed-tensors' Triton kernel (CUDA SM90+) does; the two differ in a few percent of codes."""
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"expected a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    rows, cols = w.shape
    (gr, gc), (br, bc) = block_grid((rows, cols), block), block
    pad = w.new_zeros(gr * br, gc * bc)
    pad[:rows, :cols] = w
    blocks = pad.view(gr, br, gc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = (amax.float() / FP8_MAX).to(w.dtype)
    scale = torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)
    x = blocks.float() / scale.float().view(gr, 1, gc, 1)
    if not fp32_quotient:
        x = x.to(w.dtype)
    q = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(gr * br, gc * bc)[:rows, :cols]
    return q.contiguous(), scale
