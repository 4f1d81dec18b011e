"""quantize run: one recipe drives every stage; resumable stage by stage; a changed option reruns
only the stages it affects; a failed gate stops before push; bad recipes are one line."""

import json

from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from quantize import pipeline
from quantize.cli import app
from quantize.errors import CheckFailed, QuantizeError
from quantize.evaluate.run import EvalReport, TaskResult

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'quantize[eval]')")


def _arc(d):
    (d / "arc").mkdir(parents=True, exist_ok=True)
    rows = [{"query": f"Question: What is {i} plus one?", "choices": [str(i), str(i + 1), str(i + 2), "seven"], "gold": 1} for i in range(6)]
    (d / "arc" / "arc_easy.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return d


def _recipe(tmp_path, name="r.yaml", **pipe) -> str:
    doc = yaml.safe_load(pipeline.default_recipe().read_text())
    doc["pipeline"].update(out=str(tmp_path / "run"), **pipe)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(p)


def _report(model, passed=True, delta=0.0):
    t = TaskResult("arc_easy", "acc", 6, 50.0, 20.0, 50.0 + delta, 20.0, delta, delta - 5, delta + 5 if passed else -30.0, passed)
    return EvalReport("src", str(model), 6, 1.0, [t])


def _states(out):
    rec = json.loads((out / ".quantize" / "job.json").read_text())
    return {k: v["state"] for k, v in rec["stages"].items()}


class Calls:
    """Wrap a library function and count the calls the pipeline makes to it."""

    def __init__(self, monkeypatch, module, name, replacement=None):
        self.n = 0
        real = getattr(module, name)

        def wrapped(*a, **kw):
            self.n += 1
            return (replacement or real)(*a, **kw)

        monkeypatch.setattr(module, name, wrapped)


def test_default_recipe_end_to_end_then_kept_then_only_affected_stages_rerun(tmp_path, monkeypatch):
    import quantize.convert as conv
    import quantize.evaluate.run as ev
    import quantize.shard as sh

    data = _arc(tmp_path / "data")
    r = _recipe(tmp_path, data_dir=str(data), limit=2)
    out = tmp_path / "run"
    plan = pipeline.run(r, plan=True)
    assert [s.stage for s in plan.stages] == ["make-source", "convert", "calibrate-kv", "shard", "check", "eval", "card", "push"]
    assert {s.state for s in plan.stages} == {"pending"} and not out.exists()  # --plan writes nothing

    events = []
    res = pipeline.run(r, emit=events.append)
    assert [s.state for s in res.stages] == ["done"] * 8
    assert (out / "model" / "quantize_manifest.json").is_file() and (out / "shard" / "shard_manifest.json").is_file()
    assert json.loads((out / "reports" / "check.json").read_text())["ok"] is True
    assert json.loads((out / "reports" / "eval.json").read_text())["tasks"]["arc_easy"]["n"] == 2
    card = (out / "model" / "README.md").read_text()
    assert "quantize-demo/tiny-glm-5.2-W4A16" in card and "arc_easy" in card.lower().replace("-", "_")
    # the card goes to the Hub: no path of this machine in it; the run's KV report is used; the size is explained
    assert str(tmp_path) not in card and "/tmp" not in card and "source | `source` |" in card
    kv = card.split("## FP8 KV cache")[1].split("## Checks")[0]
    assert "Measured by `quantize calibrate-kv` on `tiny-glm-5.2-W4A16`" in kv and "target sglang" in kv
    assert "GLM-5 DSA: engines write the FP8 cache" in kv and "| 2 |" in kv and "Not measured" not in kv
    assert "| why larger than the source |" in card and "`--keep-fp8` keeps them FP8" in card
    assert "here 63% of the weights" in card and "the checkpoint shrinks" in card
    push = json.loads((out / "reports" / "push.json").read_text())
    assert push["dry_run"] is True and push["sent_bytes"] == 0 and any(f["path"].endswith(".safetensors") for f in push["files"])
    started = [e["stage"] for e in events if e.get("event") == "stage" and e.get("state") == "start"]
    assert started == [s.stage for s in res.stages]
    assert any(e.get("in_stage") == "convert" and e.get("event") == "tensor" for e in events)  # per-stage progress
    rec = json.loads((out / ".quantize" / "job.json").read_text())
    assert rec["kind"] == "run" and rec["stages"]["convert"]["options"]["recipe"]["group_size"] == 32

    # a second run keeps everything: no library function is called
    conv_calls, ev_calls, sh_calls = Calls(monkeypatch, conv, "convert"), Calls(monkeypatch, ev, "evaluate"), Calls(monkeypatch, sh, "shard")
    again = pipeline.run(r)
    assert [s.state for s in again.stages] == ["done"] * 8 and conv_calls.n == ev_calls.n == sh_calls.n == 0

    # a changed eval option: eval, card and push are stale, nothing upstream
    r2 = _recipe(tmp_path, "r2.yaml", data_dir=str(data), limit=3)
    plan = {s.stage: s for s in pipeline.run(r2, plan=True).stages}
    assert {k for k, s in plan.items() if s.state != "done"} == {"eval", "card", "push"}
    assert "limit" in plan["eval"].why and "eval_report" in plan["card"].why
    pipeline.run(r2)
    assert conv_calls.n == 0 and sh_calls.n == 0 and ev_calls.n == 1
    assert json.loads((out / "reports" / "eval.json").read_text())["tasks"]["arc_easy"]["n"] == 3

    # a changed shard TP: shard and check rerun (check proves TP rules); eval, card and push do not
    r3 = _recipe(tmp_path, "r3.yaml", data_dir=str(data), limit=3, shard={"tp": 4})
    plan = {s.stage: s.state for s in pipeline.run(r3, plan=True).stages}
    assert {k for k, s in plan.items() if s != "done"} == {"shard", "check", "card", "push"}  # the card holds the check report

    # an output changed behind the run's back is redone, with what consumes it
    (out / "reports" / "eval.json").write_text("{}")
    plan = {s.stage: s for s in pipeline.run(r2, plan=True).stages}
    assert plan["eval"].state == "stale" and "missing or changed" in plan["eval"].why and plan["convert"].state == "done"


def test_crash_during_eval_keeps_conversion_and_a_failed_gate_stops_before_push(tmp_path, monkeypatch):
    import quantize.convert as conv
    import quantize.evaluate.run as ev

    data = _arc(tmp_path / "data")
    r = _recipe(tmp_path, data_dir=str(data), limit=2, stages=["convert", "eval", "card", "push"])
    out = tmp_path / "run"

    def crash(*a, **kw):
        raise RuntimeError("killed during eval")

    monkeypatch.setattr(ev, "evaluate", crash)
    with pytest.raises(RuntimeError, match="killed during eval"):
        pipeline.run(r)
    assert _states(out) == {"make-source": "done", "convert": "done", "eval": "running"}
    assert {s.stage: s.state for s in pipeline.run(r, plan=True).stages}["eval"] == "pending"

    conv_calls = Calls(monkeypatch, conv, "convert")
    monkeypatch.setattr(ev, "evaluate", lambda base, cand, **kw: _report(cand, passed=False, delta=-40.0))
    with pytest.raises(CheckFailed, match="gate failed"):
        pipeline.run(r)
    assert conv_calls.n == 0  # the crash in eval did not redo the conversion
    st = _states(out)
    assert st["eval"] == "failed" and "push" not in st and not (out / "reports" / "push.json").exists()
    # the CLI: exit 1, one line, still nothing pushed; the failure is recorded, not recomputed
    monkeypatch.setattr(ev, "evaluate", crash)
    cli = CliRunner().invoke(app, ["run", r])
    assert cli.exit_code == 1 and "gate failed" in cli.output and "Traceback" not in cli.output
    assert "push" not in _states(out)

    # a passing candidate after an option change: eval reruns, then card and push
    r2 = _recipe(tmp_path, "r2.yaml", data_dir=str(data), limit=2, max_drop=50.0, stages=["convert", "eval", "card", "push"])
    from quantize.checkpoint.output import signed_json

    def passing(base, cand, out=None, **kw):  # writes its report as eval does: signed, which card requires
        rep = _report(cand)
        out.write_text(signed_json(rep.to_dict(), ev.REPORT_KIND))
        return rep

    monkeypatch.setattr(ev, "evaluate", passing)
    res = pipeline.run(r2)
    assert [s.state for s in res.stages] == ["done"] * 5 and conv_calls.n == 0
    assert (out / "reports" / "push.json").is_file()


def test_convert_option_change_reruns_everything_downstream(tmp_path, monkeypatch):
    import quantize.convert as conv

    r = _recipe(tmp_path, stages=["convert", "card", "push"])
    pipeline.run(r)
    doc = yaml.safe_load(open(r))
    doc["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    r2 = tmp_path / "g128.yaml"
    r2.write_text(yaml.safe_dump(doc))
    plan = {s.stage: s for s in pipeline.run(str(r2), plan=True).stages}
    assert plan["make-source"].state == "done" and plan["convert"].state == "stale" and "recipe.group_size" in plan["convert"].why
    assert plan["card"].state == plan["push"].state == "stale"
    calls = Calls(monkeypatch, conv, "convert")
    pipeline.run(str(r2))
    assert calls.n == 1
    m = json.loads((tmp_path / "run" / "model" / "quantize_manifest.json").read_text())
    assert m["options"]["group_size"] == 128


def test_cli_plan_json_and_ndjson_events(tmp_path):
    r = _recipe(tmp_path, stages=["convert"])
    runner = CliRunner()
    res = runner.invoke(app, ["run", r, "--json"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.strip().splitlines()]  # every line is one JSON event
    assert {"event": "stage", "stage": "convert", "state": "start"}.items() <= next(e for e in lines if e.get("stage") == "convert").items()
    assert lines[-1]["event"] == "result" and [s["state"] for s in lines[-1]["stages"]] == ["done", "done"]
    plan = runner.invoke(app, ["run", r, "--plan", "--json"])
    assert plan.exit_code == 0 and [s["state"] for s in json.loads(plan.stdout)["stages"]] == ["done", "done"]
    text = runner.invoke(app, ["run", r, "--plan"])
    assert text.exit_code == 0 and "convert" in text.stdout and "done" in text.stdout


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["pipeline"].update(max_dorp=1), "pipeline.max_dorp: unknown key; did you mean 'max_drop'"),
    (lambda d: d["pipeline"]["kv"].update(fodl=True), "pipeline.kv.fodl: unknown key; did you mean 'fold'"),
    (lambda d: d["pipeline"].update(stages=["convert", "evl"]), "pipeline.stages: evl: unknown stage; did you mean 'eval'"),
    (lambda d: d["pipeline"].update(stages=["eval", "convert"]), "out of order"),
    (lambda d: d["pipeline"].update(stages=[]), "pipeline.stages is empty"),
    (lambda d: d["pipeline"].update(limit="ten"), "pipeline.limit is 'ten', not int or null"),
    (lambda d: d["pipeline"].update(source="tiny:glm_moe_dza"), "did you mean 'glm_moe_dsa'"),
    (lambda d: d.pop("pipeline"), "no `pipeline:` section"),
    (lambda d: d["pipeline"].update(repo=None), "pipeline.repo is missing"),
    (lambda d: d["pipeline"]["pd"].update(transfer_backend="mooncak"), "did you mean 'mooncake'"),
    (lambda d: d["pipeline"].update(base_model="GLM-5-FP8"), "pipeline.base_model GLM-5-FP8: not a Hub repo id"),
    (lambda d: d["pipeline"].update(base_mdoel="a/b"), "pipeline.base_mdoel: unknown key; did you mean 'base_model'"),
    (lambda d: d["pipeline"]["push"].update(base_model="a/b"), "pipeline.push.base_model: not a key of the push section"),
    (lambda d: d["pipeline"]["eval"].update(serve="vlm"), "pipeline.eval.serve: vlm: unknown value; did you mean 'vllm'"),
    (lambda d: d["pipeline"]["eval"].update(serv="vllm"), "pipeline.eval.serv: unknown key; did you mean 'serve'"),
])
def test_bad_recipe_is_one_line(tmp_path, edit, message):
    doc = yaml.safe_load(pipeline.default_recipe().read_text())
    doc["pipeline"]["out"] = str(tmp_path / "run")
    doc["pipeline"].setdefault("pd", {})
    edit(doc)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(QuantizeError) as e:
        pipeline.run(str(p), plan=True)
    assert message in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)
    res = CliRunner().invoke(app, ["run", str(p)])
    assert res.exit_code == 2 and message in res.output and not (tmp_path / "run").exists()


