"""The layer-sequential pass of a data-aware method, before ``convert`` writes any shard.

Calibration text is embedded once; then, one decoder layer at a time (transformers' own layer
class, built by ``calibrate.runner.LayerStreamer`` from that layer's tensors only), the method
quantizes the layer's INT4 weights from the hidden states that reach it, and the hidden states go
on through the QUANTIZED layer (weights = ``q * scale`` as the engines compute) to the next. Hidden
states live in ``store.HiddenStore`` (memory up to ``memory_budget``, disk beyond).

Each finished layer's results (``X.weight_packed`` / ``X.weight_scale`` of every INT4 weight of the
layer) are written atomically to ``OUT/.quantize/layers/LLLL.safetensors`` and recorded with their
SHA-256 and the layer report in ``OUT/.quantize/job.json``. On ``--resume``, recorded layers are
replayed (forward only, through the same quantized weights read back), so a kill mid-layer redoes
that layer only and the result is byte-identical to an uninterrupted run. The shard executor then
takes these tensors instead of round-to-nearest.

Weights the pass cannot reach are quantized RTN and named in the report: the MTP layer (which
transformers' decoder stack does not run), INT4 tensors outside the decoder layers, and a weight
that is not a parameter of transformers' layer class.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.output import RankScratch, sha256_file
from ..errors import QuantizeError
from ..events import Emit, null_emit
from .base import Layer
from .forward import Context, Forward, clear, deterministic
from .registry import METHODS
from .store import Budget, HiddenStore
from .streamed import carry, expert_budget, virtual_shapes
from .units import dequant, install, join, layer_units, param, rtn, split

LAYERS_DIR = "layers"
HIDDEN_DIR = "hidden"


@dataclass
class Calibration:
    ids: list[torch.Tensor]
    source: str
    sha256: str  # of the token ids: what the resume key holds for the data
    tokens: int
    texts_read: int
    dropped_short: int


def prepare(src: Path, options, emit: Emit = null_emit) -> Calibration:
    """Tokenize the calibration data, then check that transformers can build every layer from the
    checkpoint's tensors (``LayerStreamer.check_layers``, headers only), before any weight is read
    or any output opened: bad data, a missing tokenizer, an unbuildable architecture or a tensor the
    layer class cannot take is one line, nothing written."""
    from ..calibrate.data import build_samples

    from ..options import ACT_SAMPLES

    s = build_samples(Path(src), options.data, options.samples or ACT_SAMPLES, options.seq_len,
                      pack=bool(getattr(options, "pack", False)))
    if options.samples is None and not s.ids:  # SGLang's activation scales: as many as the data holds
        raise QuantizeError(f"--data {s.source}: no usable sample ({s.texts_read} texts read); pass calibration text")
    if options.samples is not None and len(s.ids) < options.samples:
        raise QuantizeError(f"--data {s.source}: {len(s.ids)} usable samples ({s.texts_read} texts read, "
                            f"{s.dropped_short} shorter than 2 tokens), fewer than --samples {options.samples}; "
                            f"pass more text or lower --samples to {len(s.ids)}")
    h = hashlib.sha256()
    for ids in s.ids:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(ids.to(torch.int64).numpy().tobytes())
    streamer = open_streamer(Path(src))
    try:  # every layer's class built on the meta device, its tensors found in the headers: no weight read
        streamer.check_layers(build_fix="use --method rtn")
        streamer.check_ids(s.ids)
        if getattr(options, "method_name", None) == "autoround":  # its experts' training state is held whole
            from ..distributed import current
            from .tuning import check_memory, state_copies

            check_memory(streamer, getattr(options, "device", "cpu"), current(), copies=state_copies(options))
    finally:
        streamer.close()
    return Calibration(s.ids, s.source, h.hexdigest(), sum(len(i) for i in s.ids), s.texts_read, s.dropped_short)


def open_streamer(src: Path):
    from ..calibrate.runner import LayerStreamer

    try:
        st = LayerStreamer(src, dtype=torch.float32)
    except QuantizeError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own failure, as one line
        raise QuantizeError(f"{src / 'config.json'}: transformers cannot build this architecture's layers "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); use --method rtn") from e
    if hasattr(st.config, "_experts_implementation"):
        st.config._experts_implementation = "eager"  # per-expert token routing, differentiable
    return st


def _build(streamer, i: int, stream_experts: bool = False, device=None) -> torch.nn.Module:
    try:
        return streamer.layer(i, stream_experts=stream_experts, device=device)
    except QuantizeError:
        raise
    except Exception as e:  # noqa: BLE001
        raise QuantizeError(f"{streamer.folder}: transformers cannot build decoder layer {i} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:160]}); use --method rtn") from e


# ---------------------------------------------------------------------------------------------
@dataclass
class LayerCache:
    """Checkpoint module -> the layer file holding its packed codes and scales."""

    files: dict[str, Path] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)  # module -> gptq | autoround | rtn (fallback)
    report: dict = field(default_factory=dict)

    def has(self, module: str) -> bool:
        return module in self.files

    def result(self, unit, k: int):
        """A unit's result read back from its layer file (``units.join``), or None."""
        if not all(self.has(n) for n, _, _ in unit.names):
            return None
        from safetensors import safe_open

        tensors = {}
        for n, _, _ in unit.names:
            with safe_open(self.files[n], "pt") as f:
                tensors[f"{n}.weight_packed"] = f.get_tensor(f"{n}.weight_packed")
                tensors[f"{n}.weight_scale"] = f.get_tensor(f"{n}.weight_scale")
        return join(unit, tensors, k)

    def read(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import safe_open

        with safe_open(self.files[module], "pt") as f:
            return f.get_tensor(f"{module}.weight_packed"), f.get_tensor(f"{module}.weight_scale")


# ---------------------------------------------------------------------------------------------
def _layer_files(rec: dict) -> list[dict]:
    """A recorded layer's files ({file, sha256, bytes}): its own, then its expert groups'."""
    files = list(rec.get("parts", []))
    if rec.get("file") is not None:
        files.insert(0, {"file": rec["file"], "sha256": rec.get("sha256"), "bytes": rec.get("bytes")})
    return files


class _RankOutput(RankScratch):
    """What a rank other than 0 has of rank 0's output (``checkpoint.output.Output``): its folder
    (the layer files a resumed run replays: the same folder on one node, a shared one across
    nodes), the layers rank 0 found recorded, and this rank's own spill folder (``RankScratch``,
    removed with ``close``). It writes nothing else there."""

    def __init__(self, path: str, layers: dict, first: int, rank: int):
        super().__init__(Path(path), rank)
        self.path, self.record, self.first = Path(path), {"layers": layers}, first


class Pass:
    def __init__(self, plan, src: Path, output, calib: Calibration, options, workers: int, device: str,
                 memory_budget: int, emit: Emit):
        from .. import distributed

        self.plan, self.src, self.o, self.calib, self.opt = plan, Path(src), output, calib, options
        self.method = METHODS[options.method_name]
        self.workers, self.device, self.emit = max(1, workers), device, emit
        self.dir = output.path / ".quantize" / LAYERS_DIR
        self.spill = output.scratch(HIDDEN_DIR)
        self.budget = Budget(memory_budget)
        self.world = distributed.current()
        # several ranks, each running this pass on its own calibration samples (methods/streamed.py)
        self.split = self.world.size > 1 and self.method.splits_samples

    # -- bookkeeping ---------------------------------------------------------------------------
    def _valid(self, key: str) -> bool:
        rec = self.o.record.get("layers", {}).get(key)
        if not rec:
            return False
        for f in _layer_files(rec):
            p = self.dir / f["file"]
            if not (p.is_file() and p.stat().st_size == f["bytes"] and sha256_file(p) == f["sha256"]):
                return False
        return True

    def _save(self, name: str, tensors: dict[str, torch.Tensor], i: int) -> dict:
        """One layer file, atomically: its record entry (file, SHA-256, bytes)."""
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        path, tmp = self.dir / name, self.dir / f"{name}.partial"
        save_file(tensors, str(tmp), metadata={"format": "pt", "layer": str(i), "method": self.opt.method})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return {"file": name, "sha256": sha256_file(path), "bytes": path.stat().st_size}

    def _write(self, i: int, tensors: dict[str, torch.Tensor], report: dict, modules: dict[str, str],
               parts: list[dict] | None = None, part_modules: dict[str, str] | None = None) -> None:
        """Record layer ``i`` done: its tensors in ``LLLL.safetensors``, and (streamed experts) the
        group files already written (``parts``; ``part_modules``: module -> its group file)."""
        key = f"{i:04d}"
        entry = {"file": None, "report": report, "modules": modules}
        if tensors:
            entry.update(self._save(f"{key}.safetensors", tensors, i))
        if parts:
            entry.update(parts=parts, module_files=part_modules)
        self.o.record.setdefault("layers", {})[key] = entry
        self.o.save()

    # -- the pass ------------------------------------------------------------------------------
    def run(self) -> LayerCache:
        """Every torch op runs on one thread (a GEMM's or a Cholesky's last bits can depend on the
        thread count); ``workers`` threads run samples (and GPTQ chunks) side by side instead."""
        from concurrent.futures import ThreadPoolExecutor

        streamer = open_streamer(self.src)
        # routed experts' weights (and Hessians) held at once: --memory-budget-gib, or a share of the GPU
        streamer.expert_budget = expert_budget(self.device, self.budget.limit)
        old_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with deterministic(self.device), ThreadPoolExecutor(self.workers, thread_name_prefix="layer") as self.pool:
                return self._run(streamer)
        finally:
            torch.set_num_threads(old_threads)
            streamer.close()
            self.o.clear_scratch(HIDDEN_DIR)

    def _run(self, streamer) -> LayerCache:
        n_layers = streamer.num_layers
        prefixes = [streamer._layer_prefix(i) for i in range(n_layers)]
        int4_jobs = [j for j in self.plan.jobs if j.kind == "int4"]
        jobs_by_layer = [[j for j in int4_jobs if j.name.startswith(p)] for p in prefixes]
        inside = {id(j) for js in jobs_by_layer for j in js}
        outside = [{"name": j.module, "reason": "outside the decoder layers transformers runs (MTP layer or no layer)"}
                   for j in int4_jobs if id(j) not in inside]
        keys = [f"{i:04d}" for i in range(n_layers)]
        if isinstance(self.o, _RankOutput):
            first = self.o.first
        else:
            stale = self.o.record.get("layers", {})
            for k in [k for k in stale if k not in keys or not self._valid(k)]:
                del stale[k]  # redone below
            first = next((i for i, k in enumerate(keys) if k not in stale), n_layers)
            if first < n_layers:
                self.o.clear_scratch(HIDDEN_DIR)  # a killed run's spill, every rank's: before the others make theirs
                if self.split:  # the other ranks run this pass on their samples
                    job = {"plan": self.plan, "calib": self.calib, "options": self.opt, "workers": self.workers,
                           "device": self.device, "memory_budget": self.budget.limit, "out": str(self.o.path),
                           "layers": dict(stale), "first": first}
                    self.world.broadcast(("pass", job), "the layer pass")
        t0 = time.time()
        if first < n_layers:
            # progress by layers (one "layer" event each, replayed ones included), before convert's own by bytes
            self.emit({"event": "start", "stage": self.opt.method, "unit": "layers", "total_bytes": n_layers,
                       "done_bytes": 0})
            self._stream(streamer, jobs_by_layer, first)
        if not self.world.is_writer:
            return None
        cache = LayerCache()
        layers = []
        for k in keys:
            rec = self.o.record["layers"][k]
            layers.append(rec["report"])
            for module, how in rec["modules"].items():
                cache.files[module] = self.dir / rec.get("module_files", {}).get(module, rec["file"])
                cache.methods[module] = how
        cache.report = self._summary(layers, outside, time.time() - t0)
        return cache

    def _stream(self, streamer, jobs_by_layer, first: int) -> None:
        n = len(self.calib.ids)
        own = self.world.samples(n) if self.split else range(n)
        fwd = Forward(streamer, Context(streamer, self.device), self.pool, self.workers, self.device, self.budget,
                      self.spill, samples=own, total=n, world=self.world if self.split else None)
        fwd.out = str(self.o.path)
        hidden = HiddenStore(self.budget, self.spill, "in")
        with torch.no_grad():
            for s in own:
                hidden.append(streamer.embed(self.calib.ids[s].unsqueeze(0)).to(torch.float32))
        topk: list = [None] * len(hidden)
        # a source_stream method's targets (AutoRound's), or GPTQ --asym's paired inputs: the source model's
        # own hidden states, carried beside the quantized path (the same store until the first quantized layer)
        fp_stream = self.method.source_stream or bool(getattr(self.opt, "asym", 0))
        fp_hidden, fp_topk = hidden, topk
        for i, jobs in enumerate(jobs_by_layer):
            t = time.time()
            layer = _build(streamer, i, stream_experts=self.method.streams_experts, device=self.device).to(self.device)
            stand = streamer.stand_in(layer)
            units, rtn_named = layer_units(layer, streamer._layer_prefix(i), jobs, virtual_shapes(streamer,
                                                                                                          stand))
            key = f"{i:04d}"
            fp_next = fp_next_topk = None
            if fp_stream and (units or fp_hidden is not hidden):
                if stand is None:
                    fp_next, fp_next_topk = fwd(layer, fp_hidden, fp_topk, i, "of the source layer")
                else:
                    fp_next, fp_next_topk = carry(streamer, fwd, layer, stand, i, fp_hidden, fp_topk,
                                                  "of the source layer")
            if i < first:  # recorded: replay through the same quantized weights
                out, new_topk = self._replay(fwd, streamer, layer, stand, i, units, hidden, topk)
                self.emit({"event": "layer", "layer": i, "of": len(jobs_by_layer), "replayed": True})
            else:
                out, new_topk = self._layer(fwd, layer, i, units, rtn_named, hidden, topk, t, targets=fp_next,
                                            stand=stand, sources=(fp_hidden, fp_topk))
            clear(hidden, fp_hidden)
            if fp_next is not None:
                fp_hidden, fp_topk = fp_next, fp_next_topk
            else:
                fp_hidden, fp_topk = out, new_topk
            hidden, topk = out, new_topk
            del layer
        clear(hidden, fp_hidden)

    def _replay(self, fwd: Forward, streamer, layer, stand, i, units, hidden, topk):
        """A recorded layer: forward only, through the quantized weights read back from its files."""
        rec = self.o.record["layers"][f"{i:04d}"]
        cache = LayerCache()
        for module in rec["modules"]:
            cache.files[module] = self.dir / rec.get("module_files", {}).get(module, rec["file"])
        by_expert: dict[int, list] = {}
        for u in units:
            if u.expert is None:
                res = cache.result(u, param(layer, u).shape[1])
                if res is not None:
                    install(layer, u, dequant(res).to(self.device))
            else:
                by_expert.setdefault(u.expert, []).append(u)
        what = "after the quantized layer (replayed)"
        if stand is None:
            for u in [u for us in by_expert.values() for u in us]:
                res = cache.result(u, param(layer, u).shape[1])
                if res is not None:
                    install(layer, u, dequant(res).to(self.device))
            return fwd(layer, hidden, topk, i, what)
        k = {p: shape[-1] for p, shape in virtual_shapes(streamer, stand).items()}
        return carry(streamer, fwd, layer, stand, i, hidden, topk, what,
                              result=lambda u: cache.result(u, k[u.path]), units_by_expert=by_expert)

    def _layer(self, fwd: Forward, layer, i, units, rtn_named, hidden, topk, t0, targets=None, stand=None,
               sources=(None, None)):
        """Quantize one layer: the method's step (``self.method.layer_step``: its statistics and its
        quantization, from the RTN start on the same grid), then the quantized layer's outputs for
        the next layer and its error against the step's reference, recorded with the report. A
        layer whose routed experts are streamed (``stand``) goes through ``methods/streamed.py``."""
        opt = self.opt
        report: dict = {"layer": i, "method": opt.method, "units": len(units), "samples": fwd.total}
        fallbacks = [{"name": n, "reason": r} for n, r in rtn_named]
        if not units:  # nothing INT4 here (e.g. a dense layer under --profile experts): carry through
            if stand is None:
                out, topk = fwd(layer, hidden, topk, i, "after the layer")
            else:
                out, topk = carry(fwd.streamer, fwd, layer, stand, i, hidden, topk, "after the layer")
            report.update(fallbacks=fallbacks, seconds=round(time.time() - t0, 3))
            if self.world.is_writer:
                self._write(i, {}, report, {})
            self.emit({"event": "layer", "layer": i, "of": fwd.streamer.num_layers, "units": 0})
            return out, topk
        held = [u for u in units if stand is None or u.expert is None]  # the units the built layer holds
        originals = {u.key: param(layer, u).detach().clone() for u in held}
        # the loss before: RTN on the same grid, through the real quantized layer (q * scale)
        rtn_init = {u.key: rtn(originals[u.key], opt.group_size, opt.observer, u.scale_dtype) for u in held}
        x = Layer(i, layer, units, originals, rtn_init, hidden, topk, targets, fallbacks, opt, fwd, *sources)
        parts: list[dict] = []
        part_modules: dict[str, str] = {}
        modules: dict[str, str] = {}
        if stand is None:
            step = self.method.layer_step(x)
            report.update(step.report)
            results, ref, routed, e_rtn, tot = step.results, step.ref, step.routed, step.err_rtn, step.ref_sq
            x.put(results)
            out, new_topk, (e_q, tot_q) = fwd(layer, hidden, topk, i, "after the quantized layer", ref=ref)
        else:
            def write_group(start, tensors, how):
                modules.update(how)
                if tensors:
                    entry = self._save(f"{i:04d}-e{start:05d}.safetensors", tensors, i)
                    parts.append(entry)
                    for name in how:
                        part_modules[name] = entry["file"]

            step, acc_q = self.method.streamed_step(fwd, layer, stand, x, write_group)
            report.update(step.report)
            results, ref, routed, e_rtn, tot = step.results, step.ref, step.routed, step.err_rtn, step.ref_sq
            out, new_topk, (e_q, tot_q) = fwd(layer, hidden, topk, i, "after the quantized layer", ref=ref, stand=stand,
                                          replay=acc_q)
            acc_q.clear()
        if ref is not targets:
            ref.clear()
        if e_rtn is None:  # --skip-rtn-loss: no RTN pass; the reference's norm from the quantized one
            tot = tot_q
        numel = hidden.numel
        if fwd.world is not None:  # every rank's samples
            numel = sum(fwd.world.gather(numel, f"layer {i} sizes", to=0) or [1])
        if not self.world.is_writer:
            return out, new_topk
        tensors = {}
        for u in units:
            if u.key not in results:
                continue  # a streamed expert: in its group's file
            tensors.update(split(u, results[u.key]))
            for name, _, _ in u.names:
                modules[name] = results[u.key].how
        order = {name: n for n, u in enumerate(units) for name, _, _ in u.names}
        fallbacks.sort(key=lambda f: (order.get(f["name"], -1), f["name"], f["reason"]))  # unit order, either path
        counts = sorted(routed.values())
        per_module: dict[str, list[int]] = {}
        for (path, e), c in sorted(routed.items()):
            per_module.setdefault(path, []).append(c)
        report.update(
            tokens_per_expert={"experts": len(counts), "min": counts[0], "median": statistics.median(counts),
                               "max": counts[-1], "counts": per_module} if counts else None,
            fallbacks=fallbacks,
            loss_rtn=e_rtn / numel if e_rtn is not None else None, loss=e_q / numel,
            rel_err_rtn=((e_rtn / tot) ** 0.5 if tot else 0.0) if e_rtn is not None else None,
            rel_err=(e_q / tot) ** 0.5 if tot else 0.0,
            seconds=round(time.time() - t0, 3),
        )
        self._write(i, tensors, report, modules, parts, part_modules)
        # routed experts (module, index): quantized by the method (no weight of theirs fell back), or left at
        # RTN because the router sent them fewer than --min-expert-tokens tokens
        expert_of = {name: (u.module, u.expert) for u in units if u.expert is not None for name, _, _ in u.names}
        starved = [f for f in fallbacks if "--min-expert-tokens" in f["reason"]]
        fell = {expert_of[f["name"]] for f in fallbacks if f["name"] in expert_of}
        self.emit({"event": "layer", "layer": i, "of": fwd.streamer.num_layers, "method": opt.method,
                   "units": len(units), "loss_rtn": report["loss_rtn"], "loss": report["loss"],
                   "fallbacks": len(fallbacks), "fallbacks_starved": len(starved), "seconds": report["seconds"],
                   "experts": len(set(expert_of.values())), "experts_quantized": len(set(expert_of.values()) - fell),
                   "experts_rtn": len({expert_of[f["name"]] for f in starved if f["name"] in expert_of})})
        for f in fallbacks:
            self.emit({"event": "warning", "message": f"layer {i}: {f['name']} quantized RTN ({f['reason']})"})
        return out, new_topk

    def _summary(self, layers: list[dict], outside: list[dict], seconds: float) -> dict:
        o = self.opt
        return {
            "method": o.method, "grid": o.observer, "group_size": o.group_size,
            "data": self.calib.source, "data_sha256": self.calib.sha256, "samples": len(self.calib.ids),
            "seq_len": o.seq_len, "tokens": self.calib.tokens,
            **{k: getattr(o, k) for k in self.method.report_fields},
            "all_experts": o.all_experts, "min_expert_tokens": o.min_expert_tokens,
            "layers": layers,
            "rtn": outside + [f for r in layers for f in r.get("fallbacks", [])],
            "hidden_bytes_peak_in_memory": self.budget.peak, "hidden_bytes_spilled": self.budget.spilled,
            "seconds_this_run": round(seconds, 3),
        }


def run(plan, src, output, calib: Calibration, options, workers: int = 1, device: str = "cpu",
        memory_budget: int = 4 << 30, emit: Emit = null_emit) -> LayerCache:
    return Pass(plan, src, output, calib, options, workers, device, memory_budget, emit).run()


def rank_pass(src: Path, job: dict, world) -> None:
    """A rank other than 0 of a pass whose samples are split (``Method.splits_samples``): rank 0's
    pass on this rank's samples (``job``: what rank 0's ``Pass`` holds), writing nothing; rank 0
    writes every layer file and the record."""
    out = _RankOutput(job["out"], job["layers"], job["first"], world.rank)
    layers = out.path / ".quantize" / LAYERS_DIR
    for key, rec in sorted(job["layers"].items()):  # the recorded layers this rank replays: there, of their size
        for f in _layer_files(rec):
            p = layers / f["file"]
            if not p.is_file() or (f.get("bytes") is not None and p.stat().st_size != f["bytes"]):
                out.close()
                raise QuantizeError(f"rank {world.rank}: {p}, a layer rank 0 recorded, is not visible here (or not "
                                    "of its recorded size); a --resume whose ranks span nodes needs OUT on a disk "
                                    "every node shares (or resume on rank 0's node alone)")
    device = world.device if str(job["device"]).startswith("cuda") else "cpu"
    try:
        Pass(job["plan"], src, out, job["calib"], job["options"], job["workers"], device, job["memory_budget"],
             null_emit).run()
    finally:
        out.close()
