"""A routed-experts (MoE) layer over compressed-tensors INT4 experts, without Triton: the token sort
the fused kernel needs (``moe_align``), the fp32 reference of the whole layer, and a CPU path
(torch's int4 CPU GEMM per expert). The fused Triton kernel is ``triton_moe.py``.

The layer's math is transformers' DeepSeek-V3 / GLM-MoE-DSA experts forward
(``DeepseekV3Experts.forward``): per routed (token, expert) pair ``down(silu(gate(x)) * up(x))``
times the router's weight, summed over the token's top-k experts. The reference is
``quantize.calibrate.experts.accumulate`` (that forward, op for op) run in fp32 on the dequantized
weights. Expert weights are stacked: ``w13`` [E, 2I, H/8] (gate rows then up rows: packing runs along
K, so concatenating along N keeps the layout), ``s13`` [E, 2I, H/g], ``w2`` [E, H, I/8], ``s2`` [E, H, I/g].
"""

from __future__ import annotations

import torch

from quantize.calibrate.experts import Routed, accumulate
from quantize.kernels.reference import dequant_fp32


def align_blocks(pairs: int, block_m: int, num_experts: int) -> int:
    """``moe_align``'s upper bound on the blocks of ``pairs`` routed pairs: at most min(pairs, E) experts
    are non-empty, each padding fewer than ``block_m``."""
    return -(-min(pairs + num_experts * (block_m - 1), pairs * block_m) // block_m)


def moe_align(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """Sort the T*topk (token, expert) pairs by expert, each expert's run padded to a multiple of
    ``block_m`` with the sentinel T*topk (as vLLM/SGLang's ``moe_align_block_size``), on the ids'
    device, without a host sync. -> (sorted_ids int32 [B*block_m], expert_ids int32 [B],
    num_post_padded int32 [1]); B is an upper bound on the blocks (blocks past num_post_padded are
    empty), pair p = token p // topk, slot p % topk. Within an expert the pairs keep their order."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    tk = flat.numel()
    dev = flat.device
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    dest = pad_start[e_sorted] + torch.arange(tk, device=dev) - cnt_start[e_sorted]
    blocks = align_blocks(tk, block_m, num_experts)
    sorted_ids = torch.full((blocks * block_m,), tk, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(blocks, device=dev, dtype=torch.int64) * block_m
    expert_ids = torch.searchsorted(pad_end, starts, right=True).clamp_max(num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)


def silu_and_mul(y13: torch.Tensor) -> torch.Tensor:
    """[P, 2I] -> [P, I]: silu(gate) * up in fp32 (SGLang/vLLM's SiluAndMul), in y13's dtype."""
    i = y13.shape[-1] // 2
    g, u = y13[..., :i].float(), y13[..., i:].float()
    return (torch.nn.functional.silu(g) * u).to(y13.dtype)


def combine(y2: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Expert outputs [T*topk, H] -> [T, H]: weighted by the router and summed over top-k, in fp32."""
    t, topk = topk_weights.shape
    return (y2.view(t, topk, -1).float() * topk_weights.float().unsqueeze(-1)).sum(1).to(out_dtype)


def dequant_stack(w: torch.Tensor, s: torch.Tensor, k: int) -> torch.Tensor:
    """[E, N, K/8] / [E, N, K/g] -> fp32 [E, N, K], exact (code x scale in fp32)."""
    return torch.stack([dequant_fp32(w[e], s[e], (w.shape[1], k)) for e in range(w.shape[0])])


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """fp32 [T, H]: transformers' experts forward (``accumulate``) on the dequantized experts."""
    h = x.shape[1]
    i = w2.shape[2] * 8
    gate_up, down = dequant_stack(w13, s13, h), dequant_stack(w2, s2, i)
    out = torch.zeros(x.shape, dtype=torch.float32)
    r = Routed(x.float().cpu(), topk_ids.cpu(), topk_weights.float().cpu())
    accumulate(out, r, range(w13.shape[0]), gate_up.cpu(), down.cpu(), torch.nn.functional.silu)
    return out


def moe_layer_cpu(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The layer through torch's int4 CPU GEMM, one expert at a time (no Triton): bf16 [T, H]."""
    from quantize.kernels.cpu import CpuW4A16

    t, h = x.shape
    topk = topk_ids.shape[1]
    i2, i = w13.shape[1], w2.shape[2] * 8
    xb = x.to(torch.bfloat16)
    y2 = torch.zeros((t * topk, h), dtype=torch.bfloat16)
    flat = topk_ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        pairs = torch.nonzero(flat == e).squeeze(1)
        gu = CpuW4A16.from_packed(w13[e], s13[e], (i2, h))(xb[pairs // topk])
        y2[pairs] = CpuW4A16.from_packed(w2[e], s2[e], (h, i))(silu_and_mul(gu))
    return combine(y2, topk_weights, torch.bfloat16)
