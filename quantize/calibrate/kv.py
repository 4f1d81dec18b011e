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
output when the cached row goes through e4m3, against BF16. Scales are written under the names the
target loads (../shared/FORMATS.md §3, §9) into a new checkpoint with ``kv_cache_scheme``.
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
from safetensors.torch import save_file

from compressed_tensors.quantization import QuantizationArgs

from ..checkpoint.index import INDEX_NAME
from ..checkpoint.writer import atomic_write_text
from ..errors import QuantizeError
from ..events import Emit, null_emit
from .data import build_samples, validate_sample_options
from .runner import LayerStreamer

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E4M3_ZERO_BELOW = 2.0**-10  # half the smallest subnormal (2^-9): rounds to zero
TARGETS = ("sglang", "vllm", "compressed-tensors")
KV_CACHE_SCHEME = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False).model_dump(mode="json")
STATS_VERSION = 1


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
        self.counts += torch.bincount(idx, minlength=self.nbins).double()

    def _edge(self, t: float) -> float:
        return (math.log2(t) - self.LO) * self.BPO if t > 0 else -1.0

    def frac_above(self, t: float) -> float:
        if t >= self.amax:
            return 0.0  # exact: nothing lies above the observed maximum
        e = self._edge(t)
        i = int(math.floor(e))
        if i >= self.nbins:
            return 0.0
        tot = float(self.counts[i + 1:].sum()) + float(self.counts[i]) * (1 - (e - i)) if i >= 0 else float(self.counts.sum())
        return tot / max(self.n, 1)

    def frac_below(self, t: float) -> float:
        """Fraction of NONZERO values below t (they lose precision or vanish in e4m3)."""
        e = self._edge(t)
        i = int(math.floor(e))
        if i < 0:
            return 0.0
        tot = float(self.counts[:min(i, self.nbins)].sum()) + (float(self.counts[i]) * (e - i) if i < self.nbins else 0.0)
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

    def __init__(self, layout: str, obs: LayerObs | None, rope_dim: int, mode: str | None = None,
                 scales: tuple[float, float] = (1.0, 1.0)):
        self.layout, self.obs, self.rope_dim, self.mode, self.scales = layout, obs, rope_dim, mode, scales

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.layout == "mla":  # k = kv_c_normed [.., 512], v = post-RoPE k_pe [.., 64]: one cached row
            if self.obs is not None:
                self.obs.latent.add(k)
                self.obs.rope.add(v)
                self.obs.row.add(k)
                self.obs.row.add(v)
            if self.mode in ("unit", "calibrated"):
                s = self.scales[0] if self.mode == "calibrated" else 1.0
                return fake_e4m3(k, s), fake_e4m3(v, s)
            return k, v
        if self.layout == "dsa":  # expanded per-head K; its rope part is the cached k_pe (same in every head)
            if self.obs is not None:
                rope = k[:, :1, :, -self.rope_dim:]
                self.obs.rope.add(rope)
                self.obs.row.add(rope)
            return k, v
        if self.obs is not None:  # gqa
            self.obs.k.add(k)
            self.obs.v.add(v)
        if self.mode in ("unit", "calibrated"):
            ks, vs = self.scales if self.mode == "calibrated" else (1.0, 1.0)
            return fake_e4m3(k, ks), fake_e4m3(v, vs)
        return k, v

    def update_indexer(self, k: torch.Tensor, layer_idx: int, *args, **kwargs):
        return k


def _latent_hook(obs: LayerObs | None, mode: str | None):
    """DSA: kv_c_normed is not handed to the cache; observe (and for "tiles", round) it here."""

    def hook(module, inputs, output):
        if obs is not None:
            obs.latent.add(output)
            obs.row.add(output)
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
    at_risk: bool = False
    why: str = ""


def _fingerprint(streamer: LayerStreamer) -> str:
    keys = ("model_type", "num_hidden_layers", "hidden_size", "kv_lora_rank", "qk_rope_head_dim", "num_key_value_heads",
            "head_dim", "num_attention_heads", "vocab_size")
    sig = {k: streamer.text.get(k) for k in keys}
    sig["architecture"] = streamer.arch.name
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:16]


