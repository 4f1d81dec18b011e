"""eval / eval-kld compare a candidate only with the model it was made from (quantize/evaluate/
provenance.py), and a smoke run of the gate says so everywhere (quantize/evaluate/smoke.py).

Provenance: a model's identity used to be its config and safetensors headers, so another model of
the same layout (``make-tiny --seed 1``) passed as the baseline of a conversion of seed 0. Now the
candidate's manifest records its source's weights (per file: size, header SHA-256, the SHA-256 the
source's records list, and the SHA-256 of sampled bytes), which must be the baseline's.

Smoke: a task scored on fewer than 100 documents (the card's rule, now shared) is never
"conclusive": 99 is smoke, 100 is not."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from quantize.checkpoint.manifest import (MANIFEST, SAMPLE_BYTES, SAMPLE_CHUNKS, lineage, same_weights,
                                          weights_identity)
from quantize.errors import QuantizeError
from quantize.evaluate.provenance import converted_from

NOT = "not converted from"


def _copy(src, dst, manifest=True) -> Path:
    shutil.copytree(src, dst)
    if not manifest:
        (dst / MANIFEST).unlink()
    return dst


def _refused(base, cand, match=NOT):
    with pytest.raises(QuantizeError, match=match) as e:
        converted_from(Path(base), Path(cand))
    assert "\n" not in str(e.value) and str(cand) in str(e.value)
    return str(e.value)


# -- the identity -----------------------------------------------------------------------------------


def test_weights_identity_by_hand(tiny, tmp_path):
    """Each entry computed here from the bytes: size, the header's SHA-256 (8-byte length + JSON), the
    SHA-256 make-tiny's manifest lists (the whole file), and 16 chunks of 64 KiB at evenly spaced
    offsets (the first at 0, the last ending at the file's end) hashed after the size."""
    src = tiny("glm_moe_dsa")
    ident = weights_identity(src)
    files = sorted(p.name for p in src.glob("*.safetensors"))
    assert sorted(ident) == files and len(files) == 3
    listed = json.loads((src / MANIFEST).read_text())["files"]
    for f in files:
        raw = (src / f).read_bytes()
        size = len(raw)
        assert size > SAMPLE_CHUNKS * SAMPLE_BYTES == 16 * 65536  # sampled, not read whole
        n = int.from_bytes(raw[:8], "little")
        h = hashlib.sha256(str(size).encode())
        for i in range(16):
            off = (i * (size - 65536)) // 15
            h.update(raw[off: off + 65536])
        assert ident[f] == {"bytes": size, "header_sha256": hashlib.sha256(raw[: 8 + n]).hexdigest(),
                            "sample_sha256": h.hexdigest(), "sha256": hashlib.sha256(raw).hexdigest()}
        assert listed[f]["sha256"] == ident[f]["sha256"]
    # a copy without the manifest lists nothing, the rest is the same; a Hub download's etag is listed
    bare = _copy(src, tmp_path / "bare", manifest=False)
    assert weights_identity(bare) == {f: {k: v for k, v in e.items() if k != "sha256"} for f, e in ident.items()}
    meta = bare / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    for f in files:
        (meta / f"{f}.metadata").write_text(f"0123abcd\n{ident[f]['sha256']}\n1700000000.0\n")
    assert weights_identity(bare) == ident
    # a file smaller than 16 chunks is hashed whole
    small = tmp_path / "small"
    small.mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.arange(8, dtype=torch.float32)}, str(small / "model.safetensors"))
    raw = (small / "model.safetensors").read_bytes()
    assert weights_identity(small)["model.safetensors"]["sample_sha256"] == hashlib.sha256(
        str(len(raw)).encode() + raw).hexdigest()


def test_another_seed_is_another_model_whatever_is_listed(tiny, converted, tmp_path):
    """make-tiny --seed 1 has seed 0's config, headers and tokenizer (its model_identity used to be
    equal) but other weights: refused as the baseline of seed 0's conversion, with the manifests'
    listed SHA-256s and without them (the sampled bytes alone); and as a candidate of seed 0."""
    from quantize.evaluate.kld import model_identity

    src, out, other = tiny("glm_moe_dsa"), converted("glm_moe_dsa"), tiny("glm_moe_dsa", seed=1)
    a, b = model_identity(src), model_identity(other)
    assert {k: v for k, v in a.items() if k != "weights"} == {k: v for k, v in b.items() if k != "weights"}
    assert same_weights(a["weights"], b["weights"]) == "model-00001-of-00003.safetensors"
    msg = _refused(other, out)
    assert str(other) in msg and "records a source with other weights" in msg
    bare_src, bare_other = _copy(src, tmp_path / "s", False), _copy(other, tmp_path / "o", False)
    converted_from(bare_src, out)  # the near miss: seed 0 without its manifest is still the source
    _refused(bare_other, out)
    msg = _refused(src, other)
    assert "no quantize_manifest.json of it records its source" in msg


