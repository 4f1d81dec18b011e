"""Lazy view of a safetensors checkpoint: name -> TensorRef(file, dtype, shape, offsets).

Only headers are read here. ``CheckpointIndex.open`` validates everything that can be validated
without tensor data before any work starts: config.json's fields we read, the index's shape, the
index names only files inside the folder (or, for a Hugging Face cache snapshot, symlinks into the
same cache's blobs/), every file exists and its header passes the safetensors format's own rules
(``read_header``: the tensors tile the data exactly, so a truncated or corrupt shard is caught here,
not 90% into a run), and every index entry is in the file it names.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..errors import QuantizeError

# safetensors dtype string -> (torch dtype name, itemsize); torch itself is imported only where a
# tensor is made, so header-only commands (``quantize plan``) never load it
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}


def torch_dtype(st: str):
    import torch

    return getattr(torch, DTYPES[st][0])


def st_dtype(dtype) -> str:
    """torch dtype -> safetensors dtype string."""
    name = str(dtype).removeprefix("torch.")
    for k, (n, _) in DTYPES.items():
        if n == name:
            return k
    raise KeyError(dtype)


INDEX_NAME = "model.safetensors.index.json"
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
    def torch_dtype(self):
        return torch_dtype(self.dtype)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0] if "." in self.name else ""


def read_header(path: Path) -> tuple[dict, int]:
    """-> (header dict, data start offset), checked by the safetensors format's own rules before a
    byte of data is trusted: a length of at most 100 MB, UTF-8 JSON starting with '{' (trailing
    space padding allowed), an optional ``__metadata__`` of strings, every other entry exactly
    ``dtype``/``shape``/``data_offsets`` with ``end - begin == prod(shape) * itemsize``, and the
    tensors, by offset, tiling the data exactly (from byte 0 to the end of the file, no gap, no
    overlap, no trailing bytes). Raises QuantizeError naming the file (and tensor). Reads the
    header only."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise QuantizeError(f"{path}: file is {size} bytes, too short for a safetensors header; re-download it")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise QuantizeError(
                    f"{path}: header length {n} exceeds the safetensors limit of {MAX_HEADER} bytes; "
                    "the file is corrupt or not safetensors, re-download it"
                )
            if 8 + n > size:
                raise QuantizeError(
                    f"{path}: header length {n} does not fit in a {size}-byte file; the file is "
                    "truncated or not safetensors, re-download it"
                )
            text = f.read(n)
    except OSError as e:
        raise QuantizeError(f"{path}: cannot read ({e.strerror})") from e
    if not text.startswith(b"{"):
        raise QuantizeError(
            f"{path}: header must start with '{{' (it starts with {text[:8]!r}); the file is corrupt "
            "or not safetensors, re-download it"
        )
    try:
        header = json.loads(text.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuantizeError(
            f"{path}: header is not valid UTF-8 JSON; the file is corrupt or not safetensors, re-download it"
        ) from e
    except RecursionError:
        raise QuantizeError(f"{path}: header nests too deep to be a safetensors header; re-download the file") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise QuantizeError(f"{path}: header holds a number no tensor can have ({e}); re-download the file") from None
    if not isinstance(header, dict):
        raise QuantizeError(f"{path}: header is not a JSON object; re-download it")
    _check_header(path, header, size - 8 - n, 8 + n)
    return header, 8 + n


_CORRUPT = "the header is corrupt, re-download the file"
_INFO_KEYS = {"dtype", "shape", "data_offsets"}
# dtypes the safetensors format defines; DTYPES (above) are the ones this tool reads
ST_DTYPES = set(DTYPES) | {"U16", "U32", "U64", "F4", "F6_E2M3", "F6_E3M2", "C64"}


def _is_uint(x) -> bool:
    return type(x) is int and x >= 0  # not bool, not float


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _check_header(path: Path, header: dict, data_len: int, base: int) -> None:
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise QuantizeError(
                    f"{path}: __metadata__ must be an object of strings to strings, not {_short(info)}; {_CORRUPT}"
                )
            continue
        if not isinstance(info, dict) or info.keys() != _INFO_KEYS:
            got = sorted(info) if isinstance(info, dict) else type(info).__name__
            raise QuantizeError(
                f"{path}: tensor {name}: entry must be an object with exactly dtype, shape and "
                f"data_offsets (got {got}); {_CORRUPT}"
            )
        dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dt, str) or dt not in ST_DTYPES:
            raise QuantizeError(f"{path}: tensor {name}: dtype {_short(dt)} is not a safetensors dtype; {_CORRUPT}")
        if dt not in DTYPES:
            raise QuantizeError(f"{path}: tensor {name} has dtype {dt!r}, which this tool does not read")
        if type(shape) is not list or not all(_is_uint(x) for x in shape):
            raise QuantizeError(
                f"{path}: tensor {name}: shape {_short(shape)} must be a list of non-negative integers; {_CORRUPT}"
            )
        if type(offs) is not list or len(offs) != 2 or not all(_is_uint(x) for x in offs) or offs[0] > offs[1]:
            raise QuantizeError(
                f"{path}: tensor {name}: data_offsets {_short(offs)} must be [begin, end] integers "
                f"with 0 <= begin <= end; {_CORRUPT}"
            )
        b, e = offs
        if e - b != math.prod(shape) * DTYPES[dt][1]:
            raise QuantizeError(f"{path}: tensor {name} declares shape {shape} {dt} but {e - b} bytes; {_CORRUPT}")
        spans.append((b, e, name))
    # by offset, the tensors must tile the data buffer exactly (safetensors' Metadata::validate)
    spans.sort()
    pos, prev = 0, None
    for b, e, name in spans:
        if b < pos:
            raise QuantizeError(
                f"{path}: tensor {name} (data bytes {b}..{e}) overlaps {prev}, which ends at {pos}; {_CORRUPT}"
            )
        if b > pos:
            after = "the start of the data" if prev is None else f"{prev}, which ends at {pos}"
            raise QuantizeError(
                f"{path}: tensor {name} begins at data byte {b}, leaving a gap of {b - pos} bytes "
                f"after {after}; {_CORRUPT}"
            )
        pos, prev = e, name
    if pos > data_len:
        raise QuantizeError(
            f"{path}: tensor {prev} ends at byte {base + pos} but the file has {base + data_len} "
            "bytes; the shard is truncated, re-download it"
        )
    if pos < data_len:
        raise QuantizeError(
            f"{path}: {data_len - pos} trailing bytes after the last "
            f"tensor{f' ({prev})' if prev else ''}; safetensors refuses such a file "
            "(MetadataIncompleteBuffer), re-download it"
        )


