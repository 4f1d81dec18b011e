"""Prefill/decode pairs: the fidelity check (the prefill model's cache, stored as the decode pool
stores it, decoded by the decode model) and the prefill artifact (card + SGLang PD launch lines
pointing at the source, no weights)."""

import json
import shlex

import pytest
import torch
from typer.testing import CliRunner

from quantize.cli import app
from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.evaluate import pd
from quantize.evaluate.kld import load_model
from quantize.evaluate.pd import DECODE_ALONE, PAIR, pd_fidelity, write_prefill

SOURCE_FP8 = "source, its cache stored as the decode pool does"


@pytest.fixture(scope="module")
def dsv3(tiny, tmp_path_factory):
    """A tiny DeepSeek-V3 BF16 source and its INT4 (routed experts) conversion."""
    src = tiny("deepseek_v3", layout="bf16")
    out = tmp_path_factory.mktemp("pd") / "dsv3-int4"
    convert(src, out)
    return src, out


def test_mla_pair_reads_the_prefill_cache_stored_e4m3(dsv3, tiny):
    src, dec = dsv3
    rep = pd_fidelity(src, dec, src, prompt_tokens=48, decode_tokens=24)
    assert rep.layout == "mla-latent" and "unit scale" in rep.stored
    rows = {r.name: r for r in rep.rows}
    assert set(rows) == {PAIR, DECODE_ALONE, "decode model alone, BF16 cache", SOURCE_FP8}
    assert 0 < rows[PAIR].kld_mean < 0.05 and 0 < rows[DECODE_ALONE].kld_mean < 0.05
    assert 0 <= rows[SOURCE_FP8].kld_mean < rows[PAIR].kld_mean * 5

    # the decode model really reads what the prefill side cached: a prefill model with other
    # weights (another seed) wrecks the pair, while the decode model alone is unaffected
    other = tiny("deepseek_v3", layout="bf16", seed=1)
    bad = pd_fidelity(other, dec, src, prompt_tokens=48, decode_tokens=24)
    assert bad.row(PAIR).kld_mean > 10 * rows[PAIR].kld_mean
    assert bad.row(DECODE_ALONE).kld_mean == pytest.approx(rows[DECODE_ALONE].kld_mean)

    # with a BF16 cache and the source on both sides only BF16 rounding of the cache is left
    same = pd_fidelity(src, src, src, prompt_tokens=48, decode_tokens=24, kv_cache_dtype="bf16")
    assert same.row(PAIR).kld_mean < 1e-4 and same.row(PAIR).top1_agreement > 0.9


def test_mla_stored_cache_is_e4m3_latent_expanded_by_the_decode_model(dsv3):
    src, dec = dsv3
    ms, md = load_model(src, torch.float32), load_model(dec, torch.float32)
    ids = torch.arange(5, 37).unsqueeze(0)
    with torch.no_grad():
        cache = ms(input_ids=ids, use_cache=True).past_key_values
    stored, layout = pd.stored_cache(ms, md, cache, None, "fp8_e4m3")
    assert layout == "mla-latent"
    rank = ms.config.kv_lora_rank
    for orig, layer in zip(cache.layers, stored.layers):
        assert layer.keys.shape[-1] == rank and layer.values.shape[-1] == ms.config.qk_rope_head_dim
        for a, b in ((orig.keys, layer.keys), (orig.values, layer.values)):
            as_fp8 = b.to(torch.float8_e4m3fn).float()
            assert torch.equal(as_fp8, b)  # every stored value is an e4m3 number (unit scale)
            assert not torch.equal(a, b) and torch.allclose(a, b, rtol=0.07, atol=2 ** -9)
    assert not torch.equal(cache.layers[0].keys, stored.layers[0].keys)  # the prefill's cache itself is untouched


