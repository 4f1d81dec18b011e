"""convert --scheme w4afp8 (--engine vllm): INT4 routed experts by group 128 with dynamic per-token
FP8 activations, compressed-tensors W4A8-FP8 as vLLM 0.33 reads it (docs/engines.md#w4afp8), the
vendor's block FP8 kept for the rest; check's reference W4A8 product; the one-line refusals."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml
from safetensors import safe_open

from quantize.check import W4A8_RTOL, check, verify_quant_config
from quantize.checkpoint.index import CheckpointIndex
from quantize.convert import convert
from quantize.engines import vllm as V
from quantize.errors import CheckFailed, QuantizeError
from quantize.publish.card import card
from quantize.kernels.reference import dequant_fp32, fp8_per_token, w4a8_reference
from quantize.testing.tiny import make_tiny

from .conftest import load_dir


@pytest.fixture(scope="module")
def w4afp8(tiny, tmp_path_factory):
    src = tiny("glm_moe_dsa")
    out = tmp_path_factory.mktemp("w4afp8") / "out"
    convert(src, out, scheme="w4afp8")
    return src, out


def _qc(out):
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_the_layout_is_what_vllm_reads_field_by_field(w4afp8):
    """The facts of docs/engines.md#w4afp8, each written out here by hand (vLLM 0.33.0
    compressed_tensors.py `_is_fp8_w4a8`; compressed_tensors_moe_w4a8_fp8.py `create_weights`)."""
    src, out = w4afp8
    qc = _qc(out)
    g0, g1 = qc["config_groups"]["config_group_0"], qc["config_groups"]["config_group_1"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    assert g0["targets"] == ["Linear"] and g0["format"] == "pack-quantized"  # not compressed-tensors' int-quantized
    w, a = g0["weights"], g0["input_activations"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"], w["dynamic"]) == (
        4, "int", True, "group", 128, False)
    assert (a["num_bits"], a["type"], a["symmetric"], a["strategy"], a["dynamic"]) == (8, "float", True, "token", True)
    assert g1["format"] == "float-quantized" and g1["weights"]["block_structure"] == [128, 128]
    t = load_dir(out)
    src_t = load_dir(src)
    experts = sorted({n.rsplit(".", 1)[0] for n in t if ".experts." in n})
    assert experts and all(".mlp.experts." in e for e in experts)
    for e in experts:
        n, k = src_t[e + ".weight"].shape
        assert t[e + ".weight_packed"].dtype == torch.int32 and tuple(t[e + ".weight_packed"].shape) == (n, k // 8)
        assert t[e + ".weight_scale"].dtype == torch.bfloat16 and tuple(t[e + ".weight_scale"].shape) == (n, k // 128)
        assert t[e + ".weight_shape"].tolist() == [n, k]
    # dynamic activations: no activation scale anywhere (an expert input_scale breaks vLLM's loader)
    assert not [n for n in t if n.endswith("input_scale")]
    # the source's FP8 weights outside the experts stay FP8 bit for bit (the engines serve them as block FP8)
    kept = [n for n, v in t.items() if v.dtype == torch.float8_e4m3fn]
    assert kept and all(".experts." not in n for n in kept)
    assert all(torch.equal(t[n].view(torch.uint8), src_t[n].view(torch.uint8)) for n in kept)


def test_nibbles_are_compressed_tensors_uint4b8_low_nibble_first(w4afp8):
    """vLLM subtracts 8 from each nibble, element i in bits 4i..4i+3 (quant_utils.py
    convert_packed_uint4b8_to_signed_int4_inplace): decode by hand and compare with the scale x code
    that reproduces the stored expert within one INT4 step."""
    src, out = w4afp8
    t = load_dir(out)
    e = next(n.rsplit(".", 1)[0] for n in t if n.endswith(".experts.0.gate_proj.weight_packed"))
    p = t[e + ".weight_packed"].to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([((p >> (4 * i)) & 0xF) - 8 for i in range(8)], -1).reshape(p.shape[0], -1)
    s = t[e + ".weight_scale"].float()
    w = codes.float().view(codes.shape[0], s.shape[1], -1) * s.unsqueeze(-1)
    assert torch.equal(w.view_as(codes.float()), dequant_fp32(t[e + ".weight_packed"], s, tuple(codes.shape)))
    ref = load_dir(src)[e + ".weight"].float() * 0  # shape only; the error bound is check's (verified below)
    assert codes.min() >= -8 and codes.max() <= 7 and codes.shape == ref.shape
    wrong = torch.stack([((p >> (4 * (7 - i))) & 0xF) - 8 for i in range(8)], -1).reshape(p.shape[0], -1)
    assert not torch.equal(wrong, codes)  # the other nibble order decodes other codes


def test_check_proves_the_w4afp8_output_and_its_w4a8_product(w4afp8):
    src, out = w4afp8
    rep = check(out, source=src)
    assert rep.ok, rep.failures
    errs = [r.w4a8_rel_err for r in rep.rows]
    assert errs and all(e is not None and 0 < e <= W4A8_RTOL for e in errs)


@pytest.mark.parametrize("edit, says", [
    (lambda a, w: a.update(strategy="tensor"), "input_activations.strategy is 'tensor'"),
    # static per-token: compressed-tensors' own model refuses it before our comparison
    (lambda a, w: a.update(dynamic=False), "not one compressed-tensors reads .*static token"),
    (lambda a, w: a.update(dynamic=False, strategy="tensor"), "input_activations.strategy is 'tensor'"),
    (lambda a, w: a.update(num_bits=4, type="int"), "input_activations.num_bits is 4"),
    (lambda a, w: a.update(symmetric=False), "input_activations.symmetric is False"),
])
def test_check_refuses_a_config_vllm_would_not_read_as_w4a8_fp8(w4afp8, tmp_path, edit, says):
    import shutil

    _, out = w4afp8
    d = tmp_path / "o"
    shutil.copytree(out, d)
    cfg = json.loads((d / "config.json").read_text())
    g0 = cfg["quantization_config"]["config_groups"]["config_group_0"]
    edit(g0["input_activations"], g0["weights"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckFailed, match=says):
        verify_quant_config(d, CheckpointIndex.open(d))


def test_w4a16_output_of_group_128_is_not_taken_for_w4afp8(converted):
    """A W4A16 output has no FP8 activation group: check computes no W4A8 product for it."""
    out = converted("glm_moe_dsa", group_size=128)
    assert _qc(out)["config_groups"]["config_group_0"]["input_activations"] is None
    assert all(r.w4a8_rel_err is None for r in check(out).rows)


def _e4m3_by_hand(xd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 e4m3 in float64: scale amax / 448, codes rounded to 3 mantissa bits (half to
    even; subnormal steps of 2^-9 below 2^-6). -> (codes, scales)."""
    sx = xd.abs().amax(-1, keepdim=True) / 448
    v = xd / sx
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -9))).clamp(min=-6)
    step = 2.0 ** (e - 3)
    return torch.round(v / step) * step, sx  # torch.round is half-to-even


