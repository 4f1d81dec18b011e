"""Reference W4A16 and W4A8 (FP8 activations) products, plain torch in fp32."""

from __future__ import annotations

import torch

from quantize.formats.int4 import unpack_int4


def dequant_fp32(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    q = unpack_int4(packed, k).float()
    return (q.view(n, scale.shape[1], -1) * scale.float().unsqueeze(-1)).view(n, k)


def w4a16_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """x [M, K] -> [M, N] fp32: x @ W.T with W = q * scale (exact in fp32)."""
    return x.float() @ dequant_fp32(packed, scale, shape).t()


FP8_MAX = 448.0  # float8 e4m3fn's largest finite value


def fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 e4m3 activations, as the W4A8 MoE kernels quantize them (vLLM 0.33
    ``QuantFP8(static=False, group_shape=PER_TOKEN)``: scale = row amax / 448, codes = x / scale
    rounded to e4m3). -> (codes as float8_e4m3fn [M, K], fp32 scales [M, 1])."""
    xf = x.float()
    s = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def w4a8_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """x [M, K] -> [M, N] fp32: the W4A8 product, FP8 per-token activations (``fp8_per_token``) against
    the INT4 weights W = q * scale, accumulated in fp32."""
    codes, s = fp8_per_token(x)
    return (codes.float() * s) @ dequant_fp32(packed, scale, shape).t()
