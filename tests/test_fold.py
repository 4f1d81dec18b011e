"""calibrate-kv by what the engines do: MLA on SGLang/vLLM caches at unit scale, so no scale is
written; --fold reparametrises the weights exactly (powers of two) so the unit-scale cache sees a
good e4m3 range. Proofs: logits equal the source's (fp32), cached rows land in range, only the
named tensors changed."""

import json

import pytest
import torch

from quantize.calibrate.kv import calibrate_kv
from quantize.calibrate.runner import LayerStreamer
from quantize.checkpoint.index import CheckpointIndex
from quantize.checkpoint.reader import WeightReader
from quantize.convert import convert
from quantize.errors import QuantizeError

from .conftest import load_dir

KW = dict(samples=4, seq_len=48)


def _logits(model, ids):
    st = LayerStreamer(model)
    hidden = None
    for _, hidden in st.stream([ids]):
        pass
    p = st.arch.prefix
    norm = getattr(st.modeling, st.prefix + "RMSNorm")(st.config.hidden_size, eps=st.config.rms_norm_eps)
    norm.weight.data = st.tensor(p + "model.norm.weight")
    with torch.no_grad():
        out = norm(hidden[0]) @ st.tensor(p + "lm_head.weight").T
    st.close()
    return out


def _ids(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return torch.tensor(tok("the cat of a dog is in the box and what is that", add_special_tokens=True)["input_ids"])


def _changed(a_dir, b_dir):
    a, b = load_dir(a_dir), load_dir(b_dir)
    assert set(a) == set(b)
    return sorted(k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)))


def _check_fold(src, out, res, headroom=2.0, expect_rope=True):
    man = json.loads((out / "quantize_manifest.json").read_text())
    assert man["mode"] == "fold" and res.fold and len(res.fold) == len(res.layers)
    # exact reparametrisation: the same logits in fp32
    ids = _ids(src)
    a, b = _logits(src, ids), _logits(out, ids)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())
    # only the named tensors changed, and they are the fold's
    changed = _changed(src, out)
    assert changed == man["changed_tensors"] == sorted(res.written)
    assert any("kv_a_layernorm" in n for n in changed) and any("kv_b_proj" in n for n in changed)
    assert any("kv_a_proj_with_mqa" in n for n in changed) == expect_rope
    assert all(".self_attn." in n for n in changed)
    # no scale, no kv_cache_scheme: the engines would not use them
    assert not any(n.endswith(("k_scale", "v_scale")) for n in load_dir(out))
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg.get("quantization_config") or {}).get("kv_cache_scheme") is None
    # the folded model's cache lands in range: measured again on the output
    again = calibrate_kv(out, None, **KW)
    assert len(again.layers) == len(res.layers)
    limit = 448 / headroom
    for before, after, f in zip(res.layers, again.layers, res.fold):
        assert after.overflow_unit == 0
        assert after.amax_latent == pytest.approx(before.amax_latent * f["latent"], rel=1e-3)
        if not any(n.startswith("latent") for n in f["notes"]):
            assert limit / 2 < after.amax_latent <= limit
        if expect_rope and not any(n.startswith("rope") for n in f["notes"]):
            assert limit / 2 < after.amax_rope <= limit
    return changed


def test_fold_bf16_deepseek(tiny, tmp_path):
    src = tiny("deepseek_v3", layout="bf16")
    res = calibrate_kv(src, tmp_path / "f", fold=True, **KW)
    _check_fold(src, tmp_path / "f", res)
    assert all(f["latent"] > 1 for f in res.fold)  # the tiny model's latent is far below 448: scaled up


