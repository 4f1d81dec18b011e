"""quantize check verifies everything it can: every file against the manifest's SHA-256, and with
--source every tensor against what the source implies (copies and FP8 dequantization bit for bit,
INT4 re-quantized code for code)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantize.check import check
from quantize.checkpoint.output import sha256_file


@pytest.fixture
def out(converted, tmp_path):
    d = tmp_path / "o"
    shutil.copytree(converted("glm_moe_dsa", group_size=32, observer="mse"), d)
    return d


def _edit(folder, name, fn, fix_manifest=False):
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    f = folder / idx["weight_map"][name]
    with safe_open(f, "pt") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = fh.metadata()
    fn(t)
    save_file(t, str(f), metadata=meta)
    if fix_manifest:  # a change the manifest was (wrongly) updated for: only the source can tell
        m = json.loads((folder / "quantize_manifest.json").read_text())
        m["files"][f.name] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
        (folder / "quantize_manifest.json").write_text(json.dumps(m))
        rec = json.loads((folder / ".quantize" / "job.json").read_text())  # and the job record, which check compares
        rec["files"][f.name] = m["files"][f.name]
        (folder / ".quantize" / "job.json").write_text(json.dumps(rec))
    return f


def test_clean_output_proves_every_file_and_tensor(out, tiny):
    rep = check(out, source=tiny("glm_moe_dsa"))
    assert rep.ok, rep.failures
    n_files = len(json.loads((out / "quantize_manifest.json").read_text())["files"])
    assert rep.verified["files_sha256"] == n_files > 5
    n_out = sum(1 for _ in out.glob("*.safetensors"))
    assert n_out >= 2
    from quantize.checkpoint.index import CheckpointIndex

    idx = CheckpointIndex.open(out)
    n_int4 = sum(1 for n in idx.tensors if n.endswith(".weight_packed"))
    n_plain = sum(1 for n in idx.tensors if not n.endswith((".weight_packed", ".weight_scale", ".weight_shape")))
    assert rep.verified["tensors_exact_vs_source"] == n_int4 + n_plain


def test_changed_file_fails_its_sha(out):
    f = _edit(out, "model.layers.0.self_attn.o_proj.weight", lambda t: t["model.layers.0.self_attn.o_proj.weight"].zero_())
    rep = check(out)
    assert not rep.ok and any(f.name in x and "SHA-256" in x for x in rep.failures)


def test_missing_or_unrecorded_files(out):
    (out / "tokenizer.json").unlink()
    (out / "extra.safetensors").write_bytes((out / "model-00001-of-00003.safetensors").read_bytes())
    rep = check(out)
    assert any("tokenizer.json" in x and "missing" in x for x in rep.failures)
    assert any("extra.safetensors" in x and "does not record" in x for x in rep.failures)


def test_unrecorded_weight_file_in_a_subfolder_fails(out):
    """A weight file the manifest does not record fails wherever it lies in the output, not only at
    its top level (an engine that globs recursively, or a user's `cp -r`, would pick it up)."""
    src = out / "model-00001-of-00003.safetensors"
    (out / "extra" / "deeper").mkdir(parents=True)
    for stray in (out / "extra" / "stray.safetensors", out / "extra" / "deeper" / "stray.safetensors"):
        stray.write_bytes(src.read_bytes())
    rep = check(out)
    assert not rep.ok
    assert rep.failures == [f"{out / 'extra' / 'deeper' / 'stray.safetensors'}: a weight file the manifest does not record",
                            f"{out / 'extra' / 'stray.safetensors'}: a weight file the manifest does not record"]


def test_no_manifest_fails(out):
    (out / "quantize_manifest.json").unlink()
    rep = check(out)
    assert not rep.ok and any("quantize_manifest.json" in x and "missing" in x for x in rep.failures)


@pytest.mark.parametrize("name,how", [
    ("model.layers.0.self_attn.o_proj.weight", "zero"),                  # BF16 (dequantized FP8) attention
    ("model.layers.1.input_layernorm.weight", "flip"),                  # a norm copied as is
    ("model.layers.1.mlp.gate.e_score_correction_bias", "flip"),         # fp32 router bias
    ("model.layers.2.mlp.experts.5.down_proj.weight_packed", "flip"),   # INT4 codes
    ("model.layers.1.mlp.experts.0.up_proj.weight_scale", "flip"),      # INT4 scales
])
def test_source_catches_any_changed_tensor(out, tiny, name, how):
    def fn(t):
        x = t[name]
        if how == "zero":
            x.zero_()
        else:
            raw = x.view(torch.uint8).view(-1)
            raw[:3] ^= 0x10  # a few flipped bits
    _edit(out, name, fn, fix_manifest=True)
    assert check(out).ok  # the manifest alone cannot see it now
    rep = check(out, source=tiny("glm_moe_dsa"))
    assert not rep.ok
    module = name.rsplit(".", 1)[0]
    assert any(module in x and "differ" in x for x in rep.failures), rep.failures


def test_source_catches_a_dropped_or_added_tensor(out, tiny):
    name = "model.layers.1.post_attention_layernorm.weight"

    def fn(t):
        t["model.layers.1.extra.weight"] = t.pop(name)
    _edit(out, name, fn, fix_manifest=True)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.1.extra.weight"] = idx["weight_map"].pop(name)
    (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    rep = check(out, source=tiny("glm_moe_dsa"))
    assert any(name in x and "not in the output" in x for x in rep.failures)
    assert any("model.layers.1.extra.weight" in x and "nothing in the source" in x for x in rep.failures)


def test_cli_check_names_the_tensor_and_exits_1(out, tiny):
    name = "model.layers.0.self_attn.o_proj.weight"
    _edit(out, name, lambda t: t[name].zero_(), fix_manifest=True)
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "check", str(out), "--source", str(tiny("glm_moe_dsa"))],
                       capture_output=True, text=True)
    assert p.returncode == 1 and name in p.stderr