# -- what must still work ---------------------------------------------------------------------------


def test_the_legitimate_pairs_are_proven(tiny, converted, tmp_path):
    """The baseline itself (the same folder, or a copy), an FP8 release against its INT4 conversion,
    BF16 against its FP8 conversion and against the INT4 conversion of that (through the recorded
    lineage), and Kimi's INT4 passthrough against the release, also after calibrate-kv --fold."""
    from quantize.calibrate.kv import calibrate_kv
    from quantize.convert import convert

    src = tiny("glm_moe_dsa")
    converted_from(src, src)
    converted_from(src, _copy(src, tmp_path / "copy"))
    converted_from(src, converted("glm_moe_dsa"))  # FP8 block release -> INT4
    bf16 = tiny("llama", layout="bf16")
    fp8, int4 = tmp_path / "fp8", tmp_path / "int4"
    convert(bf16, fp8, scheme="fp8-block", profile="all-linear")
    convert(fp8, int4, profile="all-linear")
    converted_from(bf16, fp8)
    converted_from(fp8, int4)  # its direct source
    converted_from(bf16, int4)  # its source's source, recorded with it
    assert len(lineage(int4)) == 2 and lineage(bf16) == []
    kimi, passthrough = tiny("kimi_k25"), converted("kimi_k25")
    converted_from(kimi, passthrough)
    folded = tmp_path / "folded"
    calibrate_kv(passthrough, folded, fold=True, samples=2, seq_len=16)
    converted_from(kimi, folded)  # calibrate-kv records its source as convert does
    converted_from(passthrough, folded)
    _refused(tiny("kimi_k25", seed=1), folded)


def test_a_hub_download_is_known_by_its_etags_and_a_stale_record_is_not_trusted(tiny, tmp_path):
    """A source downloaded from the Hub (no manifest; ``hf download --local-dir`` records each file's
    etag, its LFS SHA-256) converted: its copy without the .cache folder is still proven (sampled
    bytes); a baseline changed after the conversion is refused although its stale record lists the
    old SHA-256 (the sampled bytes differ); a manifest from before this check says so."""
    from quantize.convert import convert

    hub = _copy(tiny("glm_moe_dsa"), tmp_path / "hub", manifest=False)
    meta = hub / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    for p in hub.glob("*.safetensors"):
        (meta / f"{p.name}.metadata").write_text(f"0123abcd\n{hashlib.sha256(p.read_bytes()).hexdigest()}\n1.0\n")
    out = tmp_path / "out"
    convert(hub, out)
    rec = json.loads((out / MANIFEST).read_text())["source"]["files"]
    assert all(e["sha256"] == e["hub_etag"] and e["sample_sha256"] for e in rec.values())
    converted_from(hub, out)
    converted_from(_copy(hub, tmp_path / "nocache", manifest=True), out)
    shutil.rmtree(tmp_path / "nocache" / ".cache")
    converted_from(tmp_path / "nocache", out)
    changed = _copy(hub, tmp_path / "changed")
    f = changed / "model-00002-of-00003.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1000:] = bytes(1000)  # the last chunk: inside the sampled bytes; the etag still lists the old file
    f.write_bytes(bytes(raw))
    assert "model-00002-of-00003.safetensors differs" in _refused(changed, out)
    old = _copy(out, tmp_path / "old")
    doc = json.loads((old / MANIFEST).read_text())
    for e in doc["source"]["files"].values():
        e.pop("sample_sha256")
    (old / MANIFEST).write_text(json.dumps(doc))
    assert "written by an older quantize" in _refused(hub, old)


