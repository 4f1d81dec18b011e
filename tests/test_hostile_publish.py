"""Hostile input, card and push: a manifest is checked against the job record (not trusted), a
README.md the tool did not write is never overwritten, --eval reports are checked key by key,
bounded and escaped, the endpoint's userinfo is never echoed and --revision is a branch name.
Each refusal is one line (tests/hostile.py); beside the table, the near misses that must pass."""

import hashlib
import json
import re

import pytest

from quantize.publish.card import MARKER, MAX_TASKS, MAX_TEXT, card
from tests.hostile import Case, edit_json, run_case

from .hub_server import serve

SHARD = "model-00002-of-00003.safetensors"
MAN = "quantize_manifest.json"
JOB = ".quantize/job.json"


def _entry(p):
    b = p.read_bytes()
    return {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)}


def _rehash(ctx, *names, job=True):
    """The manifest (and the job record) re-hashed to match the files as they are now."""
    for rel in (MAN, JOB) if job else (MAN,):
        edit_json(ctx.out / rel, lambda m: m["files"].update({n: _entry(ctx.out / n) for n in names}))


def _flip(ctx, rel=SHARD):
    p = ctx.out / rel
    b = bytearray(p.read_bytes())
    b[-5] ^= 1
    p.write_bytes(bytes(b))


def _drop(name, job=True):
    def setup(ctx):
        for rel in (MAN, JOB) if job else (MAN,):
            edit_json(ctx.out / rel, lambda m: (m["files"].pop(name), None)[1])

    return setup


def _set_manifest(fn):
    return lambda ctx: edit_json(ctx.out / MAN, fn)


def _unlocked(ctx):
    """The folder but its lock (card takes it, writing its pid there) and the eval reports."""
    out = [p for p in ctx.out.iterdir() if p.name != ".quantize"]
    out += [p for p in (ctx.out / ".quantize").iterdir() if p.name != "lock"]
    return out + sorted(ctx.tmp.glob("*.json"))


def _eval_report(ctx, tasks=None, **top):
    t = {"metric": "exact_match", "n": 200, "baseline": 61.5, "baseline_stderr": 3.44, "candidate": 60.0,
         "candidate_stderr": 3.46, "delta": -1.5, "ci_low": -3.5, "ci_high": 0.5, "passed": True, "conclusive": True,
         "verdict": "pass"}
    rep = {"baseline": "/models/GLM-5-FP8", "candidate": str(ctx.out), "limit": 200, "max_drop": 1.0, "passed": True,
           "tasks": tasks if tasks is not None else {"gsm8k": t}}
    rep.update(top)
    return rep, t


def _report(make):
    """Write ``make(ctx)`` (a report, raw JSON text or bytes) to ctx.tmp / r.json."""
    def setup(ctx):
        d = make(ctx)
        (ctx.tmp / "r.json").write_text(d if isinstance(d, str) else json.dumps(d))

    return setup


def _task_value(key, value):
    def make(ctx):
        rep, t = _eval_report(ctx)
        t[key] = value
        return rep

    return make


def _generated_then(edit):
    def setup(ctx):
        card(ctx.out)
        p = ctx.out / "README.md"
        p.write_text(edit(p.read_text()))

    return setup


def _null_layers(ctx):
    edit_json(ctx.out / "config.json", lambda c: c.update(num_hidden_layers=None))
    _rehash(ctx, "config.json")


def _push(*extra):
    return lambda c: ["push", c.out, "test-org/glm-int4", "--dry-run", *extra]


def _card(*extra):
    return lambda c: ["card", c.out, *[c.tmp / "r.json" if e == "R" else e for e in extra]]