def test_dsa_pair_on_glm(tiny, tmp_path):
    src = tiny("glm_moe_dsa")
    dec = tmp_path / "glm-int4"
    convert(src, dec)
    rep = pd_fidelity(src, dec, src, prompt_tokens=40, decode_tokens=16)
    assert rep.layout == "mla-expanded" and "656 B/token/layer" in rep.stored
    assert 0 < rep.row(PAIR).kld_mean < 0.1 and 0 < rep.row(SOURCE_FP8).kld_mean
    # the latent taken from the prefill model, re-expanded by the decode side, reproduces the
    # source when nothing is rounded but BF16
    same = pd_fidelity(src, src, src, prompt_tokens=40, decode_tokens=16, kv_cache_dtype="bf16")
    assert same.row(PAIR).kld_mean < 1e-3 < rep.row(SOURCE_FP8).kld_mean


def test_gqa_smollm2_pair(smollm2, tmp_path):
    dec = tmp_path / "smol-int4"
    convert(smollm2, dec, profile="all-linear", group_size=32)
    rep = pd_fidelity(smollm2, dec, smollm2, prompt_tokens=96, decode_tokens=32, out=tmp_path / "pd.json")
    assert rep.layout == "gqa"
    pair, alone, fp8 = rep.row(PAIR), rep.row(DECODE_ALONE), rep.row(SOURCE_FP8)
    # a real model: the prefill side is the exact source, so the pair is no worse than the INT4
    # model alone by more than noise, and the FP8 cache alone costs far less than INT4 weights
    assert 0 < pair.kld_mean < 0.5 and pair.kld_mean < alone.kld_mean * 1.25
    assert fp8.kld_mean < pair.kld_mean and fp8.top1_agreement >= 0.9
    assert json.loads((tmp_path / "pd.json").read_text())["rows"][0]["name"] == PAIR


def test_eval_pd_cli(dsv3, tmp_path):
    src, dec = dsv3
    res = CliRunner().invoke(app, ["eval-pd", "--prefill-model", str(src), "--decode-model", str(dec), "--source", str(src),
                                   "--prompt-tokens", "24", "--decode-tokens", "8", "--out", str(tmp_path / "pd.json"), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "pd.json").read_text())
    assert rep["decode_tokens"] == 8 and [r["name"] for r in rep["rows"]][:2] == [PAIR, DECODE_ALONE]
    short = CliRunner().invoke(app, ["eval-pd", "--prefill-model", str(src), "--decode-model", str(dec), "--source", str(src),
                                     "--prompt-tokens", "100000"])
    assert short.exit_code == 2 and "fewer than prompt 100000" in short.output
    nobase = CliRunner().invoke(app, ["eval-pd", "--prefill-model", str(src), "--decode-model", str(dec)])
    assert nobase.exit_code == 2 and "--source is required" in nobase.output