def test_a_saved_baseline_carries_the_weights_and_is_checked_the_same_way(tiny, converted, tmp_path):
    """eval-kld --save-baseline records the baseline's weights; --baseline-logits alone then accepts
    the conversion of that baseline and refuses a candidate of another; eval's --baseline-results
    identity holds them too, so a results file saved from seed 1 is refused for seed 0."""
    from quantize.evaluate.kld import kld, model_identity
    from quantize.evaluate.run import _saved_baseline

    src, out, other = tiny("glm_moe_dsa"), converted("glm_moe_dsa"), tiny("glm_moe_dsa", seed=1)
    b = tmp_path / "b.st"
    kld(src, out, tokens=24, chunk=8, save_baseline=b)
    kld(None, out, tokens=24, chunk=8, baseline_logits=b)  # the near miss: its own conversion
    b1 = tmp_path / "b1.st"
    kld(other, other, tokens=24, chunk=8, save_baseline=b1)  # a model against itself: allowed
    with pytest.raises(QuantizeError, match=f"--candidate {out}: {NOT} the model --baseline-logits {b1} was saved"):
        kld(None, out, tokens=24, chunk=8, baseline_logits=b1)
    with pytest.raises(QuantizeError, match=r"saved from another model than --baseline .* \(weights differs\)"):
        kld(src, src, tokens=24, chunk=8, baseline_logits=b1)
    ident = {"model": model_identity(src), "tasks": ["arc_easy"], "limit": 1, "max_gen_toks": None,
             "data": {}, "chat": False, "thinking": None}
    for model, match in ((other, "made for another baseline model"), (src, "made for other tasks")):
        f = tmp_path / f"{model.name}.json"
        f.write_text(json.dumps({"written_by": {"kind": "eval-baseline"}, "samples": {},
                                 "identity": {**ident, "model": model_identity(model), "tasks": ["x"]}}))
        with pytest.raises(QuantizeError, match=match):
            _saved_baseline(f, ident)


# -- smoke ------------------------------------------------------------------------------------------


def test_smoke_is_below_the_cards_rule_99_is_smoke_100_is_not():
    from quantize.evaluate.run import EvalReport, TaskResult
    from quantize.evaluate.smoke import SMOKE_ITEMS
    from quantize.publish import card

    assert SMOKE_ITEMS == 100 and card.SMOKE_ITEMS is SMOKE_ITEMS  # one rule, the card's
    # both CIs lie above -1 point: the 100-document task passes conclusively, the 99-document one is smoke
    t99 = TaskResult("gsm8k", "exact_match", 99, 61.0, 4.9, 61.0, 4.9, 0.0, -0.5, 0.5, True, True)
    t100 = TaskResult("arc_easy", "acc", 100, 52.0, 5.0, 52.0, 5.0, 0.0, -0.5, 0.5, True, True)
    assert (t99.smoke, t99.conclusive, t100.smoke, t100.conclusive) == (True, False, False, True)
    assert t99.verdict == "pass (smoke: 99 items, below the 100 a gate needs)" and t100.verdict == "pass"
    fail = TaskResult("gsm8k", "exact_match", 8, 100.0, 0.0, 0.0, 0.0, -100.0, -100.0, -100.0, False, False)
    assert fail.verdict == "FAIL" and fail.smoke
    rep = EvalReport("b", "c", None, 1.0, [t99, t100])
    d = rep.to_dict()
    assert d["smoke"] is True and d["passed"] is True
    assert d["tasks"]["gsm8k"]["smoke"] is True and d["tasks"]["gsm8k"]["conclusive"] is False
    assert d["tasks"]["arc_easy"]["smoke"] is False and d["tasks"]["arc_easy"]["conclusive"] is True
    md = rep.markdown()
    assert "| pass (smoke: 99 items, below the 100 a gate needs) |" in md and "| arc_easy |" in md
    assert "Smoke test: gsm8k (99) scored on fewer than 100 documents" in md and "conclusiv" not in md
    only100 = EvalReport("b", "c", None, 1.0, [t100])
    assert only100.to_dict()["smoke"] is False and "Smoke" not in only100.markdown()


