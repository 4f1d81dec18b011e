"""Fused MoE W4A16 GEMM in Triton: every routed expert of a layer in one launch, over the
compressed-tensors ``pack-quantized`` layout stacked per expert (``w`` int32 [E, N, K/8], ``scale``
[E, N, K/g]; element 8j+i in bits 4i..4i+3 of word j, nibble q + 8, W = q * scale).

The scheme is SGLang's ``fused_moe_kernel_gptq_awq`` (sglang/srt/layers/moe/fused_moe_triton): the
T*topk (token, expert) pairs are sorted by expert and padded per expert to BLOCK_M (``moe.moe_align``),
each block of BLOCK_M pairs belongs to one expert (``expert_ids``), and one program computes a
[BLOCK_M, BLOCK_N] tile of that expert's output, reading the expert's packed words and scales in
place. What differs: the weight is read in the compressed-tensors layout as written ([N, K/8] rows,
not AWQ/GPTQ's [K/8, N]), blocks past the padded length exit at once, and K may be split (a
workspace and the same deterministic reduction as ``triton_w4a16``), which keeps ~2 x SMs programs
busy at decode where a TP8 shard has few N tiles. BLOCK_M == 1 aligns pairs one per block (no
padding) and multiplies with ``tl.sum`` instead of ``tl.dot``.

Output: [T*topk, N], row p for pair p (token p // topk); the caller applies activation and router
weights (``moe_layer``: gate_up -> SiluAndMul -> down -> weighted sum over top-k, transformers'
DeepSeek-V3 experts math, checked against ``moe.moe_reference``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantize.kernels.moe import combine, moe_align, silu_and_mul
from quantize.kernels.triton_w4a16 import (
    DEFAULT_SMS,
    Config,
    Launch,
    _dequant_tile,
    _gemv_words,
    _load_words,
    check_config,
    finish_splits,
    heuristic_tiles,
    k_per_split,
    m_bucket,
    split_for,
)


# measured winners: (N, K, M bucket) -> Config (scripts/bench_kernels.py prints them in this format);
# measured on one H200 (torch 2.11+cu130, triton 3.6, group 32) by scripts/bench_kernels.py's sweep
# (scripts/gpu_check.sh, 2026-12-04): (N, K, M bucket) -> the fastest config that passed its reference check.
# The M=1 entries were measured before the GEMV loop staged its loads (2026-12-06; triton_w4a16's TUNED)
MOE_TUNED: dict[tuple[int, int, int], Config] = {
    (512, 6144, 1): Config(1, 32, 256, 6, 4, 3),
    (512, 6144, 16): Config(16, 128, 128, 18, 8, 3),
    (512, 6144, 64): Config(64, 64, 128, 10, 4, 3),
    (512, 6144, 256): Config(128, 128, 64, 5, 8, 3),
    (512, 7168, 1): Config(1, 16, 512, 4, 4, 3),
    (512, 7168, 16): Config(16, 64, 128, 10, 4, 4),
    (512, 7168, 64): Config(32, 64, 128, 3, 4, 3),
    (512, 7168, 256): Config(64, 128, 64, 3, 4, 3),
    (4096, 6144, 1): Config(1, 16, 512, 1, 4, 3),
    (4096, 6144, 16): Config(16, 64, 128, 1, 4, 4),
    (4096, 6144, 64): Config(64, 128, 64, 4, 4, 4),
    (4096, 6144, 256): Config(128, 128, 64, 1, 8, 3),
    (4096, 7168, 1): Config(1, 32, 256, 2, 4, 3),
    (4096, 7168, 16): Config(16, 64, 128, 1, 4, 4),
    (4096, 7168, 64): Config(64, 128, 64, 4, 4, 4),
    (4096, 7168, 256): Config(128, 128, 64, 1, 8, 3),
    (6144, 256, 1): Config(16, 64, 128, 1, 4, 4),
    (6144, 256, 16): Config(16, 128, 128, 2, 8, 3),
    (6144, 256, 64): Config(64, 128, 64, 1, 4, 4),
    (6144, 256, 256): Config(128, 128, 64, 1, 8, 3),
    (6144, 2048, 1): Config(1, 16, 512, 1, 4, 3),
    (6144, 2048, 16): Config(16, 64, 128, 1, 4, 4),
    (6144, 2048, 64): Config(64, 128, 64, 1, 4, 4),
    (6144, 2048, 256): Config(128, 128, 64, 1, 8, 3),
    (7168, 256, 1): Config(1, 32, 256, 1, 4, 3),
    (7168, 256, 16): Config(16, 64, 128, 1, 4, 4),
    (7168, 256, 64): Config(64, 64, 128, 1, 4, 3),
    (7168, 256, 256): Config(128, 128, 64, 1, 8, 3),
    (7168, 2048, 1): Config(1, 16, 512, 1, 4, 3),
    (7168, 2048, 16): Config(16, 64, 128, 1, 4, 4),
    (7168, 2048, 64): Config(64, 64, 128, 1, 4, 3),
    (7168, 2048, 256): Config(128, 128, 64, 1, 8, 3),
}


def default_moe_config(pairs: int, n: int, k: int, sms: int = DEFAULT_SMS, experts: int = 1) -> Config:
    """Tiles for ``pairs`` = T*topk routed rows over ``experts`` active experts: ``MOE_TUNED``, else a
    heuristic (not measured)."""
    rows = max(1, -(-pairs // max(1, experts)))  # rows per active expert
    hit = MOE_TUNED.get((n, k, m_bucket(rows)))
    if hit is not None:
        return hit
    bm, bn, bk, warps, stages = heuristic_tiles(rows, k)
    blocks = experts * -(-rows // bm)
    return Config(bm, bn, bk, split_for(blocks * triton.cdiv(n, bn), k, bk, sms), warps, stages)


def interpreter_config(pairs: int, n: int, k: int, sms: int = DEFAULT_SMS, experts: int = 1) -> Config:
    """CPU tensors run in Triton's interpreter, whose cost is per program: the fewest, largest tiles."""
    return Config(16, min(1024, triton.next_power_of_2(n)), min(512, max(8, triton.next_power_of_2(k))), 1)


