"""Kimi K2.6 as Moonshot ships it: an INT4 (compressed-tensors pack-quantized) source through every
command. Two sources: the tiny Kimi in Moonshot's layout (``make-tiny kimi_k25``: routed experts
INT4 on an absmax / 7 grid, the rest BF16) and one written by llm-compressor (``model_free_ptq``
W4A16 group 32 on the BF16 fixture)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quantize.calibrate.kv import calibrate_kv
from quantize.check import check
from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.formats import fp8, int4
from quantize.plan import plan
from quantize.shard import merge, shard

from .conftest import dir_bytes, load_dir

# model_free_ptq targets every *.weight by name: its ignore list names the BF16 parts as Moonshot's
# does, plus what its exact matcher needs on Kimi's on-disk names (language_model.lm_head, the router)
LLMC_IGNORE = ["re:.*lm_head$", "re:.*embed_tokens$", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*mlp\\.gate$", "re:.*vision_tower.*",
               "re:.*mm_projector.*", "re:.*eh_proj$", "re:.*shared_head.*"]


@pytest.fixture(scope="module")
def llmc_int4(tiny, tmp_path_factory):
    """Kimi INT4 written by llm-compressor: model_free_ptq W4A16 (group 32) on the BF16 fixture."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import model_free_ptq

    out = tmp_path_factory.mktemp("llmc") / "kimi-w4a16"
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    model_free_ptq(model_stub=str(tiny("kimi_k25", layout="bf16")), save_directory=str(out), scheme=scheme,
                   ignore=LLMC_IGNORE, device="cpu")
    # model_free_ptq copies every other file of its input, make-tiny's own record too: not llm-compressor's
    (out / "quantize_manifest.json").unlink()
    shutil.rmtree(out / ".quantize")
    return out


@pytest.fixture(params=["moonshot", "llm-compressor"])
def source(request, tiny):
    return tiny("kimi_k25") if request.param == "moonshot" else request.getfixturevalue("llmc_int4")


def _n_int4(d) -> int:
    return sum(k.endswith(".weight_packed") for k in load_dir(d))


def _int4_names(d) -> list[str]:
    return sorted(k for k in load_dir(d) if k.endswith((".weight_packed", ".weight_scale", ".weight_shape"))
                  and k.replace("weight_scale", "weight_packed") in load_dir(d))


def test_the_fixture_is_moonshots_layout(tiny):
    """Routed experts INT4 pack-quantized group 32 on the 15-code grid (scale = bf16(absmax / 7),
    codes in [-7, 7]); everything else BF16; Moonshot's ignore list verbatim plus vision."""
    src = tiny("kimi_k25")
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert qc["ignore"][:4] == ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
    t = load_dir(src)
    packed = [k for k in t if k.endswith(".weight_packed")]
    assert packed and all(".mlp.experts." in k for k in packed)
    assert all(v.dtype in (torch.bfloat16, torch.float32, torch.int32, torch.int64) for v in t.values())
    m = packed[0][: -len(".weight_packed")]
    shape = tuple(t[m + ".weight_shape"].tolist())
    q = int4.unpack_int4(t[m + ".weight_packed"], shape[1])
    assert int(q.min()) >= -7 and int(q.max()) <= 7  # 15 codes: not our RTN's -8..7 grid
    ref = int4.dequantize_int4(t[m + ".weight_packed"], t[m + ".weight_scale"], shape, torch.float32)
    absmax = ref.view(shape[0], -1, 32).abs().amax(-1)
    assert torch.equal((absmax / 7).to(torch.bfloat16), t[m + ".weight_scale"])  # |code| 7 in every group
    assert cfg["text_config"]["num_nextn_predict_layers"] == 0
    assert not any(".weight_scale_inv" in k for k in t)
    # the FP8 layout stays available (Kimi K2 Instruct)
    f = load_dir(tiny("kimi_k25", layout="fp8"))
    assert any(k.endswith("weight_scale_inv") for k in f) and not any(k.endswith("weight_packed") for k in f)