def test_stage_without_its_input_is_one_line(tmp_path):
    r = _recipe(tmp_path, stages=["eval"])
    with pytest.raises(QuantizeError, match="stage eval needs the model that convert makes.*add convert to pipeline.stages"):
        pipeline.run(r)
    r = _recipe(tmp_path, "src.yaml", source=str(tmp_path / "nowhere"))
    with pytest.raises(QuantizeError, match="pipeline.source .*nowhere: not a checkpoint folder"):
        pipeline.run(r, plan=True)


def test_run_folder_is_guarded(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "mine.txt").write_text("a user's file")
    with pytest.raises(QuantizeError, match="no quantize job record"):
        pipeline.run(_recipe(tmp_path, stages=["convert"]))
    assert (tmp_path / "run" / "mine.txt").read_text() == "a user's file"


def test_eval_without_data_is_skipped_with_the_reason_or_refused(tmp_path):
    r = _recipe(tmp_path, data_dir=str(tmp_path / "absent"), stages=["convert", "eval", "card"])
    res = pipeline.run(r)
    ev = next(s for s in res.stages if s.stage == "eval")
    assert ev.state == "skipped" and "absent is not here" in ev.summary and "no gate" in ev.summary
    assert "arc_easy" not in (tmp_path / "run" / "model" / "README.md").read_text()
    r2 = _recipe(tmp_path, "r2.yaml", data_dir=str(tmp_path / "absent"), stages=["convert", "eval", "card"], eval={"if_no_data": "fail"})
    with pytest.raises(QuantizeError, match="pipeline.data_dir .*absent: no such folder"):
        pipeline.run(r2)