@triton.jit(do_not_specialize=["G", "NUM_PAIRS"])  # as triton_w4a16's kernel
def _moe_w4a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, expert_ptr, npost_ptr,
                      N, K, KW, G, NUM_PAIRS, X_ROW_DIV, K_PER_SPLIT,
                      sxm, sxk, swe, swn, swk, sse, ssn, ssg, sos, som, son,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    wp = w_ptr + e * swe
    sp = s_ptr + e * sse
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * K_PER_SPLIT
    out_split = out_ptr + pid_k.to(tl.int64) * sos
    if BLOCK_M == 1:
        pair = tl.load(sorted_ptr + pid_m).to(tl.int64)
        x_row = x_ptr + (pair // X_ROW_DIV) * sxm
        acc2 = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)  # summed across threads once, after the loop
        for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=STAGES):  # past K (last split): masked
            k0 = k_lo + kk
            rw, words, s = _load_words(wp, sp, rn, k0, N, KW, G, swn, swk, ssn, ssg,
                                       BLOCK_N, BLOCK_K, GROUP, FEW_SCALE_LOADS=True)
            acc2 += _gemv_words(x_row, sxk, words, s, rw, K)
        acc = tl.sum(acc2, axis=1)
        tl.store(out_split + pair * som + rn * son, acc.to(out_ptr.dtype.element_ty), mask=rn < N)
    else:
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = pairs < NUM_PAIRS
        rows = pairs // X_ROW_DIV
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=STAGES):  # past K (last split): masked
            k0 = k_lo + kk
            rw, words, s = _load_words(wp, sp, rn, k0, N, KW, G, swn, swk, ssn, ssg,
                                       BLOCK_N, BLOCK_K, GROUP, FEW_SCALE_LOADS=False)
            b = _dequant_tile(words, s)
            rk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
            a = tl.load(x_ptr + rows[:, None] * sxm + rk[None, :] * sxk,
                        mask=valid[:, None] & (rk[None, :] < K), other=0.0)
            acc += tl.dot(a.to(DOT_DTYPE), tl.trans(b.to(DOT_DTYPE)))
        tl.store(out_split + pairs[:, None] * som + rn[None, :] * son, acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (rn[None, :] < N))


