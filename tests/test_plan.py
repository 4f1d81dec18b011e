"""plan: from headers (or config.json alone), no tensor data; published GLM-5 figures."""

import io
import json
import os
import struct
import subprocess
import sys

import pytest

from quantize.plan import ConvertOptions, build_plan, plan
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


@pytest.fixture(scope="module")
def glm5_tp8(glm5_config_dir):
    """The full-size GLM-5 plan at TP 8 (group 32, experts: the defaults), made once for the tests that read it."""
    return plan(glm5_config_dir, tp=8, group_size=32, profile="experts").summary()


def test_full_size_glm5_published_figures(glm5_tp8):
    s = glm5_tp8
    assert abs(s["source_bytes"] / GiB - 705) < 705 * 0.005  # measured 706.0
    assert abs(s["output_bytes"] / GiB - 421) < 421 * 0.005  # measured 422.7
    assert abs(s["even_split_source_bytes"] / GiB - 88) < 1.0
    assert abs(s["even_split_output_bytes"] / GiB - 52) < 1.0
    # the largest rank also holds every replicated tensor: more than the even split, by < 5 GiB
    assert 0 < s["per_rank_output_bytes"] - s["even_split_output_bytes"] < 5 * GiB
    assert s["roles"]["expert_gate"] == {"int4": 76 * 256}  # 75 MoE layers + the MTP layer


