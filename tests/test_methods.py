"""Data-aware methods (--method gptq / autoround): layer-sequential, MoE-aware, resumable, the
output format unchanged. Tiny fixtures, a few short samples: seconds per conversion."""

import json
import os
import signal
import subprocess
import sys
import weakref

import pytest
import torch

from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.evaluate.kld import kld
from quantize.formats import int4

from .conftest import dir_bytes, load_dir

CAL = dict(samples=4, seq_len=64)


def _manifest(out):
    return json.loads((out / "quantize_manifest.json").read_text())


def _weights_only(d):
    b = dir_bytes(d)
    b.pop("quantize_manifest.json")
    return b


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama", fp8_source=False)


@pytest.fixture(scope="module")
def outs(llama, tmp_path_factory):
    """Tiny dense llama, every decoder Linear INT4 g32: RTN, GPTQ, AutoRound (20 steps) and its
    iters-0 grid, on the same calibration samples."""
    root = tmp_path_factory.mktemp("methods")
    res = {}
    for name, kw in {"rtn": {}, "gptq": dict(method="gptq", **CAL),
                     "autoround": dict(method="autoround", iters=20, **CAL),
                     "autoround0": dict(method="autoround", iters=0, **CAL),
                     "fullrange": dict(observer="fullrange")}.items():
        convert(llama, root / name, profile="all-linear", workers=2, **kw)
        res[name] = root / name
    return res


def _load(path):
    import transformers
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                         quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


def test_gptq_format_unchanged_loads_and_differs_from_rtn(outs):
    rtn, gptq = outs["rtn"], outs["gptq"]
    a, b = load_dir(rtn), load_dir(gptq)
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)
    qa = json.loads((rtn / "config.json").read_text())["quantization_config"]
    qb = json.loads((gptq / "config.json").read_text())["quantization_config"]
    assert qa == qb  # pack-quantized, static groups, no g_idx: what the engines load
    packed = [k for k in a if k.endswith("weight_packed")]
    assert len(packed) == 14
    # same grid (static minmax scales of the source weight), other codes
    for k in packed:
        m = k[: -len(".weight_packed")]
        assert torch.equal(a[m + ".weight_scale"], b[m + ".weight_scale"])
    changed = sum(not torch.equal(a[k], b[k]) for k in packed)
    assert changed == len(packed)
    # transformers (compressed-tensors' decompression) reads back exactly our q * scale
    sd = _load(gptq).state_dict()
    w = int4.dequantize_int4(b["model.layers.1.mlp.down_proj.weight_packed"], b["model.layers.1.mlp.down_proj.weight_scale"],
                             tuple(b["model.layers.1.mlp.down_proj.weight_shape"].tolist()), dtype=torch.float32)
    assert torch.allclose(sd["model.layers.1.mlp.down_proj.weight"].float(), w, rtol=2 ** -8, atol=0)


def test_gptq_lowers_layer_loss_and_kld(outs, llama):
    rep = _manifest(outs["gptq"])["method"]
    assert rep["method"] == "gptq" and rep["grid"] == "minmax" and rep["samples"] == 4 and rep["seq_len"] == 64
    assert [r["layer"] for r in rep["layers"]] == [0, 1]
    for r in rep["layers"]:
        assert r["units"] == 7 and r["fallbacks"] == []
        assert r["loss"] < 0.5 * r["loss_rtn"], r
    k_rtn = kld(llama, outs["rtn"], tokens=256, chunk=64).kld_mean
    k_gptq = kld(llama, outs["gptq"], tokens=256, chunk=64).kld_mean
    assert k_gptq < 0.8 * k_rtn, (k_gptq, k_rtn)
    # the manifest's per-tensor statistics say which method made each tensor
    assert {t["method"] for t in _manifest(outs["gptq"])["tensors"]} == {"gptq"}


def test_gptq_codes_are_llm_compressors_update(llama, tmp_path, monkeypatch):
    """Our layer pass hands quantize_weight the weight, its Hessian (2 x^T x / samples of the
    layer's own input) and the static grid; re-running llm-compressor's function on what we
    captured gives our codes exactly."""
    from llmcompressor.modifiers.gptq import gptq_quantize

    from quantize.methods import gptq as G

    calls = []
    real = gptq_quantize.quantize_weight

    def spy(W, H, scale, zp, gs, qargs, blocksize, percdamp):
        calls.append((W.clone(), H.clone(), scale.clone(), qargs, blocksize, percdamp))
        return real(W, H, scale, zp, gs, qargs, blocksize=blocksize, percdamp=percdamp)

    monkeypatch.setattr(gptq_quantize, "quantize_weight", spy)
    out = tmp_path / "o"
    convert(llama, out, profile="all-linear", method="gptq", damp=0.05, block=64, workers=1, **CAL)
    assert len(calls) == 2 * 4  # per layer, one call per weight shape: q/o, k/v, gate/up, down
    t = load_dir(out)
    ours = {k[: -len(".weight_packed")]: int4.unpack_int4(v, int(t[k[: -len("packed")] + "shape"][1])).float()
            for k, v in t.items() if k.endswith(".weight_packed")}
    matched = set()
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # as the pass runs it (a Cholesky's last bits depend on the thread count)
    try:
        for W, H, scale, qargs, blocksize, percdamp in calls:
            assert blocksize == 64 and percdamp == 0.05 and qargs.group_size == 32 and qargs.actorder is None
            zp = torch.zeros(scale.shape, dtype=torch.int8)
            wq = real(W.clone(), H.clone(), scale, zp, None, qargs, blocksize=64, percdamp=0.05)[0]
            codes = (wq / scale.float().repeat_interleave(32, -1)).round()
            assert torch.equal(codes, codes.clamp(-8, 7))  # on the grid
            for j in range(W.shape[0]):
                hit = [m for m, c in ours.items() if c.shape == codes[j].shape and torch.equal(c, codes[j])
                       and torch.equal(t[m + ".weight_scale"], scale[j])]
                assert len(hit) == 1
                matched.add(hit[0])
            # negative control: another Hessian gives other codes
            other = real(W.clone(), torch.eye(W.shape[-1]).expand_as(H).clone(), scale, zp, None, qargs, blocksize=64, percdamp=0.05)[0]
            assert not torch.equal((other / scale.float().repeat_interleave(32, -1)).round(), codes)
    finally:
        torch.set_num_threads(old)
    assert matched == set(ours) and len(matched) == 14
    assert G.CHUNK < 16  # llm-compressor switches to batched Cholesky at 16
