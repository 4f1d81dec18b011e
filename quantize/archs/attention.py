"""Attention layouts: what the KV cache of each kind of attention holds per token and layer, and
everything the tool does that depends on it (docs/kv-cache.md, docs/engines.md#pd-disaggregation). The architecture
registry's ``attention`` name picks one (``LAYOUTS``); no stage outside this package branches on
the name.

- ``mla`` (DeepSeek-V3, Kimi K2.x): ONE row per token per layer, ``kv_c_normed`` (``kv_lora_rank``,
  after ``kv_a_layernorm``) followed by post-RoPE ``k_pe`` (``qk_rope_head_dim``), read as both K
  and V; transformers hands exactly that row to ``past_key_values.update``. SGLang and vLLM cache it
  at unit scale and load no checkpoint scale; transformers (compressed-tensors) applies one
  ``self_attn.k_scale`` to the whole row. ``--fold`` moves the row's range into the weights.
- ``dsa`` (GLM-5.x): the same row, but transformers hands the cache the expanded per-head K/V (the
  latent is observed on ``kv_a_layernorm``); the engines write the FP8 cache with per-128 dynamic
  scales, so no checkpoint scale is used or written.
- ``gqa`` (Llama, Qwen, Mistral, SmolLM2): K and V per head, post-RoPE, each at its own scale.

Nothing here imports the stages (calibrate/, evaluate/) or torch: the stages hand in what they
measured (histograms, reports, cache layers) and the numerics (an e4m3 store) they use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

# FP8 modes whose attention-output error calibrate-kv measures -> the report column naming it
ERROR_COLUMNS = {"unit": "attn err @1", "calibrated": "attn err @s", "tiles": "attn err per-128"}
REPORT_COLUMNS = ["layer", "amax", "p99.9", "scale", "overflow@1", "subnormal@1", "zero@1", "overflow@s", "subnormal@s"]


@dataclass(frozen=True)
class MlaNames:
    """The tensors one MLA layer's fold touches, and the head layout of the query projection."""

    norm: str  # kv_a_layernorm.weight
    kv_a: str  # kv_a_proj_with_mqa.weight (rope rows at the end)
    kv_b: str  # kv_b_proj.weight
    q: str  # q_b_proj.weight or q_proj.weight
    kv_lora_rank: int
    rope: int
    nope: int
    heads: int

    def rope_rows_kv_a(self) -> list[int]:
        """Rows of ``kv_a_proj_with_mqa`` that make the cached ``k_pe`` (after the latent's)."""
        return list(range(self.kv_lora_rank, self.kv_lora_rank + self.rope))

    def rope_rows_q(self) -> list[int]:
        """Each head's rope rows of the query projection (``nope`` then ``rope`` per head)."""
        stride = self.nope + self.rope
        return [h * stride + self.nope + j for h in range(self.heads) for j in range(self.rope)]


class PromptStore(Protocol):
    """What the PD check hands a layout to store one layer of the prompt's cache as the decode
    pool stores it (evaluate/pd.py makes it)."""

    fp8: bool  # the decode pool's cache is fp8_e4m3 (else bf16)
    e4m3: Callable  # x -> x through e4m3 at unit scale (or ``e4m3(x, scale)``)
    tiles: Callable  # x -> x through e4m3 with one dynamic scale per 128 values
    bf16: Callable  # x -> x through BF16

    def latent(self, layer: int) -> tuple[Any, Any]: ...  # (kv_c_normed, k_pe) the prefill model expanded

    def expand(self, layer: int, latent: Any, k_pe: Any) -> tuple[Any, Any]: ...  # by the decode model's kv_b_proj

    def scale(self, layer: int, name: str) -> float: ...  # the decode model's loaded k_scale/v_scale, else 1


