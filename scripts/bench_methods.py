#!/usr/bin/env python3
"""Fidelity of the INT4 methods, side by side in one run (a benchmark, not a test).

SmolLM2-135M-Instruct (scripts/smollm2_to_hf.py), every decoder Linear INT4, at each --groups size:
RTN (minmax, mse, fullrange), GPTQ (minmax, its default full-range grid, and with --asym) and AutoRound,
calibrated on GSM8K train; KL divergence against the BF16 source over --chunks x --chunk tokens of GSM8K test (in
domain) and of ARC questions with their choices (out of domain), one table per text with each
method's ratio to RTN minmax. Then the tiny glm_moe_dsa and deepseek_v3 fixtures (BF16 sources,
routed experts INT4): KLD against the source and the tokens-per-expert report of each MoE layer. The
closing note gives wall time per decoder layer and the peak RSS of each conversion (each runs as its
own process).

    python scripts/bench_methods.py --smollm2 /tmp/smollm2 --work /tmp/bench [--groups 32 64]
        [--samples 64] [--seq-len 512] [--iters 50] [--chunks 16] [--chunk 512] [--only gptq,autoround] [--depth]
        [--pack]   # samples of exactly --seq-len tokens, and the auto-round package itself on the same samples
        [--only gptq,gptq-asym,auto-round]   # ours one text per sample, auto-round on --pack's samples
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DATA: Path  # --data-dir: local eval data, the files docs/evaluation.md#local-data lists


# The CLI in a child that writes its own VmHWM at exit: a child's ru_maxrss (wait4, getrusage)
# starts from its parent's high-water mark at fork (Linux carries it across exec), so once this
# process holds a model for the KLD tables every child would report this process's size instead.
CHILD = """import atexit, os, runpy, sys
def _hwm():
    with open(os.environ["BENCH_HWM"], "w") as f:
        f.write(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:")))
atexit.register(_hwm)
sys.argv = ["quantize", *sys.argv[1:]]
runpy.run_module("quantize.cli", run_name="__main__")
"""


def convert(src: Path, out: Path, args: list[str], reuse: bool) -> dict:
    """One conversion through the CLI in its own process: wall seconds and peak RSS (its VmHWM)."""
    if reuse and (out / "quantize_manifest.json").exists():
        m = json.loads((out / "quantize_manifest.json").read_text())
        return {"seconds": m.get("seconds"), "peak_rss_mib": None, "reused": True, "manifest": m}
    cmd = [sys.executable, "-c", CHILD, "convert", str(src), str(out), "--overwrite", "--json", *args]
    log = out.with_name(out.name + ".log")
    hwm = out.with_name(out.name + ".hwm")
    hwm.unlink(missing_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "BENCH_HWM": str(hwm)}).returncode
    seconds = time.time() - t0
    if rc:
        lines = log.read_text().strip().splitlines()
        raise SystemExit(f"convert {' '.join(args)} failed: {lines[-1] if lines else '?'} (log: {log})")
    m = json.loads((out / "quantize_manifest.json").read_text())
    return {"seconds": seconds, "peak_rss_mib": int(hwm.read_text()) / 1024 if hwm.exists() else None,
            "reused": False, "manifest": m}


AUTO_ROUND = """import json, sys, time
from pathlib import Path
import torch, transformers
from auto_round import AutoRound
from quantize.calibrate.data import build_samples
src, out, g, iters, n, seq, data = sys.argv[1:8]
ids = build_samples(Path(src), data, int(n), int(seq), pack=True).ids  # convert --pack's very samples
tok = transformers.AutoTokenizer.from_pretrained(src)
model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
t = time.time()
ar = AutoRound(model, tok, bits=4, group_size=int(g), sym=True, iters=int(iters), nsamples=int(n), seqlen=int(seq),
               batch_size=8, dataset=[x.unsqueeze(0) for x in ids], device_map="cpu")
ar.quantize_and_save(out, format="fake")
Path(out, "bench_seconds.json").write_text(json.dumps({"seconds": time.time() - t}))
"""


def auto_round(src: Path, out: Path, g: int, a, reuse: bool) -> dict:
    """The auto-round package itself (installed with llmcompressor) on ``convert --pack``'s samples, the
    same group, iterations and batch: its fake-quantized model saved, its source recorded for eval-kld."""
    from quantize.checkpoint.manifest import MANIFEST, derived_from

    done = out / "bench_seconds.json"
    if not (reuse and done.exists()):
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        p = subprocess.run([sys.executable, "-c", AUTO_ROUND, str(src), str(out), str(g), str(a.iters),
                            str(a.samples), str(a.seq_len), str(DATA / "gsm8k" / "train.jsonl")],
                           capture_output=True, text=True, env=env)
        if p.returncode:
            raise SystemExit(f"auto-round failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    # auto-round saves the fake-quantized model in a folder of its own naming under ``out``
    model = out if (out / "config.json").exists() else next(d for d in out.iterdir() if (d / "config.json").exists())
    (model / MANIFEST).write_text(json.dumps({"source": derived_from(src)}))  # eval-kld: made from src
    return {"out": model, "seconds": json.loads(done.read_text())["seconds"], "peak_rss_mib": None, "reused": reuse,
            "manifest": {}}


def texts(work: Path) -> dict[str, Path]:
    work.mkdir(parents=True, exist_ok=True)
    gsm, arc = work / "gsm8k_test.txt", work / "arc_questions.txt"
    if not gsm.exists():
        recs = [json.loads(line) for line in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines() if line.strip()]
        gsm.write_text("\n\n".join(f"{r['question']}\n{r['answer']}" for r in recs))
    if not arc.exists():
        recs = [json.loads(line) for line in (DATA / "arc" / "arc_challenge.jsonl").read_text().splitlines()
                if line.strip()]
        arc.write_text("\n\n".join(f"{r['query']}\n"
                                   + "\n".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(r["choices"]))
                                   + f"\nAnswer: {chr(65 + r['gold'])}" for r in recs))
    return {"GSM8K test (in domain)": gsm, "ARC questions (out of domain)": arc}


def per_layer(m: dict) -> str:
    rep = m.get("method")
    if not rep:
        return "-"
    secs = [r["seconds"] for r in rep["layers"] if r.get("units")]
    return f"{statistics.mean(secs):.1f} s (max {max(secs):.1f})" if secs else "-"


def kld_rows(src: Path, runs: dict[str, dict], text: Path, tokens: int, chunk: int, first: str) -> list[tuple]:
    from quantize.evaluate.kld import kld_table

    names = list(runs)
    table = kld_table(src, [runs[n]["out"] for n in names], text=text, tokens=tokens, chunk=chunk)
    base = table.reports[names.index(first)].kld_mean if first in names else None
    return [(n, r.kld_mean, r.top1_agreement, r.kld_p99, r.kld_mean / base if base else None)
            for n, r in zip(names, table.reports)]


def print_table(title: str, rows: list[tuple], first: str) -> None:
    print(f"\n{title}")
    print(f"  {'method':<28} {'KLD mean':>10} {'top-1':>8} {'KLD p99':>9} {'/ ' + first:>14}")
    for n, k, t1, p99, ratio in rows:
        print(f"  {n:<28} {k:>10.4f} {t1:>8.2%} {p99:>9.3f} {ratio:>14.3f}" if ratio is not None
              else f"  {n:<28} {k:>10.4f} {t1:>8.2%} {p99:>9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", type=Path, help="SmolLM2 transformers checkpoint (scripts/smollm2_to_hf.py OUT)")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, required=True,
                    help="local eval data (docs/evaluation.md#local-data): GSM8K train/test and ARC-Challenge")
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--only", default=None,
                    help="comma-separated subset of rtn-minmax,rtn-mse,rtn-fullrange,gptq-minmax,gptq,gptq-asym,"
                         "autoround,autoround-gptq,auto-round (the auto-round package itself, on the same --pack "
                         "samples)")
    ap.add_argument("--asym", type=float, default=0.5, help="gptq-asym's --asym fraction")
    ap.add_argument("--pack", action="store_true",
                    help="calibrate our methods on samples of exactly --seq-len tokens (convert --pack); auto-round "
                         "(run with --pack, or named in --only) always takes such samples, its only kind")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--reuse", action="store_true",
                    help="keep finished conversions in --work (their timings are the recorded ones)")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--depth", action="store_true",
                    help="also peak RSS of GPTQ/AutoRound on a 4- and a 16-layer MoE (memory flat in depth)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the KLD evaluation (default 1: "
                    "on a shared machine OpenMP threads that wait on a busy core cost far more than they give)")
    a = ap.parse_args()
    global DATA
    DATA = a.data_dir
    import torch

    torch.set_num_threads(a.threads)
    cal = ["--data", str(DATA / "gsm8k" / "train.jsonl"), "--samples", str(a.samples), "--seq-len", str(a.seq_len),
           *(["--pack"] if a.pack else [])]
    wk = ["--workers", str(a.workers)] if a.workers else []
    methods = {
        "rtn-minmax": [],
        "rtn-mse": ["--observer", "mse"],
        "rtn-fullrange": ["--observer", "fullrange"],
        "gptq-minmax": ["--method", "gptq", "--observer", "minmax", *cal],
        "gptq": ["--method", "gptq", *cal],  # its default grid: fullrange
        "gptq-asym": ["--method", "gptq", "--asym", str(a.asym), *cal],
        "autoround": ["--method", "autoround", "--iters", str(a.iters), *cal],
        "autoround-gptq": ["--method", "autoround", "--init", "gptq", "--iters", str(a.iters), *cal],
    }
    if a.only:
        methods = {k: v for k, v in methods.items() if k in a.only.split(",")}
    results: dict = {"settings": vars(a) | {"work": str(a.work), "smollm2": str(a.smollm2)}, "smollm2": {}, "tiny": {}}
    notes = []
    if a.smollm2:
        txt = texts(a.work)
        for g in a.groups:
            runs = {}
            for name, extra in methods.items():
                out = a.work / f"smollm2-g{g}-{name}"
                r = convert(a.smollm2, out, ["--profile", "all-linear", "--group-size", str(g), *extra, *wk], a.reuse)
                runs[name] = {"out": out, **r}
                notes.append(f"SmolLM2 g{g} {name}: {r['seconds']:.0f} s"
                             + (f", peak RSS {r['peak_rss_mib']:.0f} MiB" if r["peak_rss_mib"] else "")
                             + f", per layer {per_layer(r['manifest'])}" + (" (reused)" if r["reused"] else ""))
            # auto-round takes full-length samples only: it runs on --pack's samples whether ours are packed or not
            if (a.pack and not a.only) or (a.only and "auto-round" in a.only.split(",")):
                name, out = "auto-round", a.work / f"smollm2-g{g}-auto-round"
                r = auto_round(a.smollm2, out, g, a, a.reuse)
                runs[name] = {"out": out, **r}
                notes.append(f"SmolLM2 g{g} {name}: {r['seconds']:.0f} s"
                             + (f", peak RSS {r['peak_rss_mib']:.0f} MiB" if r["peak_rss_mib"] else "")
                             + f", per layer {per_layer(r['manifest'])}" + (" (reused)" if r["reused"] else ""))
            first = "rtn-minmax" if "rtn-minmax" in runs else next(iter(runs))
            for label, path in txt.items():
                rows = kld_rows(a.smollm2, runs, path, a.chunks * a.chunk, a.chunk, first)
                print_table(f"SmolLM2-135M all-linear g{g}, {label}: KLD vs BF16 over {a.chunks}x{a.chunk} tokens",
                            rows, first)
                results["smollm2"].setdefault(f"g{g}", {})[label] = [
                    dict(zip(("method", "kld_mean", "top1", "kld_p99", "ratio"), r)) for r in rows]
            for name, r in runs.items():
                rep = r["manifest"].get("method")
                if rep:
                    lr = [x for x in rep["layers"] if x.get("units")]
                    results["smollm2"][f"g{g}"][f"{name} layers"] = [
                        {k: x.get(k) for k in ("layer", "loss_rtn", "loss", "seconds")} for x in lr]
    if not a.skip_tiny:
        from quantize.testing.tiny import make_tiny

        for arch in ("glm_moe_dsa", "deepseek_v3"):
            src = a.work / f"tiny-{arch}-bf16"
            if not (src / "quantize_manifest.json").exists():
                make_tiny(arch, src, layout="bf16", overwrite=True)
            runs = {}
            tiny_cal = ["--samples", "16", "--seq-len", "128"]
            for name, extra in (("rtn-minmax", []), ("rtn-fullrange", ["--observer", "fullrange"]),
                                ("gptq", ["--method", "gptq", *tiny_cal]),
                                ("gptq-asym", ["--method", "gptq", "--asym", str(a.asym), *tiny_cal]),
                                ("autoround", ["--method", "autoround", "--iters", str(a.iters), *tiny_cal]),
                                ("autoround-gptq", ["--method", "autoround", "--init", "gptq", "--iters", str(a.iters),
                                                    *tiny_cal])):
                out = a.work / f"tiny-{arch}-{name}"
                r = convert(src, out, extra + wk, a.reuse)
                runs[name] = {"out": out, **r}
            rows = kld_rows(src, runs, None, 1024, 128, "rtn-minmax")
            print_table(f"tiny {arch} (BF16 source, routed experts INT4 g32, 16 samples x 128 tokens of the "
                        "shipped corpus): KLD vs the source over 1024 tokens of the shipped text",
                        rows, "rtn-minmax")
            results["tiny"][arch] = {"kld": [dict(zip(("method", "kld_mean", "top1", "kld_p99", "ratio"), r))
                                             for r in rows]}
            for name in ("gptq", "autoround", "autoround-gptq"):
                rep = runs[name]["manifest"]["method"]
                for x in rep["layers"]:
                    t = x.get("tokens_per_expert")
                    if t:
                        print(f"  {name} layer {x['layer']}: tokens per expert min {t['min']} / median {t['median']} "
                              f"/ max {t['max']} ({t['experts']} experts); fallbacks {len(x['fallbacks'])}; "
                              f"loss {x['loss_rtn']:.3g} (RTN) -> {x['loss']:.3g}")
                named = {f["reason"] for f in rep["rtn"]}
                print(f"  {name}: {len(rep['rtn'])} weights RTN, named ({'; '.join(sorted(named))})")
                results["tiny"][arch][f"{name} layers"] = rep["layers"]
    if a.depth:
        # memory flat in depth: the same MoE layer 4 and 16 times (routed experts ~25 MiB BF16 a layer),
        # each conversion its own process, peak RSS from wait4
        from quantize.testing.tiny import make_tiny

        big = {"hidden_size": 512, "moe_intermediate_size": 1024, "intermediate_size": 1024}
        rows = []
        for n in (4, 16):
            src = a.work / f"depth-{n}-bf16"
            if not (src / "quantize_manifest.json").exists():
                make_tiny("deepseek_v3", src, layout="bf16", overwrite=True, mtp=False,
                          overrides={**big, "num_hidden_layers": n})
            src_mib = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 2**20
            for name, extra in (("gptq", ["--method", "gptq"]),
                                ("autoround", ["--method", "autoround", "--iters", "10"])):
                r = convert(src, a.work / f"depth-{n}-{name}", extra + ["--samples", "16", "--seq-len", "128"] + wk,
                            False)
                rows.append((n, name, src_mib, r["peak_rss_mib"], r["seconds"], per_layer(r["manifest"]),
                             r["manifest"]["method"]["hidden_bytes_peak_in_memory"] / 2**20))
        print("\nMemory in depth (tiny deepseek_v3, hidden 512, 8 routed experts of 1024, BF16 source, experts INT4):")
        print(f"  {'layers':>6} {'method':<10} {'source MiB':>10} {'peak RSS MiB':>12} {'wall s':>7} "
              f"{'hidden MiB':>10}  per layer")
        for n, name, smib, rss, sec, pl, hid in rows:
            print(f"  {n:>6} {name:<10} {smib:>10.0f} {rss:>12.0f} {sec:>7.1f} {hid:>10.1f}  {pl}")
        results["depth"] = [dict(zip(("layers", "method", "source_mib", "peak_rss_mib", "seconds", "per_layer",
                                      "hidden_mib"), r)) for r in rows]
    print("\nClosing note (this machine, " + f"{os.cpu_count()} cores):")
    for n in notes:
        print("  " + n)
    (a.work / "bench_methods.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
