"""quantize eval through lm-eval on local data: same items, paired statistics, gate, bad input."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'quantize[eval]')")

from quantize.convert import convert  # noqa: E402
from quantize.errors import QuantizeError  # noqa: E402
from quantize.evaluate.run import evaluate, paired_stats  # noqa: E402
from quantize.evaluate.tasks import task_configs  # noqa: E402


def _data(tmp_path):
    """Tiny local copies in the formats docs/evaluation.md#local-data describes (GSM8K jsonl, ARC Mosaic jsonl)."""
    d = tmp_path / "data"
    (d / "gsm8k").mkdir(parents=True, exist_ok=True)
    (d / "arc").mkdir(exist_ok=True)
    qa = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many?", "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"} for i in range(8)]
    for split in ("train", "test"):
        (d / "gsm8k" / f"{split}.jsonl").write_text("\n".join(json.dumps(x) for x in qa))
    arc = [{"query": f"Question: What is {i} plus one?", "choices": [str(i), str(i + 1), str(i + 2), "seven"], "gold": 1} for i in range(6)]
    for t in ("arc_easy", "arc_challenge"):
        (d / "arc" / f"{t}.jsonl").write_text("\n".join(json.dumps(x) for x in arc))
    return d


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    base = tiny("llama", layout="bf16")
    cand = tmp_path_factory.mktemp("ev") / "g32"
    convert(base, cand, profile="all-linear")
    return base, cand


def test_eval_same_items_paired_and_reports(models, tmp_path):
    base, cand = models
    rep = evaluate(base, cand, tasks="arc_easy,gsm8k", limit=3, data_dir=_data(tmp_path), max_gen_toks=4,
                   out=tmp_path / "r.json", markdown=tmp_path / "r.md", resamples=500)
    assert [t.task for t in rep.tasks] == ["arc_easy", "gsm8k"] and all(t.n == 3 for t in rep.tasks)
    doc = json.loads((tmp_path / "r.json").read_text())
    for t in ("arc_easy", "gsm8k"):
        assert {"baseline", "candidate", "delta", "ci_low", "ci_high", "passed"} <= set(doc["tasks"][t])
    assert "| arc_easy |" in (tmp_path / "r.md").read_text()
    assert doc["written_by"]["kind"] == "eval"  # signed: a rerun may replace it, a hand-edited one is refused
    assert "written by quantize eval-markdown" in (tmp_path / "r.md").read_text().splitlines()[-1]
    self_rep = evaluate(base, base, tasks="arc_easy", limit=3, data_dir=_data(tmp_path), resamples=200)
    assert self_rep.tasks[0].delta == 0 and self_rep.tasks[0].ci_low == self_rep.tasks[0].ci_high == 0 and self_rep.passed


def test_paired_bootstrap_and_gate():
    a = np.array([1.0] * 80 + [0.0] * 20)
    b = a.copy()
    b[:10] = 0  # candidate loses 10 of 100 items: -10 points
    d, lo, hi = paired_stats(a, b, 4000)
    assert d == pytest.approx(-10.0) and lo < -10 < hi < -4  # a real drop: the CI excludes -1
    d, lo, hi = paired_stats(a, a, 1000)
    assert d == lo == hi == 0.0
    from quantize.evaluate.run import TaskResult

    wide = TaskResult("arc", "acc", 150, 26, 6, 18, 5, -8, -18, 0, passed=True, conclusive=False)  # not smoke
    assert wide.verdict.startswith("pass (inconclusive")
    assert TaskResult("arc", "acc", 50, 26, 6, 10, 5, -16, -25, -8, passed=False, conclusive=False).verdict == "FAIL"


def test_unknown_task_suggests_and_missing_data_named(tmp_path):
    with pytest.raises(QuantizeError, match="did you mean.*gsm8k"):
        task_configs(["gsm8kk"], None)
    with pytest.raises(QuantizeError, match=r"arc/arc_easy.jsonl: missing"):
        task_configs(["arc_easy"], tmp_path)


def test_mmlu_local_csv_keeps_answers_as_text(tmp_path):
    """MMLU CSVs are read all-as-string with NA parsing off ('None' stays 'None'): the subset the
    repository ships (eval/data, `--data-dir shipped`)."""
    cfgs, groups = task_configs(["mmlu"], "shipped")
    assert len(groups["mmlu"]) == 57 and all(c["dataset_path"] == "csv" for c in cfgs)
    assert cfgs[0]["dataset_kwargs"]["keep_default_na"] is False
    from lm_eval.api.task import ConfigurableTask

    task = ConfigurableTask(config=cfgs[0])
    doc = next(iter(task.test_docs()))
    assert len(doc["choices"]) == 4 and isinstance(doc["answer"], int)