OUT = ("out",)
CASES = [
    # R3: the manifest is checked, not trusted
    Case("push: a shard flipped and the manifest re-hashed", _push(), "another SHA-256 or size than the job record",
         lambda c: (_flip(c), _rehash(c, SHARD, job=False)), needs=OUT),
    Case("push: the manifest's files empty", _push(), "records no files", _set_manifest(lambda m: m.update(files={})),
         needs=OUT),
    Case("push: a file dropped from the manifest", _push(), "does not record tokenizer.json, which the job record does",
         _drop("tokenizer.json", job=False), needs=OUT),
    Case("push: a file added to the manifest only", _push(), "records extra.txt, which the job record does not",
         lambda c: ((c.out / "extra.txt").write_text("x"), _rehash(c, "extra.txt", job=False)), needs=OUT),
    Case("push: a side file dropped from manifest and record", _push(), "tokenizer.json: named by the side files",
         _drop("tokenizer.json"), needs=OUT),
    Case("push: config.json dropped from manifest and record", _push(), "config.json: named by the checkpoint",
         _drop("config.json"), needs=OUT),
    Case("push: the index dropped from manifest and record", _push(), "model.safetensors.index.json: named by",
         _drop("model.safetensors.index.json"), needs=OUT),
    Case("push: a shard dropped from manifest and record", _push(), SHARD, _drop(SHARD), needs=OUT),
    Case("push: auto_map code the manifest does not record", _push(), "modeling_evil.py: named by config.json",
         lambda c: ((c.out / "modeling_evil.py").write_text("x = 1\n"),
                    edit_json(c.out / "config.json", lambda d: d.update(auto_map={"AutoModel": "modeling_evil.M"})),
                    _rehash(c, "config.json")), needs=OUT),
    Case("push: the job record corrupt", _push(), "not a readable job record",
         lambda c: (c.out / JOB).write_text("{not json"), needs=OUT),
    Case("push: the job record's files not an object", _push(), "not a readable job record",
         lambda c: edit_json(c.out / JOB, lambda r: r.update(files=[1])), needs=OUT),
    Case("push: a manifest entry's bytes a string", _push(), "is not {sha256",
         _set_manifest(lambda m: m["files"]["config.json"].update(bytes="12")), needs=OUT),
    Case("push: a manifest entry a list", _push(), "is not {sha256",
         _set_manifest(lambda m: m["files"].update({"config.json": [1]})), needs=OUT),
    Case("push: a manifest naming ../x", _push(), "a path outside",
         _set_manifest(lambda m: m["files"].update({"../x": {"sha256": "0" * 64, "bytes": 1}})), needs=OUT),
    Case("card: a shard flipped and the manifest re-hashed", _card(), "another SHA-256 or size than the job record",
         lambda c: (_flip(c), _rehash(c, SHARD, job=False)), needs=OUT, inputs=_unlocked),
    # R12: README.md, --eval reports, config
    Case("card: a user README quoting the marker", _card(), "a card you wrote or edited",
         lambda c: (c.out / "README.md").write_text(f"# mine\n{MARKER} -->\n"), needs=OUT, inputs=_unlocked),
    Case("card: a generated card edited by hand", _card(), "never overwrites",
         _generated_then(lambda t: t + "\nmy notes\n"), needs=OUT, inputs=_unlocked),
    Case("card: a generated card with its marker removed", _card(), "never overwrites",
         _generated_then(lambda t: t.replace(MARKER, "")), needs=OUT, inputs=_unlocked),
    Case("card: README.md a folder", _card(), "never overwrites", lambda c: (c.out / "README.md").mkdir(), needs=OUT,
         inputs=_unlocked),
    Case("card: the card record corrupt", _card(), "card.json: not valid JSON",
         lambda c: (card(c.out), (c.out / ".quantize/card.json").write_text("{")),
         needs=OUT, inputs=_unlocked),
    Case("card: a stored report tampered", _card(), "reports[0]",
         lambda c: (_report(lambda ctx: _eval_report(ctx)[0])(c), card(c.out, eval=[c.tmp / "r.json"]),
                    edit_json(c.out / ".quantize/card.json",
                              lambda s: s["reports"][0]["report"]["tasks"]["gsm8k"].update(n="many"))),
         needs=OUT, inputs=_unlocked),
    Case("card: --eval a task's candidate a string", _card("--eval", "R"),
         "r.json: tasks.gsm8k.candidate is a string, not a finite number", _report(_task_value("candidate", "61.5")),
         needs=OUT, inputs=_unlocked),
    Case("card: --eval a task a list", _card("--eval", "R"), "r.json: task gsm8k is a list, not an object",
         _report(lambda c: _eval_report(c, tasks={"gsm8k": [1, 2]})[0]), needs=OUT, inputs=_unlocked),
    Case("card: --eval a task's n a float", _card("--eval", "R"), "tasks.gsm8k.n is a number, not a whole number",
         _report(_task_value("n", 2.5)), needs=OUT, inputs=_unlocked),
    Case("card: --eval a task's metric a list", _card("--eval", "R"), "tasks.gsm8k.metric is a list",
         _report(_task_value("metric", ["x"])), needs=OUT, inputs=_unlocked),
    Case("card: --eval a NaN delta", _card("--eval", "R"), "tasks.gsm8k.delta is nan, not a finite number",
         _report(lambda c: json.dumps(_eval_report(c)[0]).replace('"delta": -1.5', '"delta": NaN')), needs=OUT,
         inputs=_unlocked),
    Case("card: --eval a missing metric", _card("--eval", "R"), "tasks.gsm8k.metric is missing",
         _report(lambda c: (lambda r: (r[1].pop("metric"), r[0])[1])(_eval_report(c))), needs=OUT, inputs=_unlocked),
    Case("card: --eval too many tasks", _card("--eval", "R"), f"more than the {MAX_TASKS} a card lists",
         _report(lambda c: _eval_report(c, tasks={f"t{i}": _eval_report(c)[1] for i in range(5_000)})[0]),
         needs=OUT, inputs=_unlocked),
    Case("card: --eval a baseline too long", _card("--eval", "R"), f"more than {MAX_TEXT:,}",
         _report(lambda c: _eval_report(c, baseline="x" * (MAX_TEXT + 1))[0]), needs=OUT, inputs=_unlocked),
    Case("card: --eval a kld report with top-1 agreement -5", _card("--eval", "R"), "a fraction from 0 to 1",
         _report(lambda c: {"baseline": "b", "candidate": str(c.out), "kld_mean": 0.1, "top1_agreement": -5}),
         needs=OUT),
    Case("card: --eval a kld report with a negative KLD", _card("--eval", "R"), "a finite number, 0 or more",
         _report(lambda c: {"baseline": "b", "candidate": str(c.out), "kld_mean": -0.1, "top1_agreement": 0.9}),
         needs=OUT),
    Case("card: --eval a kld report with a string mean", _card("--eval", "R"), "kld_mean is a string",
         _report(lambda c: {"baseline": "b", "candidate": str(c.out), "kld_mean": "0.1", "top1_agreement": 0.9}),
         needs=OUT, inputs=_unlocked),
    Case("card: --eval a check report whose summary is a list", _card("--eval", "R"), "summary is a list",
         _report(lambda c: {"model": str(c.out), "verified": {}, "failures": [], "summary": []}), needs=OUT,
         inputs=_unlocked),
    Case("card: --eval a check report with a numeric failure", _card("--eval", "R"), "failures[0] is a number",
         _report(lambda c: {"model": str(c.out), "verified": {}, "failures": [1], "summary": {}}), needs=OUT,
         inputs=_unlocked),
    Case("card: --eval a JSON array", _card("--eval", "R"), "neither a `quantize eval --out` report",
         _report(lambda c: [1]), needs=OUT, inputs=_unlocked),
    Case("card: config.json num_hidden_layers null", _card(), "'num_hidden_layers' is null", _null_layers, needs=OUT,
         inputs=_unlocked),
    # --base-model: namespace/name, checked before anything is read or written
    *[Case(f"card: --base-model {b!r}", _card("--base-model", b), f"--base-model {b}: not a Hub repo id", needs=OUT)
      for b in ("GLM-5-FP8", "a/b/c", "org/bad--name", "org/.hidden")],
    Case("push: --base-model without a namespace", _push("--base-model", "GLM-5-FP8"),
         "--base-model GLM-5-FP8: not a Hub repo id", needs=OUT),
    Case("card: the card record's base_model not a repo id", _card(), "card.json: base_model is 'not a repo'",
         lambda c: (card(c.out), edit_json(c.out / ".quantize/card.json", lambda s: s.update(base_model="not a repo"))),
         needs=OUT, inputs=_unlocked),
    Case("card: the card record's base_model a number", _card(), "card.json: base_model is a number",
         lambda c: (card(c.out), edit_json(c.out / ".quantize/card.json", lambda s: s.update(base_model=7))),
         needs=OUT, inputs=_unlocked),
    # R14: --revision
    *[Case(f"push: --revision {r!r}", _push("--revision", r), "not a branch name", needs=OUT)
      for r in ("../main", "..", "/main", "main/", "a b", "a\x07b", "a\tb", "x.lock", ".hidden", "a//b", "a@{1}",
                "a~1", "-x")],
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hostile(case, tmp_path, hostile_sources):
    run_case(case, tmp_path, hostile_sources)


# -- R14: the endpoint's userinfo ------------------------------------------------------------

SECRET = "hf_InUrLsEcReT42"
TOKEN = "hf_SeCrEtToKeN123"


@pytest.fixture
def online(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    with serve(TOKEN) as (url, state):
        yield url, state


def test_a_token_in_the_endpoint_userinfo_is_never_echoed(online, tmp_path, hostile_sources):
    url, state = online
    host = url.split("://", 1)[1]
    case = Case("push: HF_ENDPOINT with a token in its userinfo",
                lambda c: ["push", c.out, "test-org/glm-int4"], "refused the token (401)",
                needs=OUT, inputs=lambda c: [c.out / SHARD, c.out / "config.json"],
                env={"HF_ENDPOINT": f"http://user:{SECRET}@{host}", "HF_TOKEN": "hf_wrongtoken"})
    line = run_case(case, tmp_path, hostile_sources)
    assert SECRET not in line and "user:" not in line and "***@" in line
    for p in (tmp_path / "out").rglob("*"):
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes(), p


def test_redact_every_url_userinfo():
    from quantize.publish.push import redact

    assert redact("at https://u:tok@h.example/api x") == "at https://***@h.example/api x"
    assert redact("HTTP://TOK@h/x and http://a:b@c/") == "HTTP://***@h/x and http://***@c/"
    assert redact("url https://h/x?a=b@c") == "url https://h/x?a=b@c"  # no userinfo: unchanged
    assert redact("token hf_abc%2Fdef in a message", "hf_abc%2Fdef") == "token *** in a message"
    assert redact("token hf_abc/def", "hf_abc%2Fdef") == "token ***"  # its decoded form too


# -- near misses: what must pass ---------------------------------------------------------------


@pytest.fixture
def out(hostile_sources, tmp_path):
    import shutil

    d = tmp_path / "out"
    shutil.copytree(hostile_sources["out"], d)
    return d


def _cli(*argv):
    from typer.testing import CliRunner

    from quantize.cli import app

    return CliRunner().invoke(app, [str(a) for a in argv])


def test_a_correct_manifest_pushes_and_card_then_push_passes(out):
    r = _cli("push", out, "test-org/glm-int4", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "README.md: would be generated" in r.stdout and "warning" not in r.stderr
    first = card(out)
    assert first.readme_was == "missing"
    job = json.loads((out / JOB).read_text())["files"]
    man = json.loads((out / MAN).read_text())["files"]
    assert job["README.md"] == man["README.md"] == _entry(out / "README.md")
    st = json.loads((out / ".quantize/card.json").read_text())
    assert st["readme_sha256"] == man["README.md"]["sha256"]
    again = card(out)  # a card generated here is regenerated on rerun
    assert again.readme_was == "ours"
    r = _cli("push", out, "test-org/glm-int4", "--dry-run", "--revision", "w4a16-g32")
    assert r.exit_code == 0, r.output
    assert "would be regenerated" in r.stdout
    for rev in ("refs/pr/1", "feature/w4a16.g32", "v1.0"):
        assert _cli("push", out, "test-org/glm-int4", "--dry-run", "--revision", rev).exit_code == 0, rev


def test_a_good_base_model_passes_where_a_near_miss_is_refused(out):
    r = _cli("card", out, "--base-model", "my-org/GLM-5.1_FP8-v2")
    assert r.exit_code == 0, r.output
    assert "base_model: my-org/GLM-5.1_FP8-v2" in (out / "README.md").read_text()
    r = _cli("push", out, "test-org/glm-int4", "--dry-run", "--base-model", "zai-org/GLM-5-FP8")
    assert r.exit_code == 0, r.output
    # without it, a local source's card says which flag names the base model (a note, exit 0)
    (out / "README.md").unlink()
    (out / ".quantize/card.json").unlink()
    r = _cli("card", out)
    assert r.exit_code == 0 and "note: base_model is not set" in r.stderr and "--base-model REPO" in r.stderr


def test_a_card_interrupted_after_recording_readme_is_still_ours(out):
    card(out)
    (out / ".quantize/card.json").write_text(json.dumps({"reports": []}))  # its SHA-256 not yet kept
    assert card(out).readme_was == "ours"


def test_a_folder_without_recorded_files_pushes_on_the_manifest_with_a_warning(out):
    edit_json(out / JOB, lambda r: r.pop("files"))
    r = _cli("push", out, "test-org/glm-int4", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "warning:" in r.stderr and "records no files" in r.stderr and "convert again" in r.stderr
    (out / JOB).unlink()
    r = _cli("push", out, "test-org/glm-int4", "--dry-run")
    assert r.exit_code == 0 and "warning:" in r.stderr and "missing" in r.stderr


def test_a_user_readme_quoting_the_marker_is_pushed_as_it_is(out):
    text = f"# mine\n{MARKER} -->\n"
    (out / "README.md").write_text(text)
    r = _cli("push", out, "test-org/glm-int4", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "the card you wrote (or edited), uploaded as it is" in r.stdout
    assert (out / "README.md").read_text() == text


def test_report_strings_are_escaped_and_bounds_are_inclusive(out, tmp_path):
    from huggingface_hub import ModelCard

    rep, t = _eval_report(type("C", (), {"out": out})())
    evil = "x\n# Injected heading\n---\nlicense: evil\n<script>alert(1)</script> [link](http://e) | cell"
    rep["baseline"] = evil
    t["verdict"] = evil
    t["metric"] = "exact_match"
    rep["tasks"] = {f"t{i}": dict(t) for i in range(MAX_TASKS - 1)} | {evil: dict(t)}  # exactly MAX_TASKS
    rep["candidate"] = str(out) + "/" + "y" * (MAX_TEXT - len(str(out)) - 1)  # exactly MAX_TEXT characters
    assert len(rep["candidate"]) == MAX_TEXT
    p = tmp_path / "evil.json"
    p.write_text(json.dumps(rep))
    text = card(out, eval=[p]).text
    lines = text.splitlines()
    assert not any(line.startswith(("# Injected", "license: evil")) for line in lines)
    body = text.split("\n---\n", 1)[1]  # the front matter is huggingface_hub's YAML: quoted, not rendered
    # in a code span it is shown literally (CommonMark renders no HTML there); elsewhere it is escaped
    assert "baseline `x # Injected heading --- license: evil <script>alert(1)</script>" in body
    prose = re.sub(r"`[^`]*`", "", body)
    assert "<script>" not in prose and "&lt;script&gt;" in prose and "\\[link\\]" in prose
    assert lines.count("---") == 3  # the front matter's two and the footer's rule
    data = ModelCard(text).data
    assert data.to_dict().get("license") is None and len(data.eval_results) == MAX_TASKS
    assert "| t0 | exact_match | 200 | 61.50 ± 3.44 | 60.00 ± 3.46 | -1.50 (-3.50, +0.50) |" in text
    # a task's optional values may be null
    t2 = dict(t, ci_low=None, ci_high=None, baseline_stderr=None, verdict=None)
    rep["tasks"] = {"gsm8k": t2}
    p.write_text(json.dumps(rep))
    assert "| gsm8k | exact_match | 200 | 61.50 ± 0.00 | 60.00 ± 3.46 | -1.50 |  |" in card(out, eval=[p]).text
