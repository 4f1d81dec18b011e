#!/usr/bin/env python3
"""The first command on a new GPU node (``scripts/gpu_check.sh`` runs it): every CUDA path of the
tool, each step time-boxed in its own process, then one table of results and timings. Offline (no
Hub): the real-width fixture is built here (DeepSeek-V3 widths, 2 MoE layers x 16 routed experts,
block FP8 as shipped, ``scripts/bench_experts.py``'s ``build``), the calibration text is the GSM8K
subset shipped in eval/. Not a test: figures for the closing note and the README's GPU section.

    python scripts/gpu_check.py [--out DIR] [--budget-s 480] [--skip kernels ...]

Steps, the headline ones first: env; the fixture; GPTQ on cuda (its log read for progress lines) and
check on what it wrote; calibrate-kv on cuda; convert RTN on the CPU and its refusal on cuda; a
two-rank NCCL GPTQ where two GPUs exist; the kernels (scripts/bench_kernels.py); GPU-seconds per
routed expert (scripts/bench_gptq_cost.py --device cuda); pytest's GPU tests; the disk floor
(scripts/bench_convert.py). A step gets what is left of the budget at most.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "eval" / "data" / "gsm8k" / "test.jsonl"


class Check:
    def __init__(self, out: Path, budget_s: float, skip: set[str]):
        self.out, self.t0, self.budget, self.skip = out, time.time(), budget_s, skip
        self.rows: list[dict] = []
        self.log = open(out / "gpu_check.log", "w")

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def run(self, name: str, cmd: list[str], timeout: float, log: Path | None = None):
        """One step in its own process, at most ``timeout`` seconds (less if the budget is short):
        (rc, seconds, output tail)."""
        if name in self.skip:
            self.rows.append({"step": name, "result": "skipped (--skip)"})
            return None, 0.0, ""
        timeout = min(timeout, max(5.0, self.left()))
        t = time.time()
        e = {**os.environ, "PYTHONUNBUFFERED": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
             "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        self.log.write(f"\n===== {name}: {' '.join(map(str, cmd))}\n")
        self.log.flush()
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                               cwd=ROOT, env=e)
            rc, text = p.returncode, p.stdout
        except subprocess.TimeoutExpired as x:
            rc, text = 124, (x.stdout or b"").decode() if isinstance(x.stdout, bytes) else (x.stdout or "")
        sec = time.time() - t
        self.log.write(text)
        self.log.write(f"\n----- {name}: rc {rc}, {sec:.1f} s\n")
        self.log.flush()
        if log is not None:
            log.write_text(text)
        return rc, sec, text

    def row(self, step: str, result: str, seconds: float | None = None, **extra) -> None:
        self.rows.append({"step": step, "result": result, "seconds": None if seconds is None else round(seconds, 1),
                          **extra})
        print(f"[gpu_check] {step}: {result}" + (f" ({seconds:.1f} s)" if seconds is not None else ""), flush=True)
        (self.out / "gpu_check.json").write_text(json.dumps({"rows": self.rows}, indent=1))  # so far, if killed


def _tail(text: str, n: int = 1) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return " | ".join(lines[-n:])[:300] if lines else ""


def _where(out: Path) -> str:
    """Where an RTN convert's time went, from its manifest (``kernels``: the path and the shard phase's
    ``phase_seconds``): what the node's CPU side is bound by."""
    try:
        m = json.loads((out / "quantize_manifest.json").read_text())
        k, ph = m["kernels"], m["kernels"]["phase_seconds"]
    except (OSError, ValueError, KeyError) as e:
        return f"no phase figures ({type(e).__name__})"
    why = f" ({k['reason']})" if k.get("reason") else ""
    return (f"own {m['seconds']:.1f} s, {k['path']} kernels{why}: {k['workers']} workers compute {ph['compute']:.1f} s "
            f"in all, writer {ph['write']:.1f} s writing and hashing, {ph['wait']:.1f} s waiting, commit "
            f"{ph['commit']:.1f} s")


