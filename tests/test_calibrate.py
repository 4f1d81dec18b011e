"""calibrate-kv: layer streaming equals transformers' full forward; observed amax equals
transformers' own DynamicCache; scales load in the target; bad input."""

import json
import shutil

import pytest
import torch
import transformers

from quantize.calibrate.kv import calibrate_kv
from quantize.calibrate.runner import LayerStreamer
from quantize.convert import convert
from quantize.errors import QuantizeError

from .conftest import load_dir


def _full_model(path):
    cfg = json.loads((path / "config.json").read_text())
    if cfg["architectures"][0].startswith("Kimi"):
        m = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        tm = m.model.language_model
    else:
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tm = m.model
    tm.config._attn_implementation = "eager"
    return tm.float().eval()  # a decompressed INT4 model comes back in bf16: fp32 is exact from there


def _num_layers(path) -> int:
    """Decoder layers in config.json (Kimi: under text_config); the MTP layer is not cached."""
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["num_hidden_layers"])


CASES = [("llama", "bf16", False), ("glm_moe_dsa", "bf16", False), ("kimi_k25", "bf16", False),
         ("kimi_k25", "fp8", True), ("glm_moe_dsa", "fp8", True), ("kimi_k25", "vendor", False)]


@pytest.mark.parametrize("arch,layout,int4", CASES,
                         ids=["llama-bf16", "glm-bf16", "kimi-bf16", "kimi-int4", "glm-int4", "kimi-native-int4"])