def _fake_eval(tmp_path, monkeypatch, n: int) -> None:
    """Two model folders with the same weights (a model and its copy) and lm-eval's per-sample results
    for n ARC documents, every one scored 1 by both (as tests/test_bounds.py does for the gate)."""
    import lm_eval.tasks
    from types import SimpleNamespace

    from safetensors.torch import save_file

    import quantize.evaluate.run as run

    def fake(path, *a, **kw):
        return {"samples": {"arc_easy": [{"doc_id": i, "filter": "none", "acc": 1.0} for i in range(n)]}}

    monkeypatch.setattr(run, "_run_model", fake)
    monkeypatch.setattr(run, "_read_tasks", lambda configs: None)
    yaml = SimpleNamespace(yaml_path=str(Path(lm_eval.__file__).parent / "tasks/arc/arc_easy.yaml"), kind="TASK")
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: SimpleNamespace(task_index={"arc_easy": yaml}))
    for m in ("base", "cand"):
        (tmp_path / m).mkdir()
        (tmp_path / m / "config.json").write_text("{}")
        (tmp_path / m / "tokenizer_config.json").write_text("{}")
        save_file({"w": torch.zeros(4)}, str(tmp_path / m / "model.safetensors"))
    (tmp_path / "data" / "arc").mkdir(parents=True)
    (tmp_path / "data" / "arc" / "arc_easy.jsonl").write_text(
        json.dumps({"query": "Question: 1 + 1?", "choices": ["1", "2"], "gold": 1}) + "\n")


@pytest.mark.parametrize("n", [99, 100])
def test_smoke_through_the_command_line_and_its_reports(n, tmp_path, monkeypatch):
    """`quantize eval` on n paired documents (each model's lm-eval results made here, both alike):
    eval.json, eval.md, the table and the verdict line say smoke at 99 and not at 100."""
    pytest.importorskip("lm_eval")
    from typer.testing import CliRunner

    import quantize.evaluate.run as run
    from quantize.cli import app

    _fake_eval(tmp_path, monkeypatch, n)
    argv = ["eval", "--baseline", tmp_path / "base", "--candidate", tmp_path / "cand", "--tasks", "arc_easy",
            "--data-dir", tmp_path / "data", "--out", tmp_path / "eval.json", "--markdown", tmp_path / "eval.md"]
    # wide enough for the table's rows on one line each, whatever the length of pytest's temporary folder (a wrapped
    # cell would fail the first check and pass the second vacuously)
    res = CliRunner().invoke(app, [str(a) for a in argv], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    t = json.loads((tmp_path / "eval.json").read_text())["tasks"]["arc_easy"]
    md = (tmp_path / "eval.md").read_text()
    last = res.stdout.strip().splitlines()[-1]
    assert t["n"] == n and t["ci_low"] == t["ci_high"] == 0.0 and run.SMOKE_ITEMS == 100
    if n == 99:
        assert t["smoke"] is True and t["conclusive"] is False
        assert t["verdict"] == "pass (smoke: 99 items, below the 100 a gate needs)"
        assert "| pass (smoke: 99 items, below the 100 a gate needs) |" in md and "Smoke test: arc_easy (99)" in md
        assert "pass, smoke" in res.stdout
        assert last.startswith("pass (smoke: 99 items, below the 100 a gate needs): 1 task(s)")
    else:
        assert t["smoke"] is False and t["conclusive"] is True and t["verdict"] == "pass"
        assert "(smoke:" not in md and "Smoke test" not in md
        assert "pass, smoke" not in res.stdout and "(smoke:" not in res.stdout
        assert last.startswith("pass: 1 task(s)")


def test_quantize_run_says_smoke_in_its_table_and_verdict_line(tmp_path):
    """`quantize run` with a 2-document eval (the default recipe's kind of run): the eval stage's row
    and the run's last line say smoke; the report it wrote is not conclusive."""
    pytest.importorskip("lm_eval")
    from typer.testing import CliRunner

    from quantize.cli import app

    from .test_pipeline import _arc, _recipe

    r = _recipe(tmp_path, data_dir=str(_arc(tmp_path / "data")), limit=2, stages=["convert", "eval"])
    res = CliRunner().invoke(app, ["run", r])
    assert res.exit_code == 0, res.output[-3000:]
    doc = json.loads((tmp_path / "run" / "reports" / "eval.json").read_text())
    assert doc["smoke"] is True and doc["tasks"]["arc_easy"]["conclusive"] is False
    table = res.stdout.replace("\n", " ")
    assert "pass (smoke: 2 items," in " ".join(table.split()), res.stdout  # the eval row (the table may wrap)
    last = res.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("quantize run passed (eval: a smoke test) in "), last
