"""Tiny checkpoints of the real architectures, made the way vendors make theirs.

The model comes from transformers' own config and model classes (random weights, fixed seed),
so ``from_pretrained`` on the BF16 dequantization of what we write is a reference model. Tensors
are saved under the real on-disk names (per-expert 2-D experts, Kimi's ``language_model.`` prefix,
an MTP layer at index ``num_hidden_layers``), then stored as the release stores them (``--layout
vendor``): GLM-5 and DeepSeek-V3 (and ``--layout fp8``) FP8-quantized as DeepSeek/zai-org do: e4m3,
128x128 blocks, ``weight_scale_inv`` multiplier on a ceil grid, router / norms / embeddings / lm_head /
indexer ``weights_proj`` / ``eh_proj`` / vision left BF16, ``quantization_config`` with
``modules_to_not_convert`` as the vendor writes it; Kimi K2.x (and ``--layout int4``) as Moonshot ships
K2 Thinking / K2.5 / K2.6: only the routed experts INT4 pack-quantized (group 32, absmax / 7 grid),
everything else BF16, Moonshot's quantization_config and ignore list. Several shards plus an index.

config.json carries the router keys the releases carry (``scoring_func: sigmoid``, ``topk_method:
noaux_tc``, ``norm_topk_prob``, ``routed_scaling_factor``, ``n_group``/``topk_group``): engines
read them (vLLM's deepseek_v2 loader raises ``KeyError ... e_score_correction_bias`` without
``noaux_tc``, docs/engines.md#vllm-cpu-build). The Kimi K2.5 fixture follows moonshotai/Kimi-K2.5's
config.json and tensor list (as published in its model report: ``text_config.architectures``
``["DeepseekV3ForCausalLM"]``, ``routed_scaling_factor`` 2.827, ``vision_config`` with the vendor's
``vt_*``/``mm_*``/``init_pos_emb_*`` keys, ``vision_tower.patch_embed.proj``, not under ``encoder``)
and its ``preprocessor_config.json`` (``media_proc_cfg``). transformers' own names
(``hidden_size`` ..., which transformers 5.17 and vLLM 0.32 read through ``Kimi_K25VisionConfig``)
are written next to the vendor's, with the same values, so both load the tiny tower; the vendor's
``auto_map`` (remote-code files a tiny fixture does not ship) is left out.
"""

from __future__ import annotations

import json
import re
import math
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..archs import REGISTRY
from ..checkpoint.manifest import write_manifest
from ..checkpoint.output import Output
from ..errors import QuantizeError
from ..options import MakeTinyOptions, takes
from ..archs.base import EXPERT_ROLES, ROLES
from ..formats import fp8

MLA_TEXT = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=128, kv_lora_rank=128,
    qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, n_group=1, topk_group=1,
    max_position_embeddings=512, tie_word_embeddings=False, rope_scaling=None,
)

# name -> (transformers module, config class, model class, config kwargs)
TINY: dict[str, dict] = {
    "glm_moe_dsa": dict(
        config="GlmMoeDsaConfig", model="GlmMoeDsaForCausalLM",
        kwargs={**{k: v for k, v in MLA_TEXT.items() if k not in ("n_group", "topk_group", "rope_scaling")},
                "mlp_layer_types": None, "index_n_heads": 2, "index_head_dim": 64, "index_topk": 16},
    ),
    "deepseek_v3": dict(config="DeepseekV3Config", model="DeepseekV3ForCausalLM",
                        kwargs={k: v for k, v in MLA_TEXT.items() if k != "rope_scaling"}),
    "kimi_k25": dict(config="Kimi_K25Config", model="Kimi_K25ForConditionalGeneration", kwargs={}),
    "llama": dict(config="LlamaConfig", model="LlamaForCausalLM",
                  kwargs=dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
}

# Router keys as the releases' config.json carry them; n_group/topk_group 1 fit the tiny 8 experts
# (DeepSeek-V3 ships 8/4 for 256 experts; Kimi K2.x and GLM-5 ship 1/1). Overrides win.
VENDOR_ROUTER = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1},
    "kimi_k25": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                 "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1},
    "glm_moe_dsa": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1},
}

