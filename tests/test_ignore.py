"""The ignore list written to config.json holds in the serving engines, which match it against
THEIR module names (docs/engines.md#ignore-list-matching), and recipes are validated the same way."""

import json
import re
from pathlib import Path

import pytest

from quantize.archs import REGISTRY
from quantize.convert import convert
from quantize.plan import plan
from quantize.errors import QuantizeError
from quantize.recipe import load_recipe

from .conftest import dir_bytes

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def sglang_ignores(name: str, ignore: list[str]) -> bool:
    """Independent restatement of SGLang's should_ignore_layer: `re:` -> re.match (anchored at
    the start), plain -> case-insensitive substring."""
    return any(re.match(p[3:], name) if p.startswith("re:") else p.lower() in name.lower() for p in ignore)


def engine_names(arch: str, module: str, layers: int) -> list[str]:
    """SGLang's names, written out by hand: Kimi's language_model. prefix stripped, GLM-5's MTP
    layer as model.decoder, and the fused projections."""
    name = module.removeprefix("language_model.")
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if arch == "glm_moe_dsa" and m and int(m.group(1)) >= layers:
        name = "model.decoder." + m.group(2)
    out = [name]
    for a, fused in ((r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)$", "self_attn.fused_qkv_a_proj_with_mqa"),
                     (r"mlp\.shared_experts\.(gate|up)_proj$", "mlp.shared_experts.gate_up_proj"),
                     (r"mlp\.(gate|up)_proj$", "mlp.gate_up_proj")):
        if re.search(a, name):
            out.append(re.sub(a, fused, name))
    return out


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "kimi_k25"])
@pytest.mark.parametrize("profile", ["experts", "all-linear"])
def test_ignore_list_holds_in_sglang(arch, profile, tiny):
    p = plan(tiny(arch), profile=profile)
    ignore = p.quantization_config["ignore"]
    layers = REGISTRY[arch].num_layers(p.config)
    seen_fused = seen_mtp = 0
    for j in p.jobs:
        if not (j.name.endswith(".weight") and len(j.wshape) == 2) or j.role in ("embed", "norm"):
            continue
        for name in engine_names(arch, j.module, layers):
            assert sglang_ignores(name, ignore) == (j.kind not in ("int4", "pass_int4")), (name, j.kind, ignore)
            seen_fused += "fused_qkv_a_proj_with_mqa" in name
            seen_mtp += name.startswith("model.decoder.")
    assert seen_fused > 0
    assert seen_mtp > 0 if arch == "glm_moe_dsa" else seen_mtp == 0


@pytest.mark.parametrize("layout,expert,other", [("fp8", "int4", "dequant"), ("vendor", "pass_int4", "copy")])
def test_expert_profile_keeps_kimi_layout(layout, expert, other, tiny):
    """Kimi K2 Instruct's FP8 (experts quantized, the rest dequantized) and Moonshot's INT4 K2.6
    (experts passed through, the rest copied): the same layout out."""
    p = plan(tiny("kimi_k25", layout=layout))
    kinds = {j.role: j.kind for j in p.jobs}
    assert kinds["expert_gate"] == expert and kinds["attn_kv_b"] == other and kinds["shared_up"] == other
    assert kinds["vision"] == "copy" and kinds["lm_head"] == "copy"
    assert "re:.*vision_tower.*" in p.quantization_config["ignore"]


def _recipe(tmp_path, ignore, group=32, extra="", symmetric="true"):
    body = "\n".join(f"        - '{i}'" for i in ignore)
    f = tmp_path / "r.yaml"
    f.write_text(f"""quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore:
{body}
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {{num_bits: 4, type: int, symmetric: {symmetric}, strategy: group, group_size: {group}{extra}}}
""")
    return str(f)


@pytest.mark.parametrize("arch,recipe,layout", [("glm_moe_dsa", "glm-5.2-w4a16-experts.yaml", "vendor"),
                                                 ("kimi_k25", "kimi-k2.6-w4a16-experts.yaml", "fp8"),
                                                 ("kimi_k25", "kimi-k2.6-w4a16-experts.yaml", "vendor")])
def test_shipped_recipes_equal_the_experts_profile(arch, recipe, layout, tiny, converted, tmp_path):
    """The same tensors as the experts profile; the same ignore list where the source has an MTP
    layer (Moonshot's INT4 release has none, so the recipe's MTP patterns are extra there)."""
    out = tmp_path / "r"
    convert(tiny(arch, layout=layout), out, recipe=str(RECIPES / recipe))
    a, b = dir_bytes(out), dir_bytes(converted(arch, layout=layout, group_size=32))
    a.pop("quantize_manifest.json"), b.pop("quantize_manifest.json")
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a if k != "config.json")
    qa = json.loads(a["config.json"])["quantization_config"]
    qb = json.loads(b["config.json"])["quantization_config"]
    assert qa["config_groups"] == qb["config_groups"]
    if layout == "vendor" and arch == "kimi_k25":
        assert set(qa["ignore"]) - set(qb["ignore"]) == {"re:.*eh_proj.*", "re:.*shared_head.*"}
    else:
        assert set(qa["ignore"]) == set(qb["ignore"])


def test_recipe_splitting_a_fused_module_is_refused(tiny, tmp_path):
    ign = ["lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$", "re:.*indexer.*", "re:.*eh_proj.*", "re:.*shared_head.*", "re:.*q_a_proj$"]
    with pytest.raises(QuantizeError, match="engines fuse"):
        plan(tiny("glm_moe_dsa"), recipe=_recipe(tmp_path, ign))


def test_recipe_ignoring_mtp_by_layer_index_is_refused(tiny, tmp_path):
    """SGLang names GLM-5's MTP layer model.decoder: an index-based ignore does nothing there."""
    base = [i for i in load_recipe(RECIPES / "glm-5.2-w4a16-experts.yaml").ignore]
    with pytest.raises(QuantizeError, match=r"engine module model\.decoder\.mlp\.experts"):
        plan(tiny("glm_moe_dsa"), recipe=_recipe(tmp_path, base + ["re:^model\\.layers\\.3\\..*"]))


def test_recipe_errors(tmp_path):
    with pytest.raises(QuantizeError, match="symmetric INT4"):
        load_recipe(_recipe(tmp_path, ["lm_head"], symmetric="false"))
    (tmp_path / "x.yaml").write_text("stage: {}\n")
    with pytest.raises(QuantizeError, match="no QuantizationModifier"):
        load_recipe(tmp_path / "x.yaml")
    with pytest.raises(QuantizeError, match="group_size 48"):
        load_recipe(_recipe(tmp_path, ["lm_head"], group=48))