class AttentionLayout:
    """One kind of attention cache. Attributes are facts; methods take what the stages measured."""

    name: str = ""  # the registry's ``attention`` value, as reports record it
    latent: bool = False  # the MLA family's compressed latent row (else K and V per head)
    # calibrate-kv: the histogram the layer scale is measured on, LayerReport field -> histogram
    # whose amax it records, field -> histogram its own scale is measured on
    scaled: str = "row"
    amax_fields: dict[str, str] = {}
    scale_fields: dict[str, str] = {}
    error_modes: tuple[str, ...] = ("unit", "calibrated")  # in the order they are measured
    static_scale: bool = True  # the engines cache at one static scale, so a layer can be at risk
    absorbed_query: bool = False  # the report records the absorbed query's range (MLA)
    fold_refusal: str | None = "it does not apply to this layout"  # why --fold does not apply; None: it does
    fold_columns: tuple[str, ...] = ()
    # the PD check: how it reports the prompt cache it stored, and what it rounds in words
    pd_name: str = ""
    pd_stored: str = ""

    def __repr__(self) -> str:
        return f"<attention layout {self.name}>"

    # -- the cache ---------------------------------------------------------------------------------
    def cache_bytes(self, cfg: dict, tp: int) -> dict[str, float]:
        """Bytes per token per layer on one TP rank: {"bf16": .., "fp8": ..} (kvcache.capacity)."""
        raise NotImplementedError

    # -- calibrate-kv: observing the cache -------------------------------------------------------------
    def observed(self, k, v, rope_dim: int) -> list[tuple[str, Any]]:
        """(histogram, tensor) pairs for what the attention hands ``past_key_values.update``."""
        raise NotImplementedError

    def latent_module(self, attn):
        """The module whose output is the cached latent when the cache does not see it, else None."""
        return None

    def observed_latent(self, output) -> list[tuple[str, Any]]:
        """(histogram, tensor) pairs for that module's output."""
        return []

    def cache_scales(self, mode: str | None, scales: tuple[float, float]) -> tuple[float, float] | None:
        """(K, V) scales the cache itself goes through e4m3 at under ``mode``, or None (kept as is)."""
        if mode == "calibrated":
            return tuple(scales)
        return (1.0, 1.0) if mode == "unit" else None

    def calibrated_scales(self, r) -> tuple[float, float]:
        """(K, V) scales of one LayerReport."""
        raise NotImplementedError

    def skips_error(self, attn) -> bool:
        """True where the attention-output error cannot be measured on this layer alone."""
        return False

    # -- calibrate-kv: what the engines apply and what is written ------------------------------------------
    def engine_scale(self, target: str) -> str:
        """What ``target`` does with this layout's cache scale, in words ("" when it uses the checkpoint's)."""
        return ""

    def applies_scales(self, target: str) -> bool:
        """``target`` reads the checkpoint's ``self_attn.k_scale``/``v_scale`` for this layout."""
        return True

    def write_refusal(self, model: str, target: str) -> str | None:
        """Why ``--out`` (without ``--fold``) has nothing to write for ``target``, or None."""
        return None

    @property
    def folds(self) -> bool:
        return self.fold_refusal is None

    def writes(self, target: str, fold: bool) -> str | None:
        """What calibrate-kv writes for these options: "fold", "scales" or None (the report only;
        also where calibrate-kv refuses the options)."""
        if fold:
            return "fold" if self.folds and target != "compressed-tensors" else None
        return "scales" if self.applies_scales(target) else None

    def scale_tensors(self, prefix: str, reports, target: str) -> dict[str, float]:
        """Checkpoint name -> value of each scale ``target`` applies, per layer. What reads them:
        transformers (compressed-tensors' kv_cache_scheme: the attention module's own
        parameters); SGLang 0.5.23 for GQA models remaps ``.self_attn.k_scale`` to
        ``.self_attn.attn.k_scale`` (``model_loader/weight_utils.py`` ``maybe_remap_kv_scale_name``;
        llama.py calls it); vLLM likewise (checked by running its CPU build, tests/test_engine.py)."""
        if not self.applies_scales(target):
            return {}
        out = {}
        for r in reports:
            base = f"{prefix}model.layers.{r.layer}.self_attn."
            ks, vs = self.calibrated_scales(r)
            out[base + "k_scale"] = ks
            out[base + "v_scale"] = vs
        return out

    def verdict(self, target: str, reports) -> tuple[str, bool]:
        """(the report's verdict in words, whether unit scale is safe)."""
        risky = [r.layer for r in reports if r.at_risk]
        if risky:
            return (f"Unit scale is NOT safe for this model: layers {risky} are at risk ({reports[risky[0]].why}). "
                    f"Use the calibrated scales."), False
        return "Unit scale is safe for this model: no layer overflows e4m3.", True

    # -- calibrate-kv: the table -------------------------------------------------------------------------
    def report_columns(self, fold: bool) -> list[str]:
        """Column names of the calibrate-kv table (``fold``: the report has fold rows)."""
        return (REPORT_COLUMNS + [ERROR_COLUMNS[m] for m in self.error_modes]
                + (list(self.fold_columns) if fold else []) + ["risk"])

    def report_cells(self, r, fold_row: dict | None = None) -> list[str]:
        """One LayerReport's cells (``fold_row``: its entry of the report's ``fold``)."""
        row = [str(r.layer), f"{r.amax:.4g}", f"{r.percentile:.4g}", f"{r.scale:.4g}", f"{r.overflow_unit:.1e}",
               f"{r.subnormal_unit:.2%}", f"{r.zero_unit:.2%}", f"{r.overflow_calibrated:.1e}",
               f"{r.subnormal_calibrated:.2%}"]
        row += [_cell(getattr(r, f"attn_rel_err_{m}"), ".4f") for m in self.error_modes]
        if fold_row is not None:
            row += self.fold_cells(fold_row)
        return row + ["[red]yes[/]" if r.at_risk else "no"]

    def fold_cells(self, f: dict) -> list[str]:
        return []

    # -- --fold ------------------------------------------------------------------------------------------
    def fold_tensors(self, prefix: str, layer: int, text: dict) -> MlaNames:
        """The tensors one layer's fold scales, and where the rope part lies in them."""
        raise NotImplementedError(f"{self.name}: {self.fold_refusal}")

    # -- the PD check --------------------------------------------------------------------------------------
    def holds(self, rank: int | None, first_layer, modules: dict) -> bool:
        """Whether a transformers prompt cache (its first layer; ``rank``: the config's
        kv_lora_rank; ``modules``: layer -> attention module) is of this layout."""
        raise NotImplementedError

    def store_prompt_layer(self, layer, i: int, store: PromptStore) -> None:
        """Round one layer of a copied prompt cache (in place) as the decode pool stores it."""
        raise NotImplementedError