# Kimi K2.5 vision settings (moonshotai/Kimi-K2.5 config.json values; sizes scaled down below)
KIMI_VISION = {"init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "merge_kernel_size": [2, 2],
               "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "model_type": "", "patch_size": 14,
               "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
               "video_attn_type": "spatial_temporal"}
KIMI_TINY_VISION = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 128}
# moonshotai/Kimi-K2.5 preprocessor_config.json (media_proc_cfg), as vLLM's KimiK25FusedVisionProcessor
# (vllm/transformers_utils/processors/kimi_k25_vision_fused.py) and SGLang's kimi_k25 processor read it
KIMI_PREPROCESSOR = {"media_proc_cfg": {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"}}

# Moonshot's quantization_config for Kimi K2 Thinking / K2.5 / K2.6
# (docs/formats.md#kimi-native-int4-release): the routed experts INT4, symmetric, group 32, QAT; the ignore
# list as the release writes it, plus the vision patterns
MOONSHOT_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*vision_tower.*", "re:.*mm_projector.*"]
MOONSHOT_INT4 = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized", "ignore": MOONSHOT_IGNORE, "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
MOONSHOT_GROUP = 32
# config.json of Kimi K2.6 at its published size (61 layers, hidden 7168, 64 heads, kv_lora 512, rope 64,
# 384 routed experts of 2048, MoonViT 27 x 1152) with Moonshot's INT4 quantization_config: for
# `quantize plan` from the config alone (no weights), e.g. the KV capacity at TP 8
KIMI_K26_CONFIG = Path(__file__).with_name("kimi-k2.6-config.json")
# what each architecture's release ships: make-tiny --layout vendor
VENDOR_LAYOUT = {"glm_moe_dsa": "fp8", "deepseek_v3": "fp8", "kimi_k25": "int4", "llama": "fp8"}

VENDOR_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
ARCH_NAMES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
              "kimi_k25": "KimiK25ForConditionalGeneration", "llama": "LlamaForCausalLM"}


def _build_model(arch: str, overrides: dict | None):
    import transformers

    spec = TINY[arch]
    if arch == "kimi_k25":
        from transformers.models.kimi_k25 import configuration_kimi_k25 as ck
        from transformers.models.kimi_k25 import modeling_kimi_k25 as mk

        text = {"model_type": "deepseek_v3", **MLA_TEXT, **VENDOR_ROUTER[arch], **(overrides or {})}
        text.pop("rope_scaling", None)
        cfg = ck.Kimi_K25Config(text_config=text, tie_word_embeddings=False, projection_hidden_size=64,
                                vision_config=dict(KIMI_TINY_VISION))
        return cfg, mk.Kimi_K25ForConditionalGeneration(cfg)
    cfg = getattr(transformers, spec["config"])(**{**spec["kwargs"], **VENDOR_ROUTER.get(arch, {}),
                                                   **(overrides or {})})
    return cfg, getattr(transformers, spec["model"])(cfg)


def _ondisk_state(model, arch: str) -> dict[str, torch.Tensor]:
    """transformers' save_pretrained reverses its in-memory fusions (per-expert names on disk);
    Kimi K2.5's reverse mapping in transformers 5.17 also renames text ``layers`` to ``blocks`` and
    moves the projector norm, which vendors' files do not: undo those."""
    from transformers.utils import logging as hf_logging

    with tempfile.TemporaryDirectory() as d:
        hf_logging.disable_progress_bar()  # its "Writing model shards" bar is noise in the tool's output
        try:
            model.save_pretrained(d)
        finally:
            hf_logging.enable_progress_bar()
        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            with safe_open(f, "pt") as fh:
                for k in fh.keys():
                    state[k] = fh.get_tensor(k)
    if arch == "kimi_k25":
        # the release stores the patch embedding at vision_tower.patch_embed.proj (next to pos_emb), as
        # vLLM's MoonViT3dPretrainedModel names it (vllm/model_executor/models/kimi_k25_vit.py)
        state = {k.replace("language_model.model.blocks.", "language_model.model.layers.")
                  .replace("model.mm_projector.", "mm_projector.")
                  .replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."): v
                 for k, v in state.items()}
    return state


def _kimi_vendor_config(cfg_dict: dict) -> None:
    """Kimi K2.5's config.json as moonshotai writes it, on top of transformers' to_dict()."""
    text, vis = cfg_dict["text_config"], cfg_dict["vision_config"]
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    vendor = dict(KIMI_VISION, vt_hidden_size=vis["hidden_size"], vt_intermediate_size=vis["intermediate_size"],
                  vt_num_attention_heads=vis["num_attention_heads"], vt_num_hidden_layers=vis["num_hidden_layers"],
                  mm_hidden_size=vis["hidden_size"], text_hidden_size=text["hidden_size"],
                  merge_kernel_size=list(vis.get("merge_kernel_size") or [2, 2]), patch_size=vis.get("patch_size", 14))
    vis.update(vendor)
    cfg_dict["media_placeholder_token_id"] = cfg_dict.get("image_token_id", 163605)
    cfg_dict["use_unified_vision_chunk"] = True
    cfg_dict["video_placeholder"] = "<|kimi_k25_video_placeholder|>"


@takes(MakeTinyOptions)
def make_tiny(arch, out, layout, seed, num_shards, overrides, mtp, overwrite) -> Path:
    """Write a tiny ``arch`` checkpoint to ``out`` (through the guarded output layer) and return
    the path. ``layout`` vendor: as the release ships (``VENDOR_LAYOUT``)."""
    if arch not in TINY:
        raise QuantizeError(f"make-tiny {arch}: unknown tiny architecture; choose one of {', '.join(TINY)}")
    check_overrides(arch, overrides)
    out = Path(out)
    layout = VENDOR_LAYOUT[arch] if layout == "vendor" else layout
    key = {"arch": arch, "layout": layout, "seed": seed, "num_shards": num_shards, "overrides": overrides,
           "mtp": mtp}
    tensors, cfg_dict, text = _build(arch, layout, seed, overrides, mtp)  # in memory: a tiny model is a few MB
    if num_shards > len(tensors):  # each file holds at least one tensor
        raise QuantizeError(f"make-tiny --num-shards {num_shards}: more files than the {len(tensors)} tensors of "
                            f"this {arch} checkpoint ({layout}); use at most {len(tensors)}")
    with Output.open(out, "make-tiny", [], overwrite=overwrite, key=key) as o:
        _write(arch, out, tensors, cfg_dict, text, num_shards)
        o.complete()
        write_manifest(o, {"kind": "make-tiny", "options": key})
    return out


def _build(arch: str, layout: str, seed: int, overrides: dict | None,
           mtp: bool) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """The tensors as they are written, config.json and its text config."""
    torch.manual_seed(seed)
    try:
        cfg, model = _build_model(arch, overrides)
    except (ValueError, TypeError, RuntimeError, AssertionError, ZeroDivisionError) as e:  # the config class says no
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise QuantizeError(
            f"make-tiny {arch} --override {' '.join(f'{k}={json.dumps(v)}' for k, v in (overrides or {}).items())}: "
            f"transformers refuses this config ({first}); change the override"
        ) from e
    model = model.to(torch.bfloat16).eval()
    state = _ondisk_state(model, arch)
    A = REGISTRY[arch]
    cfg_dict = cfg.to_dict()
    cfg_dict["architectures"] = [ARCH_NAMES[arch]]
    if arch == "kimi_k25":
        _kimi_vendor_config(cfg_dict)
    text = A.text_config(cfg_dict)
    prefix = A.prefix
    # the MLA families (DeepSeek-V3, GLM-5, Kimi K2 Instruct in FP8) carry an MTP layer; Moonshot's INT4 K2.x ships none
    has_mtp = mtp and A.layout.latent and not (arch == "kimi_k25" and layout == "int4")
    if not has_mtp and "num_nextn_predict_layers" in text:
        text["num_nextn_predict_layers"] = 0  # transformers' DeepseekV3Config defaults num_mtp_layers to 1
    if has_mtp:
        text["num_nextn_predict_layers"] = 1
        L = int(text["num_hidden_layers"])
        g = torch.Generator().manual_seed(seed + 1)
        src_p, dst_p = f"{prefix}model.layers.{L - 1}.", f"{prefix}model.layers.{L}."
        mtp_names = {n: tuple(s) for n, s, _ in A.expected(text) if n.startswith(dst_p)}
        for k in [k for k in state if k.startswith(src_p)]:
            # the MTP layer is MoE even after dense layers
            if mtp_names.get(dst_p + k[len(src_p):]) == tuple(state[k].shape):
                state[dst_p + k[len(src_p):]] = state[k].clone()
        for name, shape, role in A.expected(text):
            if name.startswith(dst_p) and name not in state:
                t = torch.ones(shape) if role == "norm" else torch.randn(shape, generator=g) * 0.02
                state[name] = t.to(torch.bfloat16)
    for k in list(state):
        if k.endswith("e_score_correction_bias"):
            state[k] = state[k].float()  # vendors keep the routing bias in fp32
    # check our config-derived table against what transformers wrote (names and shapes)
    expected = {n: s for n, s, _ in A.expected(text)}
    text_state = {k: tuple(v.shape) for k, v in state.items()
                  if A.role_of(k)[0] not in ("vision", "projector", "other") or k in expected}
    if expected != text_state:
        missing = sorted(set(expected) - set(text_state))[:5]
        extra = sorted(set(text_state) - set(expected))[:5]
        bad = sorted(k for k in set(expected) & set(text_state) if expected[k] != text_state[k])[:5]
        raise AssertionError(f"{arch}: tensor table disagrees with transformers: missing {missing} extra {extra} "
                             f"shape {bad}")

    tensors: dict[str, torch.Tensor] = {}
    not_converted: list[str] = []
    for name in sorted(state, key=_natural):
        t = state[name]
        role, _ = A.role_of(name)
        lin, _, keep = ROLES[role]
        if layout == "fp8" and name.endswith(".weight") and t.ndim == 2 and lin and not keep:
            q, s = fp8.quant_block(t.float())
            tensors[name] = q
            tensors[name[: -len("weight")] + "weight_scale_inv"] = s
        elif layout == "int4" and name.endswith(".weight") and t.ndim == 2 and role in EXPERT_ROLES:
            tensors.update(moonshot_int4(name[: -len(".weight")], t))
        else:
            tensors[name] = t.contiguous()
            if name.endswith(".weight") and t.ndim == 2 and lin:
                not_converted.append(name[: -len(".weight")])
    if layout == "int4":
        cfg_dict["quantization_config"] = json.loads(json.dumps(MOONSHOT_INT4))
    if layout == "fp8":
        qc = dict(VENDOR_FP8)
        mods = sorted(set(not_converted), key=_natural)
        if arch == "glm_moe_dsa":
            # zai-org lists `indexers_proj`, a module that does not exist (docs/formats.md#glm-5-fp8-releases)
            mods += [f"model.layers.{i}.self_attn.indexers_proj" for i in range(int(text["num_hidden_layers"]))]
        qc["modules_to_not_convert"] = mods
        cfg_dict["quantization_config"] = qc
    cfg_dict["torch_dtype"] = "bfloat16"
    return tensors, cfg_dict, text


def _write(arch: str, out: Path, tensors: dict[str, torch.Tensor], cfg_dict: dict, text: dict, num_shards: int):
    _write_shards(out, tensors, num_shards)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True, default=str))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1, "max_new_tokens": 16},
                                                           indent=2))
    (out / "chat_template.jinja").write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                                             "<|assistant|>")
    _write_tokenizer(out, int(text["vocab_size"]))
    if arch == "kimi_k25":
        (out / "preprocessor_config.json").write_text(json.dumps(KIMI_PREPROCESSOR, indent=2))


