"""``quantize check``: run the packed INT4 kernels on exactly what was written and compare with
references; check shapes against the serving kernels' rules; for a sharded folder, prove the split.

Per INT4 tensor: our unpack equals compressed-tensors' ``unpack_from_int32`` bit for bit; the CPU
kernel (and Triton on a GPU) on random activations equals the fp32 reference within tolerance;
with ``source``, the error against the source weight (FP8 dequantized or BF16): relative error and
SNR. Sharded: every slice matches its manifest checksum, and the concatenation of column-parallel
outputs and the sum of row-parallel partial products equal the unsharded product (fp32).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import archs
from .checkpoint.index import CheckpointIndex, read_tensor
from .errors import QuantizeError
from .events import Emit, null_emit
from .formats import fp8
from .formats.int4 import unpack_int4
from .kernels.cpu import CpuW4A16
from .kernels.reference import w4a16_reference
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

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {"model": self.model, "tp": self.tp, "sharded": self.sharded, "ok": self.ok, "failures": self.failures,
                "summary": self.summary(), "tensors": [asdict(r) for r in self.rows]}

    def summary(self) -> dict:
        out: dict[str, dict] = {}
        for r in self.rows:
            d = out.setdefault(r.role, {"tensors": 0, "failed": 0, "max_kernel_rel_err": 0.0, "max_source_rel_err": None,
                                        "min_snr_db": None, "max_shard_err": None})
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


def _source_weight(src: CheckpointIndex, module: str) -> torch.Tensor | None:
    name = module + ".weight"
    if name not in src.tensors:
        return None
    w = read_tensor(src.folder, src.tensors[name])
    for sname in (module + ".weight_scale_inv", module + ".weight_scale"):
        if w.dtype == torch.float8_e4m3fn and sname in src.tensors:
            s = read_tensor(src.folder, src.tensors[sname])
            if tuple(s.shape) == fp8.block_grid(tuple(w.shape)):
                return fp8.dequant_block(w, s, dtype=torch.float32)
            return fp8.dequant_channel(w, s, dtype=torch.float32)
    return w.float()


def check(model: str | os.PathLike, tp: int | None = None, source: str | os.PathLike | None = None,
          tokens: int = 8, seed: int = 0, max_source_rel_err: float = 0.25, emit: Emit = null_emit) -> CheckReport:
    model = Path(model)
    if (model / MANIFEST).exists():
        return _check_sharded(model, source, tokens, seed, emit)
    index = CheckpointIndex.open(model)
    arch = archs.resolve(index.config, str(model / "config.json"))
    failures: list[str] = []
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
        if tuple(packed.shape) != (shape[0], math.ceil(shape[1] / 8)) or scale.shape[0] != shape[0] or shape[1] % scale.shape[1]:
            row.failures.append(f"{m}: weight_packed {list(packed.shape)} / weight_scale {list(scale.shape)} do not fit weight_shape {list(shape)}")
            rows.append(row)
            continue
        ours = unpack_int4(packed, shape[1])
        row.unpack_ok = bool(torch.equal(ours, _ct_unpack(packed, shape)))
        if not row.unpack_ok:
            row.failures.append(f"{m}: unpack differs from compressed-tensors' unpack_from_int32")
        x = torch.randn(tokens, shape[1], generator=g).to(torch.bfloat16)
        row.kernel_rel_err, _ = _kernel_err(x, packed, scale, shape)
        if not row.kernel_rel_err <= KERNEL_RTOL:
            row.failures.append(f"{m}: W4A16 kernel differs from the reference (rel. error {row.kernel_rel_err:.3g} > {KERNEL_RTOL})")
        if src is not None:
            w = _source_weight(src, m)
            if w is None:
                row.failures.append(f"{m}: not in the source checkpoint {source}")
            else:
                deq = ours.float().view(shape[0], scale.shape[1], -1).mul_(scale.float().unsqueeze(-1)).view(shape)
                err = float((deq - w).norm())
                ref = float(w.norm())
                row.source_rel_err = err / ref if ref else 0.0
                row.snr_db = 20 * math.log10(ref / err) if err > 0 else float("inf")
                if row.source_rel_err > max_source_rel_err:
                    row.failures.append(f"{m}: relative error {row.source_rel_err:.3f} against the source exceeds {max_source_rel_err}")
        rows.append(row)
        emit({"event": "tensor", "name": m, "done_bytes": i + 1})
    failures += [f for r in rows for f in r.failures]
    emit({"event": "done"})
    return CheckReport(str(model), tp, False, rows, failures)


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
                    failures.append(f"{sharded / rec['ranks'][r]['file']}: tensor {name} of rank {r} does not match the manifest checksum")
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
                row.failures.append(f"{m}: ranks recombined ({rec['split']}-parallel) differ from the unsharded product "
                                    f"(max rel. {row.shard_max_err:.3g}){'; rank ' + str(bad_r) + ' is off' if bad_r is not None else ''}")
            if row.kernel_rel_err > KERNEL_RTOL:
                row.failures.append(f"{m}: W4A16 kernel differs from the reference on a rank (rel. error {row.kernel_rel_err:.3g})")
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
