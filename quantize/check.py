"""``quantize check``: run the packed INT4 kernels on exactly what was written and compare with
references; check shapes against the serving kernels' rules; for a sharded folder, prove the split.

Every file against the SHA-256 that ``quantize_manifest.json`` records for it (a missing, changed
or unrecorded weight file fails, named). Per INT4 tensor: our unpack equals compressed-tensors'
``unpack_from_int32`` bit for bit; the CPU kernel (and Triton on a GPU) on random activations
equals the fp32 reference within tolerance. With ``source``: EVERY tensor against what the source
implies, exactly — copies byte for byte, FP8 dequantized to BF16 bit for bit, INT4 re-quantized
from the source with the recorded group size and observer (round-to-nearest is deterministic) and
compared code for code and scale for scale — plus each INT4 tensor's relative error and SNR against
the source. A tensor GPTQ or AutoRound made (the manifest says which) cannot be re-derived without
its calibration pass: its grid is proven instead (GPTQ's scales bit for bit, AutoRound's within its
clip range) and its error against the source is recomputed and must equal the recorded one.
A zeroed o_proj or a few flipped bytes anywhere fail, naming the tensor. Sharded: every
slice matches its manifest checksum, and the concatenation of column-parallel outputs and the sum
of row-parallel partial products equal the unsharded product (fp32).
"""

from __future__ import annotations

import math
import os
import re
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import archs
from .archs.base import ENGINE_UNQUANTIZED, ROLES
from .checkpoint.config import ModelConfig
from .checkpoint.index import INDEX_NAME, CheckpointIndex, read_tensor
from .checkpoint.manifest import MANIFEST as QUANTIZE_MANIFEST
from .checkpoint.manifest import job_files
from .checkpoint.output import RECORD, RECORD_DIR, confined, sha256_file
from .checkpoint.reader import FP8_SCALE_NAMES, WeightReader
from .errors import CheckFailed, QuantizeError
from .events import Emit, null_emit
from .formats import int4 as int4_fmt
from .formats.int4 import unpack_int4
from .kernels.cpu import CpuW4A16
from . import check_native  # SGLang's native w4afp8: its own layout and loader facts
from .check_native import W4A8_RTOL, w4a8_row  # noqa: F401 - W4A8_RTOL: the bound both layouts' rows take
from .kernels.reference import w4a16_reference, w4a8_reference
from .options import DATA_AWARE, CheckOptions, takes  # DATA_AWARE: the source alone cannot re-derive them
from .options import torch_threads, usable_cpus
from .shard import MANIFEST, UNSHARDED, RankReader, _sha, load_manifest, plan_shard, rank_pieces, verify_shard_files

REPORT_KIND = "check"  # the ``written_by`` kind of its JSON report (`check --json`, run's reports/check.json)
KERNEL_RTOL = 2e-2  # bf16 output of the CPU/Triton kernel vs fp32 reference (relative L2)
SHARD_RTOL = 1e-5  # fp32 recombination vs fp32 unsharded product (max abs / max |y|)


@dataclass
class Row:
    tensor: str
    role: str
    unpack_ok: bool = True
    kernel_rel_err: float | None = None
    source_rel_err: float | None = None
    snr_db: float | None = None
    shard_max_err: float | None = None
    # W4AFP8: the reference W4A8 product (FP8 per-token activations) against the W4A16 one, relative L2
    w4a8_rel_err: float | None = None
    failures: list[str] = field(default_factory=list)


@dataclass
class CheckReport:
    model: str
    tp: int | None
    sharded: bool
    rows: list[Row]
    failures: list[str]
    verified: dict = field(default_factory=dict)  # what was proven: files by SHA-256, tensors against the source
    moe_layer: dict | None = None  # _moe_layer_check: one MoE layer through the fused kernel vs the reference

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {"model": self.model, "tp": self.tp, "sharded": self.sharded, "ok": self.ok, "failures": self.failures,
                "verified": self.verified, "summary": self.summary(), "tensors": [asdict(r) for r in self.rows],
                **({"moe_layer_rel_err": self.moe_layer["rel_err"], "moe_layer": self.moe_layer}
                   if self.moe_layer else {})}

    def summary(self) -> dict:
        out: dict[str, dict] = {}
        for r in self.rows:
            d = out.setdefault(r.role, {"tensors": 0, "failed": 0, "max_kernel_rel_err": 0.0,
                                        "max_source_rel_err": None, "min_snr_db": None, "max_shard_err": None})
            d["tensors"] += 1
            d["failed"] += bool(r.failures)
            if r.kernel_rel_err is not None:
                d["max_kernel_rel_err"] = max(d["max_kernel_rel_err"], r.kernel_rel_err)
            if r.source_rel_err is not None:
                d["max_source_rel_err"] = max(d["max_source_rel_err"] or 0.0, r.source_rel_err)
                d["min_snr_db"] = min(d["min_snr_db"] if d["min_snr_db"] is not None else 1e9, r.snr_db)
            if r.shard_max_err is not None:
                d["max_shard_err"] = max(d["max_shard_err"] or 0.0, r.shard_max_err)
        return out


