"""Split-K W4A16 GEMM in Triton over the compressed-tensors ``pack-quantized`` layout, read as written.

Layout (quantize/formats/int4.py, docs/formats.md): ``packed`` int32 [N, ceil(K/8)], nibble = q + 8
(``uint4b8``), element 8j+i in bits 4i..4i+3 of word j; ``scale`` [N, K/g] (bf16 as convert writes
it); W = q * scale, symmetric, no zero point. Computes ``x @ W.T`` for x [M, K] -> bf16 [M, N].

Grid: (M tiles, N tiles, K splits). At decode (M=1) an expert's N alone gives a few dozen tiles, far
fewer than a Hopper's 132 SMs; the K splits bring it to about ``2 x SMs`` programs (``default_config``).
Each program walks its K range BLOCK_K at a time, its loads staged ``num_stages`` deep: loads a
[BLOCK_N, BLOCK_K/8] tile of words, unpacks the 8 nibbles of each word with shifts and masks, multiplies
by the group's scale (one scale per word: g is a multiple of 8) and accumulates in fp32:

* BLOCK_M == 1: a broadcast multiply of the activation row and ``tl.sum`` (a GEMV; no tensor cores,
  no padding of M to 16), the program handling one row of x;
* BLOCK_M >= 16: the dequantized tile in the activation dtype and one ``tl.dot``.

Split-K reduction is deterministic: each split writes its fp32 partial to a workspace
[SPLIT_K, M, N], and a second small kernel (``_splitk_reduce``) sums the splits in a fixed order
(split 0, 1, ...) and writes bf16. No atomics, so the same inputs give the same bits on every run.
With SPLIT_K == 1 the GEMM kernel writes the output itself (one launch).

Under ``TRITON_INTERPRET=1`` (CPU tensors) the kernels run in Triton's interpreter, which rounds a
bf16 cast toward zero and mis-multiplies bf16 ``tl.dot``: there the dot is fp32 and the final
output is written fp32 and rounded to bf16 by torch.

Tile configs are a parameter (``Config``); ``TUNED`` holds configs measured on a GPU
(scripts/bench_kernels.py prints the winners of its sweep in this table's format), and
``default_config`` is the heuristic used for any shape it lacks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Config:
    block_m: int  # 1 (GEMV path) or a multiple of 16 (tl.dot path)
    block_n: int
    block_k: int  # a multiple of 8 (whole words)
    split_k: int  # K ranges, summed by the reduction pass when > 1
    num_warps: int = 4
    num_stages: int = 3

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}"
                f"w{self.num_warps}p{self.num_stages}")


# measured winners: (N, K, M bucket) -> Config (scripts/bench_kernels.py prints them in this format);
# measured on one H200 (torch 2.11+cu130, triton 3.6, group 32) by scripts/bench_kernels.py's sweep
# (scripts/gpu_check.sh, 2026-12-04): (N, K, M bucket) -> the fastest config that passed its reference check.
# The M=1 entries were measured before the GEMV loop staged its loads (2026-12-06): their num_stages did
# nothing then and now does; the next sweep re-measures them
TUNED: dict[tuple[int, int, int], Config] = {
    (512, 6144, 1): Config(1, 32, 512, 12, 4, 2),
    (512, 6144, 16): Config(16, 64, 128, 33, 4, 4),
    (512, 6144, 64): Config(32, 64, 128, 34, 4, 3),
    (512, 6144, 256): Config(64, 128, 64, 34, 4, 3),
    (512, 7168, 1): Config(1, 16, 512, 1, 4, 3),
    (512, 7168, 16): Config(16, 32, 256, 34, 4, 3),
    (512, 7168, 64): Config(32, 64, 128, 17, 4, 3),
    (512, 7168, 256): Config(128, 128, 64, 33, 8, 3),
    (4096, 6144, 1): Config(1, 16, 512, 1, 4, 3),
    (4096, 6144, 16): Config(16, 32, 256, 1, 4, 3),
    (4096, 6144, 64): Config(64, 64, 128, 1, 4, 3),
    (4096, 6144, 256): Config(128, 64, 128, 1, 8, 3),
    (4096, 7168, 1): Config(1, 16, 512, 1, 4, 3),
    (4096, 7168, 16): Config(16, 128, 128, 9, 8, 3),
    (4096, 7168, 64): Config(64, 64, 128, 10, 4, 3),
    (4096, 7168, 256): Config(128, 64, 128, 1, 8, 3),
    (6144, 256, 1): Config(1, 32, 256, 1, 4, 3),
    (6144, 256, 16): Config(16, 128, 128, 1, 8, 3),
    (6144, 256, 64): Config(64, 128, 64, 1, 4, 4),
    (6144, 256, 256): Config(64, 256, 64, 1, 8, 3),
    (6144, 2048, 1): Config(1, 16, 512, 1, 4, 3),
    (6144, 2048, 16): Config(16, 64, 256, 3, 4, 3),
    (6144, 2048, 64): Config(64, 64, 128, 6, 4, 3),
    (6144, 2048, 256): Config(128, 128, 64, 1, 8, 3),
    (7168, 256, 1): Config(1, 64, 128, 1, 4, 4),
    (7168, 256, 16): Config(16, 64, 128, 1, 4, 4),
    (7168, 256, 64): Config(64, 64, 128, 1, 4, 3),
    (7168, 256, 256): Config(64, 128, 64, 1, 4, 3),
    (7168, 2048, 1): Config(1, 16, 512, 1, 4, 3),
    (7168, 2048, 16): Config(16, 64, 256, 1, 4, 3),
    (7168, 2048, 64): Config(64, 128, 64, 5, 4, 4),
    (7168, 2048, 256): Config(128, 128, 64, 1, 8, 3),
}

DEFAULT_SMS = 132  # H100/H200 SXM


def m_bucket(m: int) -> int:
    return 1 if m == 1 else 16 if m <= 16 else 64 if m <= 64 else 256


def split_for(n_tiles: int, k: int, block_k: int, sms: int = DEFAULT_SMS, waves: int = 2) -> int:
    """K splits that bring ``n_tiles`` programs to about ``waves x sms``, at most one split per BLOCK_K."""
    want = -(-waves * sms // max(1, n_tiles))
    return max(1, min(want, -(-k // block_k)))


def heuristic_tiles(m: int, k: int) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages) for ``m`` rows and depth ``k``, by M bucket
    (not measured): what ``default_config`` and the MoE kernel's use for a shape no sweep measured."""
    if m == 1:
        bm, bn, bk, warps, stages = 1, 32, 256, 4, 3
    elif m <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = 32, 64, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = 64, 128, 64, 4, 3
    return bm, bn, min(bk, max(8, triton.next_power_of_2(k))), warps, stages