def test_fold_block_fp8_kimi_moves_scales_not_codes(tiny, tmp_path):
    """Block FP8: weight_scale_inv moves; q_b_proj's 128-row blocks mix q_nope and q_pe rows, so
    the rope part is not folded, and the report says so."""
    src = tiny("kimi_k25", layout="fp8")  # as Kimi K2 Instruct ships
    res = calibrate_kv(src, tmp_path / "f", fold=True, **KW)
    changed = _check_fold(src, tmp_path / "f", res, expect_rope=False)
    assert all(n.startswith("language_model.") for n in changed)
    assert any(n.endswith("kv_b_proj.weight_scale_inv") for n in changed)
    assert not any(n.endswith("kv_b_proj.weight") for n in changed)  # FP8 codes untouched
    assert all(any("rope: not folded" in x and "mix rope and non-rope rows" in x for x in f["notes"]) for f in res.fold)


def test_fold_int4_all_linear_moves_group_scales(tiny, tmp_path):
    q = tmp_path / "int4"
    convert(tiny("deepseek_v3"), q, profile="all-linear")
    res = calibrate_kv(q, tmp_path / "f", fold=True, **KW)
    changed = _check_fold(q, tmp_path / "f", res)
    assert any(n.endswith("kv_b_proj.weight_scale") for n in changed)
    assert any(n.endswith("q_b_proj.weight_scale") for n in changed)
    assert not any(n.endswith("weight_packed") for n in changed)
    # the folded INT4 checkpoint still dequantizes exactly to the scaled weights
    r0, r1 = WeightReader(CheckpointIndex.open(q)), WeightReader(CheckpointIndex.open(tmp_path / "f"))
    n = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(r1.weight(n) * res.fold[0]["latent"], r0.weight(n))


def test_mla_engine_targets_write_no_scales(tiny, tmp_path):
    src = tiny("deepseek_v3", layout="bf16")
    for target in ("sglang", "vllm"):
        with pytest.raises(QuantizeError, match="no scale to write") as e:
            calibrate_kv(src, tmp_path / target, target=target, **KW)
        assert "\n" not in str(e.value) and "--fold" in str(e.value)
        assert not (tmp_path / target).exists()
    res = calibrate_kv(src, None, target="sglang", **KW)  # the report alone
    assert "UNIT scale" in res.verdict and res.written == [] and len(res.layers) == 3
    assert "--fold" in res.verdict


def test_bf16_moe_report_without_out(tiny):
    res = calibrate_kv(tiny("kimi_k25", layout="bf16"), None, **KW)
    assert len(res.layers) == 3 and res.layout == "mla"
    assert all(r.q_absorbed_amax and r.q_pe_amax for r in res.layers)


def test_compressed_tensors_target_keeps_ct_names(tiny, tmp_path):
    q = tmp_path / "int4"
    convert(tiny("deepseek_v3"), q)
    calibrate_kv(q, tmp_path / "ct", target="compressed-tensors", **KW)
    t = load_dir(tmp_path / "ct")
    assert "model.layers.0.self_attn.k_scale" in t and "model.layers.0.self_attn.v_scale" in t
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8


@pytest.mark.parametrize("arch,kw,match", [
    ("llama", {"fold": True}, "GQA"),
    ("glm_moe_dsa", {"fold": True}, "per-128 dynamic scales"),
    ("deepseek_v3", {"fold": True, "target": "compressed-tensors"}, "--fold with --target compressed-tensors"),
    ("deepseek_v3", {"fold": True, "out": None}, "pass --out"),
    ("deepseek_v3", {"fold": True, "fold_headroom": 0.5}, "--fold-headroom"),
])
def test_fold_bad_input(tiny, tmp_path, arch, kw, match):
    out = kw.pop("out", tmp_path / "o")
    with pytest.raises(QuantizeError, match=match) as e:
        calibrate_kv(tiny(arch, layout="bf16"), out, **KW, **kw)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()


def test_cli_fold(tiny, tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "quantize.cli", "calibrate-kv", str(tiny("deepseek_v3", layout="bf16")),
                        "--out", str(tmp_path / "f"), "--fold", "--samples", "2", "--seq-len", "32", "--json"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["fold"] and rep["written"] and (tmp_path / "f" / "quantize_manifest.json").exists()