def test_cli_unknown_task_exits_2(models, tmp_path):
    """(exit 0 on a pass: test_quiet_by_default...; exit 1 on a failed gate: test_gate_fails_on_a_real_drop...)"""
    base, cand = models
    p = subprocess.run([sys.executable, "-c", "from quantize.cli import app; app()", "eval", "--baseline", str(base), "--candidate", str(cand),
                        "--tasks", "arcc_easy"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and "unknown task" in p.stderr


def test_served_candidate_equals_local(models, tmp_path):
    """The candidate evaluated through an OpenAI-compatible server on loopback (what SGLang/vLLM
    serve) scores the same items as the same model run locally."""
    from .completions_server import serve

    base, cand = models
    data = _data(tmp_path)
    local = evaluate(base, cand, tasks="arc_easy", limit=4, data_dir=data, resamples=200)
    with serve(cand) as url:
        served = evaluate(base, cand, tasks="arc_easy", limit=4, data_dir=data, resamples=200, base_url=url)
    assert served.tasks[0].n == local.tasks[0].n == 4
    assert served.tasks[0].candidate == local.tasks[0].candidate
    assert served.tasks[0].baseline == local.tasks[0].baseline


def test_unreachable_server_named(models, tmp_path):
    base, cand = models
    with pytest.raises(QuantizeError, match=r"http://127\.0\.0\.1:9: server not reachable"):
        evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=_data(tmp_path), base_url="http://127.0.0.1:9")


def test_malformed_data_file_named(models, tmp_path):
    base, cand = models
    d = _data(tmp_path)
    (d / "arc" / "arc_easy.jsonl").write_text('{"query": "Question: x", "choices": ["a", "b"], "gold": 0}\n{not json\n')
    with pytest.raises(QuantizeError, match=r"evaluation data could not be read.*arc_easy.jsonl"):
        evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=d)


def test_the_tasks_data_is_read_before_any_model_loads_or_engine_starts(models, tmp_path, monkeypatch):
    """The Hub out of reach without --data-dir (datasets' own ConnectionError) is one line naming the
    fix, before a model loads or a server is launched; a malformed local file is named before too."""
    import datasets
    import transformers

    base, cand = models
    loads = []
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a) or pytest.fail("a model was loaded")))

    def offline(path, *a, **k):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    logs = tmp_path / "logs"
    for kw in ({}, dict(serve="vllm", engine_python=sys.executable, serve_log=logs, kld_out=tmp_path / "k.json")):
        with pytest.raises(QuantizeError, match=r"^evaluation data: lm-eval could not fetch the tasks' datasets from "
                                                r"the Hub \(Couldn't reach 'allenai/ai2_arc'.*\); pass --data-dir "
                                                r"shipped .* or --data-dir DIR"):
            evaluate(base, cand, tasks="arc_easy", limit=1, **kw)
    monkeypatch.undo()
    d = _data(tmp_path)
    (d / "arc" / "arc_easy.jsonl").write_text("{not json\n")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        classmethod(lambda cls, *a, **k: pytest.fail("a model was loaded")))
    with pytest.raises(QuantizeError, match=r"evaluation data could not be read.*arc_easy.jsonl"):
        evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=d, serve="vllm", engine_python=sys.executable,
                 serve_log=logs)
    assert not loads and not logs.exists()


