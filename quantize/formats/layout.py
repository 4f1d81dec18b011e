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
NATIVE_OBSERVERS = ("minmax", "mse")  # what quant.c implements; the others run the torch path

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