def _kill_convert_after_first_shard(r, monkeypatch, seen: list):
    """Run recipe ``r`` with its convert stage interrupted after its first shard (``seen``: each
    convert call's ``resume``); -> the real convert."""
    import quantize.convert as conv

    real = conv.convert

    def killed_after_first_shard(*a, **kw):
        seen.append(kw["resume"])
        inner = kw["emit"]

        def emit(e):
            inner(e)
            if e.get("event") == "shard":
                raise KeyboardInterrupt

        return real(*a, **{**kw, "emit": emit})

    monkeypatch.setattr(conv, "convert", killed_after_first_shard)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(r)
    return real


def test_killed_convert_is_continued_with_resume(tmp_path, monkeypatch):
    import quantize.convert as conv

    r = _recipe(tmp_path, stages=["convert"])
    seen = []
    real = _kill_convert_after_first_shard(r, monkeypatch, seen)
    assert _states(tmp_path / "run")["convert"] == "running"
    monkeypatch.setattr(conv, "convert", lambda *a, **kw: (seen.append(kw["resume"]), real(*a, **kw))[1])
    res = pipeline.run(r)
    assert seen == [False, True] and [s.state for s in res.stages] == ["done", "done"]
    rec = json.loads((tmp_path / "run" / ".quantize" / "job.json").read_text())
    assert rec["stages"]["convert"]["result"]["resumed_shards"] >= 1
    cli = CliRunner().invoke(app, ["check", str(tmp_path / "run" / "model")])
    assert cli.exit_code == 0, cli.output


