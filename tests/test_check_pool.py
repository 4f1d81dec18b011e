"""check's INT4 modules on a pool of workers: the same rows, in the same order, with the same
progress events, whatever the number of workers (each module's activations are drawn in module
order on the calling thread); a module whose tensors do not fit its weight_shape keeps its place."""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import quantize.check as C
from quantize import archs
from quantize.checkpoint.index import CheckpointIndex


def _modules(index: CheckpointIndex) -> list[str]:
    return [n[: -len(".weight_packed")] for n in index.tensors if n.endswith(".weight_packed")]


def _run(model: Path, workers: int, fp8_act=frozenset()):
    index = CheckpointIndex.open(model)
    arch = archs.resolve(index.config, str(model / "config.json"))
    events: list[dict] = []
    rows = C._check_modules(model, index, arch, _modules(index), 4, torch.Generator().manual_seed(7), set(fp8_act),
                            events.append, workers=workers)
    return index, rows, events


def _reference_rows(model: Path, index: CheckpointIndex, modules: list[str]) -> list[dict]:
    """The loop check ran before the pool, written out here: one module after another, the
    activations drawn in module order, a misfit module skipped without drawing."""
    g = torch.Generator().manual_seed(7)
    arch = archs.resolve(index.config, str(model / "config.json"))
    out = []
    for m in modules:
        shape = tuple(int(v) for v in C.read_tensor(model, index.tensors[m + ".weight_shape"]).tolist())
        packed = C.read_tensor(model, index.tensors[m + ".weight_packed"])
        scale = C.read_tensor(model, index.tensors[m + ".weight_scale"])
        row = C.Row(m, arch.role_of(m + ".weight")[0])
        if tuple(packed.shape) != (shape[0], -(-shape[1] // 8)) or scale.shape[0] != shape[0]:
            row.failures.append("misfit")
            out.append(asdict(row))
            continue
        x = torch.randn(4, shape[1], generator=g).to(torch.bfloat16)
        row.unpack_ok = C._unpack_ok(packed, shape)
        row.kernel_rel_err = C._kernel_err(x, packed, scale, shape)[0]
        out.append(asdict(row))
    return out


def test_the_rows_are_the_same_on_one_worker_and_on_four(converted):
    model = converted("glm_moe_dsa")
    index, one, ev1 = _run(model, 1)
    _, four, ev4 = _run(model, 4)
    modules = _modules(index)
    assert len(modules) > 8  # more modules than the window of four workers holds
    assert [asdict(r) for r in one] == [asdict(r) for r in four] == _reference_rows(model, index, modules)
    assert ev1 == ev4 == [{"event": "tensor", "name": m, "done_bytes": i + 1} for i, m in enumerate(modules)]
    assert all(r.kernel_rel_err is not None and r.kernel_rel_err <= C.KERNEL_RTOL for r in four)


def test_a_misfit_module_keeps_its_place_and_draws_no_activations(converted, tmp_path):
    src = converted("glm_moe_dsa")
    model = tmp_path / "m"
    shutil.copytree(src, model)
    index = CheckpointIndex.open(model)
    modules = _modules(index)
    bad = modules[len(modules) // 2]
    ref = index.tensors[bad + ".weight_shape"]
    path = model / ref.file
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors[bad + ".weight_shape"] = tensors[bad + ".weight_shape"] + torch.tensor([1, 0])  # one row too many
    save_file(tensors, path, metadata=meta)
    index, one, ev1 = _run(model, 1)
    _, three, ev3 = _run(model, 3)
    got = [asdict(r) for r in three]
    assert [asdict(r) for r in one] == got
    at = modules.index(bad)
    assert three[at].tensor == bad and "do not fit weight_shape" in three[at].failures[0]
    assert three[at].kernel_rel_err is None
    assert all(not r.failures for i, r in enumerate(three) if i != at)
    # the modules after it drew the activations the sequential loop gives them (it drew none for the misfit)
    want = _reference_rows(model, index, modules)
    assert [r["kernel_rel_err"] for r in got] == [r["kernel_rel_err"] for r in want]
    assert [e["name"] for e in ev3] == [m for m in modules if m != bad]  # no progress event for the misfit
    assert [e["done_bytes"] for e in ev3] == [i + 1 for i, m in enumerate(modules) if m != bad]


def test_workers_one_per_cpu_and_one_with_a_gpu(monkeypatch):
    monkeypatch.setattr(C, "usable_cpus", lambda: 7)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert C.check_workers() == 7
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert C.check_workers() == 1


@pytest.mark.parametrize("workers", [1, 3])
def test_torch_threads_are_restored_after_the_pool(converted, workers):
    before = torch.get_num_threads()
    _run(converted("glm_moe_dsa"), workers)
    assert torch.get_num_threads() == before


def test_compressed_tensors_is_imported_before_any_worker_starts(converted):
    """Two threads importing one package can see it half-initialised: the workers' unpack comparison
    must find compressed-tensors' helpers imported already (in a fresh process, where nothing else
    imported them)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        from concurrent.futures import ThreadPoolExecutor
        from pathlib import Path
        import torch
        import quantize.check as C
        from quantize import archs
        from quantize.checkpoint.index import CheckpointIndex
        HELPERS = "compressed_tensors.compressors.pack_quantized.helpers"
        assert HELPERS not in sys.modules
        seen = []
        submit = ThreadPoolExecutor.submit
        def spy(self, *a, **k):
            seen.append(HELPERS in sys.modules)
            return submit(self, *a, **k)
        ThreadPoolExecutor.submit = spy
        model = Path({str(converted("glm_moe_dsa"))!r})
        index = CheckpointIndex.open(model)
        arch = archs.resolve(index.config, str(model / "config.json"))
        mods = [n[: -len(".weight_packed")] for n in index.tensors if n.endswith(".weight_packed")]
        rows = C._check_modules(model, index, arch, mods, 4, torch.Generator().manual_seed(0), set(),
                                lambda e: None, workers=2)
        assert seen and all(seen), seen
        assert all(r.unpack_ok and not r.failures for r in rows)
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_one_worker_checks_every_module_on_the_calling_thread(converted, monkeypatch):
    """With a GPU visible check uses one worker: its CUDA kernels must run from the thread that
    called check, never from a pool thread (CUDA's lazy initialisation is not safe there)."""
    import threading

    seen: set[str] = set()
    real = C._module_row

    def spy(*a, **k):
        seen.add(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(C, "_module_row", spy)
    _run(converted("glm_moe_dsa"), 1)
    assert seen == {threading.current_thread().name}
    seen.clear()
    _run(converted("glm_moe_dsa"), 2)
    assert seen and threading.current_thread().name not in seen  # the pool's threads
