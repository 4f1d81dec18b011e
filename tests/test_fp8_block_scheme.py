"""The fp8-block output scheme against llm-compressor 0.14's own ``model_free_ptq(scheme="FP8_BLOCK")``
(compressed-tensors 0.19), run here on the CPU: codes and scales bit for bit, per tensor (their
``ModelFreePtqConverter.process``, the exact per-shard step) and end to end on tiny checkpoints,
BF16 sources and the Kimi K2.6 route (an INT4 ``pack-quantized`` source dequantized by
compressed-tensors' ``CompressedTensorsDequantizer`` first). docs/formats.md#fp8-block-output-prefill-artifact.

Near misses show the test can fail: the vendors' DeepSeek recipe (fp32 scale and quotient, our
``quant_block``) and the fp32 quotient of compressed-tensors' Triton kernel both differ.
"""

import json
import shutil

import pytest
import torch

from quantize.formats import fp8, int4

from .conftest import load_dir

pytest.importorskip("llmcompressor")

KIMI_IGNORE = [  # examples/model_free_ptq/kimi_k26_fp8_block.py (vllm-project/llm-compressor)
    "re:.*mlp.gate$", "re:.*lm_head", "re:.*kv_a_proj_with_mqa$", "re:.*q_a_proj$",
    "re:.*vision_tower.*", "re:.*embed_tokens$", "re:.*mm_projector.*", "re:.*vision.*",
]


def _oracle(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's per-tensor step: one 2-D ``m.weight`` through their converter."""
    from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter
    from llmcompressor.entrypoints.model_free.validate import validate_config

    out = ModelFreePtqConverter(validate_config(None, "FP8_BLOCK", [])).process({"m.weight": w.clone()})
    assert set(out) == {"m.weight", "m.weight_scale"}
    return out["m.weight"], out["m.weight_scale"]


def _same(ours, theirs):
    for a, b in zip(ours, theirs):
        assert int4.bitwise_diff(a, b) is None, int4.bitwise_diff(a, b)


def _weights(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over five decades along the input dim, so blocks differ in scale
    return (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1])).to(dtype)


