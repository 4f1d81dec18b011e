"""Fused W4A16 GEMM in Triton over the compressed-tensors layout, read as written:
``packed`` int32 [N, K/8] (nibble q+8, element 8j+i in bits 4i..4i+3 of word j), ``scale``
bf16 [N, K/g]. Computes ``x @ W.T``, W = q * scale, fp32 accumulate and store (the interpreter
mis-stores bf16), bf16 returned.

Tiles for Hopper decode (small M): BLOCK_N 128 x BLOCK_K 128 per program, M tiled by 16; the
unpack is shifts and masks on a [BLOCK_N, BLOCK_K/8] word tile, the dequant a broadcast multiply
by the group's scale, then one ``tl.dot``. Runs on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, G,
                  sxm, sxk, swn, swk, ssn, ssg, sym, syn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                  DOT_DTYPE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + rn[:, None] * swn + rw[None, :] * swk, mask=(rn[:, None] < N) & (rw[None, :] < K // 8),
                        other=0)
        nib = (words[:, :, None] >> shifts) & 0xF  # [BN, BK/8, 8]
        q = tl.reshape(nib, (BLOCK_N, BLOCK_K)).to(tl.float32) - 8.0
        rg = rk // GROUP
        s = tl.load(s_ptr + rn[:, None] * ssn + rg[None, :] * ssg, mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0)
        b = (q * s.to(tl.float32)).to(DOT_DTYPE)
        acc += tl.dot(a.to(DOT_DTYPE), tl.trans(b))
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def w4a16_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int],
                 block_m: int = 16, block_n: int = 128, block_k: int = 128, num_warps: int = 4,
                 num_stages: int = 4) -> torch.Tensor:
    n, k = shape
    m = x.shape[0]
    group = k // scale.shape[1]
    block_k = min(block_k, k)
    if block_k % group and group % block_k:
        raise ValueError(f"BLOCK_K {block_k} and group {group} must nest")
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](x, packed, scale, y, m, n, k, scale.shape[1],
                        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
                        y.stride(0), y.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group,
                        DOT_DTYPE=tl.bfloat16 if x.is_cuda else tl.float32,
                        num_warps=num_warps, num_stages=num_stages)
    return y.to(torch.bfloat16)
