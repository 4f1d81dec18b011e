"""The registry's tensor-parallel split per role (quantize/archs/base.py ROLES) against transformers'
own TP plan for each architecture (the config's ``base_model_tp_plan`` plus the model class's
``_tp_plan``, as transformers 5.17 merges them on a built model).

Every parameter of the transformers model (built from the tiny configs, on the meta device) is
mapped to the on-disk tensor(s) it comes from, given its role by the registry, and compared with the
style transformers' own lookup picks for it. Where the two legitimately differ the difference is in
EXPECTED below, with the reason; any other disagreement, or an EXPECTED entry that no longer holds,
fails. See docs/engines.md#tensor-parallel-roles.
"""

from __future__ import annotations

import re
from functools import cache

import pytest
import torch

from quantize.archs import REGISTRY
from quantize.archs.base import ROLES

pytest.importorskip("transformers")
from transformers.distributed.tensor_parallel import _get_parameter_tp_plan  # noqa: E402

from quantize.testing.tiny import _build_model  # noqa: E402

ARCHS = ("glm_moe_dsa", "deepseek_v3", "kimi_k25", "llama")

# transformers' compressed-tensors quantizer (quantizers/quantizer_compressed_tensors.py, update_tp_plan)
# adds Llama-4 style `feed_forward.experts.*` keys to `config.get_text_config().base_model_tp_plan` in
# place, and that dict is the config CLASS's attribute: once any test has loaded one of our outputs in
# transformers, every later config of that class carries the keys. The plans compared here are the ones
# the classes declare, taken when this module is imported (before any test has loaded a model).
import copy  # noqa: E402

from transformers import CONFIG_MAPPING  # noqa: E402

_CONFIG_CLASSES = {t: CONFIG_MAPPING[t] for t in ARCHS if t in CONFIG_MAPPING}
_DECLARED = {t: copy.deepcopy(c.__dict__.get("base_model_tp_plan")) for t, c in _CONFIG_CLASSES.items()}


def _declared_plans() -> None:
    for t, c in _CONFIG_CLASSES.items():
        if _DECLARED[t] is not None:
            c.base_model_tp_plan = copy.deepcopy(_DECLARED[t])

# transformers' style names (transformers:distributed/tensor_parallel.py ParallelInterface) -> the
# axis of a Linear weight [out, in] they split. On an nn.Embedding [vocab, hidden] the axes swap
# meaning: ColwiseParallel shards dim 1 (hidden), RowwiseParallel dim 0 (vocab).
COL = {"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise", "local_colwise"}
ROW = {"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise", "local_rowwise", "embedding_rowwise"}
# styles that shard no weight: forward hooks only (gradient all-reduce, the MoE block's output
# reduction, MlaKvAProjParallel's rope-gradient all-reduce on kv_a_proj_with_mqa)
REPLICATED = {"replicated_with_grad_allreduce", "all_reduce", "sequence_parallel", "mla_kv_a_proj", "moe_tp_experts"}
# plan keys that name a module whose weights have keys of their own (the experts block's hook)
MODULE_ONLY = {"moe_tp_experts"}


def their_split(style: str | None, embedding: bool) -> str:
    """A transformers style in our split vocabulary: col / row / vocab / rep (or 'hidden', a split
    of an embedding's hidden dim that we never make)."""
    if style is None or style in REPLICATED:
        return "rep"
    if style in COL:
        return "hidden" if embedding else "col"
    if style in ROW:
        return "vocab" if embedding else "row"
    raise AssertionError(f"transformers TP style {style!r} has no mapping here: add it to COL, ROW or REPLICATED")


def our_split(role: str, roles: dict) -> str:
    """Our split for a role; a vocab split of a Linear [vocab, hidden] (lm_head, the MTP head) is
    its output split, i.e. 'col' (quantize/shard.py treats them alike: ``split in ("col", "vocab")``)."""
    is_linear, split, _ = roles[role]
    return "col" if split == "vocab" and is_linear else split