def test_mtp_layers_counted(glm5_config_dir, glm5_tp8, tmp_path):
    cfg = json.loads((glm5_config_dir / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with_mtp = glm5_tp8  # source bytes do not depend on the TP
    without = plan(tmp_path, tp=8).summary()
    assert without["roles"]["expert_gate"]["int4"] == 75 * 256
    assert 10.5 * GiB < with_mtp["source_bytes"] - without["source_bytes"] < 11.5 * GiB  # one MoE layer + eh_proj + head


def _rchar() -> int:
    """Bytes this process has read through read(2)/pread(2)/readv(2)/... so far, from any library."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_plan_reads_no_tensor_data(tiny, monkeypatch):
    """Counts the bytes the process really reads while planning: every read-family system call of
    any library (the kernel's rchar), and, per call, where in which file each os-level read
    (os.read/pread/readv/preadv, which read_tensor uses) lands. config.json, the index and each
    shard's 8-byte length + JSON header may be read; no byte at or past a shard's data start."""
    src = tiny("kimi_k25")
    shards = sorted(src.glob("*.safetensors"))
    data_start = {}
    for f in shards:
        with open(f, "rb") as fh:
            data_start[str(f.resolve())] = 8 + struct.unpack("<Q", fh.read(8))[0]
    small = sum((src / n).stat().st_size for n in ("config.json", "model.safetensors.index.json"))
    # buffered header reads may run ahead to the end of the buffer (one buffer per shard at most)
    buf = max(io.DEFAULT_BUFFER_SIZE, *(f.stat().st_blksize for f in shards))
    allowed = small + sum(-(-n // buf) * buf for n in data_start.values()) + 1024  # + reading /proc/self/io
    tensor_bytes = sum(f.stat().st_size for f in shards) - sum(data_start.values())
    assert tensor_bytes > 50 * (allowed - small - sum(data_start.values()))  # the bound sees any real read
    plan(tiny("kimi_k25"), tp=2)  # modules imported lazily are read here, outside the count

    reads: list[tuple[str, int | None, int]] = []

    def spy(name):
        real = getattr(os, name)

        def wrapper(fd, *args):
            try:
                off = args[-1] if name in ("pread", "preadv") else os.lseek(fd, 0, os.SEEK_CUR)
            except OSError:
                off = None  # a pipe
            got = real(fd, *args)
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = "?"
            reads.append((path, off, len(got) if isinstance(got, bytes) else got))
            return got

        monkeypatch.setattr(os, name, wrapper)

    for name in ("read", "pread", "readv", "preadv"):
        spy(name)
    before = _rchar()
    s = plan(src, tp=2).summary()
    read = _rchar() - before
    monkeypatch.undo()
    into_data = [(p, off, n) for p, off, n in reads if p in data_start and (off is None or off + n > data_start[p])]
    assert into_data == []
    assert read <= allowed, f"plan read {read} bytes; headers, config.json and the index are at most {allowed}"
    assert s["roles"]["expert_down"] == {"pass_int4": 16} and s["roles"]["vision"]["copy"] > 0  # Moonshot's INT4
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

    d = make_tiny("llama", tmp_path / "s", layout="bf16", overrides={"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1})
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


def test_kv_capacity_glm5_dsa_layout(glm5_tp8):
    s = glm5_tp8
    # 656 B FP8 row + indexer 128 FP8 + 4 B scale, per layer, 78 layers (the MTP layer's cache only with speculation)
    assert s["kv_bytes_per_token"]["fp8"] == 78 * (656 + 132)
    assert s["kv_bytes_per_token"]["bf16"] == 78 * (576 * 2 + 132)


def test_kv_capacity_gqa_splits_heads(tiny):
    s = plan(tiny("llama", layout="bf16"), tp=2).summary()
    assert s["kv_bytes_per_token"]["bf16"] == 2 * 2 * (2 // 2) * 64 * 2  # layers x K,V x kv heads/rank x head_dim x 2 B


def test_plan_refuses_bad_capacity_inputs_and_tp(tiny, glm5_config_dir):
    """Each refused in one line naming the option, before the KV capacity is computed from it."""
    src = tiny("kimi_k25")  # 4 attention heads
    for kw, msg in [(dict(mem_fraction=0.0), r"--mem-fraction 0\.0: .* \(0, 1\]"), (dict(mem_fraction=1.5), r"--mem-fraction 1\.5: "),
                    (dict(mem_fraction=float("nan")), r"--mem-fraction nan: "), (dict(gpu_mem_gib=-80.0), r"--gpu-mem-gib -80\.0: .*positive"),
                    (dict(gpu_mem_gib=0.0), r"--gpu-mem-gib 0\.0: "), (dict(reserve_gib=-1.0), r"--reserve-gib -1\.0: "),
                    (dict(tp=3), r"--tp 3: 4 attention heads in .*config\.json do not split over TP 3; use a TP that divides 4 \(1, 2, 4\)")]:
        with pytest.raises(QuantizeError, match=msg) as e:
            plan(src, **kw)
        assert "\n" not in str(e.value)
    # the full-size GLM-5 config: 64 heads, which TP 6 does not divide
    with pytest.raises(QuantizeError, match=r"--tp 6: 64 attention heads"):
        plan(glm5_config_dir, tp=6)
    assert plan(src, tp=4, mem_fraction=1.0, reserve_gib=0.0).kv.mem_fraction == 1.0  # the edges are allowed
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "plan", str(src), "--mem-fraction", "2"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--mem-fraction 2.0" in p.stderr


def test_kimi_text_config_heads_decide_tp(tmp_path):
    d = _kimi_k26_config_dir(tmp_path)
    with pytest.raises(QuantizeError, match=r"--tp 48: 64 attention heads"):
        plan(d, tp=48)


def _recipe(tmp_path, group=32, observer=None):
    f = tmp_path / f"r{group}{observer or ''}.yaml"
    obs = f", observer: {observer}" if observer else ""
    f.write_text(f"""quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head", "re:.*embed_tokens.*"]
      config_groups:
        group_0:
          targets: ["re:.*mlp\\\\.experts\\\\..*"]
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: {group}{obs}}}
""")
    return str(f)


def test_recipe_conflicting_flags_refused_and_resolved_options_recorded(tiny, tmp_path):
    """An explicit --group-size / --observer / non-default --profile that contradicts the recipe is
    refused in one line (it used to be replaced silently); values not given come from the recipe,
    else the defaults, and the plan's options (what the resume record and manifest hold) are the
    resolved ones, never None."""
    src = tiny("glm_moe_dsa")
    r128, r64mse = _recipe(tmp_path, 128), _recipe(tmp_path, 64, "mse")
    with pytest.raises(QuantizeError, match=rf"^--group-size 64 conflicts with group_size 128 in {r128}; drop the flag or edit the recipe$"):
        plan(src, recipe=r128, group_size=64)
    with pytest.raises(QuantizeError, match=rf"^--profile all-linear conflicts with {r128}, whose targets and ignore list decide what is INT4"):
        plan(src, recipe=r128, profile="all-linear")
    with pytest.raises(QuantizeError, match=rf"^--observer minmax conflicts with observer mse in {r64mse}; drop the flag or edit the recipe$"):
        build_plan(src, ConvertOptions(observer="minmax", recipe=r64mse))
    assert plan(src, recipe=r128).options == ConvertOptions(group_size=128, profile="experts", observer="minmax", recipe=r128,
                                                                scheme="w4a16")
    assert plan(src, recipe=r128, group_size=128, profile="experts").options.group_size == 128  # agreeing flags are fine
    assert build_plan(src, ConvertOptions(recipe=r64mse)).options.observer == "mse"
    assert build_plan(src, ConvertOptions(observer="mse", recipe=r128)).options.observer == "mse"  # the recipe names no observer
    p = plan(src)
    assert p.options == ConvertOptions(group_size=32, profile="experts", observer="minmax", scheme="w4a16")
    assert p.summary()["options"] == {"group_size": 32, "profile": "experts", "observer": "minmax", "keep_fp8": False, "recipe": None}
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "plan", str(src), "--recipe", r128, "--group-size", "32"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip() == f"error: --group-size 32 conflicts with group_size 128 in {r128}; drop the flag or edit the recipe"
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "plan", str(src), "--recipe", r128, "--json"], capture_output=True, text=True, check=True)
    assert json.loads(p.stdout)["options"]["group_size"] == 128


def test_compiled_sglang_matcher_decides_as_each_pattern_does():
    """validate_plan's compiled matcher (one alternation of the re: patterns) gives every name the
    group that SGLang's per-pattern rule gives it: ignore first, then named targets, then "Linear";
    re: is re.match at the start, a plain pattern a case-insensitive substring, back-references kept."""
    from quantize.plan import _SglangSchemes, _scheme_for, _sglang_match

    qc = {"ignore": ["lm_head", "re:.*self_attn.*", "re:model\\.layers\\.(\\d)\\.mlp\\.experts\\.\\1\\..*", "MTP",
                     "re:.*mlp\\.gate$"],
          "config_groups": {"config_group_0": {"targets": ["Linear"]},
                            "config_group_1": {"targets": ["re:.*shared_experts.*", "eh_proj"]}}}
    names = ["lm_head", "model.layers.3.self_attn.q_a_proj", "model.layers.2.mlp.experts.2.down_proj",
             "model.layers.2.mlp.experts.3.down_proj", "model.mtp.0.proj", "model.layers.1.mlp.gate",
             "model.layers.1.mlp.gate_up_proj", "model.layers.4.mlp.shared_experts.down_proj", "x.EH_PROJ",
             "self_attn", "prefix.lm_head_x", "model.layers.1.mlp.experts.1.up_proj"]
    fast = _SglangSchemes(qc)
    got = {n: fast(n) for n in names}
    assert got == {n: _scheme_for(n, qc, _sglang_match) for n in names}
    assert got["model.layers.2.mlp.experts.2.down_proj"] == "bf16"  # the back-reference holds
    assert got["model.layers.2.mlp.experts.3.down_proj"] == "config_group_0"
    assert got["model.mtp.0.proj"] == "bf16" and got["x.EH_PROJ"] == "config_group_1"  # substrings, any case
    assert got["model.layers.1.mlp.gate_up_proj"] == "config_group_0"  # "gate$" anchors