def test_killed_convert_under_another_build_starts_over(tmp_path, monkeypatch):
    """An interrupted convert stage continues (convert --resume) only under the build that started
    it: under another, the plan says why and convert starts over (convert itself would refuse)."""
    import quantize.convert as conv
    from quantize.checkpoint import manifest

    r = _recipe(tmp_path, stages=["convert"])
    seen = []
    real = _kill_convert_after_first_shard(r, monkeypatch, seen)
    monkeypatch.setattr(manifest, "_CODE_ID", ["0" * 16])  # the tool was upgraded meanwhile
    plan = {s.stage: s for s in pipeline.run(r, plan=True).stages}["convert"]
    assert (plan.state, plan.why) == ("pending", "interrupted under another build of quantize or its libraries: "
                                                 "starts over")
    monkeypatch.setattr(conv, "convert", lambda *a, **kw: (seen.append(kw["resume"]), real(*a, **kw))[1])
    res = pipeline.run(r)
    assert seen == [False, False] and [s.state for s in res.stages] == ["done", "done"]
    rec = json.loads((tmp_path / "run" / ".quantize" / "job.json").read_text())
    assert rec["stages"]["convert"]["result"]["resumed_shards"] == 0
    assert rec["stages"]["convert"]["build"]["quantize"] == "0" * 16