# GPTQ / AutoRound outputs: not re-derivable without the calibration pass, so check proves their
# grid and recomputes their recorded error against the source (and still catches any change)

@pytest.fixture(scope="module")
def method_outs(converted):
    """Tiny DeepSeek-V3 as the vendor ships it (block FP8), routed experts INT4 by GPTQ and by AutoRound."""
    return {"gptq": converted("deepseek_v3", method="gptq", samples=4, seq_len=64),
            "autoround": converted("deepseek_v3", method="autoround", iters=5, samples=4, seq_len=64)}


@pytest.fixture(params=["gptq", "autoround"])
def mout(request, method_outs, tmp_path):
    d = tmp_path / request.param
    shutil.copytree(method_outs[request.param], d)
    return request.param, d


def _made_by(d, how):
    """A routed expert's down_proj the method itself made (not an RTN fallback)."""
    m = json.loads((d / "quantize_manifest.json").read_text())
    return next(t["name"][: -len(".weight")] for t in m["tensors"] if t.get("method") == how and ".experts." in t["name"])


def test_method_output_proven_by_grid_and_recorded_error(mout, tiny):
    how, d = mout
    expert = _made_by(d, how)
    m = json.loads((d / "quantize_manifest.json").read_text())
    by = {}
    for t in m["tensors"]:
        by[t.get("method")] = by.get(t.get("method"), 0) + 1
    assert by[how] > 0 and by.get("rtn", 0) > 0  # the MTP layer's experts are RTN (outside the layers transformers runs)
    rep = check(d, source=tiny("deepseek_v3"))
    assert rep.ok, rep.failures
    assert rep.verified["tensors_method_vs_source"] == by[how]
    from quantize.checkpoint.index import CheckpointIndex

    idx = CheckpointIndex.open(d)
    n_int4 = sum(1 for n in idx.tensors if n.endswith(".weight_packed"))
    n_plain = sum(1 for n in idx.tensors if not n.endswith((".weight_packed", ".weight_scale", ".weight_shape")))
    assert rep.verified["tensors_exact_vs_source"] == n_int4 + n_plain - by[how]  # RTN fallbacks still exactly
    # the same folder is not this model's conversion of another source (the BF16 weights before FP8)
    other = check(d, source=tiny("deepseek_v3", layout="bf16"))
    assert not other.ok and any(expert in x for x in other.failures)


@pytest.mark.parametrize("part", ["weight_packed", "weight_scale"])
def test_method_output_catches_changed_codes_or_scales(mout, tiny, part):
    how, d = mout
    expert = _made_by(d, how)
    name = f"{expert}.{part}"

    def fn(t):
        raw = t[name].view(torch.uint8).view(-1)
        raw[4:7] ^= 0x10
    _edit(d, name, fn, fix_manifest=True)
    assert check(d).ok  # the manifest alone cannot see it now
    rep = check(d, source=tiny("deepseek_v3"))
    assert not rep.ok
    msgs = [x for x in rep.failures if expert in x]
    assert msgs, rep.failures
    if how == "gptq" and part == "weight_scale":  # within the searched clip range: the recorded error catches it
        assert "not the one the conversion recorded" in msgs[0] or "GPTQ group scales lie outside" in msgs[0], msgs
    else:
        assert "not the one the conversion recorded" in msgs[0] or "outside [0.5, 1]" in msgs[0], msgs


def test_autoround_scale_outside_its_clip_range_is_named(method_outs, tiny, tmp_path):
    d = tmp_path / "ar"
    shutil.copytree(method_outs["autoround"], d)
    expert = _made_by(d, "autoround")
    _edit(d, f"{expert}.weight_scale", lambda t: t[f"{expert}.weight_scale"].mul_(0.25), fix_manifest=True)
    rep = check(d, source=tiny("deepseek_v3"))
    assert any(expert in x and "AutoRound group scales lie outside [0.5, 1]" in x for x in rep.failures), rep.failures


def test_kernel_error_by_row_blocks_is_the_whole_tensors(monkeypatch):
    """``check``'s kernel row, a block of weight rows at a time (304 rows: two 128-row blocks and one of
    48), against the same error computed here on the whole tensor; an unpack that differs in the last
    block only is caught."""
    from quantize import check as C
    from quantize.formats import int4
    from quantize.kernels.cpu import CpuW4A16
    from quantize.kernels.reference import w4a16_reference

    g = torch.Generator().manual_seed(5)
    r = int4.quantize_pack(torch.randn(304, 256, generator=g) * 0.02, 32)
    x = torch.randn(8, 256, generator=g).to(torch.bfloat16)
    ref = w4a16_reference(x, r.packed, r.scale, (304, 256))
    y = CpuW4A16.from_packed(r.packed, r.scale, (304, 256))(x).float()
    err, got_ref = C._kernel_err(x, r.packed, r.scale, (304, 256))
    assert err == pytest.approx(float((y - ref).norm() / ref.norm()), rel=1e-5) and err > 0
    assert torch.allclose(got_ref, ref, rtol=1e-6, atol=1e-6)
    assert C._unpack_ok(r.packed, (304, 256))
    real = C._ct_unpack

    def last_block_off(p, shape):  # compressed-tensors' unpack made to differ in one value of the last block
        u = real(p, shape)
        if p.shape[0] == 48:
            u[-1, 0] = 99
        return u

    monkeypatch.setattr(C, "_ct_unpack", last_block_off)
    assert not C._unpack_ok(r.packed, (304, 256))
