"""``quantize shard``: per-rank tensor-parallel weights from a converted checkpoint, and
``--merge`` back.

Each tensor's split follows its role in the architecture registry (transformers' TP plan mapped to
on-disk names): column-parallel (q_b_proj / kv_b_proj by heads, gate/up of dense MLP, shared and
routed experts) split the output dim; row-parallel (o_proj, down_proj) split the input dim;
embeddings and heads split the vocabulary; norms, router, q_a/kv_a and the DSA indexer are
replicated. INT4 tensors split in whole int32 words and whole groups along K (``weight_packed`` and
``weight_scale`` together, ``weight_shape`` rewritten per rank). Every tensor is checked against
the serving kernels' rules at that TP before anything is written. The manifest records, per
tensor, how it was split and the SHA-256 of every slice, so ``merge`` and ``check`` can prove
the split exact.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import archs
from .archs.base import EXPERT_ROLES, ROLES
from .checkpoint.index import INDEX_NAME, CheckpointIndex, itemsize, read_tensor
from .checkpoint.writer import Entry, StreamWriter, atomic_write_text
from .errors import QuantizeError
from .events import Emit, null_emit

PATTERN = "model-rank-{rank}-part-{part}.safetensors"
MANIFEST = "shard_manifest.json"
MARLIN_GROUPS = (-1, 32, 64, 128)
DEFAULT_MAX_PART = 5 << 30


@dataclass
class TensorSplit:
    name: str
    split: str  # "col" | "row" | "vocab" | "rep"
    dim: int | None
    shape: tuple[int, ...]
    dtype: str
    file: str
    rank_shapes: list[tuple[int, ...]] = field(default_factory=list)


def _int4_modules(index: CheckpointIndex) -> dict[str, tuple[int, int, int]]:
    """module -> (N, K, group) for every pack-quantized module."""
    out = {}
    for name, ref in index.tensors.items():
        if name.endswith(".weight_packed"):
            m = name[: -len(".weight_packed")]
            scale = index.tensors.get(m + ".weight_scale")
            shape_t = index.tensors.get(m + ".weight_shape")
            if scale is None or shape_t is None:
                raise QuantizeError(f"{index.folder / ref.file}: {m} has weight_packed but no weight_scale/weight_shape; the checkpoint is incomplete")
            n = ref.shape[0]
            k = ref.shape[1] * 8
            out[m] = (n, k, k // scale.shape[1])
    return out


def _split_of(arch, name: str, ref) -> tuple[str, int | None]:
    role, _ = arch.role_of(name)
    split = ROLES[role][1]
    if name.endswith(".weight_shape") or role in ("norm", "router_bias") or len(ref.shape) == 0:
        return "rep", None
    if split == "rep":
        return "rep", None
    if split in ("col", "vocab"):
        return split, 0
    if len(ref.shape) == 1:  # a row-parallel layer's bias is added once, after the reduce
        return "rep", None
    return "row", 1


def plan_shard(model: Path, tp: int) -> tuple[CheckpointIndex, list[TensorSplit], dict[str, tuple[int, int, int]]]:
    index = CheckpointIndex.open(model)
    arch = archs.resolve(index.config, str(model / "config.json"))
    int4 = _int4_modules(index)
    text = arch.text_config(index.config)
    heads = int(text.get("num_attention_heads", tp))
    if heads % tp:
        raise QuantizeError(f"{model / 'config.json'}: {heads} attention heads do not split over TP {tp}; use a TP that divides {heads}")
    splits: list[TensorSplit] = []
    for name, ref in index.tensors.items():
        kind, dim = _split_of(arch, name, ref)
        ts = TensorSplit(name, kind, dim, ref.shape, ref.dtype, ref.file)
        for r in range(tp):
            if dim is None:
                shape = ref.shape  # replicated; an INT4 weight_shape keeps its shape, values are per rank
            else:
                if ref.shape[dim] % tp:
                    raise QuantizeError(f"{model / ref.file}: tensor {name} has {ref.shape[dim]} along dim {dim}, not divisible by TP {tp}; use a TP that divides it")
                shape = tuple(s // tp if i == dim else s for i, s in enumerate(ref.shape))
            ts.rank_shapes.append(shape)
        splits.append(ts)
    _check_rules(arch, index, splits, int4, tp)
    return index, splits, int4


def _check_rules(arch, index: CheckpointIndex, splits: list[TensorSplit], int4: dict, tp: int) -> None:
    """Marlin / MoE-Marlin shape rules per rank (../shared/FORMATS.md §4.4), before any write."""
    by_name = {s.name: s for s in splits}
    text = arch.text_config(index.config)
    hidden = int(text.get("hidden_size", 0))
    for module, (n, k, g) in int4.items():
        s = by_name[module + ".weight_packed"]
        role, _ = arch.role_of(module + ".weight")
        n_r = n // tp if s.split in ("col", "vocab") else n
        k_r = k // tp if s.split == "row" else k
        where = f"{index.folder / s.file}: tensor {module}"

        def fail(rule: str, fix: str):
            raise QuantizeError(f"{where} at TP {tp}: {rule}; {fix}")

        if g not in MARLIN_GROUPS:
            fail(f"group size {g} is not one of Marlin's {MARLIN_GROUPS[1:]}", "convert again with --group-size 32, 64 or 128")
        alt = [t for t in (1, 2, 4, 8, 16) if t != tp and _fits(n, k, g, t, s.split, role, hidden)]
        fix = f"use --tp {' or '.join(map(str, alt))}" if alt else "convert with a smaller --group-size"
        if s.split == "row" and (k_r % 8 or k_r % g):
            fail(f"K per rank {k_r} is not whole int32 words and whole groups of {g}", fix)
        if role in EXPERT_ROLES:
            inter_r = n_r if s.split == "col" else k_r
            if hidden and hidden % 128:
                fail(f"MoE Marlin needs hidden_size % 128 == 0, got {hidden}", "this model cannot use INT4 Marlin MoE")
            if inter_r % max(64, g):
                fail(f"MoE Marlin needs intermediate per rank % max(64, group) == 0, got {inter_r} with group {g}", fix)
        else:
            if n_r % 64:
                fail(f"Marlin needs N per rank % 64 == 0, got {n_r}", fix)
            if k_r % 128:
                fail(f"Marlin needs K per rank % 128 == 0, got {k_r}", fix)
            if k_r % g:
                fail(f"K per rank {k_r} is not a multiple of group {g}", fix)
    # fused sets must share one scheme
    for module in int4:
        for member in arch.fused_members(module):
            if member != module and (member + ".weight") in by_name:
                raise QuantizeError(f"{index.folder}: {module} is INT4 but {member}, which the engines fuse with it, is not; convert both alike")


def _fits(n, k, g, tp, split, role, hidden) -> bool:
    n_r = n // tp if split in ("col", "vocab") else n
    k_r = k // tp if split == "row" else k
    if (split in ("col", "vocab") and n % tp) or (split == "row" and k % tp):
        return False
    if split == "row" and (k_r % 8 or k_r % g):
        return False
    if role in EXPERT_ROLES:
        return (n_r if split == "col" else k_r) % max(64, g) == 0
    return n_r % 64 == 0 and k_r % 128 == 0 and k_r % g == 0


def _slices(t: torch.Tensor, ts: TensorSplit, tp: int, rank_shapes: list[tuple[int, int]] | None) -> list[torch.Tensor]:
    """Per-rank pieces; an INT4 module's weight_shape becomes each rank's [N, K]."""
    if rank_shapes is not None:
        return [torch.tensor(list(shape), dtype=torch.int64) for shape in rank_shapes]
    if ts.dim is None:
        return [t] * tp
    return [c.contiguous() for c in torch.chunk(t, tp, dim=ts.dim)]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def shard(model: str | os.PathLike, out: str | os.PathLike, tp: int = 8, max_part_bytes: int = DEFAULT_MAX_PART,
          overwrite: bool = False, emit: Emit = null_emit) -> dict:
    """Write ``out/model-rank-{r}-part-{p}.safetensors`` for r < tp plus a manifest."""
    model, out = Path(model), Path(out)
    if tp < 1:
        raise QuantizeError(f"--tp {tp}: must be at least 1")
    index, splits, int4 = plan_shard(model, tp)  # every rule checked before anything is written
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise QuantizeError(f"{out}: already exists; pass --overwrite or choose another folder")
        if not (out / MANIFEST).exists():
            raise QuantizeError(f"{out}: exists and is not a quantize shard output; remove it yourself")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    # per-rank part layout, precomputed
    parts: list[list[list[TensorSplit]]] = []
    for r in range(tp):
        rank_parts: list[list[TensorSplit]] = [[]]
        size = 0
        for ts in splits:
            b = math.prod(ts.rank_shapes[r]) * itemsize(ts.dtype)
            if rank_parts[-1] and size + b > max_part_bytes:
                rank_parts.append([])
                size = 0
            rank_parts[-1].append(ts)
            size += b
        parts.append(rank_parts)
    part_of = [{x.name: p for p, lst in enumerate(parts[r]) for x in lst} for r in range(tp)]
    writers: list[StreamWriter | None] = [None] * tp
    part_idx = [-1] * tp
    manifest_tensors: dict[str, dict] = {}
    fds: dict = {}
    emit({"event": "start", "stage": "shard", "total_bytes": index.total_bytes, "done_bytes": 0})
    done = 0
    try:
        for ts in splits:
            t = read_tensor(index.folder, index.tensors[ts.name], fds)
            module = ts.name.rsplit(".", 1)[0]
            full = None
            if ts.name.endswith(".weight_shape") and module in int4:
                pk = next(s for s in splits if s.name == module + ".weight_packed")
                n, k, _ = int4[module]
                full = [(n // tp if pk.split in ("col", "vocab") else n, k // tp if pk.split == "row" else k)] * tp
            pieces = _slices(t, ts, tp, full)
            rec = {"split": ts.split, "dim": ts.dim, "shape": list(ts.shape), "dtype": ts.dtype, "file": ts.file,
                   "sha256": _sha(t), "ranks": []}
            for r, piece in enumerate(pieces):
                p = part_of[r][ts.name]
                if p != part_idx[r]:
                    if writers[r] is not None:
                        writers[r].finish()
                    part_idx[r] = p
                    writers[r] = StreamWriter(out / PATTERN.format(rank=r, part=p), [Entry(x.name, x.dtype, x.rank_shapes[r]) for x in parts[r][p]],
                                              {"format": "pt", "tp_rank": str(r), "tp_size": str(tp)})
                writers[r].write_tensor(ts.name, piece)
                fname = PATTERN.format(rank=r, part=part_idx[r])
                rec["ranks"].append({"file": fname, "shape": list(piece.shape), "sha256": _sha(piece)})
            manifest_tensors[ts.name] = rec
            done += index.tensors[ts.name].nbytes
            emit({"event": "tensor", "name": ts.name, "kind": ts.split, "done_bytes": done})
        for w in writers:
            if w is not None:
                w.finish()
    except BaseException:
        for w in writers:
            if w is not None and w.tmp.exists():
                w.abort()
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    for p in sorted(model.iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in (INDEX_NAME, MANIFEST) and not p.name.endswith(".partial"):
            shutil.copy2(p, out / p.name)
    rank_bytes = [sum((out / PATTERN.format(rank=r, part=p)).stat().st_size for p in range(len(parts[r]))) for r in range(tp)]
    files_order: dict[str, list[str]] = {}
    for name, ref in index.tensors.items():
        files_order.setdefault(ref.file, []).append(name)
    manifest = {"tp": tp, "pattern": PATTERN, "source": str(model.resolve()), "architecture": archs.resolve(index.config).name,
                "files": files_order, "rank_bytes": rank_bytes, "tensors": manifest_tensors}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    emit({"event": "done", "rank_bytes": rank_bytes})
    return manifest


def load_manifest(sharded: Path) -> dict:
    path = sharded / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise QuantizeError(f"{path}: missing; {sharded} is not a quantize shard output") from e
    except json.JSONDecodeError as e:
        raise QuantizeError(f"{path}: corrupt ({e.msg}); re-shard") from e


class RankReader:
    """Tensors of one sharded folder, by (rank, name)."""

    def __init__(self, sharded: Path, manifest: dict):
        self.folder = sharded
        self.manifest = manifest
        self.refs: dict[tuple[int, str], object] = {}
        from .checkpoint.index import _refs_from_header

        files = {r["file"] for t in manifest["tensors"].values() for r in t["ranks"]}
        for f in sorted(files):
            if not (sharded / f).exists():
                raise QuantizeError(f"{sharded / f}: missing rank file; re-shard")
            rank = int(f.split("-rank-")[1].split("-")[0])
            for name, ref in _refs_from_header(sharded, f).items():
                self.refs[(rank, name)] = ref
        self.fds: dict = {}

    def get(self, rank: int, name: str) -> torch.Tensor:
        ref = self.refs.get((rank, name))
        if ref is None:
            raise QuantizeError(f"{self.folder}: rank {rank} has no tensor {name}; the shard is incomplete, re-shard")
        return read_tensor(self.folder, ref, self.fds)

    def close(self):
        for fd in self.fds.values():
            os.close(fd)


def merge(sharded: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False, emit: Emit = null_emit) -> dict:
    """Reassemble the unsharded checkpoint (same files, order and tensors) from per-rank files."""
    sharded, out = Path(sharded), Path(out)
    m = load_manifest(sharded)
    tp = m["tp"]
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise QuantizeError(f"{out}: already exists; pass --overwrite or choose another folder")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    reader = RankReader(sharded, m)
    try:
        for fname, names in m["files"].items():
            entries = [Entry(n, m["tensors"][n]["dtype"], tuple(m["tensors"][n]["shape"])) for n in names]
            w = StreamWriter(out / fname, entries, {"format": "pt"})
            for n in names:
                rec = m["tensors"][n]
                pieces = [reader.get(r, n) for r in range(tp)]
                for r, p in enumerate(pieces):
                    if _sha(p) != rec["ranks"][r]["sha256"]:
                        w.abort()
                        raise QuantizeError(f"{sharded / rec['ranks'][r]['file']}: tensor {n} of rank {r} does not match its checksum; the file is corrupt, re-shard")
                full = _full_shape(m, n) if n.endswith(".weight_shape") else None
                if full is not None:
                    t = torch.tensor(full, dtype=torch.int64)
                elif rec["dim"] is None:
                    t = pieces[0]
                else:
                    t = torch.cat(pieces, dim=rec["dim"])
                if _sha(t) != rec["sha256"]:
                    w.abort()
                    raise QuantizeError(f"{sharded}: reassembled {n} differs from the tensor that was sharded; the shard is inconsistent")
                w.write_tensor(n, t)
            w.finish()
    finally:
        reader.close()
    index = {"metadata": {"total_size": sum(math.prod(t["shape"]) * itemsize(t["dtype"]) for t in m["tensors"].values())},
             "weight_map": {n: f for f, names in m["files"].items() for n in names}}
    atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=2))
    for p in sorted(sharded.iterdir()):
        if p.is_file() and not p.name.startswith("model-rank-") and p.name != MANIFEST:
            shutil.copy2(p, out / p.name)
    emit({"event": "done"})
    return {"out": str(out), "tensors": len(m["tensors"])}


def _full_shape(m: dict, name: str) -> list[int] | None:
    """The unsharded [N, K] of an INT4 module, from its weight_packed record."""
    pk = m["tensors"].get(name[: -len("weight_shape")] + "weight_packed")
    if pk is None:
        return None
    return [pk["shape"][0], pk["shape"][1] * 8]
