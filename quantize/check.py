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

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import archs
from .checkpoint.index import CheckpointIndex, read_tensor
from .checkpoint.manifest import MANIFEST as QUANTIZE_MANIFEST
from .checkpoint.output import RECORD_DIR, confined, sha256_file
from .checkpoint.reader import FP8_SCALE_NAMES, WeightReader
from .errors import QuantizeError
from .events import Emit, null_emit
from .formats import int4 as int4_fmt
from .formats.int4 import unpack_int4
from .kernels.cpu import CpuW4A16
from .kernels.reference import w4a16_reference
from .options import DATA_AWARE, CheckOptions, takes  # DATA_AWARE: the source alone cannot re-derive them
from .shard import MANIFEST, RankReader, _sha, load_manifest, plan_shard

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
    failures: list[str] = field(default_factory=list)


@dataclass
class CheckReport:
    model: str
    tp: int | None
    sharded: bool
    rows: list[Row]
    failures: list[str]
    verified: dict = field(default_factory=dict)  # what was proven: files by SHA-256, tensors against the source

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {"model": self.model, "tp": self.tp, "sharded": self.sharded, "ok": self.ok, "failures": self.failures,
                "verified": self.verified, "summary": self.summary(), "tensors": [asdict(r) for r in self.rows]}

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


def _kernel_err(x: torch.Tensor, packed, scale, shape) -> tuple[float, torch.Tensor]:
    ref = w4a16_reference(x, packed, scale, shape)
    y = CpuW4A16.from_packed(packed, scale, shape)(x).float()
    err = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
    if torch.cuda.is_available():
        from .kernels.triton_w4a16 import w4a16_triton

        yt = w4a16_triton(x.cuda(), packed.cuda(), scale.cuda(), shape).float().cpu()
        err = max(err, float((yt - ref).norm() / ref.norm().clamp_min(1e-30)))
    return err, ref


def verify_files(model: Path) -> tuple[list[str], dict]:
    """Every file against its SHA-256 in ``quantize_manifest.json``; weight files the manifest does
    not record fail too. -> (failures, manifest)."""
    path = model / QUANTIZE_MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files = manifest.get("files") or manifest["outputs"]
        if not isinstance(files, dict):
            raise TypeError
    except FileNotFoundError:
        return [f"{path}: missing, so no file can be proven; the output is incomplete "
                f"or was not written by quantize"], {}
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
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


