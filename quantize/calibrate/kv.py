"""``quantize calibrate-kv``: FP8 (e4m3) KV-cache scales measured on what the engines cache.

MLA (DeepSeek-V3, Kimi K2.x): the cache is ONE row per token per layer, ``kv_c_normed`` (512, after
``kv_a_layernorm``) followed by post-RoPE ``k_pe`` (64), read as both K and V; transformers' own
attention hands exactly that row to ``past_key_values.update``, where an observing cache object
sees it. One scale covers the whole row (a latent-only scale would saturate ``k_pe``). GQA: K and V
per head, post-RoPE. GLM-5 DSA: the engines write the cache with per-128 dynamic scales, so no
checkpoint scale is used or written; the statistics and that layout's error are still reported.

Per layer: absmax, a high percentile, the scale (absmax/448, or percentile/448 with ``clip``), the
fractions that overflow +-448 or fall to subnormal / zero in e4m3 under unit scale (what SGLang
applies for MLA today) and under the calibrated scale, and the relative error of the attention
output when the cached row goes through e4m3, against BF16; for MLA also the absorbed query's and
q_pe's range. What is written follows what the target engine does (docs/kv-cache.md#what-calibrate-kv-writes): for
MLA on SGLang/vLLM nothing but, with ``fold``, the exactly reparametrised model (calibrate/fold.py);
for transformers (``compressed-tensors``) and GQA models the scales and ``kv_cache_scheme``.
What differs by layout (what is observed, the scales, the verdict, what is written) is the layout
object's (``archs/attention.py``); this module measures and writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..archs.attention import AttentionLayout
from ..checkpoint.index import INDEX_NAME, cached_fd, hub_revision, read_header
from ..checkpoint.manifest import derived_from, tool_versions, write_manifest
from ..checkpoint.output import SIDE_FILES, TMP_SUFFIX, Output, report_target, side_files, write_report
from ..parse import load_json
from ..checkpoint.writer import Entry, StreamWriter
from ..distributed import check_nproc
from . import fold as folding
from .fold import FoldFactors
from ..errors import QuantizeError
from ..events import Emit, null_emit
from ..options import KV_TARGETS, CalibrateKVOptions, takes
from .data import build_samples
from .runner import LayerStreamer
from .. import distributed

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E4M3_ZERO_BELOW = 2.0**-10  # half the smallest subnormal (2^-9): rounds to zero
TARGETS = KV_TARGETS  # declared with the option (quantize/options.py)
STATS_VERSION = 1
STATS_KIND = "kv-stats"  # what proves a --stats-out file ours (checkpoint.output.write_report)
CARRIED = SIDE_FILES  # the model's own manifest is not carried: a fresh one is written


def kv_cache_scheme() -> dict:
    """``kv_cache_scheme`` as compressed-tensors dumps it. Imported here, not at the top: the
    package takes seconds to import, and a refusal (no tokenizer, bad data) should not wait for it."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False).model_dump(
        mode="json"
    )


class Hist:
    """|x| in log2 bins of 1/16 octave from 2^-40 to 2^24; zeros counted apart; exact amax."""

    LO, HI, BPO = -40.0, 24.0, 16

    def __init__(self):
        self.nbins = int((self.HI - self.LO) * self.BPO)
        self.counts = torch.zeros(self.nbins, dtype=torch.float64)
        self.zeros = 0
        self.n = 0
        self.amax = 0.0

    def add(self, x: torch.Tensor) -> None:
        a = x.detach().abs().float().flatten()
        if not torch.isfinite(a).all():
            raise QuantizeError("non-finite values in the KV cache during calibration; the model weights are corrupt")
        self.n += a.numel()
        if a.numel():
            self.amax = max(self.amax, float(a.max()))
        nz = a[a > 0]
        self.zeros += a.numel() - nz.numel()
        idx = ((torch.log2(nz) - self.LO) * self.BPO).floor().clamp_(0, self.nbins - 1).long()
        self.counts += torch.bincount(idx, minlength=self.nbins).double().cpu()  # kept on the CPU, any device

    def merge(self, other: "Hist") -> None:
        """Another rank's values added in: integer counts (exact in float64) and a max, so the
        same histogram in any order and for any split of the samples."""
        self.counts += other.counts
        self.zeros += other.zeros
        self.n += other.n
        self.amax = max(self.amax, other.amax)

    def _edge(self, t: float) -> float:
        return (math.log2(t) - self.LO) * self.BPO if t > 0 else -1.0

    def frac_above(self, t: float) -> float:
        if t >= self.amax:
            return 0.0  # exact: nothing lies above the observed maximum
        e = self._edge(t)
        i = int(math.floor(e))
        if i >= self.nbins:
            return 0.0
        tot = (
            float(self.counts[i + 1 :].sum()) + float(self.counts[i]) * (1 - (e - i))
            if i >= 0
            else float(self.counts.sum())
        )
        return tot / max(self.n, 1)

    def frac_below(self, t: float) -> float:
        """Fraction of NONZERO values below t (they lose precision or vanish in e4m3)."""
        e = self._edge(t)
        i = int(math.floor(e))
        if i < 0:
            return 0.0
        tot = float(self.counts[: min(i, self.nbins)].sum()) + (
            float(self.counts[i]) * (e - i) if i < self.nbins else 0.0
        )
        return tot / max(self.n, 1)

    def quantile(self, q: float) -> float:
        """|x| below which a fraction q of all values lie (zeros included)."""
        target = q * self.n - self.zeros
        if target <= 0:
            return 0.0
        c = torch.cumsum(self.counts, 0)
        i = int(torch.searchsorted(c, torch.tensor(target, dtype=torch.float64)))
        i = min(i, self.nbins - 1)
        return min(2.0 ** (self.LO + (i + 1) / self.BPO), self.amax)


