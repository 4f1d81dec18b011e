#!/usr/bin/env python3
"""GPTQ (or AutoRound, --method autoround) as 1 and as N ranks (gloo on this machine's CPUs) on an
expert-heavy MoE: the output's bytes compared, the wall times side by side in one run. Not a test.
GPTQ's ranks split the calibration samples and the routed experts; AutoRound's each step's samples.

The fixture is a tiny GLM-5 (glm_moe_dsa), by default with many wide routed experts, so that the
experts' GPTQ is most of the work; with few narrow experts, long samples and ``--profile
all-linear`` the attention, its Hessians and the captures are (GPTQ's ranks split those by
calibration sample). Each rank runs one torch thread per op; with 2 cores, 2 ranks is the most this
machine can show.

    python scripts/bench_ranks.py [--ranks 2] [--experts 32] [--moe-intermediate 1024] [--hidden 1024]
    python scripts/bench_ranks.py --profile all-linear --experts 4 --moe-intermediate 128 --samples 16 --seq-len 512
    python scripts/bench_ranks.py --method autoround --iters 20 --experts 8 --hidden 512 --moe-intermediate 512
    python scripts/bench_ranks.py --experts 8 --moe-intermediate 256 --samples 32 --seq-len 512 --hidden 2048 \\
        --memory-budget-gib 0.05 --long-texts [--tool ../older-checkout]    # the exchange under a small budget

The peak RSS is that of the largest process (one rank, or the launcher).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--method", choices=("gptq", "autoround"), default="gptq")
    ap.add_argument("--profile", default="experts", help="convert's --profile (all-linear: attention too)")
    ap.add_argument("--iters", type=int, default=20, help="autoround: steps per layer")
    ap.add_argument("--memory-budget-gib", help="convert's --memory-budget-gib (default: its own)")
    ap.add_argument("--long-texts", action="store_true",
                    help="calibrate on texts of the whole shipped corpus each (so every sample reaches --seq-len)")
    ap.add_argument("--tool", help="another checkout of this tool to time instead (e.g. an older commit's worktree)")
    a = ap.parse_args()
    here = str(Path(a.tool).resolve() if a.tool else Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src"
        over = [f"n_routed_experts={a.experts}", f"hidden_size={a.hidden}",
                f"moe_intermediate_size={a.moe_intermediate}", "num_hidden_layers=3"]
        subprocess.run([sys.executable, "-m", "quantize.cli", "make-tiny", "glm_moe_dsa", str(src),
                        *sum((["--override", o] for o in over), [])], check=True, env=env, capture_output=True)
        common = ["--method", a.method, "--profile", a.profile, "--samples", str(a.samples),
                  "--seq-len", str(a.seq_len), "--min-expert-tokens", "0", "--workers", "1"]
        common += ["--iters", str(a.iters)] if a.method == "autoround" else []
        common += ["--memory-budget-gib", a.memory_budget_gib] if a.memory_budget_gib else []
        if a.long_texts:
            import json

            corpus = (Path(here) / "quantize" / "calibrate" / "default_corpus.txt").read_text()
            texts = Path(d) / "long.jsonl"
            texts.write_text("".join(json.dumps({"text": f"{k}. {corpus}"}) + "\n" for k in range(a.samples)))
            common += ["--data", str(texts)]
        rows = {}
        for n in (1, a.ranks):
            out = Path(d) / f"r{n}"
            t = time.perf_counter()
            cmd = [sys.executable, "-m", "quantize.cli", "convert", str(src), str(out), *common,
                   *(["--nproc", str(n)] if n > 1 else [])]
            # in a wrapper of its own, whose RUSAGE_CHILDREN peak is the largest of its processes (a rank or
            # the launcher): the peak RSS of one process, not the sum
            wrap = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, "
                    "text=True); sys.stderr.write(r.stderr); "
                    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
            p = subprocess.run([sys.executable, "-c", wrap, *cmd], env=env, capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(p.stderr[-2000:])
            rows[n] = (time.perf_counter() - t, digest(out), int(p.stdout.split()[-1]) / (1 << 20))
    (t1, d1, _), (tn, dn, _) = rows[1], rows[a.ranks]
    print(f"{'ranks':>5s} {'wall s':>8s} {'peak RSS GiB':>13s}  output sha256   ({here})")
    for n, (t, dg, rss) in rows.items():
        print(f"{n:5d} {t:8.1f} {rss:13.2f}  {dg[:16]}")
    print(f"{a.method}: byte-identical: {d1 == dn}; wall ratio {a.ranks} ranks / 1 rank: {tn / t1:.2f}")


if __name__ == "__main__":
    main()