def test_a_failure_after_the_tasks_read_is_not_named_the_hubs_and_keeps_its_own_cause(models, tmp_path, monkeypatch):
    """Once the data was read, a ConnectionError inside lm-eval (a served run's reset connection) is
    not reported as the Hub's, and an error passed through is not made its own cause (a cycle that
    kept the models alive); a failed local --save-baseline --kld-out leaves neither of its files."""
    import lm_eval

    import quantize.evaluate.run as run

    base, cand = models
    data = _data(tmp_path)
    for exc in (ConnectionError("reset by peer"), RuntimeError("boom")):
        monkeypatch.setattr(lm_eval, "simple_evaluate", lambda exc=exc, **kw: (_ for _ in ()).throw(exc))
        with pytest.raises(type(exc)) as ei:
            evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=data)
        assert ei.value is exc and ei.value.__cause__ is not exc
    monkeypatch.undo()
    real = run._kld
    monkeypatch.setattr(run, "_kld", lambda *a, **k: (_ for _ in ()).throw(QuantizeError("the KL failed")))
    saved, tmp = tmp_path / "b.json", tmp_path / "tmp"
    tmp.mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # $TMPDIR: where the baseline's fp32 log-probs go
    with pytest.raises(QuantizeError, match="the KL failed"):
        evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=data, kld_out=tmp_path / "k.json",
                 kld_tokens=20, kld_chunk=10, save_baseline=saved)
    assert not saved.exists() and not (tmp_path / "b.kld.safetensors").exists()
    assert not list(tmp.glob("quantize-eval-kl-*"))  # the temporary file removed on the failure too
    monkeypatch.setattr(run, "_kld", real)
    evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=data, kld_out=tmp_path / "k.json", kld_tokens=20,
             kld_chunk=10, save_baseline=saved)
    assert saved.exists() and (tmp_path / "b.kld.safetensors").exists()


def _arc(d, golds, n=10):
    """ARC items with one-token answers (the tiny tokenizer is per character): a choice's
    log-likelihood is then the model's preference, not its length."""
    items = [{"query": f"Question: Which letter comes after '{w}' in a sentence about item {i}?",
              "choices": ["b", "c", "d", "e"], "gold": golds[i]}
             for i, w in enumerate(["it", "of", "is", "and", "to", "in", "for", "on", "as", "by"][:n])]
    (d / "arc" / "arc_easy.jsonl").write_text("\n".join(json.dumps(x) for x in items))


