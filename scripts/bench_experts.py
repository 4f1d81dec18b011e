#!/usr/bin/env python3
"""Peak memory of calibrate-kv, GPTQ and AutoRound on MoE layers of DeepSeek-V3's real widths, by routed expert
count (AutoRound also by rank count: each rank trains its own experts).

The fixture is written tensor by tensor (a whole 64-expert model would not fit in memory to be
built by transformers): DeepSeek-V3's hidden 7168, moe_intermediate 2048, 128 heads, q/kv LoRA
ranks 1536/512, block FP8 weights as DeepSeek ships them (128x128 ``weight_scale_inv``), router
8 groups / 4 kept / 8 experts per token, a small vocabulary. Each measured run is its own
process (peak RSS = its VmHWM; GPTQ with --min-expert-tokens 0, so that every expert of the 32
calibration tokens runs GPTQ; AutoRound 2 steps of 2 samples, ``autoround-N`` as N ranks on gloo,
``autoround-gptq-N`` the same from GPTQ's start, peak RSS the largest rank's). ``--before PATH`` runs
the same command with another checkout of this tool on PYTHONPATH (e.g. a worktree at an older commit),
side by side. Not a test.

    python scripts/bench_experts.py [--experts 16 64] [--layers 2]
                                    [--commands calibrate-kv gptq autoround-1 autoround-2 autoround-gptq-1]
                                    [--memory-budget-gib 1] [--before /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTHS = {
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0,
}

RUN = r"""
import json, sys, time
t = time.time()
cmd, src, out, budget = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
if cmd == "calibrate-kv":
    from quantize.calibrate.kv import calibrate_kv
    kw = {"memory_budget_gib": float(budget)} if budget != "-" else {}
    calibrate_kv(src, samples=2, seq_len=16, target="vllm", **kw)
elif cmd.startswith("autoround-"):  # as N ranks (torchrun's agent in this process): the largest rank's peak
    import resource, subprocess
    args = [sys.executable, "-m", "quantize.cli", "convert", src, out, "--method", "autoround", "--iters", "2",
            "--batch-size", "2", "--lr", "0.005", "--samples", "2", "--seq-len", "16", "--min-expert-tokens", "0",
            "--nproc", cmd.rsplit("-", 1)[1]] + (["--memory-budget-gib", budget] if budget != "-" else []) + (
            ["--init", "gptq"] if cmd.startswith("autoround-gptq-") else [])
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode:
        sys.exit(p.stderr.strip().splitlines()[-1])
    ranks = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({"seconds": time.time() - t, "peak_rss": ranks}))
    sys.exit(0)
else:
    from quantize.convert import convert
    kw = {"memory_budget_gib": float(budget)} if budget != "-" else {}
    convert(src, out, method="gptq", samples=2, seq_len=16, min_expert_tokens=0, **kw)  # every expert GPTQ, not RTN
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"seconds": time.time() - t, "peak_rss": int(hwm) * 1024}))
"""


def build(out: Path, experts: int, layers: int) -> Path:
    """A DeepSeek-V3 checkpoint at real width with ``experts`` routed experts per layer."""
    import torch
    from safetensors.torch import save_file

    from quantize.archs import REGISTRY, ROLES
    from quantize.formats import fp8
    from quantize.testing.tiny import VENDOR_FP8, make_tiny

    base = make_tiny("deepseek_v3", out.parent / f"{out.name}-base", layout="fp8")
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("model.safetensors.index.json", "quantize_manifest.json") \
                and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(WIDTHS, n_routed_experts=experts, num_hidden_layers=layers)
    if experts < 2 * WIDTHS["n_group"]:  # (AutoRound's fixtures: fewer experts) one group, all of it kept
        cfg.update(n_group=1, topk_group=1)
    A = REGISTRY["deepseek_v3"]
    g = torch.Generator().manual_seed(0)
    weight_map, shard, size, n, skip = {}, {}, 0, 0, []

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, shape, role in A.expected(cfg):
        lin, _, keep = ROLES[role]
        if role == "norm":
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        if name.endswith("e_score_correction_bias"):
            t = t.float()
        if name.endswith(".weight") and t.ndim == 2 and lin and not keep:
            q, s = fp8.quant_block(t.float())
            shard[name], shard[name[: -len("weight")] + "weight_scale_inv"] = q, s
            size += q.numel() + s.numel() * 4
        else:
            shard[name] = t.contiguous()
            size += t.numel() * t.element_size()
            if name.endswith(".weight") and t.ndim == 2 and lin:
                skip.append(name[: -len(".weight")])
        if size > 1 << 30:
            flush()
    flush()
    qc = dict(VENDOR_FP8)
    qc["modules_to_not_convert"] = sorted(set(skip))
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.rmtree(base)
    return out


def measure(cmd: str, src: Path, work: Path, budget: str, pythonpath: str) -> dict:
    out = work / f"out-{cmd}-{time.time_ns()}"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    p = subprocess.run([sys.executable, "-c", RUN, cmd, str(src), str(out), budget], capture_output=True, text=True,
                       env=env)
    shutil.rmtree(out, ignore_errors=True)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--layers", type=int, default=2, help="MoE decoder layers")
    ap.add_argument("--commands", nargs="+", default=["calibrate-kv", "gptq"],
                    help="calibrate-kv, gptq, autoround-N (N ranks), autoround-gptq-N (--init gptq)")
    ap.add_argument("--memory-budget-gib", default="-", help="passed to both commands ('-': their default)")
    ap.add_argument("--before", help="another checkout of this tool, run side by side (its default budget)")
    ap.add_argument("--work", help="folder for the fixtures (default: a temporary folder; several GB)")
    a = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-experts-"))
    rows = []
    try:
        for e in a.experts:
            src = build(work / f"dsv3-{e}", e, a.layers)
            disk = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            for cmd in a.commands:
                now = measure(cmd, src, work, a.memory_budget_gib, here)
                old = measure(cmd, src, work, "-", a.before) if a.before else None
                rows.append((e, disk, cmd, now, old))
                print(json.dumps({"experts": e, "command": cmd, "now": now, "before": old}), flush=True)
            shutil.rmtree(src)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    gib = lambda r: f"{r['peak_rss'] / 2**30:6.2f} GiB {r['seconds']:7.1f} s" if r and "peak_rss" in r else \
        (r or {}).get("error", "-")  # noqa: E731
    print(f"\n{'experts':>7s} {'FP8 on disk':>12s} {'command':>13s}  {'peak RSS, wall (now)':>22s}  before")
    for e, disk, cmd, now, old in rows:
        print(f"{e:7d} {disk / 2**30:8.2f} GiB {cmd:>13s}  {gib(now):>22s}  {gib(old)}")
    for cmd in a.commands:
        got = [r[3]["peak_rss"] for r in rows if r[2] == cmd and "peak_rss" in r[3]]
        if len(got) > 1:
            print(f"{cmd}: peak RSS ratio {a.experts[-1]}/{a.experts[0]} experts: {got[-1] / got[0]:.3f}")


if __name__ == "__main__":
    main()
