"""Bad input: one line naming the file or tensor and the fix, non-zero exit, nothing presented as
complete, the source untouched."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.testing.tiny import make_tiny


@pytest.fixture
def src(tiny, tmp_path):
    d = tmp_path / "src"
    shutil.copytree(tiny("glm_moe_dsa"), d)
    return d


def _index(d):
    return json.loads((d / "model.safetensors.index.json").read_text())


def _rewrite(d, fn):
    """Apply fn(name -> tensor dict) to the shard holding the first expert of layer 1."""
    target = "model.layers.1.mlp.experts.0.gate_proj.weight"
    f = d / _index(d)["weight_map"][target]
    with safe_open(f, "pt") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys()}
    fn(t, target)
    save_file(t, str(f), metadata={"format": "pt"})
    idx = _index(d)
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k in t or v != f.name}
    for k in t:
        idx["weight_map"][k] = f.name
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def _fails(src, out, match, **kw):
    with pytest.raises(QuantizeError, match=match) as e:
        convert(src, out, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    assert not (out / "quantize_manifest.json").exists() and not (out / "config.json").exists()
    return msg


def test_missing_shard(src, tmp_path):
    (src / "model-00002-of-00003.safetensors").unlink()
    msg = _fails(src, tmp_path / "o", "missing")
    assert "model-00002-of-00003.safetensors" in msg


def test_truncated_shard(src, tmp_path):
    f = src / "model-00003-of-00003.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    msg = _fails(src, tmp_path / "o", "truncated")
    assert f.name in msg and "re-download" in msg


def test_index_entry_outside_source(src, tmp_path):
    idx = _index(src)
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = "../elsewhere.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _fails(src, tmp_path / "o", "points outside")


def test_scale_shape_mismatch_named(src, tmp_path):
    _rewrite(src, lambda t, w: t.__setitem__(w[:-6] + "weight_scale_inv", torch.ones(1, 1)))
    msg = _fails(src, tmp_path / "o", "ceil grid")
    assert "experts.0.gate_proj.weight_scale_inv" in msg


def test_missing_weight_scale_inv(src, tmp_path):
    _rewrite(src, lambda t, w: t.pop(w[:-6] + "weight_scale_inv"))
    msg = _fails(src, tmp_path / "o", "has no .*weight_scale_inv")
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in msg


def test_nan_in_fp8_weight(src, tmp_path):
    def fn(t, w):
        raw = t[w].view(torch.uint8).clone()
        raw[3, 5] = 0x7F  # e4m3fn NaN
        t[w] = raw.view(torch.float8_e4m3fn)
    _rewrite(src, fn)
    msg = _fails(src, tmp_path / "o", "NaN or Inf")
    assert "experts.0.gate_proj.weight" in msg


def test_inf_in_bf16_weight(src, tmp_path):
    name = []

    def fn(t, w):
        k = next(k for k in t if t[k].dtype == torch.bfloat16 and k.endswith("layernorm.weight"))
        t[k][7] = float("inf")
        name.append(k)
    _rewrite(src, fn)
    msg = _fails(src, tmp_path / "o", "NaN or Inf")
    assert name[0] in msg


def test_k_not_divisible_by_group(tmp_path):
    d = make_tiny("glm_moe_dsa", tmp_path / "s", overrides={"moe_intermediate_size": 96})
    msg = _fails(d, tmp_path / "o", "not a multiple of group size 64", group_size=64)
    assert "down_proj" in msg and "--group-size 32" in msg


def test_unknown_architecture(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    msg = _fails(src, tmp_path / "o", "unknown architecture")
    assert "GlmMoeDsaForCausalLM" in msg and "DeepseekV3ForCausalLM" in msg


def test_pickle_checkpoint_refused(tmp_path):
    d = tmp_path / "pkl"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    torch.save({"x": torch.zeros(2)}, d / "pytorch_model.bin")
    _fails(d, tmp_path / "o", "pickle")


def test_no_space_left(src, tmp_path, monkeypatch):
    import quantize.checkpoint.writer as writer

    real_open = open

    def full_open(path, mode="r", *a, **kw):
        if str(path).endswith(".partial") and "b" in mode:
            return real_open("/dev/full", mode, *a, **kw)
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(writer, "open", full_open, raising=False)
    msg = _fails(src, tmp_path / "o", "no space left")
    assert "--resume" in msg


def test_output_inside_source_refused(src):
    _fails(src, src / "out", "overlaps the input")


def test_overwrite_only_replaces_quantize_outputs(src, tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    _fails(src, other, "did not write it")
    _fails(src, other, "did not write it", overwrite=True)
    assert (other / "precious.txt").exists()


def test_cli_error_is_one_line_nonzero(src, tmp_path):
    (src / "model-00001-of-00003.safetensors").unlink()
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "convert", str(src), str(tmp_path / "o")], capture_output=True, text=True)
    assert p.returncode == 2
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "model-00001-of-00003.safetensors" in lines[0]
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: --device cuda is valid here")
def test_device_cuda_without_gpu(src, tmp_path):
    _fails(src, tmp_path / "o", "no CUDA device", device="cuda")
