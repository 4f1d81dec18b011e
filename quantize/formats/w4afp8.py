"""SGLang's native ``w4afp8`` layout of a routed expert projection (docs/formats.md#w4afp8-layouts):
pure tensor math, no I/O.

* ``weight``            int8 ``[out, in/2]``: signed INT4 codes (-8..7, two's complement, no offset),
  two per byte, element ``2j`` in the low nibble of byte ``j`` (read in SGLang 0.5.23
  ``layers/quantization/w4afp8.py`` and the compressed-tensors route's repack,
  ``layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a8_fp8_moe.py``).
* ``weight_scale_inv``  fp32 ``[out, in/128]``: a multiplier despite its name, W = q x s.
* ``input_scale``       fp32 ``[1]``: static FP8 scale of the projection's input, x_fp8 = x / s.

compressed-tensors' ``weight_packed`` (int32 words of ``q + 8`` nibbles, low first) holds the same
nibbles in the same order: its little-endian bytes, each XOR ``0x88`` (``q + 8`` minus 8 modulo 16 in
both nibbles), are the native bytes, so codes convert bit for bit both ways.
"""

from __future__ import annotations

import sys

import torch

from .int4 import QMAX, QMIN

GROUP = 128  # the CUTLASS W4A8 MoE kernel's one group size (SGLang 0.5.23 w4afp8.py L46)
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value
NIBBLE_FLIP = 0x88  # uint4b8 <-> two's complement in both nibbles of a byte


def _little_endian() -> None:
    if sys.byteorder != "little":  # safetensors is little-endian; a view of the words is not, here
        raise RuntimeError("the int32 <-> int8 code views assume a little-endian machine")


def from_packed(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``weight_packed`` int32 [out, in/8] -> native ``weight`` int8 [out, in/2]."""
    if packed.dtype != torch.int32 or packed.ndim != 2:
        raise ValueError(f"expected int32 [out, in/8] packed codes, got {packed.dtype} {tuple(packed.shape)}")
    _little_endian()
    b = packed.contiguous().view(torch.uint8) ^ NIBBLE_FLIP
    return b.view(torch.int8)


def to_packed(weight: torch.Tensor) -> torch.Tensor:
    """native ``weight`` int8 [out, in/2] -> compressed-tensors ``weight_packed`` int32 [out, in/8]."""
    if weight.dtype != torch.int8 or weight.ndim != 2 or weight.shape[1] % 4:
        raise ValueError(f"expected int8 [out, in/2] codes with in/2 % 4 == 0, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    _little_endian()
    return (weight.contiguous().view(torch.uint8) ^ NIBBLE_FLIP).view(torch.int32)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Signed codes [out, in] (-8..7, any integer dtype) -> native int8 [out, in/2]: element 2j in the
    low nibble of byte j, 2j+1 in the high nibble."""
    if q.ndim != 2 or q.shape[1] % 2:
        raise ValueError(f"expected [out, in] codes with an even in, got {tuple(q.shape)}")
    q = q.to(torch.int16)
    if bool((q < QMIN).any() or (q > QMAX).any()):
        raise ValueError(f"INT4 codes must lie in [{QMIN}, {QMAX}]")
    lo, hi = q[:, 0::2] & 0xF, q[:, 1::2] & 0xF
    return (lo | (hi << 4)).to(torch.uint8).view(torch.int8)


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """native int8 [out, in/2] -> signed codes int8 [out, in] (each nibble sign-extended)."""
    if weight.dtype != torch.int8 or weight.ndim != 2:
        raise ValueError(f"expected int8 [out, in/2] codes, got {weight.dtype} {tuple(weight.shape)}")
    b = weight.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    lo, hi = torch.where(lo > QMAX, lo - 16, lo), torch.where(hi > QMAX, hi - 16, hi)
    return torch.stack((lo, hi), dim=-1).reshape(weight.shape[0], -1).to(torch.int8)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """native ``weight`` and ``weight_scale_inv`` [out, in/group] -> W = q x s, in fp32, then ``dtype``."""
    q = unpack(weight).float()
    n, k = q.shape
    if scale.ndim != 2 or scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ValueError(f"scale {tuple(scale.shape)} does not fit codes [{n}, {k}]")
    return (q.view(n, scale.shape[1], -1) * scale.float().unsqueeze(-1)).view(n, k).to(dtype)


def input_scale(amax: float) -> float:
    """The static FP8 input scale for activations of largest magnitude ``amax``: amax / 448, rounded UP
    to the nearest bfloat16 value (SGLang holds the input scale as a bf16 parameter, and a scale rounded
    down would push the largest activation past 448, where the e4m3 cast saturates). A zero ``amax`` (an
    input never seen non-zero) gives bf16's smallest normal, not 0 (x / 0)."""
    s = torch.tensor(float(amax) / FP8_MAX, dtype=torch.float32)
    if not bool(torch.isfinite(s)) or float(s) < 0:
        raise ValueError(f"activation amax {amax} is not a finite non-negative number")
    b = s.to(torch.bfloat16)
    if float(b) < float(s):  # round to nearest went down: the next bf16 value up (positive: the next bits)
        b = (b.reshape(1).view(torch.int16) + 1).view(torch.bfloat16)[0]
    tiny = torch.finfo(torch.bfloat16).tiny
    return max(float(b), tiny)


def fake_fp8_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x through e4m3 with one static scale, as the W4A8 MoE kernel's input: e4m3(clamp(x / s)) x s."""
    xf = x.float() / scale
    return (xf.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