def _negated_head(base, out):
    """The baseline with its output layer negated: it prefers what the baseline finds least likely."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from .lineage import made_from

    shutil.copytree(base, out)
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            if "lm_head.weight" not in fh.keys():
                continue
            t = {k: fh.get_tensor(k) for k in fh.keys()}
            meta = fh.metadata()
        t["lm_head.weight"] = -t["lm_head.weight"]
        save_file(t, str(f), metadata=meta)
        return made_from(out, base)  # made here from the baseline, as a converter would (evaluate/provenance.py)
    raise AssertionError("no lm_head.weight")


def test_gate_fails_on_a_real_drop_and_cli_exits_1(models, tmp_path):
    """The gate's failing path on real models: ARC items whose gold answer is the baseline's own
    choice (baseline 100%), against the baseline with its output layer negated. The drop is far
    beyond -max-drop, so the task and the report fail, and `quantize eval` exits 1."""
    from quantize.evaluate.run import _run_model

    base, _ = models
    data = _data(tmp_path)
    _arc(data, [0] * 10)
    configs, _ = task_configs(["arc_easy"], data)
    picks = {s["doc_id"]: int(np.argmax([ll for ll, _ in s["filtered_resps"]])) for s in _run_model(str(base), configs, None, "cpu", 1)["samples"]["arc_easy"]}
    assert sorted(picks) == list(range(10))
    _arc(data, [picks[i] for i in range(10)])
    from typer.testing import CliRunner

    from quantize.cli import app

    bad = _negated_head(base, tmp_path / "negated")
    res = CliRunner().invoke(app, ["eval", "--baseline", str(base), "--candidate", str(bad), "--tasks", "arc_easy",
                                   "--data-dir", str(data), "--max-drop", "1.0", "--out", str(tmp_path / "r.json"),
                                   "--json"])
    assert res.exit_code == 1, res.output[-2000:]
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    t = doc["tasks"]["arc_easy"]
    assert t["n"] == 10 and t["baseline"] == 100.0 and t["candidate"] <= 50.0
    assert t["ci_high"] < -1.0 and t["passed"] is False and t["verdict"] == "FAIL" and doc["passed"] is False
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is False
    # the same items against the baseline itself pass: the failure is the drop, not the data
    assert evaluate(base, base, tasks="arc_easy", data_dir=data, resamples=200).passed


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_cuda_device_without_gpu_refused_before_running(models, tmp_path, monkeypatch):
    import quantize.evaluate.run as run

    monkeypatch.setattr(run, "_run_model", lambda *a, **k: pytest.fail("a model ran"))
    base, cand = models
    with pytest.raises(QuantizeError, match=r"^--device cuda: no CUDA GPU is visible here; use --device cpu$"):
        evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=_data(tmp_path), device="cuda")
    with pytest.raises(QuantizeError, match=r"^--device gpu0: unknown; use cpu, cuda or cuda:N$"):
        evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=_data(tmp_path), device="gpu0")


def test_the_shipped_subset_serves_every_task():
    """eval/data holds every supported task's files in the local layout: a bare clone evaluates
    without the Hub or a copy beside it."""
    from lm_eval.api.task import ConfigurableTask

    from quantize.evaluate.tasks import SUPPORTED, data_folder

    assert (data_folder("shipped") / "arc" / "arc_easy.jsonl").is_file()
    cfgs, groups = task_configs(list(SUPPORTED), "shipped")
    assert {k: len(v) for k, v in groups.items()} == {"gsm8k": 1, "arc_easy": 1, "arc_challenge": 1, "mmlu": 57,
                                                       "mmlu_pro": 14}
    by_name = {c["task"]: c for c in cfgs}
    for name, n in (("gsm8k", 100), ("arc_easy", 100), ("mmlu_pro_math", 10), ("mmlu_anatomy", 5)):
        docs = list(ConfigurableTask(config=by_name[name]).test_docs())
        assert len(docs) == n, name


def test_quiet_by_default_its_output_in_a_named_log(models, tmp_path):
    """lm-eval's and transformers' own output (bars, load reports, warnings, git's complaint) goes to
    a log file the command names in one line; the terminal keeps the table and the verdict."""
    base, cand = models
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "eval", "--baseline", str(base), "--candidate", str(cand),
                        "--tasks", "arc_easy", "--limit", "2", "--data-dir", str(_data(tmp_path))],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lm-eval's and transformers' output: "), p.stderr[-2000:]
    log = err[0].split(": ", 1)[1].split(" (--verbose")[0]
    text = open(log).read()
    assert "Running loglikelihood requests" in text  # what used to be on the terminal
    assert "Loading weights" not in p.stdout + p.stderr
    rep = evaluate(base, cand, tasks="arc_easy", limit=2, data_dir=_data(tmp_path), resamples=200, verbose=True)
    assert rep.log is None  # --verbose: nothing captured
    # the verdict, by hand: the gate fails a task only when the whole 95% CI of the paired drop lies below
    # -max_drop (1 point by default); both models score each of the 2 items alike here (the INT4 copy picks
    # the baseline's answers), so every bootstrap resample's drop is 0 and the task passes, as a smoke test
    # (2 documents, under the 100 a gate needs: evaluate/smoke.py)
    (t,) = rep.tasks
    assert t.docs == ["arc_easy/0", "arc_easy/1"] and t.candidate_items == t.baseline_items
    assert p.stdout.strip().splitlines()[-1] == ("pass (smoke: 2 items, below the 100 a gate needs): 1 task(s), "
                                                 "gate max drop 1 points; no report written (--out FILE keeps one)")


def test_saved_baseline_is_reused_and_refused_for_another_comparison(models, tmp_path, monkeypatch):
    """--save-baseline keeps the baseline's per-document results; --baseline-results compares the next
    candidate against them without running the baseline again, and only for the same comparison."""
    import quantize.evaluate.run as run

    import quantize.evaluate.kld as kld

    base, cand = models
    data, saved = _data(tmp_path), tmp_path / "base.json"
    kl = dict(kld_tokens=40, kld_chunk=20)
    first = evaluate(base, cand, tasks="arc_easy", limit=3, data_dir=data, resamples=200, save_baseline=saved,
                     kld_out=tmp_path / "k1.json", **kl)
    assert json.loads(saved.read_text())["kld"] == {"file": "base.kld.safetensors", "served": False}
    calls, loads = [], []
    real, real_load = run._run_model, kld.load_model
    monkeypatch.setattr(run, "_run_model", lambda path, *a, **k: calls.append(path) or real(path, *a, **k))
    monkeypatch.setattr(kld, "load_model", lambda path, *a, **k: loads.append(str(path)) or real_load(path, *a, **k))
    again = evaluate(base, cand, tasks="arc_easy", limit=3, data_dir=data, resamples=200, baseline_results=saved,
                     kld_out=tmp_path / "k2.json", **kl)
    # the candidate alone ran, loaded once: its tasks, then its KL on the same model (the saved KL side)
    assert calls == loads == [str(cand)]
    assert [(t.baseline, t.candidate, t.docs) for t in again.tasks] == [(t.baseline, t.candidate, t.docs)
                                                                         for t in first.tasks]
    assert again.measured["baseline"]["reused"] is True
    # the KL against the saved fp16 log-probs: the fresh run's fp32 ones to fp16's precision
    assert again.kld.kld_mean == pytest.approx(first.kld.kld_mean, rel=2e-2, abs=1e-4)
    assert again.kld.top1_agreement == first.kld.top1_agreement and again.kld.tokens == 40
    with pytest.raises(QuantizeError, match=r"--baseline-results \S+base.json: its KL side: .*saved for --tokens 40 "
                                            r"\(this run: 30\)"):
        evaluate(base, cand, tasks="arc_easy", limit=3, data_dir=data, baseline_results=saved,
                 kld_out=tmp_path / "k3.json", kld_tokens=30, kld_chunk=20)
    assert calls == loads == [str(cand)]  # refused before anything ran
    for kw, what in ((dict(limit=2), "another --limit"), (dict(tasks="arc_challenge"), "other tasks"),
                     (dict(chat=True), r"other prompts \(--chat or not\)")):
        args = {**dict(tasks="arc_easy", limit=3, data_dir=data, resamples=200, baseline_results=saved), **kw}
        with pytest.raises(QuantizeError, match=f"made for {what} than this run"):
            evaluate(base, cand, **args)
    with pytest.raises(QuantizeError, match="made for another baseline model"):
        evaluate(cand, cand, tasks="arc_easy", limit=3, data_dir=data, baseline_results=saved)
    (data / "arc" / "arc_easy.jsonl").write_text((data / "arc" / "arc_easy.jsonl").read_text() + "\n")
    with pytest.raises(QuantizeError, match="made for other evaluation data"):
        evaluate(base, cand, tasks="arc_easy", limit=3, data_dir=data, baseline_results=saved)
    with pytest.raises(QuantizeError, match="--save-baseline with --baseline-results"):
        evaluate(base, cand, tasks="arc_easy", limit=3, data_dir=data, baseline_results=saved, save_baseline=saved)
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(QuantizeError, match="not a file `quantize eval --save-baseline` wrote"):
        evaluate(base, cand, tasks="arc_easy", limit=3, data_dir=data, baseline_results=other)


def test_each_local_model_loads_once_for_its_tasks_and_its_kl(models, tmp_path, monkeypatch):
    """Local --chat --kld-out: two lm-eval runs per model (templated generation, log-likelihood as
    written) and the KL, on one load of each model (transformers' from_pretrained counted, lm-eval's
    own loader included: it used to load each three times), one model in memory at a time (the
    baseline's log-probs are written after its tasks and it is freed before the candidate loads;
    it used to stay through the candidate's tasks); the KL report equals eval-kld's own, which holds
    both models (the oracle), and a --save-baseline's KL side is eval-kld's --save-baseline file."""
    import weakref

    import torch

    import transformers

    import quantize.evaluate.kld as kld

    base, cand = models
    data, loads, alive = _data(tmp_path), [], []
    real = transformers.PreTrainedModel.from_pretrained.__func__

    def counted(cls, path, *a, **k):
        loads.append((Path(path).name, sum(r() is not None for r in alive)))  # (folder, models alive before it)
        m = real(cls, path, *a, **k)
        alive.append(weakref.ref(m))
        return m

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(counted))
    saved = tmp_path / "b.json"
    rep = evaluate(base, cand, tasks="arc_easy,gsm8k", limit=2, data_dir=data, chat=True, max_gen_toks=4,
                   resamples=100, kld_out=tmp_path / "k.json", kld_tokens=40, kld_chunk=20, save_baseline=saved)
    assert loads == [(base.name, 0), (cand.name, 0)] and all(t.n == 2 for t in rep.tasks)
    assert not any(r() for r in alive)  # and none is left after
    loads.clear()
    own = kld.kld(base, cand, tokens=40, chunk=20, save_baseline=tmp_path / "own.safetensors")
    assert loads == [(base.name, 0), (cand.name, 1)]  # eval-kld: both at once
    drop = ("baseline", "candidate", "text")
    assert {k: v for k, v in rep.kld.to_dict().items() if k not in drop} == {
        k: v for k, v in own.to_dict().items() if k not in drop} and rep.kld.tokens == 40
    from safetensors.torch import load_file

    side, mine = load_file(tmp_path / "b.kld.safetensors"), load_file(tmp_path / "own.safetensors")
    assert side.keys() == mine.keys() and all(torch.equal(side[k], mine[k]) for k in side)


def test_a_compressed_tensors_fp8_block_candidate_is_evaluated(tiny, tmp_path):
    """convert --scheme fp8-block's output, which transformers cannot decompress (its fused experts),
    runs locally through eval's tasks and KL as through eval-kld (a dequantized copy); it used to end
    in transformers' traceback."""
    import torch

    from quantize.evaluate.kld import load_model

    src = tiny("deepseek_v3")
    out = tmp_path / "fp8b"
    convert(src, out, scheme="fp8-block")
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [1, 7], "do_sample": False}))
    m = load_model(out, torch.float32)  # the copy transformers loads keeps the folder's stop tokens (generate's)
    assert m.generation_config.eos_token_id == [1, 7] and m.generation_config.max_new_tokens == gen["max_new_tokens"]
    del m
    rep = evaluate(src, out, tasks="arc_easy", limit=3, data_dir=_data(tmp_path), resamples=100,
                   kld_out=tmp_path / "k.json", kld_tokens=40, kld_chunk=20)
    assert rep.tasks[0].n == 3 and rep.measured["candidate"]["engine"] == "transformers"
    assert 0 < rep.kld.kld_mean < 0.05  # FP8 block: close to the source, and not the source itself


