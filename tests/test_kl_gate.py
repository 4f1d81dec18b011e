"""The KL / flip gate (--max-kld, --max-flip-rate) of eval-kld, eval --kld-out and a run's eval stage:
each figure against an oracle computed here, and the near misses of each bound (1 % above the figure
passes, 1 % below fails)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from quantize.cli import app
from quantize.errors import QuantizeError
from quantize.evaluate.kld import DEFAULT_TEXT, KlGate, kld, kld_table

TOKENS, CHUNK = 96, 48


@pytest.fixture(scope="module")
def pair(tiny, converted):
    return tiny("glm_moe_dsa"), converted("glm_moe_dsa", group_size=32)


@pytest.fixture(scope="module")
def oracle(pair):
    """KL(base || cand) per token and the top-1 flips, counted here from both models' full
    log-softmax on the same chunks kld() scores (float64)."""
    import transformers

    base, cand = pair
    ids = transformers.AutoTokenizer.from_pretrained(base)(DEFAULT_TEXT.read_text(encoding="utf-8"))["input_ids"]
    ids = ids[: TOKENS + 1]
    mb = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    mc = transformers.AutoModelForCausalLM.from_pretrained(cand, dtype=torch.float32).eval()
    kl, flips = [], 0
    for start in range(0, TOKENS, CHUNK):
        seg = torch.tensor(ids[start: start + CHUNK + 1])
        with torch.no_grad():
            lb = mb(input_ids=seg[None, :-1]).logits[0].float().log_softmax(-1).double()
            lc = mc(input_ids=seg[None, :-1]).logits[0].float().log_softmax(-1).double()
        kl.append((lb.exp() * (lb - lc)).sum(-1))
        flips += sum(int(a) != int(b) for a, b in zip(lb.argmax(-1), lc.argmax(-1)))  # counted one by one
    return float(torch.cat(kl).mean()), flips / TOKENS


@pytest.fixture(scope="module")
def report(pair):
    base, cand = pair
    return kld(base, cand, tokens=TOKENS, chunk=CHUNK)


def test_the_gate_reads_the_forward_kl_and_the_hand_counted_flip_rate(report, oracle):
    kl, flip = oracle
    assert 0 < flip < 1 and kl > 0
    g = KlGate(max_kld=1.0, max_flip_rate=1.0).judge(report)
    # float32 model arithmetic in kld() against float64 here; the direction itself is proven in
    # test_kld.py (a sharpened candidate whose two directions differ by a quarter)
    assert g["kld_mean"] == pytest.approx(kl, rel=1e-4) and g["kld_mean"] == report.kld_mean
    assert g["flip_rate"] == pytest.approx(flip, abs=1e-12)
    assert g["passed"] is True


@pytest.mark.parametrize("which", ["max_kld", "max_flip_rate"])
def test_near_misses_of_each_bound(report, oracle, which):
    figure = report.kld_mean if which == "max_kld" else oracle[1]
    above = KlGate(**{which: figure * 1.01}).judge(report)
    below = KlGate(**{which: figure * 0.99}).judge(report)
    assert above["passed"] is True and above["verdict"].startswith("pass: ")
    assert below["passed"] is False
    flag = "--max-kld" if which == "max_kld" else "--max-flip-rate"
    name = "KLD mean" if which == "max_kld" else "flip rate"
    assert below["verdict"] == f"FAIL: {name} {figure:.6g} > {flag} {figure * 0.99:g}"


def test_eval_kld_exits_1_with_the_figure_and_the_bound_in_one_line(pair, oracle, tmp_path):
    base, cand = pair
    kl, flip = kld(base, cand, tokens=TOKENS, chunk=CHUNK).kld_mean, oracle[1]
    out = tmp_path / "kld.json"
    args = ["eval-kld", "--baseline", str(base), "--candidate", str(cand), "--tokens", str(TOKENS),
            "--chunk", str(CHUNK), "--out", str(out)]
    res = CliRunner().invoke(app, [*args, "--max-kld", f"{kl * 0.99:.10g}"])
    assert res.exit_code == 1, res.output
    failed = [ln for ln in res.output.splitlines() if ln.startswith("gate FAILED")]
    assert failed == [f"gate FAILED: {cand}: KLD mean {kl:.6g} > --max-kld {float(f'{kl * 0.99:.10g}'):g}"]
    doc = json.loads(out.read_text())  # the report carries the gate and its verdict
    assert doc["gate"]["passed"] is False and doc["gate"]["max_kld"] == pytest.approx(kl * 0.99)
    res = CliRunner().invoke(app, [*args, "--max-kld", f"{kl * 1.01:.10g}", "--max-flip-rate", f"{flip * 1.01:.10g}"])
    assert res.exit_code == 0, res.output
    assert "gate passed: " in res.output and json.loads(out.read_text())["gate"]["passed"] is True
    res = CliRunner().invoke(app, [*args, "--json", "--max-kld", f"{kl * 1.01:.10g}"])
    assert res.exit_code == 0 and json.loads(res.stdout)["gate"]["passed"] is True  # stdout is the JSON alone
    res = CliRunner().invoke(app, [*args, "--max-flip-rate", "1.5"])
    assert res.exit_code != 0 and "--max-flip-rate 1.5: must be from 0 to 1" in res.output


def test_several_candidates_each_gated(pair, tmp_path, oracle):
    base, cand = pair
    t = kld_table(base, [cand, base], tokens=TOKENS, chunk=CHUNK, max_kld=oracle[0] * 0.5)
    assert [r.gate["passed"] for r in t.reports] == [False, True]  # the baseline against itself: KL 0


def test_eval_takes_the_bounds_only_with_kld_out(pair):
    from quantize.evaluate.run import evaluate

    base, cand = pair
    with pytest.raises(QuantizeError, match="--max-kld gates the KL divergence report: add --kld-out FILE"):
        evaluate(base, cand, tasks="arc_easy", max_kld=0.1)


def test_eval_report_fails_when_its_kl_gate_fails(report):
    from dataclasses import replace

    from quantize.evaluate.run import EvalReport, TaskResult

    t = TaskResult("arc_easy", "acc", 200, 50.0, 3.5, 50.0, 3.5, 0.0, -1.0, 1.0, True)
    ok = replace(report, gate=KlGate(max_kld=1.0).judge(report))
    bad = replace(report, gate=KlGate(max_kld=0.0).judge(report))
    assert EvalReport("b", "c", None, 1.0, [t], kld=ok).passed is True
    assert EvalReport("b", "c", None, 1.0, [t], kld=bad).passed is False
    assert EvalReport("b", "c", None, 1.0, [t], kld=bad).to_dict()["kld_gate"]["passed"] is False


def test_a_recipe_bound_without_the_kl_measurement_is_refused(tmp_path):
    from quantize import pipeline

    doc = yaml.safe_load(pipeline.default_recipe().read_text())
    doc["pipeline"].update(out=str(tmp_path / "run"))
    doc["pipeline"].setdefault("eval", {})
    r = tmp_path / "r.yaml"
    for kld_on, bound in ((False, {"max_kld": 0.05}), (False, {"max_flip_rate": 0.1}), (True, {"max_kld": 0.05})):
        doc["pipeline"]["eval"] = {**{k: v for k, v in doc["pipeline"]["eval"].items()
                                      if k not in ("max_kld", "max_flip_rate")}, "kld": kld_on, **bound}
        r.write_text(yaml.safe_dump(doc, sort_keys=False))
        if kld_on:  # the near miss: with the measurement on, the bound is taken
            assert pipeline.load_pipeline(r).opts["eval"]["max_kld"] == 0.05
            continue
        with pytest.raises(QuantizeError, match=f"pipeline.eval.{next(iter(bound))} gates the KL divergence.*"
                                                "pipeline.eval.kld: true"):
            pipeline.load_pipeline(r)


def test_the_card_shows_the_gate_and_its_verdict(converted, report, tmp_path):
    import shutil
    from dataclasses import replace

    from quantize.checkpoint.output import signed_json
    from quantize.publish.card import card

    folder = tmp_path / "m"
    shutil.copytree(converted("glm_moe_dsa", group_size=32), folder)
    rep = replace(report, candidate=str(folder), gate=KlGate(max_kld=0.0).judge(report))
    f = tmp_path / "kld.json"
    f.write_text(signed_json(rep.to_dict(), "kld"))
    text = card(folder, eval=[f]).text
    assert f"KL / flip gate (`--max-kld` 0.0, `--max-flip-rate` not set; flip rate = 1 - same top-1): " \
           f"**FAIL: KLD mean {report.kld_mean:.6g} &gt; --max-kld 0**." in text  # ">" escaped for Markdown
