"""Group-wise symmetric INT4 (W4A16) in compressed-tensors ``pack-quantized`` layout.

Pure tensor math, no I/O. The layout (docs/formats.md#pack-quantized-tensors, #bit-packing):

* ``weight_packed``  int32 ``[out, in/8]``: stored nibble = q + 8 (``uint4b8``), 8 nibbles per word,
  element ``8j+k`` in bits ``[4k, 4k+3]`` of word ``j`` — low bits first, packed along the input dim.
* ``weight_scale``   bf16 ``[out, in/group]`` (the source weight dtype), dequant = ``q * scale``.
* ``weight_shape``   int64 ``[2]``.

``minmax`` reproduces compressed-tensors' RTN bit for bit: ``scale = bf16(absmax / 7.5)`` (a zero
scale becomes bf16's eps), ``q = round(clamp(bf16(w / scale), -8, 7))``, everything rounded to bf16
where torch's bf16 eager ops round. ``mse`` searches a per-group shrink of the range
(compressed-tensors' ``memoryless_mse`` grid: 100 steps down to 0.8, error norm 2.4).

``fullrange`` uses all 16 codes: ``scale = bf16(e / -8)`` where ``e`` is the group's extreme value
WITH its sign, so ``e`` lands on code -8 and the other side reaches +7 (llama.cpp's Q4_0 and
AutoRound use this grid). The scale is negative when ``e`` is positive: to every dequantizer it is
just a number (``q * scale``), so the file format is unchanged. ``fullrange-mse`` runs the shrink
search on that grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import (  # noqa: F401
    NATIVE_OBSERVERS,
    NUM_BITS,
    OBSERVERS,
    SUPPORTED_GROUP_SIZES,
    packed_shape,
    scale_shape,
)

QMIN, QMAX = -8, 7
OFFSET = 8  # uint4b8: stored = q + 8
HALF_RANGE = 7.5  # (QMAX - QMIN) / 2, compressed-tensors' symmetric divisor

# compressed-tensors memoryless_mse defaults (observers/mse.py): grid, maxshrink, norm
MSE_GRID = 100
MSE_MAXSHRINK = 0.20
MSE_NORM = 2.4


@dataclass(frozen=True)
class Int4Result:
    packed: torch.Tensor  # int32 [out, in/8]
    scale: torch.Tensor  # scale_dtype [out, in/group]
    # error statistics against the input weight, summable over row chunks
    sq_err: float
    sq_ref: float
    max_abs_err: float

    @property
    def rel_err(self) -> float:
        return (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref > 0 else 0.0


def _minmax_scale(absmax: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """absmax (scale_dtype) -> scale (scale_dtype), as compressed-tensors computes it."""
    s = (absmax.float() / HALF_RANGE).to(scale_dtype)
    eps = torch.finfo(scale_dtype).eps
    return torch.where(s == 0, torch.tensor(eps, dtype=scale_dtype, device=s.device), s)


def _fullrange_scale(extreme: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """signed extreme (scale_dtype) -> scale putting it on code -8 (a zero scale becomes eps)."""
    s = (extreme.float() / QMIN).to(scale_dtype)
    eps = torch.finfo(scale_dtype).eps
    return torch.where(s == 0, torch.tensor(eps, dtype=scale_dtype, device=s.device), s)


def _signed_extreme(wq: torch.Tensor) -> torch.Tensor:
    """[..., g] -> the element of largest magnitude, with its sign (first one on ties)."""
    return wq.gather(-1, wq.abs().argmax(-1, keepdim=True)).squeeze(-1)


def _codes(wg: torch.Tensor, scale: torch.Tensor, work_dtype: torch.dtype) -> torch.Tensor:
    """wg float32 [..., G, g], scale [..., G] -> integer codes as float32 in [-8, 7]."""
    x = (wg / scale.float().unsqueeze(-1)).to(work_dtype).float()
    return x.clamp_(QMIN, QMAX).round_()


def quantize_groups(
    w: torch.Tensor,
    group_size: int,
    observer: str = "minmax",
    scale_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype; rounded to ``scale_dtype`` first, like compressed-tensors'
    bf16 module) -> (q int8 [out, in] in [-8, 7], scale [out, in/group])."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    out, k = w.shape
    if k % group_size:
        raise ValueError(f"input dim {k} is not a multiple of group size {group_size}")
    if observer not in GRIDS:
        raise ValueError(f"unknown observer {observer!r}; choose one of {', '.join(GRIDS)}")
    wq = w.to(scale_dtype)  # the module dtype compressed-tensors quantizes from
    wg = wq.float().view(out, k // group_size, group_size)
    grid = GRIDS[observer]
    rng = grid.range(wq.view(out, k // group_size, group_size))
    scale = _mse_scale(wg, rng, scale_dtype, grid.scale) if grid.search else grid.scale(rng, scale_dtype)
    q = _codes(wg, scale, scale_dtype)
    return q.to(torch.int8).view(out, k), scale


def _mse_scale(wg: torch.Tensor, absmax: torch.Tensor, scale_dtype: torch.dtype, grid=_minmax_scale) -> torch.Tensor:
    """Per-group shrink search: for p in 1, 0.998, ..., 0.8 pick the scale minimising
    sum |w - dequant(quant(w))|^2.4 over the group. ``grid`` maps the (shrunk) range to a scale:
    compressed-tensors' absmax / 7.5, or the full-range signed extreme / -8."""
    best_err = torch.full(absmax.shape, float("inf"), device=absmax.device)
    best = grid(absmax, scale_dtype)
    steps = int(MSE_MAXSHRINK * MSE_GRID)
    for i in range(steps + 1):
        p = 1.0 - i / MSE_GRID
        cand = grid((absmax.float() * p).to(scale_dtype), scale_dtype)
        q = _codes(wg, cand, scale_dtype)
        err = (q.mul_(cand.float().unsqueeze(-1)).sub_(wg)).abs_().pow_(MSE_NORM).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, cand, best)
    return best