def test_layer_streaming_equals_full_forward(arch, layout, int4, tiny, tmp_path):
    path = tiny(arch, layout=layout)
    if int4:  # our INT4 output, dequantized on the fly; transformers decompresses the same bits
        convert(path, tmp_path / "int4")
        path = tmp_path / "int4"
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    s = LayerStreamer(path)
    ours = [h for _, h in s.stream([ids[0], ids[1]])]
    assert len(ours) == s.num_layers == _num_layers(path)
    tm = _full_model(path)
    caps = []
    hooks = [L.register_forward_hook(lambda mod, a, out: caps.append((out[0] if isinstance(out, tuple) else out).detach()))
             for L in tm.layers[: s.num_layers]]
    for b in range(2):
        with torch.no_grad():
            tm(input_ids=ids[b : b + 1])
    for h in hooks:
        h.remove()
    for i in range(s.num_layers):
        for b in range(2):
            ref = caps[b * s.num_layers + i]
            assert float((ours[i][b] - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("arch", ["kimi_k25", "llama"])
def test_amax_equals_transformers_dynamic_cache(arch, tiny, request, tmp_path):
    """transformers' own DynamicCache holds exactly what the engines cache (MLA: kv_c_normed and
    post-RoPE k_pe; GQA: K and V): its absmax per layer is the independent oracle. (Kimi: our INT4
    output, whose config can carry kv_cache_scheme; transformers decompresses the same bits.)"""
    path = request.getfixturevalue("kimi_int4") if arch == "kimi_k25" else tiny(arch, layout="bf16")
    data = tmp_path / "d.jsonl"
    texts = ["the a of to and in is it that for on with as be by", "what how many are or at from this"] * 2
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    res = calibrate_kv(path, tmp_path / "out", data=str(data), samples=4, seq_len=64, target="compressed-tensors")
    tm = _full_model(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    amax = {}
    for t in texts[:4]:
        cache = transformers.DynamicCache(config=tm.config)
        with torch.no_grad():
            tm(input_ids=torch.tensor([tok(t)["input_ids"]]), past_key_values=cache, use_cache=True)
        for i, layer in enumerate(cache.layers):
            k, v = layer.keys.abs().max().item(), layer.values.abs().max().item()
            a = amax.setdefault(i, [0.0, 0.0])
            a[0], a[1] = max(a[0], k), max(a[1], v)
    assert [r.layer for r in res.layers] == list(range(_num_layers(path))) == sorted(amax)
    for r in res.layers:
        k, v = amax[r.layer]
        if res.layout == "mla":  # keys = kv_c_normed (latent), values = k_pe (rope): one row
            assert r.amax_latent == pytest.approx(k, rel=1e-5) and r.amax_rope == pytest.approx(v, rel=1e-5)
            assert r.amax == pytest.approx(max(k, v), rel=1e-5)
            assert r.scale == pytest.approx(max(k, v) / 448, rel=1e-5)
        else:
            assert r.k_amax == pytest.approx(k, rel=1e-5) and r.v_amax == pytest.approx(v, rel=1e-5)
        assert r.overflow_calibrated == 0.0


@pytest.fixture(scope="module")
def kimi_int4(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi-int4") / "o"
    convert(tiny("kimi_k25", layout="fp8"), out)  # our INT4 of Kimi K2 Instruct's FP8
    return out


def test_mla_compressed_tensors_target_loads_in_transformers(kimi_int4, tmp_path):
    res = calibrate_kv(kimi_int4, tmp_path / "o", samples=4, seq_len=32, target="compressed-tensors")
    m = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(tmp_path / "o", dtype=torch.float32)
    assert [r.layer for r in res.layers] == list(range(_num_layers(kimi_int4)))
    for r in res.layers:
        attn = m.model.language_model.layers[r.layer].self_attn
        assert attn.k_scale.item() == pytest.approx(r.scale, rel=1e-6) and attn.v_scale.item() == pytest.approx(r.scale, rel=1e-6)


def test_bf16_moe_needs_convert_first_for_ct_scales(tiny, tmp_path):
    """transformers' loader needs a compressed-tensors weight scheme to carry kv_cache_scheme on a
    MoE model; the report alone needs nothing."""
    with pytest.raises(QuantizeError, match="run `quantize convert` first"):
        calibrate_kv(tiny("kimi_k25", layout="bf16"), tmp_path / "o", samples=2, seq_len=16, target="compressed-tensors")
    assert not (tmp_path / "o").exists()
    res = calibrate_kv(tiny("kimi_k25", layout="bf16"), None, samples=2, seq_len=16)
    assert len(res.layers) == 3


def test_mla_engine_target_report_stats_reuse_and_fold(kimi_int4, tmp_path):
    """sglang/vllm cache MLA at unit scale: no scale tensors are written; the report and its stats
    are reusable, and --fold from reused stats writes the folded model (hard-linking what it
    does not change)."""
    path = kimi_int4
    r1 = calibrate_kv(path, None, samples=8, seq_len=64, target="sglang", stats_out=tmp_path / "st.json")
    assert len(r1.layers) == _num_layers(path) == 3
    assert r1.out is None and r1.written == [] and "UNIT scale" in r1.verdict
    stats = json.loads((tmp_path / "st.json").read_text())
    assert [x["layer"] for x in stats["layers"]] == [0, 1, 2] and all("amax" in x and "scale" in x and x["q_absorbed_amax"] for x in stats["layers"])
    with pytest.raises(QuantizeError, match="no scale to write"):
        calibrate_kv(path, tmp_path / "o1", target="vllm", stats=tmp_path / "st.json")
    r2 = calibrate_kv(path, tmp_path / "o2", target="sglang", stats=tmp_path / "st.json", fold=True)
    assert r2.samples == r1.samples and len(r2.layers) == 3 and r2.written
    t = load_dir(tmp_path / "o2")
    assert not [n for n in t if n.endswith(("k_scale", "v_scale"))]
    cfg = json.loads((tmp_path / "o2" / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"] is None
    # shards holding no folded tensor are shared with (hard-linked to) the source, which is untouched
    idx = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    touched = {idx[n] for n in r2.written}
    kept = [f for f in sorted(set(idx.values())) if f not in touched]
    assert kept, "every shard holds a folded tensor: the hard-link path is not exercised"
    for f in kept:
        assert (tmp_path / "o2" / f).stat().st_ino == (path / f).stat().st_ino


def test_compressed_tensors_target_loads_in_transformers(tiny, tmp_path):
    path = tiny("llama", layout="bf16")
    res = calibrate_kv(path, tmp_path / "o", samples=8, seq_len=64, target="compressed-tensors")
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o", dtype=torch.float32)  # bf16 would round the scales
    assert [r.layer for r in res.layers] == list(range(_num_layers(path)))
    for r in res.layers:
        attn = m.model.layers[r.layer].self_attn
        assert attn.k_scale.item() == pytest.approx(r.k_scale, rel=1e-6)
        assert attn.v_scale.item() == pytest.approx(r.v_scale, rel=1e-6)


def test_glm_dsa_writes_no_scales_but_reports(tiny, tmp_path):
    path = tiny("glm_moe_dsa", layout="bf16")
    with pytest.raises(QuantizeError, match="nothing to write"):
        calibrate_kv(path, tmp_path / "o", samples=4, seq_len=32)
    assert not (tmp_path / "o").exists()
    res = calibrate_kv(path, None, samples=4, seq_len=32)
    assert [r.layer for r in res.layers] == list(range(_num_layers(path)))
    assert res.out is None
    assert "no checkpoint scale" in res.verdict
    assert all(r.attn_rel_err_tiles is not None and 0 < r.attn_rel_err_tiles < 0.2 for r in res.layers)


def test_bad_input(tiny, tmp_path):
    path = tiny("llama", layout="bf16")
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": ""}\n{"text": "a"}\n')
    with pytest.raises(QuantizeError, match="no usable samples"):
        calibrate_kv(path, tmp_path / "o", data=str(short))
    notok = tmp_path / "notok"
    shutil.copytree(path, notok)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (notok / f).unlink()
    with pytest.raises(QuantizeError, match="no tokenizer"):
        calibrate_kv(notok, tmp_path / "o2")
    st = tmp_path / "st.json"
    calibrate_kv(path, tmp_path / "o3", samples=2, seq_len=16, stats_out=st)
    with pytest.raises(QuantizeError, match="another model"):
        calibrate_kv(tiny("kimi_k25", layout="bf16"), None, stats=st)
    noattn = tmp_path / "noattn"
    shutil.copytree(path, noattn)
    from safetensors.torch import save_file

    for f in noattn.glob("*.safetensors"):
        f.unlink()
    (noattn / "model.safetensors.index.json").unlink()
    save_file({"model.embed_tokens.weight": torch.zeros(512, 256)}, str(noattn / "model.safetensors"))
    with pytest.raises(QuantizeError, match="no attention tensors"):
        calibrate_kv(noattn, tmp_path / "o5")
    with pytest.raises(QuantizeError, match="--target"):
        calibrate_kv(path, tmp_path / "o6", target="trt")


def test_layer_streaming_fp8_source_equals_ct_dequantized_forward(tiny, tmp_path):
    """Block-FP8 weights dequantized on the fly: equal to transformers running the checkpoint that
    compressed-tensors' own FP8BlockDequantizer wrote."""
    from .test_convert import _bf16_reference

    src = tiny("kimi_k25", layout="fp8")
    ref_dir = _bf16_reference(src, tmp_path / "ref")
    ids = torch.randint(3, 500, (16,), generator=torch.Generator().manual_seed(2))
    s = LayerStreamer(src)
    ours = [h[0] for _, h in s.stream([ids])]
    tm = _full_model(ref_dir)
    caps = []
    for L in tm.layers[: s.num_layers]:
        L.register_forward_hook(lambda mod, a, out: caps.append((out[0] if isinstance(out, tuple) else out).detach()))
    with torch.no_grad():
        tm(input_ids=ids.unsqueeze(0))
    assert len(ours) == len(caps) == _num_layers(src)
    for a, b in zip(ours, caps):
        assert float((a - b).norm() / b.norm()) < 1e-5


def test_glm_amax_equals_independent_hooks(tiny, tmp_path):
    """GLM-5 DSA caches expanded K/V, so the latent comes from a hook on kv_a_layernorm and k_pe from
    the rope part of transformers' own DynamicCache keys."""
    path = tiny("glm_moe_dsa", layout="bf16")
    text = "the a of to and in is it that for on with as be by this"
    data = tmp_path / "d.txt"
    data.write_text(text)
    res = calibrate_kv(path, None, data=str(data), samples=1, seq_len=64)
    tm = _full_model(path)
    lat = {}
    for i, L in enumerate(tm.layers):
        L.self_attn.kv_a_layernorm.register_forward_hook(lambda m, a, out, i=i: lat.__setitem__(i, float(out.abs().max())))
    cache = transformers.DynamicCache(config=tm.config)
    ids = transformers.AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    with torch.no_grad():
        tm(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    rope = int(tm.config.qk_rope_head_dim)
    assert [r.layer for r in res.layers] == list(range(_num_layers(path))) == sorted(lat)
    for r in res.layers:
        assert r.amax_latent == pytest.approx(lat[r.layer], rel=1e-5)
        assert r.amax_rope == pytest.approx(float(cache.layers[r.layer].keys[..., -rope:].abs().max()), rel=1e-5)


def test_parquet_and_folder_data(tiny, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "data"
    d.mkdir()
    pq.write_table(pa.table({"question": ["how many are in this", "what is it"], "n": [1, 2]}), d / "a.parquet")
    (d / "b.txt").write_text("the a of to and\n\nin is it that for")
    path = tiny("llama", layout="bf16")
    res = calibrate_kv(path, tmp_path / "o", data=str(d), samples=10, seq_len=32)
    assert res.samples == 4 and res.dropped_short == 0 and len(res.layers) == _num_layers(path)


def test_sample_options_refused_before_the_model_is_opened(tiny, tmp_path, monkeypatch):
    import quantize.calibrate.kv as kv

    def boom(*a, **k):
        raise AssertionError("the model was opened before the options were checked")

    monkeypatch.setattr(kv, "LayerStreamer", boom)
    path = tiny("llama", layout="bf16")
    for kw, msg in [(dict(samples=0), r"^--samples 0: must be at least 1"), (dict(samples=-5), r"^--samples -5: "),
                    (dict(seq_len=0), r"^--seq-len 0: must be at least 2 tokens"), (dict(seq_len=1), r"^--seq-len 1: ")]:
        with pytest.raises(QuantizeError, match=msg):
            calibrate_kv(path, tmp_path / "o", **kw)
    assert not (tmp_path / "o").exists()


def test_binary_and_undecodable_data_files_named(tiny, tmp_path):
    """Binary or non-UTF-8 calibration files are refused in one line naming the file (they used to
    surface as a UnicodeDecodeError or a pyarrow traceback)."""
    import re
    import subprocess
    import sys

    path = tiny("llama", layout="bf16")
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.txt").write_text("the a of to and in is it that for")
    binary = d / "b.jsonl"
    binary.write_bytes(b'{"text": "ok"}\n' + bytes(range(256)))
    with pytest.raises(QuantizeError, match=rf"^{re.escape(str(binary))}: binary data \(NUL byte at offset 15\), not text; pass UTF-8"):
        calibrate_kv(path, tmp_path / "o1", data=str(d), samples=2, seq_len=16)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(QuantizeError, match=rf"^{re.escape(str(latin))}: not UTF-8 text \(byte 0xe9 at offset 3\); re-encode it as UTF-8"):
        calibrate_kv(path, tmp_path / "o2", data=str(latin), samples=2, seq_len=16)
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(QuantizeError, match=rf"^{re.escape(str(fake))}: not a readable Parquet file \(.*\); pass another --data$"):
        calibrate_kv(path, tmp_path / "o3", data=str(fake), samples=2, seq_len=16)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode() + b'{"text": "the a of to and in is it that for"}\n')
    assert calibrate_kv(path, tmp_path / "o4", data=str(bom), samples=2, seq_len=16).samples == 1  # a UTF-8 BOM is fine
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "calibrate-kv", str(path), "--out", str(tmp_path / "o5"), "--data", str(latin)],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and f"{latin}: not UTF-8 text" in p.stderr


def test_mla_scale_covers_the_rope_part_when_it_dominates_the_row(tiny, tmp_path):
    """The MLA row is kv_c_normed (kv_lora_rank) then post-RoPE k_pe (qk_rope_head_dim), cached at
    ONE scale: in the shipped tiny models the latent's amax is the larger, so a scale taken from the
    latent alone would pass the DynamicCache test above. Here layer 1's rope rows of
    kv_a_proj_with_mqa (its last qk_rope_head_dim output rows, BF16 on disk) are scaled x64, so
    k_pe dominates that layer's row; the oracle is transformers' own DynamicCache on the edited model."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = tiny("kimi_k25", layout="bf16")
    path = tmp_path / "rope-heavy"
    shutil.copytree(src, path)
    text = json.loads((path / "config.json").read_text())["text_config"]
    rank, rope, layer = int(text["kv_lora_rank"]), int(text["qk_rope_head_dim"]), 1
    name = f"language_model.model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"
    f = path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(f, "pt") as fh:
        t, meta = {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()
    assert t[name].shape == (rank + rope, int(text["hidden_size"])) and t[name].dtype == torch.bfloat16
    w = t[name].clone()
    w[rank:] *= 64  # a power of two: exact in BF16; the latent rows [:rank] untouched
    t[name] = w
    save_file(t, str(f), metadata=meta)

    data = tmp_path / "d.jsonl"
    texts = ["the a of to and in is it that for on with as be by", "what how many are or at from this"]
    data.write_text("\n".join(json.dumps({"text": s}) for s in texts))
    res = calibrate_kv(path, None, data=str(data), samples=2, seq_len=64)
    assert res.layout == "mla"

    tm = _full_model(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    lat, pe = {}, {}
    for s in texts:
        cache = transformers.DynamicCache(config=tm.config)
        with torch.no_grad():
            tm(input_ids=torch.tensor([tok(s)["input_ids"]]), past_key_values=cache, use_cache=True)
        for i, c in enumerate(cache.layers):  # keys: kv_c_normed [B, 1, S, rank]; values: k_pe [B, 1, S, rope]
            assert c.keys.shape[-1] == rank and c.values.shape[-1] == rope
            lat[i] = max(lat.get(i, 0.0), float(c.keys.abs().max()))
            pe[i] = max(pe.get(i, 0.0), float(c.values.abs().max()))
    assert [r.layer for r in res.layers] == sorted(lat) == list(range(_num_layers(path)))
    assert pe[layer] > 4 * lat[layer]  # the fixture: the rope part dominates layer 1's row
    for r in res.layers:
        row = max(lat[r.layer], pe[r.layer])
        assert r.amax_latent == pytest.approx(lat[r.layer], rel=1e-5)
        assert r.amax_rope == pytest.approx(pe[r.layer], rel=1e-5)
        assert r.amax == pytest.approx(row, rel=1e-5)
        assert r.scale == pytest.approx(row / 448, rel=1e-5)  # e4m3's largest finite value
    r = res.layers[layer]
    assert r.scale != pytest.approx(lat[layer] / 448, rel=0.5)  # what a latent-only scale would be
