"""SIGKILL at any point, then --resume: byte-identical to an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys

import pytest

from quantize.convert import convert
from quantize.errors import QuantizeError

from .conftest import dir_bytes


def _kill_after(src, out, predicate) -> list[dict]:
    """Run the CLI with NDJSON events; SIGKILL it as soon as ``predicate(event)`` holds."""
    cmd = [sys.executable, "-m", "quantize.cli", "convert", str(src), str(out), "--json", "--workers", "1", "--observer", "mse"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stdout:
        ev = json.loads(line)
        seen.append(ev)
        if predicate(ev):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    return seen


POINTS = {
    "first-tensor": lambda ev: ev.get("event") == "tensor",
    "mid-shard": lambda ev: ev.get("event") == "tensor" and "layers.1.mlp.experts.5" in ev.get("name", ""),
    "after-first-shard": lambda ev: ev.get("event") == "shard",
}


@pytest.mark.parametrize("point", list(POINTS))
def test_kill_then_resume_is_byte_identical(point, tiny, converted, tmp_path):
    src = tiny("glm_moe_dsa")
    reference = converted("glm_moe_dsa", group_size=32, observer="mse")
    out = tmp_path / "out"
    _kill_after(src, out, POINTS[point])
    # nothing is presented as complete
    assert not (out / "quantize_manifest.json").exists()
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    job = json.loads((out / ".quantize" / "job.json").read_text())
    assert job["state"] == "running"
    with pytest.raises(QuantizeError, match="already exists"):
        convert(src, out, observer="mse")
    with pytest.raises(QuantizeError, match="different options"):
        convert(src, out, observer="minmax", resume=True)
    res = convert(src, out, observer="mse", resume=True)
    if point == "after-first-shard":
        assert res.resumed_shards >= 1
    a, b = dir_bytes(out), dir_bytes(reference)
    ma, mb = json.loads(a.pop("quantize_manifest.json")), json.loads(b.pop("quantize_manifest.json"))
    assert a == b
    assert ma["outputs"] == mb["outputs"] and ma["tensors"] == mb["tensors"]
    assert not list(out.glob("*.partial"))


def test_resume_under_another_build_is_refused_naming_what_changed(tiny, converted, tmp_path):
    """A run killed under one build of the tool (its code) or of a library that shapes the bytes,
    then resumed under another, would mix two builds' shards: refused, naming each change; the same
    build resumes (and the refusals left the interrupted run as it was)."""
    from importlib.metadata import version

    from quantize.checkpoint.manifest import code_id

    src, out = tiny("glm_moe_dsa"), tmp_path / "out"

    def stop_after_first_shard(e):
        if e.get("event") == "shard":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(src, out, emit=stop_after_first_shard, workers=1)
    job = out / ".quantize" / "job.json"
    rec = json.loads(job.read_text())
    build = rec["key"]["build"]
    assert build["quantize"] == code_id() and build["torch"] == version("torch")

    def resume_with(b):
        job.write_text(json.dumps({**rec, "key": {**rec["key"], "build": b}}))
        with pytest.raises(QuantizeError) as e:
            convert(src, out, resume=True)
        assert json.loads(job.read_text())["key"]["build"] == b  # the record is left as it was
        return str(e.value)

    msg = resume_with({**build, "quantize": "0" * 16})
    assert f"another build (quantize {'0' * 16} -> {code_id()})" in msg and "--overwrite" in msg
    msg = resume_with({**build, "torch": "2.12.0"})
    assert f"(torch 2.12.0 -> {version('torch')})" in msg and "quantize" not in msg.split("(")[1]
    msg = resume_with({k: v for k, v in build.items() if k != "llmcompressor"})
    assert f"(llmcompressor unrecorded -> {version('llmcompressor')})" in msg
    assert "(flash 1.0 -> none)" in resume_with({**build, "flash": "1.0"})  # a library this build does not list
    job.write_text(json.dumps({**rec, "key": {k: v for k, v in rec["key"].items() if k != "build"}}))
    with pytest.raises(QuantizeError, match=r"another build \(compressed_tensors unrecorded -> .*, quantize unrecorded"):
        convert(src, out, resume=True)  # a run started before the build was recorded
    job.write_text(json.dumps(rec))
    res = convert(src, out, resume=True)
    assert res.resumed_shards >= 1
    a, b = dir_bytes(out), dir_bytes(converted("glm_moe_dsa"))
    a.pop("quantize_manifest.json"), b.pop("quantize_manifest.json")
    assert a == b


def test_code_id_is_the_package_files_and_nothing_else(tmp_path):
    import hashlib
    import shutil
    from pathlib import Path

    import quantize
    from quantize.checkpoint.manifest import code_id, tree_id

    a = tmp_path / "a"
    a.mkdir()
    (a / "x.py").write_text("abc")
    by_hand = hashlib.sha256(b"x.py\x003\x00abc").hexdigest()[:16]
    assert tree_id(a) == by_hand
    (a / "sub").mkdir()
    (a / "sub" / "k.c").write_text("int f;")
    one = tree_id(a)
    shutil.copytree(a, tmp_path / "b")
    assert tree_id(tmp_path / "b") == one  # where it lies does not matter
    for junk in ("__pycache__/x.cpython-312.pyc", "sub/quant.so", "sub/quant.o", "y.pyc"):
        (a / junk).parent.mkdir(exist_ok=True)
        (a / junk).write_bytes(b"built")
    assert tree_id(a) == one  # caches and built libraries are not the code
    (a / "sub" / "k.c").write_text("int g;")
    assert tree_id(a) != one  # one byte
    (a / "sub" / "k.c").write_text("int f;")
    assert tree_id(a) == one
    (a / "x.py").write_text("ab")
    (a / "sub" / "k.c").write_text("cint f;")
    assert tree_id(a) != one  # a byte moved from one file to the next
    (a / "x.py").write_text("abc")
    (a / "sub" / "k.c").rename(a / "sub" / "k2.c")
    assert tree_id(a) != one  # a renamed file
    assert code_id() == tree_id(Path(quantize.__file__).parent)