def _ct_unpack(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(packed, 4, torch.Size(shape))


def _unpack_ok(packed: torch.Tensor, shape: tuple[int, int]) -> bool:
    """Our unpack equals compressed-tensors' ``unpack_from_int32``, a block of rows at a time."""
    k = shape[1]
    return all(torch.equal(unpack_int4(packed[r0:r1], k), _ct_unpack(packed[r0:r1], (r1 - r0, k)))
               for r0, r1 in int4_fmt.row_blocks(shape[0]))


def _kernel_err(x: torch.Tensor, packed, scale, shape) -> tuple[float, torch.Tensor]:
    """The CPU kernel's relative L2 error against the fp32 reference, both a block of output rows
    (weight rows) at a time; and the reference [tokens, N]."""
    n, k = shape
    ref = torch.empty((x.shape[0], n), dtype=torch.float32)
    sq = 0.0
    for r0, r1 in int4_fmt.row_blocks(n):
        part = (r1 - r0, k)
        ref[:, r0:r1] = w4a16_reference(x, packed[r0:r1], scale[r0:r1], part)
        y = CpuW4A16.from_packed(packed[r0:r1], scale[r0:r1], part)(x).float()
        sq += float((y - ref[:, r0:r1]).pow(2).sum(dtype=torch.float64))
    err = sq**0.5 / max(float(ref.norm()), 1e-30)
    if torch.cuda.is_available():  # torch's CUDA INT4 GEMM where it applies, the split-K Triton kernel otherwise
        from .kernels import cuda_int4
        from .kernels.availability import triton_available

        pc, sc = packed.cuda(), scale.cuda()
        if cuda_int4.applies(tuple(shape), shape[1] // scale.shape[1], torch.cuda.get_device_capability())[0]:
            yt = cuda_int4.CudaW4A16.from_packed(pc, sc, tuple(shape))(x.cuda()).float().cpu()
        elif triton_available()[0]:
            from .kernels.triton_w4a16 import w4a16_triton

            yt = w4a16_triton(x.cuda(), pc, sc, tuple(shape)).float().cpu()
        else:
            return err, ref
        err = max(err, float((yt - ref).norm() / ref.norm().clamp_min(1e-30)))
    return err, ref


def _module_row(model: Path, index: CheckpointIndex, row: "Row", shape: tuple[int, int], x: torch.Tensor,
                fp8_act: bool) -> "Row":
    """One INT4 module's checks into ``row``: the unpack against compressed-tensors', the CPU kernel
    (and CUDA's, where a GPU is visible) against the reference on ``x``, the W4A8 product if it has one."""
    m = row.tensor
    packed = read_tensor(model, index.tensors[m + ".weight_packed"])
    scale = read_tensor(model, index.tensors[m + ".weight_scale"])
    row.unpack_ok = _unpack_ok(packed, shape)
    if not row.unpack_ok:
        row.failures.append(f"{m}: unpack differs from compressed-tensors' unpack_from_int32")
    row.kernel_rel_err, ref = _kernel_err(x, packed, scale, shape)
    if not row.kernel_rel_err <= KERNEL_RTOL:
        row.failures.append(f"{m}: W4A16 kernel differs from the reference "
                            f"(rel. error {row.kernel_rel_err:.3g} > {KERNEL_RTOL})")
    if fp8_act:
        w4a8_row(row, w4a8_reference(x, packed, scale, shape), ref, "FP8 per-token activations")
    return row


def check_workers() -> int:
    """Modules checked at once: one per usable CPU, each on one torch thread (a block of 128 rows is
    too small an op for torch's own threads to share well); one where a GPU is visible, whose kernels
    run from this thread alone."""
    return 1 if torch.cuda.is_available() else usable_cpus()


def _ready(value) -> Future:
    done: Future = Future()
    done.set_result(value)
    return done


def _check_modules(model: Path, index: CheckpointIndex, arch, modules: list[str], tokens: int,
                   g: torch.Generator, fp8_act: set[str], emit: Emit, workers: int | None = None) -> list["Row"]:
    """Every INT4 module's row, in module order, on ``workers`` threads (``check_workers()``). This
    thread reads each module's shape from the header and draws its activations from ``g`` in module
    order, so every row is the same whatever the number of workers; the tensors are read and checked
    on the workers, at most two modules per worker ahead of the one reported."""
    # compressed-tensors' unpack is imported here, before the workers: two threads importing one
    # package can see it half-initialised
    import compressed_tensors.compressors.pack_quantized.helpers  # noqa: F401

    workers = workers or check_workers()
    rows: list[Row] = []
    pending: deque[tuple[Future, bool]] = deque()

    def report(limit: int) -> None:
        while len(pending) > limit:
            fut, checked = pending.popleft()
            rows.append(fut.result())
            if checked:
                emit({"event": "tensor", "name": rows[-1].tensor, "done_bytes": len(rows)})

    with torch_threads(1) if workers > 1 else nullcontext(), ThreadPoolExecutor(workers) as pool:
        for m in modules:
            pshape, sshape = index.tensors[m + ".weight_packed"].shape, index.tensors[m + ".weight_scale"].shape
            shape = tuple(int(v) for v in read_tensor(model, index.tensors[m + ".weight_shape"]).tolist())
            row = Row(m, arch.role_of(m + ".weight")[0])
            if (tuple(pshape) != (shape[0], math.ceil(shape[1] / 8)) or sshape[0] != shape[0]
                    or shape[1] % sshape[1]):
                row.failures.append(f"{m}: weight_packed {list(pshape)} / weight_scale {list(sshape)} "
                                    f"do not fit weight_shape {list(shape)}")
                pending.append((_ready(row), False))
                continue
            x = torch.randn(tokens, shape[1], generator=g).to(torch.bfloat16)
            if workers > 1:
                pending.append((pool.submit(_module_row, model, index, row, shape, x, m in fp8_act), True))
            else:  # here, on this thread: with a GPU visible its kernels never run from a worker thread
                pending.append((_ready(_module_row(model, index, row, shape, x, m in fp8_act)), True))
            report(2 * workers)
        report(0)
    return rows


MOE_RTOL = 2e-2  # a whole MoE layer (bf16 between its GEMMs) vs the fp32 reference (relative L2)
MOE_CHECK_EXPERTS = 16  # experts of the layer read for the MoE-layer check (the lowest indices)
MOE_CHECK_EXPERTS_INTERPRETED = 4  # as many under Triton's interpreter (CPU), whose cost is per element
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


def _moe_layer_check(model: Path, index: CheckpointIndex, arch, modules: list[str], tokens: int,
                     seed: int) -> dict | None:
    """The first MoE layer's routed experts (the lowest MOE_CHECK_EXPERTS, every one INT4; fewer when
    the kernel is interpreted) as one layer: random tokens routed top-k through the fused MoE Triton
    kernel (on CUDA; on the CPU under TRITON_INTERPRET=1), else torch's int4 CPU GEMM per expert, against
    the fp32 reference of the dequantized experts (transformers' experts math). None when no layer has
    INT4 routed experts of one shape."""
    from .kernels import moe
    from .kernels.availability import triton_available

    fused = triton_available()[0] and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
    cap = MOE_CHECK_EXPERTS if torch.cuda.is_available() or not fused else MOE_CHECK_EXPERTS_INTERPRETED
    roles = {"expert_gate": 0, "expert_up": 1, "expert_down": 2}
    layers: dict[int, dict[int, list]] = {}
    for m in modules:
        role, layer = arch.role_of(m + ".weight")
        hit = _EXPERT_RE.search(m)
        if role in roles and layer is not None and hit:
            layers.setdefault(layer, {}).setdefault(int(hit.group(1)), [None, None, None])[roles[role]] = m
    for layer in sorted(layers):
        experts = sorted(e for e, ms in layers[layer].items() if all(ms))[:cap]
        if experts:
            break
    else:
        return None
    t = {}
    for e in experts:
        for m in layers[layer][e]:
            t[m] = tuple(read_tensor(model, index.tensors[m + s]) for s in (".weight_packed", ".weight_scale"))
    gate, up, down = ([t[layers[layer][e][j]] for e in experts] for j in range(3))
    i, h = gate[0][0].shape[0], gate[0][0].shape[1] * 8
    if not all(g[0].shape == u[0].shape == (i, h // 8) and g[1].shape == u[1].shape and d[0].shape == (h, i // 8)
               and d[1].shape[0] == h and h % g[1].shape[1] == 0 and i % d[1].shape[1] == 0
               for g, u, d in zip(gate, up, down)) or len({d[1].shape for d in down}) != 1 \
            or len({g[1].shape for g in gate}) != 1:
        return None  # a shape the per-tensor rows already report, or experts of mixed shapes
    w13 = torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(gate, up)])
    s13 = torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(gate, up)])
    w2, s2 = torch.stack([d[0] for d in down]), torch.stack([d[1] for d in down])
    top_k = min(len(experts), ModelConfig.from_dict(index.config, model / "config.json").int("num_experts_per_tok", 2))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, len(experts), generator=g).argsort(-1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    ref = moe.moe_reference(x, ids, weights, w13, s13, w2, s2)
    if fused:
        from .kernels.triton_moe import moe_layer

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        path = "triton fused MoE" + (" (CUDA)" if dev == "cuda" else " (interpreted)")
        y = moe_layer(*(a.to(dev) for a in (x, ids, weights, w13, s13, w2, s2))).float().cpu()
    else:
        path = "torch int4 CPU GEMM per expert"
        y = moe.moe_layer_cpu(x, ids, weights, w13, s13, w2, s2).float()
    err = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
    return {"layer": layer, "experts": len(experts), "top_k": top_k, "tokens": tokens, "path": path, "rel_err": err}


def verify_files(model: Path) -> tuple[list[str], dict]:
    """Every file against its SHA-256 in ``quantize_manifest.json``; weight files the manifest does
    not record fail too. -> (failures, manifest)."""
    from .parse import load_json

    path = model / QUANTIZE_MANIFEST
    if not path.exists():
        return [f"{path}: missing, so no file can be proven; the output is incomplete "
                f"or was not written by quantize"], {}
    manifest = load_json(path, "quantize manifest", kind="record")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return [f"{path}: not a quantize manifest (needs per-file SHA-256 under 'files'); the output is corrupt"], {}
    failures = []
    for name, rec in sorted(files.items()):
        p = confined(model, name, str(path))
        if not p.is_file():
            failures.append(f"{p}: recorded in the manifest but missing")
        elif p.stat().st_size != rec.get("bytes") or sha256_file(p) != rec.get("sha256"):
            failures.append(f"{p}: SHA-256 differs from the manifest; the file changed after it was written")
    for p in sorted(model.rglob("*.safetensors")):
        rel = p.relative_to(model).as_posix()
        if rel.split("/")[0] != RECORD_DIR and rel not in files:
            failures.append(f"{p}: a weight file the manifest does not record")
    return failures, manifest


def is_vendor_folder(model: Path) -> bool:
    """A release as its vendor ships it (e.g. Kimi K2.6's INT4): neither a quantize manifest nor a
    job record, so there is no manifest to prove files against (a quantize output missing its
    manifest still has its record, and is incomplete)."""
    return not (model / QUANTIZE_MANIFEST).exists() and not (model / RECORD_DIR).exists()


def prove_files(model: Path) -> tuple[bool, list[str], dict]:
    """(a vendor folder, failures, manifest): ``verify_files`` unless ``is_vendor_folder``."""
    if is_vendor_folder(model):
        return True, [], {}
    return (False, *verify_files(model))


def check_fp8_dtypes(src: CheckpointIndex) -> None:
    """Every FP8 weight of a source 2-D e4m3 and its scale of a dtype the format allows
    (formats.layout), as convert's plan requires: one line naming the tensor otherwise."""
    from .checkpoint.reader import fp8_scale_format, weight_block
    from .formats import layout

    block = weight_block(src.config, ModelConfig.from_dict(src.config, src.folder / "config.json").text)
    for name, ref in src.tensors.items():
        if ref.dtype != layout.FP8_WEIGHT_DTYPE or not name.endswith(".weight"):
            continue
        why = layout.fp8_weight_error(ref.shape)
        scale = next((src.tensors[name[: -len("weight")] + s] for s in FP8_SCALE_NAMES
                      if name[: -len("weight")] + s in src.tensors), None)
        if why is None and scale is not None:
            why = layout.fp8_scale_error(scale.dtype, fp8_scale_format(ref, scale, block, src.folder))
            name = scale.name if why else name
        if why:
            raise QuantizeError(f"{src.folder / src.tensors[name].file}: {name} {why}; the source is corrupt, "
                                f"re-download it")


def verify_manifest_record(model: Path, manifest: dict, index: CheckpointIndex) -> None:
    """The manifest must prove something and be what the writing command recorded: its ``files``
    equal the job record's (``job_files``), and cover config.json, the index, every file the index
    names (a stray *.safetensors in the folder is ``verify_files``' failure). CheckFailed (one line)
    otherwise."""
    path = model / QUANTIZE_MANIFEST
    files = manifest.get("files") or {}
    if not files:
        raise CheckFailed(f"{path}: 'files' is empty, so the manifest proves nothing; the output is corrupt, "
                          f"convert again")
    rec_path = model / RECORD_DIR / RECORD
    recorded = job_files(model)
    if recorded is None:
        if not rec_path.is_file():
            raise CheckFailed(f"{rec_path}: missing, so the manifest cannot be compared with what the writing "
                              f"command recorded; the output is incomplete or not quantize's, convert again")
        # a record from before records kept their files: the manifest alone speaks for the output
    else:
        for name in sorted(set(recorded) | set(files)):
            if name not in files:
                raise CheckFailed(f"{path}: does not list {name}, which the job record ({rec_path}) says was "
                                  f"written; the manifest was edited, convert again")
            if name not in recorded:
                raise CheckFailed(f"{path}: lists {name}, which the job record ({rec_path}) does not; the manifest "
                                  f"was edited, convert again")
            if recorded[name] != files[name]:
                raise CheckFailed(f"{path}: the SHA-256 or size of {name} differs from the job record's "
                                  f"({rec_path}); the manifest was edited after it was written, convert again")
    need = {"config.json", *index.files}  # a *.safetensors no index names: verify_files reports it
    if (model / INDEX_NAME).exists():
        need.add(INDEX_NAME)
    missing = sorted(need - set(files))
    if missing:
        raise CheckFailed(f"{path}: does not record {missing[0]}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the folder holds; "
                          f"the manifest must cover config.json, the index and every weight file, convert again")


def _value(v):
    """An enum field of compressed-tensors' models as its plain value."""
    return getattr(v, "value", v)


def w4afp8_modules(index: CheckpointIndex, modules: list[str]) -> set[str]:
    """The INT4 modules whose config group quantizes their input activations (W4AFP8), matched as
    compressed-tensors matches (``verify_quant_config`` has proven the config first)."""
    from .plan import _ct_match, _scheme_for

    qc = ModelConfig.from_dict(index.config, "config.json").quantization_config or {}
    groups = qc.get("config_groups") or {}
    act = {g for g, sc in groups.items() if isinstance(sc, dict) and sc.get("input_activations")}
    if not act:
        return set()
    view = {"ignore": qc.get("ignore") or [],
            "config_groups": {g: {"targets": sc.get("targets") or []} for g, sc in groups.items()}}
    return {m for m in modules if _scheme_for(m, view, _ct_match) in act}


def verify_quant_config(model: Path, index: CheckpointIndex) -> None:
    """config.json's ``quantization_config`` describes the tensors, read by compressed-tensors' own
    models and matched by its own ``match_name``: compressed-tensors, pack-quantized, 4-bit symmetric
    int by group of the group size the tensors are stored with (W4A16), every INT4 module in a
    config group and not ignored, every BF16 Linear ignored (or untargeted), every FP8 one in an
    8-bit float group. CheckFailed (one line naming the field and what the tensors say) otherwise."""
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    from .options import W4AFP8_GROUP
    from .plan import W4AFP8_INPUT, _ct_match, _names, _scheme_for
    from .shard import _int4_modules

    where = model / "config.json"
    arch = archs.resolve(index.config, str(where))
    qc = ModelConfig.from_dict(index.config, where).quantization_config
    int4 = _int4_modules(index)
    first = next(iter(int4), None)
    if not qc:
        raise CheckFailed(f"{where}: no quantization_config, but the tensors hold {len(int4)} INT4 pack-quantized "
                          f"modules (e.g. {first}); an engine would not load them, convert again")
    try:
        parsed = QuantizationConfig.model_validate(qc)
    except (ValidationError, ValueError, TypeError) as e:
        why = str(e).splitlines()
        raise CheckFailed(f"{where}: quantization_config is not one compressed-tensors reads "
                          f"({' '.join(why[:3])[:200]}); convert again") from None
    for pat in [p for p in (qc.get("ignore") or []) if isinstance(p, str) and p.startswith("re:")] + [
        t for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)
        for t in (g.get("targets") or []) if isinstance(t, str) and t.startswith("re:")
    ]:
        try:
            re.compile(pat[3:])
        except re.error as e:
            raise CheckFailed(f"{where}: quantization_config pattern {pat!r} does not compile ({e}); no engine can "
                              "match names with it, convert again") from None
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckFailed(f"{where}: quantization_config.quant_method is {qc.get('quant_method')!r}, but the tensors "
                          f"are compressed-tensors pack-quantized INT4; convert again")
    fp8 = [n[: -len(".weight")] for n, r in index.tensors.items() if r.dtype == "F8_E4M3" and n.endswith(".weight")]
    want_fmt = "mixed-precision" if fp8 else "pack-quantized"
    if int4 and parsed.format != want_fmt:
        raise CheckFailed(f"{where}: quantization_config.format is {parsed.format!r}, but the tensors are "
                          f"{'INT4 and FP8' if fp8 else 'INT4 pack-quantized'} ({want_fmt!r}); convert again")
    view = {"ignore": list(parsed.ignore or []),
            "config_groups": {g: {"targets": list(sc.targets)} for g, sc in parsed.config_groups.items()}}
    checked: set[str] = set()
    def group(module: str) -> str:
        # "bf16" when the config leaves the module unquantized under the checkpoint's name or the one
        # the engines match (Kimi: `language_model.` stripped, so a plain `lm_head` in the ignore list,
        # as Moonshot writes it, holds for `language_model.lm_head`), else its group by the checkpoint name
        grps = {_scheme_for(m, view, _ct_match) for m in _names(arch, module, index.config)}
        return "bf16" if "bf16" in grps else _scheme_for(module, view, _ct_match)

    for module, (n, k, g) in int4.items():
        grp = group(module)
        if grp == "bf16":
            raise CheckFailed(f"{where}: quantization_config leaves {module} unquantized (ignored, or in no config "
                              f"group's targets), but the tensors hold it INT4; convert again")
        if grp in checked:
            continue
        sc, field = parsed.config_groups[grp], f"quantization_config.config_groups.{grp}"
        w = sc.weights
        fmt = sc.format or parsed.format
        says = (("format", fmt, "pack-quantized"), ("weights", None if w is None else "given", "given"),
                ("weights.num_bits", getattr(w, "num_bits", None), 4),
                ("weights.type", _value(getattr(w, "type", None)), "int"),
                ("weights.symmetric", getattr(w, "symmetric", None), True),
                ("weights.strategy", _value(getattr(w, "strategy", None)), "group"),
                ("weights.group_size", getattr(w, "group_size", None), g),
                ("weights.dynamic", getattr(w, "dynamic", None), False))
        for name, got, want in says:
            if got != want:
                raise CheckFailed(f"{where}: {field}.{name} is {got!r}, but the tensors of {module} are "
                                  f"{want!r} (INT4 pack-quantized, group {g}); convert again")
        a = sc.input_activations
        if a is not None and g != W4AFP8_GROUP:
            raise CheckFailed(f"{where}: {field}.input_activations is set (W4AFP8), but the tensors of {module} are "
                              f"INT4 by group {g} and the W4A8 kernels take group {W4AFP8_GROUP} only: a W4A16 "
                              "checkpoint needs input_activations null; convert again")
        for k, want in W4AFP8_INPUT.items() if a is not None else ():  # exactly what vLLM's `_is_fp8_w4a8` takes
            got = _value(getattr(a, k, None))
            if got != want:
                raise CheckFailed(f"{where}: {field}.input_activations.{k} is {got!r}; W4AFP8 as vLLM 0.33 reads it "
                                  f"needs {want!r} (dynamic per-token FP8, docs/engines.md#w4afp8); convert again")
        checked.add(grp)
    for name, ref in index.tensors.items():
        base, _, param = name.rpartition(".")
        role = arch.role_of(name)[0]
        if param != "weight" or len(ref.shape) != 2 or not ROLES[role][0] or role in ENGINE_UNQUANTIZED:
            continue
        grp = _scheme_for(base, view, _ct_match) if ref.dtype == "F8_E4M3" else group(base)
        if ref.dtype == "F8_E4M3":
            w = parsed.config_groups[grp].weights if grp != "bf16" else None
            if w is None or w.num_bits != 8 or _value(w.type) != "float":
                raise CheckFailed(f"{where}: quantization_config puts {base} in {grp}, but the tensors hold it as "
                                  f"FP8 (8-bit float); convert again")
        elif grp != "bf16":
            raise CheckFailed(f"{where}: quantization_config puts {base} in {grp} (its targets match it and no "
                              f"ignore entry does), but the tensors hold it {ref.dtype}; an engine would expect "
                              f"packed weights, add it to 'ignore' or convert again")


