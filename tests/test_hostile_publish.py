"""Hostile input, card and push: a manifest is checked against the job record (not trusted), a
README.md the tool did not write is never overwritten, --eval reports are checked key by key,
bounded and escaped, the endpoint's userinfo is never echoed and --revision is a branch name.
Each refusal is one line (tests/hostile.py); beside the table, the near misses that must pass."""

import hashlib
import json
import re

import pytest

from quantize.checkpoint.output import signed_json
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


def _signed(make, kind="eval", edit=None):
    """Write ``make(ctx)`` to ctx.tmp / r.json as quantize's report writer does (``signed_json``:
    ``written_by`` holds the SHA-256 of the rest); ``edit`` then changes the document by hand."""
    def setup(ctx):
        doc = json.loads(signed_json(make(ctx), kind))
        if edit is not None:
            edit(doc)
        (ctx.tmp / "r.json").write_text(json.dumps(doc))

    return setup


def _plant_report(ctx):
    """A report inside the folder, naming the folder by its absolute path, recorded in the manifest
    and the job record alike (so it is proven, and would be uploaded)."""
    (ctx.out / "reports").mkdir()
    (ctx.out / "reports" / "eval.json").write_text(signed_json(_eval_report(ctx)[0], "eval"))
    _rehash(ctx, "reports/eval.json")


def _edit_file(rel, fn):
    """``fn`` applied to a JSON file of the folder (or, for another file, to its text), then the
    manifest and the job record re-hashed to match: every SHA-256 agrees."""
    def setup(ctx):
        p = ctx.out / rel
        if rel.endswith(".json"):
            edit_json(p, fn)
        else:
            p.write_text(fn(p.read_text()))
        _rehash(ctx, rel)

    return setup


def _group_size(cfg):
    w = cfg["quantization_config"]["config_groups"]["config_group_0"]["weights"]
    w["group_size"] *= 2