def test_w4a8_reference_against_a_float_computation_of_the_same_quantized_values():
    """The oracle: e4m3 codes rounded by hand (3 mantissa bits, round half to even on the float64
    grid), scales amax / 448, the product in float64; W = code x scale by hand too."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    q = torch.randint(-8, 8, (64, 256), generator=g)
    scale = torch.rand(64, 2, generator=g).to(torch.bfloat16) + 0.01
    from quantize.formats.int4 import pack_int4

    packed = pack_int4(q.to(torch.int8))
    xd = x.double()
    codes, sx = _e4m3_by_hand(xd)
    w = q.double().view(64, 2, 128) * scale.double().unsqueeze(-1)
    want = (codes * sx) @ w.view(64, 256).t()
    got = w4a8_reference(x, packed, scale, (64, 256))
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    c, s = fp8_per_token(x)
    assert torch.equal(c.double(), codes) and torch.allclose(s.double(), sx, rtol=1e-6)
    # a near miss: the activations not quantized at all are far from the W4A8 product
    assert not torch.allclose((xd @ w.view(64, 256).t()), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kw, says", [
    ({"samples": 4}, "--engine vllm quantizes the experts' activations dynamically"),
    ({"data": "x.txt", "engine": "vllm"}, "--data: --engine vllm quantizes the experts' activations dynamically"),
    ({"engine": "sglang", "group_size": 64}, "take group 128 only"),
    ({"group_size": 32}, "take group 128 only"),
    ({"profile": "all-linear"}, "quantizes the routed experts only"),
    ({"observer": "fullrange"}, "negative scales are not proven"),
])
def test_w4afp8_refusals_are_one_line(tiny, tmp_path, kw, says):
    out = tmp_path / "o"
    with pytest.raises(QuantizeError, match=says):
        convert(tiny("glm_moe_dsa"), out, scheme="w4afp8", **kw)
    assert not out.exists()


def test_engine_without_w4afp8_is_refused(tiny, tmp_path):
    with pytest.raises(QuantizeError, match="--engine vllm picks a W4AFP8 layout, but the scheme is w4a16"):
        convert(tiny("glm_moe_dsa"), tmp_path / "o", engine="vllm")


def test_the_w4a8_kernel_shape_rule_names_the_tp_that_fits(tiny, tmp_path):
    """vLLM's W4A8 MoE kernel: hidden % 256 and moe_intermediate per rank % 256 (the tiny model's
    256 fits TP 1 only); a near miss of the rule (intermediate 384) is refused at TP 1 too."""
    from quantize.plan import plan, w4afp8_violation

    assert w4afp8_violation(6144, 2048, 8) is None and w4afp8_violation(7168, 2048, 8) is None  # GLM-5, Kimi K2
    assert "2048 / TP 16" in w4afp8_violation(6144, 2048, 16)
    assert "hidden_size 6016" in w4afp8_violation(6016, 2048, 1)
    src = tiny("glm_moe_dsa")
    with pytest.raises(QuantizeError, match="moe_intermediate_size 256 / TP 2 is not a multiple of 256.*use --tp 1"):
        plan(src, 2, None, None, False, None, "w4afp8", None, False, 140.4, 0.9, 0.0)
    odd = make_tiny("glm_moe_dsa", tmp_path / "odd", "vendor", 0, 1, {"moe_intermediate_size": 384}, False, False)
    with pytest.raises(QuantizeError, match="moe_intermediate_size 384 / TP 1"):
        convert(odd, tmp_path / "o", scheme="w4afp8")


def test_a_kimi_int4_source_of_group_32_needs_requantize(tiny, tmp_path):
    src = tiny("kimi_k25")
    with pytest.raises(QuantizeError, match="INT4 by group 32 .* W4AFP8 needs group 128 .* add --requantize"):
        convert(src, tmp_path / "o", scheme="w4afp8")
    out = tmp_path / "re"
    convert(src, out, scheme="w4afp8", requantize=True)
    assert _qc(out)["config_groups"]["config_group_0"]["weights"]["group_size"] == 128
    assert check(out).ok


# -- vLLM's own code as the oracle (its CPU build, in its own venv) --------------------------------

VLLM_READS = r"""
import json, sys
import torch
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
class RoutedExperts(torch.nn.Module): pass  # the class names vLLM matches targets against
class MergedColumnParallelLinear(torch.nn.Module): pass
qc = json.load(open(sys.argv[1]))["quantization_config"]
cfg = CompressedTensorsConfig.from_config(qc)
cfg._add_fused_moe_to_target_scheme_map()  # as CompressedTensorsMoEMethod.get_moe_method does
out = {}
for name in sys.argv[2:]:
    layer = RoutedExperts() if ".experts." in name else MergedColumnParallelLinear()
    d = cfg.get_scheme_dict(layer, name)
    out[name] = None if d is None else {
        "w4a8_fp8": bool(d["weights"] is not None and d.get("input_activations") is not None
                         and cfg._is_fp8_w4a8(d["weights"], d["input_activations"])),
        "weights_bits": d["weights"].num_bits, "format": d.get("format")}