def test_chat_templates_the_generation_tasks_and_keeps_the_log_likelihood_ones(models, tmp_path, monkeypatch):
    """--chat: a generation task runs through the chat template, a log-likelihood task as written
    (a chat-completions server cannot score it), both on the same model; a folder without a
    template is one line before anything runs when a generation task needs it, and goes on when
    none does (the near miss)."""
    import shutil

    import quantize.evaluate.run as run

    base, cand = models
    data = _data(tmp_path)
    bare = tmp_path / "bare"
    shutil.copytree(cand, bare)
    (bare / "chat_template.jinja").unlink()  # the tiny's tokenizer carries one: this copy has none
    with pytest.raises(QuantizeError, match=r"--chat: .*bare has no chat template \(tokenizer_config.json"):
        evaluate(base, bare, tasks="arc_easy,gsm8k", limit=1, data_dir=data, chat=True)
    (bare / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))  # a processor's, not
    with pytest.raises(QuantizeError, match=r"bare has no chat template"):  # the tokenizer's: still none
        evaluate(base, bare, tasks="gsm8k", limit=1, data_dir=data, chat=True)
    calls = []
    real = run._lm_eval
    monkeypatch.setattr(run, "_lm_eval", lambda path, cs, *a, **k: calls.append(
        (path, sorted(c["task"] for c in cs), a[4])) or real(path, cs, *a, **k))
    rep = evaluate(base, bare, tasks="arc_easy", limit=2, data_dir=data, chat=True, resamples=100)
    assert rep.tasks[0].n == 2 and calls == [(str(base), ["arc_easy"], False), (str(bare), ["arc_easy"], False)]
    calls.clear()
    rep = evaluate(base, cand, tasks="arc_easy,gsm8k", limit=2, data_dir=data, chat=True, max_gen_toks=4,
                   resamples=100)
    assert [t.task for t in rep.tasks] == ["arc_easy", "gsm8k"] and all(t.n == 2 for t in rep.tasks)
    assert calls == [(str(m), t, chat) for m in (base, cand) for t, chat in ((["gsm8k"], True), (["arc_easy"], False))]
    assert rep.measured["candidate"]["prompts"] == run.CHAT_PROMPTS[False]
    with pytest.raises(QuantizeError, match=r"127\.0\.0\.1:9: server not reachable"):  # served: the same checks
        evaluate(base, cand, tasks="gsm8k,arc_easy", limit=1, data_dir=data, chat=True, base_url="http://127.0.0.1:9")


