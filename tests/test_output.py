"""The one guarded output layer (quantize/checkpoint/output.py), as every writing command uses it:
nothing outside what this tool wrote for the same kind of job is deleted or overwritten, one run
per OUT at a time, retries converge, kept shards are proven by SHA-256, records are confined."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from quantize.calibrate.kv import calibrate_kv
from quantize.checkpoint.output import Output
from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.shard import merge, shard
from quantize.testing.tiny import make_tiny

from .conftest import TP8, dir_bytes


def _precious(d):
    d.mkdir(parents=True, exist_ok=True)
    (d / "precious.txt").write_text("do not lose me")
    return d


def _intact(d):
    assert (d / "precious.txt").read_text() == "do not lose me"


def _one_line(e):
    assert "\n" not in str(e.value)
    return str(e.value)


def test_merge_overwrite_refuses_a_folder_it_did_not_write(converted, tmp_path):
    sh = tmp_path / "sh"
    shard(converted("glm_moe_dsa", group_size=32), sh, tp=1)
    other = _precious(tmp_path / "someone-elses")
    with pytest.raises(QuantizeError, match="did not write it") as e:
        merge(sh, other, overwrite=True)
    _one_line(e)
    _intact(other)
    # a shard output is not a merge output either
    sh2 = tmp_path / "sh2"
    shard(converted("glm_moe_dsa", group_size=32), sh2, tp=1)
    with pytest.raises(QuantizeError, match="quantize shard. output, not a merge"):
        merge(sh, sh2, overwrite=True)
    assert (sh2 / "shard_manifest.json").exists()


def test_calibrate_kv_out_at_the_models_parent_is_refused(tiny, tmp_path):
    parent = tmp_path / "models"
    model = parent / "llama"
    shutil.copytree(tiny("llama", layout="bf16"), model)
    before = dir_bytes(model)
    with pytest.raises(QuantizeError, match="overlaps the input") as e:
        calibrate_kv(model, parent, samples=2, seq_len=8, overwrite=True)
    _one_line(e)
    assert dir_bytes(model) == before
    with pytest.raises(QuantizeError, match="overlaps the input"):
        calibrate_kv(model, model / "kv", samples=2, seq_len=8)


def test_resume_into_another_models_folder_is_refused(tiny, tmp_path):
    other = tmp_path / "other-model"  # as a vendor ships it: no record of ours
    shutil.copytree(tiny("deepseek_v3"), other, ignore=shutil.ignore_patterns(".quantize", "quantize_manifest.json"))
    before = dir_bytes(other)
    for kw in ({"resume": True}, {"overwrite": True}):
        with pytest.raises(QuantizeError, match="did not write it"):
            convert(tiny("glm_moe_dsa"), other, **kw)
    assert dir_bytes(other) == before and not (other / ".quantize").exists()
    # another kind of quantize output (make-tiny) is not a convert output
    mt = make_tiny("llama", tmp_path / "mt", layout="bf16")
    with pytest.raises(QuantizeError, match="make-tiny. output, not a convert"):
        convert(tiny("glm_moe_dsa"), mt, resume=True)


def test_never_through_a_symlink(tiny, converted, tmp_path):
    real = converted("glm_moe_dsa", group_size=32)
    link = tmp_path / "link"
    link.symlink_to(real)
    for kw in ({"resume": True}, {"overwrite": True}):
        with pytest.raises(QuantizeError, match="symlink"):
            convert(tiny("glm_moe_dsa"), link, group_size=32, **kw)
    assert (real / "quantize_manifest.json").exists()


def test_out_containing_the_source_is_refused(tiny, tmp_path):
    src = tmp_path / "work" / "src"
    shutil.copytree(tiny("glm_moe_dsa"), src)
    with pytest.raises(QuantizeError, match="overlaps the input"):
        convert(src, tmp_path / "work", overwrite=True)
    assert (src / "config.json").exists()


def test_second_run_into_the_same_out_is_refused(tiny, tmp_path):
    out = tmp_path / "o"
    with Output.open(out, "convert", [tiny("glm_moe_dsa")]):
        for kw in ({}, {"resume": True}, {"overwrite": True}):
            with pytest.raises(QuantizeError, match="another quantize run is writing") as e:
                convert(tiny("glm_moe_dsa"), out, **kw)
            assert str(os.getpid()) in _one_line(e)
    convert(tiny("glm_moe_dsa"), out, overwrite=True)  # lock released: it goes through
    assert (out / "quantize_manifest.json").exists()


def test_lock_holds_across_processes(tiny, tmp_path):
    out = tmp_path / "o"
    code = ("import sys, time; from quantize.checkpoint.output import Output\n"
            f"o = Output.open({str(out)!r}, 'convert', [])\nprint('locked', flush=True)\ntime.sleep(30)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(QuantizeError, match=f"another quantize run is writing this folder \\(pid {p.pid}\\)"):
            convert(tiny("glm_moe_dsa"), out, resume=True)
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("state", ["missing", "empty", "lock-only"])
def test_resume_with_nothing_written_starts_the_job(state, tiny, converted, tmp_path):
    out = tmp_path / "o"
    if state != "missing":
        out.mkdir()
    if state == "lock-only":  # died after taking the lock, before its record
        (out / ".quantize").mkdir()
        (out / ".quantize" / "lock").write_text("12345")
    convert(tiny("glm_moe_dsa"), out, group_size=32, resume=True)
    a, b = dir_bytes(out), dir_bytes(converted("glm_moe_dsa", group_size=32))
    a.pop("quantize_manifest.json"), b.pop("quantize_manifest.json")
    assert a == b


def test_kept_shard_with_same_size_but_other_bytes_is_redone(tiny, converted, tmp_path):
    ref = converted("glm_moe_dsa", group_size=32)
    out = tmp_path / "o"
    shutil.copytree(ref, out)
    shard1 = sorted(out.glob("model-*.safetensors"))[0]
    raw = bytearray(shard1.read_bytes())
    raw[-5] ^= 0xFF  # same size, one byte off
    shard1.write_bytes(bytes(raw))
    (out / "quantize_manifest.json").unlink()
    res = convert(tiny("glm_moe_dsa"), out, group_size=32, resume=True)
    assert res.resumed_shards == len(list(ref.glob("model-*.safetensors"))) - 1
    assert shard1.read_bytes() == (ref / shard1.name).read_bytes()


def test_records_read_from_shard_manifests_are_confined(converted, tmp_path):
    sh = tmp_path / "sh"
    shard(converted("glm_moe_dsa", group_size=32), sh, tp=2)
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    m = json.loads((sh / "shard_manifest.json").read_text())
    bad = json.loads(json.dumps(m))
    next(iter(bad["tensors"].values()))["ranks"][0]["file"] = "../outside.safetensors"
    (sh / "shard_manifest.json").write_text(json.dumps(bad))
    with pytest.raises(QuantizeError, match="outside"):
        merge(sh, tmp_path / "m")
    bad = json.loads(json.dumps(m))
    bad["files"] = {"../../escape.safetensors": v for v in bad["files"].values()}
    (sh / "shard_manifest.json").write_text(json.dumps(bad))
    with pytest.raises(QuantizeError, match="not a plain"):
        merge(sh, tmp_path / "m2")
    assert not (tmp_path / "escape.safetensors").exists() and not list(tmp_path.glob("m2/*.safetensors"))


def test_only_what_the_checkpoint_needs_is_copied(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny("glm_moe_dsa"), src)
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"\0" * 1000)
    (src / "pytorch_model.bin").write_bytes(b"\0" * 10)
    (src / "notes.pt").write_bytes(b"\0" * 10)
    (src / "README.md").write_text("# vendor card")
    named = src / "additional_chat_templates"  # transformers' named chat templates, one NAME.jinja each
    named.mkdir()
    (named / "tool_use.jinja").write_text("{% for m in messages %}TOOL {{ m['content'] }}{% endfor %}")
    (named / "notes.txt").write_text("not a template")
    out = tmp_path / "o"
    convert(src, out)
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "README.md",
            "additional_chat_templates"} <= names
    assert not names & {"original", "pytorch_model.bin", "notes.pt"}
    assert [p.name for p in (out / "additional_chat_templates").iterdir()] == ["tool_use.jinja"]
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_bytes() == (named / "tool_use.jinja").read_bytes()
    man = json.loads((out / "quantize_manifest.json").read_text())
    assert {"README.md", "additional_chat_templates/tool_use.jinja"} <= set(man["copied_from_source"])
    assert set(man["files"]) == {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()
                                 and p.name != "quantize_manifest.json" and ".quantize" not in p.parts}
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out)  # the named template is the tokenizer's again
    assert "TOOL hi" in tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="tool_use",
                                                tokenize=False)


def test_dangling_symlink_named_before_any_shard(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny("glm_moe_dsa"), src)
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(tmp_path / "gone.json")
    out = tmp_path / "o"
    with pytest.raises(QuantizeError, match="tokenizer.json: dangling symlink") as e:
        convert(src, out)
    _one_line(e)
    assert not out.exists() or not list(out.glob("*.safetensors*"))


def test_out_is_an_existing_file(tiny, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(QuantizeError, match="is a file") as e:
        convert(tiny("glm_moe_dsa"), f, overwrite=True)
    _one_line(e)
    assert f.read_text() == "x"


def test_over_long_name(tiny, tmp_path):
    with pytest.raises(QuantizeError, match="name too long") as e:
        convert(tiny("glm_moe_dsa"), tmp_path / ("x" * 300))
    _one_line(e)


def test_disk_full_while_writing_config_index_or_manifest(tiny, tmp_path, monkeypatch):
    import quantize.checkpoint.output as output

    real_open = open
    for name in ("model.safetensors.index.json", "config.json", "quantize_manifest.json"):
        def full_open(path, mode="r", *a, _name=name, **kw):
            if str(path).endswith(_name + ".partial"):
                return real_open("/dev/full", mode, *a, **kw)
            return real_open(path, mode, *a, **kw)

        monkeypatch.setattr(output, "open", full_open, raising=False)
        out = tmp_path / name
        with pytest.raises(QuantizeError, match="no space left") as e:
            convert(tiny("glm_moe_dsa"), out)
        assert name in _one_line(e) and "--resume" in str(e.value)
        assert not (out / "quantize_manifest.json").exists() and not list(out.glob("*.partial"))
        monkeypatch.undo()
        convert(tiny("glm_moe_dsa"), out, resume=True)  # the retry converges
        assert (out / "quantize_manifest.json").exists()


def _unshare_available():
    return shutil.which("unshare") and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_available(), reason="needs user namespaces (unshare -rm) to mount a read-only filesystem")
def test_read_only_filesystem_is_one_line(tiny, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = (f"mount -t tmpfs -o ro tmpfs {ro} && exec {sys.executable} -m quantize.cli convert {tiny('glm_moe_dsa')} {ro / 'out'}")
    p = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "read-only" in lines[0], p.stderr


def test_make_tiny_and_demo_guarded(tmp_path):
    d = _precious(tmp_path / "d")
    with pytest.raises(QuantizeError, match="did not write it"):
        make_tiny("llama", d, overwrite=True)
    _intact(d)


def test_calibrate_kv_output_has_its_own_manifest(tiny, tmp_path):
    model = tiny("llama", layout="bf16")
    out = tmp_path / "kv"
    calibrate_kv(model, out, samples=2, seq_len=16, target="compressed-tensors")
    man = json.loads((out / "quantize_manifest.json").read_text())
    assert man["kind"] == "calibrate-kv"
    assert {"config.json", "kv_scales.safetensors", "model.safetensors.index.json"} <= set(man["files"])
    from quantize.checkpoint.output import sha256_file

    for f, rec in man["files"].items():
        assert sha256_file(out / f) == rec["sha256"], f
    # the weights are shared (hard links), and the source is untouched by a rerun with --overwrite
    before = dir_bytes(model)
    calibrate_kv(model, out, samples=2, seq_len=16, target="compressed-tensors", overwrite=True)
    assert dir_bytes(model) == before


def test_cli_convert_overwrite_of_foreign_folder(tiny, tmp_path):
    other = _precious(tmp_path / "other")
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "convert", str(tiny("glm_moe_dsa")), str(other), "--overwrite"],
                       capture_output=True, text=True)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and str(other) in lines[0]
    _intact(other)


def test_shard_overwrite_of_its_own_output(converted, tmp_path):
    sh = tmp_path / "sh"
    shard(converted("glm_moe_dsa", group_size=32), sh, tp=2)
    with pytest.raises(QuantizeError, match="already exists"):
        shard(converted("glm_moe_dsa", group_size=32), sh, tp=1)
    m = shard(converted("glm_moe_dsa", group_size=32), sh, tp=1, overwrite=True)
    assert m["tp"] == 1 and not (sh / "rank-01").exists()


def test_tp8_fixture_still_shards(tiny, tmp_path):
    src = tmp_path / "int4"
    convert(tiny("glm_moe_dsa", overrides=TP8), src)
    m = shard(src, tmp_path / "sh", tp=8)
    assert len(m["rank_bytes"]) == 8


@pytest.mark.parametrize("nbytes", [64, 4 << 20], ids=["buffered-until-close", "fails-in-write"])
def test_disk_full_at_any_write_of_a_shard_is_one_line(tmp_path, monkeypatch, nbytes):
    """A small file is still in the write buffer when ``finish`` flushes it: the flush fails with
    ENOSPC, and the abort that follows must not flush (and fail) a second time (issue 16 R10)."""
    import quantize.checkpoint.writer as writer
    from quantize.checkpoint.writer import Entry, StreamWriter

    real_open = open
    monkeypatch.setattr(
        writer, "open", lambda p, mode="r", *a, **kw: real_open("/dev/full" if str(p).endswith(".partial") else p,
                                                                 mode, *a, **kw), raising=False
    )
    w = StreamWriter(tmp_path / "x.safetensors", [Entry("t", "U8", (nbytes,))])
    with pytest.raises(QuantizeError, match="no space left") as e:
        w.write_tensor("t", torch.zeros(nbytes, dtype=torch.uint8))
        w.finish()
    _one_line(e)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kind, fix, wrong", [("convert", "--resume", None), ("shard", "--overwrite", "--resume"),
                                               ("calibrate-kv", "--overwrite", "--resume")])
def test_messages_name_the_fix_of_the_running_command(tmp_path, monkeypatch, kind, fix, wrong):
    """Only convert takes --resume: shard, merge, calibrate-kv and the others are told --overwrite,
    for an existing folder and for disk full alike (issue 16 R13)."""
    import quantize.checkpoint.output as output

    out = tmp_path / "o"
    with Output.open(out, kind) as o:
        o.write_text("x.txt", "x")
        real_open = open
        monkeypatch.setattr(output, "open", lambda p, *a, **kw: real_open("/dev/full" if str(p).endswith(".partial")
                                                                          else p, *a, **kw), raising=False)
        with pytest.raises(QuantizeError, match="no space left") as e:
            o.write_text("y.txt", "y")
        monkeypatch.undo()
    assert fix in str(e.value) and (wrong is None or wrong not in str(e.value))
    with pytest.raises(QuantizeError, match="already exists") as e:
        Output.open(out, kind)
    assert fix in str(e.value) and (wrong is None or wrong not in str(e.value))
    assert output.rerun_hint() == "rerun the command"  # no output open: the stack is back to its base


def test_a_named_templates_folder_linked_outside_the_checkpoint_is_one_line(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny("glm_moe_dsa"), src)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tool_use.jinja").write_text("x")
    (src / "additional_chat_templates").symlink_to(elsewhere, target_is_directory=True)
    out = tmp_path / "o"
    with pytest.raises(QuantizeError, match=r"additional_chat_templates: symlink to \S+elsewhere, outside the "
                                            r"checkpoint and its Hub cache; copy the folder in instead") as e:
        convert(src, out)
    _one_line(e)
    assert not out.exists() or not list(out.glob("*.safetensors*"))