def _report_layer(i: int, obs: LayerObs, layout: str, clip: float | None) -> LayerReport:
    h = obs.row if layout in ("mla", "dsa") else obs.k
    thresh = h.quantile(clip) if clip else h.amax
    scale = max(thresh, 1e-30) / E4M3_MAX
    r = LayerReport(
        layer=i, amax=h.amax, scale=scale, percentile=h.quantile(0.999),
        overflow_unit=h.frac_above(E4M3_MAX), subnormal_unit=h.frac_below(E4M3_MIN_NORMAL), zero_unit=h.frac_below(E4M3_ZERO_BELOW),
        overflow_calibrated=h.frac_above(E4M3_MAX * scale), subnormal_calibrated=h.frac_below(E4M3_MIN_NORMAL * scale),
        zero_calibrated=h.frac_below(E4M3_ZERO_BELOW * scale),
    )
    if layout in ("mla", "dsa"):
        r.amax_latent, r.amax_rope = obs.latent.amax, obs.rope.amax
    else:
        r.k_amax, r.v_amax = obs.k.amax, obs.v.amax
        r.k_scale = (obs.k.quantile(clip) if clip else obs.k.amax) / E4M3_MAX
        r.v_scale = (obs.v.quantile(clip) if clip else obs.v.amax) / E4M3_MAX
    return r


def _attn_error(streamer: LayerStreamer, layer, inputs: list[torch.Tensor], layout: str, rope_dim: int, rep: LayerReport) -> None:
    """Relative error of the attention output with the cached row through e4m3, against BF16."""
    attn = layer.self_attn
    norm = layer.input_layernorm

    def run(mode: str | None, scales=(1.0, 1.0)) -> list[torch.Tensor]:
        outs = []
        handle = attn.kv_a_layernorm.register_forward_hook(_latent_hook(None, mode)) if layout == "dsa" else None
        try:
            for h in inputs:
                pos, pe, mask = streamer._context(h)
                kw = {"prev_topk_indices": None} if streamer.arch.hf.get("topk") else {}
                with torch.no_grad():
                    out = attn(hidden_states=norm(h), position_embeddings=pe, attention_mask=mask, position_ids=pos,
                               past_key_values=ObservingCache(layout, None, rope_dim, mode, scales), **kw)
                outs.append(out[0] if isinstance(out, tuple) else out)
        finally:
            if handle is not None:
                handle.remove()
        return outs

    if layout == "dsa" and getattr(attn, "indexer", 1) is None:
        return  # a shared-index layer: its attention needs the previous layer's top-k
    ref = run(None)

    def err(outs):
        num = sum(float((o.float() - r.float()).pow(2).sum()) for o, r in zip(outs, ref))
        den = sum(float(r.float().pow(2).sum()) for r in ref)
        return (num / den) ** 0.5 if den else 0.0

    if layout == "dsa":
        rep.attn_rel_err_tiles = err(run("tiles"))
        return
    rep.attn_rel_err_unit = err(run("unit"))
    scales = (rep.scale, rep.scale) if layout == "mla" else (rep.k_scale, rep.v_scale)
    rep.attn_rel_err_calibrated = err(run("calibrated", scales))


