"""The full-range grid (issue 11.1): scale = signed extreme / -8, all 16 codes used; same file
format, read right by compressed-tensors' own dequantization and by transformers."""

import json

import pytest
import torch

from quantize.check import check
from quantize.convert import convert
from quantize.formats import int4

from .conftest import load_dir


def _w(shape=(64, 256), seed=0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)


def test_extreme_lands_on_minus_8_and_all_codes_used():
    w = _w()
    q, s = int4.quantize_groups(w, 32, "fullrange")
    g = w.float().view(64, 8, 32)
    ext = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    qg = q.view(64, 8, 32)
    at = qg.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
    assert (at == -8).all()
    assert torch.equal(torch.sign(s.float()), -torch.sign(ext))  # negative scale for a positive extreme
    assert set(q.unique().tolist()) == set(range(-8, 8))
    q_mm, _ = int4.quantize_groups(w, 32, "minmax")
    assert (q_mm == -8).float().mean() < (q == -8).float().mean()


@pytest.mark.parametrize("observer", ["fullrange", "fullrange-mse"])
def test_compressed_tensors_dequantizes_it_like_we_do(observer):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    w = _w(seed=1)
    r = int4.quantize_pack(w, 32, observer)
    q = unpack_from_int32(r.packed, 4, torch.Size(w.shape))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    theirs = dequantize(q, r.scale, None, args, dtype=torch.bfloat16)
    ours = int4.dequantize_int4(r.packed, r.scale, tuple(w.shape))
    assert torch.equal(theirs, ours)


def test_lower_error_than_minmax_on_gaussian_weights():
    w = _w((256, 512), seed=2)
    e = {o: int4.quantize_pack(w, 32, o).rel_err for o in int4.OBSERVERS}
    assert e["fullrange"] < e["minmax"] and e["fullrange-mse"] <= e["fullrange"] and e["mse"] < e["minmax"]


def test_convert_fullrange_loads_in_transformers_and_checks_exact(tiny, tmp_path):
    import transformers

    src = tiny("deepseek_v3")
    out = tmp_path / "fr"
    res = convert(src, out, observer="fullrange")
    mm = convert(src, tmp_path / "mm")
    assert res.mean_rel_err < mm.mean_rel_err
    man = json.loads((out / "quantize_manifest.json").read_text())
    assert man["options"]["observer"] == "fullrange"
    files = load_dir(out)
    assert any((files[k].float() < 0).any() for k in files if k.endswith("weight_scale"))
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    gu = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    m = "model.layers.1.mlp.experts.3."
    deq = [int4.dequantize_int4(files[m + p + ".weight_packed"], files[m + p + ".weight_scale"],
                                tuple(files[m + p + ".weight_shape"].tolist())) for p in ("gate_proj", "up_proj")]
    assert torch.equal(gu[3], torch.cat(deq, 0))
    rep = check(out, source=src)
    assert rep.ok, rep.failures
    assert rep.verified["tensors_exact_vs_source"] > 0
