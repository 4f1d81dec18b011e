"""quantize card: README.md from the folder's own records: Hub metadata (base_model from a cache
snapshot, licence carried from the source's card, model-index from eval reports), how it was made,
bits per weight and per-GPU figures from the headers, KV/check/eval sections only from records,
launch lines that fit; never over a card the user wrote."""

import json
import math
import shutil
import sys

import pytest
import yaml

from quantize.check import verify_files
from quantize.checkpoint.index import CheckpointIndex, read_tensor
from quantize.checkpoint.manifest import command_line
from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.publish.card import MARKER, bits_per_weight, card, tp_figures

from .conftest import TP8

REV = "0123456789abcdef0123456789abcdef01234567"
SOURCE_CARD = "---\nlicense: other\nlicense_name: glm-license\nlicense_link: LICENSE\nlibrary_name: transformers\n---\n# GLM-5-FP8\n\nThe vendor's card.\n"


def _meta(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("\n---\n", 1)[0][4:])


@pytest.fixture
def folder(converted, tmp_path):
    d = tmp_path / "glm-int4"
    shutil.copytree(converted("glm_moe_dsa", group_size=32), d)
    return d


def test_card_from_a_hub_snapshot_carries_base_model_and_licence(tiny, tmp_path):
    snap = tmp_path / "hub" / "models--zai-org--GLM-5-FP8" / "snapshots" / REV
    shutil.copytree(tiny("glm_moe_dsa"), snap, ignore=shutil.ignore_patterns(".quantize", "quantize_manifest.json"))
    (snap / "README.md").write_text(SOURCE_CARD)
    out = tmp_path / "GLM-5-W4A16"
    convert(snap, out)
    assert (out / "README.md").read_text() == SOURCE_CARD  # the conversion copied the source's card
    res = card(out)
    text = (out / "README.md").read_text()
    assert res.text == text and MARKER in text and res.readme_was == "source"
    meta = _meta(text)
    assert meta["base_model"] == "zai-org/GLM-5-FP8" and meta["base_model_relation"] == "quantized"
    assert (meta["license"], meta["license_name"], meta["license_link"]) == ("other", "glm-license", "LICENSE")
    assert meta["library_name"] == "transformers" and {"int4", "w4a16", "compressed-tensors", "glm_moe_dsa"} <= set(meta["tags"])
    assert "model-index" not in meta  # no eval report: nothing claimed
    assert f"at revision `{REV}`" in text and "source format | block FP8" in text
    assert "a library call (its manifest records no command line)" in text
    assert "group size 32" in text and "observer `minmax`" in text
    assert "Not measured for this folder" in text and "No evaluation report attached" in text
    # tiny GLM-5 has 4 heads: TP 8 is refused with the reason, the figures and launch lines use TP 4
    assert "TP 8 | does not fit:" in text and "4 attention heads" in text
    assert f"--model-path {out.name} --tp 4 --kv-cache-dtype fp8_e4m3" in text and str(out.resolve()) not in text
    assert "--tp 8" not in text
    # the source's card is kept in the record; the folder still proves every file
    assert (out / ".quantize" / "source_README.md").read_text() == SOURCE_CARD
    assert verify_files(out)[0] == []
    # regenerated: still ours, still carrying the licence (from the kept copy)
    again = card(out, repo_id="my-org/GLM-5-W4A16")
    assert again.readme_was == "ours" and _meta(again.text)["license"] == "other"
    assert "--model-path my-org/GLM-5-W4A16 --tp 4" in again.text and "# GLM-5-W4A16" in again.text


def _eval_report(candidate, baseline="/models/GLM-5-FP8", limit=200):
    from quantize.evaluate.run import EvalReport, TaskResult

    tasks = [TaskResult("gsm8k", "exact_match", 200, 61.5, 3.44, 60.0, 3.46, -1.5, -3.5, 0.5, True, False),
             TaskResult("arc_challenge", "acc_norm", 200, 52.0, 3.5, 51.25, 3.5, -0.75, -2.0, 0.5, True, True)]
    return EvalReport(baseline, str(candidate), limit, 1.0, tasks).to_dict()


def _kld_report(candidate):
    from quantize.evaluate.kld import KldReport

    return KldReport("/models/GLM-5-FP8", str(candidate), 8192, 512, 0.01234, 0.005, 0.1, 0.3, 1.2, 0.955, 5.1, 5.2, 1.0196, "kld_default.txt").to_dict()


def _check_report(model):
    from quantize.check import CheckReport, Row

    rows = [Row("model.layers.1.mlp.experts.0.gate_proj", "expert_gate", kernel_rel_err=0.004, source_rel_err=0.095, snr_db=20.4)]
    return CheckReport(str(model), 4, False, rows, [], {"files_sha256": 9, "tensors_exact_vs_source": 154}).to_dict()


def _as_written(kind: str, rep: dict) -> str:
    """A report's text as its writer writes it: signed (``written_by``) where the writer signs it,
    which the card requires (`check --json` prints it unsigned)."""
    from quantize.checkpoint.output import signed_json
    from quantize.publish.card import SIGNED_BY

    return signed_json(rep, SIGNED_BY[kind][0]) if kind in SIGNED_BY else json.dumps(rep)