def _quantize(*args) -> list[str]:
    return [sys.executable, "-m", "quantize.cli", *map(str, args)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantize-gpu-check"))
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole check's wall-clock budget")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--skip", nargs="*", default=[])
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    c = Check(a.out, a.budget_s, set(a.skip))
    import torch

    gpus = torch.cuda.device_count()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus,
           "gpu": torch.cuda.get_device_name() if gpus else None, "cores": os.cpu_count()}
    sys.path.insert(0, str(ROOT))  # the checkout, installed or not
    from quantize.options import usable_cpus

    env["cores_usable"] = usable_cpus()  # affinity and cgroup quota: what convert's default workers use
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    c.row("env", json.dumps(env))
    if not gpus:
        c.row("cuda", "FAIL: no CUDA GPU visible")

    # 1. the real-width fixture
    src = a.work / "dsv3-16"
    t = time.time()
    if "fixture" not in c.skip:
        sys.path.insert(0, str(ROOT / "scripts"))
        sys.path.insert(0, str(ROOT))
        from bench_experts import build

        build(src, 16, 2)
        disk = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        c.row("fixture (DeepSeek-V3 widths, 2 MoE layers x 16 experts, block FP8)", f"{disk / 2**30:.2f} GiB",
              time.time() - t)
    else:
        disk = 0

    cal = ["--data", GSM8K, "--samples", a.samples, "--seq-len", a.seq_len]
    if disk:
        # 2. GPTQ on the GPU, its log read as a user's nohup would leave it
        log = a.out / "gptq.log"
        gout = a.work / "gptq"
        rc, sec, text = c.run("gptq cuda", _quantize("convert", src, gout, "--method", "gptq", "--device", "cuda",
                                                     *cal, "--memory-budget-gib", 32), 300, log=log)
        if rc is not None:
            lines = [x for x in text.splitlines() if x.strip()]
            plain = not any("\x1b" in x or "\r" in x for x in lines)
            ok = rc == 0
            extra = {}
            if ok:
                whole = json.loads((gout / "quantize_manifest.json").read_text())
                man = whole["method"]
                phases: dict[str, float] = {}
                for x in man["layers"]:
                    for k, v in (x.get("phase_seconds") or {}).items():
                        phases[k] = round(phases.get(k, 0.0) + v, 2)
                extra = {"phases": phases, "layers": [{k: x.get(k) for k in ("layer", "rel_err_rtn", "rel_err",
                                                                            "seconds")} for x in man["layers"]],
                         "fallbacks": len(man.get("rtn", [])),
                         # the whole wall: the process's start-up (imports, CUDA) before convert's own steps
                         "wall": {"process_start": round(sec - whole["seconds"], 2), **whole["wall_seconds"]}}
            c.row("convert --method gptq --device cuda (100 GSM8K, <= 512 tokens)",
                  (f"ok, target <= 60 s: {'MET' if sec <= 60 else 'MISSED'}; log {len(lines)} lines, "
                   f"{'plain' if plain else 'CONTROL CHARACTERS'}; wall {extra.get('wall')}; "
                   f"layer phases {extra.get('phases')}") if ok else
                  f"FAIL rc {rc}: {_tail(text, 3)}", sec, **extra)

            # 3. check, on what GPTQ wrote
            if ok:
                rc, sec, text = c.run("check", _quantize("check", gout, "--source", src), 150)
                c.row("check OUT --source SRC", "passes" if rc == 0 else f"FAIL rc {rc}: {_tail(text, 2)}", sec)
            shutil.rmtree(gout, ignore_errors=True)

        # 4. calibrate-kv on the GPU
        rc, sec, text = c.run("calibrate-kv cuda", _quantize("calibrate-kv", src, "--device", "cuda", *cal,
                                                             "--stats-out", a.work / "kv.json"), 150)
        if rc is not None:
            c.row("calibrate-kv --device cuda", "ok" if rc == 0 else f"FAIL rc {rc}: {_tail(text, 2)}", sec)

        # 5. RTN: the CPU's native kernels; cuda refused in one line
        rc, sec, text = c.run("rtn cuda", _quantize("convert", src, a.work / "rtn-cuda", "--device", "cuda"), 60)
        ok = rc == 2 and "drop --device" in text and not (a.work / "rtn-cuda").exists()
        if rc is not None:  # None: skipped, its row already says so
            c.row("convert RTN --device cuda", ("refused in one line, nothing written" if ok else
                                                f"FAIL rc {rc}: {_tail(text)}"), sec)
        rc, sec, text = c.run("rtn cpu", _quantize("convert", src, a.work / "rtn-cpu", "--json"), 120)
        if rc is not None:
            c.row("convert RTN --device cpu", f"{disk / sec / 1e9:.3f} GB/s of source; {_where(a.work / 'rtn-cpu')}"
                  if rc == 0 else f"FAIL rc {rc}: {_tail(text)}", sec)
        shutil.rmtree(a.work / "rtn-cpu", ignore_errors=True)

        # 6. two ranks over NCCL, where two GPUs exist
        if gpus >= 2:
            rc, sec, text = c.run("gptq nccl 2", _quantize("convert", src, a.work / "gptq2", "--method", "gptq",
                                                           "--device", "cuda", "--nproc", 2, *cal), 300)
            c.row("convert --method gptq --device cuda --nproc 2 (NCCL)", "ok" if rc == 0 else
                  f"FAIL rc {rc}: {_tail(text, 2)}", sec)
        else:
            c.row("convert --nproc 2 over NCCL", f"not run: {gpus} GPU on this node")

        # 6b. GPTQ again without the report's RTN passes (the same bytes): what --skip-rtn-loss saves on
        # this GPU, where the budget leaves room for it and the steps after it
        if c.left() > 300:
            sout = a.work / "gptq-skip"
            rc, sec, text = c.run("gptq cuda skip-rtn-loss", _quantize(
                "convert", src, sout, "--method", "gptq", "--device", "cuda", *cal, "--memory-budget-gib", 32,
                "--skip-rtn-loss"), 150)
            if rc is not None:
                try:
                    wall = json.loads((sout / "quantize_manifest.json").read_text())["wall_seconds"]
                    res = f"ok, target <= 60 s: {'MET' if sec <= 60 else 'MISSED'}; wall {wall}" if rc == 0 else \
                        f"FAIL rc {rc}: {_tail(text, 3)}"
                except (OSError, ValueError, KeyError) as e:
                    res = f"rc {rc}, no manifest ({type(e).__name__}): {_tail(text, 2)}"
                c.row("convert --method gptq --device cuda --skip-rtn-loss", res, sec)
            shutil.rmtree(sout, ignore_errors=True)
        else:
            c.row("convert --method gptq --device cuda --skip-rtn-loss", f"not run: {c.left():.0f} s of budget left")
        shutil.rmtree(src, ignore_errors=True)

    # 7. the kernels against BF16
    rc, sec, text = c.run("kernels", [sys.executable, "scripts/bench_kernels.py", "--out", a.out / "kernels.json"],
                          150)
    if rc is not None:
        c.row("kernels (scripts/bench_kernels.py)", "ok" if rc == 0 else f"FAIL rc {rc}: {_tail(text, 2)}", sec)
        print(text[-3000:], flush=True)

    # 8. GPU-seconds per routed expert at real width (the batched GPU path)
    rc, sec, text = c.run("expert cost", [sys.executable, "scripts/bench_gptq_cost.py", "--device", "cuda",
                                          "--experts", "16", "--tokens", "2048", "--model", "deepseek-v3", "glm-5",
                                          "kimi-k2.6", "--json", a.work / "cost.json"], 120)
    cost = json.loads((a.work / "cost.json").read_text()) if rc == 0 else {}
    if rc is not None:
        c.row("GPU-s per routed expert (16 batched, 2048 tokens each)",
              "; ".join(f"{k}: Hessians {v['hessian_s']:.3f} + GPTQ {v['gptq_s']:.3f} s" for k, v in cost.items())
              or f"FAIL rc {rc}: {_tail(text, 2)}", sec)

    # 9. the GPU tests
    rc, sec, text = c.run("pytest", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                                     "gpu or not gpu", "tests/test_gpu.py", "tests/test_kernels.py",
                                     "tests/test_gpu_path.py"], 170)
    if rc is not None:
        c.row("pytest tests/test_gpu.py test_kernels.py test_gpu_path.py", f"rc {rc}: {_tail(text)}", sec)

    # 10. the disk floor and convert's fraction of it
    rc, sec, text = c.run("disk floor", [sys.executable, "scripts/bench_convert.py", "--gb", "1.0", "--skip-baseline",
                                         "--work", a.work / "bench-convert"], 150)
    if rc is not None:
        frac = [x for x in text.splitlines() if "floor throughput" in x]
        c.row("scripts/bench_convert.py --gb 1 (RTN vs read+write+fsync)", (frac[0].strip() if frac else "?")
              if rc == 0 else f"FAIL rc {rc}: {_tail(text, 2)}", sec)
        if rc == 0:  # the writer thread's own ceiling on this node (hashing after vs beside each write)
            w = [x for x in text.splitlines() if x.startswith("the writer thread alone")]
            c.row("bench_convert: the writer thread alone", w[0].strip() if w else "?", None)

    (a.out / "gpu_check.json").write_text(json.dumps({"env": env, "rows": c.rows, "cost": cost,
                                                      "seconds": round(time.time() - c.t0, 1)}, indent=1))
    print(f"\n{'step':70s} {'s':>6s}  result")
    for r in c.rows:
        s = "" if r.get("seconds") is None else f"{r['seconds']:6.1f}"
        print(f"{r['step'][:70]:70s} {s:>6s}  {r['result']}")
    print(f"total {time.time() - c.t0:.0f} s (budget {a.budget_s:.0f} s)")
    shutil.rmtree(a.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
