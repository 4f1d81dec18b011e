"""Prefill and decode pools from one source (SGLang PD disaggregation).

The decode pool serves our INT4 checkpoint (memory-bound decode gains most from 4-bit experts);
the prefill pool serves the vendor's own FP8 release (compute-bound prefill runs FP8 GEMMs), so the
prefill artifact is a card and launch lines pointing at the source and its revision, never a copy
of its weights. ``write_prefill`` writes that folder; ``pd_fidelity`` measures the pair as deployed.

What SGLang 0.5.23 does (read from the PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64):

- ``sglang/srt/arg_groups/fields/disagg.py`` (namespace ``disagg``): ``--disaggregation-mode
  null|prefill|decode``, ``--disaggregation-transfer-backend`` (default mooncake; choices in
  ``sglang/srt/arg_groups/choices.py``: mooncake, nixl, ascend, fake, mori, mooncake_tcp),
  ``--disaggregation-bootstrap-port`` ("Bootstrap server port on the prefill server", default 8998),
  ``--disaggregation-ib-device``; ``sglang/srt/arg_groups/fields/model.py``: ``--revision``,
  ``--kv-cache-dtype``.
- ``sglang/srt/disaggregation/common/conn.py`` (``CommonKVManager.try_ensure_parallel_info``, the
  base of the mooncake, nixl and mori connectors): the decode server refuses a prefill server
  whose ``kv_cache_dtype`` differs ("KV cache dtype mismatch ... Both servers must use the same
  --kv-cache-dtype value"), and likewise a different ``--page-size``. A BF16-cache prefill pool
  feeding an FP8-cache decode pool is therefore refused: both pools run ``--kv-cache-dtype
  fp8_e4m3``. The prefill pool's pages travel as they are stored, FP8.
- ``sglang/test/server_fixtures/disaggregation_fixture.py``: how SGLang's own tests start a pair:
  prefill and decode servers with ``--disaggregation-mode``, ``--disaggregation-bootstrap-port``,
  ``--disaggregation-transfer-backend``, ``--tp``, and the router ``python3 -m
  sglang_router.launch_router --pd-disaggregation --prefill URL --decode URL --host H --port P``
  (sglang_router is the separate ``sglang-router`` package; the fixture also passes ``--mini-lb``,
  marked "FIXME: remove this"). sglang-router 0.3.2's ``sglang_router/router_args.py``: ``--prefill
  URL [BOOTSTRAP_PORT]`` ("BOOTSTRAP_PORT can be a port number, 'none', or omitted (defaults to
  none)"), so the lines here name the prefill pool's bootstrap port after its URL.
- ``sglang/srt/mem_cache/index_key_cache.py``: GLM-5 DSA's indexer keys are stored FP8 with one
  scale per 128 values (``index_head_dim + index_head_dim // quant_block_size * 4`` bytes).

The fidelity check, in transformers (fp32 compute): the prompt runs through the prefill model with
a cache; that cache is rounded as the decode pool stores it; the decode model then scores the next
tokens (teacher-forced on the text) from that cache. Its next-token distributions are compared with
the source model's own, computed along the same path (its own prompt cache, unrounded; no
quantization anywhere; transformers 5.17's GLM-5 DSA model gives other logits with a cache than
in one pass, so the one-pass forward is not the reference, only reported beside it): KL divergence
and top-1 agreement, beside the decode model alone (its own prompt cache, stored the same way;
and with a BF16 cache) and the source with the FP8 cache (the cache's share of the error). What is
rounded, per layout:

- MLA (DeepSeek-V3, Kimi K2.x): transformers caches what the engines cache, the latent
  ``kv_a_layernorm(c)`` and the post-RoPE ``k_pe`` (one 576-wide row per token for the real
  models); both are rounded to e4m3 at unit scale, as SGLang's MLA pool stores them (a plain
  ``.to(fp8)``, docs/kv-cache.md#mla-unit-scale). The decode model expands the rounded latent with its own
  ``kv_b_proj``, as the decode pool does.
- GLM-5 DSA: transformers caches the expanded per-head K/V, so the latent and ``k_pe`` are taken
  from the prefill model's attention as it runs, the latent rounded with one dynamic scale per 128
  values and ``k_pe`` kept BF16 (SGLang's 656 B/token/layer layout), then expanded by the decode
  model's ``kv_b_proj``; the indexer keys are rounded per 128 values likewise.
- GQA (Llama, Qwen, SmolLM2): K and V per head, rounded to e4m3 at the decode model's ``k_scale`` /
  ``v_scale`` when it loads them, else at unit scale: exactly the values the engine stores.

Not modelled: the prefill pool's own attention reading earlier chunks of a long prompt back from
its FP8 cache (chunked prefill; here the whole prompt is one chunk at full precision), the engines'
kernels and their accumulation order.
"""

