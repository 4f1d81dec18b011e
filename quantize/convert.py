"""``quantize convert``: execute a Plan, tensor by tensor.

Workers (threads; torch releases the GIL, each runs single-threaded torch so the math is the
same for any worker count) read and transform tensors in plan order inside a bounded window; the
main thread writes results in order into the output shard whose header was computed up front.
Copies stream byte ranges without materialising tensors. Each shard is committed by fsync +
rename, then recorded in ``OUT/.quantize/job.json``; the index and config.json follow the last
shard, and the manifest is written last of all.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint.config import ModelConfig
from .checkpoint.index import INDEX_NAME, TensorRef, cached_fd, hub_revision, read_tensor
from .checkpoint.manifest import build_key, lineage, shown_path, source_identity, tool_versions, write_manifest
from .checkpoint.output import Output, side_files
from .checkpoint.writer import COPY_CHUNK, StreamWriter
from . import distributed
from .distributed import check_nproc
from .errors import QuantizeError
from .events import Emit, null_emit
from .formats import fp8, int4, native, w4afp8
from .options import DATA_AWARE, ConvertOptions, takes, torch_threads, usable_cpus
from . import startup
from .plan import Job, Plan, build_plan, check_with_compressed_tensors, refuse_copy, sglang_native

ROW_CHUNK = 512  # rows per compute chunk: bounded temporaries, cache-friendly; multiple of 128


@dataclass
class ConvertResult:
    out: str
    plan: dict
    seconds: float
    source_bytes: int
    output_bytes: int
    tensors_int4: int
    mean_rel_err: float | None
    max_rel_err: float | None
    resumed_shards: int
    method: dict | None = None  # a data-aware method's report (also in the manifest): per layer, RTN fallbacks
    passed_through: int = 0  # an INT4 source's tensors written bit for bit

    @property
    def gbps(self) -> float:
        return self.source_bytes / self.seconds / 1e9 if self.seconds else 0.0


# --------------------------------------------------------------------------------------------
# per-job compute (pure transforms over tensors read from the source)


def _weight_rows(job: Job, w: torch.Tensor, s: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of the job's weight in its working precision (bf16 for FP8 sources)."""
    rows = w[r0:r1]
    if job.scale is None:
        return rows
    if job.scale_format == "int4":  # an INT4 source, dequantized exactly: code x scale in fp32
        return int4.dequantize_int4(rows, s[r0:r1], (r1 - r0, job.wshape[1]), dtype=torch.float32, exact=True)
    if job.scale_format == "block":
        br = job.block[0]
        if r0 % br:
            raise AssertionError("row chunks must start on a block boundary")
        return fp8.dequant_block(rows, s[r0 // br : -(-r1 // br)], job.block)
    return fp8.dequant_channel(rows, s if s.numel() == 1 else s.reshape(-1, 1)[r0:r1])


def _native_source(w: torch.Tensor) -> bool:
    """The C kernels are built and read this source dtype (on the CPU)."""
    return native.lib() is not None and w.dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float32)


def _native_int4(job: Job, scale_dtype: torch.dtype, k: int, g: int, observer: str) -> bool:
    """quant.c quantizes (and measures) this INT4 job as the torch reference does: not an INT4
    source, bf16 scales, its grid, its shape, groups inside the FP8 blocks."""
    return (
        job.scale_format != "int4"
        and scale_dtype == torch.bfloat16
        and observer in int4.NATIVE_OBSERVERS
        and native.supports(k, g)
        and (job.scale_format != "block" or job.block[1] % g == 0)
    )


def _nan_error(job: Job) -> QuantizeError:
    return QuantizeError(
        f"{job.src.file}: tensor {job.name} contains NaN or Inf; the source weight is corrupt, re-download that shard"
    )


def _check_finite(job: Job, t: torch.Tensor) -> None:
    if not torch.isfinite(t).all():
        raise _nan_error(job)


_tls = threading.local()


def _read(folder: Path, ref: TensorRef, fds: dict, slot: str) -> torch.Tensor:
    """Read into a per-thread buffer that is reused across jobs (no fresh pages per tensor)."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    buf = bufs.get(slot)
    if buf is None or len(buf) < ref.nbytes:
        buf = bufs[slot] = bytearray(max(ref.nbytes, 1 << 20))
    return read_tensor(folder, ref, fds, buf)


def compute_job(
    job: Job, folder: Path, options: ConvertOptions, fds: dict, device: str = "cpu", cache=None
) -> tuple[list[torch.Tensor], dict | None]:
    if job.kind == "int4" and cache is not None:
        if cache.has(job.module):
            return _cached_job(job, folder, options, fds, cache)
        tensors, stats = compute_job(
            job, folder, options, fds, device
        )  # out of the method's reach: RTN, named in its report
        return tensors, {**stats, "method": "rtn"}
    w = _read(folder, job.src, fds, "w")
    s = _read(folder, job.scale, fds, "s").clone() if job.scale is not None else None
    if device != "cpu":  # the torch reference path, on the GPU; same bits as on the CPU
        w = w.to(device)
        s = s.to(device) if s is not None else None
    use_native = device == "cpu" and _native_source(w)
    if job.kind == "dequant":
        if use_native and w.dtype == torch.float8_e4m3fn:
            out, bad = native.dequant_rows(w, s, job.scale_format, job.block)
            if bad:
                raise _nan_error(job)
            return [out], None
        rows = w.shape[0]
        out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
        for r0, r1 in int4.row_blocks(rows, ROW_CHUNK):
            out[r0:r1] = _weight_rows(job, w, s, r0, r1)
        _check_finite(job, out)
        return [out.cpu()], None
    if job.kind == "fp8":
        return _fp8_block_job(job, w, s, fp32_scale=sglang_native(options))
    if job.kind == "transcode":  # an INT4 source's codes for SGLang's layout (``sglang_expert``): bit for bit
        rows, k = job.wshape
        if tuple(s.shape) != int4.scale_shape((rows, k), w4afp8.GROUP):
            raise QuantizeError(f"{job.src.file}: {job.name} is not INT4 by group {w4afp8.GROUP} (scales "
                                f"{list(s.shape)}); add --requantize")
        if not torch.isfinite(s).all():
            raise _nan_error(job)
        return [w.clone(), s, None], {"name": job.name, "role": job.role, "rel_err": 0.0, "max_abs_err": 0.0,
                                          "passed_through": True}
    if job.kind == "int4":
        rows, k = job.wshape
        g = options.group_size
        if job.scale_format == "int4":  # re-quantized: scales keep the source's dtype
            scale_dtype = s.dtype
        else:
            scale_dtype = torch.bfloat16 if (job.scale is not None or w.dtype == torch.bfloat16) else w.dtype
        if use_native and _native_int4(job, scale_dtype, k, g, options.observer):
            packed, scale, (sq_err, sq_ref, max_err), bad = native.quant_rows(
                w, s, job.scale_format, g, options.observer, block=job.block
            )
            if bad:
                raise _nan_error(job)
            sq_err_mm = (
                native.quant_rows(w, s, job.scale_format, g, "minmax", block=job.block)[2][0]
                if options.observer != "minmax"
                else 0.0
            )
        else:
            packed = torch.empty(int4.packed_shape((rows, k)), dtype=torch.int32, device=w.device)
            scale = torch.empty(int4.scale_shape((rows, k), g), dtype=scale_dtype, device=w.device)
            sq_err = sq_ref = max_err = sq_err_mm = 0.0
            for r0, r1 in int4.row_blocks(rows, ROW_CHUNK):
                wr = _weight_rows(job, w, s, r0, r1)
                res = int4.quantize_pack(wr, g, options.observer, scale_dtype)
                if not torch.isfinite(res.scale).all():
                    _check_finite(job, wr)
                packed[r0:r1] = res.packed
                scale[r0:r1] = res.scale
                sq_err += res.sq_err
                sq_ref += res.sq_ref
                max_err = max(max_err, res.max_abs_err)
                if options.observer != "minmax":
                    sq_err_mm += int4.quantize_pack(wr, g, "minmax", scale_dtype).sq_err
        stats = {
            "name": job.name,
            "role": job.role,
            "rel_err": (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0,
            "max_abs_err": max_err,
        }
        if options.observer != "minmax":
            stats["rel_err_minmax"] = (sq_err_mm / sq_ref) ** 0.5 if sq_ref else 0.0
        return [packed.cpu(), scale.cpu(), torch.tensor([rows, k], dtype=torch.int64)], stats
    raise AssertionError(job.kind)


def _fp8_block_job(job: Job, w: torch.Tensor, s: torch.Tensor | None,
                   fp32_scale: bool = False) -> tuple[list[torch.Tensor], dict]:
    """``--scheme fp8-block``: the weight as llm-compressor's model_free_ptq sees it (an FP8 source
    dequantized to BF16 as FP8BlockDequantizer does, an INT4 one as CompressedTensorsDequantizer
    does: code x scale in BF16), then FP8_BLOCK's round to nearest (``fp8.quant_block_ct``).
    ``fp32_scale``: the scale in fp32 (SGLang's ``weight_scale_inv``), the quotient too."""
    if job.scale_format == "int4":
        wb = int4.dequantize_int4(w, s, job.wshape, dtype=torch.bfloat16)
    elif job.scale is not None:
        wb = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
        for r0, r1 in int4.row_blocks(w.shape[0], ROW_CHUNK):
            wb[r0:r1] = _weight_rows(job, w, s, r0, r1)
    else:
        wb = w
    _check_finite(job, wb)
    q, scale = fp8.quant_block_ct(wb.float() if fp32_scale else wb)
    ref = wb.float()
    diff = fp8.dequant_block(q, scale.float(), fp8.DEFAULT_BLOCK, dtype=torch.float32).sub_(ref)
    sq_ref, sq_err = float(ref.pow(2).sum(dtype=torch.float64)), float(diff.pow(2).sum(dtype=torch.float64))
    stats = {"name": job.name, "role": job.role, "rel_err": (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0,
             "max_abs_err": float(diff.abs().max()) if diff.numel() else 0.0, "scheme": "fp8-block"}
    return [q.cpu(), scale.cpu()], stats


def _cached_job(job: Job, folder: Path, options: ConvertOptions, fds: dict, cache) -> tuple[list[torch.Tensor], dict]:
    """An INT4 job a data-aware method already quantized (``methods.runner``): its packed codes and
    scales from the layer file, with the same error statistics against the source weight as RTN's
    (plus RTN's own error on the method's grid, for comparison)."""
    w = _read(folder, job.src, fds, "w")
    s = _read(folder, job.scale, fds, "s").clone() if job.scale is not None else None
    rows, k = job.wshape
    packed, scale = cache.read(job.module)
    want = (int4.packed_shape((rows, k)), int4.scale_shape((rows, k), options.group_size))
    if tuple(packed.shape) != want[0] or tuple(scale.shape) != want[1]:
        raise QuantizeError(
            f"{cache.files[job.module]}: {job.module} has shapes {tuple(packed.shape)}/{tuple(scale.shape)}, not "
            f"{want}; "
            "the layer cache is corrupt, rerun with --overwrite"
        )
    sq_err = sq_ref = max_err = sq_rtn = 0.0
    g = options.group_size
    # the C kernels: the same decoded rows and sums (another order of addition: ~1e-15, so `check --source`
    # still proves them); RTN's comparison bit for bit (minmax and fullrange; mse runs the torch path)
    if _native_source(w) and _native_int4(job, scale.dtype, k, g, options.observer):
        (sq_err, sq_ref, max_err), bad = native.error_rows(w, s, job.scale_format, packed, scale, job.block)
        if bad:
            raise _nan_error(job)
        sq_rtn = native.quant_rows(w, s, job.scale_format, g, options.observer, block=job.block)[2][0]
    else:
        for r0, r1 in int4.row_blocks(rows, ROW_CHUNK):
            wr = _weight_rows(job, w, s, r0, r1)
            _check_finite(job, wr)
            e, r, m = int4.error_sums(wr, packed[r0:r1], scale[r0:r1])
            sq_err, sq_ref, max_err = sq_err + e, sq_ref + r, max(max_err, m)
            sq_rtn += int4.quantize_pack(wr, g, options.observer, scale.dtype).sq_err
    stats = {
        "name": job.name,
        "role": job.role,
        "rel_err": (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0,
        "max_abs_err": max_err,
        "method": cache.methods.get(job.module, options.method_name),
        "rel_err_rtn": (sq_rtn / sq_ref) ** 0.5 if sq_ref else 0.0,
    }
    return [packed, scale, torch.tensor([rows, k], dtype=torch.int64)], stats


# --------------------------------------------------------------------------------------------


def _job_key(plan: Plan, ident: dict) -> dict:
    # key_dict: the options the bytes depend on (a resume may add or correct --base-model)
    # build: a run resumed under another build of this tool or its libraries would mix two builds' bytes
    return {"options": plan.options.key_dict(), "plan": plan.fingerprint(), "source": ident, "build": build_key()}


@takes(ConvertOptions)
def convert(options: ConvertOptions, emit: Emit = null_emit) -> ConvertResult:
    """FP8/BF16 checkpoint ``source`` -> compressed-tensors pack-quantized INT4 checkpoint ``out``
    (keywords: ``quantize.options.ConvertOptions``). ``group_size``/``profile``/``observer``/``method``
    left None take the recipe's values or the defaults (32, experts, the method's grid, rtn); an explicit value
    that contradicts the recipe is refused. ``method`` gptq / autoround (or a recipe's GPTQModifier)
    first runs a layer-sequential pass over calibration text (``data``, ``samples`` x ``seq_len``
    tokens; quantize/methods/), holding at most ``memory_budget_gib`` of hidden states in memory (the
    rest on disk under OUT/.quantize/). ``device="cuda"`` runs a data-aware method's layer pass on a
    GPU; the shards are written on the CPU, and RTN on cuda is refused (``RTN_ON_GPU``)."""
    t0 = time.time()
    check_nproc(options.nproc)  # a library call starts no ranks: it runs in those it is called from
    world = distributed.current()
    if world.size > 1 and not world.is_writer:  # a rank of a GPTQ / AutoRound run: its share of each layer
        from .methods.ranks import serve

        startup.settle()
        return serve(Path(options.source), world)
    res = _convert(options, emit, t0)  # a failure here: the other ranks see this one's connection close, one line
    if world.size > 1:
        world.broadcast(("done", res), "the end of the run")
    return res


# Measured on an H200 node (16 cores, the source in the page cache, 1.76 GiB of block FP8): RTN on
# --device cuda 24.7 s, on the CPU's native kernels 16.9 s, byte-identical. RTN reads each byte once
# and does a few operations per byte; the GPU adds a copy to it and back per tensor and gains nothing.
RTN_ON_GPU = ("--device {device}: {what} streams each tensor once at a few operations per byte, which the "
              "CPU's native kernels do at the disk's speed, while a GPU adds a copy to it and back per tensor "
              "(measured on an H200 node: 24.7 s on cuda vs 16.9 s on the CPU, byte-identical); drop --device "
              "(a GPU serves --method gptq / autoround's layer pass and calibrate-kv)")


def _convert(options: ConvertOptions, emit: Emit, t0: float) -> ConvertResult:
    device, resume, overwrite, workers = options.device, options.resume, options.overwrite, options.workers
    if device != "cpu":
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise QuantizeError(f"--device {device}: no CUDA device is available here; use --device cpu (the default)")
    src, out = Path(options.source), Path(options.out)
    wall: dict[str, float] = {}  # where the run's wall time went, step by step (the manifest's wall_seconds)
    last = [t0]

    def lap(step: str) -> None:
        now = time.time()
        wall[step] = round(wall.get(step, 0.0) + now - last[0], 3)
        last[0] = now

    plan = build_plan(src, options, ct_check=False)
    refuse_copy(plan)
    lap("plan")
    options = plan.options  # a recipe may have set group size / observer / method
    if device != "cpu" and options.method_name not in DATA_AWARE and not sglang_native(options):
        what = f"--scheme {options.scheme}" if options.scheme == "fp8-block" else f"--method {options.method_name}"
        raise QuantizeError(RTN_ON_GPU.format(device=device, what=what))
    size = distributed.current().size
    if size > 1 and options.method_name not in DATA_AWARE and not sglang_native(options):
        raise QuantizeError(f"{size} ranks: only the data-aware methods ({', '.join(DATA_AWARE)}) split their work "
                            f"across ranks; run --method {options.method_name} as one process (no --nproc)")
    calib = None
    if options.method_name != "rtn" or sglang_native(options):  # SGLang's w4afp8: static activation scales
        from . import methods

        calib = methods.prepare(src, options, emit)  # bad data / unbuildable layers: one line, nothing written
        lap("calibration_data")
    # compressed-tensors (seconds to import) is needed only for the config written at the end and an
    # internal check of it: for RTN both run on a thread beside the first tensors. A data-aware
    # method imports llm-compressor (and so compressed-tensors) on this thread: two threads importing
    # the same package cycle can see it half-initialised, so then it runs here, first.
    if calib is None:
        ct = ThreadPoolExecutor(1, thread_name_prefix="ct").submit(_ct_config, plan)
    else:
        ct = Future()
        ct.set_result(_ct_config(plan))
    try:
        sides = side_files(src)  # a dangling symlink is named before any shard is written
        ident = source_identity(
            src, [f for f in {r.file for j in plan.jobs for r in j.inputs}]
        )
        key = _job_key(plan, ident)
        if calib is not None:
            key["data"] = {"source": calib.source, "token_ids_sha256": calib.sha256}
        inputs = [src] + ([Path(options.recipe)] if options.recipe else [])
        if options.data and not str(options.data).startswith("hf:") and Path(options.data).exists():
            inputs.append(Path(options.data))
        with Output.open(out, "convert", inputs, resume=resume, overwrite=overwrite, key=key) as o:
            if o.resumed:
                o.check_key(key)
            lap("setup")  # the config (data-aware: its import), the source's identity, the output folder
            # by default the cores of this node shared by its ranks (the bytes do not depend on the thread count)
            workers = max(1, workers or usable_cpus() // distributed.current().local_size)
            cache = acts = None
            if options.method_name != "rtn":
                from . import methods

                try:
                    cache = methods.run(
                        plan,
                        src,
                        o,
                        calib,
                        options,
                        # on a GPU the samples go one after another on one stream (threads would race
                        # CUDA's lazy initialisation and gain nothing on a serialized stream)
                        workers=1 if device != "cpu" else workers,
                        device=device,
                        memory_budget=int(options.memory_budget_gib * 2**30),
                        emit=emit,
                    )
                except BaseException as e:
                    emit({"event": "error", "message": str(e)})
                    raise
                lap("layers")
            if sglang_native(options):
                try:
                    acts = activation_scales(plan, src, o, calib, options, device, emit)
                except BaseException as e:
                    emit({"event": "error", "message": str(e)})
                    raise
                lap("activation_scales")
            kept = o.kept([s.file for s in plan.shards], workers)
            lap("resume_check")
            todo = [s for s in plan.shards if s.file not in kept]
            resumed = len(plan.shards) - len(todo)
            for s in plan.shards:
                if s.file in kept:
                    emit({"event": "skip", "file": s.file})
            total = sum(s.source_bytes for s in plan.shards)
            done_bytes = total - sum(s.source_bytes for s in todo)
            # the shards are written on the CPU whatever --device says: what is left after a GPU's
            # layer pass is round-to-nearest and byte copies (RTN_ON_GPU says why; the same bytes)
            device = "cpu"
            kernels = _kernel_path(device, emit)
            emit(
                {
                    "event": "start",
                    "stage": "convert",
                    "total_bytes": total,
                    "done_bytes": done_bytes,
                    "shards": len(plan.shards),
                    "workers": workers,
                    "kernels": kernels["path"],
                }
            )
            fds: dict = {}
            try:
                phases: dict[str, float] = {}
                with torch_threads(1), ThreadPoolExecutor(workers) as pool:
                    done_bytes = _execute(
                        plan, todo, src, out, options, o, pool, workers, fds, emit, done_bytes, device, cache, acts,
                        phases=phases
                    )
                lap("shards")
                ct.result()  # the config and its check, before anything presents the output as complete
                lap("config_wait")
                kernels = {**kernels, "workers": workers, "phase_seconds": phases}
                _finish(plan, src, o, sides, ident, t0, kernels, emit, cache.report if cache is not None else None,
                        acts, wall)
            except BaseException as e:
                emit({"event": "error", "message": str(e)})
                raise
            finally:
                for fd in fds.values():
                    os.close(fd)
            record = o.record
    finally:
        ct.exception()  # a failed run never leaves the import thread running behind it
    stats = [s for shard in record["stats"].values() for s in shard]
    rel = [s["rel_err"] for s in stats]
    seconds = time.time() - t0
    summary = plan.summary()
    res = ConvertResult(
        str(out),
        summary,
        seconds,
        total,
        summary["output_bytes"],
        len(rel),
        sum(rel) / len(rel) if rel else None,
        max(rel) if rel else None,
        resumed,
        cache.report if cache is not None else None,
        sum(j.kind == "pass_int4" for j in plan.jobs),
    )
    emit(
        {
            "event": "done",
            "seconds": round(seconds, 3),
            "source_bytes": total,
            "output_bytes": res.output_bytes,
            "gb_per_s": round(res.gbps, 4),
            "tensors_int4": len(rel),
            "mean_rel_err": res.mean_rel_err,
        }
    )
    return res


ACT_SCALES = "act_scales.json"  # OUT/.quantize/: the calibrated scales, kept for a resume


def activation_scales(plan: Plan, src: Path, o: Output, calib, options: ConvertOptions, device: str, emit: Emit):
    """SGLang's static per-expert FP8 input scales (``calibrate.act_scales``), calibrated on the
    calibration samples through the source's layers (every rank its share under ``--nproc``), or
    read back on a resume (the job key holds the source, the options and the samples' token ids)."""
    from .archs.base import EXPERT_ROLES
    from .calibrate import act_scales
    from .methods.runner import open_streamer

    path = o.scratch(ACT_SCALES)
    if o.resumed and path.is_file():
        try:
            acts = act_scales.ActScales.from_dict(json.loads(path.read_text()))
            emit({"event": "skip", "file": ACT_SCALES})
            return acts
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: measured again
    moe: dict[int, set[int]] = {}
    for j in plan.jobs:
        m = _EXPERT.search(j.name) if j.role in EXPERT_ROLES else None
        if m:
            moe.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    for i, es in moe.items():
        if es != set(range(len(es))):
            raise QuantizeError(f"{src}: layer {i}'s routed experts are not numbered 0..{len(es) - 1}; the checkpoint "
                                "is incomplete")
    world = distributed.current()
    budget = int(options.memory_budget_gib * 2**30)
    if world.size > 1:
        world.broadcast(("act_scales", {"ids": calib.ids, "device": device, "budget": budget}),
                        "the activation-scale calibration")
    streamer = open_streamer(src)
    try:
        streamer.device, streamer.expert_budget = _rank_device(device, world), budget
        emit({"event": "start", "stage": "activation scales", "unit": "layers", "total_bytes": streamer.num_layers})
        seen = act_scales.observe(streamer, calib.ids, world, emit)
    finally:
        streamer.close()
    acts = act_scales.scales(seen, {i: len(es) for i, es in sorted(moe.items())}, options.min_expert_tokens)
    acts.data = {"samples": len(calib.ids), "tokens": calib.tokens, "source": calib.source}
    path.parent.mkdir(parents=True, exist_ok=True)
    from .checkpoint.output import write_text_atomic

    write_text_atomic(path, json.dumps(acts.to_dict()))
    return acts


def _rank_device(device: str, world) -> str:
    """A rank's device for the calibration: the CPU, or under NCCL each rank's own GPU."""
    return device if device == "cpu" or world.backend != "nccl" else world.device


def sglang_expert(job: Job, tensors: list, acts) -> list[torch.Tensor]:
    """A routed expert's [weight_packed, weight_scale, ...] as SGLang's native w4afp8 holds it: int8
    codes (``formats.w4afp8.from_packed``: the same nibbles), the scale in fp32 (the exact values:
    SGLang casts it to bf16 on load, and the codes were made against the bf16 scale), and the
    projection's calibrated static input scale (``calibrate.act_scales``)."""
    m = _EXPERT.search(job.name)
    if m is None:
        raise AssertionError(f"not a routed expert projection: {job.name}")
    layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
    packed, scale = tensors[0], tensors[1]
    return [w4afp8.from_packed(packed), scale.float(),
            torch.tensor([acts.of(layer, expert, proj)], dtype=torch.float32)]


_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _timed_job(*args):
    t = time.perf_counter()
    got = compute_job(*args)
    return got, time.perf_counter() - t


def _execute(
    plan, todo, src, out, options, output, pool, workers, fds, emit, done_bytes, device="cpu", cache=None, acts=None,
    *, phases: dict,
) -> int:
    """Workers compute ahead inside a bounded window; this thread writes in plan order; a
    committer thread makes each finished shard durable (fsync, rename) and records it while the
    next shard is being computed and written. ``phases`` gets where the time went, in seconds
    (what a slow run is bound by): ``compute`` (the workers' conversions, summed over them),
    ``wait`` (this thread waiting for the next result), ``write`` (this thread's writes, copies and
    hashing), ``commit`` (fsync and rename, on the committer thread, beside the rest)."""
    phases.update({"compute": 0.0, "wait": 0.0, "write": 0.0, "commit": 0.0})
    clock = time.perf_counter
    window = 2 * workers
    jobs = [(si, j) for si, s in enumerate(todo) for j in s.jobs]
    pending: deque[tuple[int, Job, Future | None]] = deque()
    it = iter(jobs)

    def refill():
        while sum(1 for _, _, f in pending if f is not None) < window:
            nxt = next(it, None)
            if nxt is None:
                return
            si, j = nxt
            fut = (
                pool.submit(_timed_job, j, src, options, fds, device, cache)
                if j.kind in ("int4", "dequant", "fp8", "transcode") else None
            )
            pending.append((si, j, fut))

    def commit(writer: StreamWriter, shard, sha: str, stats: list[dict]) -> None:
        t = clock()
        writer.commit()
        phases["commit"] += clock() - t
        output.mark_done(shard.file, sha, writer.bytes_written, stats)
        emit({"event": "shard", "file": shard.file, "bytes": writer.bytes_written, "sha256": sha})

    copy_buf = bytearray(COPY_CHUNK)
    with ThreadPoolExecutor(1) as committer:
        commits: list[Future] = []
        for si, shard in enumerate(todo):
            (out / shard.file).parent.mkdir(parents=True, exist_ok=True)  # an index may name shards in a folder
            writer = StreamWriter(out / shard.file, shard.entries, shard.metadata)
            stats: list[dict] = []
            try:
                for _ in shard.jobs:
                    refill()
                    psi, job, fut = pending.popleft()
                    assert psi == si
                    if fut is None:  # copy / keep_fp8 / pass_int4: stream bytes, no tensor in memory
                        t0 = clock()
                        for ref, entry in zip(job.inputs, job.outputs):
                            _copy_checked(writer, entry.name, cached_fd(fds, src / ref.file), ref, copy_buf)
                        phases["write"] += clock() - t0
                    else:
                        t0 = clock()
                        (tensors, st), took = fut.result()
                        t1 = clock()
                        phases["wait"] += t1 - t0
                        phases["compute"] += took
                        if acts is not None and job.kind in ("int4", "transcode"):
                            tensors = sglang_expert(job, tensors, acts)
                        for entry, t in zip(job.outputs, tensors):
                            writer.write_tensor(entry.name, t)
                        phases["write"] += clock() - t1
                        if st:
                            stats.append(st)
                    done_bytes += job.in_bytes
                    emit(
                        {
                            "event": "tensor",
                            "name": job.name,
                            "kind": job.kind,
                            "done_bytes": done_bytes,
                            **({"rel_err": round(st["rel_err"], 6)} if fut is not None and st else {}),
                        }
                    )
                sha = writer.close()
            except BaseException:
                writer.abort()
                for _, _, f in pending:
                    if f is not None:
                        f.cancel()
                for c in commits:
                    c.exception()  # let committed shards finish; their records stay valid
                raise
            for c in [c for c in commits if c.done()]:
                c.result()  # a failed commit stops the run here
            commits = [c for c in commits if not c.done()]
            commits.append(committer.submit(commit, writer, shard, sha, stats))
        for c in commits:
            c.result()
    for k in ("compute", "wait", "write", "commit"):
        phases[k] = round(phases[k], 3)
    return done_bytes


FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _copy_checked(writer: StreamWriter, name: str, fd: int, ref: TensorRef, buf: bytearray) -> None:
    """Copy bytes verbatim; float tensors are scanned for NaN/Inf chunk by chunk on the way."""
    dt = FLOAT_DTYPES.get(ref.dtype)
    check = None
    if dt is not None:
        size = torch.finfo(dt).bits // 8

        def check(chunk: memoryview) -> None:
            t = torch.frombuffer(chunk, dtype=dt, count=len(chunk) // size) if len(chunk) >= size else None
            if t is not None and not torch.isfinite(t).all():
                raise QuantizeError(
                    f"{ref.file}: tensor {ref.name} contains NaN or Inf; the source is corrupt, re-download that shard"
                )

    writer.copy_bytes(name, fd, ref.start, ref.nbytes, buf, on_chunk=check)


def _ct_config(plan: Plan) -> dict:
    check_with_compressed_tensors(plan)
    startup.settle()  # the last library convert imports is in: the CLI's collector runs again (quantize/startup.py)
    return plan.quantization_config


def _kernel_path(device: str, emit: Emit) -> dict:
    """Which transform path runs (recorded in the manifest); a fallback is one warning line."""
    if device != "cpu":
        return {"path": "torch", "device": device, "reason": "the torch reference path runs on the GPU"}
    st = native.status()
    if st["path"] != "native" and st.get("reason") and "QUANTIZE_NATIVE=0" not in st["reason"]:
        emit(
            {
                "event": "warning",
                "message": f"native kernels unavailable ({st['reason']}); using the torch path (same output, slower)",
            }
        )
    return {**st, "device": device}


def _finish(
    plan: Plan,
    src: Path,
    o: Output,
    sides: list[Path],
    ident: dict,
    t0: float,
    kernels: dict,
    emit: Emit,
    method: dict | None,
    acts,
    wall: dict,
) -> None:
    copied = o.copy_side_files(sides)
    weight_map = {e.name: s.file for s in plan.shards for e in s.entries}
    index = {
        "metadata": {"total_size": sum(e.nbytes for s in plan.shards for e in s.entries)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    o.write_json(INDEX_NAME, index, sort_keys=False, indent=2)
    config = ModelConfig.load(src).raw  # the source's, read and checked as plan read it
    config.pop("quantization_config", None)
    if plan.arch.text_config_key and isinstance(config.get(plan.arch.text_config_key), dict):
        config[plan.arch.text_config_key].pop("quantization_config", None)
    config["quantization_config"] = plan.quantization_config
    name = config.get("_name_or_path")  # transformers' save_pretrained may have written a local folder there
    if isinstance(name, str) and (os.path.isabs(name) or name.startswith("~")):
        config["_name_or_path"] = shown_path(name)  # published with the model: no path of this machine
    o.write_json("config.json", config, indent=2)
    stats = [s for f in plan.shards for s in o.record["stats"].get(f.file, [])]
    manifest = {
        "kind": "convert",
        "tool": tool_versions(),
        "source": {
            "path": str(src.resolve()),
            "revision": hub_revision(src),
            "files": ident,
            "lineage": lineage(src),  # what the source was made from (eval: the candidate's provenance)
            "format": plan.source_format,
        },
        "options": plan.options.to_dict(),
        "kernels": kernels,
        "plan": plan.summary(),
        "dropped_source_tensors": plan.dropped,
        "copied_from_source": copied,
        "outputs": o.record["shards"],
        **({"passed_through": passed_through(plan)} if plan.source_int4 is not None else {}),
        "error_summary": _error_summary(stats),
        **({"method": method} if method is not None else {}),
        **({"activation_scales": acts.report()} if acts is not None else {}),
        "tensors": stats,
        "seconds": round(time.time() - t0, 3),
        # the steps before this manifest (the process's own start-up and imports come before them)
        "wall_seconds": wall,
    }
    o.complete()
    write_manifest(o, manifest)


def passed_through(plan: Plan) -> dict:
    """What of an INT4 source was written bit for bit (codes, scales and shape), by role; and
    what was re-quantized (``--requantize``)."""
    from collections import Counter

    kept = Counter(j.role for j in plan.jobs if j.kind == "pass_int4")
    redone = Counter(j.role for j in plan.jobs if j.kind == "int4" and j.scale_format == "int4")
    return {
        "scheme": {"group_size": plan.source_int4.group_size, "observer": plan.source_int4.observer},
        "modules": sum(kept.values()),
        "by_role": dict(sorted(kept.items())),
        "requantized": sum(redone.values()),
        **({"requantized_by_role": dict(sorted(redone.items()))} if redone else {}),
    }


def _error_summary(stats: list[dict]) -> dict:
    by_role: dict[str, list[dict]] = {}
    for s in stats:
        by_role.setdefault(s["role"], []).append(s)
    out = {}
    for role, ss in sorted(by_role.items()):
        rel = [s["rel_err"] for s in ss]
        d = {
            "tensors": len(ss),
            "mean_rel_err": sum(rel) / len(rel),
            "max_rel_err": max(rel),
            "worst": max(ss, key=lambda s: s["rel_err"])["name"],
        }
        if "rel_err_minmax" in ss[0]:
            mm = [s["rel_err_minmax"] for s in ss]
            d["mean_rel_err_minmax"] = sum(mm) / len(mm)
            d["mse_vs_minmax_sq_err_reduction"] = 1 - sum(r * r for r in rel) / max(sum(m * m for m in mm), 1e-30)
        if all("rel_err_rtn" in s for s in ss):  # a data-aware method: its weight error beside RTN's on the same grid
            d["mean_rel_err_rtn"] = sum(s["rel_err_rtn"] for s in ss) / len(ss)
        out[role] = d
    return out
