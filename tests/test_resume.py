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