from __future__ import annotations

import copy
import math
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..archs.attention import AttentionLayout, cache_layout
from ..errors import QuantizeError
from ..events import Emit, null_emit
from ..options import PDOptions, takes

E4M3_MAX = 448.0
SGLANG = "SGLang 0.5.23"
CITES = {
    "flags": "sglang/srt/arg_groups/fields/disagg.py",
    "choices": "sglang/srt/arg_groups/choices.py",
    "dtype_check": "sglang/srt/disaggregation/common/conn.py (CommonKVManager.try_ensure_parallel_info)",
    "router": "sglang/test/server_fixtures/disaggregation_fixture.py (launch_lb)",
    "model_flags": "sglang/srt/arg_groups/fields/model.py (--revision, --kv-cache-dtype)",
    "indexer": "sglang/srt/mem_cache/index_key_cache.py",
}


# -- rounding as the decode pool stores the cache -----------------------------------------------


def _e4m3(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The engine's store: the BF16 value cast to e4m3 (saturating at +-448) at ``scale``."""
    q = (x.to(torch.bfloat16).float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def _e4m3_tiles(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """One dynamic scale (amax / 448) per ``tile`` values per token (GLM-5 DSA's FP8 layout)."""
    tile = min(tile, x.shape[-1])
    t = x.to(torch.bfloat16).float().reshape(*x.shape[:-1], x.shape[-1] // tile, tile)
    s = (t.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(1e-30)
    return ((t / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s).reshape(x.shape).to(x.dtype)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def _attention_modules(model) -> dict[int, torch.nn.Module]:
    """layer index -> the decoder layer's attention module (text model only)."""
    out = {}
    for name, m in model.named_modules():
        if "vision" in name or not hasattr(m, "layer_idx"):
            continue
        if hasattr(m, "expand_kv") or name.endswith("self_attn"):
            out.setdefault(int(m.layer_idx), m)
    return out


class _LatentTap:
    """Records the MLA latent (``kv_a_layernorm(c)``, post-RoPE ``k_pe``) each attention module
    expands, for models whose transformers cache holds the expanded K/V (GLM-5 DSA)."""

    def __init__(self, model):
        self.latents: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.mods = {i: m for i, m in _attention_modules(model).items() if hasattr(m, "expand_kv")}
        for i, m in self.mods.items():
            real = m.expand_kv

            def tapped(kv_nope, k_rot, _i=i, _real=real):
                self.latents[_i] = (kv_nope.detach().clone(), k_rot.detach().clone())
                return _real(kv_nope, k_rot)

            m.expand_kv = tapped

    def close(self) -> None:
        for m in self.mods.values():
            if "expand_kv" in m.__dict__:
                del m.expand_kv


def _layout(model, cache) -> AttentionLayout:
    """The attention layout ``cache`` holds this model's KV in: the MLA latent itself, DSA's
    expanded K/V (its attention modules expand the latent) or K and V per head."""
    mods = _attention_modules(model)
    rank = getattr(model.config.get_text_config(), "kv_lora_rank", None)
    return cache_layout(rank, cache.layers[0], mods)


class _Store:
    """How the decode pool stores one layer (``archs.attention.PromptStore``): the numerics above,
    the latent the prefill model expanded, the decode model's ``kv_b_proj`` and loaded scales."""

    e4m3 = staticmethod(_e4m3)
    tiles = staticmethod(_e4m3_tiles)
    bf16 = staticmethod(_bf16)

    def __init__(self, kv: str, tap: _LatentTap | None, decode_modules: dict):
        self.fp8, self.tap, self.decode = kv == "fp8_e4m3", tap, decode_modules

    def latent(self, layer: int):
        return self.tap.latents[layer]

    def expand(self, layer: int, latent: torch.Tensor, k_pe: torch.Tensor):
        with torch.no_grad():
            return self.decode[layer].expand_kv(latent, k_pe)

    def scale(self, layer: int, name: str) -> float:
        m = self.decode.get(layer)
        return float(getattr(m, name, 1.0)) if m is not None and torch.is_tensor(getattr(m, name, None)) else 1.0


def _stored(prefill, decode, cache, tap: _LatentTap | None, kv: str):
    out = copy.deepcopy(cache)
    layout = _layout(prefill, cache)
    store = _Store(kv, tap, _attention_modules(decode))
    for i, layer in enumerate(out.layers):
        layout.store_prompt_layer(layer, i, store)
    return out, layout


def stored_cache(prefill, decode, cache, tap: _LatentTap | None, kv: str):
    """The prefill model's prompt cache as the decode model reads it from the decode pool: a copy
    of ``cache`` rounded per ``kv`` ("fp8_e4m3" or "bf16") and, for MLA, expanded by the decode
    model's own ``kv_b_proj``. -> (that cache, the layout's name in the PD report)."""
    out, layout = _stored(prefill, decode, cache, tap, kv)
    return out, layout.pd_name


# -- the fidelity check ---------------------------------------------------------------------------


@dataclass
class PdRow:
    name: str
    kld_mean: float
    kld_p99: float
    kld_max: float
    top1_agreement: float
    nll: float  # mean negative log-likelihood of the text's next tokens

    def line(self) -> str:
        return (
            f"{self.name}: KLD mean {self.kld_mean:.5f} (p99 {self.kld_p99:.4f}, max {self.kld_max:.4f}), "
            f"same top-1 {self.top1_agreement:.2%}"
        )


@dataclass
class PdReport:
    prefill: str
    decode: str
    source: str
    text: str
    prompt_tokens: int
    decode_tokens: int
    kv_cache_dtype: str
    layout: str
    stored: str  # what was rounded, in words
    rows: list[PdRow] = field(default_factory=list)
    source_nll: float = 0.0
    # max |logit| between the source's one-pass forward and its prefill -> decode path (the
    # reference): ~1e-6 for MLA and GQA; transformers 5.17's GLM-5 DSA (glm_moe_dsa) differs with a
    # cache by ~0.1-0.7 on the tiny model, so the reference is always the source's own cached path
    path_max_abs_logit_diff: float = 0.0

    def row(self, name: str) -> PdRow:
        return next(r for r in self.rows if r.name == name)

    def line(self) -> str:
        pd, alone = self.row(PAIR), self.row(DECODE_ALONE)
        return (
            f"vs the source over {self.decode_tokens} decoded tokens: prefill->decode pair KLD {pd.kld_mean:.5f}, "
            "top-1 "
            f"{pd.top1_agreement:.2%}; decode model alone KLD {alone.kld_mean:.5f}, top-1 {alone.top1_agreement:.2%} "
            f"({self.kv_cache_dtype} cache, {self.layout})"
        )

    def to_dict(self) -> dict:
        return asdict(self)


PAIR = "prefill -> decode (deployed pair)"
DECODE_ALONE = "decode model alone"
ROWS = (  # name, prefill side, decode side, stored cache dtype ("kv": the option's)
    (PAIR, "prefill", "decode", "kv"),
    (DECODE_ALONE, "decode", "decode", "kv"),
    ("decode model alone, BF16 cache", "decode", "decode", "bf16"),
    ("source, its cache stored as the decode pool does", "source", "source", "kv"),
)


def _forward(model, ids: torch.Tensor, cache=None):
    with torch.no_grad():
        return model(input_ids=ids.unsqueeze(0).to(model.device), past_key_values=cache, use_cache=True)


@takes(PDOptions)
def pd_fidelity(
    prefill_model,
    decode_model,
    source,
    text,
    prompt_tokens,
    decode_tokens,
    kv_cache_dtype,
    device,
    out,
    emit: Emit = null_emit,
) -> PdReport:
    """The prompt's cache computed by ``prefill_model``, stored as the decode pool stores it
    (``kv_cache_dtype``), then ``decode_tokens`` tokens of the text scored by ``decode_model``
    from that cache, against ``source`` alone; beside the decode model alone."""
    from ..checkpoint.output import report_target, write_report
    from ..errors import CheckFailed
    from .kld import _config, _tokenizer, check_device, load_model, read_text, same_model, same_tokenizer

    if kv_cache_dtype not in ("fp8_e4m3", "bf16"):
        raise QuantizeError(f"--kv-cache-dtype {kv_cache_dtype}: use fp8_e4m3 (the decode pool's FP8 cache) or bf16")
    if prompt_tokens < 1 or decode_tokens < 1:
        raise QuantizeError(
            f"--prompt-tokens {prompt_tokens} / --decode-tokens {decode_tokens}: both must be at least 1"
        )
    dev = check_device(device)
    paths = {"prefill": Path(prefill_model), "decode": Path(decode_model), "source": Path(source)}
    flags = {"prefill": "--prefill-model", "decode": "--decode-model", "source": "--source"}
    inputs = [*paths.values(), text]
    if out is not None:  # before anything is read or loaded
        report_target(out, "pd", inputs, "--out")
    for k, p in paths.items():
        _config(p, f"{k} model")
    for k in ("prefill", "decode"):  # proven to belong before any model loads
        same_model(paths["source"], paths[k], "--source", flags[k])
    text_path, raw = read_text(text)
    tok = _tokenizer(paths["source"])
    for k in ("prefill", "decode"):
        same_tokenizer(paths["source"], paths[k], raw, tok_a=tok, what_a="--source", what_b=flags[k])
    ids = torch.tensor(tok(raw)["input_ids"][: prompt_tokens + decode_tokens + 1])
    if ids.numel() < prompt_tokens + decode_tokens + 1:
        raise QuantizeError(
            f"--text {text_path}: {ids.numel()} tokens, fewer than prompt {prompt_tokens} + decode {decode_tokens} + "
            "1; "
            "pass a longer text or fewer tokens"
        )
    prompt, cont = ids[:prompt_tokens], ids[prompt_tokens : prompt_tokens + decode_tokens]
    target = ids[prompt_tokens + 1 : prompt_tokens + decode_tokens + 1]

    models: dict[str, object] = {}
    by_path: dict[Path, object] = {}
    for k, p in paths.items():  # the prefill model is usually the source itself: load it once
        r = p.resolve()
        if r not in by_path:
            by_path[r] = load_model(p, torch.float32, dev)
        models[k] = by_path[r]
    emit({"event": "start", "stage": "pd-fidelity", "total_bytes": len(ROWS) + 1, "done_bytes": 0, "unit": "steps"})
    prefills: dict[str, tuple] = {}  # prefill side -> (its prompt cache, its latent tap)

    def prefill(side: str):
        if side not in prefills:
            tap = _LatentTap(models[side])
            try:
                prefills[side] = (_forward(models[side], prompt).past_key_values, tap)
            finally:
                tap.close()
        return prefills[side]

    # the reference: the source alone, along the same path (its prompt cache as computed, then the
    # continuation); beside it, its one-pass forward, to show the path itself costs nothing
    one_pass = _forward(models["source"], ids[: prompt_tokens + decode_tokens]).logits[0, prompt_tokens:].float()
    ref_logits = _forward(models["source"], cont, copy.deepcopy(prefill("source")[0])).logits[0].float()
    path_diff = float((one_pass - ref_logits).abs().max())
    ref = torch.log_softmax(ref_logits, -1)
    emit({"event": "tensor", "name": "source alone", "done_bytes": 1})

    rows, layout = [], None
    for i, (name, pside, dside, kv) in enumerate(ROWS):
        cache, tap = prefill(pside)
        stored, lay = _stored(models[pside], models[dside], cache, tap, kv_cache_dtype if kv == "kv" else "bf16")
        layout = layout or lay
        lp = torch.log_softmax(_forward(models[dside], cont, stored).logits[0].float(), -1)
        kl = (ref.exp() * (ref - lp)).sum(-1).clamp_min(0).double()
        rows.append(
            PdRow(
                name,
                float(kl.mean()),
                float(torch.quantile(kl, 0.99)) if kl.numel() > 1 else float(kl[0]),
                float(kl.max()),
                float((lp.argmax(-1) == ref.argmax(-1)).float().mean()),
                float(-lp.gather(-1, target.unsqueeze(-1).to(lp.device)).mean()),
            )
        )
        emit({"event": "tensor", "name": name, "done_bytes": i + 2})
    rep = PdReport(
        str(prefill_model),
        str(decode_model),
        str(source),
        str(text_path),
        prompt_tokens,
        decode_tokens,
        kv_cache_dtype,
        layout.pd_name,
        layout.pd_stored.format(kv=kv_cache_dtype),
        rows,
        float(-ref.gather(-1, target.unsqueeze(-1).to(ref.device)).mean()),
        path_diff,
    )
    bad = [r.name for r in rep.rows if not all(map(math.isfinite, (r.kld_mean, r.kld_p99, r.kld_max, r.nll)))]
    if bad or not math.isfinite(rep.source_nll):
        raise CheckFailed(f"--decode-model {decode_model}: the KL divergence of '{(bad or ['the source'])[0]}' is "
                          f"not finite (NaN or inf log-probabilities); the pair fails")
    if out is not None:
        write_report(out, rep.to_dict(), "pd", inputs)
    emit({"event": "done"})
    return rep


# -- the prefill artifact -------------------------------------------------------------------------


def launch_lines(
    prefill: str,
    decode: str,
    *,
    revision: str | None = None,
    prefill_tp: int = 8,
    decode_tp: int = 8,
    transfer_backend: str = "mooncake",
    bootstrap_port: int = 8998,
    prefill_host: str = "PREFILL_HOST",
    decode_host: str = "DECODE_HOST",
    prefill_port: int = 30000,
    decode_port: int = 30001,
    router_port: int = 8000,
    kv_cache_dtype: str = "fp8_e4m3",
    trust_remote_code: bool = False,
) -> dict[str, list[str]]:
    """SGLang 0.5.23 PD launch arguments (flags as ``sglang/srt/arg_groups/fields/disagg.py`` names
    them; both pools with the same ``--kv-cache-dtype``, which the decode side requires)."""
    common = [
        "--disaggregation-transfer-backend",
        transfer_backend,
        "--disaggregation-bootstrap-port",
        str(bootstrap_port),
        "--kv-cache-dtype",
        kv_cache_dtype,
        "--host",
        "0.0.0.0",
    ] + (["--trust-remote-code"] if trust_remote_code else [])
    p = (
        ["python", "-m", "sglang.launch_server", "--model-path", prefill]
        + (["--revision", revision] if revision else [])
        + ["--tp", str(prefill_tp), "--disaggregation-mode", "prefill", "--port", str(prefill_port)]
        + common
    )
    d = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        decode,
        "--tp",
        str(decode_tp),
        "--disaggregation-mode",
        "decode",
        "--port",
        str(decode_port),
    ] + common
    r = [
        "python",
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--prefill",  # URL [BOOTSTRAP_PORT] (sglang_router/router_args.py, 0.3.2): the port decode pulls from
        f"http://{prefill_host}:{prefill_port}",
        str(bootstrap_port),
        "--decode",
        f"http://{decode_host}:{decode_port}",
        "--host",
        "0.0.0.0",
        "--port",
        str(router_port),
    ]
    return {"prefill": p, "decode": d, "router": r}


def write_prefill(
    source: str | os.PathLike,
    decode_model: str | os.PathLike,
    out: str | os.PathLike,
    repo: str | None = None,
    pd_report: str | os.PathLike | None = None,
    overwrite: bool = False,
    revision: str | None = None,
    source_repo: str | None = None,
    prefill_model: str | os.PathLike | None = None,
    **launch,
) -> dict:
    """Write the prefill artifact into ``out``: README.md (the card), launch.sh and prefill.json,
    pointing at ``source`` (a Hub repo and revision where known, else the folder) for the prefill
    pool, or at ``prefill_model`` (its own weights made from the source, e.g. FP8 block from Kimi
    K2.6's INT4), and at ``decode_model`` (or ``repo``) for the decode pool. No weights are written."""
    from ..checkpoint.index import hf_snapshot, hub_revision
    from ..checkpoint.manifest import write_manifest
    from ..checkpoint.output import Output
    from ..parse import load_json

    src, dec = Path(source), Path(decode_model)
    cfg = load_json(src / "config.json", "config.json")
    revision = revision or hub_revision(src)
    snap = hf_snapshot(src.resolve())
    source_repo = source_repo or (snap.repo_id if snap else None)
    source_ref = source_repo or str(src.resolve())
    prefill_ref = str(Path(prefill_model).resolve()) if prefill_model else source_ref
    decode_ref = repo or str(dec.resolve())
    dec_man = load_json(dec / "quantize_manifest.json", "quantize manifest", kind="record") \
        if (dec / "quantize_manifest.json").is_file() else {}
    # the decode model is the source's own weights when its conversion passed INT4 through and
    # quantized nothing (the card's lineage decides it, for both)
    from ..publish.card import lineage

    decode_is_source = (isinstance(dec_man, dict) and bool((dec_man.get("passed_through") or {}).get("modules"))
                        and not lineage(dec, dec_man, None).requantized)
    lines = launch_lines(
        prefill_ref,
        decode_ref,
        revision=revision if source_repo and not prefill_model else None,
        trust_remote_code=bool(cfg.get("auto_map")),
        **launch,
    )
    kv = launch.get("kv_cache_dtype", "fp8_e4m3")
    report = load_json(pd_report, "eval-pd report", kind="report") if pd_report else None
    arch = (cfg.get("architectures") or ["?"])[0]
    L = [
        "---",
        *([f"base_model: {source_repo}"] if source_repo else []),
        "tags:",
        "- pd-disaggregation",
        "- prefill",
        "- sglang",
        "---",
        "",
        f"# Prefill pool for {decode_ref}",
        "",
        f"This folder holds **no weights**. In a prefill/decode disaggregated {SGLANG} deployment the prefill pool "
        + (
            f"serves **{prefill_ref}**: FP8 block weights (e4m3, one scale per 128x128 block, compressed-tensors "
            f"float-quantized, as llm-compressor's FP8_BLOCK writes them) made from the source **{source_ref}**"
            + (f" at revision `{revision}`" if revision else "")
            + f" ({arch}) by `quantize convert --scheme fp8-block`"
            if prefill_model
            else f"serves the source release itself, **{prefill_ref}**"
            + (f" at revision `{revision}`" if revision else " (no Hub revision recorded: pin one)")
            + f" ({arch}, its own FP8 weights)"
        )
        + (
            f", and the decode pool serves **{decode_ref}**: the source's own INT4 weights, passed through bit for "
            "bit by `quantize convert`."
            if decode_is_source
            else f", and the decode pool serves the INT4 checkpoint **{decode_ref}** made from it by `quantize "
            "convert` (routed experts INT4, everything else as in the source)."
        )
        + " Nothing here is a copy of either.",
        "",
        "## KV cache",
        "",
        f"Both pools run `--kv-cache-dtype {kv}`. {SGLANG}'s decode server refuses a prefill server whose cache dtype "
        "differs "
        f'(`{CITES["dtype_check"]}`: "KV cache dtype mismatch ... Both servers must use the same '
        '--kv-cache-dtype value"), so a '
        "BF16-cache prefill pool cannot feed an FP8-cache decode pool: the prompt's KV is computed by the prefill "
        "pool at full "
        f"precision, stored {kv} in its pool, and transferred as stored.",
        "",
        "## Launch",
        "",
        f"Flags as the pinned release names them (`{CITES['flags']}`, `{CITES['model_flags']}`; transfer backends in "
        f"`{CITES['choices']}`); the router is the separate `sglang-router` package, started as SGLang's own PD tests "
        "start it "
        f"(`{CITES['router']}`).",
        "",
        "```sh",
    ]
    L += [shlex.join(lines["prefill"]), shlex.join(lines["decode"]), shlex.join(lines["router"]), "```", ""]
    if report:
        L += [
            "## Fidelity of the pair",
            "",
            f"{report['prompt_tokens']} prompt tokens through the prefill model, the cache stored as the decode pool "
            "stores it "
            f"({report['stored']}), then {report['decode_tokens']} tokens scored by the decode model; against the "
            "source model alone "
            "(fp32, no quantization, its own prompt cache), transformers on CPU:",
            "",
            "| | KLD mean | KLD p99 | KLD max | same top-1 |",
            "|---|---|---|---|---|",
        ]
        L += [
            f"| {r['name']} | {r['kld_mean']:.5f} | {r['kld_p99']:.4f} | {r['kld_max']:.4f} | "
            f"{r['top1_agreement']:.2%} |"
            for r in report["rows"]
        ]
        L += [
            "",
            f"Text: `{Path(report['text']).name}`. Not modelled: chunked prefill reading earlier chunks back from the "
            "FP8 cache, "
            "the engines' kernels.",
            "",
        ]
    else:
        L += [
            "## Fidelity of the pair",
            "",
            "Not measured here: run `quantize eval-pd --prefill-model SOURCE --decode-model DECODE --source SOURCE`.",
            "",
        ]
    text = "\n".join(L)
    record = {
        "source": prefill_ref,
        **({"prefill_weights_from": source_ref} if prefill_model else {}),
        "revision": revision,
        "source_path": str(src.resolve()),
        "decode": decode_ref,
        "launch": lines,
        "kv_cache_dtype": kv,
        "sglang": SGLANG,
        "cites": CITES,
        "fidelity": report,
    }
    key = {k: v for k, v in record.items() if k != "fidelity"}
    inputs = [src, dec] + ([Path(prefill_model)] if prefill_model else [])
    with Output.open(out, "pd-prefill", inputs, overwrite=overwrite, key=key) as o:
        o.write_text("README.md", text)
        o.write_text(
            "launch.sh",
            "#!/bin/sh\n# "
            + SGLANG
            + " prefill/decode pair (see README.md); one line per host\n"
            + "\n".join(shlex.join(v) for v in lines.values())
            + "\n",
        )
        o.write_json("prefill.json", record)
        o.complete()
        write_manifest(o, {"kind": "pd-prefill", "options": key})
    return record