def test_eval_kld_and_check_reports_become_tables_and_model_index(folder, tmp_path):
    from huggingface_hub import ModelCard

    files = {}
    for kind, rep in (("eval", _eval_report(folder)), ("kld", _kld_report(folder)), ("check", _check_report(folder))):
        files[kind] = tmp_path / f"{kind}.json"
        files[kind].write_text(_as_written(kind, rep))
    res = card(folder, eval=list(files.values()), repo_id="my-org/glm-int4")
    assert [r["kind"] for r in res.reports] == ["eval", "kld", "check"]
    mc = ModelCard((folder / "README.md").read_text())  # as the Hub parses it
    ev = {e.dataset_type: e for e in mc.data.eval_results}
    assert set(ev) == {"openai/gsm8k", "allenai/ai2_arc"}
    assert ev["openai/gsm8k"].metric_type == "exact_match" and ev["openai/gsm8k"].metric_value == 60.0
    assert ev["allenai/ai2_arc"].metric_type == "acc_norm" and ev["allenai/ai2_arc"].metric_value == 51.25
    assert ev["allenai/ai2_arc"].dataset_config == "ARC-Challenge" and "200 items (--limit 200)" in ev["allenai/ai2_arc"].metric_name
    assert mc.data.model_name == "glm-int4"
    text = res.text
    assert "| gsm8k | exact_match | 200 | 61.50 ± 3.44 | 60.00 ± 3.46 | -1.50 (-3.50, +0.50) |" in text
    assert "| 0.01234 |" in text and "95.50%" in text  # the KLD row
    assert "passed; 154 tensors exactly against the source" in text and "| expert_gate | 1 | 0 |" in text
    # a later card (as push writes it) keeps the reports
    again = card(folder, repo_id="my-org/glm-int4")
    assert len(ModelCard(again.text).data.eval_results) == 2 and "| 0.01234 |" in again.text


def test_smoke_evaluations_are_shown_not_published_and_where_each_figure_was_measured(folder, tmp_path):
    """A task under SMOKE_ITEMS documents stays in the table, marked, and out of the model-index (99
    is a smoke test, 100 a measurement); the report's "measured" says where each model ran."""
    from huggingface_hub import ModelCard

    from quantize.evaluate.kld import KldReport
    from quantize.evaluate.run import EvalReport, TaskResult
    from quantize.publish.card import SMOKE_ITEMS

    assert SMOKE_ITEMS == 100
    served = {"engine": "vllm", "version": "0.33.0", "startup_s": 41.5,
              "launch": "python -m vllm.entrypoints.openai.api_server --model /m --port 8000 --tensor-parallel-size 8"}
    tasks = [TaskResult("gsm8k", "exact_match", 99, 61.5, 3.44, 60.0, 3.46, -1.5, -3.5, 0.5, True, False),
             TaskResult("arc_challenge", "acc_norm", 100, 52.0, 3.5, 51.25, 3.5, -0.75, -2.0, 0.5, True, True)]
    ev = EvalReport("/models/GLM-5-FP8", str(folder), None, 1.0, tasks,
                    {"baseline": {"engine": "transformers", "device": "cpu"}, "candidate": served}).to_dict()
    kld = KldReport("/models/GLM-5-FP8", str(folder), 8192, 512, 0.01234, 0.005, 0.1, 0.3, 1.2, 0.955, 5.1, 5.2,
                    1.0196, "kld_default.txt", estimator="top-20 lower bound (served)", top_k=20,
                    measured={"baseline": served, "candidate": served}).to_dict()
    files = [tmp_path / "ev.json", tmp_path / "kld.json"]
    for f, rep, kind in zip(files, (ev, kld), ("eval", "kld")):
        f.write_text(_as_written(kind, rep))
    text = card(folder, eval=files, repo_id="my-org/glm-int4").text
    results = ModelCard(text).data.eval_results
    assert [r.dataset_type for r in results] == ["allenai/ai2_arc"]  # the 99-document task is not published
    gsm8k_row = "| gsm8k |" + text.split("| gsm8k |")[1].splitlines()[0]
    assert gsm8k_row.endswith("| pass (smoke: 99 items, below the 100 a gate needs) |")  # said once, by eval's verdict
    assert "smoke" not in text.split("| arc_challenge |")[1].splitlines()[0]
    assert "the baseline on transformers on the evaluating machine (cpu)" in text
    assert ("the candidate on vllm 0.33.0, launched by `quantize` as `python -m vllm.entrypoints.openai.api_server "
            "--model /m --port 8000 --tensor-parallel-size 8`") in text
    # the estimator's name through the card's Markdown escaping, which leaves parentheses alone
    assert ("\nEstimator: top-20 lower bound (served): the engine returns each position's top-20 log-probabilities, "
            "the rest of the vocabulary is one bucket, so this KL is a lower bound of the full-vocabulary KL.\n") in text
    assert "a lower bound of the full-vocabulary KL" in text
    bad = dict(ev, measured={"candidate": "vllm"})
    files[0].write_text(json.dumps(bad))
    with pytest.raises(QuantizeError, match=r"measured\.candidate is a string, not an object"):
        card(folder, eval=files[:1])


