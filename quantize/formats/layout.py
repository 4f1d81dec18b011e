"""Shapes and names of the formats, without tensors: what ``plan`` needs to size an output from
headers alone (kept free of torch so ``quantize plan`` starts in well under a second)."""

from __future__ import annotations

import math

# INT4 pack-quantized (docs/formats.md#int4-pack-quantized)
NUM_BITS = 4
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# the RTN observers (the grid a group's scale is chosen on) and what the card says of each; their
# math is formats/int4.py's GRIDS table, keyed the same (tests/test_formats.py checks both agree)
OBSERVERS = {
    "minmax": "round-to-nearest, scale = group absmax / 7.5 (compressed-tensors' RTN, as llm-compressor's "
    "model_free_ptq)",
    "mse": "round-to-nearest with a per-group clipping search (the scale minimising the group's error)",
    "fullrange": "round-to-nearest over all 16 codes (scale = the group's signed extreme / -8)",
    "fullrange-mse": "all 16 codes with a per-group clipping search",
}
# what quant.c implements; the others run the torch path. mse is not among them: its clipping search sums each
# candidate's error, and a sum in another order (the C loop's) picked the neighbouring shrink at a near-tie,
# about 1 group in 230,000, which `check --source` (it re-derives RTN scales with the torch path) then
# refused; the torch search was also 3x faster (1.0 against 3.0 s for a 2048 x 7168 FP8 expert matrix).
NATIVE_OBSERVERS = ("minmax", "fullrange")

# FP8 block (docs/formats.md#block-fp8)
DEFAULT_BLOCK = (128, 128)


def packed_shape(shape: tuple[int, int]) -> tuple[int, int]:
    out, k = shape
    return (out, (k * NUM_BITS + 31) // 32)


def scale_shape(shape: tuple[int, int], group_size: int) -> tuple[int, int]:
    out, k = shape
    return (out, k // group_size)


def block_grid(shape: tuple[int, int], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """Scale grid for a [rows, cols] weight: ceil on both axes (576 rows -> 5 scale rows)."""
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


# The dtypes the readers decode (docs/formats.md#block-fp8-scales): an FP8 weight is e4m3 and 2-D
# [out, in]; its scale is a float, or a UE8M0 exponent (float8_e8m0fnu, or uint8 read as 2**(b-127)
# by formats/fp8.py's scale_as_float) on a block grid. An integer scale (I32) would be read as its
# value and make every weight ~1e9 too large.
FP8_WEIGHT_DTYPE = "F8_E4M3"
FP8_SCALE_DTYPES = {"block": ("F32", "BF16", "F8_E8M0", "U8"), "channel": ("F32", "BF16")}
FLOAT_WEIGHT_DTYPES = ("BF16", "F16", "F32", FP8_WEIGHT_DTYPE)  # a Linear weight this tool reads


def fp8_weight_error(shape: tuple[int, ...]) -> str | None:
    """Why an FP8 weight of ``shape`` cannot be read, or None."""
    if len(shape) != 2:
        return f"is a {len(shape)}-D FP8 tensor {list(shape)}; an FP8 weight is 2-D [out, in]"
    return None


def fp8_scale_error(scale_dtype: str, kind: str) -> str | None:
    """Why an FP8 scale of ``scale_dtype`` stored as a ``kind`` ("block" | "channel") scale
    cannot be read, or None."""
    ok = FP8_SCALE_DTYPES[kind]
    if scale_dtype not in ok:
        return f"has dtype {scale_dtype}; a {kind} FP8 scale must be {' or '.join(ok)}"
    return None
