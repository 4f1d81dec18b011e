"""convert against independent oracles: compressed-tensors / llmcompressor model_free_ptq and
transformers' own loader and model classes."""

import json

import pytest
import torch

from quantize.convert import convert
from quantize.formats import int4

from .conftest import dir_bytes, load_dir

ARCHS = ["glm_moe_dsa", "kimi_k25"]
ORACLE_ARCHS = ARCHS + ["deepseek_v3"]  # DeepSeek-V3 itself (Kimi's text model, without the wrapper)


def _no_scale_modules(src, scale_name):
    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    mods = sorted({k[:-7] for k in idx if k.endswith(".weight") and f"{k[:-7]}.{scale_name}" not in idx})
    return ["re:" + m.replace(".", r"\.") + "$" for m in mods]


def _bf16_reference(src, out):
    """The FP8 source dequantized to BF16 by compressed-tensors' own FP8BlockDequantizer."""
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer, convert_checkpoint

    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    bf16 = sorted({k[:-7] for k in idx if k.endswith(".weight") and k[:-7] + ".weight_scale_inv" not in idx})
    conv = FP8BlockDequantizer(ignore=["re:" + m.replace(".", r"\.") + "$" for m in bf16])
    convert_checkpoint(src, out, conv, device="cpu")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _load_model(path):
    import transformers

    cfg = json.loads((path / "config.json").read_text())
    cls = getattr(transformers, {"KimiK25ForConditionalGeneration": "Kimi_K25ForConditionalGeneration"}.get(
        cfg["architectures"][0], cfg["architectures"][0]))
    return cls.from_pretrained(path, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("arch", ORACLE_ARCHS)
def test_output_tensors_and_config_equal_model_free_ptq(arch, tiny, converted, tmp_path):
    """RTN's default, the minmax grid (no --observer given): every tensor and the quantization_config
    equal llmcompressor's model_free_ptq (with compressed-tensors' FP8BlockDequantizer) on the same
    FP8 input."""
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import model_free_ptq

    src, ours = tiny(arch, layout="fp8"), converted(arch, layout="fp8", group_size=32)  # Kimi: as K2 Instruct ships
    qc = json.loads((ours / "config.json").read_text())["quantization_config"]
    assert json.loads((ours / "quantize_manifest.json").read_text())["options"]["observer"] == "minmax"
    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    bf16 = sorted({k[:-7] for k in idx if k.endswith(".weight") and k[:-7] + ".weight_scale_inv" not in idx})
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    model_free_ptq(model_stub=str(src), save_directory=str(tmp_path / "mfp"), scheme=scheme, ignore=qc["ignore"],
                   converter=FP8BlockDequantizer(ignore=["re:" + m.replace(".", r"\.") + "$" for m in bf16]), device="cpu")
    a, b = load_dir(ours), load_dir(tmp_path / "mfp")
    assert set(a) == set(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert bad == []
    assert sum(k.endswith("weight_packed") for k in a) == 3 * 8 * 3  # 8 experts x 3 proj x (2 MoE + 1 MTP)
    theirs = json.loads((tmp_path / "mfp" / "config.json").read_text())["quantization_config"]
    assert qc == theirs


@pytest.mark.parametrize("arch", ORACLE_ARCHS)
def test_transformers_loads_output_and_weights_equal_our_dequant(arch, converted):
    out = converted(arch, group_size=32)
    model = _load_model(out)
    sd = model.state_dict()
    files = load_dir(out)
    prefix = "model.language_model." if arch == "kimi_k25" else "model."
    disk = "language_model.model." if arch == "kimi_k25" else "model."
    checked = 0
    for layer in (1, 2):
        gu = sd[f"{prefix}layers.{layer}.mlp.experts.gate_up_proj"]
        dn = sd[f"{prefix}layers.{layer}.mlp.experts.down_proj"]
        for e in range(8):
            deq = {}
            for p in ("gate_proj", "up_proj", "down_proj"):
                m = f"{disk}layers.{layer}.mlp.experts.{e}.{p}"
                shape = tuple(files[m + ".weight_shape"].tolist())
                deq[p] = int4.dequantize_int4(files[m + ".weight_packed"], files[m + ".weight_scale"], shape)
            assert torch.equal(gu[e], torch.cat([deq["gate_proj"], deq["up_proj"]], 0))
            assert torch.equal(dn[e], deq["down_proj"])
            checked += 3
    assert checked == 48


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_close_to_fp8_reference(arch, tiny, converted, tmp_path):
    """INT4 g32 model vs the FP8 source dequantized by compressed-tensors, through transformers.
    Bound (random-init tiny models, routed experts INT4, weight rel. error ~0.095): relative L2
    error of logits < 0.20 and top-1 agreement >= 75% over 64 positions (measured: GLM 0.106 /
    84%, Kimi 0.129 / 86%). Control: the same model with one layer's experts read in the wrong
    nibble order (K reversed) must break the bound."""
    ref = _load_model(_bf16_reference(tiny(arch, layout="fp8"), tmp_path / "ref"))
    cand = _load_model(converted(arch, layout="fp8", group_size=32))
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ref(input_ids=ids).logits.float()
        b = cand(input_ids=ids).logits.float()
    rel = float((a - b).norm() / a.norm())
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    assert 0 < rel < 0.20, rel
    assert agree >= 0.75, agree
    experts = (cand.model.language_model if arch == "kimi_k25" else cand.model).layers[1].mlp.experts
    experts.gate_up_proj.data = experts.gate_up_proj.data.flip(-1)
    with torch.no_grad():
        c = cand(input_ids=ids).logits.float()
    assert float((a - c).norm() / a.norm()) > 0.20


def test_deterministic_across_worker_counts(tiny, tmp_path):
    src = tiny("glm_moe_dsa")
    convert(src, tmp_path / "w1", workers=1)
    convert(src, tmp_path / "w3", workers=3)
    a, b = dir_bytes(tmp_path / "w1"), dir_bytes(tmp_path / "w3")
    a.pop("quantize_manifest.json"), b.pop("quantize_manifest.json")
    assert a == b


def test_manifest_says_where_the_shard_phase_went(tiny, tmp_path, monkeypatch):
    """The manifest's ``kernels`` records the workers and the shard phase's seconds (what a slow node is
    bound by: the workers' conversions, the writer's writes, its waits, the commits). The workers'
    ``compute`` is their conversions' time summed: with each conversion made to take 20 ms or more, it
    is at least 20 ms x the INT4 tensors the manifest counts (the oracle; one worker's share alone, or
    the wall, would be about half); the writer waits for them, so ``wait`` grows."""
    import time

    from quantize import convert as C

    src = tiny("glm_moe_dsa")
    convert(src, tmp_path / "a", workers=2)
    m = json.loads((tmp_path / "a" / "quantize_manifest.json").read_text())
    k = m["kernels"]
    assert k["workers"] == 2 and set(k["phase_seconds"]) == {"compute", "wait", "write", "commit"}
    assert all(v >= 0 for v in k["phase_seconds"].values())
    # and the run's wall, step by step: RTN has no calibration data, layers or activation scales
    assert set(m["wall_seconds"]) == {"plan", "setup", "resume_check", "shards", "config_wait"}
    assert sum(m["wall_seconds"].values()) <= m["seconds"]
    real, real_plan = C.compute_job, C.build_plan
    monkeypatch.setattr(C, "compute_job", lambda *a: (time.sleep(0.02), real(*a))[1])
    monkeypatch.setattr(C, "build_plan", lambda *a, **kw: (time.sleep(0.5), real_plan(*a, **kw))[1])
    convert(src, tmp_path / "b", workers=2)
    mb = json.loads((tmp_path / "b" / "quantize_manifest.json").read_text())
    slow, wall = mb["kernels"]["phase_seconds"], mb["wall_seconds"]
    n = len(m["tensors"])
    assert n > 10 and slow["compute"] >= 0.02 * n
    assert slow["wait"] > k["phase_seconds"]["wait"]
    # each slowed step is charged where it ran: the plan its 0.5 s (not the step after it), the
    # shards at least half the workers' 20 ms each (2 workers)
    assert wall["plan"] >= 0.5 and wall["setup"] < 0.5 + m["wall_seconds"]["setup"]
    assert wall["shards"] >= 0.01 * n


def test_mse_observer_lowers_weight_error_and_reports_it(converted):
    mm = json.loads((converted("glm_moe_dsa", group_size=32) / "quantize_manifest.json").read_text())
    ms = json.loads((converted("glm_moe_dsa", group_size=32, observer="mse") / "quantize_manifest.json").read_text())
    for role in ("expert_gate", "expert_up", "expert_down"):
        a, b = mm["error_summary"][role], ms["error_summary"][role]
        assert b["mean_rel_err"] < a["mean_rel_err"]
        assert abs(b["mean_rel_err_minmax"] - a["mean_rel_err"]) < 1e-9
        assert b["mse_vs_minmax_sq_err_reduction"] > 0.01


def test_group_sizes_and_all_linear_profile(converted):
    out = converted("glm_moe_dsa", group_size=128, profile="all-linear")
    t = load_dir(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["config_group_0"]["weights"]["group_size"] == 128
    assert t["model.layers.0.self_attn.q_a_proj.weight_scale"].shape == (128, 2)
    assert "model.layers.0.mlp.gate_proj.weight_packed" in t  # dense MLP INT4
    assert "model.layers.0.self_attn.indexer.wk.weight" in t  # indexer stays BF16
    assert t["model.layers.0.self_attn.indexer.wk.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.gate.weight" in t and "lm_head.weight" in t
    _load_model(out)  # transformers accepts the all-linear layout too


def test_bf16_source_and_gqa(tiny, tmp_path):
    src = tiny("llama", layout="bf16")
    out = tmp_path / "o"
    convert(src, out, profile="all-linear", group_size=64)
    t = load_dir(out)
    assert t["model.layers.0.self_attn.k_proj.weight_packed"].shape == (128, 32)
    m = _load_model(out)
    ref = _load_model(src)
    ids = torch.arange(20).view(1, 20)
    with torch.no_grad():
        rel = float((m(ids).logits - ref(ids).logits).float().norm() / ref(ids).logits.float().norm())
    assert rel < 0.2


def test_non_weight_files_copied_and_source_untouched(tiny, converted):
    src = tiny("glm_moe_dsa")
    before = dir_bytes(src)
    out = converted("glm_moe_dsa", group_size=32)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (src / f).read_bytes()
    assert dir_bytes(src) == before
    m = json.loads((out / "quantize_manifest.json").read_text())
    assert set(m["outputs"]) == {p.name for p in out.glob("*.safetensors")}
    assert m["tool"]["compressed_tensors"] == "0.19.0" and m["options"]["group_size"] == 32
    assert len(m["tensors"]) == 72 and all(0 < s["rel_err"] < 0.2 for s in m["tensors"])
    assert not (out / "model-00001-of-00003.safetensors.partial").exists()


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8_BLOCK"])
def test_compressed_tensors_fp8_source(scheme, tiny, tmp_path):
    """A compressed-tensors FP8 source (channel or block `weight_scale`, written by llmcompressor
    itself): our output equals model_free_ptq run with compressed-tensors' own dequantizer."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import model_free_ptq

    fp8src = tmp_path / scheme
    model_free_ptq(model_stub=str(tiny("llama", layout="bf16")), save_directory=str(fp8src), scheme=scheme,
                   ignore=["lm_head", "re:.*embed_tokens.*"], device="cpu")
    ours = tmp_path / "ours"
    res = convert(fp8src, ours, profile="all-linear", group_size=64)
    assert res.plan["source_format"] == "ct-fp8" and res.tensors_int4 == 14
    qc = json.loads((ours / "config.json").read_text())["quantization_config"]
    ws = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64))
    model_free_ptq(model_stub=str(fp8src), save_directory=str(tmp_path / "mfp"), scheme=ws, ignore=qc["ignore"],
                   converter=CompressedTensorsDequantizer(str(fp8src), ignore=_no_scale_modules(fp8src, "weight_scale")), device="cpu")
    a, b = load_dir(ours), load_dir(tmp_path / "mfp")
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    _load_model(ours)


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_fp8(arch, tiny, converted, tmp_path):
    """--keep-fp8: INT4 experts as usual; attention / shared / dense weights stay the vendor's FP8
    bytes with their multiplier renamed to compressed-tensors' `weight_scale` (same semantics);
    a second, regex-targeted float-quantized block group describes them (name matches outrank the
    "Linear" class target in compressed-tensors and SGLang), and the config parses as
    compressed-tensors' own QuantizationConfig. transformers 5.17 cannot load a mixed-precision
    fused-MoE checkpoint (its expert conversion finds no tensors), so loading is not tested here."""
    from compressed_tensors.quantization import QuantizationConfig

    src = tiny(arch, layout="fp8")
    out = tmp_path / "kf"
    convert(src, out, keep_fp8=True)
    a, ref, s = load_dir(out), load_dir(converted(arch, layout="fp8", group_size=32)), load_dir(src)
    for k, v in a.items():
        if k.endswith(("weight_packed", "weight_shape")) or (k.endswith("weight_scale") and k.replace("weight_scale", "weight_packed") in a):
            assert torch.equal(v, ref[k])
        elif v.dtype == torch.float8_e4m3fn:
            assert torch.equal(v.view(torch.uint8), s[k].view(torch.uint8))
            assert torch.equal(a[k[:-6] + "weight_scale"], s[k[:-6] + "weight_scale_inv"])
    pre = "language_model." if arch == "kimi_k25" else ""
    assert a[f"{pre}model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert a[f"{pre}model.layers.1.mlp.shared_experts.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert a[f"{pre}model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and set(qc["config_groups"]) == {"config_group_0", "config_group_1"}
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.config_groups["config_group_1"].weights.strategy == "block"
    assert sum(v.numel() * v.element_size() for v in a.values()) < sum(v.numel() * v.element_size() for v in ref.values())


def test_default_workers_are_the_usable_cpus(tiny, tmp_path, monkeypatch):
    """Without --workers, one worker per CPU this process may use (``options.usable_cpus``: affinity and
    cgroup quota), not per CPU of the host: a container limited to 3 of 64 CPUs runs 3."""
    import os

    from quantize import convert as C

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(C, "usable_cpus", lambda: 3)
    convert(tiny("glm_moe_dsa"), tmp_path / "a")
    assert json.loads((tmp_path / "a" / "quantize_manifest.json").read_text())["kernels"]["workers"] == 3


# ---- scripts/bench_convert.py: the disk floor and the fixed / marginal split ----


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_convert.py"
    spec = importlib.util.spec_from_file_location("bench_convert", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path


def test_bench_fit_is_the_line_through_two_runs():
    """1 GB in 5 s and 3 GB in 6 s: 2 GB more in 1 s more, so 2 GB/s past a fixed 4.5 s; a floor of
    0.1 s + 1 GB/s against it at 10 GB: 10.1 / 9.5. A bigger run that was not slower has no line."""
    b, _ = _bench()
    fixed, rate = b.fit((1e9, 5.0), (3e9, 6.0))
    assert (fixed, rate) == pytest.approx((4.5, 2e9))
    assert b.fraction_at(10e9, (0.1, 1e9), (4.5, 2e9)) == pytest.approx(10.1 / 9.5)
    assert b.fit((1e9, 5.0), (3e9, 5.0)) is None and b.fit((3e9, 5.0), (3e9, 6.0)) is None
    assert b.fit((1e9, 5.0), (3e9, 5.001)) is not None  # the near miss: barely slower has a line
    # summarize: the same runs as measure() records them; convert 1 GB in 5 s, 3 GB in 6 s; the floor
    # 1 GB in 1.1 s, 3 GB in 3.1 s (0.1 s + 1 GB/s)
    runs = {"small": {"bytes": 1e9, "quantize": {"seconds": 5.0}, "floor": {"seconds": 1.1}},
            "big": {"bytes": 3e9, "quantize": {"seconds": 6.0}, "floor": {"seconds": 3.1}}}
    summary, line = b.summarize(runs)
    size = b.RELEASE_BYTES
    assert summary == {"whole_run": round(3.1 / 6.0, 3), "fixed_s": 4.5, "marginal": 2.0, "marginal_gbps": 2.0,
                       "floor_marginal_gbps": 1.0, "release_fraction": round((0.1 + size / 1e9) / (4.5 + size / 2e9), 3)}
    assert "marginal 2.00" in line and "fixed 4.5 s" in line
    runs["big"]["floor"]["seconds"] = 1.1  # the floor's bigger run no slower: no marginal figure at all
    assert b.summarize(runs)[0] == {"whole_run": round(1.1 / 6.0, 3)}
    assert b.summarize({"big": runs["big"]})[0] == {"whole_run": round(1.1 / 6.0, 3)}


def test_bench_convert_dry_run(tmp_path):
    """The script's code on tiny widths: the floor writes exactly as many bytes as convert wrote (after
    reading every source byte), and the summary is recomputed here from the recorded runs."""
    import subprocess
    import sys

    b, path = _bench()
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(path), "--dry-run", "--gb", "0.005", "--skip-baseline", "--work",
                        str(tmp_path / "w"), "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())
    runs, summary = got["runs"], got["summary"]
    assert set(runs) == {"big", "small"} and runs["small"]["bytes"] < runs["big"]["bytes"]
    for m in runs.values():
        assert m["floor"]["written"] == m["quantize"]["written"] > 0
    # convert writes INT4 (half a byte and a 2-byte scale per 32 weights) for the FP8 experts: less than it reads
    assert runs["big"]["quantize"]["written"] < runs["big"]["bytes"]
    # the writer alone, hashing after and beside each write: whole 6 MiB tensors up to convert's bytes
    # (at least one), each rate the recorded bytes over the recorded seconds
    want_bytes = max(1, min(1 << 30, runs["big"]["quantize"]["written"]) // (6 << 20)) * (6 << 20)
    for m in ("inline", "beside"):
        r = got["writer"][m]
        assert r["writer_bytes"] == want_bytes and r["writer_seconds"] > 0
        assert summary["writer_gbps"][m] == round(r["writer_bytes"] / r["writer_seconds"] / 1e9, 3)
    assert "hashing beside it" in p.stdout
    big, small = runs["big"], runs["small"]
    assert summary["whole_run"] == round(big["floor"]["seconds"] / big["quantize"]["seconds"], 3)
    line = {}
    for k in ("floor", "quantize"):
        (b1, t1), (b2, t2) = (small["bytes"], small[k]["seconds"]), (big["bytes"], big[k]["seconds"])
        if t2 <= t1:  # noise on a few MB: the script says so and gives no marginal figure
            assert "marginal" not in summary and "no marginal rate" in p.stdout
            return
        slope = (t2 - t1) / (b2 - b1)  # seconds per byte
        line[k] = (t1 - b1 * slope, slope)
    assert summary["marginal"] == round(line["floor"][1] / line["quantize"][1], 3)
    assert summary["fixed_s"] == round(line["quantize"][0], 2)
    size = got["release_bytes"]
    want = (line["floor"][0] + size * line["floor"][1]) / (line["quantize"][0] + size * line["quantize"][1])
    assert summary["release_fraction"] == round(want, 3)
    assert f"quantize / floor throughput: {summary['whole_run']:.2f}" in p.stdout


def test_a_conversion_that_quantizes_nothing_is_refused(tiny, tmp_path):
    """A dense model under the default --profile experts (or --scheme fp8-block), and a recipe whose
    targets match no weight of the model, would write the source copied under a quantization_config
    (0 tensors quantized, exit 0, and check then refused the folder): refused in one line, nothing
    written. Near miss: --profile all-linear on the same model quantizes its Linears. ``plan`` still
    sizes it (the KV capacity of a dense model)."""
    from quantize.errors import QuantizeError
    from quantize.plan import plan

    src = tiny("llama", layout="bf16")
    for kw in ({}, {"scheme": "fp8-block"}):
        with pytest.raises(QuantizeError, match=r"--profile experts selects no weight to quantize, so the output "
                                                r"would be a copy of the source; pass --profile all-linear") as e:
            convert(src, tmp_path / "o", **kw)
        assert "\n" not in str(e.value) and not (tmp_path / "o").exists()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("""quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["re:.*mlp\\\\.experts\\\\..*"]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
""")
    with pytest.raises(QuantizeError, match="the recipe's targets and ignore list leave no weight to quantize"):
        convert(src, tmp_path / "o", recipe=str(recipe))
    assert not (tmp_path / "o").exists()
    assert plan(src).summary()["kv_bytes_per_token"]
    res = convert(src, tmp_path / "all", profile="all-linear")
    assert res.tensors_int4 > 0