def moonshot_int4(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A weight as Moonshot's QAT release stores it: symmetric INT4, group 32, on a 15-code grid
    (scale = bf16(group absmax / 7), codes in [-7, 7]; our RTN divides by 7.5 and uses -8 too, so
    re-rounding would show), compressed-tensors pack-quantized (``weight_packed`` / ``weight_scale``
    / ``weight_shape``)."""
    from ..formats import int4

    out_f, k = w.shape
    g = w.float().reshape(out_f, k // MOONSHOT_GROUP, MOONSHOT_GROUP)
    scale = (g.abs().amax(-1) / 7).to(torch.bfloat16)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    q = torch.round(g / safe.unsqueeze(-1)).clamp(-7, 7).to(torch.int8).reshape(out_f, k)
    return {f"{module}.weight_packed": int4.pack_int4(q), f"{module}.weight_scale": scale.contiguous(),
            f"{module}.weight_shape": torch.tensor([out_f, k], dtype=torch.int64)}


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.replace(".", " . ").split()]


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    target = math.ceil(total / max(1, num_shards))
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        b = tensors[n].numel() * tensors[n].element_size()
        if size + b > target and groups[-1] and len(groups) < num_shards:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += b
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))


TOKENS = (["<unk>", "<eos>", "<pad>"]
          + "the a of to and in is it that for on with as be by this are or at from what how many".split()
          + [chr(c) for c in range(32, 127)])  # the tiny tokenizer's vocabulary: a vocab_size holds at least these
SIZE_KEY = re.compile(r"(^num_|^n_|_size$|_rank$|_dim$|^first_k_dense_replace$|^topk_group$)")


def check_overrides(arch: str, overrides: dict | None) -> None:
    """Before any model is built: every size a positive integer (``first_k_dense_replace`` may be
    0) and ``vocab_size`` at least the tiny tokenizer's ``len(TOKENS)``; one line naming the key."""
    for k, v in (overrides or {}).items():
        if not SIZE_KEY.search(k):
            continue
        low = 0 if k == "first_k_dense_replace" else 1
        if type(v) is not int or v < low:
            raise QuantizeError(
                f"make-tiny --override {k}={json.dumps(v)}: a size must be an integer of at least {low}"
            )
        if k == "vocab_size" and v < len(TOKENS):
            raise QuantizeError(
                f"make-tiny --override vocab_size={v}: the tiny tokenizer has {len(TOKENS)} tokens; use at least that"
            )
    # the sizes that must agree with each other, on the config the overrides change
    base = MLA_TEXT if arch == "kimi_k25" else TINY[arch]["kwargs"]
    cfg = {**base, **VENDOR_ROUTER.get(arch, {}), **(overrides or {})}
    rules = (
        ("num_experts_per_tok", "n_routed_experts", "routes to more experts than a layer has"),
        ("first_k_dense_replace", "num_hidden_layers", "makes more dense layers than the model has"),
        ("topk_group", "n_group", "selects more expert groups than there are"),
    )
    for small, big, why in rules:
        a, b = cfg.get(small), cfg.get(big)
        if (small in (overrides or {}) or big in (overrides or {})) and type(a) is int and type(b) is int and a > b:
            raise QuantizeError(f"make-tiny --override: {small} {a} {why} ({big} {b}); change the override")
    h, n = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if ({"hidden_size", "num_attention_heads"} & set(overrides or {}) and type(h) is int and type(n) is int
            and "head_dim" not in cfg and "qk_nope_head_dim" not in cfg and h % n):
        raise QuantizeError(f"make-tiny --override: hidden_size {h} is not a multiple of num_attention_heads {n}; "
                            "change the override")


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A real (tiny, byte-level BPE-free) tokenizer transformers can load: WordLevel over words
    and characters, ids < vocab_size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(TOKENS)}
    assert len(vocab) <= vocab_size  # check_overrides refused a smaller vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Split("", "isolated")])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<eos>", "pad_token": "<pad>",
        "model_max_length": 512}, indent=2))


def parse_overrides(items: list[str]) -> dict:
    """``["kv_lora_rank=512", "scoring_func=softmax"]`` -> ``{"kv_lora_rank": 512, "scoring_func": "softmax"}``:
    each VALUE parsed as JSON (numbers, true/false/null, lists, objects), else kept as a string."""
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise QuantizeError(f"make-tiny --override {item!r}: expected KEY=VALUE, e.g. --override kv_lora_rank=512")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out