def _cell(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


class _LatentRow(AttentionLayout):
    """The MLA family's row: latent then rope, one scale for the whole row."""

    latent = True
    scaled = "row"
    amax_fields = {"amax_latent": "latent", "amax_rope": "rope"}

    def calibrated_scales(self, r) -> tuple[float, float]:
        return r.scale, r.scale


class Mla(_LatentRow):
    name = "mla"
    absorbed_query = True
    fold_refusal = None
    fold_columns = ("fold latent", "fold rope", "|q_abs| after", "|q_pe| after")
    pd_name = "mla-latent"
    pd_stored = ("the MLA latent (kv_a_layernorm(c)) and post-RoPE k_pe, as transformers and the engines cache them; "
                 "{kv} at unit scale")
    ENGINE = {
        "sglang": ("SGLang writes the MLA cache without a scale (mem_cache/memory_pool.py) and its fa3 backend, the "
                   "H200 default, ignores k_scale for 576-wide rows (FlashMLA would mis-apply it), and kv_cache_scheme "
                   "in config.json would silently switch its cache to FP8."),
        "vllm": ("vLLM's compressed-tensors path attaches no KV-cache scales to MLAAttention, so MLA runs at unit "
                 "scale (\"k_scale is not loaded\")."),
    }

    def cache_bytes(self, cfg: dict, tp: int) -> dict[str, float]:
        # kv_lora_rank + qk_rope_head_dim (512 + 64 = 576) values, replicated on every TP rank (the latent is
        # not split by heads); FP8: one byte per value (the per-tensor scale is negligible)
        row = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
        return {"bf16": row * 2, "fp8": row}

    def observed(self, k, v, rope_dim: int) -> list[tuple[str, Any]]:
        # k = kv_c_normed [.., 512], v = post-RoPE k_pe [.., 64]: one cached row
        return [("latent", k), ("rope", v), ("row", k), ("row", v)]

    def cache_scales(self, mode, scales):
        if mode == "calibrated":
            return scales[0], scales[0]  # one scale for the whole row
        return (1.0, 1.0) if mode == "unit" else None

    def engine_scale(self, target: str) -> str:
        return self.ENGINE.get(target, "")

    def applies_scales(self, target: str) -> bool:
        return target not in self.ENGINE

    def write_refusal(self, model: str, target: str) -> str | None:
        if target not in self.ENGINE:
            return None
        return (f"--target {target}: {self.ENGINE[target]} So there is no scale to write; drop --out for the report, "
                f"add --fold to write a model whose unit-scale cache is in range, or --target compressed-tensors for "
                f"transformers")

    def verdict(self, target: str, reports) -> tuple[str, bool]:
        risky = [r.layer for r in reports if r.at_risk]
        engine = self.ENGINE.get(target, "transformers applies the calibrated self_attn.k_scale "
                                         "(compressed-tensors' kv_cache_scheme).")
        if target in self.ENGINE:
            head = f"{target}: the MLA cache is e4m3 at UNIT scale, whatever the checkpoint holds ({engine})"
        else:
            head = f"compressed-tensors: {engine}"
        if risky:
            return (f"{head} Unit scale is NOT safe: layers {risky} are at risk ({reports[risky[0]].why}); "
                    f"use --fold so the unit-scale cache sees a good range."), False
        return (f"{head} Unit scale is safe for this model: no layer overflows e4m3 or loses >10% of its values below "
                f"the normal range, and the attention error stays close to the calibrated scale's."), True

    def fold_cells(self, f: dict) -> list[str]:
        return [f"x{f['latent']:g}", f"x{f['rope']:g}", _cell(f["q_absorbed_amax_after"], ".3g"),
                _cell(f["q_pe_amax_after"], ".3g")]

    def fold_tensors(self, prefix: str, layer: int, text: dict) -> MlaNames:
        base = f"{prefix}model.layers.{layer}.self_attn."
        q = "q_b_proj" if text.get("q_lora_rank") else "q_proj"
        return MlaNames(base + "kv_a_layernorm.weight", base + "kv_a_proj_with_mqa.weight", base + "kv_b_proj.weight",
                        base + q + ".weight", int(text["kv_lora_rank"]), int(text["qk_rope_head_dim"]),
                        int(text["qk_nope_head_dim"]), int(text["num_attention_heads"]))

    def holds(self, rank, first_layer, modules) -> bool:
        # transformers caches the latent itself: keys kv_c_normed [B, 1, S, rank], values k_pe [B, 1, S, rope]
        return bool(rank and first_layer.keys.shape[1] == 1 and first_layer.keys.shape[-1] == rank)

    def store_prompt_layer(self, layer, i: int, store: PromptStore) -> None:
        f = store.e4m3 if store.fp8 else store.bf16  # SGLang's MLA pool: a plain .to(fp8), unit scale
        layer.keys, layer.values = f(layer.keys), f(layer.values)


class Dsa(_LatentRow):
    name = "dsa"
    error_modes = ("tiles",)
    static_scale = False  # per-128 dynamic scales: no range to be at risk of
    fold_refusal = "GLM-5 DSA's FP8 cache carries per-128 dynamic scales, so there is no range to fold"
    pd_name = "mla-expanded"
    pd_stored = ("the MLA latent taken from the prefill model's attention, {kv} with one dynamic scale per 128 values, "
                 "k_pe BF16 (GLM-5 DSA's 656 B/token/layer layout), expanded by the decode model's kv_b_proj; indexer "
                 "keys {kv} per 128 values")

    def cache_bytes(self, cfg: dict, tp: int) -> dict[str, float]:
        # BF16: the 576-value row; SGLang/vLLM's FP8 layout: 512 FP8 latent + 4 fp32 tile scales + 64 BF16 rope
        # values (656 B for GLM-5); plus the indexer's key cache, index_head_dim FP8 values + one fp32 scale
        kvl, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        indexer = int(cfg.get("index_head_dim", 128)) + 4
        fp8_row = kvl + 4 * math.ceil(kvl / 128) + 2 * rope
        return {"bf16": (kvl + rope) * 2 + indexer, "fp8": fp8_row + indexer}

    def observed(self, k, v, rope_dim: int) -> list[tuple[str, Any]]:
        # expanded per-head K; its rope part is the cached k_pe (same in every head)
        rope = k[:, :1, :, -rope_dim:]
        return [("rope", rope), ("row", rope)]

    def latent_module(self, attn):
        return attn.kv_a_layernorm  # kv_c_normed is not handed to the cache

    def observed_latent(self, output) -> list[tuple[str, Any]]:
        return [("latent", output), ("row", output)]

    def cache_scales(self, mode, scales):
        return None  # the expanded K/V are not what the engines store: the latent is rounded at its module

    def skips_error(self, attn) -> bool:
        return getattr(attn, "indexer", 1) is None  # a shared-index layer: its attention needs the previous top-k

    def applies_scales(self, target: str) -> bool:
        return False

    def write_refusal(self, model: str, target: str) -> str | None:
        return (f"{model}: GLM-5 DSA: the engines compute per-128 KV scales when they write the cache, so there is "
                f"nothing to write; drop --out for the report")

    def verdict(self, target: str, reports) -> tuple[str, bool]:
        worst = max((r.attn_rel_err_tiles or 0.0) for r in reports)
        return (f"GLM-5 DSA: engines write the FP8 cache with per-128 dynamic scales; no checkpoint scale is used or "
                f"written. Worst attention-output error of that layout: {worst:.4f}."), True

    def holds(self, rank, first_layer, modules) -> bool:
        # transformers caches the expanded per-head K/V; the attention modules expand the latent
        return any(hasattr(m, "expand_kv") for m in modules.values())

    def store_prompt_layer(self, layer, i: int, store: PromptStore) -> None:
        c, k_pe = store.latent(i)
        if store.fp8:
            c, k_pe = store.tiles(c), store.bf16(k_pe)
        else:
            c, k_pe = store.bf16(c), store.bf16(k_pe)
        layer.keys, layer.values = store.expand(i, c, k_pe)
        if getattr(layer, "indexer_keys", None) is not None and layer.indexer_keys.numel():
            layer.indexer_keys = store.tiles(layer.indexer_keys) if store.fp8 else store.bf16(layer.indexer_keys)


class Gqa(AttentionLayout):
    name = "gqa"
    scaled = "k"
    amax_fields = {"k_amax": "k", "v_amax": "v"}
    scale_fields = {"k_scale": "k", "v_scale": "v"}
    fold_refusal = ("it is an MLA reparametrisation and this model caches K and V per head (GQA); "
                    "use the scales instead")
    pd_name = "gqa"
    pd_stored = ("K and V per head, {kv} at the decode model's k_scale/v_scale (unit scale when it has none), "
                 "exactly what the engine stores")

    def cache_bytes(self, cfg: dict, tp: int) -> dict[str, float]:
        # K and V, split over ranks (replicated when there are fewer KV heads than ranks)
        nh = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or nh)
        hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nh)
        per_rank = max(1, math.ceil(kv / tp))
        return {"bf16": 2 * per_rank * hd * 2, "fp8": 2 * per_rank * hd}

    def observed(self, k, v, rope_dim: int) -> list[tuple[str, Any]]:
        return [("k", k), ("v", v)]

    def calibrated_scales(self, r) -> tuple[float, float]:
        return r.k_scale, r.v_scale

    def holds(self, rank, first_layer, modules) -> bool:
        return True  # K and V per head: whatever is neither MLA form

    def store_prompt_layer(self, layer, i: int, store: PromptStore) -> None:
        if store.fp8:
            ks, vs = store.scale(i, "k_scale"), store.scale(i, "v_scale")
            layer.keys, layer.values = store.e4m3(layer.keys, ks), store.e4m3(layer.values, vs)
        else:
            layer.keys, layer.values = store.bf16(layer.keys), store.bf16(layer.values)


MLA, DSA, GQA = Mla(), Dsa(), Gqa()
# the registry's ``attention`` name -> layout; also the order the PD check recognises a cache in
LAYOUTS: dict[str, AttentionLayout] = {x.name: x for x in (MLA, DSA, GQA)}


def attention_layout(name: str) -> AttentionLayout:
    """The layout an architecture's ``attention`` (or a report's ``layout``) names."""
    return LAYOUTS[name]


def cache_layout(rank: int | None, first_layer, modules: dict) -> AttentionLayout:
    """The layout a transformers prompt cache is in (the PD check reads any model transformers
    loads, so the cache, not the registry, says which)."""
    return next(x for x in LAYOUTS.values() if x.holds(rank, first_layer, modules))