print(json.dumps(out))
"""


@pytest.mark.skipif(not V.has_engine(), reason="no vLLM interpreter: create .venv-vllm (docs/vllm-cpu.md)")
def test_vllm_takes_the_experts_as_w4a8_fp8_and_the_rest_as_written(w4afp8, converted):
    _, out = w4afp8
    names = ["model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.3.down_proj",
             "model.layers.1.mlp.shared_experts.gate_proj", "model.layers.0.self_attn.q_a_proj", "lm_head"]

    def reads(folder):
        p = subprocess.run([str(V.engine_python()), "-c", VLLM_READS, str(folder / "config.json"), *names],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    got = reads(out)
    # the near miss: a W4A16 output of the same group size is not W4A8-FP8 to vLLM
    assert reads(converted("glm_moe_dsa", group_size=128, keep_fp8=True))[names[0]]["w4a8_fp8"] is False
    for e in names[:2]:
        assert got[e] == {"w4a8_fp8": True, "weights_bits": 4, "format": "pack-quantized"}
    for m in names[2:4]:
        assert got[m]["w4a8_fp8"] is False and got[m]["weights_bits"] == 8
    assert got["lm_head"] is None


def test_a_local_w4afp8_candidate_runs_its_experts_through_fp8_activations(w4afp8, converted):
    """eval / eval-kld load a W4AFP8 candidate with its experts' GEMM inputs fake-quantized per token
    (evaluate/w4a8.py); the oracle recomputes one MoE layer's experts by hand in float64."""
    from quantize.evaluate import w4a8
    from quantize.evaluate.kld import load_model

    _, out = w4afp8
    m = load_model(out, torch.float32)
    experts = [x for x in m.modules() if type(x).__name__.endswith("Experts")]
    assert experts and all(x.forward.__func__ is w4a8._w4a8_experts_forward for x in experts)
    ex = experts[0]
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, ex.hidden_dim, generator=g)
    idx = torch.randint(0, ex.num_experts, (6, 2), generator=g)
    wts = torch.rand(6, 2, generator=g)
    got = ex(h, idx, wts).double()
    want = torch.zeros(6, ex.hidden_dim, dtype=torch.float64)
    for t in range(6):
        c, s = _e4m3_by_hand(h[t:t + 1].double())
        x8 = c * s
        for j in range(2):
            e = int(idx[t, j])
            gu = x8 @ ex.gate_up_proj[e].double().t()
            gate, up = gu.chunk(2, dim=-1)
            a = torch.nn.functional.silu(gate) * up
            ca, sa = _e4m3_by_hand(a)
            want[t] += wts[t, j].double() * ((ca * sa) @ ex.down_proj[e].double().t())[0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    # the near miss: the same weights with BF16 activations (W4A16) are measurably elsewhere
    plain = type(ex).forward(ex, h, idx, wts).double()
    assert not torch.allclose(plain, want, rtol=1e-3, atol=1e-4)
    # a W4A16 candidate is left as transformers built it
    m16 = load_model(converted("glm_moe_dsa", group_size=128, keep_fp8=True), torch.float32)
    assert not [x for x in m16.modules() if getattr(x.forward, "__func__", None) is w4a8._w4a8_experts_forward]


def test_a_w4afp8_config_without_an_experts_module_is_not_scored():
    from quantize.evaluate import w4a8

    cfg = {"quantization_config": {"config_groups": {"g": {"weights": {"type": "int", "num_bits": 4},
                                                           "input_activations": {
        "type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}}}}
    with pytest.raises(QuantizeError, match="no fused experts module .* not scored"):
        w4a8.apply(torch.nn.Linear(2, 2), cfg, "m")
    near = {"quantization_config": {"config_groups": {"g": {"weights": {"type": "int", "num_bits": 4},
                                                            "input_activations": {
        "type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": True}}}}}
    assert w4a8.apply(torch.nn.Linear(2, 2), near, "m") == 0
    # compressed-tensors' FP8_DYNAMIC (FP8 weights, per-token dynamic activations): a W8A8 model, not W4AFP8
    w8a8 = {"quantization_config": {"config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}}}}
    assert w4a8.fp8_token_groups(w8a8) == [] and w4a8.apply(torch.nn.Linear(2, 2), w8a8, "m") == 0
    w4 = {"quantization_config": {"config_groups": {"g": {
        **w8a8["quantization_config"]["config_groups"]["g"], "weights": {"type": "int", "num_bits": 4}}}}}
    assert w4a8.fp8_token_groups(w4) == ["g"]


def test_a_w4afp8_card_gives_vllm_launch_line_only(tiny, tmp_path):
    out = tmp_path / "w4afp8"
    convert(tiny("glm_moe_dsa"), out, scheme="w4afp8")
    text = card(out).text
    assert f"vllm serve {out.name} --tensor-parallel-size" in text
    assert "sglang.launch_server" not in text and "so no SGLang line is given" in text
    assert "shared-experts-fusion" not in text  # no SGLang advice where no SGLang line is given
    assert "FP8 e4m3 activations, dynamic per token (W4AFP8)" in text and "(W4A16)" not in text
    tags = yaml.safe_load(text.split("\n---\n", 1)[0][4:])["tags"]
    assert "w4afp8" in tags and "w4a16" not in tags
    # the near miss: a W4A16 output of the same group size keeps both lines
    out16 = tmp_path / "w4a16"
    convert(tiny("glm_moe_dsa"), out16, group_size=128, keep_fp8=True)
    t16 = card(out16).text
    assert "sglang.launch_server" in t16 and "no SGLang line" not in t16
    assert "w4a16" in yaml.safe_load(t16.split("\n---\n", 1)[0][4:])["tags"]


def test_sglang_turns_fusion_off_for_a_pack_quantized_w4afp8(w4afp8):
    """SGLang's is_wint4afp8_or_wint4a16_config: an INT4 "Linear" group with 8-bit dynamic input
    activations and a top-level pack-quantized format (a BF16 source's W4AFP8) turns fusion off too."""
    from quantize.publish.card import sglang_shared_fusion

    qc = _qc(w4afp8[1])
    pack = {**qc, "format": "pack-quantized",
            "config_groups": {"config_group_0": qc["config_groups"]["config_group_0"]}}
    eligible = {"n_shared_experts": 1, "n_routed_experts": 256, "first_k_dense_replace": 1}
    assert sglang_shared_fusion(eligible, pack) == "auto-off"
    static = {**pack, "config_groups": {"config_group_0": {**pack["config_groups"]["config_group_0"],
              "input_activations": {**pack["config_groups"]["config_group_0"]["input_activations"],
                                    "dynamic": False}}}}
    assert sglang_shared_fusion(eligible, static) != "auto-off"  # static activations: the check does not fire


def test_shard_and_the_card_keep_the_w4a8_rule(tiny, tmp_path):
    """The tiny model's moe_intermediate_size 256 fits vLLM's W4A8 MoE at TP 1 only (I/tp % 256)."""
    from quantize.shard import plan_shard

    out = tmp_path / "w4afp8"
    convert(tiny("glm_moe_dsa"), out, scheme="w4afp8")
    with pytest.raises(QuantizeError, match="W4AFP8 at TP 2: moe_intermediate_size 256 / TP 2 .* use --tp 1"):
        plan_shard(out, 2)
    plan_shard(out, 1)
    assert f"vllm serve {out.name} --tensor-parallel-size 1 " in card(out).text
