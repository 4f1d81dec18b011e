"""CUDA W4A16 through PyTorch's own INT4 GEMM (``torch._weight_int4pack_mm``, the "tinygemm" kernel of
aten/src/ATen/native/cuda/int4mm.cu), after a one-time repack of the compressed-tensors layout.

What torch wants, as read in its source and tests:

* ``torch.ops.aten._convert_weight_to_int4pack(w, innerKTiles)``: w uint8 [N, K/2] holding two
  nibbles per byte, element 2p in the HIGH nibble and element 2p+1 in the LOW one. torch's own test
  helper packs it so (torch/testing/_internal/common_quantization.py, ``_group_quantize_tensor``:
  ``out = (out[::, ::2] << 4 | out[::, 1::2]).to(torch.uint8)`` where the device is not the CPU),
  and int4mm.cu's ``matrix_to_m16n8k16_Bint4_layout`` reads it so (``v[i] & 0xF0`` is the even
  element). innerKTiles is 2, 4 or 8 and K must be a multiple of innerKTiles * 16; N is tiled by 8.
* ``torch.ops.aten._weight_int4pack_mm(x, w, groupSize, scalesAndZeros)``: x bf16 [M, K]
  contiguous, groupSize 32, 64, 128 or 256, scalesAndZeros bf16 [K/g, N, 2] (scale, zero) — the
  layout ``_group_quantize_tensor`` builds (``torch.cat([scales, zeros], 2).transpose(0, 1)``); it
  computes ``(nibble - 8) * scale + zero``, so zero = 0 is exactly ``q * scale`` with nibble = q + 8.
  int4mm.cu builds for sm80+ only (``__CUDA_ARCH__ >= 800``).

compressed-tensors stores the same nibble (q + 8, ``uint4b8``) with element 8j+i in bits 4i..4i+3 of
int32 word j (its ``pack_to_int32``; quantize/formats/int4.py). Read as little-endian bytes, byte b of
word j holds element 8j+2b in its LOW nibble and 8j+2b+1 in its HIGH one: torch's byte is the same
byte with its nibbles swapped (``to_int4pack_bytes``), no unpacking needed. The CPU twin
(``_convert_weight_to_int4pack_for_cpu`` takes the nibbles as int32 [N, K]) checks this repack
on a machine without a GPU: tests/test_kernels.py unpacks these bytes back, compares them with
compressed-tensors' ``unpack_from_int32`` and runs the CPU GEMM on them against the reference.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

GROUPS = (32, 64, 128, 256)  # int4mm.cu: TORCH_CHECK(qGroupSize == 32 || 64 || 128 || 256)
INNER_K_TILES = (8, 4, 2)  # preferred first: 8 inner k-tiles = 16-byte loads
MIN_CAPABILITY = (8, 0)


def inner_k_tiles(k: int) -> int | None:
    """The largest innerKTiles torch accepts for K (K a multiple of innerKTiles * 16), or None."""
    return next((t for t in INNER_K_TILES if k % (t * 16) == 0), None)


def applies(shape: tuple[int, int], group: int, capability: tuple[int, int] | None = None) -> tuple[bool, str]:
    """Whether torch's CUDA INT4 GEMM takes weight ``shape`` (N, K) at ``group`` on a GPU of
    ``capability`` (None: not asked). Pure: no GPU is touched. -> (applies, why not)."""
    n, k = shape
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        return False, f"compute capability {capability[0]}.{capability[1]} < 8.0 (int4mm.cu builds for sm80+)"
    if group not in GROUPS:
        return False, f"group {group} is not one of {GROUPS}"
    if k % group:
        return False, f"K {k} is not a multiple of the group {group}"
    if inner_k_tiles(k) is None:
        return False, f"K {k} is not a multiple of 32 (innerKTiles * 16, innerKTiles >= 2)"
    if n % 8:
        return False, f"N {n} is not a multiple of 8 (the kernel's n-tile)"
    return True, ""


def to_int4pack_bytes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors int32 [N, K/8] -> torch's uint8 [N, K/2] (element 2p in the high nibble,
    2p+1 in the low one, nibble = q + 8 kept). Pure tensor math, on the tensor's device."""
    if sys.byteorder != "little":
        raise RuntimeError("the int32 -> byte view assumes a little-endian host (x86, ARM as run)")
    if k % 8:
        raise ValueError(f"K {k} is not a multiple of 8")
    b = packed.contiguous().view(torch.uint8)[:, : k // 2]  # byte b of word j: element 8j+2b low, +1 high
    return ((b & 0x0F) << 4) | (b >> 4)


def int4pack_bytes_to_nibbles(b: torch.Tensor) -> torch.Tensor:
    """The inverse reading of torch's uint8 [N, K/2] -> int32 nibbles [N, K] (for the CPU twin and tests)."""
    out = torch.empty((b.shape[0], b.shape[1] * 2), dtype=torch.int32, device=b.device)
    out[:, 0::2] = (b >> 4).to(torch.int32)
    out[:, 1::2] = (b & 0x0F).to(torch.int32)
    return out


def scales_and_zeros(scale: torch.Tensor) -> torch.Tensor:
    """weight_scale [N, K/g] -> torch's bf16 [K/g, N, 2] with zeros (symmetric: q * scale exactly)."""
    s = scale.to(torch.bfloat16).t().contiguous()
    return torch.stack([s, torch.zeros_like(s)], -1).contiguous()


@dataclass
class CudaW4A16:
    weight: torch.Tensor  # torch's tinygemm layout, int32 [N/8, K/(innerKTiles*16), 32, innerKTiles/2]
    scales_zeros: torch.Tensor  # bf16 [K/g, N, 2]
    group: int
    shape: tuple[int, int]

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> "CudaW4A16":
        """One-time repack on ``packed``'s (CUDA) device; ValueError where ``applies`` says no."""
        n, k = shape
        group = k // scale.shape[1]
        cap = torch.cuda.get_device_capability(packed.device) if packed.is_cuda else None
        ok, why = applies(shape, group, cap)
        if not ok:
            raise ValueError(f"torch's INT4 GEMM does not take weight {shape} at group {group}: {why}")
        w = torch.ops.aten._convert_weight_to_int4pack(to_int4pack_bytes(packed, k).contiguous(), inner_k_tiles(k))
        return cls(w, scales_and_zeros(scale), group, (n, k))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> bf16 [M, N]."""
        return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.group,
                                                  self.scales_zeros)


def cpu_twin(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]):
    """The same bytes through torch's CPU INT4 GEMM (``_convert_weight_to_int4pack_for_cpu`` takes
    the nibbles as int32 [N, K]): x -> bf16 [M, N]. What the tests run without a GPU."""
    n, k = shape
    group = k // scale.shape[1]
    nib = int4pack_bytes_to_nibbles(to_int4pack_bytes(packed, k))
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nib, 1)
    sz = scales_and_zeros(scale)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), w, group, sz)