def default_config(m: int, n: int, k: int, sms: int = DEFAULT_SMS) -> Config:
    """The heuristic for a shape ``TUNED`` lacks (not measured: the sweep in scripts/bench_kernels.py is)."""
    hit = TUNED.get((n, k, m_bucket(m)))
    if hit is not None:
        return hit
    bm, bn, bk, warps, stages = heuristic_tiles(m, k)
    tiles = triton.cdiv(n, bn) * (m if bm == 1 else triton.cdiv(m, bm))
    return Config(bm, bn, bk, split_for(tiles, k, bk, sms), warps, stages)


@triton.jit
def _words_at(k0, BLOCK_K: tl.constexpr):
    """Word indices of K elements k0 .. k0+BLOCK_K-1; k0 is a multiple of BLOCK_K (each split starts at
    one), which the hints tell the compiler so that the word loads vectorize."""
    rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    return tl.max_contiguous(tl.multiple_of(rw, BLOCK_K // 8), BLOCK_K // 8)


@triton.jit
def _load_words(w_ptr, s_ptr, rn, k0, N, KW, G, swn, swk, ssn, ssg,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                FEW_SCALE_LOADS: tl.constexpr):
    """Rows ``rn`` [BN] x the BW = BLOCK_K/8 words from element k0 of the packed weight -> (int32 words
    [BN, BW], fp32 scales [BN, BW]: the group of each word, GROUP % 8 == 0 so a word's 8 elements share
    it). Out of range: 0. With FEW_SCALE_LOADS (the GEMV path) the scales are read as few times as the
    step allows: where whole groups tile it (GROUP a power of 2 dividing BLOCK_K) one contiguous
    [BN, BLOCK_K/GROUP] tile, repeated over each group's words in registers; where the step lies in one
    group (GROUP a multiple of BLOCK_K) one scale per row. Otherwise one load per word (the dot path: the
    repeat costs it registers; ptxas spilled m16n64k128s1w4p4 with it, kernels/aot.py)."""
    BW: tl.constexpr = BLOCK_K // 8
    rw = _words_at(k0, BLOCK_K)
    row_ok = rn[:, None] < N
    words = tl.load(w_ptr + rn[:, None] * swn + rw[None, :] * swk, mask=row_ok & (rw[None, :] < KW), other=0)
    if FEW_SCALE_LOADS and (BLOCK_K % GROUP == 0) and ((GROUP & (GROUP - 1)) == 0):
        NG: tl.constexpr = BLOCK_K // GROUP
        rg = k0 // GROUP + tl.arange(0, NG)
        s = tl.load(s_ptr + rn[:, None] * ssn + rg[None, :] * ssg, mask=row_ok & (rg[None, :] < G), other=0.0)
        s = tl.reshape(tl.broadcast_to(s.to(tl.float32)[:, :, None], (BLOCK_N, NG, GROUP // 8)), (BLOCK_N, BW))
    elif FEW_SCALE_LOADS and GROUP % BLOCK_K == 0:
        g1 = k0 // GROUP + tl.zeros_like(rn)  # past K (the last split): masked
        s1 = tl.load(s_ptr + rn * ssn + g1 * ssg, mask=(rn < N) & (g1 < G), other=0.0)
        s = tl.broadcast_to(s1.to(tl.float32)[:, None], (BLOCK_N, BW))
    else:
        grp = (rw * 8) // GROUP
        s = tl.load(s_ptr + rn[:, None] * ssn + grp[None, :] * ssg, mask=row_ok & (grp[None, :] < G),
                    other=0.0).to(tl.float32)
    return rw, words, s


@triton.jit
def _dequant_tile(words, s):
    """[BN, BW] words and scales -> fp32 [BN, 8*BW] in K order, (nibble - 8) * scale (element 8j+i of
    word j in bits 4i..4i+3; the mask drops an arithmetic shift's sign bits). The 8 nibbles are
    interleaved back into place (element 8j+i at column 8j+i) with ``tl.interleave``, which keeps a
    word's 8 elements in one thread: no 3-D broadcast across lanes."""
    e0 = (((words >> 0) & 0xF).to(tl.float32) - 8.0) * s
    e1 = (((words >> 4) & 0xF).to(tl.float32) - 8.0) * s
    e2 = (((words >> 8) & 0xF).to(tl.float32) - 8.0) * s
    e3 = (((words >> 12) & 0xF).to(tl.float32) - 8.0) * s
    e4 = (((words >> 16) & 0xF).to(tl.float32) - 8.0) * s
    e5 = (((words >> 20) & 0xF).to(tl.float32) - 8.0) * s
    e6 = (((words >> 24) & 0xF).to(tl.float32) - 8.0) * s
    e7 = (((words >> 28) & 0xF).to(tl.float32) - 8.0) * s
    # interleave(a, b)[2j] = a[j], [2j+1] = b[j]: evens (0, 2, 4, 6) then odds (1, 3, 5, 7), each
    # built the same way, land element i of word j at 8j+i
    even = tl.interleave(tl.interleave(e0, e4), tl.interleave(e2, e6))
    odd = tl.interleave(tl.interleave(e1, e5), tl.interleave(e3, e7))
    return tl.interleave(even, odd)


@triton.jit
def _gemv_words(x_row, sxk, words, s, rw, K):
    """One activation row against a [BN, BW] tile of words: fp32 [BN, BW] partial sums per word,
    scale x sum_i (nibble_i - 8) * x[8j+i], the x values read 8 strided vectors in the words' layout."""
    t = tl.zeros(words.shape, dtype=tl.float32)
    xs = tl.zeros(rw.shape, dtype=tl.float32)
    for i in tl.static_range(8):
        rk = rw * 8 + i
        xi = tl.load(x_row + rk * sxk, mask=rk < K, other=0.0).to(tl.float32)
        t += ((words >> (4 * i)) & 0xF).to(tl.float32) * xi[None, :]
        xs += xi
    return s * (t - 8.0 * xs[None, :])


# M and the group count are not specialized on (== 1, % 16): masks only. The scale row stride is (a
# multiple of 16 lets the GEMV path's [BLOCK_N, BLOCK_K/GROUP] scale tile load in vectors). KW = ceil(K/8)
# words per row is an argument so that its divisibility is known: the words' mask is then constant over
# a vector and their loads vectorize. The K loop stages its loads STAGES deep (``tl.range``: cp.async
# into shared memory ahead of use); Triton stages a loop's loads on its own only where they feed a dot,
# so the GEMV path (no dot) waited for its own loads at every step until it asked (kernels/aot.py).
@triton.jit(do_not_specialize=["M", "G"])
def _w4a16_splitk_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, KW, G, K_PER_SPLIT,
                         sxm, sxk, swn, swk, ssn, ssg, sos, som, son,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * K_PER_SPLIT
    if BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)  # summed across threads once, after the loop
        x_row = x_ptr + pid_m.to(tl.int64) * sxm
        for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=STAGES):  # past K (last split): masked
            k0 = k_lo + kk
            rw, words, s = _load_words(w_ptr, s_ptr, rn, k0, N, KW, G, swn, swk, ssn, ssg,
                                       BLOCK_N, BLOCK_K, GROUP, FEW_SCALE_LOADS=True)
            acc2 += _gemv_words(x_row, sxk, words, s, rw, K)
        acc = tl.sum(acc2, axis=1)
        dst = out_ptr + pid_k.to(tl.int64) * sos + pid_m.to(tl.int64) * som + rn * son
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=rn < N)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=STAGES):  # past K (last split): masked
            k0 = k_lo + kk
            rw, words, s = _load_words(w_ptr, s_ptr, rn, k0, N, KW, G, swn, swk, ssn, ssg,
                                       BLOCK_N, BLOCK_K, GROUP, FEW_SCALE_LOADS=False)
            b = _dequant_tile(words, s)  # [BLOCK_N, BLOCK_K]
            rk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            acc += tl.dot(a.to(DOT_DTYPE), tl.trans(b.to(DOT_DTYPE)))
        dst = out_ptr + pid_k.to(tl.int64) * sos + rm[:, None].to(tl.int64) * som + rn[None, :] * son
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _splitk_reduce(ws_ptr, y_ptr, NUMEL, SPLIT_K, BLOCK: tl.constexpr):
    """y[i] = sum over s in 0..SPLIT_K-1, in that order, of ws[s, i] (fp32), stored as y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT_K):
        acc += tl.load(ws_ptr + s * NUMEL + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


REDUCE_BLOCK = 1024


def check_config(cfg: Config, group: int) -> None:
    if cfg.block_m != 1 and cfg.block_m % 16:
        raise ValueError(f"{cfg}: BLOCK_M must be 1 (GEMV path) or a multiple of 16 (tl.dot)")
    if cfg.block_k % 8 or cfg.block_k & (cfg.block_k - 1) or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"{cfg}: BLOCK_N and BLOCK_K must be powers of 2, BLOCK_K at least 8")
    if group % 8:
        raise ValueError(f"group {group} is not a multiple of 8: a packed word would span two groups")
    if cfg.split_k < 1:
        raise ValueError(f"{cfg}: split_k must be at least 1")


def k_per_split(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(K elements per split, rounded up to BLOCK_K; the number of non-empty splits)."""
    per = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return per, triton.cdiv(k, per)


def finish_splits(ws: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """ws fp32 [S, *shape] -> sum over S in order, ``out_dtype``. On a GPU the reduction kernel
    writes ``out_dtype``; in the interpreter it writes fp32 and torch rounds (see module doc)."""
    split = ws.shape[0]
    numel = ws[0].numel()
    on_gpu = ws.is_cuda
    y = torch.empty(ws.shape[1:], dtype=out_dtype if on_gpu else torch.float32, device=ws.device)
    _splitk_reduce[(triton.cdiv(numel, REDUCE_BLOCK),)](ws, y, numel, split, BLOCK=REDUCE_BLOCK)
    return y if on_gpu else y.to(out_dtype)


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as built for a GPU run or for ``aot`` (compiled for a GPU that is not here):
    ``kernel[grid](*args, **kwargs)``."""
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


def splitk_launch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int, cfg: Config,
                  gpu: bool) -> tuple[Launch, torch.Tensor]:
    """The GEMM kernel's launch for a checked ``cfg`` and the buffer it writes: [1, M, N] (bf16 on a GPU)
    or the fp32 workspace [S, M, N] of S > 1 splits. ``gpu`` False: the interpreter's dtypes (module doc)."""
    m = x.shape[0]
    per, split = k_per_split(k, cfg.split_k, cfg.block_k)
    grid_m = m if cfg.block_m == 1 else triton.cdiv(m, cfg.block_m)
    dtype = torch.bfloat16 if (gpu and split == 1) else torch.float32
    out = torch.empty((split, m, n), dtype=dtype, device=x.device)
    grid = (grid_m, triton.cdiv(n, cfg.block_n), split)  # M (up to 2**31 - 1 programs) first; y, z < 65536
    args = (x, packed, scale, out, m, n, k, packed.shape[1], scale.shape[1], per,
            x.stride(0), x.stride(1), packed.stride(0), packed.stride(1),
            scale.stride(0), scale.stride(1), out.stride(0), out.stride(1), out.stride(2))
    kwargs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP=k // scale.shape[1],
                  DOT_DTYPE=tl.bfloat16 if gpu else tl.float32, STAGES=cfg.num_stages,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return Launch(_w4a16_splitk_kernel, grid, args, kwargs), out


def w4a16_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int],
                 config: Config | None = None, sms: int | None = None) -> torch.Tensor:
    """x [M, K] @ (q * scale).T -> bf16 [M, N]; ``config`` None: ``default_config`` (``TUNED`` first)."""
    n, k = shape
    m = x.shape[0]
    if x.shape[1] != k or packed.shape != (n, triton.cdiv(k, 8)) or scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"x {tuple(x.shape)}, packed {tuple(packed.shape)}, scale {tuple(scale.shape)} "
                         f"do not fit weight shape {(n, k)}")
    if config is None and sms is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else DEFAULT_SMS
    cfg = config or default_config(m, n, k, sms)
    check_config(cfg, k // scale.shape[1])
    launch, out = splitk_launch(x, packed, scale, n, k, cfg, x.is_cuda)
    launch()
    if out.shape[0] == 1:
        return out[0] if x.is_cuda else out[0].to(torch.bfloat16)
    return finish_splits(out, torch.bfloat16)