_diff = int4_fmt.bitwise_diff


KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale", "k_proj.k_scale", "v_proj.v_scale")


METHOD_BOUND = 2.0  # a data-aware method's weight error may reach this many times --max-source-rel-err


def _method_tensor(where: str, how: str, rec: dict, scale: torch.Tensor, exp: "int4_fmt.Int4Result", observer: str,
                   sums: tuple[float, float, float]) -> str | None:
    """A tensor GPTQ or AutoRound made cannot be re-derived without its calibration pass; what the
    source still proves: the grid (GPTQ fixes the RTN scales before its update, bit for bit;
    AutoRound's clip factors keep each |scale| within [0.5, 1] of RTN's on its grid) and the error
    against this source (``sums``: ``int4.error_sums`` of the stored tensor, as the conversion
    recorded it; a different split of the sum moves the relative error by ~1e-15, the max not at
    all). -> why not, or None."""
    from .methods.registry import METHODS  # the method's own proof of its grid (imports torch, as this module does)

    why = METHODS[how].grid_proof(scale, exp.scale, observer)
    if why:
        return f"{where}: {why}"
    sq_err, sq_ref, max_err = sums
    rel = (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0
    want_rel, want_max = rec.get("rel_err"), rec.get("max_abs_err")
    if not (isinstance(want_rel, (int, float)) and math.isclose(rel, want_rel, rel_tol=1e-9, abs_tol=1e-12)
            and isinstance(want_max, (int, float)) and max_err == want_max):
        return (f"{where}: its error against this source (relative {rel:.9g}, max {max_err:.6g}) is not the one "
                f"the conversion recorded ({want_rel}, {want_max}): the codes or scales changed, or another source "
                f"was used")
    return None


def _fp8_block_diff(o: WeightReader, s: WeightReader, name: str, base: str) -> str | None:
    """An FP8 block output tensor against FP8_BLOCK of the source weight as llm-compressor reads it
    (FP8 and INT4 sources dequantized to BF16 first); why not, or None."""
    from .formats import fp8 as fp8_fmt

    # the one reader dequantizes INT4 (code x scale in the scale dtype) and FP8 to BF16, as
    # llm-compressor's dequantizers do; a float weight keeps its own dtype
    w = s.raw(name) if s.scheme(name) == "float" else s.weight(name, torch.bfloat16)
    if base + ".weight_scale" not in o.index.tensors:
        return "its weight_scale is missing"
    q, scale = fp8_fmt.quant_block_ct(w)
    d = _diff(o.raw(name), q) or _diff(o.raw(base + ".weight_scale"), scale)
    return f"FP8 block codes/scales differ from FP8_BLOCK of the source: {d}" if d else None


def verify_against_source(out: CheckpointIndex, src: CheckpointIndex, options: dict, rows: dict[str, "Row"],
                          max_source_rel_err: float, emit: Emit = null_emit, records: dict[str, dict] | None = None
                          ) -> tuple[list[str], int, int]:
    """Every output tensor against what the source implies: copies, FP8 and round-to-nearest INT4
    exactly; a tensor the manifest's ``records`` say GPTQ or AutoRound made, by its grid and its
    recorded error (``_method_tensor``). -> (failures, tensors proven exactly, method tensors proven)."""
    o, s = WeightReader(out), WeightReader(src)
    observer = options.get("observer") or "minmax"
    records = records or {}
    # an INT4 source (Kimi K2.6): its tensors pass through (compared byte for byte below, as copies),
    # or with --requantize were dequantized exactly and quantized again (re-derived here the same way)
    fp8_block = options.get("scheme") == "fp8-block"
    redone = {n[: -len(".weight_packed")] for n in src.tensors if n.endswith(".weight_packed")} \
        if options.get("requantize") or fp8_block else set()
    failures: list[str] = []
    proven = by_method = 0
    accounted: set[str] = set()
    try:
        names = [n for n in src.tensors if n.rpartition(".")[2] not in FP8_SCALE_NAMES + ("input_scale",)
                 or n.rpartition(".")[0] + ".weight" not in src.tensors]
        emit({"event": "start", "stage": "check against source", "total_bytes": len(names), "done_bytes": 0,
              "unit": "tensors"})
        for i, name in enumerate(names):
            emit({"event": "tensor", "name": name, "done_bytes": i + 1})
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            where = f"{out.folder}: tensor {name}"
            m4, _, part = name.rpartition(".")
            if m4 in redone:
                if part != "weight_packed":
                    continue  # its module is proven with its weight_packed
                name, base, where = m4 + ".weight", m4, f"{out.folder}: tensor {m4}"
                if base + ".weight" in out.tensors:  # INT4 -> FP8 block
                    accounted.update((base + ".weight", base + ".weight_scale"))
                    d = _fp8_block_diff(o, s, name, base)
                    if d:
                        failures.append(f"{where}: differs from the source ({d})")
                    else:
                        proven += 1
                    continue
            if name in out.tensors:
                got, ref = o.raw(name), s.raw(name)
                accounted.add(name)
                if got.dtype == torch.float8_e4m3fn and fp8_block:  # FP8_BLOCK of the source weight, an FP8
                    d = _fp8_block_diff(o, s, name, base)  # one too (dequantized to BF16 first, its scale BF16)
                    accounted.add(base + ".weight_scale")
                elif got.dtype == ref.dtype:  # a copy, or an FP8 weight kept FP8 with its scale
                    d = _diff(got, ref)
                    if d is None and got.dtype == torch.float8_e4m3fn:
                        sc = s.fp8_scale(name)
                        kept = base + ".weight_scale"
                        accounted.add(kept)
                        d = (_diff(o.raw(kept), s.raw(sc[0].name)) if sc and kept in out.tensors
                             else "its scale is missing")
                elif ref.dtype == torch.float8_e4m3fn:
                    d = _diff(got, s.weight(name, torch.bfloat16))
                else:
                    d = f"{got.dtype} where the source holds {ref.dtype}"
                if d:
                    failures.append(f"{where}: differs from the source ({d})")
                else:
                    proven += 1
                continue
            if base is not None and base + ".weight_packed" in out.tensors:
                accounted.update(base + x for x in (".weight_packed", ".weight_scale", ".weight_shape"))
                packed, scale = o.raw(base + ".weight_packed"), o.raw(base + ".weight_scale")
                shape = [int(v) for v in o.raw(base + ".weight_shape").tolist()]
                if base in redone:
                    ref_shape = [int(v) for v in s.raw(base + ".weight_shape").tolist()]
                else:
                    ref_shape = list(src.tensors[name].shape)
                if shape != ref_shape or scale.shape[0] != shape[0] or shape[1] % scale.shape[1]:
                    failures.append(f"{where}: INT4 shape {shape} / scale {list(scale.shape)} do not fit the source "
                                    f"{ref_shape}")
                    continue
                if base in redone:  # as convert --requantize read it: code x scale, exact in fp32
                    w = int4_fmt.dequantize_int4(s.raw(base + ".weight_packed"), s.raw(base + ".weight_scale"),
                                                 tuple(ref_shape), dtype=torch.float32, exact=True)
                else:
                    fp8src = s.scheme(name).startswith("fp8")
                    w = s.weight(name, torch.bfloat16 if fp8src else src.tensors[name].torch_dtype)
                g = shape[1] // scale.shape[1]
                exp = int4_fmt.quantize_pack_rows(w, g, observer, scale.dtype)
                how = (records.get(name) or {}).get("method")
                by_data = how in DATA_AWARE
                sums = int4_fmt.error_sums_rows(w, packed, scale)  # the stored tensor's error against the source
                if by_data:
                    d = _method_tensor(where, how, records[name], scale, exp, observer, sums)
                    if d:
                        failures.append(d)
                    else:
                        by_method += 1
                else:
                    d = _diff(packed, exp.packed) or _diff(scale, exp.scale)
                    if d:
                        failures.append(f"{where}: INT4 codes/scales differ from re-quantizing the source "
                                        f"(group {g}, observer {observer}: {d})")
                    else:
                        proven += 1
                row = rows.get(base)
                if row is not None:
                    sq_err, sq_ref, _ = sums
                    row.source_rel_err = (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0
                    row.snr_db = 10 * math.log10(sq_ref / sq_err) if sq_err > 0 else float("inf")
                    bound = max_source_rel_err * (METHOD_BOUND if by_data else 1.0)
                    if row.source_rel_err > bound:
                        row.failures.append(f"{base}: relative error {row.source_rel_err:.3f} against the source "
                                            f"exceeds {bound:g}"
                                            + (f" ({METHOD_BOUND:g} x --max-source-rel-err for a {how} tensor: "
                                               "the method lowers the layer's output error, not the weight error)"
                                               if bound != max_source_rel_err else ""))
                continue
            failures.append(f"{where}: in the source but not in the output")
        for name in out.tensors:
            if name not in accounted and not name.endswith(KV_SCALE_SUFFIXES):
                failures.append(f"{out.folder}: tensor {name} is in the output but nothing in the source implies it")
    finally:
        o.close()
        s.close()
    return failures, proven, by_method


def proven_parts(verified: dict) -> list[str]:
    """What a check report's ``verified`` proves against the source, in words: the CLI, the run's
    summary and the model card say it alike."""
    parts = []
    if "tensors_exact_vs_source" in verified:
        parts.append(f"{verified['tensors_exact_vs_source']} tensors exactly against the source")
    if "tensors_method_vs_source" in verified:
        parts.append(f"{verified['tensors_method_vs_source']} GPTQ/AutoRound tensors by their grid and recorded error")
    return parts


@takes(CheckOptions)
def check(model, tp, source, tokens, seed, max_source_rel_err, emit: Emit = null_emit) -> CheckReport:
    model = Path(model)
    if source is not None and Path(source).resolve() == model.resolve():
        raise QuantizeError(f"--source {source}: is the checkpoint being checked, which proves nothing against itself; "
                            "pass the checkpoint convert read (or, for a sharded folder, the one shard read)")
    if (model / MANIFEST).exists():
        return _check_sharded(model, source, tokens, seed, emit)
    index = CheckpointIndex.open(model)
    arch = archs.resolve(index.config, str(model / "config.json"))
    vendor, failures, manifest = prove_files(model)
    if manifest:
        verify_manifest_record(model, manifest, index)
    if check_native.is_native(index):  # SGLang's native w4afp8: its own layout and loader facts
        return _check_native(model, index, tp, source, tokens, seed, max_source_rel_err, vendor, failures,
                             manifest, emit)
    verify_quant_config(model, index)
    verified = {"files_sha256": len(manifest.get("files") or {}) - len(failures)}
    if vendor:
        verified["files_unrecorded"] = len(index.files)
    if tp:
        try:
            plan_shard(model, tp)
        except QuantizeError as e:
            failures.append(str(e))
    src = CheckpointIndex.open(source) if source else None
    if src is not None:
        check_fp8_dtypes(src)
    g = torch.Generator().manual_seed(seed)
    modules = [n[: -len(".weight_packed")] for n in index.tensors if n.endswith(".weight_packed")]
    fp8_out = any(r.dtype == "F8_E4M3" for r in index.tensors.values())
    if not modules and not fp8_out:
        raise QuantizeError(f"{model}: no INT4 (weight_packed) or FP8 tensors to check; is this a quantize convert "
                            "output?")
    fp8_act = w4afp8_modules(index, modules)
    emit({"event": "start", "stage": "check", "total_bytes": len(modules), "done_bytes": 0, "unit": "modules"})
    rows = _check_modules(model, index, arch, modules, tokens, g, fp8_act, emit)
    moe_rec = _moe_layer_check(model, index, arch, modules, tokens, seed)
    if moe_rec is not None and not moe_rec["rel_err"] <= MOE_RTOL:
        failures.append(f"{model}: MoE layer {moe_rec['layer']} through {moe_rec['path']} differs from the "
                        f"reference (rel. error {moe_rec['rel_err']:.3g} > {MOE_RTOL})")
    if src is not None:
        records = {t["name"]: t for t in manifest.get("tensors") or []
                   if isinstance(t, dict) and isinstance(t.get("name"), str)}
        bad, proven, by_method = verify_against_source(index, src, manifest.get("options") or {},
                                                       {r.tensor: r for r in rows}, max_source_rel_err, emit, records)
        failures += bad
        verified["tensors_exact_vs_source"] = proven
        if by_method:
            verified["tensors_method_vs_source"] = by_method
    failures += [f for r in rows for f in r.failures]
    emit({"event": "done"})
    return CheckReport(str(model), tp, False, rows, failures, verified, moe_rec)


def _check_native(model: Path, index: CheckpointIndex, tp, source, tokens, seed, max_source_rel_err, vendor,
                  failures: list[str], manifest: dict, emit: Emit) -> CheckReport:
    """``check`` of SGLang's native w4afp8 layout (``check_native``): the layout against the loader's
    facts, each expert's decode and static-scale W4A8 product, and with ``source`` every tensor re-derived."""
    experts = check_native.verify_layout(model, index)
    verified = {"files_sha256": len(manifest.get("files") or {}) - len(failures), "layout": "sglang w4afp8"}
    if vendor:
        verified["files_unrecorded"] = len(index.files)
    if tp:
        try:
            plan_shard(model, tp)  # the split, and SGLang's W4A8 MoE rule per rank (shard._check_sglang_w4a8)
        except QuantizeError as e:
            failures.append(str(e))
    rows = check_native.check_experts(model, index, experts, tokens, seed, Row, emit)
    if source is not None:
        src = CheckpointIndex.open(source)
        check_fp8_dtypes(src)
        bad, proven = check_native.verify_against_source(index, src, manifest.get("options") or {},
                                                         {r.tensor: r for r in rows}, max_source_rel_err)
        failures += bad
        verified["tensors_exact_vs_source"] = proven
    failures += [f for r in rows for f in r.failures]
    emit({"event": "done"})
    return CheckReport(str(model), tp, False, rows, failures, verified, None)


def _check_sharded(sharded: Path, source, tokens: int, seed: int, emit: Emit) -> CheckReport:
    man = load_manifest(sharded)
    failures: list[str] = verify_shard_files(sharded, man)  # the manifest and unsharded/ as shard wrote them
    tp = man["tp"]
    if not source and not isinstance(man.get("source"), str):
        raise QuantizeError(f"{sharded / MANIFEST}: 'source' is not a folder name; pass --source with the unsharded "
                            f"checkpoint")
    src_dir = Path(source) if source else Path(man["source"])
    if not (src_dir / "config.json").exists():
        raise QuantizeError(f"{sharded / MANIFEST}: the unsharded checkpoint {src_dir} is gone; pass --source with it")
    full = CheckpointIndex.open(src_dir)
    arch = archs.resolve(full.config, str(src_dir / "config.json"))
    # the unsharded checkpoint by its own manifest and record, its config by its tensors
    _, bad, fman = prove_files(src_dir)
    failures += bad
    if fman:
        verify_manifest_record(src_dir, fman, full)
    verify_quant_config(src_dir, full)
    for f in man.get("unsharded_files", []):
        mine, theirs = sharded / UNSHARDED / f, src_dir / f
        if not theirs.is_file() or sha256_file(mine) != sha256_file(theirs):
            raise CheckFailed(f"{mine}: differs from {theirs} (or it is missing); {src_dir} is not the checkpoint "
                              f"that was sharded, pass --source with that one or re-shard")
    # the split, as shard makes it from this checkpoint: every slice recomputed and compared
    _, splits, int4 = plan_shard(src_dir, tp)
    by_name = {ts.name: ts for ts in splits}
    extra = sorted(set(man["tensors"]) ^ set(by_name))
    if extra:
        a, b = ("the manifest", src_dir) if extra[0] in man["tensors"] else (src_dir, "the manifest")
        raise CheckFailed(f"{sharded / MANIFEST}: tensor {extra[0]} is in {a} but not in {b}; re-shard")
    reader = RankReader(sharded, man)
    rows: list[Row] = []
    g = torch.Generator().manual_seed(seed)
    fds: dict = {}
    try:
        for ts in splits:
            rec, name = man["tensors"][ts.name], ts.name
            if (rec["split"], rec["dim"]) != (ts.split, ts.dim):
                failures.append(f"{sharded / MANIFEST}: tensor {name} is recorded as split {rec['split']} (dim "
                                f"{rec['dim']}), but its role splits it {ts.split} (dim {ts.dim})")
                continue
            t = read_tensor(full.folder, full.tensors[name], fds)
            if _sha(t) != rec["sha256"]:
                failures.append(f"{src_dir}: tensor {name} differs from the one that was sharded")
            for r, piece in enumerate(rank_pieces(t, ts, tp, int4, by_name)):
                got = reader.get(r, name)
                sha = _sha(got)
                if sha != rec["ranks"][r]["sha256"]:
                    failures.append(f"{sharded / rec['ranks'][r]['file']}: tensor {name} of rank {r} "
                                    f"does not match the manifest checksum")
                if got.dtype != piece.dtype or tuple(got.shape) != tuple(piece.shape) or sha != _sha(piece):
                    failures.append(f"{sharded / rec['ranks'][r]['file']}: tensor {name} of rank {r} differs from "
                                    f"its slice recomputed from {src_dir}")
        modules = [n[: -len(".weight_packed")] for n in man["tensors"] if n.endswith(".weight_packed")]
        emit({"event": "start", "stage": "check", "total_bytes": len(modules), "done_bytes": 0, "unit": "modules"})
        for i, m in enumerate(modules):
            rec = man["tensors"][m + ".weight_packed"]
            packed = read_tensor(full.folder, full.tensors[m + ".weight_packed"])
            scale = read_tensor(full.folder, full.tensors[m + ".weight_scale"])
            n, k = packed.shape[0], packed.shape[1] * 8
            row = Row(m, arch.role_of(m + ".weight")[0])
            x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
            y_full = w4a16_reference(x, packed, scale, (n, k))
            parts = []
            for r in range(tp):
                pr, sr = reader.get(r, m + ".weight_packed"), reader.get(r, m + ".weight_scale")
                shp = tuple(int(v) for v in reader.get(r, m + ".weight_shape").tolist())
                if not _unpack_ok(pr, shp):
                    row.unpack_ok = False
                    row.failures.append(f"rank {r}: {m}: unpack differs from compressed-tensors' unpack_from_int32")
                xr = x if rec["split"] != "row" else x[:, r * shp[1]:(r + 1) * shp[1]]
                kerr, yr = _kernel_err(xr, pr, sr, shp)
                row.kernel_rel_err = max(row.kernel_rel_err or 0.0, kerr)
                parts.append(yr)
            if rec["split"] == "row":
                y = torch.stack(parts).sum(0)
            elif rec["split"] in ("col", "vocab"):
                y = torch.cat(parts, dim=1)
            else:
                y = parts[0]
                for r, p in enumerate(parts[1:], 1):
                    if not torch.equal(p, y):
                        row.failures.append(f"rank {r}: replicated {m} differs from rank 0")
            row.shard_max_err = float((y - y_full).abs().max() / y_full.abs().max().clamp_min(1e-30))
            if row.shard_max_err > SHARD_RTOL:
                bad_r = _guilty_rank(parts, y_full, rec["split"], tp)
                row.failures.append(f"{m}: ranks recombined ({rec['split']}-parallel) differ from the unsharded "
                                    f"product (max rel. {row.shard_max_err:.3g})"
                                    f"{'; rank ' + str(bad_r) + ' is off' if bad_r is not None else ''}")
            if row.kernel_rel_err > KERNEL_RTOL:
                row.failures.append(f"{m}: W4A16 kernel differs from the reference on a rank "
                                    f"(rel. error {row.kernel_rel_err:.3g})")
            rows.append(row)
            emit({"event": "tensor", "name": m, "done_bytes": i + 1})
    finally:
        reader.close()
        for fd in fds.values():
            os.close(fd)
    failures += [f for r in rows for f in r.failures]
    emit({"event": "done"})
    return CheckReport(str(sharded), tp, True, rows, failures)


def _guilty_rank(parts: list[torch.Tensor], y_full: torch.Tensor, split: str, tp: int) -> int | None:
    if split in ("col", "vocab"):
        n = y_full.shape[1] // tp
        errs = [float((p - y_full[:, r * n:(r + 1) * n]).abs().max()) for r, p in enumerate(parts)]
        return max(range(tp), key=errs.__getitem__)
    return None