def _refs_from_header(folder: Path, fname: str) -> dict[str, TensorRef]:
    header, base = read_header(folder / fname)
    return {
        name: TensorRef(
            name,
            fname,
            info["dtype"],
            tuple(info["shape"]),
            base + info["data_offsets"][0],
            base + info["data_offsets"][1],
        )
        for name, info in header.items()
        if name != "__metadata__"
    }


class HubSnapshot(NamedTuple):
    repo: Path  # <cache>/models--org--name
    revision: str  # the snapshot folder's name
    repo_id: str | None  # "org/name" when the repo folder is named models--org--name (not validated)


def hf_snapshot(path: str | os.PathLike) -> HubSnapshot | None:
    """The Hugging Face cache layout, ``<cache>/models--org--name/snapshots/<rev>``, read from
    ``path`` as written (resolve a folder on disk first); None for any other path."""
    p = Path(path)
    if p.parent.name != "snapshots":
        return None
    repo = p.parent.parent
    rid = repo.name[len("models--") :].replace("--", "/", 1) if repo.name.startswith("models--") else None
    return HubSnapshot(repo, p.name, rid)


def hf_blobs(root: Path) -> Path | None:
    """``<cache>/models--org--name/blobs`` when ``root`` (resolved) is ``.../snapshots/<rev>``."""
    snap = hf_snapshot(root)
    return (snap.repo / "blobs").resolve() if snap else None


def inside(folder: Path, fname: str) -> bool:
    """``fname`` stays in ``folder``: no absolute path or ``..``, and symlinks resolve inside the
    folder or, for a Hugging Face cache snapshot, to a file of the same cache repo's ``blobs/``."""
    p = Path(fname)
    if p.is_absolute() or ".." in p.parts:
        return False
    root = folder.resolve()
    real = (folder / p).resolve()
    if real.is_relative_to(root):
        return True
    blobs = hf_blobs(root)
    return blobs is not None and real.parent == blobs


def _check_weight_file(folder: Path, idx_path: Path, fname: object) -> None:
    p = Path(fname)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise QuantizeError(f"{idx_path}: entry {fname!r} points outside {folder}; the index is unsafe, fix it")
    path = folder / p
    if path.is_symlink() and not path.exists():
        raise QuantizeError(
            f"{path}: dangling symlink to {os.readlink(path)} (the file it names is gone, e.g. an "
            "interrupted download); re-download it"
        )
    if path.exists() and not path.is_file():  # a FIFO would block the read forever, a folder is no shard
        raise QuantizeError(f"{path}: not a regular file; a weight shard is a .safetensors file, re-download it")
    if not inside(folder, fname):
        raise QuantizeError(
            f"{path}: symlink points outside {folder} to {path.resolve()}; only links into the folder "
            "or its Hugging Face cache's blobs/ are followed, copy the file in instead"
        )


def hub_revision(folder: Path) -> str | None:
    """The Hub commit: the folder name of a cache snapshot (``.../snapshots/<rev>``), else the one
    ``hf download --local-dir`` records (first line of ``.cache/huggingface/download/*.metadata``)."""
    snap = hf_snapshot(folder.resolve())
    if snap:
        return snap.revision
    for meta in sorted((folder / ".cache" / "huggingface" / "download").glob("*.metadata")):
        try:
            first = meta.read_text().split("\n", 1)[0].strip()
        except (OSError, UnicodeDecodeError):
            continue
        if first:
            return first
    return None