@dataclass
class LayerObs:
    """What one layer's cache held: one row histogram (MLA/DSA, with its latent and rope parts) or
    K and V histograms (GQA)."""

    row: Hist = field(default_factory=Hist)
    latent: Hist = field(default_factory=Hist)
    rope: Hist = field(default_factory=Hist)
    k: Hist = field(default_factory=Hist)
    v: Hist = field(default_factory=Hist)

    def merge(self, other: "LayerObs") -> None:
        for name in ("row", "latent", "rope", "k", "v"):
            getattr(self, name).merge(getattr(other, name))


def fake_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x -> cache (x / scale, saturating to +-448, e4m3) -> read (* scale)."""
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def fake_e4m3_tiles(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """DSA's FP8 layout: one dynamic scale (amax/448) per 128-value tile per token."""
    shape = x.shape
    t = x.float().reshape(-1, shape[-1] // tile, tile)
    s = (t.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(1e-30)
    q = (t / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return q.reshape(shape).to(x.dtype)


class ObservingCache:
    """Duck-typed ``past_key_values`` for one forward: sees what the attention caches and returns it,
    optionally through FP8 (``mode``: None | "unit" | "calibrated" | "tiles")."""

    def __init__(
        self,
        layout: AttentionLayout,
        obs: LayerObs | None,
        rope_dim: int,
        mode: str | None = None,
        scales: tuple[float, float] = (1.0, 1.0),
    ):
        self.layout, self.obs, self.rope_dim, self.mode, self.scales = layout, obs, rope_dim, mode, scales

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.obs is not None:  # what the layout caches, into the layer's histograms
            for part, t in self.layout.observed(k, v, self.rope_dim):
                getattr(self.obs, part).add(t)
        scales = self.layout.cache_scales(self.mode, self.scales)
        if scales is None:
            return k, v
        return fake_e4m3(k, scales[0]), fake_e4m3(v, scales[1])

    def update_indexer(self, k: torch.Tensor, layer_idx: int, *args, **kwargs):
        return k


def _latent_hook(layout: AttentionLayout, obs: LayerObs | None, mode: str | None):
    """Where the cache is not handed the latent (DSA's kv_c_normed): observe (and for "tiles",
    round) it on the module that makes it (``layout.latent_module``)."""

    def hook(module, inputs, output):
        if obs is not None:
            for part, t in layout.observed_latent(output):
                getattr(obs, part).add(t)
        if mode == "tiles":
            return fake_e4m3_tiles(output)
        return output

    return hook


@dataclass
class LayerReport:
    layer: int
    amax: float
    scale: float
    percentile: float
    overflow_unit: float
    subnormal_unit: float
    zero_unit: float
    overflow_calibrated: float
    subnormal_calibrated: float
    zero_calibrated: float
    amax_latent: float | None = None
    amax_rope: float | None = None
    k_amax: float | None = None
    v_amax: float | None = None
    k_scale: float | None = None
    v_scale: float | None = None
    attn_rel_err_unit: float | None = None
    attn_rel_err_calibrated: float | None = None
    attn_rel_err_tiles: float | None = None
    q_absorbed_amax: float | None = None  # MLA: max |q_nope x W_UK| (what FlashMLA casts to e4m3 with the latent)
    q_pe_amax: float | None = None  # MLA: max |RoPE(q_pe)|
    at_risk: bool = False
    why: str = ""


def _fingerprint(streamer: LayerStreamer) -> str:
    keys = (
        "model_type",
        "num_hidden_layers",
        "hidden_size",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "num_key_value_heads",
        "head_dim",
        "num_attention_heads",
        "vocab_size",
    )
    sig = {k: streamer.text.get(k) for k in keys}
    sig["architecture"] = streamer.arch.name
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:16]


def _report_layer(i: int, obs: LayerObs, layout: AttentionLayout, clip: float | None) -> LayerReport:
    h = getattr(obs, layout.scaled)
    thresh = h.quantile(clip) if clip else h.amax
    scale = max(thresh, 1e-30) / E4M3_MAX
    r = LayerReport(
        layer=i,
        amax=h.amax,
        scale=scale,
        percentile=h.quantile(0.999),
        overflow_unit=h.frac_above(E4M3_MAX),
        subnormal_unit=h.frac_below(E4M3_MIN_NORMAL),
        zero_unit=h.frac_below(E4M3_ZERO_BELOW),
        overflow_calibrated=h.frac_above(E4M3_MAX * scale),
        subnormal_calibrated=h.frac_below(E4M3_MIN_NORMAL * scale),
        zero_calibrated=h.frac_below(E4M3_ZERO_BELOW * scale),
    )
    for name, part in layout.amax_fields.items():
        setattr(r, name, getattr(obs, part).amax)
    for name, part in layout.scale_fields.items():
        hp = getattr(obs, part)
        setattr(r, name, (hp.quantile(clip) if clip else hp.amax) / E4M3_MAX)
    return r


def _query_amax(streamer: LayerStreamer, layer, inputs: list[torch.Tensor], rep: LayerReport) -> None:
    """MLA: the largest |absorbed query| (q_nope x W_UK, per head, kv_lora_rank wide) and |RoPE(q_pe)|:
    what a fold divides by its factors, and what SGLang's FlashMLA FP8 path casts to e4m3."""
    attn, norm = layer.self_attn, layer.input_layernorm
    nope, rope, heads = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.num_heads
    w_uk = attn.kv_b_proj.weight.float().view(heads, nope + attn.v_head_dim, -1)[:, :nope]  # [H, nope, R]
    qa = qp = 0.0
    with torch.no_grad():
        for h in inputs:
            x = norm(h)
            q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
            q = q.view(*h.shape[:-1], heads, nope + rope).transpose(-3, -2).float()  # [B, H, S, nope+rope]
            q_nope, q_pe = q[..., :nope], q[..., nope:]
            _, pe, _ = streamer._context(h)
            cos, sin = pe
            q_pe, _ = streamer.modeling.apply_rotary_pos_emb(q_pe, q_pe, cos.float(), sin.float())
            qa = max(qa, float(torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk).abs().max()))
            qp = max(qp, float(q_pe.abs().max()))
    rep.q_absorbed_amax, rep.q_pe_amax = qa, qp


def _attn_error(
    streamer: LayerStreamer, layer, inputs: list[torch.Tensor], layout: AttentionLayout, rope_dim: int,
    rep: LayerReport, world=None, i: int = 0,
) -> None:
    """Relative error of the attention output with the cached row through e4m3, against BF16.
    ``world``: the samples are split over its ranks (``inputs``: this rank's); the per-sample sums
    go to rank 0 and are added there in sample order, as one process adds them."""
    attn = layer.self_attn
    norm = layer.input_layernorm

    def run(mode: str | None, scales=(1.0, 1.0)) -> list[torch.Tensor]:
        outs = []
        tap = layout.latent_module(attn)
        handle = tap.register_forward_hook(_latent_hook(layout, None, mode)) if tap is not None else None
        try:
            for h in inputs:
                pos, pe, mask = streamer._context(h)
                kw = {"prev_topk_indices": None} if streamer.arch.hf.get("topk") else {}
                with torch.no_grad():
                    out = attn(
                        hidden_states=norm(h),
                        position_embeddings=pe,
                        attention_mask=mask,
                        position_ids=pos,
                        past_key_values=ObservingCache(layout, None, rope_dim, mode, scales),
                        **kw,
                    )
                outs.append(out[0] if isinstance(out, tuple) else out)
        finally:
            if handle is not None:
                handle.remove()
        return outs

    if layout.skips_error(attn):
        return  # e.g. a DSA shared-index layer: its attention needs the previous layer's top-k
    ref = run(None)
    terms: dict[str, list[tuple[float, float]]] = {}
    for mode in layout.error_modes:  # "unit" / "calibrated" (MLA, GQA), "tiles" (DSA's per-128 scales)
        scales = layout.calibrated_scales(rep) if mode == "calibrated" else (1.0, 1.0)
        terms[mode] = [(float((o.float() - r.float()).pow(2).sum()), float(r.float().pow(2).sum()))
                       for o, r in zip(run(mode, scales), ref)]
    if world is not None and world.size > 1:
        got = world.gather(terms, f"layer {i} attention error", to=0)
        if got is None:
            return
        terms = {mode: [t for part in got for t in part[mode]] for mode in terms}
    for mode, ts in terms.items():
        num = sum(a for a, _ in ts)
        den = sum(b for _, b in ts)
        setattr(rep, f"attn_rel_err_{mode}", (num / den) ** 0.5 if den else 0.0)


def _risk(r: LayerReport, layout: AttentionLayout) -> None:
    why = []
    if r.overflow_unit > 0:
        why.append(f"{r.overflow_unit:.2e} of values exceed +-448 at unit scale")
    if r.subnormal_unit > 0.10:
        why.append(f"{r.subnormal_unit:.1%} fall below e4m3's normal range at unit scale")
    if (
        r.attn_rel_err_unit is not None
        and r.attn_rel_err_calibrated is not None
        and r.attn_rel_err_unit > 1.5 * r.attn_rel_err_calibrated
        and r.attn_rel_err_unit - r.attn_rel_err_calibrated > 0.01
    ):
        why.append(
            f"attention error {r.attn_rel_err_unit:.3f} at unit scale vs {r.attn_rel_err_calibrated:.3f} calibrated"
        )
    r.at_risk = bool(why) and layout.static_scale
    r.why = "; ".join(why)


@dataclass
class KvResult:
    model: str
    out: str | None
    target: str
    layout: str
    layers: list[LayerReport]
    samples: int
    tokens: int
    dropped_short: int
    unit_scale_safe: bool
    verdict: str
    written: list[str]
    stats_path: str | None = None
    engine_scale: str = ""  # what the target engine does with this layout's cache scale
    fold: list[dict] = field(default_factory=list)  # per layer, with --fold

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


@takes(CalibrateKVOptions)
def calibrate_kv(
    model,
    out,
    data,
    samples,
    seq_len,
    target,
    clip,
    stats_out,
    stats,
    chat_template,
    error_samples,
    fold,
    fold_headroom,
    overwrite,
    memory_budget_gib,
    base_model,
    device,
    nproc,
    dist_timeout_s,  # noqa: ARG001 - the timeout of the World the command line joined (quantize.distributed)
    emit: Emit = null_emit,
) -> KvResult:
    """The per-layer KV report for any model the tool reads; with ``out``, a new checkpoint that
    the target engine uses as intended (docs/kv-cache.md#what-calibrate-kv-writes):

    - MLA, ``target`` sglang/vllm: both engines cache the MLA row at unit scale and use no
      checkpoint scale, so no scale and no ``kv_cache_scheme`` is written; ``fold`` writes the
      exactly reparametrised model whose unit-scale cache sees a good e4m3 range.
    - ``target`` compressed-tensors (transformers): ``self_attn.k_scale``/``v_scale`` and
      ``kv_cache_scheme``.
    - GQA: K and V scales under the names the engines load, and ``kv_cache_scheme``.
    - GLM-5 DSA: the report only (the engines compute per-128 scales when they write the cache).

    ``base_model`` (the Hub repo the weights come from) is recorded in the new checkpoint's manifest
    (``options.base_model``) for its card.
    """
    # the order (docs/hostile-input.md#fail-fast): options, config.json, the calibration data and
    # tokenizer, the layer classes against the headers; only then a weight is read or OUT opened
    model = Path(model)  # the options were checked where they are declared (quantize/options.py)
    check_nproc(nproc)  # a library call starts no ranks: it runs in those it is called from
    world = distributed.current()
    device = _device(device, world)
    # config.json (routing included) and the safetensors headers
    streamer = LayerStreamer(model, expert_budget=int(memory_budget_gib * (1 << 30)))
    streamer.device = device
    if world.size > 1:  # the samples split across ranks (_observe); rank 0 does the rest
        if not world.is_writer:
            try:
                return distributed.follow(world, {"measure": lambda job: _observe(
                    streamer, job["ids"], job["clip"], job["error_samples"], null_emit, world)})
            finally:
                streamer.close()
        result = _calibrate(streamer, model, out, data, samples, seq_len, target, clip, stats_out, stats, chat_template,
                            error_samples, fold, fold_headroom, overwrite, base_model, emit)
        world.broadcast(("done", result), "the end of the run")
        return result
    return _calibrate(streamer, model, out, data, samples, seq_len, target, clip, stats_out, stats, chat_template,
                      error_samples, fold, fold_headroom, overwrite, base_model, emit)


def _device(device: str, world) -> str:
    """``--device``: cpu, or a CUDA device that is there (several ranks under NCCL: each rank's own)."""
    if device == "cpu":
        return device
    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise QuantizeError(f"--device {device}: no CUDA device is available here; use --device cpu (the default)")
    return world.device if world.backend == "nccl" else device


def _calibrate(streamer, model, out, data, samples, seq_len, target, clip, stats_out, stats, chat_template,
               error_samples, fold, fold_headroom, overwrite, base_model, emit) -> KvResult:
    layout = streamer.arch.layout
    fp = _fingerprint(streamer)
    mode = _mode(model, layout, target, fold, out is not None)
    if stats_out is not None:  # before the long measurement: never inside an input, never over a foreign file
        report_target(stats_out, STATS_KIND, [model, stats, data], what="--stats-out")
    output = None
    loaded = _load_stats(Path(stats), fp, streamer) if stats is not None else None
    if mode == "fold" and loaded is not None and any(r.q_absorbed_amax is None for r in loaded[0]):
        raise QuantizeError(
            f"{stats}: written before query statistics were recorded; --fold needs them, recompute the stats with "
            "--stats-out"
        )
    if mode == "scales":
        _check_writable_config(model, streamer)  # before the long measurement
    batch = build_samples(model, data, samples, seq_len, chat_template) if loaded is None else None
    streamer.check_layers()  # on the meta device, from the headers: no tensor data read
    if batch is not None:
        streamer.check_ids(batch.ids)
    if mode is not None:
        carried = side_files(model, CARRIED) + [model / f for f in streamer.index.files]
        output = Output.open(
            out,
            "calibrate-kv",
            [model] + ([Path(stats)] if stats else []) + ([Path(data)] if data and Path(data).exists() else []),
            overwrite=overwrite,
        )
    try:
        if loaded is not None:
            reports, meta = loaded
        else:
            reports, meta = _measure(streamer, batch, clip, error_samples, emit)
        result = _finish(
            model,
            output,
            carried if output else [],
            streamer,
            reports,
            meta,
            fp,
            target,
            layout,
            clip,
            stats_out,
            mode,
            fold_headroom,
            {"base_model": base_model} if base_model is not None else {},
        )
    finally:
        streamer.close()
        if output is not None:
            output.close()
    emit({"event": "done", "written": len(result.written)})
    return result


def _mode(model: Path, layout: AttentionLayout, target: str, fold: bool, writing: bool) -> str | None:
    """What an ``--out`` checkpoint holds: "scales", "fold", or None (report only); bad
    combinations refused in one line before anything is measured."""
    if fold:
        if layout.fold_refusal:
            raise QuantizeError(f"{model}: --fold does not apply: {layout.fold_refusal}")
        if target == "compressed-tensors":
            raise QuantizeError(
                "--fold with --target compressed-tensors: transformers applies the calibrated k_scale itself; "
                "fold for the engines (--target sglang or vllm), or drop --fold"
            )
        if not writing:
            raise QuantizeError("--fold writes a new checkpoint: pass --out")
        return "fold"
    if not writing:
        return None
    if not layout.applies_scales(target):
        raise QuantizeError(layout.write_refusal(str(model), target))
    return "scales"


def _finish(
    model, output, carried, streamer, reports, meta, fp, target, layout, clip, stats_out, mode, headroom, recorded
) -> "KvResult":
    if len(reports) != streamer.num_layers:
        raise QuantizeError(
            f"{model}: calibration produced {len(reports)} layer reports for {streamer.num_layers} layers; rerun"
        )
    for r in reports:
        _risk(r, layout)
    result = _verdict(str(model), target, layout, reports, meta)
    if layout.folds:
        factors = _fold_factors(streamer, layout, reports, headroom)
        result.fold = [f.to_dict() for f in factors]
        if mode != "fold":
            moves = [
                f"layer {f.layer}: latent x{f.latent:g}, rope x{f.rope:g}"
                for f in factors
                if (f.latent, f.rope) != (1.0, 1.0)
            ]
            result.verdict += (
                f" --fold (headroom {headroom:g}) would scale the cached row by powers of two: "
                + ("; ".join(moves[:4]) + ("; ..." if len(moves) > 4 else "") if moves else "nothing to move")
                + "."
            )
    if stats_out is not None:
        doc = {
            "version": STATS_VERSION,
            "model": str(model),
            "fingerprint": fp,
            "layout": layout.name,
            "clip": clip,
            **meta,
            # what the engines do with this cache, as this run judged it (what `quantize card --eval` shows)
            "target": target,
            "verdict": result.verdict,
            "unit_scale_safe": result.unit_scale_safe,
            "engine_scale": result.engine_scale,
            "layers": [r.__dict__ for r in reports],
        }
        write_report(stats_out, doc, STATS_KIND, [model], what="--stats-out")  # the other inputs: checked first
        result.stats_path = str(stats_out)
    if output is None:
        return result
    if mode == "fold":
        result.written = _write_folded(model, output, carried, streamer, reports, headroom, result, recorded)
    else:
        result.written = _write_checkpoint(
            model, output, carried, streamer, reports, target, layout, result, recorded
        )
    result.out = str(output.path)
    return result


def _measure(streamer, batch, clip, error_samples, emit):
    tokens = sum(int(x.numel()) for x in batch.ids)
    world = distributed.current()
    if world.size > 1:  # the other ranks observe their samples (calibrate_kv's loop)
        world.broadcast(("measure", {"ids": batch.ids, "clip": clip, "error_samples": error_samples}),
                        "the KV measurement")
    reports = _observe(streamer, batch.ids, clip, error_samples, emit, world)
    return reports, {
        "samples": len(batch.ids),
        "tokens": tokens,
        "dropped_short": batch.dropped_short,
        "data": batch.source,
    }


def _observe(streamer, ids: list, clip, error_samples, emit, world) -> list[LayerReport]:
    """Every layer's report from the samples ``ids``. Several ranks: each streams its own samples
    (``World.samples``) through every layer, its routed experts included (no exchange: a sample's
    output depends on that sample alone); per layer the histograms (integer counts and maxima) and
    the query maxima are merged on rank 0, which makes the report and sends it to the others for
    the calibrated error pass, whose per-sample sums rank 0 adds in sample order. The reports are
    one process's at the same torch threads per process. Returns them on rank 0 (else [])."""
    layout, rope_dim = streamer.arch.layout, int(streamer.text.get("qk_rope_head_dim", 0) or 0)
    split = world.size > 1
    own = world.samples(len(ids)) if split else range(len(ids))
    n_err = max(0, min(own.stop, error_samples) - own.start)  # this rank's of the first error_samples samples
    reports: list[LayerReport] = []
    obs: dict[int, LayerObs] = {}
    handles: list = []

    def before(i, layer):
        obs[i] = LayerObs()
        tap = layout.latent_module(layer.self_attn)  # DSA hands the cache expanded K/V: the latent is observed here
        if tap is not None:
            handles.append(tap.register_forward_hook(_latent_hook(layout, obs[i], None)))
        return list(handles)  # removed by the stream before a MoE layer's replay pass, so each sample counts once

    def after(i, layer, inputs):
        while handles:
            handles.pop().remove()
        seen = obs.pop(i)
        rep = None
        if split:
            got = world.gather(seen, f"layer {i} KV statistics", to=0)
            if got is not None:
                for other in got[1:]:
                    seen.merge(other)
        if world.is_writer:
            rep = _report_layer(i, seen, layout, clip)
        if split:
            rep = world.broadcast(rep, f"layer {i} KV report")
        _attn_error(streamer, layer, inputs[:n_err], layout, rope_dim, rep, world if split else None, i)
        if layout.absorbed_query:
            _query_amax(streamer, layer, inputs, rep)
            if split:
                got = world.gather((rep.q_absorbed_amax, rep.q_pe_amax), f"layer {i} query maxima", to=0)
                if got is not None:
                    rep.q_absorbed_amax, rep.q_pe_amax = max(q for q, _ in got), max(p for _, p in got)
        reports.append(rep)
        emit({"event": "tensor", "name": f"layer {i}", "done_bytes": i + 1})

    emit({"event": "start", "stage": "calibrate-kv", "total_bytes": streamer.num_layers, "done_bytes": 0,
          "unit": "layers"})
    for _ in streamer.stream(
        [ids[s] for s in own], cache_for=lambda i: ObservingCache(layout, obs[i], rope_dim), before=before,
        after=after,
    ):
        pass
    return reports if world.is_writer else []


def _load_stats(path: Path, fp: str, streamer) -> tuple[list[LayerReport], dict]:
    doc = load_json(path, "calibrate-kv stats file", kind="report")
    try:
        layers = [LayerReport(**x) for x in doc["layers"]]
        bad = next((f"layer {r.layer} {k}" for r in layers for k, v in r.__dict__.items()
                    if k not in ("at_risk", "why") and v is not None
                    and (type(v) not in (int, float) or not math.isfinite(v))), None)
        if bad or any(type(r.at_risk) is not bool or type(r.why) is not str for r in layers):
            raise TypeError(bad)
    except (KeyError, TypeError) as e:
        raise QuantizeError(
            f"{path}: not a calibrate-kv stats file (needs 'layers' with per-layer amax and scale); recompute it with "
            "--stats-out"
        ) from e
    if doc.get("fingerprint") != fp or len(layers) != streamer.num_layers:
        raise QuantizeError(
            f"{path}: stats were computed for another model ({doc.get('model')}, {len(layers)} layers); recompute "
            "them for this one"
        )
    return layers, {k: doc.get(k) for k in ("samples", "tokens", "dropped_short", "data")}


def _verdict(model: str, target: str, layout: AttentionLayout, reports: list[LayerReport], meta: dict) -> KvResult:
    verdict, safe = layout.verdict(target, reports)
    return KvResult(
        model,
        None,
        target,
        layout.name,
        reports,
        meta.get("samples") or 0,
        meta.get("tokens") or 0,
        meta.get("dropped_short") or 0,
        safe,
        verdict,
        [],
        engine_scale=layout.engine_scale(target),
    )


def _scale_tensors(
    streamer, reports: list[LayerReport], target: str, layout: AttentionLayout
) -> dict[str, torch.Tensor]:
    """The scales ``target`` applies for this layout (``layout.scale_tensors``: ``self_attn.k_scale`` /
    ``self_attn.v_scale`` per layer, MLA's one scale covering the whole row) as fp32 scalars."""
    return {
        name: torch.tensor(v, dtype=torch.float32)
        for name, v in layout.scale_tensors(streamer.arch.prefix, reports, target).items()
    }


def _fold_factors(streamer, layout: AttentionLayout, reports: list[LayerReport], headroom: float) -> list[FoldFactors]:
    out = []
    for r in reports:
        n = layout.fold_tensors(streamer.arch.prefix, r.layer, streamer.text)
        f = FoldFactors(
            r.layer,
            latent_amax_before=r.amax_latent or 0.0,
            rope_amax_before=r.amax_rope or 0.0,
            q_absorbed_amax_before=r.q_absorbed_amax,
            q_pe_amax_before=r.q_pe_amax,
        )
        f.latent, note = folding.choose_factor(f.latent_amax_before, r.q_absorbed_amax, headroom, "latent")
        f.notes += [note] if note else []
        blocker = folding.rope_fold_blocker(streamer.reader, n)
        if blocker:
            f.notes.append(f"rope: not folded, {blocker}")
        else:
            f.rope, note = folding.choose_factor(f.rope_amax_before, r.q_pe_amax, headroom, "rope")
            f.notes += [note] if note else []
        out.append(f)
    return out


def _write_folded(
    model: Path, output: Output, carried: list[Path], streamer, reports, headroom: float, result, recorded: dict
) -> list[str]:
    """The folded model: shards holding a changed tensor are rewritten (unchanged tensors copied
    byte for byte, streamed), the others hard-linked; config and index as the source's (no scale,
    no kv_cache_scheme); a fresh manifest with the factors and the changed tensors."""
    out, index, reader = output.path, streamer.index, streamer.reader
    changed: dict[str, torch.Tensor] = {}
    factors = [
        FoldFactors(**{k: v for k, v in d.items() if k in FoldFactors.__dataclass_fields__}) for d in result.fold
    ]
    for f in factors:
        try:
            names = streamer.arch.layout.fold_tensors(streamer.arch.prefix, f.layer, streamer.text)
            changed.update(folding.fold_changes(reader, names, f.latent, f.rope))
        except ValueError as e:
            raise QuantizeError(f"{model}: layer {f.layer} cannot be folded exactly ({e})") from e
    by_file: dict[str, list] = {}
    for ref in index.tensors.values():
        by_file.setdefault(ref.file, []).append(ref)
    weights = {model / f for f in index.files}
    output.copy_side_files([p for p in carried if p not in weights] + [model / "config.json"])
    output.copy_side_files(
        [model / f for f in index.files if not any(r.name in changed for r in by_file[f])], link=True
    )
    fds: dict = {}
    try:
        for fname in index.files:
            refs = sorted(by_file[fname], key=lambda r: r.start)
            if not any(r.name in changed for r in refs):
                continue
            header, _ = read_header(model / fname)
            w = StreamWriter(out / fname, [Entry(r.name, r.dtype, r.shape) for r in refs], header.get("__metadata__"))
            try:
                for r in refs:
                    if r.name in changed:
                        w.write_tensor(r.name, changed[r.name])
                    else:
                        w.copy_bytes(r.name, cached_fd(fds, model / fname), r.start, r.nbytes)
                output.mark_done(fname, w.finish(), w.bytes_written)
            except BaseException:
                w.abort()
                raise
    finally:
        for fd in fds.values():
            os.close(fd)
    if (model / INDEX_NAME).exists():
        output.copy_side_files([model / INDEX_NAME])
    output.complete()
    write_manifest(
        output,
        {
            "kind": "calibrate-kv",
            "mode": "fold",
            "tool": tool_versions(),
            "source": {"path": str(model.resolve()), "revision": hub_revision(model), **derived_from(model)},
            "target": result.target,
            "layout": result.layout,
            "fold_headroom": headroom,
            "options": recorded,
            "fold": result.fold,
            "changed_tensors": sorted(changed),
            "report": {k: v for k, v in result.to_dict().items() if k not in ("written", "out", "fold")},
        },
    )
    return sorted(changed)


def _check_writable_config(model: Path, streamer) -> None:
    cfg = streamer.index.config
    qc = cfg.get("quantization_config")
    if qc and qc.get("quant_method") != "compressed-tensors":
        raise QuantizeError(
            f"{model / 'config.json'}: quant_method {qc.get('quant_method')!r}; kv_cache_scheme is a "
            "compressed-tensors field, so calibrate a BF16 or `quantize convert` output"
        )
    if not qc and int(streamer.text.get("n_routed_experts", 0) or 0):
        raise QuantizeError(
            f"{model / 'config.json'}: a BF16 mixture-of-experts model has no compressed-tensors weight scheme to "
            "attach "
            f"kv_cache_scheme to (transformers' loader needs one for MoE); run `quantize convert` first and calibrate "
            "its output"
        )


def _write_checkpoint(
    model: Path,
    output: Output,
    carried: list[Path],
    streamer,
    reports,
    target: str,
    layout: AttentionLayout,
    result,
    recorded: dict,
) -> list[str]:
    """The model's weights (hard-linked where possible: shared, never modified), its side files,
    the scales in ``kv_scales.safetensors``, index and config with ``kv_cache_scheme``, and a
    fresh manifest covering every file (the source's manifest is not carried: its hashes would
    not cover the new config and scales)."""
    out = output.path
    cfg = load_json(model / "config.json", "config.json")
    qc = cfg.get("quantization_config")
    weights = {model / f for f in streamer.index.files}
    output.copy_side_files([p for p in carried if p not in weights])
    output.copy_side_files([p for p in carried if p in weights], link=True)
    tensors = _scale_tensors(streamer, reports, target, layout)
    tmp = out / ("kv_scales.safetensors" + TMP_SUFFIX)
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / "kv_scales.safetensors")
    except OSError as e:
        raise QuantizeError(
            f"{out / 'kv_scales.safetensors'}: cannot write ({e.strerror}); free space or choose another OUT"
        ) from e
    idx = {
        "metadata": dict(streamer.index.index_metadata),
        "weight_map": {n: r.file for n, r in streamer.index.tensors.items()},
    }
    idx["weight_map"].update({k: "kv_scales.safetensors" for k in tensors})
    output.write_json(INDEX_NAME, idx, sort_keys=False, indent=2)
    qc = (
        dict(qc)
        if qc
        else {
            "config_groups": {},
            "format": "dense",
            "ignore": [],
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "version": "0.19.0",
        }
    )
    qc["kv_cache_scheme"] = kv_cache_scheme()
    cfg["quantization_config"] = qc
    output.write_json("config.json", cfg, indent=2)
    output.complete()
    write_manifest(
        output,
        {
            "kind": "calibrate-kv",
            "tool": tool_versions(),
            "source": {"path": str(model.resolve()), "revision": hub_revision(model), **derived_from(model)},
            "target": target,
            "layout": layout.name,
            "kv_cache_scheme": qc["kv_cache_scheme"],
            "options": recorded,
            "report": {k: v for k, v in result.to_dict().items() if k not in ("written", "out")},
            "scales": sorted(tensors),
        },
    )
    return sorted(tensors)