def _risk(r: LayerReport, layout: str) -> None:
    why = []
    if r.overflow_unit > 0:
        why.append(f"{r.overflow_unit:.2e} of values exceed +-448 at unit scale")
    if r.subnormal_unit > 0.10:
        why.append(f"{r.subnormal_unit:.1%} fall below e4m3's normal range at unit scale")
    if (r.attn_rel_err_unit is not None and r.attn_rel_err_calibrated is not None
            and r.attn_rel_err_unit > 1.5 * r.attn_rel_err_calibrated and r.attn_rel_err_unit - r.attn_rel_err_calibrated > 0.01):
        why.append(f"attention error {r.attn_rel_err_unit:.3f} at unit scale vs {r.attn_rel_err_calibrated:.3f} calibrated")
    r.at_risk = bool(why) and layout != "dsa"
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

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def calibrate_kv(
    model: str | os.PathLike,
    out: str | os.PathLike | None = None,
    data: str | None = None,
    samples: int = 512,
    seq_len: int = 2048,
    target: str = "sglang",
    clip: float | None = None,
    stats_out: str | os.PathLike | None = None,
    stats: str | os.PathLike | None = None,
    chat_template: bool = False,
    error_samples: int = 8,
    overwrite: bool = False,
    emit: Emit = null_emit,
) -> KvResult:
    model = Path(model)
    validate_sample_options(samples, seq_len)
    if target not in TARGETS:
        raise QuantizeError(f"--target {target}: unknown; use one of {', '.join(TARGETS)}")
    if clip is not None and not 0.9 <= clip < 1.0:
        raise QuantizeError(f"--clip {clip}: a percentile between 0.9 and 1 (e.g. 0.9999), or leave it off for absmax")
    streamer = LayerStreamer(model)
    layout = streamer.arch.attention
    rope_dim = int(streamer.text.get("qk_rope_head_dim", 0) or 0)
    fp = _fingerprint(streamer)
    if out is not None and layout != "dsa":
        out = Path(out)
        if out.exists() and any(out.iterdir()) and not overwrite:
            raise QuantizeError(f"{out}: already exists; pass --overwrite or choose another folder")
        if out.resolve() == model.resolve():
            raise QuantizeError(f"{out}: is the model folder; the source is never modified, choose another OUT")
    elif layout != "dsa":
        raise QuantizeError("--out is required: scales are written into a new checkpoint")
    if stats is not None:
        reports, meta = _load_stats(Path(stats), fp, streamer)
    else:
        reports, meta = _measure(streamer, model, data, samples, seq_len, chat_template, clip, error_samples, layout, rope_dim, emit)
    streamer.close()
    for r in reports:
        _risk(r, layout)
    result = _verdict(str(model), target, layout, reports, meta)
    if stats_out is not None:
        doc = {"version": STATS_VERSION, "model": str(model), "fingerprint": fp, "layout": layout, "clip": clip, **meta,
               "layers": [r.__dict__ for r in reports]}
        atomic_write_text(Path(stats_out), json.dumps(doc, indent=1))
        result.stats_path = str(stats_out)
    if layout == "dsa":
        result.out = None
        return result
    result.written = _write_checkpoint(model, Path(out), streamer, reports, target, layout, overwrite)
    result.out = str(out)
    emit({"event": "done", "written": len(result.written)})
    return result


def _measure(streamer, model, data, samples, seq_len, chat_template, clip, error_samples, layout, rope_dim, emit):
    batch = build_samples(model, data, samples, seq_len, chat_template)
    tokens = sum(int(x.numel()) for x in batch.ids)
    emit({"event": "start", "stage": "calibrate-kv", "total_bytes": streamer.num_layers, "done_bytes": 0})
    reports: list[LayerReport] = []
    obs: dict[int, LayerObs] = {}
    handles: list = []

    def before(i, layer):
        obs[i] = LayerObs()
        if layout == "dsa":  # DSA hands the cache expanded K/V: the latent is observed on kv_a_layernorm
            handles.append(layer.self_attn.kv_a_layernorm.register_forward_hook(_latent_hook(obs[i], None)))

    def after(i, layer, inputs):
        while handles:
            handles.pop().remove()
        rep = _report_layer(i, obs.pop(i), layout, clip)
        _attn_error(streamer, layer, inputs[:error_samples], layout, rope_dim, rep)
        reports.append(rep)
        emit({"event": "tensor", "name": f"layer {i}", "done_bytes": i + 1})

    for _ in streamer.stream(batch.ids, cache_for=lambda i: ObservingCache(layout, obs[i], rope_dim), before=before, after=after):
        pass
    return reports, {"samples": len(batch.ids), "tokens": tokens, "dropped_short": batch.dropped_short, "data": batch.source}


def _load_stats(path: Path, fp: str, streamer) -> tuple[list[LayerReport], dict]:
    try:
        doc = json.loads(path.read_text())
        layers = [LayerReport(**x) for x in doc["layers"]]
    except FileNotFoundError as e:
        raise QuantizeError(f"{path}: no such stats file") from e
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise QuantizeError(f"{path}: not a calibrate-kv stats file (needs 'layers' with per-layer amax and scale); recompute it with --stats-out") from e
    if doc.get("fingerprint") != fp or len(layers) != streamer.num_layers:
        raise QuantizeError(f"{path}: stats were computed for another model ({doc.get('model')}, {len(layers)} layers); recompute them for this one")
    return layers, {k: doc.get(k) for k in ("samples", "tokens", "dropped_short", "data")}


