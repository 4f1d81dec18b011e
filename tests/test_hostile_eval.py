"""Hostile input, the evaluation commands (eval, eval-kld, eval-pd): what they write goes through the
output rules (never into an input, never over a file this tool did not write, a folder is one line);
a saved baseline is refused unless it is this run's (model, tokenizer, text, --tokens, --chunk, every
chunk, finite values); models of another kind or tokenizer are refused before work; a non-finite
KLD never passes; numeric options are refused at their declaration."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.hostile import Case, edit_json, run_case

@pytest.fixture(autouse=True)
def _quiet_progress_bars(monkeypatch):
    """transformers' and compressed-tensors' own progress bars (tqdm, on stderr) while a model loads
    are not error output; the cases whose refusal comes after a load (a NaN found while scoring) would
    otherwise see them beside the one error line."""
    import tqdm.std

    init = tqdm.std.tqdm.__init__

    def quiet(self, *a, **kw):
        kw["disable"] = True
        init(self, *a, **kw)

    monkeypatch.setattr(tqdm.std.tqdm, "__init__", quiet)


T, C = ["--tokens", "24"], ["--chunk", "8"]  # 3 chunks of the shipped text: fast on the tiny models
_SAVED: dict[str, Path] = {}


def _saved_baseline(ctx) -> Path:
    """A baseline saved by `eval-kld --save-baseline` from src (made once, copied per case); every
    copy of src has the same identity (same config.json, weights' headers, tokenizer files)."""
    if "b" not in _SAVED:
        from quantize.evaluate.kld import kld

        d = Path(tempfile.mkdtemp(prefix="hostile-kld-"))
        kld(ctx.src, ctx.out, tokens=24, chunk=8, save_baseline=d / "b.st")
        _SAVED["b"] = d / "b.st"
    dst = ctx.tmp / "b.st"
    shutil.copy(_SAVED["b"], dst)
    return dst


def _rewrite_baseline(fn):
    """A saved baseline, its tensors and metadata changed by ``fn(tensors, meta)``."""

    def setup(ctx):
        p = _saved_baseline(ctx)
        with safe_open(p, "pt") as f:
            t, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
        fn(t, meta)
        save_file(t, str(p), metadata=meta)

    return setup


def _nan_chunk(t, meta):
    t["chunk.1"][0, 0] = float("nan")


def _drop_chunk(t, meta):
    del t["chunk.2"]


def _old_format(t, meta):
    meta.pop("identity")


def _with_baseline(ctx):
    _saved_baseline(ctx)


def _other_tokenizer(where="out"):
    """The model's tokenizer with two tokens' ids swapped: another tokenizer of the same size (as a
    DeepSeek-V3/Kimi tokenizer is another than GLM-5's)."""

    def setup(ctx):
        def swap(tok):
            v = tok["model"]["vocab"]
            a, b = sorted(v)[10], sorted(v)[20]
            v[a], v[b] = v[b], v[a]

        edit_json(getattr(ctx, where) / "tokenizer.json", swap)

    return setup


def _nan_head(where):
    """lm_head.weight of the copy ``where`` set to NaN: a model whose log-probabilities are NaN."""

    def setup(ctx):
        folder = getattr(ctx, where)
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, "pt") as fh:
                if "lm_head.weight" not in fh.keys():
                    continue
                t, meta = {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()
            t["lm_head.weight"] = torch.full_like(t["lm_head.weight"], float("nan"))
            save_file(t, str(f), metadata=meta)
            return
        raise AssertionError("no lm_head.weight")

    return setup


def _text(data: bytes):
    def setup(ctx):
        (ctx.tmp / "t.txt").write_bytes(data)

    return setup


def _foreign(name: str, text: str = '{"mine": true}'):
    def setup(ctx):
        (ctx.tmp / name).write_text(text)

    return setup


def _edit_config(ctx):
    edit_json(ctx.src / "config.json", lambda d: d.update(initializer_range=0.5))


def _kld(*more):
    return lambda c: ["eval-kld", "--baseline", c.src, "--candidate", c.out, *T, *C, *[m(c) if callable(m) else m
                                                                                        for m in more]]


def _reuse(*more, candidate="out"):
    return lambda c: ["eval-kld", "--candidate", getattr(c, candidate), "--baseline-logits", c.tmp / "b.st",
                      *[m(c) if callable(m) else m for m in more]]


def _eval(*more, candidate="out"):
    return lambda c: ["eval", "--baseline", c.src, "--candidate", getattr(c, candidate), "--tasks", "arc_easy",
                      *[m(c) if callable(m) else m for m in more]]


def _pd(*more, decode="out"):
    return lambda c: ["eval-pd", "--prefill-model", c.src, "--decode-model", getattr(c, decode), "--source", c.src,
                      "--prompt-tokens", "8", "--decode-tokens", "4", *[m(c) if callable(m) else m for m in more]]


IN = "lies inside the input"
SO = ("src", "out")
S1 = ("seed1", "out")  # make-tiny --seed 1 beside seed 0's conversion


def _prefill_copy(ctx):
    """The PD pair's prefill model: a copy of the source (an FP8 release in the prefill pool)."""
    shutil.copytree(ctx.src, ctx.tmp / "pfx")


def _seed1_baseline(ctx):
    """A baseline saved by `eval-kld --save-baseline` from make-tiny --seed 1 (against itself)."""
    if "b1" not in _SAVED:
        from quantize.evaluate.kld import kld

        d = Path(tempfile.mkdtemp(prefix="hostile-kld1-"))
        kld(ctx.seed1, ctx.seed1, tokens=24, chunk=8, save_baseline=d / "b1.st")
        _SAVED["b1"] = d / "b1.st"
    shutil.copy(_SAVED["b1"], ctx.tmp / "b1.st")


def _results_of(where):
    """An `eval --save-baseline` file whose identity is the model ``where``'s (its other fields this
    run's, as far as the model check reads): saved from seed 1, it was equal to seed 0's identity."""

    def setup(ctx):
        from quantize.evaluate.kld import model_identity

        doc = {"written_by": {"tool": "quantize", "kind": "eval-baseline"}, "samples": {},
               "identity": {"model": model_identity(getattr(ctx, where))}}
        (ctx.tmp / "base.json").write_text(json.dumps(doc))

    return setup


def _fake_python(ctx):
    """An interpreter that answers vLLM's version probe: the served path's checks run, no engine starts."""
    p = ctx.tmp / "python"
    p.write_text('#!/bin/sh\ncase "$1" in -c) echo "0.32.0"; exit 0;; esac\nexit 1\n')
    p.chmod(0o755)
CASES = [
    Case("kld: --chunk past max_position_embeddings",
         lambda c: ["eval-kld", "--baseline", c.src, "--candidate", c.out, "--tokens", "1024", "--chunk", "600"],
         "longer than the candidate's max_position_embeddings 512", needs=SO),
    # the KL / flip gate's bounds (issue 37)
    Case("kld: --max-flip-rate 1.5", _kld("--max-flip-rate", "1.5"), "--max-flip-rate 1.5: must be from 0 to 1",
         needs=SO),
    Case("kld: --max-kld -0.1", _kld("--max-kld", "-0.1"), "--max-kld -0.1: must be 0 or more", needs=SO),
    Case("kld: --max-kld nan", _kld("--max-kld", "nan"), "--max-kld nan", needs=SO),
    Case("eval: --max-kld without --kld-out", _eval("--max-kld", "0.1"),
         "--max-kld gates the KL divergence report: add --kld-out FILE", needs=SO),
    Case("kld: --tokens 10**12", lambda c: ["eval-kld", "--baseline", c.src, "--candidate", c.out, "--tokens",
                                            str(10**12)], "must be from 2 to 16777216 tokens", needs=SO),
    Case("kld: --chunk 10**9", lambda c: ["eval-kld", "--baseline", c.src, "--candidate", c.out, "--chunk",
                                          str(10**9)], "must be from 2 to 1048576 tokens", needs=SO),
    # R1: what eval-kld writes
    Case("kld: --save-baseline the source's config.json", _kld("--save-baseline", lambda c: c.src / "config.json"),
         IN, needs=SO),
    Case("kld: --save-baseline the source folder", _kld("--save-baseline", lambda c: c.src), "is a folder", needs=SO),
    Case("kld: --save-baseline a file we did not write", _kld("--save-baseline", lambda c: c.tmp / "notes.json"),
         "is not a kld-baseline file this tool wrote", _foreign("notes.json"), needs=SO),
    Case("kld: --out the candidate's index", _kld("--out", lambda c: c.out / "model.safetensors.index.json"), IN,
         needs=SO),
    Case("kld: --out the source's tokenizer", _kld("--out", lambda c: c.src / "tokenizer.json"), IN, needs=SO),
    Case("kld: --out a shard", _kld("--out", lambda c: c.out / "model-00001-of-00003.safetensors"), IN, needs=SO),
    Case("kld: --out the --text file", _kld("--text", lambda c: c.tmp / "t.txt", "--out", lambda c: c.tmp / "t.txt"),
         IN, _text(b"some text to score " * 50), needs=SO),
    Case("kld: --out a folder", _kld("--out", lambda c: c.tmp), "is a folder", needs=SO),
    Case("kld: --out a file we did not write", _kld("--out", lambda c: c.tmp / "r.json"),
         "is not a kld file this tool wrote", _foreign("r.json"), needs=SO),
    Case("kld: --out a hand-edited report of ours", _kld("--out", lambda c: c.tmp / "r.json"),
         "or was edited since", _foreign("r.json", json.dumps({"kld_mean": 0.0, "written_by": {
             "tool": "quantize", "kind": "kld", "sha256": "0" * 64}})), needs=SO),
    Case("kld: --out the --save-baseline file",
         _kld("--save-baseline", lambda c: c.tmp / "x", "--out", lambda c: c.tmp / "x"), "the same file", needs=SO),
    Case("kld: --out the --baseline-logits file", _reuse(*T, *C, "--out", lambda c: c.tmp / "b.st"), IN,
         _with_baseline, needs=SO),
    Case("kld: --save-baseline with --baseline-logits",
         _reuse(*T, *C, "--save-baseline", lambda c: c.tmp / "b2.st"), "nothing to save", _with_baseline, needs=SO),
    # R6: a saved baseline proven to be this run's
    Case("kld: baseline reused with other --tokens", _reuse("--tokens", "16", *C), "saved for --tokens 24",
         _with_baseline, needs=SO),
    Case("kld: baseline reused with other --chunk", _reuse(*T, "--chunk", "12"), "saved for --chunk 8",
         _with_baseline, needs=SO),
    Case("kld: baseline reused with other --text", _reuse(*T, *C, "--text", lambda c: c.tmp / "t.txt"),
         "saved for another --text", lambda c: (_with_baseline(c), _text(b"another text " * 40)(c)), needs=SO),
    Case("kld: baseline reused with another tokenizer", _reuse(*T, *C), "saved for another tokenizer",
         lambda c: (_with_baseline(c), _other_tokenizer()(c)), needs=SO),
    Case("kld: baseline reused for another kind of model", _reuse(*T, *C, candidate="kimi"),
         "saved from a glm_moe_dsa", _with_baseline, needs=("src", "out", "kimi")),
    Case("kld: baseline reused beside another --baseline", _reuse(*T, *C, "--baseline", lambda c: c.src),
         "saved from another model than --baseline", lambda c: (_with_baseline(c), _edit_config(c)), needs=SO),
    Case("kld: baseline with fewer chunks than needed", _reuse(*T, *C), "holds 2 chunks, this run needs 3",
         _rewrite_baseline(_drop_chunk), needs=SO),
    Case("kld: baseline holding NaN", _reuse(*T, *C), "chunk 1 holds NaN or inf", _rewrite_baseline(_nan_chunk),
         needs=SO),
    Case("kld: baseline without its identity (older format)", _reuse(*T, *C), "saved by an older quantize",
         _rewrite_baseline(_old_format), needs=SO),
    Case("kld: --baseline-logits a shard", lambda c: ["eval-kld", "--candidate", c.out, "--baseline-logits",
                                                      c.src / "model-00001-of-00003.safetensors", *T, *C],
         "not a baseline-logits file", needs=SO),
    Case("kld: --baseline-logits a folder", lambda c: ["eval-kld", "--candidate", c.out, "--baseline-logits", c.src,
                                                       *T, *C], "is a folder", needs=SO),
    Case("kld: candidate of another kind", lambda c: ["eval-kld", "--baseline", c.src, "--candidate", c.kimi, *T, *C],
         "a kimi_k25", needs=("src", "kimi")),
    Case("kld: candidate with another tokenizer", _kld(), "its tokenizer differs", _other_tokenizer(), needs=SO),
    Case("kld: NaN candidate fails", _kld(), "the candidate fails", _nan_head("out"), code=1, needs=SO),
    # against itself: a candidate converted before its baseline was changed is not its conversion (provenance)
    Case("kld: NaN baseline refused, nothing saved",
         lambda c: ["eval-kld", "--baseline", c.src, "--candidate", c.src, *T, *C, "--save-baseline", c.tmp / "s.st"],
         "the baseline model is broken", _nan_head("src"), needs=SO),
    # R8/R11: --text and the numeric options
    Case("kld: --text a folder", _kld("--text", lambda c: c.src), "is a folder", needs=SO),
    Case("kld: --text not UTF-8", _kld("--text", lambda c: c.tmp / "t.txt"), "not UTF-8",
         _text(b"\xff\xfe text" * 20), needs=SO),
    Case("kld: --text binary (NUL bytes)", _kld("--text", lambda c: c.src / "model-00001-of-00003.safetensors"),
         "binary file", needs=SO),
    Case("kld: --text missing", _kld("--text", lambda c: c.tmp / "none.txt"), "no such file", needs=SO),
    Case("kld: --tokens 0", _kld("--tokens", "0"), "--tokens 0: must be from 2 to 16777216 tokens", needs=SO),
    Case("kld: --tokens -5", _kld("--tokens", "-5"), "--tokens -5: must be from 2 to 16777216 tokens", needs=SO),
    Case("kld: --tokens 1", _kld("--tokens", "1"), "--tokens 1: must be from 2 to 16777216 tokens", needs=SO),
    Case("kld: --chunk 0", _kld("--chunk", "0"), "--chunk 0: must be from 2 to 1048576 tokens", needs=SO),
    Case("kld: --chunk 1", _kld("--chunk", "1"), "--chunk 1: must be from 2 to 1048576 tokens", needs=SO),
    # eval: refused before lm-eval runs
    Case("eval: --limit 0", _eval("--limit", "0"), "--limit 0: must be at least 1", needs=SO),
    Case("eval: --max-drop nan", _eval("--max-drop", "nan"), "--max-drop nan: not a finite number; must be 0 or more points", needs=SO),
    Case("eval: --max-drop inf", _eval("--max-drop", "inf"), "--max-drop inf: not a finite number", needs=SO),
    Case("eval: --max-drop -0.5", _eval("--max-drop", "-0.5"), "--max-drop -0.5: must be 0 or more points", needs=SO),
    Case("eval: --max-gen-toks 0", _eval("--max-gen-toks", "0"), "--max-gen-toks 0: must be at least 1", needs=SO),
    Case("eval: --tasks names none", lambda c: ["eval", "--baseline", c.src, "--candidate", c.out, "--tasks", " , "],
         "names no task", needs=SO),
    Case("eval: --out the source's config.json", _eval("--out", lambda c: c.src / "config.json"), IN, needs=SO),
    Case("eval: --markdown inside the candidate", _eval("--markdown", lambda c: c.out / "chat_template.jinja"), IN,
         needs=SO),
    Case("eval: --markdown a folder", _eval("--markdown", lambda c: c.tmp), "is a folder", needs=SO),
    Case("eval: --out a file we did not write", _eval("--out", lambda c: c.tmp / "r.json"),
         "is not a eval file this tool wrote", _foreign("r.json"), needs=SO),
    Case("eval: --markdown the --out file", _eval("--out", lambda c: c.tmp / "r", "--markdown", lambda c: c.tmp / "r"),
         "the same file as --out", needs=SO),
    Case("eval: candidate of another kind", _eval(candidate="kimi"), "a kimi_k25", needs=("src", "kimi")),
    Case("eval: candidate with another tokenizer", _eval(), "its tokenizer differs", _other_tokenizer(), needs=SO),
    # eval-pd
    Case("pd: --out the source's config.json", _pd("--out", lambda c: c.src / "config.json"), IN, needs=SO),
    Case("pd: --out a folder", _pd("--out", lambda c: c.tmp), "is a folder", needs=SO),
    Case("pd: --out a file we did not write", _pd("--out", lambda c: c.tmp / "pd.json"),
         "is not a pd file this tool wrote", _foreign("pd.json"), needs=SO),
    Case("pd: decode model of another kind", _pd(decode="kimi"), "a kimi_k25", needs=("src", "kimi")),
    Case("pd: decode model with another tokenizer", _pd(), "its tokenizer differs", _other_tokenizer(), needs=SO),
    Case("pd: --text not UTF-8", _pd("--text", lambda c: c.tmp / "t.txt"), "not UTF-8", _text(b"\xc3\x28" * 99),
         needs=SO),
    Case("pd: --text a folder", _pd("--text", lambda c: c.out), "is a folder", needs=SO),
    Case("pd: --prompt-tokens 0", _pd("--prompt-tokens", "0"), "--prompt-tokens 0: must be at least 1", needs=SO),
    Case("pd: --decode-tokens 0", _pd("--decode-tokens", "0"), "--decode-tokens 0: must be at least 1", needs=SO),
    Case("pd: NaN decode model fails", _pd(), "not finite", _nan_head("out"), code=1, needs=SO),
    # --serve-log: an output like the others, checked before any work (no engine is needed to refuse it)
    Case("eval: --serve-log inside the source", _eval("--serve", "vllm", "--serve-log", lambda c: c.src / "logs"),
         "logs: lies inside the input", needs=SO),
    Case("eval: --serve-log the candidate folder", _eval("--serve", "vllm", "--serve-log", lambda c: c.out),
         "lies inside the input", needs=SO),
    Case("eval: --serve-log a file in the source", _eval("--serve", "vllm", "--serve-log",
                                                         lambda c: c.src / "config.json"),
         "config.json: is a file, not a folder", needs=SO),
    Case("eval: --serve-log a file", _eval("--serve", "vllm", "--serve-log", lambda c: c.tmp / "engine.log"),
         "engine.log: is a file, not a folder", _foreign("engine.log"),
         inputs=lambda c: [c.src, c.out, c.tmp / "engine.log"], needs=SO),
    Case("eval: --serve-log under a file", _eval("--serve", "vllm", "--serve-log", lambda c: c.tmp / "f.txt" / "l"),
         "f.txt is a file, not a folder", _foreign("f.txt"), inputs=lambda c: [c.src, c.out, c.tmp / "f.txt"],
         needs=SO),
    Case("kld: --serve-log inside the candidate", _kld("--serve", "vllm", "--serve-log", lambda c: c.out / "logs"),
         "logs: lies inside the input", needs=SO),
    Case("kld: --serve-log a file", _kld("--serve", "vllm", "--serve-log", lambda c: c.tmp / "engine.log"),
         "engine.log: is a file, not a folder", _foreign("engine.log"),
         inputs=lambda c: [c.src, c.out, c.tmp / "engine.log"], needs=SO),
    # the PD pair's prefill model is an input like the others
    Case("eval: --out inside the --serve-pd-prefill model",
         _eval("--serve", "sglang", "--serve-pd-prefill", lambda c: c.tmp / "pfx", "--out",
               lambda c: c.tmp / "pfx" / "pd.json"), "pd.json: lies inside the input", _prefill_copy,
         inputs=lambda c: [c.src, c.out, c.tmp / "pfx"], needs=SO),
    Case("eval: --markdown the --serve-pd-prefill model's README",
         _eval("--serve", "sglang", "--serve-pd-prefill", lambda c: c.tmp / "pfx", "--markdown",
               lambda c: c.tmp / "pfx" / "README.md"), "README.md: lies inside the input", _prefill_copy,
         inputs=lambda c: [c.src, c.out, c.tmp / "pfx"], needs=SO),
    Case("eval: --serve-log inside the --serve-pd-prefill model",
         _eval("--serve", "sglang", "--serve-pd-prefill", lambda c: c.tmp / "pfx", "--serve-log",
               lambda c: c.tmp / "pfx" / "logs"), "logs: lies inside the input", _prefill_copy,
         inputs=lambda c: [c.src, c.out, c.tmp / "pfx"], needs=SO),
    # provenance: another model of the same layout (make-tiny --seed 1) is not the candidate's source
    Case("eval: baseline of the same layout, other weights (seed 1)",
         lambda c: ["eval", "--baseline", c.seed1, "--candidate", c.out, "--tasks", "arc_easy"],
         "not converted from --baseline", needs=S1),
    Case("eval: candidate of the same layout, not a conversion (seed 1)", _eval(candidate="seed1"),
         "not converted from --baseline", needs=("src", "seed1")),
    Case("eval: baseline without its manifest, other weights (seed 1)",
         lambda c: ["eval", "--baseline", c.seed1, "--candidate", c.out, "--tasks", "arc_easy"],
         "not converted from --baseline", lambda c: (c.seed1 / "quantize_manifest.json").unlink(), needs=S1),
    Case("eval: --baseline-results saved from seed 1",
         _eval("--baseline-results", lambda c: c.tmp / "base.json"), "made for another baseline model",
         _results_of("seed1"), needs=("src", "out", "seed1")),
    Case("kld: baseline of the same layout, other weights (seed 1)",
         lambda c: ["eval-kld", "--baseline", c.seed1, "--candidate", c.out, *T, *C],
         "not converted from --baseline", needs=S1),
    Case("kld: candidate of the same layout, not a conversion (seed 1)",
         lambda c: ["eval-kld", "--baseline", c.src, "--candidate", c.seed1, *T, *C],
         "not converted from --baseline", needs=("src", "seed1")),
    Case("kld: --baseline-logits saved from seed 1", lambda c: ["eval-kld", "--candidate", c.out, "--baseline-logits",
                                                               c.tmp / "b1.st", *T, *C],
         "not converted from the model --baseline-logits", _seed1_baseline, needs=S1),
    Case("kld: --baseline-logits saved from seed 1, second candidate of a table",
         lambda c: ["eval-kld", "--candidate", c.seed1, "--candidate", c.out, "--baseline-logits", c.tmp / "b1.st",
                    *T, *C], "not converted from the model --baseline-logits", _seed1_baseline, needs=S1),
    Case("kld: --serve, baseline of the same layout, other weights (seed 1)",
         lambda c: ["eval-kld", "--baseline", c.seed1, "--candidate", c.out, *T, *C, "--serve", "vllm",
                    "--engine-python", c.tmp / "python"], "not converted from --baseline", _fake_python, needs=S1),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hostile(case, tmp_path, hostile_sources, tiny):
    if "seed1" in case.needs and "seed1" not in hostile_sources:
        hostile_sources["seed1"] = tiny("glm_moe_dsa", seed=1)  # seed 0's layout, config and tokenizer
    msg = run_case(case, tmp_path, hostile_sources)
    assert "Traceback" not in msg
    if case.id.startswith("kld: NaN baseline"):
        assert not (tmp_path / "s.st").exists() and not list(tmp_path.glob("*.partial"))


# -- near misses: the same inputs, done right, work -------------------------------------------------


def _cli(argv):
    from typer.testing import CliRunner

    from quantize.cli import app

    res = CliRunner().invoke(app, [str(a) for a in argv])
    assert res.exit_code == 0, res.output[-3000:]
    return res


def test_saved_baseline_reused_and_reports_rerun(hostile_sources, tmp_path):
    """The same baseline with a matching identity is reused (alone or beside its --baseline); a
    report and a saved baseline this tool wrote are replaced by a rerun; --chunk 2, --tokens 2 work."""
    src, out = hostile_sources["src"], hostile_sources["out"]
    b, r = tmp_path / "new" / "b.st", tmp_path / "r.json"  # a folder not made yet is made
    first = ["eval-kld", "--baseline", src, "--candidate", out, *T, *C, "--save-baseline", b, "--out", r, "--json"]
    _cli(first)
    with safe_open(b, "pt") as f:
        meta = f.metadata()
    ident = json.loads(meta["identity"])
    assert meta["quantize_kind"] == "kld-baseline" and ident["tokens"] == 24 and ident["chunk"] == 8
    assert ident["chunks"] == 3 and ident["model"]["model_type"] == "glm_moe_dsa" and ident["text_sha256"]
    assert ident["model"]["config_sha256"] and ident["model"]["weights_sha256"] and ident["model"]["tokenizer_files"]
    doc = json.loads(r.read_text())
    assert doc["written_by"]["kind"] == "kld"
    _cli(first)  # ours: replaced
    reused = json.loads(_cli(["eval-kld", "--candidate", out, "--baseline-logits", b, *T, *C, "--json"]).stdout)
    assert reused["kld_mean"] == pytest.approx(doc["kld_mean"], rel=0.05)
    _cli(["eval-kld", "--baseline", src, "--candidate", out, "--baseline-logits", b, *T, *C, "--out", r])
    _cli(["eval-kld", "--baseline", src, "--candidate", out, "--tokens", "2", "--chunk", "2"])
    r.write_text(r.read_text().replace('"kld_mean": ', '"kld_mean": 1'))  # hand-edited: refused next time
    from typer.testing import CliRunner

    from quantize.cli import app

    res = CliRunner().invoke(app, [str(a) for a in first])
    assert res.exit_code == 2 and "edited since" in res.stderr


def test_pd_report_rerun_replaces_ours(hostile_sources, tmp_path):
    src, out = hostile_sources["src"], hostile_sources["out"]
    argv = ["eval-pd", "--prefill-model", src, "--decode-model", out, "--source", src, "--prompt-tokens", "8",
            "--decode-tokens", "4", "--out", tmp_path / "pd.json"]
    _cli(argv)
    _cli(argv)
    assert json.loads((tmp_path / "pd.json").read_text())["written_by"]["kind"] == "pd"


def test_option_bounds_accept_their_edge():
    from quantize.options import EvalOptions, KLDOptions, PDOptions

    EvalOptions(limit=1, max_drop=0.0, max_gen_toks=1, resamples=100).validate()
    KLDOptions(tokens=2, chunk=2).validate()
    PDOptions(prompt_tokens=1, decode_tokens=1).validate()
    from quantize.errors import QuantizeError

    for bad in ({"resamples": 99}, {"batch_size": 0}, {"max_drop": float("nan")}):
        with pytest.raises(QuantizeError):
            EvalOptions(**bad).validate()
    with pytest.raises(QuantizeError, match="--dtype float16"):
        KLDOptions(dtype="float16").validate()