def test_the_card_says_when_prompts_went_through_the_chat_template():
    from quantize.publish.card import where

    served = {"engine": "vllm", "version": "0.33.0", "launch": "python -m vllm.entrypoints.openai.api_server"}
    assert where({**served, "prompts": "the model's chat template (chat-completions)"}).endswith(
        "; prompts: the model's chat template (chat-completions)")
    assert "prompts" not in where(served)  # without --chat: the task's own prompts, nothing said
    assert where({"engine": "transformers", "device": "cpu", "prompts": "the model's chat template"}) == (
        "transformers on the evaluating machine (cpu); prompts: the model's chat template")
    pair = {"engine": "sglang", "version": "0.5.23", "launch": "python -m sglang.launch_server --model-path /int4",
            "pd_prefill": "python -m sglang.launch_server --model-path /fp8",
            "pd_router": "python -m sglang_router.launch_router --pd-disaggregation"}
    assert where(pair) == ("sglang 0.5.23 as a prefill/decode pair launched by `quantize`: prefill `python -m "
                           "sglang.launch_server --model-path /fp8`, decode `python -m sglang.launch_server "
                           "--model-path /int4`, router `python -m sglang_router.launch_router --pd-disaggregation`")


def test_reports_that_are_not_reports_or_of_another_model_are_refused(folder, converted, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(QuantizeError, match="--eval .*bad.json"):
        card(folder, eval=[bad])
    bad.write_text("not json")
    with pytest.raises(QuantizeError, match="bad.json: not valid JSON"):
        card(folder, eval=[bad])
    with pytest.raises(QuantizeError, match="no such file"):
        card(folder, eval=[tmp_path / "missing.json"])
    other = converted("glm_moe_dsa", group_size=128)  # another quantize output, other weights
    rep = tmp_path / "other.json"
    rep.write_text(_as_written("eval", _eval_report(other)))
    with pytest.raises(QuantizeError, match="other weights"):
        card(folder, eval=[rep])
    # the converted folder this one was copied from has the same weights: accepted
    rep.write_text(_as_written("eval", _eval_report(converted("glm_moe_dsa", group_size=32))))
    assert card(folder, eval=[rep]).reports
    assert not (tmp_path / "bad.json.partial").exists()


def test_bits_per_weight_and_tp8_figures_from_the_headers(tiny, tmp_path):
    from quantize.plan import plan

    src = tiny("glm_moe_dsa", overrides=TP8)
    out = tmp_path / "g128"
    convert(src, out, group_size=128)
    idx = CheckpointIndex.open(out)
    bpw = bits_per_weight(idx)
    # independently: every INT4 module's stored bits over N x K
    mods = [n[: -len(".weight_packed")] for n in idx.tensors if n.endswith(".weight_packed")]
    bits = sum(idx.tensors[m + s].nbytes * 8 for m in mods for s in (".weight_packed", ".weight_scale", ".weight_shape"))
    weights = sum(math.prod(read_tensor(out, idx.tensors[m + ".weight_shape"]).tolist()) for m in mods)
    assert bpw["int4"] == pytest.approx(bits / weights) and bpw["int4_weights"] == weights
    assert 4 + 16 / 128 < bpw["int4"] < 4 + 16 / 128 + 0.01
    assert bpw["weights"] == bpw["int4_weights"] + bpw["high_precision_weights"]
    assert 16 <= bpw["high_precision"] < 16.01  # BF16 everywhere else (a few small F32 router biases)
    tpf = tp_figures(out, idx)
    assert tpf["tp"] == 8 and tpf["refused"] == []
    p = plan(src, tp=8, group_size=128).summary()
    # plan divides every split tensor by 8; the serving split keeps each INT4 module's 16-byte
    # weight_shape whole on every rank
    assert tpf["per_gpu_bytes"] - p["per_rank_output_bytes"] == len(mods) * 16 * 7 // 8
    assert tpf["kv"]["kv_bytes_per_token"] == p["kv_bytes_per_token"]
    assert abs(tpf["kv"]["kv_tokens_per_gpu"]["fp8"] - p["kv_tokens_per_gpu"]["fp8"]) <= 2
    text = card(out).text
    assert "--tp 8 --kv-cache-dtype fp8_e4m3" in text and "--tensor-parallel-size 8 --kv-cache-dtype fp8_e4m3" in text
    assert f"{bpw['int4']:.3f} (4-bit codes + BF16 scale per 128" in text
    assert f"FP8 e4m3: {tpf['kv']['kv_tokens_per_gpu']['fp8']:,} tokens" in text


def test_never_over_a_users_card_nor_a_tampered_folder(folder):
    (folder / "README.md").write_text("# mine\n")
    with pytest.raises(QuantizeError, match="a card you wrote or edited, which quantize never overwrites"):
        card(folder)
    assert (folder / "README.md").read_text() == "# mine\n"
    (folder / "README.md").unlink()
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(QuantizeError, match=f"{shard.name}.*SHA-256"):
        card(folder)
    assert not (folder / "README.md").exists()


def test_not_a_quantize_output(tiny, tmp_path):
    d = tmp_path / "plain"
    shutil.copytree(tiny("glm_moe_dsa"), d)
    with pytest.raises(QuantizeError, match="make-tiny"):  # the tiny fixture's own manifest
        card(d)
    (d / "quantize_manifest.json").unlink()
    with pytest.raises(QuantizeError, match="not a finished quantize output"):
        card(d)


def test_calibrate_kv_fold_output_card_follows_its_conversion(converted, tmp_path):
    from quantize.calibrate.kv import calibrate_kv

    q = converted("deepseek_v3", group_size=32)
    out = tmp_path / "fold"
    calibrate_kv(q, out, fold=True, samples=4, seq_len=48)
    text = card(out).text
    assert f"Measured by `quantize calibrate-kv` on `{q.name}` (before the fold below): mla cache, target sglang" in text
    assert str(q) not in text
    assert "Folded factors" in text and "| 0 | x" in text
    assert "group size 32" in text and "observer `minmax`" in text  # from the conversion's manifest
    assert "# convert: a library call" in text and "# calibrate-kv: a library call" in text
    assert verify_files(out)[0] == []


def test_command_line_records_only_the_cli(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/quantize", "convert", "/m/src dir", "/m/out", "--group-size", "32"])
    assert command_line() == "quantize convert 'src dir' out --group-size 32"  # a manifest is published: no path
    monkeypatch.setattr(sys, "argv", ["/repo/quantize/cli.py", "push", "d", "o/r"])
    assert command_line() == "quantize push d o/r"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/pytest", "-q"])
    assert command_line() is None
    monkeypatch.setattr(sys, "argv", [])
    assert command_line() is None


# -- base_model: --base-model, the manifest, the cache snapshot; base_model_relation per artifact ----


def test_a_local_source_names_the_flag_and_base_model_on_convert_reaches_the_card(converted, tiny, tmp_path):
    """`hf download REPO --local-dir DIR` leaves a folder that names no repo: the card says how to
    name it; --base-model on convert records it (the manifest's options) without changing a byte."""
    plain = tmp_path / "plain"
    shutil.copytree(converted("glm_moe_dsa"), plain)
    res = card(plain)
    meta = _meta(res.text)
    assert "base_model" not in meta and "base_model_relation" not in meta
    note = next(n for n in res.notes if n.startswith("base_model is not set"))
    assert "is a local folder that names no Hub repository" in note
    assert "pass --base-model REPO (or `base_model:` in the recipe's pipeline section)" in note
    assert "| base model | not set (pass --base-model REPO) |" in res.text

    out = tmp_path / "named"
    convert(tiny("glm_moe_dsa"), out, base_model="zai-org/GLM-5-FP8")
    m = json.loads((out / "quantize_manifest.json").read_text())
    assert m["options"]["base_model"] == "zai-org/GLM-5-FP8"
    theirs = json.loads((converted("glm_moe_dsa") / "quantize_manifest.json").read_text())
    weights = lambda mm: {k: v for k, v in mm["files"].items() if k.endswith(".safetensors")}
    assert weights(m) == weights(theirs)  # the same bytes with or without it
    assert m["plan"]["options"]["base_model"] == "zai-org/GLM-5-FP8"
    res = card(out)
    meta = _meta(res.text)
    assert meta["base_model"] == "zai-org/GLM-5-FP8" and meta["base_model_relation"] == "quantized"
    assert not any("base_model" in n for n in res.notes)
    assert "[zai-org/GLM-5-FP8](https://huggingface.co/zai-org/GLM-5-FP8) quantized by `quantize` to INT4" in res.text
    assert "recorded by `quantize convert --base-model`" in res.text


def test_a_resume_may_add_or_correct_base_model_but_not_change_the_bytes(tiny, tmp_path):
    from quantize.checkpoint.output import read_record

    src, out = tiny("glm_moe_dsa"), tmp_path / "out"
    convert(src, out)
    key = read_record(out)["key"]
    assert "base_model" not in key["options"]  # not part of what a resume must match
    res = convert(src, out, resume=True, base_model="zai-org/GLM-5-FP8")
    assert res.resumed_shards == 3  # every shard kept: nothing recomputed
    assert json.loads((out / "quantize_manifest.json").read_text())["options"]["base_model"] == "zai-org/GLM-5-FP8"
    assert verify_files(out)[0] == []
    # the near miss: an option that changes the bytes is still refused on resume
    with pytest.raises(QuantizeError, match="--resume with different options"):
        convert(src, out, resume=True, group_size=128)


def test_base_model_on_card_overrides_the_recorded_one_and_is_kept_for_the_next_card(tiny, tmp_path):
    out = tmp_path / "named"
    convert(tiny("glm_moe_dsa"), out, base_model="zai-org/GLM-5-FP8")
    res = card(out, base_model="my-org/GLM-5-FP8-mirror")
    assert _meta(res.text)["base_model"] == "my-org/GLM-5-FP8-mirror"
    assert any("replaces `zai-org/GLM-5-FP8`, which the manifest records" in n for n in res.notes)
    st = json.loads((out / ".quantize" / "card.json").read_text())
    assert st["base_model"] == "my-org/GLM-5-FP8-mirror"
    again = card(out)  # regenerated without it (as push does): the same base model
    assert _meta(again.text)["base_model"] == "my-org/GLM-5-FP8-mirror" and again.readme_was == "ours"
    assert again.text == res.text  # the same card, word for word (push regenerates it without churn)
    # the near miss: the same value as recorded is not a disagreement
    same = card(out, base_model="zai-org/GLM-5-FP8")
    assert not any("replaces" in n or "snapshot" in n for n in same.notes)


def test_an_explicit_base_model_against_the_cache_snapshot_is_noted_not_refused(tiny, tmp_path):
    snap = tmp_path / "hub" / "models--zai-org--GLM-5-FP8" / "snapshots" / REV
    shutil.copytree(tiny("glm_moe_dsa"), snap, ignore=shutil.ignore_patterns(".quantize", "quantize_manifest.json"))
    out = tmp_path / "out"
    convert(snap, out)
    res = card(out, base_model="zai-org/GLM-5")
    assert _meta(res.text)["base_model"] == "zai-org/GLM-5"
    note = next(n for n in res.notes if "cache snapshot" in n)
    assert "base_model is `zai-org/GLM-5`" in note and "the Hugging Face cache snapshot of `zai-org/GLM-5-FP8`" in note
    assert "> Note: " + note.replace(str(snap), f"zai-org/GLM-5-FP8@{REV[:12]}") in res.text and str(tmp_path) not in res.text
    # the near miss: the snapshot's own repo given explicitly says nothing
    res = card(out, base_model="zai-org/GLM-5-FP8")
    assert not any("snapshot" in n for n in res.notes) and _meta(res.text)["base_model"] == "zai-org/GLM-5-FP8"


@pytest.mark.parametrize("bad", ["GLM-5-FP8", "a/b/c", "org/bad--name", "org/.hidden", "org/a b", ""])
def test_a_bad_base_model_is_refused_in_one_line(folder, tiny, tmp_path, bad):
    before = (folder / "quantize_manifest.json").read_bytes()
    with pytest.raises(QuantizeError) as e:
        card(folder, base_model=bad)
    assert str(e.value).startswith("--base-model ") and "not a Hub repo id" in str(e.value) and "\n" not in str(e.value)
    assert (folder / "quantize_manifest.json").read_bytes() == before and not (folder / "README.md").exists()
    with pytest.raises(QuantizeError, match="--base-model .*not a Hub repo id"):
        convert(tiny("glm_moe_dsa"), tmp_path / "never", base_model=bad)
    assert not (tmp_path / "never").exists()


def test_the_edge_repo_ids_are_accepted(folder):
    for ok in ("a/b", "my-org/GLM-5.1_FP8-v2", "x" * 40 + "/" + "y" * 40):
        assert _meta(card(folder, base_model=ok).text)["base_model"] == ok


def _int4_modules(folder) -> int:
    roles = json.loads((folder / "quantize_manifest.json").read_text())["plan"]["roles"]
    return sum(k.get("int4", 0) for k in roles.values())


def test_passed_through_int4_is_no_relation_and_one_requantized_module_is_quantized(folder):
    """A conversion recording every INT4 module as passed through bit for bit (an already-INT4 source)
    changed no weight: base_model stays, base_model_relation goes, and the card says why."""
    from tests.hostile import edit_json

    n = _int4_modules(folder)
    assert n > 1

    def passed(m, redone=0):  # as convert records an INT4 source: pass_int4 jobs, counted in passed_through
        left = redone
        for k in m["plan"]["roles"].values():
            if "int4" in k:
                c = k.pop("int4")
                k["pass_int4"] = c - min(c, left)
                if min(c, left):
                    k["int4"] = min(c, left)
                left -= min(c, left)
        m.update(passed_through={"modules": n - redone, "requantized": redone})

    pristine = (folder / "quantize_manifest.json").read_text()
    edit_json(folder / "quantize_manifest.json", passed)
    res = card(folder, base_model="moonshotai/Kimi-K2.6")
    meta = _meta(res.text)
    assert meta["base_model"] == "moonshotai/Kimi-K2.6" and "base_model_relation" not in meta
    assert "quantized" not in meta["tags"]
    assert f"its {n} INT4 modules passed through bit for bit from the source, none re-quantized" in res.text
    assert any(n_.startswith("base_model_relation is not set") and "adapter, merge, quantized, finetune" in n_
               for n_ in res.notes)
    # the near miss: one module re-quantized makes it a quantized model again
    (folder / "quantize_manifest.json").write_text(pristine)
    edit_json(folder / "quantize_manifest.json", lambda m: passed(m, redone=1))
    res = card(folder, base_model="moonshotai/Kimi-K2.6")
    assert _meta(res.text)["base_model_relation"] == "quantized"
    assert f"{n - 1} INT4 modules passed through from the source bit for bit" in res.text
    assert "were not kept for 1 modules" in res.text
    # the FP8 block scheme re-quantizes whatever it reads
    def fp8(m):
        m.update(passed_through={"modules": n})
        m["options"].update(scheme="fp8-block")

    edit_json(folder / "quantize_manifest.json", fp8)
    assert _meta(card(folder, base_model="moonshotai/Kimi-K2.6").text)["base_model_relation"] == "quantized"
    # a manifest that records no plan roles claims no relation either way
    edit_json(folder / "quantize_manifest.json", lambda m: (m["plan"].pop("roles"), None)[1])
    res = card(folder, base_model="moonshotai/Kimi-K2.6")
    assert "base_model_relation" not in _meta(res.text) and any("records no plan roles" in n for n in res.notes)


def test_calibrate_kv_fold_of_the_release_keeps_base_model_without_a_relation(tiny, converted, tmp_path):
    from quantize.calibrate.kv import calibrate_kv

    src = tiny("deepseek_v3")
    out = tmp_path / "fold"
    calibrate_kv(src, out, fold=True, samples=4, seq_len=48, base_model="deepseek-ai/DeepSeek-V3")
    m = json.loads((out / "quantize_manifest.json").read_text())
    assert m["options"] == {"base_model": "deepseek-ai/DeepSeek-V3"} and m["changed_tensors"]
    res = card(out)
    meta = _meta(res.text)
    assert meta["base_model"] == "deepseek-ai/DeepSeek-V3" and "base_model_relation" not in meta
    assert not {"int4", "w4a16", "quantized"} & set(meta["tags"])  # the release's FP8 weights, not ours
    assert (f"The weights are [deepseek-ai/DeepSeek-V3](https://huggingface.co/deepseek-ai/DeepSeek-V3)'s, "
            f"unchanged except {len(m['changed_tensors'])} tensors multiplied by exact powers of two") in res.text
    assert "quantized by `quantize` to" not in res.text
    assert any(n.startswith("base_model_relation is not set") for n in res.notes)
    assert verify_files(out)[0] == []
    # the near miss: the fold of a conversion is still a quantized model (its weights are INT4)
    q = converted("deepseek_v3", group_size=32)
    out2 = tmp_path / "fold-int4"
    calibrate_kv(q, out2, fold=True, samples=4, seq_len=48)
    res = card(out2, base_model="deepseek-ai/DeepSeek-V3")
    meta = _meta(res.text)
    assert meta["base_model"] == "deepseek-ai/DeepSeek-V3" and meta["base_model_relation"] == "quantized"
    assert "Then `quantize calibrate-kv --fold` changed" in res.text and "int4" in meta["tags"]


INT8_WARNING = "Do not set `VLLM_MARLIN_INPUT_DTYPE=int8` for this checkpoint"


def test_the_fullrange_grid_warns_of_vllms_int8_activation_path_and_minmax_does_not(folder, converted, tmp_path):
    """Negative scales (the full-range grid) are served as written by the engines' W4A16 paths, but
    vLLM's opt-in int8-activation Marlin path divides the scales by their maximum: the card says so,
    citing the file, exactly when the INT4 tensors the conversion made are on a signed grid.
    Near misses: minmax and mse output, the same grid with every INT4 module passed through, an FP8
    scheme, and a method report on minmax say nothing of it."""
    from tests.hostile import edit_json

    fr = tmp_path / "fr"
    shutil.copytree(converted("glm_moe_dsa", group_size=32, observer="fullrange"), fr)
    idx = CheckpointIndex.open(fr)
    scales = [read_tensor(fr, ref) for n, ref in idx.tensors.items() if n.endswith(".weight_scale")]
    assert scales and any(bool((s < 0).any()) for s in scales)  # what the warning is about
    text = card(fr).text
    assert INT8_WARNING in text and "(`fullrange`)" in text
    assert "`vllm/model_executor/layers/quantization/utils/marlin_utils.py`, `marlin_act_int8_process_scales`" in text
    assert "serve them as written" in text and "`CompressedTensorsWNA16MoE`" in text
    assert "VLLM_MARLIN_INPUT_DTYPE" not in card(folder).text  # minmax: all scales positive
    pristine = (fr / "quantize_manifest.json").read_text()

    def edited(fn):
        (fr / "quantize_manifest.json").write_text(pristine)
        edit_json(fr / "quantize_manifest.json", fn)
        return card(fr).text

    assert INT8_WARNING in edited(lambda m: m["options"].update(observer="fullrange-mse"))
    assert "VLLM_MARLIN_INPUT_DTYPE" not in edited(lambda m: m["options"].update(observer="mse"))

    def passed(m):  # every INT4 module the source's own (an INT4 source): no grid of ours was applied
        for k in m["plan"]["roles"].values():
            if "int4" in k:
                k["pass_int4"] = k.pop("int4")
    assert "VLLM_MARLIN_INPUT_DTYPE" not in edited(passed)

    def fp8(m):
        for k in m["plan"]["roles"].values():
            if "int4" in k:
                k["fp8"] = k.pop("int4")
    assert "VLLM_MARLIN_INPUT_DTYPE" not in edited(fp8)
    # a data-aware method's report names the grid it ran on, and that decides
    assert "VLLM_MARLIN_INPUT_DTYPE" not in edited(lambda m: m.update(method={"method": "gptq", "grid": "minmax"}))

    def gptq_fullrange(m):
        m["options"].update(observer="minmax")
        m.update(method={"method": "gptq", "grid": "fullrange"})
    assert INT8_WARNING in edited(gptq_fullrange)


def test_card_repo_names_the_title_and_launch_lines(folder, tmp_path):
    """`quantize card DIR --repo ID`: the card's title and launch lines name the Hub repo, not the
    folder; a malformed id is one line."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "quantize.cli", "card", str(folder), "--repo", "my-org/GLM-5.2-W4A16"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    text = (folder / "README.md").read_text()
    assert "\n# GLM-5.2-W4A16\n" in text and "--model-path my-org/GLM-5.2-W4A16 " in text
    assert str(folder.resolve()) not in text.split("## Serving")[1]
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "card", str(folder), "--repo", "not a repo"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--repo 'not a repo': not a Hub repo id" in p.stderr


def test_no_path_of_this_machine_reaches_the_card(folder, tmp_path):
    """The card goes to the Hub: the source, the commands, the reports' models and the launch lines
    name folders by what a reader can use (this folder by its name, a cache snapshot by its repo),
    never by this machine's absolute paths; Hub ids, URLs and ratios are left alone."""
    from pathlib import Path

    from quantize.publish.card import delocalize

    card(folder)
    text = (folder / "README.md").read_text()
    assert str(tmp_path) not in text and str(folder.resolve()) not in text
    assert "--model-path glm-int4 " in text and "`glm-int4` is this folder; `quantize card --repo ID`" in text
    here = Path("/work/runs/glm/model")
    snap = "/home/u/.cache/huggingface/hub/models--zai-org--GLM-5-FP8/snapshots/" + REV
    got = delocalize(
        f"source `{snap}`, see /work/runs/glm/model/config.json; run --out /work/runs/glm. "
        "https://huggingface.co/zai-org/GLM-5-FP8 zai-org/GLM-5-FP8 lr 1/iters, absmax / 7.5; /work/runs/glm/model",
        here, "GLM-5-W4A16",
    )
    assert got == (
        "source `zai-org/GLM-5-FP8@0123456789ab`, see config.json; run --out glm. "
        "https://huggingface.co/zai-org/GLM-5-FP8 zai-org/GLM-5-FP8 lr 1/iters, absmax / 7.5; GLM-5-W4A16"
    )


def test_a_calibrate_kv_report_fills_the_kv_section_and_a_bad_one_is_named(folder, tmp_path):
    """`quantize card DIR --eval kv.json` with a `calibrate-kv --stats-out` report: the card's FP8 KV
    section shows its verdict and per-layer table (without one it says "Not measured"); a report
    whose layer holds a wrong type, or too many layers, is one line naming the key."""
    from quantize.calibrate.kv import calibrate_kv
    from quantize.publish.card import MAX_LAYERS

    card(folder)
    assert "Not measured for this folder" in (folder / "README.md").read_text()
    kv = tmp_path / "kv.json"
    calibrate_kv(folder, None, samples=2, seq_len=16, stats_out=kv)
    res = card(folder, eval=[kv])
    assert [r["kind"] for r in res.reports] == ["kv"]
    sec = (folder / "README.md").read_text().split("## FP8 KV cache")[1].split("## Checks")[0]
    assert "Measured by `quantize calibrate-kv` on `glm-int4`: dsa cache, target sglang, 2 samples" in sec
    assert "GLM-5 DSA: engines write the FP8 cache" in sec and "Not measured" not in sec
    doc = json.loads(kv.read_text())
    assert sum(line.startswith(f"| {x['layer']} | ") for x in doc["layers"] for line in sec.splitlines()) == len(doc["layers"])
    bad = tmp_path / "bad-kv.json"
    d = json.loads(kv.read_text())
    d["layers"][1]["amax"] = "big"
    bad.write_text(json.dumps(d))
    with pytest.raises(QuantizeError, match=r"--eval .*bad-kv.json: layers\[1\]\.amax is a string, not a finite number"):
        card(folder, eval=[bad])
    d["layers"] = [doc["layers"][0]] * (MAX_LAYERS + 1)
    bad.write_text(json.dumps(d))
    with pytest.raises(QuantizeError, match=f"{MAX_LAYERS + 1} layers, more than the {MAX_LAYERS}"):
        card(folder, eval=[bad])
    d["layers"] = [doc["layers"][0]] * MAX_LAYERS  # the bound itself is accepted (as calibrate-kv would write it)
    bad.write_text(_as_written("kv", d))
    assert card(folder, eval=[bad]).reports[0]["kind"] == "kv"


def test_license_from_the_flag_where_the_source_states_none_and_kept_for_the_next_card(folder, tiny, tmp_path):
    """`--license ID` (card, push, pipeline.license) sets the card's licence where the source's card
    states none; it is kept for a card regenerated without it (push); a licence other than the
    source's is used and said in a note; a malformed id is one line."""
    from typer.testing import CliRunner

    from quantize.cli import app

    res = card(folder)
    assert "license" not in _meta(res.text) and any("pass --license ID" in n for n in res.notes)
    res = card(folder, license="mit")
    assert _meta(res.text)["license"] == "mit" and not any("licence" in n for n in res.notes)
    assert _meta(card(folder).text)["license"] == "mit"  # kept in .quantize/card.json
    cli = CliRunner().invoke(app, ["card", str(folder), "--license", "MIT License"])
    assert cli.exit_code == 2 and "must be a Hub licence id" in cli.output and cli.output.count("\n") == 1
    # a source whose card states one: a different --license replaces it (name and link dropped), with a note
    snap = tmp_path / "hub" / "models--zai-org--GLM-5-FP8" / "snapshots" / REV
    shutil.copytree(tiny("glm_moe_dsa"), snap, ignore=shutil.ignore_patterns(".quantize", "quantize_manifest.json"))
    (snap / "README.md").write_text(SOURCE_CARD)
    out = tmp_path / "lic"
    convert(snap, out)
    assert _meta(card(out).text)["license_name"] == "glm-license"
    res = card(out, license="apache-2.0")
    meta = _meta(res.text)
    assert meta["license"] == "apache-2.0" and "license_name" not in meta and "license_link" not in meta
    assert any("license `apache-2.0` is given with --license; the source's card states `other`" in n for n in res.notes)
    res = card(out, license="other")  # the source's own: its name and link stay
    assert _meta(res.text)["license_name"] == "glm-license" and not any("--license" in n for n in res.notes)


def test_only_a_checkpoint_larger_than_its_source_says_why(folder, tiny, tmp_path):
    text = card(folder).text  # the tiny GLM-5: FP8 source, experts INT4, the rest BF16 -> larger
    assert "| why larger than the source |" in text and "(FP8: 8)" in text
    out = tmp_path / "bf16-src"
    convert(tiny("deepseek_v3", layout="bf16"), out)  # a BF16 source: the INT4 checkpoint is smaller
    text = card(out).text
    assert "why larger" not in text and "| bytes | source " in text


def test_card_push_and_make_tiny_end_with_their_verdict_line(folder, tmp_path):
    """Notes and warnings first; the last line says what was written (or would be sent) where."""
    from typer.testing import CliRunner

    from quantize.cli import app

    last = lambda r: r.output.rstrip("\n").splitlines()[-1]  # noqa: E731
    r = CliRunner().invoke(app, ["card", str(folder)])
    assert r.exit_code == 0 and "note: " in r.output and last(r) == f"wrote {folder / 'README.md'}"
    r = CliRunner().invoke(app, ["push", str(folder), "my-org/GLM-5-W4A16", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert last(r).endswith("would go to my-org/GLM-5-W4A16@main; nothing was sent") and "README.md:" in r.output
    r = CliRunner().invoke(app, ["make-tiny", "llama", str(tmp_path / "t"), "--layout", "bf16"])
    assert r.exit_code == 0 and last(r) == f"wrote a tiny llama checkpoint (bf16 layout) to {tmp_path / 't'}"


# SGLang 0.5.23's shared-expert fusion gate (docs/engines.md): only 1 shared + 256 routed experts are eligible
GLM5_EXPERTS = {"n_shared_experts": 1, "n_routed_experts": 256, "first_k_dense_replace": 1}


@pytest.mark.parametrize("kw, want", [
    ({}, "auto-off"),  # W4A16 pack-quantized with a "Linear" INT4 group: step 6 turns fusion off
    ({"profile": "all-linear"}, "auto-off"),
    ({"keep_fp8": True}, "flag"),  # mixed-precision: step 6 does not fire, an FP8 shared expert in an INT4 layer
    ({"scheme": "fp8-block", "profile": "experts"}, "flag"),  # a BF16 shared expert fused into an FP8 layer
    ({"scheme": "fp8-block", "profile": "all-linear"}, None),  # same scheme: fusion as for the vendor's release
])
def test_sglang_fusion_advice_follows_the_engine_gate(converted, kw, want):
    from quantize.publish.card import sglang_shared_fusion

    qc = json.loads((converted("glm_moe_dsa", **kw) / "config.json").read_text())["quantization_config"]
    assert sglang_shared_fusion(GLM5_EXPERTS, qc) == want
    # near misses of the eligibility step (4): Kimi's 384 routed experts, two shared experts: never fused
    assert sglang_shared_fusion({**GLM5_EXPERTS, "n_routed_experts": 384}, qc) is None
    assert sglang_shared_fusion({**GLM5_EXPERTS, "n_shared_experts": 2}, qc) is None
    if want == "auto-off":  # step 6 needs the top-level pack-quantized format and no input activations
        assert sglang_shared_fusion(GLM5_EXPERTS, {**qc, "format": "mixed-precision"}) in ("flag", None)
        g = {k: {**v, "input_activations": {"num_bits": 8, "type": "float"}} for k, v in qc["config_groups"].items()}
        assert sglang_shared_fusion(GLM5_EXPERTS, {**qc, "config_groups": g}) != "auto-off"


def test_card_launch_line_disables_fusion_where_sglang_would_fuse_a_foreign_shared_expert(tiny, tmp_path):
    src = tiny("glm_moe_dsa", overrides={"n_routed_experts": 256, "num_hidden_layers": 2,
                                         "moe_intermediate_size": 128})
    kept, plain = tmp_path / "kept", tmp_path / "plain"
    convert(src, kept, keep_fp8=True)
    convert(src, plain)
    kept_text, plain_text = card(kept).text, card(plain).text
    assert "--kv-cache-dtype fp8_e4m3 --disable-shared-experts-fusion\n" in kept_text
    assert "`--disable-shared-experts-fusion` is needed: the shared expert is not in the routed experts' scheme" in kept_text
    assert "--disable-shared-experts-fusion" not in plain_text
    assert "SGLang turns shared-expert fusion off by itself for this INT4 MoE" in plain_text


def test_starved_experts_are_named_per_layer_from_the_method_report():
    """Only routed experts whose fallback reason is --min-expert-tokens, grouped by layer (the near
    misses: another reason, a non-expert module); more than STARVED_SHOWN are counted, not listed."""
    from quantize.publish.card import STARVED_SHOWN, starved_experts, starved_lines

    why = "3 calibration tokens < --min-expert-tokens 16"
    rep = {"rtn": [
        {"name": "model.layers.5.mlp.experts.7.down_proj", "reason": why},
        {"name": "model.layers.5.mlp.experts.7.gate_proj", "reason": why},
        {"name": "model.layers.5.mlp.experts.2.up_proj", "reason": why},
        {"name": "model.layers.3.mlp.experts.9.up_proj", "reason": why},
        {"name": "model.layers.3.mlp.experts.4.up_proj", "reason": "Cholesky failed at every dampening"},
        {"name": "model.layers.3.mlp.shared_experts.up_proj", "reason": why},
    ]}
    assert starved_experts(rep) == [(3, [9]), (5, [2, 7])]
    assert starved_experts(None) == [] and starved_experts({"rtn": []}) == []
    many = {"rtn": [{"name": f"model.layers.1.mlp.experts.{e}.gate_proj", "reason": why}
                    for e in range(STARVED_SHOWN + 3)]}
    assert starved_experts(many) == [(1, list(range(STARVED_SHOWN + 3)))]
    assert starved_lines(rep) == ["layer 3: 9 (1 expert)", "layer 5: 2, 7 (2 experts)"]
    shown = ", ".join(str(e) for e in range(STARVED_SHOWN))
    assert starved_lines(many) == [f"layer 1: {shown} and 3 more ({STARVED_SHOWN + 3} experts)"]