def verify_against_source(out: CheckpointIndex, src: CheckpointIndex, options: dict, rows: dict[str, "Row"],
                          max_source_rel_err: float, emit: Emit = null_emit, records: dict[str, dict] | None = None
                          ) -> tuple[list[str], int, int]:
    """Every output tensor against what the source implies: copies, FP8 and round-to-nearest INT4
    exactly; a tensor the manifest's ``records`` say GPTQ or AutoRound made, by its grid and its
    recorded error (``_method_tensor``). -> (failures, tensors proven exactly, method tensors proven)."""
    o, s = WeightReader(out), WeightReader(src)
    observer = options.get("observer") or "minmax"
    records = records or {}
    failures: list[str] = []
    proven = by_method = 0
    accounted: set[str] = set()
    try:
        names = [n for n in src.tensors if n.rpartition(".")[2] not in FP8_SCALE_NAMES + ("input_scale",)
                 or n.rpartition(".")[0] + ".weight" not in src.tensors]
        emit({"event": "start", "stage": "check against source", "total_bytes": len(names), "done_bytes": 0})
        for i, name in enumerate(names):
            emit({"event": "tensor", "name": name, "done_bytes": i + 1})
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            where = f"{out.folder}: tensor {name}"
            if name in out.tensors:
                got, ref = o.raw(name), s.raw(name)
                accounted.add(name)
                if got.dtype == ref.dtype:  # a copy, or an FP8 weight kept FP8 with its scale
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
                ref_shape = list(src.tensors[name].shape)
                if shape != ref_shape or scale.shape[0] != shape[0] or shape[1] % scale.shape[1]:
                    failures.append(f"{where}: INT4 shape {shape} / scale {list(scale.shape)} do not fit the source "
                                    f"{ref_shape}")
                    continue
                fp8src = s.scheme(name).startswith("fp8")
                w = s.weight(name, torch.bfloat16 if fp8src else src.tensors[name].torch_dtype)
                g = shape[1] // scale.shape[1]
                exp = int4_fmt.quantize_pack(w, g, observer, scale.dtype)
                how = (records.get(name) or {}).get("method")
                by_data = how in DATA_AWARE
                sums = int4_fmt.error_sums(w, packed, scale)  # the stored tensor's error against the source, once
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
    if (model / MANIFEST).exists():
        return _check_sharded(model, source, tokens, seed, emit)
    index = CheckpointIndex.open(model)
    arch = archs.resolve(index.config, str(model / "config.json"))
    failures, manifest = verify_files(model)
    verified = {"files_sha256": len((manifest.get("files") or manifest.get("outputs") or {})) - len(failures)}
    if tp:
        try:
            plan_shard(model, tp)
        except QuantizeError as e:
            failures.append(str(e))
    src = CheckpointIndex.open(source) if source else None
    g = torch.Generator().manual_seed(seed)
    rows: list[Row] = []
    modules = [n[: -len(".weight_packed")] for n in index.tensors if n.endswith(".weight_packed")]
    if not modules:
        raise QuantizeError(f"{model}: no INT4 (weight_packed) tensors to check; is this a quantize convert output?")
    emit({"event": "start", "stage": "check", "total_bytes": len(modules), "done_bytes": 0})
    for i, m in enumerate(modules):
        packed = read_tensor(model, index.tensors[m + ".weight_packed"])
        scale = read_tensor(model, index.tensors[m + ".weight_scale"])
        shape = tuple(int(v) for v in read_tensor(model, index.tensors[m + ".weight_shape"]).tolist())
        row = Row(m, arch.role_of(m + ".weight")[0])
        if (tuple(packed.shape) != (shape[0], math.ceil(shape[1] / 8)) or scale.shape[0] != shape[0]
                or shape[1] % scale.shape[1]):
            row.failures.append(f"{m}: weight_packed {list(packed.shape)} / weight_scale {list(scale.shape)} "
                                f"do not fit weight_shape {list(shape)}")
            rows.append(row)
            continue
        ours = unpack_int4(packed, shape[1])
        row.unpack_ok = bool(torch.equal(ours, _ct_unpack(packed, shape)))
        if not row.unpack_ok:
            row.failures.append(f"{m}: unpack differs from compressed-tensors' unpack_from_int32")
        x = torch.randn(tokens, shape[1], generator=g).to(torch.bfloat16)
        row.kernel_rel_err, _ = _kernel_err(x, packed, scale, shape)
        if not row.kernel_rel_err <= KERNEL_RTOL:
            row.failures.append(f"{m}: W4A16 kernel differs from the reference "
                                f"(rel. error {row.kernel_rel_err:.3g} > {KERNEL_RTOL})")
        rows.append(row)
        emit({"event": "tensor", "name": m, "done_bytes": i + 1})
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
    return CheckReport(str(model), tp, False, rows, failures, verified)


def _check_sharded(sharded: Path, source, tokens: int, seed: int, emit: Emit) -> CheckReport:
    man = load_manifest(sharded)
    tp = man["tp"]
    src_dir = Path(source) if source else Path(man["source"])
    if not (src_dir / "config.json").exists():
        raise QuantizeError(f"{sharded / MANIFEST}: the unsharded checkpoint {src_dir} is gone; pass --source with it")
    full = CheckpointIndex.open(src_dir)
    arch = archs.resolve(full.config, str(src_dir / "config.json"))
    reader = RankReader(sharded, man)
    failures: list[str] = []
    rows: list[Row] = []
    g = torch.Generator().manual_seed(seed)
    try:
        # every slice against its manifest checksum
        for name, rec in man["tensors"].items():
            for r in range(tp):
                if _sha(reader.get(r, name)) != rec["ranks"][r]["sha256"]:
                    failures.append(f"{sharded / rec['ranks'][r]['file']}: tensor {name} of rank {r} "
                                    f"does not match the manifest checksum")
        modules = [n[: -len(".weight_packed")] for n in man["tensors"] if n.endswith(".weight_packed")]
        emit({"event": "start", "stage": "check", "total_bytes": len(modules), "done_bytes": 0})
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
                if not torch.equal(unpack_int4(pr, shp[1]), _ct_unpack(pr, shp)):
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
    failures += [f for r in rows for f in r.failures]
    emit({"event": "done"})
    return CheckReport(str(sharded), tp, True, rows, failures)


def _guilty_rank(parts: list[torch.Tensor], y_full: torch.Tensor, split: str, tp: int) -> int | None:
    if split in ("col", "vocab"):
        n = y_full.shape[1] // tp
        errs = [float((p - y_full[:, r * n:(r + 1) * n]).abs().max()) for r, p in enumerate(parts)]
        return max(range(tp), key=errs.__getitem__)
    return None