def test_bad_pd_input_one_line(dsv3, tmp_path):
    src, dec = dsv3
    with pytest.raises(QuantizeError, match="kv-cache-dtype fp8_e5m2"):
        pd_fidelity(src, dec, src, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(QuantizeError, match="no config.json; pass the prefill model's folder"):
        pd_fidelity(tmp_path, dec, src)


def test_prefill_artifact_points_at_the_source_revision(dsv3, tmp_path):
    import shutil

    src, dec = dsv3
    snap = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-V3" / "snapshots" / "0123abcd"
    shutil.copytree(src, snap, ignore=shutil.ignore_patterns(".quantize"))
    rep = pd_fidelity(src, dec, src, prompt_tokens=24, decode_tokens=8, out=tmp_path / "pd.json")
    rec = write_prefill(snap, dec, tmp_path / "prefill", repo="org/DeepSeek-V3-W4A16", pd_report=tmp_path / "pd.json", prefill_tp=8,
                        decode_tp=4, transfer_backend="nixl")
    files = sorted(p.name for p in (tmp_path / "prefill").iterdir() if p.is_file())
    assert files == ["README.md", "launch.sh", "prefill.json", "quantize_manifest.json"]  # no weights
    assert rec["source"] == "deepseek-ai/DeepSeek-V3" and rec["revision"] == "0123abcd"
    p, d, r = rec["launch"]["prefill"], rec["launch"]["decode"], rec["launch"]["router"]
    assert p[p.index("--model-path") + 1] == "deepseek-ai/DeepSeek-V3" and p[p.index("--revision") + 1] == "0123abcd"
    assert p[p.index("--disaggregation-mode") + 1] == "prefill" and d[d.index("--disaggregation-mode") + 1] == "decode"
    assert d[d.index("--model-path") + 1] == "org/DeepSeek-V3-W4A16" and d[d.index("--tp") + 1] == "4"
    for args in (p, d):  # the same cache dtype on both pools, as SGLang's decode side requires
        assert args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and args[args.index("--disaggregation-transfer-backend") + 1] == "nixl"
        assert args[args.index("--disaggregation-bootstrap-port") + 1] == "8998"
    assert r[:4] == ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"] and "--decode" in r
    at = r.index("--prefill")  # URL, then the bootstrap port the decode pool pulls the KV cache from
    assert r[at + 2] == p[p.index("--disaggregation-bootstrap-port") + 1]
    card = (tmp_path / "prefill" / "README.md").read_text()
    assert "base_model: deepseek-ai/DeepSeek-V3" in card and "no weights" in card
    assert "sglang/srt/disaggregation/common/conn.py" in card and "sglang/srt/arg_groups/fields/disagg.py" in card
    assert f"{rep.row(PAIR).kld_mean:.5f}" in card and shlex.join(p) in card
    assert (tmp_path / "prefill" / "launch.sh").read_text().count("python -m") == 3
    with pytest.raises(QuantizeError, match="already exists"):
        write_prefill(snap, dec, tmp_path / "prefill")
    # a plain folder: the launch line names the folder, and no revision is invented
    rec = write_prefill(src, dec, tmp_path / "prefill2")
    assert rec["source"] == str(src.resolve()) and rec["revision"] is None and "--revision" not in rec["launch"]["prefill"]
    assert "no Hub revision recorded" in (tmp_path / "prefill2" / "README.md").read_text()


def test_folded_decode_model_behind_an_unfolded_prefill_is_caught(dsv3, tmp_path):
    """fold rescales the cached MLA latent; an unfolded prefill pool writes it: the pair breaks,
    the folded model alone is fine, and the check says so."""
    from quantize.calibrate.kv import calibrate_kv

    src, dec = dsv3
    res = calibrate_kv(dec, tmp_path / "fold", samples=4, seq_len=64, fold=True)
    assert any((f["latent"], f["rope"]) != (1.0, 1.0) for f in res.fold)
    rep = pd_fidelity(src, tmp_path / "fold", src, prompt_tokens=32, decode_tokens=16)
    assert rep.row(PAIR).kld_mean > 10 * rep.row(DECODE_ALONE).kld_mean


@pytest.mark.parametrize("name", ["glm-5.2-pd.yaml", "kimi-k2.6-pd.yaml"])
def test_pd_recipes_parse(name):
    from pathlib import Path

    from quantize.pipeline import load_pipeline

    recipe = Path(__file__).resolve().parents[1] / "recipes" / name
    # a shipped recipe names no folder of a machine: the source comes from --source
    with pytest.raises(QuantizeError, match="pipeline.source is missing; pass --source DIR"):
        load_pipeline(recipe)
    p = load_pipeline(recipe, source="/models/release")
    assert p.opts["source"] == "/models/release"
    assert {"prefill", "push"} <= set(p.stages) and p.opts["pd"]["kv_cache_dtype"] == "fp8_e4m3"
    # a release of this size is evaluated through the engine; transformers' fp32 pair check does not fit a node
    assert "pd-eval" not in p.stages and (p.opts["eval"]["serve"], p.opts["eval"]["tp"]) == ("sglang", 8)
    assert p.opts["kv"]["fold"] is False and p.opts["push"]["dry_run"] is True


def test_pd_recipe_yields_decode_and_prefill_artifacts(tmp_path):
    from pathlib import Path

    import yaml

    from quantize import pipeline

    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "glm-5.2-pd.yaml").read_text())
    doc["pipeline"].update(source="tiny:glm_moe_dsa", out=str(tmp_path / "run"), stages=["convert", "pd-eval", "card", "prefill", "push"])
    doc["pipeline"]["pd"].update(prompt_tokens=32, decode_tokens=8, device="cpu", decode_tp=2)
    r = tmp_path / "pd.yaml"
    r.write_text(yaml.safe_dump(doc))
    res = pipeline.run(str(r))
    assert [s.state for s in res.stages] == ["done"] * 6
    out = tmp_path / "run"
    rep = json.loads((out / "reports" / "pd.json").read_text())
    assert rep["layout"] == "mla-expanded" and rep["rows"][0]["name"] == PAIR
    rec = json.loads((out / "prefill" / "prefill.json").read_text())
    assert rec["source"] == "zai-org/GLM-5.2-FP8" and rec["fidelity"]["rows"][0]["kld_mean"] == rep["rows"][0]["kld_mean"]
    assert not list((out / "prefill").glob("*.safetensors"))
    d = rec["launch"]["decode"]
    assert d[d.index("--model-path") + 1] == "my-org/GLM-5.2-W4A16" and d[d.index("--tp") + 1] == "2"
    assert "launch_server" in (out / "model" / "README.md").read_text()  # the decode artifact's own card

    bad = dict(doc)
    bad["pipeline"] = {**doc["pipeline"], "kv": {"fold": True}}
    r.write_text(yaml.safe_dump(bad))
    with pytest.raises(QuantizeError, match="kv.fold with the pd-eval/prefill stage"):
        pipeline.run(str(r), plan=True)


