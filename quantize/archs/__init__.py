"""Architecture registry: ``architectures[0]`` (or ``model_type``) -> Architecture.

Adding a family = one entry here, built from data; no ``if arch == ...`` outside this package.
"""

from __future__ import annotations

from functools import partial

from ..errors import QuantizeError
from .attention import LAYOUTS, AttentionLayout, attention_layout, cache_layout  # noqa: F401
from .base import ROLES, Architecture, profile_quantizes  # noqa: F401
from .gqa import GQA_FUSIONS, GQA_GLOBAL_RULES, GQA_LAYER_RULES, gqa_expected
from .mla import MLA_FUSIONS, MLA_GLOBAL_RULES, MLA_LAYER_RULES, mla_expected

REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    REGISTRY[arch.name] = arch
    return arch


register(Architecture(
    name="glm_moe_dsa",
    architectures=("GlmMoeDsaForCausalLM",),
    model_types=("glm_moe_dsa",),
    prefix="",
    layer_rules=MLA_LAYER_RULES,
    global_rules=MLA_GLOBAL_RULES,
    fusions=MLA_FUSIONS,
    engine_mtp_name="model.decoder",
    attention="dsa",
    hf={"module": "glm_moe_dsa", "prefix": "GlmMoeDsa", "mask_kwargs": {"allow_is_causal_skip": False}, "topk": True,
        "experts": "mlp.experts"},
    expected=partial(mla_expected, dsa=True, mtp_embed=False),
    reasoning_parsers={"glm_moe_dsa": {"sglang": "glm45", "vllm": "glm45"}},
    notes="GLM-5.x: MLA + DSA indexer, dense first layers, MTP layer at num_hidden_layers",
))

register(Architecture(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3", "kimi_k2"),
    prefix="",
    layer_rules=MLA_LAYER_RULES,
    global_rules=MLA_GLOBAL_RULES,
    fusions=MLA_FUSIONS,
    attention="mla",
    hf={"module": "deepseek_v3", "prefix": "DeepseekV3", "experts": "mlp.experts"},
    expected=partial(mla_expected, dsa=False, mtp_embed=True),
    reasoning_parsers={"deepseek_v3": {"sglang": "deepseek-v3", "vllm": "deepseek_v3"},
                       "kimi_k2": {"sglang": "kimi_k2", "vllm": "kimi_k2"}},
    notes="DeepSeek-V3 / Kimi K2: MLA, MTP layer at num_hidden_layers",
))

register(Architecture(
    name="kimi_k25",
    architectures=("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"),
    model_types=("kimi_k25",),
    prefix="language_model.",
    text_config_key="text_config",
    layer_rules=MLA_LAYER_RULES,
    global_rules=MLA_GLOBAL_RULES,
    fusions=MLA_FUSIONS,
    attention="mla",
    hf={"module": "deepseek_v3", "prefix": "DeepseekV3", "experts": "mlp.experts"},
    expected=partial(mla_expected, dsa=False, mtp_embed=True, prefix="language_model."),
    reasoning_parsers={"kimi_k25": {"sglang": "kimi_k2", "vllm": "kimi_k2"},
                       "kimi_k2": {"sglang": "kimi_k2", "vllm": "kimi_k2"}},
    notes="Kimi K2.5/K2.6: deepseek_v3 text model under language_model., vision tower",
))

register(Architecture(
    name="llama",
    architectures=("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"),
    model_types=("llama", "qwen2", "qwen3", "mistral"),
    prefix="",
    layer_rules=GQA_LAYER_RULES,
    global_rules=GQA_GLOBAL_RULES,
    fusions=GQA_FUSIONS,
    attention="gqa",
    hf={"module": "llama", "prefix": "Llama",
        "by_model_type": {"qwen2": ("qwen2", "Qwen2"), "qwen3": ("qwen3", "Qwen3"), "mistral": ("mistral", "Mistral")}},
    expected=gqa_expected,
    reasoning_parsers={"qwen3": {"sglang": "qwen3", "vllm": "qwen3"}},
    notes="dense GQA decoders (Llama, Qwen2/3, Mistral)",
))


def supported() -> list[str]:
    return sorted({a for arch in REGISTRY.values() for a in arch.architectures})


def resolve(config: dict, where: str = "config.json") -> Architecture:
    names = config.get("architectures") or []
    name = names[0] if names else None
    for arch in REGISTRY.values():
        if name in arch.architectures:
            return arch
    if not name:
        for arch in REGISTRY.values():
            if config.get("model_type") in arch.model_types:
                return arch
    raise QuantizeError(
        f"{where}: unknown architecture {name or config.get('model_type')!r}; supported: {', '.join(supported())}"
    )