def test_cli_interrupt_says_how_to_continue(tmp_path, monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run", interrupted)
    res = CliRunner().invoke(app, ["run", _recipe(tmp_path, stages=["convert"])])
    assert res.exit_code == 130 and "rerun the same `quantize run` to continue" in res.output and "--resume" in res.output


def test_data_aware_method_from_the_recipe_runs_checks_and_cards(tmp_path, monkeypatch):
    """A recipe's GPTQModifier with convert: {samples, seq_len} calibrates on the pipeline's data;
    check proves the GPTQ tensors by their grid and recorded error; the card says GPTQ; a changed
    method option reruns convert; convert: {method: gptq} against a QuantizationModifier is refused."""
    import quantize.convert as conv

    r = _recipe(tmp_path, stages=["convert", "check", "card"], shard={"tp": 2}, convert={"method": "gptq", "samples": 4, "seq_len": 64})
    with pytest.raises(QuantizeError, match="conflicts with .* whose modifier means method rtn"):
        pipeline.run(r)
    doc = yaml.safe_load(open(r))
    mods = doc["quant_stage"]["quant_modifiers"]
    mods["GPTQModifier"] = mods.pop("QuantizationModifier")
    doc["pipeline"]["convert"] = {"samples": 4, "seq_len": 64, "workers": 2}
    doc["pipeline"]["out"] = str(tmp_path / "run")
    r = tmp_path / "gptq.yaml"
    r.write_text(yaml.safe_dump(doc, sort_keys=False))
    res = pipeline.run(str(r))
    by = {s.stage: s for s in res.stages}
    assert by["check"].state == "done" and "GPTQ/AutoRound tensors by their grid and recorded error" in by["check"].summary
    m = json.loads((tmp_path / "run" / "model" / "quantize_manifest.json").read_text())
    assert m["method"]["method"] == "gptq" and m["method"]["samples"] == 4 and m["method"]["data"] == "default corpus"
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    assert "`gptq`: GPTQ" in card and "data-free" not in card
    doc = yaml.safe_load(open(r))
    doc["pipeline"]["convert"]["samples"] = 8
    r2 = tmp_path / "s8.yaml"
    r2.write_text(yaml.safe_dump(doc))
    plan = {s.stage: s for s in pipeline.run(str(r2), plan=True).stages}
    assert plan["convert"].state == "stale" and "samples" in plan["convert"].why, plan["convert"].why
    assert "gptq calibrated on the shipped corpus" in plan["convert"].does, plan["convert"].does
    calls = Calls(monkeypatch, conv, "convert")
    pipeline.run(str(r2))
    assert calls.n == 1
    assert json.loads((tmp_path / "run" / "model" / "quantize_manifest.json").read_text())["method"]["samples"] == 8


def test_a_stage_is_kept_only_while_every_file_it_wrote_is_unchanged(tmp_path):
    """Issue 16 R2: run decides "done" from the files' SHA-256s, not from each output's own
    manifest: a flipped byte in a shard, an edited config.json, a removed rank file or a removed
    folder each rerun the stage that wrote it and its consumers, and nothing else."""
    import shutil

    r = _recipe(tmp_path, stages=["convert", "shard", "check"])
    out = tmp_path / "run"

    def finished():
        rec = json.loads((out / ".quantize" / "job.json").read_text())
        return {k: v.get("finished") for k, v in rec["stages"].items()}

    pipeline.run(r)
    t0 = finished()
    pipeline.run(r)  # nothing changed: every stage kept (the near miss of each case below)
    assert finished() == t0

    def rerun_after(edit):
        before = finished()
        edit()
        pipeline.run(r)
        after = finished()
        return sorted(k for k in after if after[k] != before[k])

    shard_file = sorted((out / "model").glob("*.safetensors"))[0]

    def flip():
        b = bytearray(shard_file.read_bytes())
        b[-1] ^= 1
        shard_file.write_bytes(bytes(b))  # the manifest still records the old SHA-256

    assert rerun_after(flip) == ["check", "convert", "shard"]
    cfg = out / "model" / "config.json"
    assert rerun_after(lambda: cfg.write_text(cfg.read_text().replace('"group_size": 32', '"group_size": 64'))) == [
        "check", "convert", "shard"]
    rank = sorted((out / "shard").rglob("*.safetensors"))[0]
    assert rerun_after(rank.unlink) == ["check", "shard"]
    assert rerun_after(lambda: (out / "reports" / "check.json").write_text("{}")) == ["check"]
    assert rerun_after(lambda: shutil.rmtree(out / "model")) == ["check", "convert", "shard"]
    assert (out / "model" / "quantize_manifest.json").exists()
    assert rerun_after(lambda: None) == []


def test_recipe_base_model_is_recorded_and_reaches_the_card_and_a_change_rewrites_only_the_card(tmp_path, monkeypatch):
    import quantize.convert as conv

    r = _recipe(tmp_path, stages=["convert", "card", "push"], base_model="zai-org/GLM-5.2-FP8")
    out = tmp_path / "run"
    assert "base_model zai-org/GLM-5.2-FP8" in {s.stage: s for s in pipeline.run(r, plan=True).stages}["card"].does
    pipeline.run(r)
    m = json.loads((out / "model" / "quantize_manifest.json").read_text())
    assert m["options"]["base_model"] == "zai-org/GLM-5.2-FP8"
    card = (out / "model" / "README.md").read_text()
    meta = yaml.safe_load(card.split("\n---\n", 1)[0][4:])
    assert meta["base_model"] == "zai-org/GLM-5.2-FP8" and meta["base_model_relation"] == "quantized"
    assert "base_model is not set" not in card

    # another base_model: the card and push are redone, the conversion is kept (same bytes)
    r2 = _recipe(tmp_path, "r2.yaml", stages=["convert", "card", "push"], base_model="zai-org/GLM-5.2")
    plan = {s.stage: s for s in pipeline.run(r2, plan=True).stages}
    assert plan["convert"].state == "done" and plan["card"].state == plan["push"].state == "stale"
    assert "options changed: base_model" in plan["card"].why
    calls = Calls(monkeypatch, conv, "convert")
    pipeline.run(r2)
    assert calls.n == 0
    card = (out / "model" / "README.md").read_text()
    assert "base_model: zai-org/GLM-5.2\n" in card and "replaces `zai-org/GLM-5.2-FP8`, which the manifest records" in card

    # the near miss: a recipe without the key (the tiny source is a local folder) names the flag instead
    (tmp_path / "other").mkdir()
    pipeline.run(_recipe(tmp_path / "other", stages=["convert", "card"]))
    card = (tmp_path / "other" / "run" / "model" / "README.md").read_text()
    assert "base_model:" not in card.split("\n---\n", 1)[0]
    assert "pass --base-model REPO (or `base_model:` in the recipe's pipeline section)" in card


def test_the_eval_stage_launches_the_engine_the_recipe_names(tmp_path, monkeypatch):
    """pipeline.eval.serve (with tp, kv_cache_dtype, baseline_kv_cache_dtype, serve_args, serve_timeout_s) reaches
    `quantize eval --serve`, its logs under the run's reports; the stage's options record it."""
    from quantize.evaluate import run as ev

    doc = yaml.safe_load(pipeline.default_recipe().read_text())
    doc["pipeline"].update(out=str(tmp_path / "run"), data_dir=None)
    doc["pipeline"]["eval"] = {"serve": "vllm", "tp": 2, "serve_args": "--max-model-len 512", "concurrency": 32,
                               "kv_cache_dtype": "fp8_e4m3", "baseline_kv_cache_dtype": "auto"}
    r = tmp_path / "r.yaml"
    r.write_text(yaml.safe_dump(doc))
    p = pipeline.load_pipeline(r)
    assert {k: p.opts["eval"][k] for k in pipeline.SERVE_KEYS} == {
        "serve": "vllm", "tp": 2, "kv_cache_dtype": "fp8_e4m3", "baseline_kv_cache_dtype": "auto",
        "serve_args": "--max-model-len 512", "serve_timeout_s": 900.0, "concurrency": 32}
    bad = yaml.safe_load(r.read_text())
    bad["pipeline"]["eval"]["baseline_kv_cache_dtype"] = "fp8"  # a near miss of a choice
    r.write_text(yaml.safe_dump(bad))
    with pytest.raises(QuantizeError, match=r"baseline_kv_cache_dtype"):
        pipeline.load_pipeline(r)
    r.write_text(yaml.safe_dump(doc))
    seen = {}

    def fake(*a, **kw):
        seen.update(kw)
        raise QuantizeError("stop here")

    monkeypatch.setattr(ev, "evaluate", fake)
    (p.out / "reports").mkdir(parents=True)
    ctx = SimpleNamespace(p=p, path=lambda name: tmp_path / name)
    with pytest.raises(QuantizeError, match="stop here"):
        pipeline._run_eval(ctx, False)
    assert seen["serve"] == "vllm" and seen["tp"] == 2 and seen["serve_args"] == "--max-model-len 512"
    assert seen["concurrency"] == 32
    assert (seen["kv_cache_dtype"], seen["baseline_kv_cache_dtype"]) == ("fp8_e4m3", "auto")
    assert seen["serve_log"] == p.out / "reports" / "engine-logs"


def test_run_overrides_take_the_place_of_recipe_values_and_are_checked_and_recorded(tmp_path):
    """--source/--out/--data/--data-dir and --set KEY=VALUE stand in for the recipe's values: they
    are checked as recipe keys are (did-you-mean included) and reach the stages' recorded options."""
    p = pipeline.load_pipeline(None, tmp_path / "o", source="tiny:deepseek_v3", data_dir="shipped",
                               sets=["limit=3", "convert.workers=2", "eval.serve=vllm", "kv.samples=4"])
    assert p.source == "tiny:deepseek_v3" and p.out == tmp_path / "o"
    assert p.opts["limit"] == 3 and p.opts["convert"]["workers"] == 2 and p.opts["eval"]["serve"] == "vllm"
    assert p.opts["kv"]["samples"] == 4 and p.opts["data_dir"] == "shipped"
    assert p.overrides == {"source": "tiny:deepseek_v3", "data_dir": "shipped", "limit": 3, "convert.workers": 2,
                           "eval.serve": "vllm", "kv.samples": 4}
    assert pipeline._opts_eval(p)["limit"] == 3  # what the stage records and fingerprints
    # the recipe on disk is unchanged
    assert "limit: 8" in pipeline.default_recipe().read_text()
    for sets, message in ((["limit"], r"--set 'limit': write KEY=VALUE"),
                          (["a.b.c=1"], r"--set 'a.b.c=1': write KEY=VALUE or SECTION.KEY=VALUE"),
                          (["convrt.group_size=64"], r"--set convrt: unknown section; did you mean 'convert'"),
                          (["convert.group_sise=64"], r"pipeline.convert.group_sise: unknown key; did you mean "
                                                      r"'group_size'"),
                          (["limit=[1"], r"--set 'limit=\[1': the value is not YAML"),
                          (["convert.group_size=64"], r"--group-size 64 conflicts with group_size 32"),
                          (["convert.workers=0"], r"pipeline\.convert\.workers.*; fix --set convert\.workers=\.\.\. on "
                                                  r"the command line$"),
                          (["license=Not ok"], r"pipeline\.license Not ok: must be a Hub licence id.*; fix --set "
                                               r"license=\.\.\. on the command line$")):
        with pytest.raises(QuantizeError, match=message):
            pipeline.load_pipeline(None, tmp_path / "o", sets=sets)
    res = CliRunner().invoke(app, ["run", "--out", str(tmp_path / "p"), "--set", "limit=2", "--plan", "--json"])
    assert res.exit_code == 0, res.output


def test_cli_run_ends_with_one_verdict_line_naming_what_it_wrote(tmp_path):
    r = _recipe(tmp_path, stages=["convert"])
    res = CliRunner().invoke(app, ["run", r])
    assert res.exit_code == 0, res.output
    last = res.output.rstrip("\n").splitlines()[-1]
    out = tmp_path / "run"
    assert last.startswith("quantize run passed in ") and "(2 stages done)" in last
    assert f"the model and its card: {out / 'model'}" in last and "reports" not in last  # no reports stage ran
    assert "Writing model shards" not in res.output  # transformers' save bar is not the tool's output


def test_eval_kld_in_the_recipe_writes_the_kl_report_from_the_same_stage_and_the_card_shows_it(tmp_path):
    """pipeline.eval.kld: true: the eval stage's one run of each model also gives the KL report
    (reports/kld.json, eval-kld's kind), recorded as the stage's output and read by the card; a
    change of it reruns eval and card, nothing upstream."""
    data = _arc(tmp_path / "data")
    r = _recipe(tmp_path, data_dir=str(data), limit=2, stages=["convert", "eval", "card"], eval={"kld": True})
    res = pipeline.run(r)
    out = tmp_path / "run"
    assert [s.state for s in res.stages] == ["done"] * 4
    k = json.loads((out / "reports" / "kld.json").read_text())
    assert k["written_by"]["kind"] == "kld" and k["estimator"] == "full vocabulary" and k["tokens"] > 100
    rec = json.loads((out / ".quantize" / "job.json").read_text())["stages"]
    assert rec["eval"]["outputs"]["kld_report"]["path"] == "reports/kld.json"
    assert "KL divergence" in next(s.summary for s in res.stages if s.stage == "eval")
    card = next(p for p in out.rglob("README.md") if p.parent.name != "reports").read_text()
    assert "Next-token KL divergence" in card and f"{k['kld_mean']:.4f}"[:5] in card
    r2 = _recipe(tmp_path, "r2.yaml", data_dir=str(data), limit=2, stages=["convert", "eval", "card"])
    plan = {s.stage: s.state for s in pipeline.run(r2, plan=True).stages}
    assert plan["convert"] == "done" and plan["eval"] != "done" and plan["card"] != "done"
