"""Reference W4A16 product, plain torch in fp32."""

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
