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

This is a VERIFICATION layout, not an engine load format: both engines' ``sharded_state`` loaders
want their live model's runtime names after post-processing (fused, Marlin-repacked), which only the
engine can write (docs/engines.md#pre-sharded-weights). So files live under ``rank-RR/part-PPP.safetensors``
(no engine globs them, and OUT has no config.json at its top: an engine pointed at it refuses it),
and the unsharded checkpoint's own files (config, index, tokenizer, manifest) under ``unsharded/``,
from which ``--merge`` restores the original folder byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import archs
from .archs.base import EXPERT_ROLES, ROLES
from .checkpoint.config import ModelConfig
from .checkpoint.index import DTYPES, INDEX_NAME, CheckpointIndex, _refs_from_header, itemsize, read_header, read_tensor
from .checkpoint.manifest import MANIFEST as QUANTIZE_MANIFEST
from .checkpoint.manifest import file_records
from .checkpoint.output import SIDE_FILES, Output, confined, side_files
from .checkpoint.writer import Entry, StreamWriter
from .errors import QuantizeError
from .events import Emit, null_emit
from .options import ShardOptions, takes

PATTERN = "rank-{rank:02d}/part-{part:03d}.safetensors"
MANIFEST = "shard_manifest.json"
UNSHARDED = "unsharded"  # the unsharded checkpoint's non-weight files, for --merge
CARRIED = SIDE_FILES + ("config.json", INDEX_NAME, QUANTIZE_MANIFEST)
LAYOUT_NOTE = ("verification layout: per-rank slices under checkpoint names, for proving the split exact and sizing "
               "ranks; not an engine load format (SGLang/vLLM sharded_state files hold the engine's runtime tensors "
               "and only the engine can write them: SGLang --load-format presharded, or save_sharded_model on a GPU "
               "node)")
MARLIN_GROUPS = (-1, 32, 64, 128)


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
                raise QuantizeError(f"{index.folder / ref.file}: {m} has weight_packed but no "
                                    f"weight_scale/weight_shape; the checkpoint is incomplete")
            n = ref.shape[0]
            k = ref.shape[1] * 8
            out[m] = (n, k, k // scale.shape[1])
    return out


def _split_of(arch, name: str, ref) -> tuple[str, int | None]:
    role, _ = arch.role_of(name)
    split = ROLES[role][1]
    if name.endswith((".weight_shape", ".input_scale")) or role in ("norm", "router_bias") or len(ref.shape) == 0:
        return "rep", None  # an input scale (SGLang's w4afp8: [1] per expert) is every rank's
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
    heads = ModelConfig.from_dict(index.config, model / "config.json").num_attention_heads
    if heads % tp:
        raise QuantizeError(f"{model / 'config.json'}: {heads} attention heads do not split over TP {tp}; "
                            f"use a TP that divides {heads}")
    _check_fp8_block(arch, index, tp)
    splits: list[TensorSplit] = []
    for name, ref in index.tensors.items():
        kind, dim = _split_of(arch, name, ref)
        ts = TensorSplit(name, kind, dim, ref.shape, ref.dtype, ref.file)
        for r in range(tp):
            if dim is None:
                shape = ref.shape  # replicated; an INT4 weight_shape keeps its shape, values are per rank
            else:
                if ref.shape[dim] % tp:
                    raise QuantizeError(f"{model / ref.file}: tensor {name} has {ref.shape[dim]} along dim {dim}, "
                                        f"not divisible by TP {tp}; use a TP that divides it")
                shape = tuple(s // tp if i == dim else s for i, s in enumerate(ref.shape))
            ts.rank_shapes.append(shape)
        splits.append(ts)
    _check_rules(arch, index, splits, int4, tp)
    _check_sglang_w4a8(model, index, tp)
    return index, splits, int4


def _check_sglang_w4a8(model: Path, index: CheckpointIndex, tp: int) -> None:
    """SGLang's native w4afp8 (int8 expert pairs): its W4A8 MoE's K % 128 per rank in both GEMMs
    (``plan.sglang_w4a8_violation``), or one line naming the TPs that fit."""
    from .plan import sglang_w4a8_violation

    downs = [r for n, r in index.tensors.items()
             if ".experts." in n and n.endswith("down_proj.weight") and r.dtype == "I8" and len(r.shape) == 2]
    if not downs:
        return
    hidden, inter = downs[0].shape[0], 2 * downs[0].shape[1]
    why = sglang_w4a8_violation(hidden, inter, tp)
    if why:
        ok = [t for t in (1, 2, 4, 8, 16) if sglang_w4a8_violation(hidden, inter, t) is None]
        fix = "use --tp " + " or ".join(map(str, ok)) if ok else "no TP fits"
        raise QuantizeError(f"{model}: SGLang's w4afp8 at TP {tp}: {why} (its W4A8 MoE kernel's rule, "
                            f"docs/engines.md#w4afp8); {fix}")


def marlin_violation(n: int, k: int, g: int, tp: int, split: str, role: str, hidden: int) -> str | None:
    """The first serving-kernel rule (Marlin / MoE Marlin, docs/engines.md#marlin-shape-rules) that an INT4
    module [N, K] with group ``g`` breaks at TP ``tp``, or None."""
    if g not in MARLIN_GROUPS:
        return f"group size {g} is not one of Marlin's {MARLIN_GROUPS[1:]}"
    if (split in ("col", "vocab") and n % tp) or (split == "row" and k % tp):
        return f"{'N' if split != 'row' else 'K'} = {n if split != 'row' else k} does not divide over TP {tp}"
    n_r = n // tp if split in ("col", "vocab") else n
    k_r = k // tp if split == "row" else k
    if split == "row" and (k_r % 8 or k_r % g):
        return f"K per rank {k_r} is not whole int32 words and whole groups of {g}"
    if role in EXPERT_ROLES:
        if hidden and hidden % 128:
            return f"MoE Marlin needs hidden_size % 128 == 0, got {hidden}"
        inter_r = n_r if split == "col" else k_r
        if inter_r % max(64, g):
            return f"MoE Marlin needs intermediate per rank % max(64, group) == 0, got {inter_r} with group {g}"
        return None
    if n_r % 64:
        return f"Marlin needs N per rank % 64 == 0, got {n_r}"
    if k_r % 128:
        return f"Marlin needs K per rank % 128 == 0, got {k_r}"
    if k_r % g:
        return f"K per rank {k_r} is not a multiple of group {g}"
    return None


FP8_BLOCK = 128  # the block the engines' FP8 block kernels tile by (weight_block_size / block_structure)


def fp8_block_violation(shape: tuple[int, int], split: str, tp: int) -> str | None:
    """vLLM 0.33.0's rule for a 128x128 block FP8 weight split over ``tp`` ranks
    (vllm/model_executor/layers/quantization/utils/fp8_utils.py ``validate_fp8_block_shape``, and
    ``validate_fp8_block_shape_moe`` for the experts): the split dimension per rank a whole number
    of blocks (column: N, row: K); a replicated weight is not split. None when it holds."""
    if tp == 1 or split not in ("col", "row"):
        return None
    n, k = shape
    size, what = (n, "N (output rows)") if split == "col" else (k, "K (input columns)")
    if size % tp or (size // tp) % FP8_BLOCK:
        return f"FP8 block weights need {what} per rank % {FP8_BLOCK} == 0, got {size} / {tp}"
    return None


def _check_fp8_block(arch, index: CheckpointIndex, tp: int) -> None:
    """Every block-FP8 weight (``--scheme fp8-block``, ``--keep-fp8``) against ``fp8_block_violation``
    at ``tp``, before any write; one line naming the tensor and a TP that works."""
    for name, ref in index.tensors.items():
        if ref.dtype != "F8_E4M3" or not name.endswith(".weight") or len(ref.shape) != 2:
            continue
        split, _ = _split_of(arch, name, ref)
        rule = fp8_block_violation(tuple(ref.shape), split, tp)
        if rule:
            alt = [t for t in (1, 2, 4, 8, 16) if t != tp and fp8_block_violation(tuple(ref.shape), split, t) is None]
            raise QuantizeError(f"{index.folder / ref.file}: tensor {name} at TP {tp}: {rule}; use --tp "
                                f"{' or '.join(map(str, alt))}")


def _check_w4a8_rule(index: CheckpointIndex, int4: dict, hidden: int, tp: int) -> None:
    """A W4AFP8 checkpoint (FP8 per-token input activations): its routed experts under the W4A8 MoE
    kernel's shape rule at ``tp`` (plan.w4afp8_violation), or one line naming the TP that fits."""
    from .evaluate.w4a8 import fp8_token_groups
    from .plan import w4afp8_fits, w4afp8_violation

    downs = [k for m, (n, k, g) in int4.items() if ".experts." in m and m.endswith(".down_proj")]
    if not downs or not fp8_token_groups(index.config):
        return
    why = w4afp8_violation(hidden, downs[0], tp)
    if why:
        ok = w4afp8_fits(hidden, downs[0], (1, 2, 4, 8, 16))
        fix = f"use --tp {' or '.join(map(str, ok))}" if ok else "no TP fits the W4A8 MoE kernel"
        raise QuantizeError(f"{index.folder}: W4AFP8 at TP {tp}: {why} (the W4A8 MoE kernel's rule, "
                            f"docs/engines.md#w4afp8); {fix}")


def _check_rules(arch, index: CheckpointIndex, splits: list[TensorSplit], int4: dict, tp: int) -> None:
    """Marlin / MoE-Marlin shape rules per rank, before any write; a violation names the tensor,
    the rule and a TP that works."""
    by_name = {s.name: s for s in splits}
    hidden = ModelConfig.from_dict(index.config, index.folder / "config.json").hidden_size
    for module, (n, k, g) in int4.items():
        s = by_name[module + ".weight_packed"]
        role, _ = arch.role_of(module + ".weight")
        rule = marlin_violation(n, k, g, tp, s.split, role, hidden)
        if rule is None:
            continue
        if rule.startswith("group size"):
            fix = "convert again with --group-size 32, 64 or 128"
        elif rule.startswith("MoE Marlin needs hidden"):
            fix = "this model cannot use INT4 Marlin MoE"
        else:
            alt = [t for t in (1, 2, 4, 8, 16)
                   if t != tp and marlin_violation(n, k, g, t, s.split, role, hidden) is None]
            fix = f"use --tp {' or '.join(map(str, alt))}" if alt else "convert with a smaller --group-size"
        raise QuantizeError(f"{index.folder / s.file}: tensor {module} at TP {tp}: {rule}; {fix}")
    _check_w4a8_rule(index, int4, hidden, tp)
    # fused sets must share one scheme
    for module in int4:
        for member in arch.fused_members(module):
            if member != module and (member + ".weight") in by_name:
                raise QuantizeError(f"{index.folder}: {module} is INT4 but {member}, which the engines fuse with it, "
                                    f"is not; convert both alike")


def _slices(t: torch.Tensor, ts: TensorSplit, tp: int, rank_shapes: list[tuple[int, int]] | None) -> list[torch.Tensor]:
    """Per-rank pieces; an INT4 module's weight_shape becomes each rank's [N, K]."""
    if rank_shapes is not None:
        return [torch.tensor(list(shape), dtype=torch.int64) for shape in rank_shapes]
    if ts.dim is None:
        return [t] * tp
    return [c.contiguous() for c in torch.chunk(t, tp, dim=ts.dim)]


def rank_pieces(t: torch.Tensor, ts: TensorSplit, tp: int, int4: dict, by_name: dict) -> list[torch.Tensor]:
    """The ``tp`` slices of ``t`` (tensor ``ts``) as ``shard`` writes them; check recomputes them so."""
    module = ts.name.rsplit(".", 1)[0]
    full = None
    if ts.name.endswith(".weight_shape") and module in int4:
        pk = by_name[module + ".weight_packed"]
        n, k, _ = int4[module]
        full = [(n // tp if pk.split in ("col", "vocab") else n, k // tp if pk.split == "row" else k)] * tp
    return _slices(t, ts, tp, full)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


# the output layer's fixes name --resume, which convert has and shard / merge do not (both start over)
_RESUME_FIXES = (
    ("pass --resume to continue an interrupted run or --overwrite to replace it", "pass --overwrite to replace it"),
    ("rerun with --resume", "rerun with --overwrite (shard and merge start over; there is no --resume)"),
)


def _no_resume(fn):
    """``fn`` with every one-line error's --resume fix replaced by the one shard and merge have."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kw):
        try:
            return fn(*args, **kw)
        except QuantizeError as e:
            msg = str(e)
            fixed = msg
            for old, new in _RESUME_FIXES:
                fixed = fixed.replace(old, new)
            if fixed == msg:
                raise
            raise type(e)(fixed) from e

    return run


def _refuse_native(model: Path) -> None:
    """SGLang's native w4afp8 is not written per rank (SGLang splits it at load; its checks here are
    compressed-tensors'): one line before anything is written."""
    from .parse import load_json

    cfg = load_json(model / "config.json", "config.json", kind="config") if (model / "config.json").is_file() else {}
    if ((cfg.get("quantization_config") or {}).get("quant_method")) == "w4afp8":
        raise QuantizeError(f"{model}: SGLang's native w4afp8 layout is not sharded by this version (SGLang splits it "
                            "at load: serve the folder with --tp); quantize check --tp N checks its TP rule")


@takes(ShardOptions)
@_no_resume
def shard(model, out, tp, max_part_gib, overwrite, emit: Emit = null_emit) -> dict:
    """Write ``out/rank-RR/part-PPP.safetensors`` for r < tp, the unsharded folder's own files
    under ``out/unsharded/``, and ``shard_manifest.json`` (last); no part file over ``max_part_gib``."""
    model, out = Path(model), Path(out)
    max_part_bytes = int(max_part_gib * 2**30)
    _refuse_native(model)
    index, splits, int4 = plan_shard(model, tp)  # every rule checked before anything is written
    carried = side_files(model, CARRIED)
    by_name = {ts.name: ts for ts in splits}
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
    with Output.open(out, "shard", [model], overwrite=overwrite, key={"tp": tp, "max_part_bytes": max_part_bytes}) as o:
        for r in range(tp):
            (out / PATTERN.format(rank=r, part=0)).parent.mkdir(exist_ok=True)
        writers: list[StreamWriter | None] = [None] * tp
        part_idx = [-1] * tp
        manifest_tensors: dict[str, dict] = {}
        fds: dict = {}
        emit({"event": "start", "stage": "shard", "total_bytes": index.total_bytes, "done_bytes": 0})
        done = 0

        def finish(r: int) -> None:
            sha = writers[r].finish()
            o.mark_done(PATTERN.format(rank=r, part=part_idx[r]), sha, writers[r].bytes_written)

        try:
            for ts in splits:
                t = read_tensor(index.folder, index.tensors[ts.name], fds)
                pieces = rank_pieces(t, ts, tp, int4, by_name)
                rec = {"split": ts.split, "dim": ts.dim, "shape": list(ts.shape), "dtype": ts.dtype, "file": ts.file,
                       "sha256": _sha(t), "ranks": []}
                for r, piece in enumerate(pieces):
                    p = part_of[r][ts.name]
                    if p != part_idx[r]:
                        if writers[r] is not None:
                            finish(r)
                        part_idx[r] = p
                        writers[r] = StreamWriter(out / PATTERN.format(rank=r, part=p),
                                                  [Entry(x.name, x.dtype, x.rank_shapes[r]) for x in parts[r][p]],
                                                  {"format": "pt", "tp_rank": str(r), "tp_size": str(tp),
                                                   "layout": "quantize-verification"})
                    writers[r].write_tensor(ts.name, piece)
                    rec["ranks"].append({"file": PATTERN.format(rank=r, part=part_idx[r]), "shape": list(piece.shape),
                                         "sha256": _sha(piece)})
                manifest_tensors[ts.name] = rec
                done += index.tensors[ts.name].nbytes
                emit({"event": "tensor", "name": ts.name, "kind": ts.split, "done_bytes": done})
            for r in range(tp):
                if writers[r] is not None:
                    finish(r)
        except BaseException:
            for w in writers:
                if w is not None and w.tmp.exists():
                    w.abort()
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
        names = o.copy_side_files(carried, subdir=UNSHARDED)
        rank_bytes = [sum((out / PATTERN.format(rank=r, part=p)).stat().st_size for p in range(len(parts[r])))
                      for r in range(tp)]
        files_order: dict[str, list[str]] = {}
        for name, ref in index.tensors.items():
            files_order.setdefault(ref.file, []).append(name)
        manifest = {"kind": "shard", "layout": LAYOUT_NOTE, "tp": tp, "pattern": PATTERN,
                    "source": str(model.resolve()), "architecture": archs.resolve(index.config).name,
                    "files": files_order, "unsharded_files": names, "rank_bytes": rank_bytes,
                    # each file's own __metadata__ (None: none), so --merge rewrites its header byte for byte
                    # (llm-compressor's files carry none, ours {"format": "pt"})
                    "file_metadata": {f: read_header(model / f)[0].get("__metadata__") for f in files_order},
                    "outputs": file_records(o, o.record["shards"]), "tensors": manifest_tensors}
        text = json.dumps(manifest, indent=1, default=str)
        # the job record keeps what the manifest proves, and the manifest's own SHA-256, before the
        # manifest is written: an edited (or re-hashed) manifest no longer agrees with it (check, merge)
        o.record["files"] = manifest["outputs"]
        o.record["manifest"] = MANIFEST
        o.record["manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        o.complete()
        o.write_text(MANIFEST, text)
    emit({"event": "done", "rank_bytes": rank_bytes})
    return manifest


SPLITS = ("col", "row", "vocab", "rep")
MAX_TP = 1024
_HEX = frozenset("0123456789abcdef")


def _is_sha(v) -> bool:
    return isinstance(v, str) and len(v) == 64 and set(v) <= _HEX


def _is_shape(v) -> bool:
    return type(v) is list and all(type(x) is int and x >= 0 for x in v)


def load_manifest(sharded: Path) -> dict:
    """The shard manifest, every field of the shape ``shard`` writes and every path it names inside
    ``sharded``; anything else is one line naming the field."""
    from .parse import load_json

    path = sharded / MANIFEST
    if not path.is_file():
        raise QuantizeError(f"{path}: missing; {sharded} is not a quantize shard output")
    m = load_json(path, "shard manifest", kind="record")

    def bad(field: str, why: str) -> QuantizeError:
        return QuantizeError(f"{path}: {field} {why}; the manifest is corrupt or hostile, re-shard")

    tp = m.get("tp")
    if type(tp) is not int or not 1 <= tp <= MAX_TP:
        raise bad("'tp'", f"must be an integer in [1, {MAX_TP}], not {tp!r:.40}")
    tensors, files = m.get("tensors"), m.get("files")
    if not isinstance(tensors, dict) or not tensors:
        raise bad("'tensors'", "must be an object of tensor records")
    if not isinstance(files, dict):
        raise bad("'files'", "must be an object of file name -> tensor names")
    for name, rec in tensors.items():
        where = f"tensors[{name!r:.80}]"
        if not isinstance(rec, dict):
            raise bad(where, "must be an object")
        for key, ok, want in (("split", lambda v: v in SPLITS, f"one of {', '.join(SPLITS)}"),
                              ("shape", _is_shape, "a list of non-negative integers"),
                              ("dtype", lambda v: isinstance(v, str) and v in DTYPES, "a safetensors dtype"),
                              ("sha256", _is_sha, "a SHA-256 (64 hex digits)"),
                              ("ranks", lambda v: type(v) is list and len(v) == tp, f"a list of {tp} rank records")):
            if not ok(rec.get(key)):
                raise bad(f"{where}.{key}", f"must be {want}, not {rec.get(key)!r:.40}")
        dim = rec.get("dim")
        if dim is not None and (type(dim) is not int or not 0 <= dim < len(rec["shape"])):
            raise bad(f"{where}.dim", f"must be null or an axis of shape {rec['shape']}, not {dim!r:.40}")
        for r, rr in enumerate(rec["ranks"]):
            if not (isinstance(rr, dict) and isinstance(rr.get("file"), str) and _is_sha(rr.get("sha256"))
                    and _is_shape(rr.get("shape"))):
                raise bad(f"{where}.ranks[{r}]", "must be an object with file, shape and sha256")
            confined(sharded, rr["file"], str(path))
    for f, names in files.items():
        if "/" in f or "\\" in f or not f.endswith(".safetensors"):
            raise bad(f"'files' entry {f!r:.80}", "is not a plain *.safetensors name")
        if type(names) is not list or not all(isinstance(n, str) and n in tensors for n in names):
            raise bad(f"files[{f!r:.80}]", "must list tensors the manifest records")
    unsharded = m.get("unsharded_files", [])
    if type(unsharded) is not list or not all(isinstance(f, str) for f in unsharded):
        raise bad("'unsharded_files'", "must be a list of file names")
    for f in unsharded:
        confined(sharded / UNSHARDED, f, str(path))
    outputs = m.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, dict) or not all(
                isinstance(v, dict) and _is_sha(v.get("sha256")) and type(v.get("bytes")) is int and v["bytes"] >= 0
                for v in outputs.values()):
            raise bad("'outputs'", "must be an object of file -> {sha256, bytes}")
        for f in outputs:
            confined(sharded, f, str(path))
    return m


def verify_shard_files(sharded: Path, m: dict) -> list[str]:
    """The shard folder's files against the manifest and the job record: the manifest must be the
    one ``shard`` recorded (its SHA-256 in the job record) and list what the record lists, and
    ``unsharded/`` must hold exactly what was carried, each file as the manifest, the record and
    ``unsharded/quantize_manifest.json`` say (CheckFailed, one line, otherwise). -> failures of
    the rank files (changed, missing, unrecorded), for the report."""
    from .checkpoint.manifest import job_files
    from .checkpoint.output import RECORD_DIR, RECORD, read_record, sha256_file
    from .errors import CheckFailed

    path = sharded / MANIFEST
    rec = read_record(sharded) or {}
    rec_path = sharded / RECORD_DIR / RECORD
    outputs = m.get("outputs")
    if rec.get("manifest_sha256") is None and outputs is None and job_files(sharded) is None:
        return []  # a shard written before manifests listed their files: its slice checksums only
    if rec.get("kind") != "shard" or not isinstance(rec.get("manifest_sha256"), str):
        raise CheckFailed(f"{rec_path}: missing or not a shard job record, so {path} cannot be compared with what "
                          f"`quantize shard` wrote; re-shard")
    if sha256_file(path) != rec["manifest_sha256"]:
        raise CheckFailed(f"{path}: not the manifest `quantize shard` wrote (its SHA-256 differs from the job "
                          f"record's); the manifest was edited, re-shard")
    if outputs is None or outputs != job_files(sharded):
        raise CheckFailed(f"{path}: its 'outputs' disagree with the job record's files; re-shard")
    failures = []
    for rel, want in sorted(outputs.items()):
        p = sharded / rel
        ok = p.is_file() and p.stat().st_size == want["bytes"] and sha256_file(p) == want["sha256"]
        if rel.startswith(UNSHARDED + "/"):
            if not ok:
                raise CheckFailed(f"{p}: {'missing' if not p.is_file() else 'changed'} since `quantize shard` "
                                  f"carried it (SHA-256 differs from the shard manifest); re-shard")
        elif not ok:
            failures.append(f"{p}: {'missing' if not p.is_file() else 'SHA-256 differs from the shard manifest'}")
    for p in sorted(sharded.rglob("*")):
        rel = p.relative_to(sharded).as_posix()
        if p.is_file() and rel.split("/")[0] != RECORD_DIR and rel != MANIFEST and rel not in outputs:
            if rel.startswith(UNSHARDED + "/"):
                raise CheckFailed(f"{p}: in {UNSHARDED}/ but not carried by `quantize shard` (the shard manifest "
                                  f"does not record it); remove it or re-shard")
            failures.append(f"{p}: a file the shard manifest does not record")
    carried = {f"{UNSHARDED}/{f}" for f in m.get("unsharded_files", [])}
    if carried != {f for f in outputs if f.startswith(UNSHARDED + "/")}:
        raise CheckFailed(f"{path}: 'unsharded_files' disagree with its 'outputs'; re-shard")
    qm = sharded / UNSHARDED / QUANTIZE_MANIFEST
    if qm.is_file():
        from .parse import load_json

        inner = load_json(qm, "quantize manifest", kind="record").get("files")
        if not isinstance(inner, dict):
            raise CheckFailed(f"{qm}: not a quantize manifest (no 'files'); re-shard")
        for f in m.get("unsharded_files", []):
            want = inner.get(f)
            if f != QUANTIZE_MANIFEST and (not isinstance(want, dict)
                                           or want.get("sha256") != sha256_file(sharded / UNSHARDED / f)):
                raise CheckFailed(f"{sharded / UNSHARDED / f}: differs from what the unsharded checkpoint's manifest "
                                  f"({qm}) records for it; re-shard from a checkpoint that passes `quantize check`")
    return failures


class RankReader:
    """Tensors of one sharded folder, by (rank, name); files only from the (confined) manifest."""

    def __init__(self, sharded: Path, manifest: dict):
        self.folder = sharded
        self.manifest = manifest
        self.refs: dict[tuple[int, str], object] = {}
        files: dict[str, int] = {}
        for t in manifest["tensors"].values():
            for rank, r in enumerate(t["ranks"]):
                files.setdefault(r["file"], rank)
        for f, rank in sorted(files.items()):
            path = confined(sharded, f, str(sharded / MANIFEST))
            if not path.exists():
                raise QuantizeError(f"{path}: missing rank file; re-shard")
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


@_no_resume
def merge(sharded: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False, emit: Emit = null_emit) -> dict:
    """Reassemble the unsharded checkpoint (same files, order, tensors and side files) from
    per-rank files; every slice and every reassembled tensor is checked against the manifest."""
    sharded, out = Path(sharded), Path(out)
    m = load_manifest(sharded)
    verify_shard_files(sharded, m)  # the manifest is the one shard wrote, unsharded/ as it carried it
    tp = m["tp"]
    carried = [confined(sharded / UNSHARDED, f, str(sharded / MANIFEST)) for f in m.get("unsharded_files", [])]
    reader = RankReader(sharded, m)
    try:
        with Output.open(out, "merge", [sharded], overwrite=overwrite) as o:
            size = {n: math.prod(t["shape"]) * itemsize(t["dtype"]) for n, t in m["tensors"].items()}
            emit({"event": "start", "stage": "merge", "total_bytes": sum(size.values()), "done_bytes": 0})
            done = 0
            for fname, names in m["files"].items():
                entries = [Entry(n, m["tensors"][n]["dtype"], tuple(m["tensors"][n]["shape"])) for n in names]
                meta = (m.get("file_metadata") or {}).get(fname, {"format": "pt"})  # older manifests: ours
                if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
                    raise QuantizeError(f"{sharded / MANIFEST}: file_metadata of {fname} is not an object of strings; "
                                        "the manifest is corrupt, re-shard")
                w = StreamWriter(out / fname, entries, meta)
                for n in names:
                    rec = m["tensors"][n]
                    pieces = [reader.get(r, n) for r in range(tp)]
                    for r, p in enumerate(pieces):
                        if _sha(p) != rec["ranks"][r]["sha256"]:
                            w.abort()
                            raise QuantizeError(f"{sharded / rec['ranks'][r]['file']}: tensor {n} of rank {r} "
                                                f"does not match its checksum; the file is corrupt, re-shard")
                    full = _full_shape(m, n) if n.endswith(".weight_shape") else None
                    if full is not None:
                        t = torch.tensor(full, dtype=torch.int64)
                    elif rec["dim"] is None:
                        t = pieces[0]
                    else:
                        t = torch.cat(pieces, dim=rec["dim"])
                    if _sha(t) != rec["sha256"]:
                        w.abort()
                        raise QuantizeError(f"{sharded}: reassembled {n} differs from the tensor that was sharded; "
                                            f"the shard is inconsistent")
                    w.write_tensor(n, t)
                    done += size[n]
                    emit({"event": "tensor", "name": n, "done_bytes": done})
                o.mark_done(fname, w.finish(), w.bytes_written)
            # the manifest last: it means complete
            o.copy_side_files(sorted(carried, key=lambda p: p.name == QUANTIZE_MANIFEST))
            if not (out / INDEX_NAME).exists():
                index = {"metadata": {"total_size": sum(math.prod(t["shape"]) * itemsize(t["dtype"])
                                                        for t in m["tensors"].values())},
                         "weight_map": {n: f for f, names in m["files"].items() for n in names}}
                o.write_json(INDEX_NAME, index, sort_keys=False, indent=2)
            o.complete()
    finally:
        reader.close()
    emit({"event": "done"})
    return {"out": str(out), "tensors": len(m["tensors"])}


def _full_shape(m: dict, name: str) -> list[int] | None:
    """The unsharded [N, K] of an INT4 module, from its weight_packed record."""
    pk = m["tensors"].get(name[: -len("weight_shape")] + "weight_packed")
    if pk is None:
        return None
    return [pk["shape"][0], pk["shape"][1] * 8]
