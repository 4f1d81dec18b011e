"""GPTQ and calibrate-kv across ranks (gloo on the CPU, real torchrun processes through --nproc): the
calibration samples and the routed experts split across ranks give the bytes of one process; a rank
killed mid-layer fails the run in one line and --resume finishes it with the same bytes; a method
that does not split refuses."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantize.convert import convert

from .conftest import method_layers, weights_only

ARGS = ["--method", "gptq", "--profile", "all-linear", "--samples", "4", "--seq-len", "48", "--workers", "1",
        "--memory-budget-gib", "0"]
KW = dict(method="gptq", profile="all-linear", samples=4, seq_len=48, workers=1, memory_budget_gib=0.0)
ROOT = str(Path(__file__).resolve().parents[1])


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "quantize.cli", *args], capture_output=True, text=True, env=_env(),
                          timeout=600, **kw)


@pytest.fixture(scope="module")
def one_rank(tiny, tmp_path_factory):
    src = tiny("glm_moe_dsa")
    out = tmp_path_factory.mktemp("ranks") / "one"
    convert(src, out, **KW)
    return src, out


def test_two_ranks_are_one_process_bit_for_bit(one_rank, tmp_path):
    src, one = one_rank
    two = tmp_path / "two"
    p = _cli("convert", str(src), str(two), *ARGS, "--nproc", "2")
    assert p.returncode == 0, p.stderr[-2000:]
    assert weights_only(two) == weights_only(one)
    assert method_layers(two) == method_layers(one)  # token counts, losses, fallbacks: rank 1's experts included
    job = json.loads((two / ".quantize" / "job.json").read_text())
    parts = {x["file"] for x in job["layers"]["0001"]["parts"]}
    assert len(parts) == 8  # every expert's group file, rank 1's written by rank 0
    assert "rank" not in p.stdout.lower() or p.stdout.count("done") == 1  # rank 0 alone speaks
    # rank 0 held (here: spilled, budget 0) the hidden states of its 2 samples of 4, and on the same budget
    # what the exchange brought it: every sample's routed experts' inputs, its experts' outputs (before, those
    # lay in memory outside the budget, and rank 0 spilled exactly half of one process's bytes)
    spilled = [json.loads((d / "quantize_manifest.json").read_text())["method"]["hidden_bytes_spilled"]
               for d in (one, two)]
    assert spilled[0] > 0 and spilled[1] * 2 > spilled[0], spilled


def _rank_pid(out: Path, rank: int) -> int | None:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out).encode() in cmd and f"RANK={rank}".encode() in env and b"LOCAL_RANK=%d" % rank in env:
            return int(d.name)
    return None


def test_a_rank_killed_mid_layer_fails_in_one_line_and_resumes_byte_identical(one_rank, tmp_path):
    src, one = one_rank
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "quantize.cli", "convert", str(src), str(out), *ARGS, "--nproc", "2",
           "--dist-timeout-s", "60"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    job = out / ".quantize" / "job.json"
    killed = None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            layers = json.loads(job.read_text()).get("layers", {})
        except (OSError, ValueError):
            layers = {}
        if "0001" in layers:  # layer 1 recorded: rank 1 is working on layer 2's experts
            killed = _rank_pid(out, 1)
            if killed:
                os.kill(killed, signal.SIGKILL)
                break
        time.sleep(0.05)
    assert killed, "rank 1 was not found while the run was in layer 2"
    _, err = proc.communicate(timeout=300)
    assert proc.returncode not in (0, None)
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # beside rank 0's warnings
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert "rank 1" in errors[0], errors[0]
    assert not (out / "quantize_manifest.json").exists()
    p = _cli("convert", str(src), str(out), *ARGS, "--nproc", "2", "--resume")
    assert p.returncode == 0, p.stderr[-2000:]
    assert weights_only(out) == weights_only(one)


AR = ["--method", "autoround", "--profile", "all-linear", "--iters", "3", "--batch-size", "3", "--samples", "4",
      "--seq-len", "24", "--workers", "1", "--memory-budget-gib", "0", "--all-experts"]


@pytest.mark.parametrize("init", ["rtn", "gptq"])
def test_autoround_on_two_ranks_is_one_process_bit_for_bit(tiny, tmp_path, init):
    """Each step's samples split across ranks (3 per step over 2 ranks: 2 and 1), each MoE layer's
    routed experts too (4 each: their inputs to every rank, their outputs, input gradients and
    --all-experts terms back), the gradients summed in fixed trees: one process's codes, scales
    and losses (--init gptq: the Linear units' GPTQ start on rank 0, which holds every sample, and each rank's
    routed experts' on that rank, from rank 0's captures)."""
    src = tiny("glm_moe_dsa")
    one, two = tmp_path / "one", tmp_path / "two"
    convert(src, one, method="autoround", profile="all-linear", iters=3, batch_size=3, samples=4, seq_len=24,
            workers=1, memory_budget_gib=0.0, all_experts=True, init=init)
    p = _cli("convert", str(src), str(two), *AR, "--init", init, "--nproc", "2")
    assert p.returncode == 0, p.stderr[-2000:]
    assert weights_only(two) == weights_only(one)
    assert method_layers(two) == method_layers(one)  # per-step losses (first, last, best) included
    trained = [x["train"] for x in method_layers(one) if x.get("train")]
    assert trained and all(t["first_loss"] != t["last_loss"] for t in trained)  # the steps moved the weights


def test_rtn_on_two_ranks_is_refused_in_one_line(tiny, tmp_path):
    out = tmp_path / "rtn"
    p = _cli("convert", str(tiny("llama", layout="bf16")), str(out), "--nproc", "2", "--profile", "all-linear")
    assert p.returncode != 0
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "only the data-aware methods" in lines[0], p.stderr[-1500:]
    assert not (out / "quantize_manifest.json").exists()


def test_calibrate_kv_on_two_ranks_is_one_process(tiny, tmp_path):
    """calibrate-kv's figures depend on the torch thread count (its GEMMs run multi-threaded); at
    the same threads per process (OMP_NUM_THREADS=1, as --nproc 2 gives each rank on 2 cores) the
    routed experts split across two ranks give the one-process report."""
    src = tiny("deepseek_v3")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    args = ["calibrate-kv", str(src), "--samples", "3", "--seq-len", "24", "--memory-budget-gib", "0"]
    env = {**_env(), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "quantize.cli", *args, "--stats-out", str(one)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "quantize.cli", *args, "--stats-out", str(two), "--nproc", "2",
                        "--device", "cpu"],  # the default, said: the same report
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(two.read_text())["layers"] == json.loads(one.read_text())["layers"]


def test_bad_input_on_two_ranks_is_rank_0s_one_line(tiny, tmp_path):
    """Rank 0 refuses (no tokenizer) before any work; the other rank, waiting for its first layer,
    sees rank 0 go: the run prints rank 0's line, once."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny("deepseek_v3"), src)
    for f in src.glob("tokenizer*"):
        f.unlink()
    p = _cli("convert", str(src), str(tmp_path / "o"), *ARGS, "--nproc", "2", "--dist-timeout-s", "60")
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no tokenizer files" in lines[0], p.stderr[-1500:]
    assert not (tmp_path / "o" / "quantize_manifest.json").exists()