def test_plan_reads_it(source):
    s = plan(source, tp=4).summary()
    assert s["source_format"] == "ct-int4"
    n = _n_int4(source)
    assert n in (48, 72)  # 8 experts x 3 projections x 2 MoE layers (+ the MTP layer's, llm-compressor's source)
    assert s["roles"]["expert_gate"] == {"pass_int4": n // 3}
    assert s["roles"]["attn_kv_b"] == {"copy": 3 if n == 48 else 4}  # 3 layers (+ MTP)
    assert s["kv_tokens_per_gpu"]["fp8"] == 2 * s["kv_tokens_per_gpu"]["bf16"] or \
        abs(s["kv_tokens_per_gpu"]["fp8"] - 2 * s["kv_tokens_per_gpu"]["bf16"]) <= 1
    assert s["per_rank_output_bytes"] < s["output_bytes"]


def test_convert_passes_int4_through_bit_for_bit(source, tmp_path):
    out = tmp_path / "o"
    res = convert(source, out)
    a, b = load_dir(source), load_dir(out)
    assert set(a) == set(b)
    for k in a:  # every tensor, INT4 codes and scales included, byte-identical
        assert int4.bitwise_diff(a[k], b[k]) is None, k
    man = json.loads((out / "quantize_manifest.json").read_text())
    n = _n_int4(source)
    assert man["passed_through"]["modules"] == n and man["passed_through"]["requantized"] == 0
    assert res.passed_through == n and res.tensors_int4 == 0
    rep = check(out, tp=4, source=source)
    assert rep.ok, rep.failures
    assert rep.verified["tensors_exact_vs_source"] == len(a)


def test_a_different_scheme_needs_requantize(source, tmp_path):
    for kw in ({"group_size": 64}, {"observer": "mse"}, {"method": "gptq", "data": "x"}):
        with pytest.raises(QuantizeError, match="already INT4.*add --requantize"):
            convert(source, tmp_path / "r", **kw)
        assert not (tmp_path / "r").exists()
    convert(source, tmp_path / "same", observer="minmax", group_size=32)  # what the source says it is: passes
    assert json.loads((tmp_path / "same" / "quantize_manifest.json").read_text())["passed_through"]["modules"] == \
        _n_int4(source)
    out = tmp_path / "rq"
    convert(source, out, requantize=True, group_size=64)
    a, b = load_dir(source), load_dir(out)
    m = next(k for k in a if k.endswith(".weight_packed"))[: -len(".weight_packed")]
    assert b[m + ".weight_scale"].shape[1] * 2 == a[m + ".weight_scale"].shape[1]
    man = json.loads((out / "quantize_manifest.json").read_text())
    assert man["options"]["requantize"] is True and man["passed_through"]["requantized"] == _n_int4(source)
    rep = check(out, source=source)  # re-derived from the exact dequantization
    assert rep.ok, rep.failures
    # and group 32 re-quantized: every module's scales and codes are compressed-tensors' RTN (computed here:
    # scale = bf16(absmax / 7.5) of the exact dequantization rounded to BF16, code = round(clamp(w / scale)))
    # and neither is the source's, for either source: Moonshot's grid is absmax / 7 (|code| 7 in every group:
    # each scale x 7 / 7.5); llm-compressor's is absmax / 7.5 of the BF16 weight, but its extreme sits on code
    # 7 or -8 (absmax 7 s or 8 s), so re-deriving moves every scale, and some codes with it
    out32 = tmp_path / "rq32"
    convert(source, out32, requantize=True)
    c = load_dir(out32)
    mods = sorted(k[: -len(".weight_packed")] for k in a if k.endswith(".weight_packed"))
    assert len(mods) == _n_int4(source) and {k[: -len(".weight_packed")] for k in c if k.endswith("_packed")} == set(mods)
    for mod in mods:
        rows, cols = a[mod + ".weight_shape"].tolist()
        q, s = int4.unpack_int4(a[mod + ".weight_packed"], cols).float(), a[mod + ".weight_scale"]
        w = (q.view(rows, cols // 32, 32) * s.float().unsqueeze(-1)).to(torch.bfloat16).float()
        scale = (w.abs().amax(-1) / 7.5).to(torch.bfloat16)
        codes = (w / scale.float().unsqueeze(-1)).to(torch.bfloat16).float().clamp(-8, 7).round()
        assert s.dtype == torch.bfloat16 and torch.equal(c[mod + ".weight_scale"], scale), mod
        assert torch.equal(int4.unpack_int4(c[mod + ".weight_packed"], cols).float().view_as(codes), codes), mod
        assert not torch.equal(c[mod + ".weight_scale"], s), mod
        assert not torch.equal(c[mod + ".weight_packed"], a[mod + ".weight_packed"]), mod
    assert check(out32, source=source).ok


def test_requantized_codes_are_proven_not_trusted(tiny, tmp_path):
    """--requantize'd codes are re-derived from the source, so one flipped code fails, named."""
    from safetensors.torch import load_file, save_file

    src = tiny("kimi_k25")
    out = tmp_path / "rq"
    convert(src, out, requantize=True)
    assert check(out, source=src).ok
    f = next(f for f in sorted(out.glob("*.safetensors")) if any(k.endswith(".weight_packed") for k in load_file(f)))
    t = load_file(f)
    k = next(k for k in t if k.endswith(".weight_packed"))
    t[k] = t[k].clone()
    t[k][0, 0] ^= 1
    save_file(t, f, metadata={"format": "pt"})
    rep = check(out, source=src)
    assert not rep.ok
    assert any(k[: -len(".weight_packed")] in x and "re-quantizing the source" in x for x in rep.failures), rep.failures


def test_fp8_block_equals_llm_compressor(source, tmp_path):
    """--scheme fp8-block on the INT4 source equals model_free_ptq FP8_BLOCK with its own
    CompressedTensorsDequantizer (examples/model_free_ptq/kimi_k26_fp8_block.py), given our ignore list."""
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer
    from llmcompressor.entrypoints.model_free import model_free_ptq

    out = tmp_path / "fp8"
    convert(source, out, scheme="fp8-block")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    theirs = tmp_path / "theirs"
    model_free_ptq(str(source), str(theirs), scheme="FP8_BLOCK", ignore=qc["ignore"], device="cpu",
                   converter=CompressedTensorsDequantizer(str(source), ignore=qc["ignore"]))
    a, b = load_dir(out), load_dir(theirs)
    assert set(a) == set(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
           or int4.bitwise_diff(a[k], b[k]) is not None]
    assert bad == []
    assert sum(v.dtype == torch.float8_e4m3fn for v in a.values()) == _n_int4(source)
    tq = json.loads((theirs / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["config_group_0"] == {**tq["config_groups"]["FP8_BLOCK"]}
    assert {k: v for k, v in qc.items() if k != "config_groups"} == {k: v for k, v in tq.items() if k != "config_groups"}
    rep = check(out, source=source)
    assert rep.ok, rep.failures


def test_fp8_block_on_a_bf16_source_equals_llm_compressor(tiny, tmp_path):
    from llmcompressor.entrypoints.model_free import model_free_ptq

    src = tiny("deepseek_v3", layout="bf16")
    out = tmp_path / "fp8"
    convert(src, out, scheme="fp8-block", profile="all-linear")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    model_free_ptq(str(src), str(tmp_path / "theirs"), scheme="FP8_BLOCK", ignore=qc["ignore"], device="cpu")
    a, b = load_dir(out), load_dir(tmp_path / "theirs")
    assert set(a) == set(b)
    assert [k for k in a if int4.bitwise_diff(a[k], b[k]) is not None] == []
    assert any(".self_attn.o_proj.weight_scale" in k for k in a)  # all-linear: attention too
    # near miss: our vendor-style quant_block (ceil grid, fp32 scale) is not theirs
    k = next(k for k in a if k.endswith("o_proj.weight"))
    q, _ = fp8.quant_block(load_dir(src)[k].float())
    assert not torch.equal(q.view(torch.uint8), a[k].view(torch.uint8))
    assert check(out, source=src).ok


def test_calibrate_kv_fold_keeps_every_int4_tensor(source, tmp_path):
    out = tmp_path / "f"
    res = calibrate_kv(source, out, fold=True, samples=4, seq_len=32)
    a, b = load_dir(source), load_dir(out)
    changed = sorted(k for k in a if int4.bitwise_diff(a[k], b[k]) is not None)
    assert changed and changed == sorted(res.written)
    assert all(b[k].dtype == torch.bfloat16 for k in changed)  # the folded tensors are BF16 in this layout
    assert all(".self_attn." in k for k in changed)
    for k in _int4_names(source):
        assert int4.bitwise_diff(a[k], b[k]) is None, k


def test_check_without_a_source(source, tmp_path):
    """A vendor folder: no manifest to prove files against (reported, not failed); every INT4
    tensor's unpack against compressed-tensors and the kernels; the shapes at the given TP."""
    bare = tmp_path / "bare"
    shutil.copytree(source, bare, ignore=shutil.ignore_patterns("quantize_manifest.json", ".quantize", "recipe.yaml"))
    rep = check(bare, tp=4)
    assert rep.ok, rep.failures
    assert rep.verified["files_unrecorded"] >= 1 and len(rep.rows) == _n_int4(source)
    assert all(r.unpack_ok and r.kernel_rel_err < 2e-2 for r in rep.rows)
    # near miss: a quantize output whose manifest is gone is incomplete, not a vendor folder
    out = tmp_path / "c"
    convert(source, out)
    (out / "quantize_manifest.json").unlink()
    assert not check(out, tp=4).ok


def test_shard_and_merge(source, tmp_path):
    shard(source, tmp_path / "sh", tp=4)
    merge(tmp_path / "sh", tmp_path / "m")
    a, b = dir_bytes(source), dir_bytes(tmp_path / "m")
    assert sorted(a) == sorted(b) and all(a[f] == b[f] for f in a)
    rep = check(tmp_path / "sh")
    assert rep.ok, rep.failures


def test_plan_of_kimi_k26_at_full_size(tmp_path):
    """The published dimensions (61 layers, hidden 7168, 64 heads, kv_lora 512, rope 64, 384
    experts), config only: KV tokens per GPU at TP 8 for BF16 and FP8 caches within 2 % of the
    seed's 686K and 1.37M (which counted the weights a little differently)."""
    from quantize.testing.tiny import KIMI_K26_CONFIG

    p = plan(KIMI_K26_CONFIG, tp=8)
    s = p.summary()
    assert s["source_format"] == "ct-int4"
    kv = s["kv_tokens_per_gpu"]
    assert abs(kv["bf16"] / 686_000 - 1) < 0.02 and abs(kv["fp8"] / 1_370_000 - 1) < 0.02, kv
    assert 540 * 2**30 < s["source_bytes"] < 600 * 2**30  # ~594 GB, as the release is on disk
    assert s["roles"]["expert_gate"] == {"pass_int4": 60 * 384}


def test_eval_and_card_of_what_was_made_from_it(source, tmp_path):
    """KLD through transformers: the pass-through is the source (0 exactly), the FP8 block prefill
    weights close to it; each card names the base model, with the relation that is true."""
    from huggingface_hub import ModelCard

    from quantize.evaluate.kld import kld
    from quantize.publish.card import card

    same, pre = tmp_path / "same", tmp_path / "fp8"
    convert(source, same, base_model="moonshotai/Kimi-K2.6")
    convert(source, pre, scheme="fp8-block", profile="all-linear", base_model="moonshotai/Kimi-K2.6")
    r = kld(source, same, tokens=200, chunk=64)
    assert r.kld_max == pytest.approx(0, abs=1e-5) and r.top1_agreement == 1.0
    f = kld(source, pre, tokens=200, chunk=64)
    assert 0 < f.kld_mean < 0.05 and f.top1_agreement > 0.5, f  # near-uniform tiny model: top-1 is noisy
    for folder, relation in ((same, None), (pre, "quantized")):
        card(folder)
        data = ModelCard.load(folder / "README.md").data.to_dict()
        assert data["base_model"] == "moonshotai/Kimi-K2.6" and data.get("base_model_relation") == relation
    text = (same / "README.md").read_text()
    assert "passed through bit for bit" in text and "absmax / 7.5" not in text
    assert "FP8_BLOCK" in (pre / "README.md").read_text()
    rq = tmp_path / "rq"
    convert(source, rq, requantize=True, base_model="moonshotai/Kimi-K2.6")
    card(rq)
    assert "were not kept" in (rq / "README.md").read_text()


def test_fp8_block_shape_rule_at_tp(tiny, tmp_path):
    """vLLM's validate_fp8_block_shape: the split dimension per rank a whole number of 128-blocks."""
    from quantize.shard import fp8_block_violation

    assert fp8_block_violation((1024, 7168), "col", 8) is None  # 128 rows per rank
    assert "N (output rows) per rank % 128" in fp8_block_violation((1024, 7168), "col", 16)  # 64: a near miss
    assert fp8_block_violation((7168, 2048), "row", 16) is None
    assert "K (input columns)" in fp8_block_violation((7168, 2048), "row", 32)
    assert fp8_block_violation((576, 7168), "rep", 8) is None  # replicated: not split
    assert fp8_block_violation((200, 300), "col", 1) is None
    out = tmp_path / "fp8"
    convert(tiny("kimi_k25"), out, scheme="fp8-block")
    assert check(out, tp=2).ok  # 256-wide experts: 128 per rank
    rep = check(out, tp=4)
    assert not rep.ok and any("FP8 block weights need K (input columns) per rank % 128" in f and "use --tp 1 or 2" in f
                              for f in rep.failures), rep.failures


def test_requantize_with_gptq_is_proven_by_its_grid(tiny, tmp_path):
    """--requantize --method gptq on Moonshot's INT4: the layer pass reads the dequantized experts,
    and check proves each GPTQ tensor by its grid and recorded error against the exact dequantization."""
    src, out = tiny("kimi_k25"), tmp_path / "g"
    convert(src, out, requantize=True, method="gptq", samples=4, seq_len=32)
    man = json.loads((out / "quantize_manifest.json").read_text())
    assert man["passed_through"]["requantized"] == 48 and man["method"]["method"] == "gptq"
    rep = check(out, source=src)
    assert rep.ok, rep.failures
    assert rep.verified.get("tensors_method_vs_source", 0) > 0


def test_our_matcher_is_compressed_tensors_match_name():
    """plan matches an INT4 source's config without importing compressed-tensors: the same answers
    as its match_name on Kimi's names and Moonshot's patterns (plain names exact, re: re.match)."""
    from compressed_tensors.utils.match import match_name

    from quantize.plan import _ct_name_match, _Patterns
    from quantize.testing.tiny import MOONSHOT_IGNORE

    names = ["lm_head", "language_model.lm_head", "language_model.model.layers.0.self_attn.kv_b_proj",
             "language_model.model.layers.1.mlp.experts.3.down_proj", "language_model.model.layers.1.mlp.gate",
             "language_model.model.layers.0.mlp.gate_proj", "vision_tower.blocks.0.mlp.fc0", "mm_projector.proj.0"]
    pats = MOONSHOT_IGNORE + ["re:.*experts\\.3\\..*", "Linear", "language_model.lm_head"]
    for n in names:
        for p in pats:
            assert _ct_name_match(n, p) == match_name(n, p), (n, p)
        assert _Patterns(pats).match(n) == any(match_name(n, p) for p in pats), n


def test_plan_cli_for_each_scheme(tiny):
    """`quantize plan` prints the INT4 pass-through and the FP8 block plan of the release (a near miss
    of a summary that lost the INT4 group size for FP8 block was a traceback)."""
    from typer.testing import CliRunner

    from quantize.cli import app

    for extra, want in (([], "INT4 g32"), (["--scheme", "fp8-block"], "FP8 block 128x128")):
        res = CliRunner().invoke(app, ["plan", str(tiny("kimi_k25")), "--tp", "2", *extra], env={"COLUMNS": "200"})
        assert res.exit_code == 0 and res.exception is None, res.output
        text = " ".join(res.output.split())  # the table's title wraps at its width
        assert want in text and ("pass_int4 16" in text or "fp8 16" in text)


def test_prefill_card_says_the_decode_weights_are_the_sources_only_when_they_are(tiny, tmp_path):
    """Passed through and nothing quantized: 'the source's own INT4 weights'; the near miss, the
    same release with its BF16 attention quantized too (--profile all-linear), is not described so."""
    from quantize.evaluate.pd import write_prefill

    src = tiny("kimi_k25")
    convert(src, tmp_path / "same")
    convert(src, tmp_path / "more", profile="all-linear")
    write_prefill(src, tmp_path / "same", tmp_path / "p1")
    write_prefill(src, tmp_path / "more", tmp_path / "p2")
    assert "the source's own INT4 weights, passed through bit for bit" in (tmp_path / "p1" / "README.md").read_text()
    assert "passed through bit for bit" not in (tmp_path / "p2" / "README.md").read_text()