# (arch, role) -> (our split, transformers' split, why they legitimately differ)
_EMBED = ("vocab", "rep", "transformers has no embed_tokens entry (replicated); we split the vocabulary as the "
                          "engines' vocab-parallel embedding does")
_DSV3_ATTN = "DeepseekV3Config has no attention entries (replicated); the engines split MLA attention by heads " \
             "(q_b/kv_b ColumnParallelLinear, o_proj RowParallelLinear), as GlmMoeDsaConfig does"
EXPECTED: dict[tuple[str, str], tuple[str, str, str]] = {
    ("glm_moe_dsa", "embed"): _EMBED,
    ("deepseek_v3", "embed"): _EMBED,
    ("kimi_k25", "embed"): _EMBED,
    ("llama", "embed"): _EMBED,
    ("deepseek_v3", "attn_q_b"): ("col", "rep", _DSV3_ATTN),
    ("deepseek_v3", "attn_kv_b"): ("col", "rep", _DSV3_ATTN),
    ("deepseek_v3", "attn_o"): ("row", "rep", _DSV3_ATTN),
    # Kimi K2.5's text model is transformers' deepseek_v3 (Kimi_K25Config has no plan of its own)
    ("kimi_k25", "attn_q_b"): ("col", "rep", _DSV3_ATTN),
    ("kimi_k25", "attn_kv_b"): ("col", "rep", _DSV3_ATTN),
    ("kimi_k25", "attn_o"): ("row", "rep", _DSV3_ATTN),
    ("kimi_k25", "lm_head"): ("col", "rep", "Kimi_K25ForConditionalGeneration declares no _tp_plan (lm_head "
                                           "replicated); *ForCausalLM have lm_head: colwise_gather_output"),
}

# roles whose on-disk tensors are buffers (or absent) in transformers' model, so no parameter
# reaches them: the router's e_score_correction_bias is a buffer
NOT_PARAMETERS = {"router_bias"}


@cache
def _model(arch: str):
    _declared_plans()
    with torch.device("meta"):
        cfg, model = _build_model(arch, None)
    return cfg.to_dict(), model


def _disk_names(arch: str, param: str) -> list[str]:
    """The on-disk tensor name(s) a transformers parameter is loaded from: fused experts come from
    per-expert tensors (expert 0 stands for all), Kimi's runtime ``model.language_model.`` is
    ``language_model.model.`` on disk and its vision parts lie at the top."""
    name = param
    if arch == "kimi_k25":
        if name.startswith("model.language_model."):
            name = "language_model.model." + name[len("model.language_model."):]
        elif name == "lm_head.weight":
            name = "language_model.lm_head.weight"
        elif name.startswith("model."):
            name = name[len("model."):]
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        return [base + "0.gate_proj.weight", base + "0.up_proj.weight"]
    if name.endswith("mlp.experts.down_proj"):
        return [name[: -len("down_proj")] + "0.down_proj.weight"]
    return [name]


def compare(arch_name: str, roles: dict = ROLES) -> tuple[dict, set, list]:
    """(disagreements {role: {(ours, theirs, example)}}, plan keys used, untranslated parameters)."""
    arch = REGISTRY[arch_name]
    cfg, model = _model(arch_name)
    plan = model.tp_plan
    expected_names = {n for n, _, _ in arch.expected(arch.text_config(cfg))}
    diffs: dict[str, set] = {}
    used, unknown = set(), []
    for param, _ in model.named_parameters():
        style = _get_parameter_tp_plan(param, plan, is_weight=True)
        for key in plan:
            if _get_parameter_tp_plan(param, {key: "x"}, is_weight=True):
                used.add(key)
        module = model.get_submodule(param.rsplit(".", 1)[0])
        theirs = their_split(style, isinstance(module, torch.nn.Embedding))
        for disk in _disk_names(arch_name, param):
            role, _ = arch.role_of(disk)
            if role not in ("vision", "projector") and disk not in expected_names:
                unknown.append((param, disk))
            ours = our_split(role, roles)
            if ours != theirs:
                diffs.setdefault(role, set()).add((ours, theirs, disk))
    return diffs, used, unknown


