"""plan: from headers (or config.json alone), no tensor data; published GLM-5 figures."""

import json
import subprocess
import sys

import pytest

import quantize.checkpoint.index as index_mod
from quantize.convert import plan
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