def test_autoround_init_gptq_iters0_on_two_ranks_writes_gptqs_bytes(one_rank, tmp_path):
    """--init gptq on 2 ranks: each GPTQs the routed experts it trains from rank 0's captures, sent to it a
    slice at a time (budget 0: spilled to its scratch folder). With no step: --method gptq's one-process
    bytes (the oracle), and no rank's scratch folder is left behind."""
    src, gptq = one_rank
    out = tmp_path / "two"
    p = _cli("convert", str(src), str(out), "--method", "autoround", "--iters", "0", "--init", "gptq", *ARGS[2:],
             "--nproc", "2")
    assert p.returncode == 0, p.stderr[-2000:]
    assert weights_only(out) == weights_only(gptq)
    assert not (out / ".quantize" / "hidden").exists()


def test_skip_rtn_loss_on_two_ranks_is_one_processs_bytes(one_rank, tmp_path):
    """Two ranks exchange two captures instead of three under --skip-rtn-loss: the same bytes and
    losses as one process without it, the RTN figures not measured, and the log says so."""
    src, one = one_rank
    two = tmp_path / "two"
    p = _cli("convert", str(src), str(two), *ARGS, "--nproc", "2", "--skip-rtn-loss")
    assert p.returncode == 0, p.stderr[-2000:]
    assert weights_only(two) == weights_only(one)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("loss_rtn", "rel_err_rtn")} for r in rows]  # noqa: E731
    assert strip(method_layers(two)) == strip(method_layers(one))
    assert all(r["loss_rtn"] is None for r in method_layers(two) if r.get("units"))
    assert "(RTN's not measured)" in p.stdout + p.stderr