def problems(arch_name: str, roles: dict = ROLES) -> list[str]:
    """Every disagreement not in EXPECTED, and every EXPECTED entry that no longer holds."""
    diffs, _, _ = compare(arch_name, roles)
    out = []
    for role, found in sorted(diffs.items()):
        pairs = {(o, t) for o, t, _ in found}
        want = EXPECTED.get((arch_name, role))
        if want is None or pairs != {want[:2]}:
            ex = sorted(found)[0]
            out.append(f"{arch_name} {role}: ours {ex[0]}, transformers {ex[1]} (e.g. {ex[2]})"
                       + ("" if want is None else f"; expected ours {want[0]}, transformers {want[1]}"))
    for (a, role), want in EXPECTED.items():
        if a == arch_name and role not in diffs:
            out.append(f"{arch_name} {role}: EXPECTED says ours {want[0]} vs transformers {want[1]}; they agree now")
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_registry_tp_roles_agree_with_transformers_plan(arch):
    assert problems(arch) == []


@pytest.mark.parametrize("arch", ARCHS)
def test_every_transformers_parameter_maps_to_a_registry_tensor(arch):
    """The name translation is honest: every text parameter lands on a tensor of the registry's own
    table, every plan key is exercised, and every table tensor (MTP layer aside: transformers drops
    it) is reached by some parameter."""
    a = REGISTRY[arch]
    cfg, model = _model(arch)
    _, used, unknown = compare(arch)
    assert unknown == []
    assert {k for k, v in model.tp_plan.items() if v not in MODULE_ONLY} <= used
    reached = {d for p, _ in model.named_parameters() for d in _disk_names(arch, p)}
    missing = sorted(n for n, _, role in a.expected(a.text_config(cfg))
                     if role not in NOT_PARAMETERS and not _mtp(a, a.role_of(n)[1], cfg) and n not in reached
                     and not _other_expert(n, reached))
    assert missing == []


def _mtp(a, layer: int | None, cfg: dict) -> bool:
    """A tensor of the MTP layer (numbered after the decoder layers), which transformers drops."""
    return layer is not None and layer >= a.num_layers(cfg)


def _other_expert(name: str, reached: set) -> bool:
    """Experts 1..E-1 are stood for by expert 0 (one fused parameter holds them all)."""
    return re.sub(r"\.experts\.\d+\.", ".experts.0.", name) in reached


def test_expected_differences_name_known_roles_and_archs():
    for (arch, role), (ours, theirs, why) in EXPECTED.items():
        assert arch in ARCHS and role in ROLES and why
        assert ours == our_split(role, ROLES) and ours != theirs


@pytest.mark.parametrize("role,flip", [("expert_down", "col"), ("attn_o", "rep"), ("attn_kv_a", "col")])
def test_a_flipped_role_is_reported(role, flip):
    """Near miss: one role changed in a copy of ROLES is named, for every architecture that has it."""
    roles = dict(ROLES)
    is_linear, _, keeps = roles[role]
    roles[role] = (is_linear, flip, keeps)
    hit = [arch for arch in ARCHS if any(p.startswith(f"{arch} {role}:") for p in problems(arch, roles))]
    have = [arch for arch in ARCHS if role in {r for _, _, r in REGISTRY[arch].expected(
        REGISTRY[arch].text_config(_model(arch)[0]))}]
    assert have and hit == have


def test_dropping_an_expected_difference_is_reported():
    """Near miss the other way: if our embeddings were replicated like transformers', the stale
    EXPECTED entry is named."""
    roles = dict(ROLES)
    roles["embed"] = (False, "rep", True)
    assert any("embed: EXPECTED says" in p for p in problems("llama", roles))