def _verdict(model: str, target: str, layout: str, reports: list[LayerReport], meta: dict) -> KvResult:
    risky = [r.layer for r in reports if r.at_risk]
    if layout == "dsa":
        worst = max((r.attn_rel_err_tiles or 0.0) for r in reports)
        verdict = (f"GLM-5 DSA: engines write the FP8 cache with per-128 dynamic scales; no checkpoint scale is used or written. "
                   f"Worst attention-output error of that layout: {worst:.4f}.")
        safe = True
    elif risky:
        verdict = f"Unit scale is NOT safe for this model: layers {risky} are at risk ({reports[risky[0]].why}). Use the calibrated scales."
        safe = False
    else:
        verdict = ("Unit scale (what SGLang applies to the MLA cache today) is safe for this model: no layer overflows e4m3 and "
                   "the attention error stays close to the calibrated scale's." if layout == "mla" else
                   "Unit scale is safe for this model: no layer overflows e4m3.")
        safe = True
    return KvResult(model, None, target, layout, reports, meta.get("samples") or 0, meta.get("tokens") or 0,
                    meta.get("dropped_short") or 0, safe, verdict, [])


def _scale_tensors(streamer, reports: list[LayerReport], target: str, layout: str) -> dict[str, torch.Tensor]:
    out = {}
    p = streamer.arch.prefix
    for r in reports:
        base = f"{p}model.layers.{r.layer}.self_attn."
        ks, vs = (r.scale, r.scale) if layout == "mla" else (r.k_scale, r.v_scale)
        if layout == "mla" and target in ("sglang", "vllm"):
            # both engines remap the ModelOpt-style names onto their MLA attention; they drop self_attn.k_scale
            out[base + "k_proj.k_scale"] = torch.tensor(ks, dtype=torch.float32)
            out[base + "v_proj.v_scale"] = torch.tensor(vs, dtype=torch.float32)
        else:
            out[base + "k_scale"] = torch.tensor(ks, dtype=torch.float32)
            out[base + "v_scale"] = torch.tensor(vs, dtype=torch.float32)
    return out


def _write_checkpoint(model: Path, out: Path, streamer, reports, target: str, layout: str, overwrite: bool) -> list[str]:
    cfg = json.loads((model / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if qc and qc.get("quant_method") != "compressed-tensors":
        raise QuantizeError(f"{model / 'config.json'}: quant_method {qc.get('quant_method')!r}; kv_cache_scheme is a compressed-tensors field, so calibrate a BF16 or `quantize convert` output")
    if not qc and int(streamer.text.get("n_routed_experts", 0) or 0):
        raise QuantizeError(f"{model / 'config.json'}: a BF16 mixture-of-experts model has no compressed-tensors weight scheme to attach "
                            f"kv_cache_scheme to (transformers' loader needs one for MoE); run `quantize convert` first and calibrate its output")
    if out.exists() and overwrite:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    for p in sorted(model.iterdir()):
        if p.name in ("config.json", INDEX_NAME) or p.name.startswith("."):
            continue
        dst = out / p.name
        if p.is_dir():
            shutil.copytree(p, dst)
            continue
        try:
            os.link(p, dst)  # unchanged files are shared with the source, never modified
        except OSError:
            shutil.copy2(p, dst)
    tensors = _scale_tensors(streamer, reports, target, layout)
    save_file(tensors, str(out / "kv_scales.safetensors"), metadata={"format": "pt"})
    idx_path = model / INDEX_NAME
    if idx_path.exists():
        idx = json.loads(idx_path.read_text())
    else:
        from safetensors import safe_open

        idx = {"metadata": {}, "weight_map": {}}
        for f in sorted(model.glob("*.safetensors")):
            with safe_open(f, "pt") as fh:
                idx["weight_map"].update({k: f.name for k in fh.keys()})
    idx["weight_map"].update({k: "kv_scales.safetensors" for k in tensors})
    atomic_write_text(out / INDEX_NAME, json.dumps(idx, indent=2))
    qc = dict(qc) if qc else {"config_groups": {}, "format": "dense", "ignore": [], "quant_method": "compressed-tensors",
                              "quantization_status": "compressed", "version": "0.19.0"}
    qc["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    cfg["quantization_config"] = qc
    atomic_write_text(out / "config.json", json.dumps(cfg, indent=2, sort_keys=True))
    return sorted(tensors)