def weighted_scale(w: torch.Tensor, importance: torch.Tensor, group_size: int, observer: str,
                   scale_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per-group scale of ``observer``'s grid (its range shrunk by p in 1, 0.99, ..., 0.8) that
    minimises the importance-weighted squared error ``sum_j importance_j (w_j - s q_j)^2`` over the
    group: the imatrix idea (llama.cpp's importance matrix), ``importance`` the diagonal of the layer
    input's Hessian (mean x_j^2 over the calibration tokens), so the columns the activations drive
    hardest decide the clipping. ``w`` [out, in], ``importance`` [in] -> scale [out, in/group]. p = 1
    (plain RTN) wins ties, so a zero importance gives RTN's scale."""
    if w.ndim != 2 or importance.shape != (w.shape[1],):
        raise ValueError(f"expected w [out, in] and importance [in], got {tuple(w.shape)} and "
                         f"{tuple(importance.shape)}")
    out, k = w.shape
    if k % group_size:
        raise ValueError(f"input dim {k} is not a multiple of group size {group_size}")
    grid = GRIDS[observer]
    wq = w.to(scale_dtype)
    wg = wq.float().view(out, k // group_size, group_size)
    imp = importance.float().clamp_min(0).view(1, k // group_size, group_size)
    rng = grid.range(wq.view(out, k // group_size, group_size))
    best = grid.scale(rng, scale_dtype)
    best_err = torch.full(rng.shape, float("inf"), device=w.device)
    for _, cand in _shrunk_scales(rng, grid, scale_dtype):
        q = _codes(wg, cand, scale_dtype)
        err = (q.mul_(cand.float().unsqueeze(-1)).sub_(wg)).pow_(2).mul_(imp).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, cand, best)
    return best


WEIGHTED_STEPS = 20  # shrink candidates of ``weighted_scale`` (p from 1 down to 1 - WEIGHTED_MAXSHRINK)
WEIGHTED_MAXSHRINK = 0.20


def _shrunk_scales(rng: torch.Tensor, grid: "Grid", scale_dtype: torch.dtype):
    """``weighted_scale``'s candidates: (p, the grid's scale of the range ``rng`` shrunk by p) for p
    in 1 (RTN), 0.99, ..., 1 - WEIGHTED_MAXSHRINK."""
    for i in range(WEIGHTED_STEPS + 1):
        p = 1.0 - i * WEIGHTED_MAXSHRINK / WEIGHTED_STEPS
        yield p, grid.scale((rng.float() * p).to(scale_dtype), scale_dtype)


def shrink_of(w: torch.Tensor, scale: torch.Tensor, group_size: int, observer: str,
              scale_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of ``weighted_scale``'s choice: per group of ``w`` [out, in], the largest shrink
    candidate whose scale on ``observer``'s grid is ``scale`` [out, in/group] bit for bit (1 for
    RTN's own scale), nan where none is. float32 [out, in/group]."""
    out, k = w.shape
    grid = GRIDS[observer]
    rng = grid.range(w.to(scale_dtype).view(out, k // group_size, group_size))
    found = torch.full(rng.shape, float("nan"), device=w.device)
    for p, cand in _shrunk_scales(rng, grid, scale_dtype):
        found = torch.where(found.isnan() & (cand == scale.to(cand.device)), torch.tensor(p, device=w.device), found)
    return found


def _absmax(groups: torch.Tensor) -> torch.Tensor:
    return groups.abs().amax(-1)


@dataclass(frozen=True)
class Grid:
    """An RTN observer: the range a group is measured by (``range``: [..., g] -> [...]), the scale
    that range maps to (``scale``), whether a per-group shrink of the range is searched, and
    whether its scales can be negative (``signed``: the range keeps the extreme's sign)."""

    range: object
    scale: object
    search: bool = False
    signed: bool = False


# the observers, keyed as formats/layout.py's OBSERVERS (which holds their names without torch)
GRIDS = {
    "minmax": Grid(_absmax, _minmax_scale),
    "mse": Grid(_absmax, _minmax_scale, search=True),
    "fullrange": Grid(_signed_extreme, _fullrange_scale, signed=True),
    "fullrange-mse": Grid(_signed_extreme, _fullrange_scale, search=True, signed=True),
}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 [out, in] in [-8, 7] (in % 8 == 0) -> int32 [out, in/8], low nibble first."""
    out, k = q.shape
    if k % 8:
        raise ValueError(f"input dim {k} is not a multiple of 8")
    u = (q.to(torch.int16) + OFFSET).to(torch.uint8)
    # byte j of the little-endian word holds elements 2j (low nibble) and 2j+1 (high nibble)
    b = u[:, 0::2] | (u[:, 1::2] << 4)
    return b.contiguous().view(torch.int32)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [out, ceil(k/8)] -> int8 [out, k] in [-8, 7]."""
    b = packed.contiguous().view(torch.uint8)
    out = b.shape[0]
    u = torch.empty((out, b.shape[1] * 2), dtype=torch.uint8, device=b.device)
    u[:, 0::2] = b & 0xF
    u[:, 1::2] = b >> 4
    return (u[:, :k].to(torch.int16) - OFFSET).to(torch.int8)


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], dtype=torch.bfloat16, exact: bool = False
) -> torch.Tensor:
    """compressed-tensors' decompression: q * scale in the scale dtype. ``exact``: the product in
    fp32 instead (a code times a BF16/F16 scale is exact there, not always in BF16)."""
    out, k = shape
    q = unpack_int4(packed, k)
    g = k // scale.shape[1]
    work = torch.float32 if exact else scale.dtype
    deq = q.to(work).view(out, scale.shape[1], g) * scale.to(work).unsqueeze(-1)
    return deq.view(out, k).to(dtype)


def quantize_pack(
    w: torch.Tensor,
    group_size: int,
    observer: str = "minmax",
    scale_dtype: torch.dtype = torch.bfloat16,
) -> Int4Result:
    """Quantize, pack and measure: the whole per-tensor job of ``convert``."""
    q, scale = quantize_groups(w, group_size, observer, scale_dtype)
    out, k = w.shape
    ref = w.to(scale_dtype).float()
    deq = q.float().view(out, k // group_size, group_size) * scale.float().unsqueeze(-1)
    diff = deq.view(out, k).sub_(ref)
    sq_ref = float(ref.pow(2).sum(dtype=torch.float64))
    sq_err = float(diff.pow(2).sum(dtype=torch.float64))
    return Int4Result(pack_int4(q), scale, sq_err, sq_ref, float(diff.abs().max()) if diff.numel() else 0.0)


def error_sums(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> tuple[float, float, float]:
    """(squared error, squared reference, max abs error) of stored codes and scales against the
    weight rows ``w`` they were made from (the reference rounded to the scale dtype, as
    ``quantize_pack`` measures it): how ``convert`` records a data-aware method's tensor, and how
    ``check --source`` recomputes that record."""
    rows, k = w.shape
    ref = w.to(scale.dtype).float()
    diff = dequantize_int4(packed, scale, (rows, k), dtype=torch.float32).sub_(ref)
    return (
        float(diff.pow(2).sum(dtype=torch.float64)),
        float(ref.pow(2).sum(dtype=torch.float64)),
        float(diff.abs().max()) if diff.numel() else 0.0,
    )


# rows per block in the *_rows forms: a few MB of fp32 temporaries, which the allocator hands back
# for the next block. Whole-tensor temporaries (several fp32 copies of a 2048 x 6144 expert, 50 MB
# each) come from fresh pages every tensor: 2048 x 6144 FP8 experts, `check --source`'s re-derivation
# and error sums took 0.48 s each (0.5 s of it in the kernel's page faults) where row blocks of 128
# take 0.11 s (24 experts side by side on a 2-core machine, 2026-12-06).
ROWS = 128


def row_blocks(n: int, rows: int = ROWS) -> list[tuple[int, int]]:
    """(start, stop) of ``n`` rows in blocks of ``rows``, the last one partial."""
    return [(r0, min(n, r0 + rows)) for r0 in range(0, n, rows)]


def quantize_pack_rows(w: torch.Tensor, group_size: int, observer: str = "minmax",
                       scale_dtype: torch.dtype = torch.bfloat16, rows: int = ROWS) -> Int4Result:
    """``quantize_pack`` a block of ``rows`` rows at a time: the same codes and scales (every group
    lies in one row), the same max; the sums added block by block (another order of addition,
    ~1e-16 relative)."""
    out, k = w.shape
    if out <= rows:
        return quantize_pack(w, group_size, observer, scale_dtype)
    packed = torch.empty(packed_shape((out, k)), dtype=torch.int32, device=w.device)
    scale = torch.empty(scale_shape((out, k), group_size), dtype=scale_dtype, device=w.device)
    sq_err = sq_ref = max_err = 0.0
    for r0, r1 in row_blocks(out, rows):
        res = quantize_pack(w[r0:r1], group_size, observer, scale_dtype)
        packed[r0:r1], scale[r0:r1] = res.packed, res.scale
        sq_err, sq_ref, max_err = sq_err + res.sq_err, sq_ref + res.sq_ref, max(max_err, res.max_abs_err)
    return Int4Result(packed, scale, sq_err, sq_ref, max_err)


def error_sums_rows(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    rows: int = ROWS) -> tuple[float, float, float]:
    """``error_sums`` a block of ``rows`` rows at a time (the max the same, the sums ~1e-16 apart)."""
    sq_err = sq_ref = max_err = 0.0
    for r0, r1 in row_blocks(w.shape[0], rows):
        e, r, m = error_sums(w[r0:r1], packed[r0:r1], scale[r0:r1])
        sq_err, sq_ref, max_err = sq_err + e, sq_ref + r, max(max_err, m)
    return sq_err, sq_ref, max_err


def weights_args(group_size: int, observer: str | None = None) -> dict:
    """The ``weights`` QuantizationArgs dict compressed-tensors 0.19 writes for W4A16, from its own
    pydantic model."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(
        num_bits=NUM_BITS,
        type="int",
        symmetric=True,
        strategy="group",
        group_size=group_size,
        dynamic=False,
        observer=observer,
    ).model_dump(mode="json")


def bitwise_diff(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when bit-identical, else how they differ."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} where the source implies {b.dtype}{list(b.shape)}"
    av, bv = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    if torch.equal(av, bv):
        return None
    n = int((a.reshape(-1).view(torch.uint8).view(-1, a.element_size())
             != b.reshape(-1).view(torch.uint8).view(-1, b.element_size())).any(1).sum())
    return f"{n} of {a.numel()} values differ"
