"""CPU W4A16: repack the compressed-tensors layout once for torch's int4 CPU GEMM.

torch computes ``(nibble - 8) * scale + zero``; compressed-tensors stores nibble = q + 8
(``uint4b8``) and is symmetric, so zero = 0 reproduces ``q * scale`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantize.formats.int4 import unpack_int4
from quantize.kernels.cuda_int4 import scales_and_zeros


@dataclass
class CpuW4A16:
    weight: torch.Tensor  # torch's int4pack layout
    scales_zeros: torch.Tensor  # [K/g, N, 2] bf16
    group: int
    shape: tuple[int, int]

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> "CpuW4A16":
        n, k = shape
        group = k // scale.shape[1]
        nib = unpack_int4(packed, k).to(torch.int32) + 8
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nib, 1)
        return cls(w, scales_and_zeros(scale), group, (n, k))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), self.weight, self.group, self.scales_zeros
        )