def _linked_copy(folder: Path, dst: Path) -> Path:
    """A copy of a model folder's files, its weights linked, not copied."""
    import shutil

    dst.mkdir(parents=True)
    for f in Path(folder).iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


def _switched(folder: Path, dst: Path, var: str = "enable_thinking") -> Path:
    """A copy of a model folder (weights linked) whose chat template has a thinking switch: set
    False, it prefills an empty trace after the assistant's tag, as GLM's templates do."""
    _linked_copy(folder, dst)
    (dst / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
        f"{{% if {var} is defined and not {var} %}}<think></think>{{% endif %}}")
    return dst


def test_a_thinking_switch_is_set_alike_on_both_models_and_on_needs_room(models, tmp_path, monkeypatch):
    """A reasoning model's template (a thinking switch) under --chat: off by default, rendered with
    the switch False for both models (the prefilled empty trace is in every GSM8K prompt), said in the
    report and part of a saved baseline's identity; on, lm-eval cuts at </think>; refused: on with a
    cap that cuts a trace (1023 tokens, the near miss of 1024), without --chat, on a template without
    a switch, and two models whose templates switch differently."""
    import lm_eval

    import quantize.evaluate.run as run

    base, cand = models
    b, c = _switched(base, tmp_path / "b"), _switched(cand, tmp_path / "c")
    data = _data(tmp_path)
    seen, got = [], []
    real = lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: seen.append(kw) or got.append(real(**kw)) or got[-1])
    kw = dict(tasks="gsm8k", limit=1, data_dir=data, chat=True, resamples=100)
    rep = evaluate(b, c, max_gen_toks=1024, save_baseline=tmp_path / "base.json", **kw)
    # lm-eval's hf backend around each loaded model, the switch set on it
    assert [s["model"].chat_template_args for s in seen] == [{"enable_thinking": False}] * 2
    assert all(s["model"].think_end_token is None and s["gen_kwargs"] is None for s in seen)
    prompts = [json.dumps(x["arguments"]) for r in got for x in r["samples"]["gsm8k"]]
    assert len(prompts) == 4 and all(p.count("<|assistant|><think></think>") == 1 for p in prompts)  # 2 filters x 2
    m = rep.measured["candidate"]
    assert m["thinking"]["mode"] == "off" and m["prompts"].endswith("; thinking off (the template's "
                                                                   "enable_thinking=False)")
    with pytest.raises(QuantizeError, match=r"made for another --thinking than this run"):
        evaluate(b, c, max_gen_toks=1024, thinking="on", baseline_results=tmp_path / "base.json", **kw)
    seen.clear()
    rep = evaluate(b, c, max_gen_toks=1024, thinking="on", **kw)
    assert [(s["model"].chat_template_args, s["model"].think_end_token) for s in seen] == [
        ({"enable_thinking": True}, "</think>")] * 2
    assert rep.measured["baseline"]["thinking"]["trace"] == "cut at </think> by lm-eval"
    for bad, match in [(dict(thinking="on", max_gen_toks=1023), r"--thinking on: --max-gen-toks 1023 cuts a reasoning"),
                       (dict(thinking="on"), r"--thinking on: the task's own cap \(GSM8K: 256\) cuts"),
                       (dict(thinking="off", chat=False), r"--thinking off: a chat template's switch, so it needs --chat")]:
        with pytest.raises(QuantizeError, match=match):
            evaluate(b, c, **{**kw, **bad})
    with pytest.raises(QuantizeError, match=r"--thinking off: \S+'s chat template has no thinking switch"):
        evaluate(base, cand, thinking="off", **kw)
    k = _switched(cand, tmp_path / "k", var="thinking")
    with pytest.raises(QuantizeError, match=r"/b's chat template switches thinking with enable_thinking, .*/k's with "
                                            r"thinking; both models need the same template"):
        evaluate(b, k, **kw)
    assert len(seen) == 2  # every refusal before lm-eval ran


def test_a_message_without_content_is_an_empty_answer_not_none():
    """A reasoning model's trace cut at the cap: the engine's parser puts it all in reasoning_content
    and the message's content is null. Our chat backend reads it as an empty answer (scored 0), where
    lm-eval's own returns None, which its answer filters cannot read; text is kept as it is."""
    from lm_eval.models.openai_completions import LocalChatCompletion

    import quantize.evaluate.run as run

    out = {"choices": [{"index": 0, "message": {"content": None, "reasoning_content": "Let me think"}}]}
    text = {"choices": [{"index": 0, "message": {"content": "#### 4"}}]}
    from lm_eval.api.registry import get_model

    cls = run._chat_backend()
    assert run._chat_backend() is cls and get_model(run.CHAT_BACKEND) is cls  # registered once, under our name
    me = cls.__new__(cls)
    me.think_end_token = None
    assert LocalChatCompletion.parse_generations(me, out) == [None]  # lm-eval's own
    assert me.parse_generations(out) == [""] and me.parse_generations([out, text]) == ["", "#### 4"]