NOT_ME = {"HOME": "/home/qtest-user", "LOGNAME": "qtest-user", "USER": "qtest-user"}


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
         lambda c: (_signed(lambda ctx: _eval_report(ctx)[0])(c), card(c.out, eval=[c.tmp / "r.json"]),
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
    # only the reports quantize wrote, unedited (written_by: the SHA-256 of the rest of the document)
    Case("card: --eval an eval report written by hand", _card("--eval", "R"),
         "r.json: carries no `written_by`", _report(lambda c: _eval_report(c)[0]), needs=OUT, inputs=_unlocked),
    Case("card: --eval a kld report written by hand", _card("--eval", "R"), "r.json: carries no `written_by`",
         _report(lambda c: {"baseline": "b", "candidate": str(c.out), "kld_mean": 0.1, "top1_agreement": 0.9}),
         needs=OUT, inputs=_unlocked),
    Case("card: --eval a check report written by hand", _card("--eval", "R"), "r.json: carries no `written_by`",
         _report(lambda c: {"model": str(c.out), "verified": {}, "failures": [], "summary": {}}),
         needs=OUT, inputs=_unlocked),
    Case("card: --eval a signed report edited since", _card("--eval", "R"), "r.json: edited since quantize wrote it",
         _signed(lambda c: _eval_report(c)[0], edit=lambda d: d["tasks"]["gsm8k"].update(candidate=61.5)),
         needs=OUT, inputs=_unlocked),
    Case("card: --eval an eval report signed as a kld report", _card("--eval", "R"),
         "its `written_by` names quantize kld, not quantize eval", _signed(lambda c: _eval_report(c)[0], "kld"),
         needs=OUT, inputs=_unlocked),
    Case("card: --eval an eval report whose written_by names another tool", _card("--eval", "R"),
         "names lm-eval eval, not quantize eval",
         _signed(lambda c: _eval_report(c)[0], edit=lambda d: d["written_by"].update(tool="lm-eval")),
         needs=OUT, inputs=_unlocked),
    # push: nothing that names this machine goes up (quantize/publish/privacy.py)
    Case("push: a report naming the folder planted and recorded", _push(),
         "reports/eval.json: holds the output folder's path", _plant_report, needs=OUT),
    Case("push: an older manifest recording the source's path", _push(),
         "quantize_manifest.json: holds the source's path (/data/models/GLM-5-FP8)",
         _set_manifest(lambda m: m["source"].update(path="/data/models/GLM-5-FP8")), needs=OUT),
    Case("push: an older manifest recording an absolute command line", _push(),
         "quantize_manifest.json: holds an absolute path (/data/x/src)",
         _set_manifest(lambda m: m.update(command="quantize convert /data/x/src out")), needs=OUT),
    Case("push: config.json's _name_or_path a local folder", _push(),
         "config.json: holds an absolute path (/srv/ckpt/GLM-5-FP8)",
         _edit_file("config.json", lambda c: c.update(_name_or_path="/srv/ckpt/GLM-5-FP8")), needs=OUT),
    Case("push: a side file holding a path in the home folder", _push(),
         "tokenizer_config.json: holds a path in your home folder (/home/qtest-user/.cache/hf)",
         _edit_file("tokenizer_config.json", lambda t: t.update(cache_dir="/home/qtest-user/.cache/hf")),
         needs=OUT, env=NOT_ME),
    Case("push: a chat template naming the user's home folder", _push(),
         "chat_template.jinja: holds your user's home folder (/Users/qtest-user/work)",
         _edit_file("chat_template.jinja", lambda t: t + "{# made in /Users/qtest-user/work #}\n"),
         needs=OUT, env=NOT_ME),
    # push proves config.json against the tensors as check does, though every SHA-256 was re-hashed to agree
    Case("push: config.json's group size contradicting the tensors, re-hashed", _push(),
         "config_group_0.weights.group_size is", _edit_file("config.json", _group_size), needs=OUT),
    Case("push: config.json ignoring the INT4 experts, re-hashed", _push(), "unquantized (ignored",
         _edit_file("config.json", lambda c: c["quantization_config"]["ignore"].append("re:.*experts.*")),
         needs=OUT),
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
    p.write_text(signed_json(rep, "eval"))
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
    p.write_text(signed_json(rep, "eval"))
    assert "| gsm8k | exact_match | 200 | 61.50 ± 0.00 | 60.00 ± 3.46 | -1.50 |  |" in card(out, eval=[p]).text


# -- this machine's names: the host name, and the near misses scan must let through ---------------


def test_the_host_name_is_refused_where_it_names_a_host(monkeypatch, tmp_path, hostile_sources):
    """The host name (4 characters or more) as a word in a file quantize writes, or naming a host
    (``//host``, ``@host``, ``host:port``) in any file, is refused; as a word in the source's files (a
    vocabulary may hold any word), and a host name too short to be one, are not."""
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-17.example.org")
    refused = [
        ("config.json", lambda c: c.update(comment="converted on gpu-node-17"), "config.json: holds this machine's "
         "host name (gpu-node-17)"),
        ("tokenizer_config.json", lambda t: t.update(url="http://gpu-node-17:8000/v1"),
         "tokenizer_config.json: holds this machine's host name (gpu-node-17"),
        ("tokenizer_config.json", lambda t: t.update(remote="me@GPU-NODE-17.example.org"), "(GPU-NODE-17.example.org"),
    ]
    for i, (rel, fn, expect) in enumerate(refused):
        run_case(Case(f"push: host name in {rel} ({i})", _push(), expect, _edit_file(rel, fn), needs=OUT),
                 tmp_path / f"r{i}", hostile_sources)
    passed = [("tokenizer_config.json", lambda t: t.update(note="gpu-node-17 gpu-node-170 my-gpu-node-17")),
              ("config.json", lambda c: c.update(comment="gpu-node-170 and gpu-node-17a"))]
    for i, (rel, fn) in enumerate(passed):
        assert _pushed_dry(tmp_path / f"p{i}", hostile_sources, _edit_file(rel, fn)), rel
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")  # trivially short: a word of any text
    assert _pushed_dry(tmp_path / "short", hostile_sources,
                       _edit_file("config.json", lambda c: c.update(comment="vm http://vm:8000")))


def _pushed_dry(tmp, sources, setup) -> bool:
    """A fresh copy of the converted folder, ``setup`` applied, passes `push --dry-run`."""
    from tests.hostile import Ctx

    tmp.mkdir()
    ctx = Ctx(tmp, sources, OUT)
    setup(ctx)
    r = _cli("push", ctx.out, "test-org/glm-int4", "--dry-run")
    return r.exit_code == 0 or print(r.output)


@pytest.mark.parametrize("text, refused", [
    ("/home/qtest-user/.cache/x", "a path in your home folder"),
    ("see /home/qtest-user", "your user's home folder"),
    ("C:\\\\Users\\\\qtest-user\\\\x", "your user's home folder"),
    ("FOLDER/weights", "the output folder's path"),
    ("PARENT/other-model", "the path of the folder it is in"),
    # near misses: not this machine
    ("/home/qtest-userx/a /home/qtest-user-b", None),
    ("qtest-user wrote it; /homes/qtest-user", None),
    ("in FOLDER.", "the output folder's path"),
    ("PARENT2/x PARENT.bak/y", None),
    ("/tmp/x and /data and https://huggingface.co/org/name and 1/iters and </think>", None),
])
def test_scan_matches_this_machine_as_paths_not_as_words(text, refused, tmp_path, monkeypatch):
    """``privacy.scan`` on a file quantize did not write (a source's file): only this machine's
    paths are refused, by role; the same names inside other words or paths pass."""
    from quantize.errors import QuantizeError
    from quantize.publish.privacy import scan

    monkeypatch.setenv("HOME", "/home/qtest-user")
    monkeypatch.setenv("LOGNAME", "qtest-user")
    folder = tmp_path / "deep" / "model"
    folder.mkdir(parents=True)
    text = text.replace("FOLDER", str(folder)).replace("PARENT", str(folder.parent))
    (folder / "notes.txt").write_text(text)
    if refused is None:
        scan(folder, ["notes.txt"])
        return
    with pytest.raises(QuantizeError, match=re.escape(f"notes.txt: holds {refused}")) as e:
        scan(folder, ["notes.txt"])
    assert "\n" not in str(e.value) and "nothing was pushed" in str(e.value)


def test_a_file_quantize_writes_holds_no_absolute_path_where_a_source_file_may(tmp_path):
    """Any absolute path in the manifest (or config.json, the index, a generated card) is refused;
    in a source's file or a card the user wrote, only this machine's are."""
    from quantize.errors import QuantizeError
    from quantize.publish.privacy import scan

    folder = tmp_path / "m"
    folder.mkdir()
    doc = json.dumps({"note": "download to /models/GLM-5-FP8", "url": "https://huggingface.co/a/b", "r": "1/iters"})
    for name in ("quantize_manifest.json", "config.json", "README.md"):
        with pytest.raises(QuantizeError, match=re.escape(f"{name}: holds an absolute path (/models/GLM-5-FP8)")):
            scan(folder, [name], {name: doc})
    scan(folder, ["tokenizer_config.json", "README.md"], {"tokenizer_config.json": doc, "README.md": doc},
         generated_card=False)
    ok = json.dumps({"url": "https://huggingface.co/a/b", "r": "1/iters", "ignore": ["re:.*mlp\\.(gate|up)_proj.*"],
                     "tag": "</think>", "repo": "org/name", "rel": "reports/eval.json"})
    scan(folder, ["quantize_manifest.json"], {"quantize_manifest.json": ok})


def test_a_manifest_names_paths_relative_or_by_role(tmp_path, monkeypatch):
    """What write_manifest and command_line record instead of a path: inside the output its path
    there, a Hub cache snapshot org/name@rev, anything else its last component; Hub ids, URLs and
    ratios as they are."""
    import sys

    from quantize.checkpoint.manifest import command_line, public, shown_path

    out = tmp_path / "run" / "model"
    snap = "/h/.cache/huggingface/hub/models--zai-org--GLM-5-FP8/snapshots/0123456789abcdef0123"
    assert shown_path(str(out), out) == "model" and shown_path(str(out / "a" / "b.json"), out) == "a/b.json"
    assert shown_path(snap) == "zai-org/GLM-5-FP8@0123456789ab"
    assert shown_path(snap + "/config.json") == "zai-org/GLM-5-FP8@0123456789ab/config.json"
    assert public({"k": ["/usr/bin/cc", "-I/usr/include/py", "--out=/a/b"], "n": 3}) == {"k": ["cc", "-Ipy", "--out=b"],
                                                                                      "n": 3}
    kept = "zai-org/GLM-5-FP8 https://huggingface.co/a/b lr 1/iters re:.*mlp\\.(gate|up)_proj.* </think> w/o"
    assert public(kept) == kept
    assert public("wrote /tmp/x/kv.json. done") == "wrote kv.json. done"
    monkeypatch.setattr(sys, "argv", ["/venv/bin/quantize", "convert", "/m/src dir", "../../home/u/out", "run/out",
                                      "--base-model", "org/name", "--data=/d/c.jsonl", "--set", "p.source=/s/x"])
    assert command_line() == ("quantize convert 'src dir' out run/out --base-model org/name --data=c.jsonl "
                              "--set p.source=x")


def test_the_card_takes_the_report_kinds_their_writers_sign():
    """The oracle: each writer's own kind (evaluate/run.py, evaluate/kld.py, calibrate/kv.py, check.py)."""
    from quantize.calibrate.kv import STATS_KIND
    from quantize.check import REPORT_KIND as CHECK_KIND
    from quantize.evaluate.kld import REPORT_KIND as KLD_KIND
    from quantize.evaluate.run import REPORT_KIND
    from quantize.publish.card import SIGNED_BY

    assert {k: v[0] for k, v in SIGNED_BY.items()} == {"eval": REPORT_KIND, "kld": KLD_KIND, "kv": STATS_KIND,
                                                      "check": CHECK_KIND}
