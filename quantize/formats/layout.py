"""Shapes and names of the formats, without tensors: what ``plan`` needs to size an output from
headers alone (kept free of torch so ``quantize plan`` starts in well under a second)."""

from __future__ import annotations

import math

# INT4 pack-quantized (docs/formats.md#int4-pack-quantized)
NUM_BITS = 4
SUPPORTED_GROUP_SIZES = (32, 64, 128)
OBSERVERS = ("minmax", "mse", "fullrange", "fullrange-mse")
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
