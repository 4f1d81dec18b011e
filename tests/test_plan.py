"""plan: from headers (or config.json alone), no tensor data; published GLM-5 figures."""

import json
import subprocess
import sys

import pytest

import quantize.checkpoint.index as index_mod
from quantize.plan import plan
from quantize.errors import QuantizeError

GiB = 2**30


@pytest.fixture(scope="module")
def glm5_config_dir(tmp_path_factory):
    """The full-size GLM-5 architecture: transformers' GlmMoeDsaConfig defaults (= the release),
    one MTP layer, zai-org's block-FP8 quantization_config. No weights."""
    from transformers import GlmMoeDsaConfig

    d = tmp_path_factory.mktemp("glm5")
    cfg = GlmMoeDsaConfig().to_dict()
    cfg.update(architectures=["GlmMoeDsaForCausalLM"], num_nextn_predict_layers=1,
               quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]})
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_full_size_glm5_published_figures(glm5_config_dir):
    s = plan(glm5_config_dir, tp=8, group_size=32, profile="experts").summary()
    assert abs(s["source_bytes"] / GiB - 705) < 705 * 0.005  # measured 706.0
    assert abs(s["output_bytes"] / GiB - 421) < 421 * 0.005  # measured 422.7
    assert abs(s["even_split_source_bytes"] / GiB - 88) < 1.0
    assert abs(s["even_split_output_bytes"] / GiB - 52) < 1.0
    # the largest rank also holds every replicated tensor: more than the even split, by < 5 GiB
    assert 0 < s["per_rank_output_bytes"] - s["even_split_output_bytes"] < 5 * GiB
    assert s["roles"]["expert_gate"] == {"int4": 76 * 256}  # 75 MoE layers + the MTP layer


def test_mtp_layers_counted(glm5_config_dir, tmp_path):
    cfg = json.loads((glm5_config_dir / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with_mtp = plan(glm5_config_dir).summary()
    without = plan(tmp_path).summary()
    assert without["roles"]["expert_gate"]["int4"] == 75 * 256
    assert 10.5 * GiB < with_mtp["source_bytes"] - without["source_bytes"] < 11.5 * GiB  # one MoE layer + eh_proj + head


def test_plan_reads_no_tensor_data(tiny, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("plan read tensor data")

    monkeypatch.setattr(index_mod, "read_tensor", boom)
    s = plan(tiny("kimi_k25"), tp=2).summary()
    assert s["roles"]["expert_down"] == {"int4": 24} and s["roles"]["vision"]["copy"] > 0
    assert s["per_rank_output_bytes"] < s["output_bytes"]


def test_plan_json_cli(glm5_config_dir):
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "plan", str(glm5_config_dir), "--tp", "8", "--json"],
                       capture_output=True, text=True, check=True)
    s = json.loads(p.stdout)
    for k in ("source_bytes", "output_bytes", "per_rank_source_bytes", "per_rank_output_bytes"):
        assert isinstance(s[k], int) and s[k] > 0


def test_plan_refuses_group_not_dividing_k(tmp_path):
    """SmolLM2's case: hidden 576 is not a multiple of 128 (here 192)."""
    from quantize.testing.tiny import make_tiny

    d = make_tiny("llama", tmp_path / "s", fp8_source=False, overrides={"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1})
    with pytest.raises(QuantizeError, match=r"K=192, not a multiple of group size 128; use --group-size 64"):
        plan(d, group_size=128, profile="all-linear")
    assert plan(d, group_size=64, profile="all-linear").summary()["jobs"]["int4"] == 14


def _kimi_k26_config_dir(d):
    """Kimi K2.6's published architecture (kimi_k25 wrapper, deepseek_v3 text model), FP8 source."""
    text = dict(model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64,
                n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, q_lora_rank=1536, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_nextn_predict_layers=0, tie_word_embeddings=False)
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
           "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_kv_capacity_kimi_k26_doubles_and_lands_near_published(tmp_path):
    """Published for Kimi K2.6's decode pool (8x H200): 686K tokens BF16 -> 1.37M FP8 KV."""
    s = plan(_kimi_k26_config_dir(tmp_path), tp=8).summary()
    assert s["kv_bytes_per_token"] == {"bf16": 61 * 576 * 2, "fp8": 61 * 576}
    t = s["kv_tokens_per_gpu"]
    assert t["fp8"] in (2 * t["bf16"], 2 * t["bf16"] + 1)
    assert abs(t["bf16"] - 686_000) < 0.05 * 686_000 and abs(t["fp8"] - 1_370_000) < 0.05 * 1_370_000
    assert s["kv_capacity_inputs"]["mem_fraction"] == 0.85 and s["kv_capacity_inputs"]["gpu_mem_gib"] > 140


def test_kv_capacity_glm5_dsa_layout(glm5_config_dir):
    s = plan(glm5_config_dir, tp=8).summary()
    # 656 B FP8 row + indexer 128 FP8 + 4 B scale, per layer, 78 layers (the MTP layer's cache only with speculation)
    assert s["kv_bytes_per_token"]["fp8"] == 78 * (656 + 132)
    assert s["kv_bytes_per_token"]["bf16"] == 78 * (576 * 2 + 132)


def test_kv_capacity_gqa_splits_heads(tiny):
    s = plan(tiny("llama", fp8_source=False), tp=2).summary()
    assert s["kv_bytes_per_token"]["bf16"] == 2 * 2 * (2 // 2) * 64 * 2  # layers x K,V x kv heads/rank x head_dim x 2 B