def moe_launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, align, num_pairs: int, x_row_div: int,
               config: Config, k: int, gpu: bool) -> tuple[Launch, torch.Tensor]:
    """The fused kernel's launch for a checked ``config`` and the buffer it writes: [1, P, N] (bf16 on a
    GPU) or the fp32 workspace [S, P, N] of S > 1 splits; ``gpu`` False: the interpreter's dtypes."""
    e, n, kw = w.shape
    sorted_ids, expert_ids, npost = align
    per, split = k_per_split(k, config.split_k, config.block_k)
    dtype = torch.bfloat16 if (gpu and split == 1) else torch.float32
    out = torch.empty((split, num_pairs, n), dtype=dtype, device=x.device)
    grid = (expert_ids.numel(), triton.cdiv(n, config.block_n), split)  # blocks first: y, z < 65536
    args = (x, w, scale, out, sorted_ids, expert_ids, npost, n, k, kw, scale.shape[2], num_pairs, x_row_div, per,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
            scale.stride(0), scale.stride(1), scale.stride(2), out.stride(0), out.stride(1), out.stride(2))
    kwargs = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  GROUP=k // scale.shape[2], DOT_DTYPE=tl.bfloat16 if gpu else tl.float32,
                  STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages)
    return Launch(_moe_w4a16_kernel, grid, args, kwargs), out


def moe_w4a16(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, align, num_pairs: int, x_row_div: int,
              config: Config, k: int | None = None) -> torch.Tensor:
    """One grouped GEMM over all experts: pair p's row of x is ``p // x_row_div`` (topk for the
    first GEMM of a layer, 1 for the second, whose input has one row per pair). ``align``:
    ``moe_align(topk_ids, config.block_m, E)``. -> bf16 [num_pairs, N]."""
    e, n, kw = w.shape
    k = k if k is not None else kw * 8
    if x.shape[1] != k or scale.shape[:2] != (e, n) or k % scale.shape[2]:
        raise ValueError(f"x {tuple(x.shape)}, w {tuple(w.shape)}, scale {tuple(scale.shape)} do not fit K {k}")
    check_config(config, k // scale.shape[2])
    sorted_ids, expert_ids, _ = align
    if sorted_ids.numel() != expert_ids.numel() * config.block_m:
        raise ValueError(f"align was made for another BLOCK_M than {config.block_m}")
    launch, out = moe_launch(x, w, scale, align, num_pairs, x_row_div, config, k, x.is_cuda)
    launch()
    if out.shape[0] == 1:
        return out[0] if x.is_cuda else out[0].to(torch.bfloat16)
    return finish_splits(out, torch.bfloat16)


def moe_layer(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
              s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, config13: Config | None = None,
              config2: Config | None = None, sms: int | None = None) -> torch.Tensor:
    """x [T, H] routed to ``topk_ids`` [T, topk] with ``topk_weights``: gate_up (one launch) ->
    SiluAndMul -> down (one launch) -> weighted sum over top-k. -> bf16 [T, H]."""
    t, h = x.shape
    topk = topk_ids.shape[1]
    e, i2 = w13.shape[0], w13.shape[1]
    i = w2.shape[2] * 8
    if sms is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else DEFAULT_SMS
    active = min(e, t * topk)
    pick = default_moe_config if x.is_cuda else interpreter_config
    c13 = config13 or pick(t * topk, i2, h, sms, active)
    c2 = config2 or pick(t * topk, h, i, sms, active)
    aligns = {bm: moe_align(topk_ids, bm, e) for bm in {c13.block_m, c2.block_m}}
    y13 = moe_w4a16(x.to(torch.bfloat16), w13, s13, aligns[c13.block_m], t * topk, topk, c13, h)
    y2 = moe_w4a16(silu_and_mul(y13), w2, s2, aligns[c2.block_m], t * topk, 1, c2, i)
    return combine(y2, topk_weights, torch.bfloat16)
