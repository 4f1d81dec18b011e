"""make-tiny writes checkpoints as the vendors ship them: router keys in config.json, config
overrides (CLI --override KEY=VALUE), and a Kimi K2.5 fixture with the release's text_config,
vision_config, vision tower names and preprocessor_config.json."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from quantize.errors import QuantizeError
from quantize.testing.tiny import parse_overrides

ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "n_group": 1, "topk_group": 1}


def _names(d) -> set[str]:
    return set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("arch,scaling", [("deepseek_v3", 2.5), ("glm_moe_dsa", 2.5), ("kimi_k25", 2.827)])
def test_router_keys_as_the_releases_carry_them(tiny, arch, scaling):
    cfg = json.loads((tiny(arch) / "config.json").read_text())
    text = cfg["text_config"] if arch == "kimi_k25" else cfg
    assert {k: text.get(k) for k in ROUTER} == ROUTER
    assert text["routed_scaling_factor"] == scaling


def test_kimi_fixture_is_the_release_layout(tiny):
    d = tiny("kimi_k25")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["text_config"]["model_type"] == "deepseek_v3"
    assert cfg["media_placeholder_token_id"] == 163605 and cfg["use_unified_vision_chunk"] is True
    v = cfg["vision_config"]
    # the vendor's keys (moonshotai/Kimi-K2.5 config.json), sizes scaled down ...
    assert {k: v[k] for k in ("init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time", "merge_kernel_size", "merge_type",
                              "mm_projector_type", "patch_size", "pos_emb_type", "projector_hidden_act", "projector_ln_eps",
                              "video_attn_type")} == {
        "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4, "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "patch_size": 14, "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "video_attn_type": "spatial_temporal"}
    assert (v["vt_hidden_size"], v["vt_num_hidden_layers"], v["vt_num_attention_heads"], v["vt_intermediate_size"]) == (64, 1, 2, 128)
    assert v["mm_hidden_size"] == v["vt_hidden_size"] and v["text_hidden_size"] == cfg["text_config"]["hidden_size"]
    # ... and transformers' names with the same values (what transformers and vLLM read)
    assert (v["hidden_size"], v["num_hidden_layers"], v["num_attention_heads"], v["intermediate_size"]) == (64, 1, 2, 128)
    names = _names(d)
    assert {"vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.proj.bias", "vision_tower.patch_embed.pos_emb.weight",
            "vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.encoder.blocks.0.mlp.fc0.weight",
            "vision_tower.encoder.final_layernorm.weight", "mm_projector.pre_norm.weight", "mm_projector.proj.0.weight",
            "mm_projector.proj.2.weight"} <= names
    assert not any(n.startswith("vision_tower.encoder.patch_embed") for n in names)
    pre = json.loads((d / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert pre["patch_size"] == 14 and pre["merge_kernel_size"] == 2 and pre["in_patch_limit"] == 16384
    assert pre["image_mean"] == [0.5, 0.5, 0.5] and pre["temporal_merge_kernel_size"] == 4


def test_kimi_fixture_loads_in_transformers_with_nothing_missing(tiny):
    import torch
    import transformers

    m, info = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(tiny("kimi_k25", layout="bf16"), dtype=torch.bfloat16,
                                                                            output_loading_info=True)
    assert not info["missing_keys"]
    assert m.config.vision_config.hidden_size == 64
    # what transformers does not load is the MTP layer only (it has no MTP module)
    assert all(".layers.3." in k for k in info["unexpected_keys"])


def test_overrides_reach_the_config_and_the_tensors(tiny):
    d = tiny("deepseek_v3", overrides={"kv_lora_rank": 512, "first_k_dense_replace": 3})
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["kv_lora_rank"] == 512 and cfg["first_k_dense_replace"] == 3
    norm = "model.layers.0.self_attn.kv_a_layernorm.weight"
    with safe_open(str(d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][norm]), "pt") as f:
        assert f.get_slice(norm).get_shape() == [512]
    names = _names(d)
    assert "model.layers.2.mlp.gate_proj.weight" in names and not any(n.startswith("model.layers.2.mlp.experts") for n in names)
    assert any(n.startswith("model.layers.3.mlp.experts.") for n in names)  # the MTP layer stays MoE, as the release's


def test_parse_overrides():
    assert parse_overrides(["kv_lora_rank=512", "scoring_func=softmax", "norm_topk_prob=false", "x=[1,2]", "y="]) == {
        "kv_lora_rank": 512, "scoring_func": "softmax", "norm_topk_prob": False, "x": [1, 2], "y": ""}
    with pytest.raises(QuantizeError, match="expected KEY=VALUE"):
        parse_overrides(["kv_lora_rank"])


def test_make_tiny_cli_override(tmp_path):
    from quantize.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["make-tiny", "kimi_k25", str(tmp_path / "k"), "--override", "kv_lora_rank=512", "--override", "n_group=1"])
    assert res.exit_code == 0, res.output
    text = json.loads((tmp_path / "k" / "config.json").read_text())["text_config"]
    assert text["kv_lora_rank"] == 512 and text["routed_scaling_factor"] == 2.827
    res = runner.invoke(app, ["make-tiny", "llama", str(tmp_path / "l"), "--override", "oops"])
    assert res.exit_code == 2 and "make-tiny --override 'oops': expected KEY=VALUE" in res.stderr