def _load_json(path: Path, what: str, kind: str = "config"):
    from ..parse import load_json

    return load_json(path, what, kind=kind, want=None)


@dataclass
class CheckpointIndex:
    folder: Path
    tensors: dict[str, TensorRef]  # in a stable order: by file (index order), then offset
    files: list[str]  # safetensors files in order
    config: dict
    index_metadata: dict
    revision: str | None = None  # Hub commit of a cache snapshot or a `hf download --local-dir` folder

    @classmethod
    def open(cls, folder: str | os.PathLike) -> "CheckpointIndex":
        folder = Path(folder)
        if not folder.is_dir():
            raise QuantizeError(
                f"{folder}: not a directory; pass a checkpoint folder with config.json and *.safetensors"
            )
        config = load_config(folder)
        idx_path = folder / INDEX_NAME
        weight_map: dict[str, str] | None = None
        meta: dict = {}
        if idx_path.exists():
            idx = _load_json(idx_path, "safetensors index", kind="index")
            if not isinstance(idx, dict) or not isinstance(idx.get("weight_map"), dict):
                raise QuantizeError(
                    f"{idx_path}: not a valid safetensors index (needs a 'weight_map' object of "
                    "tensor name -> file name); fix or delete it"
                )
            weight_map = idx["weight_map"]
            for name, f in weight_map.items():
                if not isinstance(f, str) or not f:
                    raise QuantizeError(
                        f"{idx_path}: weight_map maps {name} to {_short(f)}, not a file name; fix or "
                        "regenerate the index"
                    )
            meta = idx.get("metadata")
            if meta is None:
                meta = {}
            elif not isinstance(meta, dict):
                raise QuantizeError(
                    f"{idx_path}: 'metadata' must be an object, not {type(meta).__name__}; fix or regenerate the index"
                )
            files = list(dict.fromkeys(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise QuantizeError(
                    f"{folder / pickles[0]}: pickle checkpoints (.bin/.pt) are not read, since "
                    "loading them can execute code; convert the model to safetensors first"
                )
            raise QuantizeError(
                f"{folder}: no *.safetensors files and no {INDEX_NAME}; pass a safetensors checkpoint folder"
            )
        for f in files:
            _check_weight_file(folder, idx_path, f)
            if not (folder / f).exists():
                missing = [x for x in files if not (folder / x).exists()]
                raise QuantizeError(
                    f"{folder / f}: missing ({len(missing)} of {len(files)} shards named by the index "
                    f"are absent: {', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}); "
                    "download them"
                )
        per_file = {f: _refs_from_header(folder, f) for f in files}
        tensors: dict[str, TensorRef] = {}
        for f in files:
            for ref in sorted(per_file[f].values(), key=lambda r: r.start):
                if ref.name in tensors:
                    raise QuantizeError(
                        f"{folder / f}: tensor {ref.name} also appears in {tensors[ref.name].file}; "
                        "remove the duplicate"
                    )
                tensors[ref.name] = ref
        if weight_map is not None:
            for name, f in weight_map.items():
                if name not in per_file[f]:
                    raise QuantizeError(
                        f"{folder / f}: the index says it holds {name}, but its header does not; the "
                        "shard is stale or truncated, re-download it"
                    )
            extra = [n for n in tensors if n not in weight_map]
            if extra:
                raise QuantizeError(
                    f"{folder / tensors[extra[0]].file}: holds {extra[0]} which the index does not "
                    "list; the index is stale, regenerate it"
                )
        from .config import ModelConfig, check_against_tensors

        check_against_tensors(
            ModelConfig.from_dict(config, folder / "config.json"), {n: r.shape for n, r in tensors.items()}, folder
        )
        return cls(folder, tensors, files, config, meta, hub_revision(folder))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorRef:
        return self.tensors[name]

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.tensors.values())


def load_config(folder: Path) -> dict:
    """``folder/config.json``, read through the bounded parser and checked by its typed view
    (``checkpoint.config.ModelConfig``: the fields this tool reads present, typed and in range)."""
    from .config import ModelConfig

    return ModelConfig.load(folder).raw


def check_config(cfg: dict, where: Path | str) -> None:
    """The config.json fields this tool reads have the types and ranges it reads them as."""
    from .config import ModelConfig

    ModelConfig.from_dict(cfg, where)


def cached_fd(cache: dict, path: Path) -> int:
    """A read-only descriptor for ``path``, opened once per cache (the caller closes them)."""
    fd = cache.get(path)
    if fd is None:
        fd = cache[path] = os.open(path, os.O_RDONLY)
    return fd


def read_tensor(folder: Path, ref: TensorRef, fd_cache: dict | None = None, buf: bytearray | None = None):
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
                raise QuantizeError(
                    f"{path}: tensor {ref.name} could not be read completely (file shrank?); re-download it"
                )
            got += n
    finally:
        if close:
            os.close(fd)
    import torch

    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=ref.torch_dtype)
    return torch.frombuffer(buf, dtype=ref.torch_dtype, count=ref.nbytes // itemsize(ref.dtype)).view(ref.shape)
