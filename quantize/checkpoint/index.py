"""Lazy view of a safetensors checkpoint: name -> TensorRef(file, dtype, shape, offsets).

Only headers are read here. ``CheckpointIndex.open`` validates everything that can be validated
without tensor data before any work starts: the index names only files inside the folder, every
file exists and its header parses, every index entry is in the file it names, and every tensor's
bytes lie inside the file (a truncated shard is caught here, not 90% into a run).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import QuantizeError

# safetensors dtype string <-> torch dtype, itemsize
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER = 100 * 1024 * 1024


def itemsize(dtype: str) -> int:
    return DTYPES[dtype][1]


@dataclass(frozen=True)
class TensorRef:
    name: str
    file: str  # file name relative to the checkpoint folder
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0] if "." in self.name else ""


def read_header(path: Path) -> tuple[dict, int]:
    """-> (header dict, data start offset). Raises QuantizeError naming the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise QuantizeError(f"{path}: file is {size} bytes, too short for a safetensors header; re-download it")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise QuantizeError(f"{path}: header length {n} does not fit in a {size}-byte file; the file is truncated or not safetensors, re-download it")
            header = json.loads(f.read(n))
    except OSError as e:
        raise QuantizeError(f"{path}: cannot read ({e.strerror})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuantizeError(f"{path}: header is not valid JSON; the file is corrupt or not safetensors, re-download it") from e
    if not isinstance(header, dict):
        raise QuantizeError(f"{path}: header is not a JSON object; re-download it")
    return header, 8 + n


def _refs_from_header(folder: Path, fname: str) -> dict[str, TensorRef]:
    path = folder / fname
    header, base = read_header(path)
    size = path.stat().st_size
    refs: dict[str, TensorRef] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info.get("dtype")
        if dt not in DTYPES:
            raise QuantizeError(f"{path}: tensor {name} has dtype {dt!r}, which this tool does not read")
        shape = tuple(int(x) for x in info["shape"])
        b, e = info["data_offsets"]
        if e - b != math.prod(shape) * itemsize(dt):
            raise QuantizeError(f"{path}: tensor {name} declares shape {list(shape)} {dt} but {e - b} bytes; the header is corrupt, re-download the file")
        if base + e > size:
            raise QuantizeError(f"{path}: tensor {name} ends at byte {base + e} but the file has {size} bytes; the shard is truncated, re-download it")
        refs[name] = TensorRef(name, fname, dt, shape, base + b, base + e)
    return refs


def _inside(folder: Path, fname: str) -> bool:
    p = Path(fname)
    if p.is_absolute() or ".." in p.parts:
        return False
    return (folder / p).resolve().is_relative_to(folder.resolve())


@dataclass
class CheckpointIndex:
    folder: Path
    tensors: dict[str, TensorRef]  # in a stable order: by file (index order), then offset
    files: list[str]  # safetensors files in order
    config: dict
    index_metadata: dict

    @classmethod
    def open(cls, folder: str | os.PathLike) -> "CheckpointIndex":
        folder = Path(folder)
        if not folder.is_dir():
            raise QuantizeError(f"{folder}: not a directory; pass a checkpoint folder with config.json and *.safetensors")
        config = load_config(folder)
        idx_path = folder / INDEX_NAME
        weight_map: dict[str, str] | None = None
        meta: dict = {}
        if idx_path.exists():
            try:
                idx = json.loads(idx_path.read_text())
                weight_map = idx["weight_map"]
                meta = idx.get("metadata", {}) or {}
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise QuantizeError(f"{idx_path}: not a valid safetensors index (needs a 'weight_map' object); fix or delete it") from e
            files = list(dict.fromkeys(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise QuantizeError(f"{folder / pickles[0]}: pickle checkpoints (.bin/.pt) are not read, since loading them can execute code; convert the model to safetensors first")
            raise QuantizeError(f"{folder}: no *.safetensors files and no {INDEX_NAME}; pass a safetensors checkpoint folder")
        for f in files:
            if not _inside(folder, f):
                raise QuantizeError(f"{idx_path}: entry {f!r} points outside {folder}; the index is unsafe, fix it")
            if not (folder / f).exists():
                missing = [x for x in files if not (folder / x).exists()]
                raise QuantizeError(f"{folder / f}: missing ({len(missing)} of {len(files)} shards named by the index are absent: {', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}); download them")
        per_file = {f: _refs_from_header(folder, f) for f in files}
        tensors: dict[str, TensorRef] = {}
        for f in files:
            for ref in sorted(per_file[f].values(), key=lambda r: r.start):
                if ref.name in tensors:
                    raise QuantizeError(f"{folder / f}: tensor {ref.name} also appears in {tensors[ref.name].file}; remove the duplicate")
                tensors[ref.name] = ref
        if weight_map is not None:
            for name, f in weight_map.items():
                if name not in per_file[f]:
                    raise QuantizeError(f"{folder / f}: the index says it holds {name}, but its header does not; the shard is stale or truncated, re-download it")
            extra = [n for n in tensors if n not in weight_map]
            if extra:
                raise QuantizeError(f"{folder / tensors[extra[0]].file}: holds {extra[0]} which the index does not list; the index is stale, regenerate it")
        return cls(folder, tensors, files, config, meta)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorRef:
        return self.tensors[name]

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.tensors.values())


def load_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise QuantizeError(f"{path}: missing; a checkpoint needs its config.json (architectures, sizes)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise QuantizeError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); fix the file") from e
    if not isinstance(cfg, dict):
        raise QuantizeError(f"{path}: not a JSON object; fix the file")
    return cfg


def cached_fd(cache: dict, path: Path) -> int:
    """A read-only descriptor for ``path``, opened once per cache (the caller closes them)."""
    fd = cache.get(path)
    if fd is None:
        fd = cache[path] = os.open(path, os.O_RDONLY)
    return fd


def read_tensor(folder: Path, ref: TensorRef, fd_cache: dict | None = None, buf: bytearray | None = None) -> torch.Tensor:
    """Read one tensor's bytes with pread (no mmap: page-cache pressure stays the kernel's, and
    RSS counts only this tensor). ``buf`` (at least ``ref.nbytes``) is reused when given; the
    returned tensor then aliases it."""
    buf = bytearray(ref.nbytes) if buf is None else buf
    path = folder / ref.file
    close = fd_cache is None
    fd = os.open(path, os.O_RDONLY) if close else cached_fd(fd_cache, path)
    try:
        view = memoryview(buf)[: ref.nbytes]
        got = 0
        while got < ref.nbytes:
            n = os.preadv(fd, [view[got:]], ref.start + got)
            if n <= 0:
                raise QuantizeError(f"{path}: tensor {ref.name} could not be read completely (file shrank?); re-download it")
            got += n
    finally:
        if close:
            os.close(fd)
    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=ref.torch_dtype)
    return torch.frombuffer(buf, dtype=ref.torch_dtype, count=ref.nbytes // itemsize(ref.dtype)).view(ref.shape)