def test_kimi_pd_recipe_end_to_end_from_the_int4_release(tmp_path):
    """recipes/kimi-k2.6-pd.yaml on the tiny Kimi as Moonshot ships it: the decode artifact is the
    release's INT4 passed through bit for bit, the prefill artifact FP8 block weights made from it,
    pd-eval measures that pair, and the prefill card points at the FP8 weights."""
    from pathlib import Path

    import yaml

    from quantize import pipeline

    from .conftest import load_dir

    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "kimi-k2.6-pd.yaml").read_text())
    doc["pipeline"].update(source="tiny:kimi_k25", out=str(tmp_path / "run"),
                           stages=["convert", "convert-prefill", "calibrate-kv", "pd-eval", "card", "prefill", "push"])
    doc["pipeline"]["kv"].update(samples=4, seq_len=32)
    doc["pipeline"]["pd"].update(prompt_tokens=24, decode_tokens=8, device="cpu", decode_tp=2, source_repo=None)
    r = tmp_path / "pd.yaml"
    r.write_text(yaml.safe_dump(doc))
    res = pipeline.run(str(r))
    assert [s.state for s in res.stages] == ["done"] * 8
    out = tmp_path / "run"
    src, dec, pre = load_dir(out / "source"), load_dir(out / "model"), load_dir(out / "prefill-model")
    int4 = [k for k in src if k.endswith((".weight_packed", ".weight_scale", ".weight_shape"))]
    assert int4 and all(torch.equal(src[k], dec[k]) for k in int4)  # Moonshot's codes and scales, unchanged
    man = json.loads((out / "model" / "quantize_manifest.json").read_text())
    assert man["passed_through"]["modules"] == sum(k.endswith(".weight_packed") for k in src)
    fp8 = [k for k, v in pre.items() if v.dtype == torch.float8_e4m3fn]
    assert any(".mlp.experts." in k for k in fp8) and any(".self_attn.o_proj." in k for k in fp8)
    assert not any(k.endswith(".weight_packed") for k in pre)
    rep = json.loads((out / "reports" / "pd.json").read_text())
    assert Path(rep["prefill"]).resolve() == (out / "prefill-model").resolve()
    rec = json.loads((out / "prefill" / "prefill.json").read_text())
    p = rec["launch"]["prefill"]
    assert p[p.index("--model-path") + 1] == str((out / "prefill-model").resolve())
    card = (out / "prefill" / "README.md").read_text()
    assert "FP8 block weights" in card and "passed through bit for bit" in card
    # a rerun keeps every stage
    assert [s.state for s in pipeline.run(str(r)).stages] == ["done"] * 8
