"""One dequantizing reader: a checkpoint tensor as numbers, whatever its stored scheme (block or
channel FP8 with ``weight_scale_inv`` / ``weight_scale``, compressed-tensors pack-quantized INT4,
SGLang's native w4afp8 INT4, BF16/FP16/FP32). calibrate-kv's layer streamer, ``quantize check`` and
the plan's scale checks all read through it, so the block-vs-channel decision is made in one place.

FP8 weights come back as ``bf16(fp8 * scale)`` (computed in fp32, as a BF16 checkpoint of the
model and ``convert`` hold them), then cast to the requested dtype.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..errors import QuantizeError
from ..formats.layout import DEFAULT_BLOCK, block_grid
from .index import CheckpointIndex, TensorRef, read_tensor

FP8_SCALE_NAMES = ("weight_scale_inv", "weight_scale")


def fp8_scale_format(weight: TensorRef, scale: TensorRef, block: tuple[int, int], folder: Path | str = "") -> str:
    """"block" or "channel" for an FP8 weight's scale, or a one-line error naming the scale.
    DeepSeek-style ``weight_scale_inv`` is always a block grid (ceil); compressed-tensors'
    ``weight_scale`` is per output row, one per tensor, or a block grid."""
    out, grid = weight.shape[0], block_grid(weight.shape, block)
    shape = tuple(scale.shape)
    if scale.name.endswith("weight_scale_inv"):
        if shape != grid:
            where = Path(folder) / scale.file
            raise QuantizeError(f"{where}: {scale.name} has shape {list(shape)}, but a {list(weight.shape)} weight "
                                f"with {block[0]}x{block[1]} blocks needs {list(grid)} (ceil grid); the checkpoint is "
                                f"corrupt")
        return "block"
    if math.prod(shape) == 1 or shape in ((out, 1), (out,)):
        return "channel"
    if shape == grid:
        return "block"
    where = Path(folder) / scale.file
    raise QuantizeError(f"{where}: {scale.name} has shape {list(shape)}, which fits neither a per-channel "
                        f"[{out}, 1] nor a {block[0]}x{block[1]} block scale of {list(weight.shape)}")


def weight_block(config: dict, text_config: dict | None = None) -> tuple[int, int]:
    qc = config.get("quantization_config") or (text_config or {}).get("quantization_config") or {}
    wb = qc.get("weight_block_size")
    if wb:
        return (int(wb[0]), int(wb[1]))
    for g in (qc.get("config_groups") or {}).values():
        bs = (g.get("weights") or {}).get("block_structure")
        if bs:
            return (int(bs[0]), int(bs[1]))
    return DEFAULT_BLOCK


class WeightReader:
    """``reader.weight("model.layers.0.mlp.experts.3.up_proj.weight")`` -> float tensor."""

    def __init__(self, index: CheckpointIndex, block: tuple[int, int] | None = None):
        self.index = index
        self.block = block or weight_block(index.config, index.config.get("text_config")
                                           if isinstance(index.config.get("text_config"), dict) else None)
        self._fds: dict = {}

    @property
    def folder(self) -> Path:
        return self.index.folder

    def raw(self, name: str):
        return read_tensor(self.folder, self.index.tensors[name], self._fds)

    def fp8_scale(self, name: str) -> tuple[TensorRef, str] | None:
        """(scale tensor, "block" | "channel") of an FP8 weight, or None."""
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is None:
            return None
        for s in FP8_SCALE_NAMES:
            ref = self.index.tensors.get(f"{base}.{s}")
            if ref is not None:
                return ref, fp8_scale_format(self.index.tensors[name], ref, self.block, self.folder)
        return None

    def scheme(self, name: str) -> str:
        """How ``name`` (a ``.weight`` name for quantized ones) is stored: "int4", "fp8-block",
        "fp8-channel", "float" or "missing"."""
        t = self.index.tensors
        if name in t:
            if t[name].dtype == "F8_E4M3":
                sc = self.fp8_scale(name)
                return f"fp8-{sc[1]}" if sc else "fp8-unscaled"
            if self.native_int4(name):
                return "int4-native"
            return "float"
        if name.endswith(".weight") and name[: -len("weight")] + "weight_packed" in t:
            return "int4"
        return "missing"

    def native_int4(self, name: str) -> bool:
        """``name`` is SGLang's native w4afp8 INT4 (int8 nibble pairs beside a ``weight_scale_inv``)."""
        t = self.index.tensors
        return name in t and t[name].dtype == "I8" and name.endswith(".weight") and \
            f"{name[: -len('.weight')]}.weight_scale_inv" in t

    def mismatch(self, name: str, shape: tuple[int, ...]) -> str | None:
        """Why ``weight(name)`` could not give a tensor of ``shape``, from the headers alone (no
        tensor data read); None when it can. FP8: the weight's shape, and a scale whose grid fits
        (``fp8_scale_format`` raises naming the scale); INT4: ``weight_packed`` [out, ceil(in / 8)]
        with its ``weight_scale`` and ``weight_shape`` beside it."""
        t, shape = self.index.tensors, tuple(shape)
        if name in t:
            ref = t[name]
            if ref.dtype == "F8_E4M3" and self.fp8_scale(name) is None:
                return "is FP8 without a weight_scale_inv / weight_scale beside it"
            if self.native_int4(name):  # two codes per byte
                sc = t[f"{name[: -len('.weight')]}.weight_scale_inv"]
                ok = (len(shape) == 2 and tuple(ref.shape) == (shape[0], shape[1] // 2) and shape[1] % 2 == 0
                      and len(sc.shape) == 2 and sc.shape[0] == shape[0] and sc.shape[1] and not shape[1] % sc.shape[1])
                return None if ok else f"is INT4 (SGLang w4afp8) as {list(ref.shape)} with scales {list(sc.shape)}"
            return None if tuple(ref.shape) == shape else f"has shape {list(ref.shape)}"
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        packed = t.get(f"{base}.weight_packed") if base else None
        if packed is None:
            return "is missing (and so is its INT4 form)" if base else "is missing"
        for part in ("weight_scale", "weight_shape"):
            if f"{base}.{part}" not in t:
                return f"is INT4 without its {base}.{part}"
        if len(shape) != 2 or tuple(packed.shape) != (shape[0], -(-shape[1] // 8)):
            return f"is INT4 packed as {list(packed.shape)} ({packed.name})"
        return None

    def weight(self, name: str, dtype=None, device=None):
        """The tensor as ``dtype`` (default float32), dequantized from whatever it is stored as;
        ``device``: the stored bytes moved there first and dequantized there (the same elementwise
        ops, so the same values: on a GPU, without the CPU's widening of every weight to fp32)."""
        import torch

        from ..formats import fp8, int4

        dtype = dtype or torch.float32
        t = self.index.tensors
        on = (lambda x: x.to(device)) if device is not None else (lambda x: x)  # noqa: E731
        if name in t:
            w = on(self.raw(name))
            if self.native_int4(name):
                from ..formats import w4afp8

                s = on(self.raw(f"{name[: -len('.weight')]}.weight_scale_inv"))
                return w4afp8.dequantize(w, s).to(dtype)
            if w.dtype == torch.float8_e4m3fn:
                sc = self.fp8_scale(name)
                if sc is None:
                    raise QuantizeError(f"{self.folder / t[name].file}: FP8 tensor {name} has no weight_scale_inv / "
                                        f"weight_scale; the checkpoint is incomplete")
                ref, kind = sc
                s = on(read_tensor(self.folder, ref, self._fds))
                w = fp8.dequant_block(w, s, self.block) if kind == "block" else fp8.dequant_channel(w, s)
            return w.to(dtype)
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and base + ".weight_packed" in t:
            packed = on(self.raw(base + ".weight_packed"))
            scale = on(self.raw(base + ".weight_scale"))
            shape = tuple(int(v) for v in self.raw(base + ".weight_shape").tolist())
            return int4.dequantize_int4(packed, scale, shape, dtype=torch.float32).to(dtype)
        raise QuantizeError(f"{self.folder}: tensor {name} (or its INT4/FP8 form) is missing; "
                            f"the checkpoint is incomplete")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