@pytest.mark.parametrize("shape", [(256, 512), (200, 300), (8, 256), (129, 130), (1, 1), (576, 384)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_codes_and_scales_match_llm_compressor(shape, dtype):
    q, s = fp8.quant_block_ct(_weights(shape, dtype))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == dtype
    assert tuple(s.shape) == fp8.block_grid(shape)
    _same((q, s), _oracle(_weights(shape, dtype)))


def test_all_zero_block_gets_the_dtype_eps():
    w = _weights((256, 256), torch.bfloat16)
    w[:128, 128:] = 0
    q, s = fp8.quant_block_ct(w)
    assert s[0, 1].item() == torch.finfo(torch.bfloat16).eps  # 2**-7, not 1 as the vendors' recipe
    assert not q[:128, 128:].float().any()
    _same((q, s), _oracle(w))


def test_huge_values_are_clamped_like_theirs():
    w = _weights((256, 384), torch.bfloat16)
    w[0, 0], w[5, 130], w[200, 300] = 3.0e38, -1.0e38, 6.0e4  # near bf16's max, one block each
    w[130:, :128] *= 1e30
    q, s = fp8.quant_block_ct(w)
    assert torch.isfinite(q.float()).all() and torch.isfinite(s.float()).all()
    _same((q, s), _oracle(w))


def test_a_scale_rounded_down_saturates_at_448():
    # absmax 1.0078125: bf16(absmax / 448) rounds down, absmax / scale rounds to 450 in bf16, code 448
    w = torch.full((128, 128), 0.5, dtype=torch.bfloat16)
    w[3, 7] = 1.0078125
    q, s = fp8.quant_block_ct(w)
    assert s.float().item() < 1.0078125 / 448 and q[3, 7].float().item() == fp8.FP8_MAX
    _same((q, s), _oracle(w))


def test_near_miss_vendor_recipe_differs():
    """The DeepSeek recipe (``quant_block``: fp32 scale, fp32 quotient) is not theirs."""
    w = _weights((256, 512), torch.bfloat16)
    q, s = _oracle(w)
    vq, vs = fp8.quant_block(w)
    assert vs.dtype == torch.float32 and s.dtype == torch.bfloat16
    assert int4.bitwise_diff(vq, q) is not None  # the fp32 quotient
    assert not torch.equal(vs, s.float())  # the scale unrounded


def test_near_miss_fp32_quotient_differs():
    """The Triton kernel's fp32 quotient (CUDA SM90+) flips a few percent of bf16 codes by one step."""
    w = _weights((256, 512), torch.bfloat16)
    q, s = _oracle(w)
    fq, fs = fp8.quant_block_ct(w, fp32_quotient=True)
    assert torch.equal(fs, s)
    n = int((fq.view(torch.uint8) != q.view(torch.uint8)).sum())
    assert 0.01 * q.numel() < n < 0.05 * q.numel()  # measured 2.6 %
    codes = fq.view(torch.uint8).int() - q.view(torch.uint8).int()
    assert set(codes.unique().tolist()) == {-1, 0, 1}  # neighbouring e4m3 codes, same sign
    # in fp32 weights the two paths agree: the quotient is fp32 either way
    w32 = w.float()
    _same(fp8.quant_block_ct(w32, fp32_quotient=True), _oracle(w32))


def test_refuses_what_they_refuse():
    with pytest.raises(ValueError, match="2-D"):
        fp8.quant_block_ct(torch.zeros(2, 128, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        fp8.quant_block_ct(torch.zeros(128, dtype=torch.bfloat16))


# --- end to end: model_free_ptq on tiny checkpoints -------------------------------------------------------------

EXPECTED_CONFIG = {
    "config_groups": {"FP8_BLOCK": {
        "format": "float-quantized",
        "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": 128,
                              "num_bits": 8, "observer": None, "observer_kwargs": {}, "scale_dtype": None,
                              "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None},
        "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": [128, 128], "dynamic": False, "group_size": None,
                    "num_bits": 8, "observer": None, "observer_kwargs": {}, "scale_dtype": None,
                    "strategy": "block", "symmetric": True, "type": "float", "zp_dtype": None},
    }},
    "format": "float-quantized",
    "global_compression_ratio": None,
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "transform_config": {},
    "version": "0.19.0",
}


def _ptq(src, out, ignore, converter=None):
    from llmcompressor.entrypoints.model_free import model_free_ptq

    model_free_ptq(str(src), str(out), scheme="FP8_BLOCK", ignore=ignore, device="cpu", converter=converter)
    return load_dir(out), json.loads((out / "config.json").read_text())["quantization_config"]


def _quantized_names(src_tensors, ignored):
    """What model_free_ptq targets: every ``*.weight`` whose module does not end in ``norm`` and is
    not ignored (names only; a non-2-D one would be refused)."""
    return {k for k, v in src_tensors.items() if k.endswith(".weight")
            and not k[: -len(".weight")].endswith("norm") and not ignored(k[: -len(".weight")])}


def _check_outputs(src_t, out_t, targeted, weights_of):
    expect = set(src_t) | {k + "_scale" for k in targeted}
    assert set(out_t) == expect
    for k in targeted:
        q, s = fp8.quant_block_ct(weights_of(k))
        _same((out_t[k], out_t[k + "_scale"]), (q, s))
    for k in set(src_t) - targeted:
        assert int4.bitwise_diff(out_t[k], src_t[k]) is None, k


def test_model_free_ptq_end_to_end_llama(tiny, tmp_path):
    """With no ignore list, embed_tokens and lm_head are quantized too: targets ["Linear"] match
    every ``*.weight`` by name (only ``*norm`` modules are skipped)."""
    src = tiny("llama", layout="bf16")
    out_t, qc = _ptq(src, tmp_path / "out", [])
    src_t = load_dir(src)
    targeted = _quantized_names(src_t, lambda m: False)
    assert "model.embed_tokens.weight" in targeted and "lm_head.weight" in targeted
    _check_outputs(src_t, out_t, targeted, lambda k: src_t[k])
    assert qc == {**EXPECTED_CONFIG, "ignore": []}


def test_model_free_ptq_end_to_end_moe_with_the_kimi_ignore_list(tiny, tmp_path):
    from compressed_tensors.utils.match import match_name

    src = tiny("deepseek_v3", layout="bf16")
    out_t, qc = _ptq(src, tmp_path / "out", KIMI_IGNORE)
    src_t = load_dir(src)
    targeted = _quantized_names(src_t, lambda m: any(match_name(m, i) for i in KIMI_IGNORE))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in targeted
    assert not {"model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"} & targeted
    _check_outputs(src_t, out_t, targeted, lambda k: src_t[k])
    assert qc == {**EXPECTED_CONFIG, "ignore": KIMI_IGNORE}


def test_model_free_ptq_router_and_ragged_rows_when_not_ignored(tiny, tmp_path):
    """The router (8 rows) and kv_a_proj_with_mqa (192 rows) are accepted: zero-padded to whole blocks."""
    src = tiny("deepseek_v3", layout="bf16")
    out_t, _ = _ptq(src, tmp_path / "out", ["lm_head", "model.embed_tokens"])
    for k, grid in [("model.layers.1.mlp.gate.weight", (1, 2)),
                    ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", (2, 2))]:
        assert out_t[k].dtype == torch.float8_e4m3fn and tuple(out_t[k + "_scale"].shape) == grid
        _same((out_t[k], out_t[k + "_scale"]), fp8.quant_block_ct(load_dir(src)[k]))


@pytest.fixture(scope="module")
def int4_source(tiny, tmp_path_factory):
    """A pack-quantized W4A16 g128 checkpoint (bf16 scales), written by llm-compressor itself."""
    from llmcompressor.entrypoints.model_free import model_free_ptq

    out = tmp_path_factory.mktemp("int4") / "w4a16"
    model_free_ptq(str(tiny("deepseek_v3", layout="bf16")), str(out), scheme="W4A16",
                   ignore=KIMI_IGNORE, device="cpu")
    shutil.rmtree(out / ".quantize", ignore_errors=True)
    return out


def _our_int4_dequant(t, k):
    m = k[: -len(".weight")]
    shape = tuple(int(x) for x in t[m + ".weight_shape"])
    return int4.dequantize_int4(t[m + ".weight_packed"], t[m + ".weight_scale"], shape, dtype=torch.bfloat16)


def test_int4_dequantizer_matches_dequantize_int4(int4_source):
    """CompressedTensorsDequantizer ends in bf16 (its default dtype): q * scale in the scale dtype."""
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    t = load_dir(int4_source)
    deq = CompressedTensorsDequantizer(str(int4_source), ignore=KIMI_IGNORE).process(dict(t))
    packed = [k for k in t if k.endswith(".weight_packed")]
    assert packed and t[packed[0]].dtype == torch.int32 and t[packed[0][:-6] + "scale"].dtype == torch.bfloat16
    for k in packed:
        w = k[: -len("_packed")]
        assert deq[w].dtype == torch.bfloat16
        _same((_our_int4_dequant(t, w),), (deq[w],))


def test_kimi_route_int4_to_fp8_block(int4_source, tmp_path):
    """examples/model_free_ptq/kimi_k26_fp8_block.py in small: dequantize INT4 to bf16, FP8_BLOCK."""
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    conv = CompressedTensorsDequantizer(str(int4_source), ignore=KIMI_IGNORE)
    out_t, qc = _ptq(int4_source, tmp_path / "out", KIMI_IGNORE, converter=conv)
    src_t = load_dir(int4_source)
    experts = {k[: -len("_packed")] for k in src_t if k.endswith(".weight_packed")}
    assert experts
    for k in experts:
        _same((out_t[k], out_t[k + "_scale"]), fp8.quant_block_ct(_our_int4_dequant(src_t, k)))
        assert not {k + "_packed", k + "_shape"} & set(out_t)
    assert qc == {**EXPECTED_CONFIG, "ignore": KIMI_IGNORE}  # the INT4 config is replaced, not merged


def test_deepseek_fp8_route_to_fp8_block(tiny, tmp_path):
    """A DeepSeek block-FP8 source (``weight_scale_inv``) through FP8BlockDequantizer (fp32 multiply,
    bf16) then FP8_BLOCK: our dequant_block then quant_block_ct."""
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer

    src = tiny("deepseek_v3")
    # the dequantizer wants a weight_scale_inv beside every targeted weight: ignore every BF16 one
    vendor = json.loads((src / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    bf16 = sorted(vendor) + ["re:.*embed_tokens$", "re:.*lm_head$", "re:.*shared_head.head$"]
    conv = FP8BlockDequantizer(ignore=bf16)
    out_t, qc = _ptq(src, tmp_path / "out", bf16, converter=conv)
    src_t = load_dir(src)
    fp8_w = [k for k in src_t if k.endswith(".weight_scale_inv")]
    assert fp8_w
    for k in fp8_w:
        w = k[: -len("_scale_inv")]
        _same((out_t[w], out_t[w + "_scale"]), fp8.quant_block_ct(fp8.dequant_block(src_t[w], src_t[k])))
        assert k not in out_t
    assert qc == {**EXPECTED_CONFIG, "ignore": bf16}  # the vendor's fp8 config is replaced


def test_check_proves_fp8_block_made_from_a_block_fp8_release(tiny, tmp_path):
    """GLM-5.2's release (block FP8, fp32 ``weight_scale_inv``) to the prefill pool's FP8 block
    checkpoint: every routed expert is FP8_BLOCK of its BF16 dequantization (bf16 ``weight_scale``,
    as model_free_ptq's FP8BlockDequantizer route writes it). check took an FP8 weight in both for a
    copy and compared the scales' dtypes, so it refused every expert of a correct output; it now
    re-derives them. Near miss: one code moved (the manifest's hash made to agree) fails that tensor."""
    from quantize.check import check
    from quantize.convert import convert

    from .test_check_verify import _edit

    src = tiny("glm_moe_dsa")
    out = tmp_path / "fp8"
    convert(src, out, scheme="fp8-block")
    a, s = load_dir(out), load_dir(src)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert a[name].dtype == s[name].dtype == torch.float8_e4m3fn
    assert a[name + "_scale"].dtype == torch.bfloat16 and s[name + "_scale_inv"].dtype == torch.float32
    _same((a[name], a[name + "_scale"]), fp8.quant_block_ct(fp8.dequant_block(s[name], s[name + "_scale_inv"])))
    rep = check(out, source=src)
    assert rep.ok, rep.failures
    assert rep.verified["tensors_exact_vs_source"] == len([k for k in s if not k.endswith("_scale_inv")])

    def move(t):
        t[name].view(torch.uint8)[3, 5] ^= 1

    _edit(out, name, move, fix_manifest=True)
    rep = check(out, source=src)
    assert not rep.ok and [f for f in rep.failures if name in f and "FP8_BLOCK" in f] == rep.failures
