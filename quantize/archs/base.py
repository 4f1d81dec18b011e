"""What an architecture declares, as data: tensor-name rules -> roles, which roles each profile
quantizes, the TP split of each role, the engine-side fusions and the MTP quirks.

A role is a name from ``ROLES``. Rules are regexes over the name *inside* a decoder layer
(``self_attn.q_a_proj.weight``) or, for tensors outside the layers, over the whole name without
the architecture's prefix (``model.embed_tokens.weight``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from .attention import AttentionLayout, attention_layout

# role -> (is a Linear weight, TP split, vendor FP8 source keeps it high precision)
#   split: "col" (split out dim), "row" (split in dim), "rep" (replicated), "vocab" (split rows)
ROLES: dict[str, tuple[bool, str, bool]] = {
    "embed": (False, "vocab", True),
    "lm_head": (True, "vocab", True),
    "norm": (False, "rep", True),
    "router": (True, "rep", True),
    "router_bias": (False, "rep", True),
    "attn_q_a": (True, "rep", False),
    "attn_q_b": (True, "col", False),
    "attn_kv_a": (True, "rep", False),
    "attn_kv_b": (True, "col", False),
    "attn_q": (True, "col", False),
    "attn_k": (True, "col", False),
    "attn_v": (True, "col", False),
    "attn_o": (True, "row", False),
    "indexer": (True, "rep", False),
    "indexer_weights": (True, "rep", True),
    "dense_gate": (True, "col", False),
    "dense_up": (True, "col", False),
    "dense_down": (True, "row", False),
    "shared_gate": (True, "col", False),
    "shared_up": (True, "col", False),
    "shared_down": (True, "row", False),
    "expert_gate": (True, "col", False),
    "expert_up": (True, "col", False),
    "expert_down": (True, "row", False),
    "mtp_proj": (True, "rep", True),
    "mtp_head": (True, "vocab", True),
    "vision": (True, "rep", True),
    "projector": (True, "rep", True),
    "other": (False, "rep", True),
}

EXPERT_ROLES = frozenset({"expert_gate", "expert_up", "expert_down"})
# roles whose input is the layer's own (normed) residual stream, which carries the earlier layers' error;
# the others (q_b, kv_b, o, down) read another projection of the same layer, which is what GPTQ's
# asymmetric calibration corrects (convert --asym: those would be corrected twice)
RESIDUAL_INPUT_ROLES = frozenset({"attn_q_a", "attn_kv_a", "attn_q", "attn_k", "attn_v", "dense_gate", "dense_up",
                                  "shared_gate", "shared_up", "expert_gate", "expert_up"})
# roles the engines build without a quant method whatever quantization_config says: the MoE router
# (SGLang 0.5.23 sglang/srt/models/deepseek_v2.py MoEGate holds a plain nn.Parameter; vLLM 0.33.0
# vllm/model_executor/models/deepseek_v2.py builds GateLinear with no quant_config), so a "Linear"
# target does not reach it (docs/engines.md#the-moe-router-is-never-quantized)
ENGINE_UNQUANTIZED = frozenset({"router"})
PROFILES = ("experts", "all-linear")
# roles no profile quantizes: embeddings/heads, the router, DSA indexer, MTP glue, vision
NEVER_INT4 = frozenset(
    {"embed", "lm_head", "router", "indexer", "indexer_weights", "mtp_proj", "mtp_head", "vision", "projector"}
)

# Engine-safe ignore patterns per high-precision role (docs/engines.md#ignore-list-matching): SGLang
# matches `re:` with re.match and plain names exactly or as a dotted suffix (some releases: as
# substrings), against ITS module names (fused ones too); compressed-tensors matches `re:` with
# re.match and plain names exactly. So every pattern but `lm_head` is a `re:.*` regex.
IGNORE_PATTERN: dict[str, str] = {
    "lm_head": "lm_head",
    "embed": "re:.*embed_tokens.*",
    "attention": "re:.*self_attn.*",
    "indexer": "re:.*self_attn\\.indexer.*",
    "indexer_weights": "re:.*self_attn\\.indexer\\.weights_proj.*",
    "shared": "re:.*shared_experts.*",
    "dense": "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    "router": "re:.*mlp\\.gate$",
    "mtp_proj": "re:.*eh_proj.*",
    "mtp_head": "re:.*shared_head.*",
    "vision": "re:.*vision_tower.*",
    "projector": "re:.*mm_projector.*",
}
ROLE_GROUP = {
    "lm_head": "lm_head",
    "embed": "embed",
    "attn_q_a": "attention",
    "attn_q_b": "attention",
    "attn_kv_a": "attention",
    "attn_kv_b": "attention",
    "attn_q": "attention",
    "attn_k": "attention",
    "attn_v": "attention",
    "attn_o": "attention",
    "indexer": "indexer",
    "indexer_weights": "indexer",
    "shared_gate": "shared",
    "shared_up": "shared",
    "shared_down": "shared",
    "dense_gate": "dense",
    "dense_up": "dense",
    "dense_down": "dense",
    "router": "router",
    "mtp_proj": "mtp_proj",
    "mtp_head": "mtp_head",
    "vision": "vision",
    "projector": "projector",
}


def profile_quantizes(profile: str, role: str) -> bool:
    if profile == "experts":
        return role in EXPERT_ROLES
    if profile == "all-linear":
        return ROLES[role][0] and role not in NEVER_INT4
    raise ValueError(profile)


@dataclass(frozen=True)
class Architecture:
    name: str  # registry key, e.g. "glm_moe_dsa"
    architectures: tuple[str, ...]  # config.json architectures[0] values
    model_types: tuple[str, ...]
    prefix: str  # "" or "language_model." (Kimi K2.5)
    layer_rules: tuple[tuple[str, str], ...]  # (regex on in-layer name, role)
    global_rules: tuple[tuple[str, str], ...]  # (regex on prefix-less name, role)
    text_config_key: str | None = None
    # engine module fusions: fused suffix -> member suffixes (SGLang/vLLM names)
    fusions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the engine's name for the MTP layer (SGLang names GLM-5's `model.decoder`)
    engine_mtp_name: str | None = None
    # the attention layout (archs/attention.py LAYOUTS): "mla" | "dsa" | "gqa"
    attention: str = "mla"
    # transformers' own text-model classes for layer-streamed calibration:
    # {"module": "deepseek_v3", "prefix": "DeepseekV3", "mask_kwargs": {...}, "topk": bool,
    #  "by_model_type": {text model_type: (module, prefix)} where a family spans several,
    #  "experts": the routed experts module in a decoder layer (fused gate_up_proj / down_proj),
    #  streamed a group of experts at a time (calibrate/experts.py)}
    hf: dict = field(default_factory=dict)
    # a reasoning model's parser in each engine, by its text config's model_type: {model_type: {engine:
    # --reasoning-parser name}} (SGLang 0.5.23 sglang/srt/parser/reasoning_parser_names.py, vLLM 0.32.0
    # vllm/reasoning/__init__.py); `eval --chat --thinking on` launches the engine with it
    reasoning_parsers: dict = field(default_factory=dict)
    # tensors from config alone: cfg(text) -> [(name, shape, role)]
    expected: Callable[[dict], list[tuple[str, tuple[int, ...], str]]] | None = None
    notes: str = ""

    @property
    def layout(self) -> AttentionLayout:
        return attention_layout(self.attention)

    def hf_classes(self, text: dict) -> tuple[str, str]:
        """(transformers module, class-name prefix) of this text config's layer classes."""
        by_type = self.hf.get("by_model_type", {})
        return by_type.get(text.get("model_type")) or (self.hf["module"], self.hf["prefix"])

    def reasoning_parser(self, cfg: dict, engine: str) -> str | None:
        """The engine's ``--reasoning-parser`` for this config's model, or None where none is known."""
        by_type = self.reasoning_parsers.get(self.text_config(cfg).get("model_type")) or self.reasoning_parsers.get(
            cfg.get("model_type")) or {}
        return by_type.get(engine)

    def text_config(self, cfg: dict) -> dict:
        if self.text_config_key:
            return cfg.get(self.text_config_key) or {}
        return cfg

    def num_layers(self, cfg: dict) -> int:
        return int(self.text_config(cfg)["num_hidden_layers"])

    def _compiled(self):
        return (
            [(re.compile(p), r) for p, r in self.layer_rules],
            [(re.compile(p), r) for p, r in self.global_rules],
            {},  # in-layer name -> role, filled as names are seen
        )

    def role_of(self, name: str) -> tuple[str, int | None]:
        """Tensor name -> (role, layer index or None). Unknown names get role "other"."""
        compiled = _COMPILED.get(self.name)
        if compiled is None:
            compiled = _COMPILED[self.name] = self._compiled()
        layer_rules, global_rules, memo = compiled
        rest = name[len(self.prefix) :] if self.prefix and name.startswith(self.prefix) else name
        m = _LAYER_RE.match(rest)
        if m:
            layer, local = int(m.group(1)), m.group(2)
            role = memo.get(local)  # a layer rule sees only the name within the layer: one scan per distinct one
            if role is None:
                module = local.rsplit(".", 1)[0]
                role = next((r for rx, r in layer_rules if rx.fullmatch(local) or rx.fullmatch(module)), "other")
                memo[local] = role
            return role, layer
        module = rest.rsplit(".", 1)[0]
        for rx, role in global_rules:
            if rx.fullmatch(rest) or rx.fullmatch(module):
                return role, None
        return "other", None

    def engine_module_names(self, module: str, cfg: dict) -> list[str]:
        """The serving engine's name(s) for a checkpoint module: prefix stripped (SGLang builds
        Kimi's language model with an empty prefix), MTP layer renamed, fused modules added."""
        name = module
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix) :]
        m = _LAYER_RE.match(name)
        if m and self.engine_mtp_name and int(m.group(1)) >= self.num_layers(cfg):
            name = f"{self.engine_mtp_name}.{m.group(2)}"
        names = [name]
        for fused, members in self.fusions.items():
            for member in members:
                if name.endswith("." + member):
                    names.append(name[: -len(member)] + fused)
        return names

    def fused_members(self, module: str) -> list[str]:
        """Sibling checkpoint modules an engine fuses with ``module`` (itself included)."""
        for members in self.fusions.values():
            for member in members:
                if module.endswith("." + member):
                    base = module[: -len(member)]
                    return [base + x for x in members]
        return [module]


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_COMPILED: dict[str, tuple] = {}
