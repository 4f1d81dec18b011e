#!/usr/bin/env python3
"""W4A16 kernel benchmark over GLM-5 and Kimi K2 routed-expert shapes at TP1 and TP8, against BF16.

Shapes (N, K) per expert GEMM: gate_up is the fused gate|up projection engines launch
(N = 2 x moe_intermediate, K = hidden), down is (N = hidden, K = moe_intermediate); TP8 splits
gate_up's N and down's K by 8. GLM-5: hidden 6144, moe_intermediate 2048; Kimi K2: hidden 7168,
moe_intermediate 2048. Weights are random INT4 words and bf16 scales (group 32 by default), the
BF16 baseline the same weights dequantized.

With a CUDA GPU, per (shape, M), times from ``triton.testing.do_bench`` (median; it clears the L2
before every run, so weights come from HBM as they do at decode), ratios = BF16 time / W4A16 time:

* ``bf16``: torch's ``x @ W.T`` (cuBLAS), microseconds;
* ``tiny``: torch's INT4 GEMM (``_weight_int4pack_mm``, kernels/cuda_int4.py), weight repacked once;
* ``splitK``: the split-K Triton kernel (kernels/triton_w4a16.py), the best of a small sweep of
  tile configs and K splits (printed), each checked against the fp32 reference first;
* ``moe8``: the fused MoE kernel (kernels/triton_moe.py), one launch over 8 experts of this shape
  with M tokens each routed to all 8 (top-8 of 8), against ONE BF16 ``torch.bmm`` over the same 8
  experts ([8, M, K] x [8, K, N]: the same bytes and FLOPs, one launch). The token sort
  (``moe_align``) runs once outside the timing: engines share it between gate_up and down;
* ``limit``: the byte limit, BF16 weight bytes / (INT4 bytes + scale bytes) = 2 / (0.5 + 2/g),
  3.56x at g 32 (activations and the output not counted);
* PASS/MISS: the best dense ratio (tiny or splitK) and moe8 against the targets, >= 2.5x at M=1 and
  >= 1.5x at M=16 (other M: no target, "-").

At the end: the sweep's winners as lines for ``TUNED`` in kernels/triton_w4a16.py (and ``--out FILE``
writes everything as JSON). About 60-90 s on an H200 (most of it Triton compiling ~30 configs).

Without a GPU: the CPU path (torch's int4 CPU GEMM, kernels/cpu.py) against the BF16 matmul on the
CPU (time.perf_counter, ``--reps``); the Triton kernels are not timed (the interpreter says
nothing about speed). Nothing here is a test.

    PYTHONPATH=. python3 scripts/bench_kernels.py [--m 1 16 64 256] [--group 32] [--out FILE]
                                                 [--models GLM-5 Kimi-K2] [--max-configs 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, without an install

import torch  # noqa: E402

# model -> (hidden, moe_intermediate)
MODELS = {"GLM-5": (6144, 2048), "Kimi-K2": (7168, 2048)}
DRY_RUN_MODELS = {"GLM-5": (64, 256), "Kimi-K2": (96, 256)}  # --dry-run: the code path, not the numbers
TARGETS = {1: 2.5, 16: 1.5}
MOE_EXPERTS = 8

# split-K sweep: (block_m, block_n, block_k, num_warps, num_stages) by M bucket; K splits tried per
# config: 1, the heuristic's (about 2 x SMs programs) and twice that. At M=1 the first two are one tile
# with its K loop's loads staged (num_stages 3) and not (1): STAGING prints what the staging is worth
SPLITK_SWEEP = {
    1: [(1, 16, 512, 4, 3), (1, 16, 512, 4, 1), (1, 32, 256, 4, 3), (1, 32, 512, 4, 2), (1, 64, 128, 4, 4)],
    16: [(16, 64, 128, 4, 4), (16, 32, 256, 4, 3), (16, 64, 256, 4, 3), (16, 128, 128, 8, 3)],
    64: [(32, 64, 128, 4, 3), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (16, 64, 128, 4, 4)],
    256: [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 128, 8, 3)],
}
MOE_SWEEP = {
    1: [(1, 16, 512, 4, 3), (1, 16, 512, 4, 1), (1, 32, 256, 4, 3), (16, 64, 128, 4, 4)],
    16: [(16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 128, 128, 8, 3)],
    64: [(32, 64, 128, 4, 3), (64, 128, 64, 4, 4), (64, 64, 128, 4, 3)],
    256: [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3)],
}
TOL = 1e-2  # a kernel's bf16 output vs the fp32 reference (relative L2); over it the config is WRONG


STAGED, UNSTAGED = "m1n16k512s{}w4p3", "m1n16k512s{}w4p1"  # the M=1 staging pair (the sweeps' first two)


def staging(tried: list[dict]) -> float | None:
    """Unstaged time / staged time of the M=1 pair, each at its best K split (None: one is missing)."""
    best = {}
    for rec in tried:
        for tag, pattern in (("staged", STAGED), ("unstaged", UNSTAGED)):
            split = rec["config"]["split_k"]
            if rec["name"] == pattern.format(split) and "us" in rec:
                best[tag] = min(best.get(tag, rec["us"]), rec["us"])
    return best["unstaged"] / best["staged"] if len(best) == 2 else None


def _try(cfg, run, ref, bench) -> dict:
    """One config: its error against the fp32 reference, then (within TOL) its time; a wrong result
    or an error recorded instead of a time."""
    rec = {"config": cfg.as_dict(), "name": str(cfg)}
    try:
        rec["rel_err"] = err = rel_err(run(), ref)
        if err <= TOL:
            rec["us"] = bench(run)
        else:
            rec["wrong"] = True
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    return rec


def shapes(models: list[str], tps=(1, 8), dims=MODELS):
    for model in models:
        hidden, inter = dims[model]
        for tp in tps:
            yield model, "gate_up", tp, 2 * inter // tp, hidden
            yield model, "down", tp, hidden, inter // tp


def byte_limit(group: int) -> float:
    return 2.0 / (0.5 + 2.0 / group)


def random_experts(e: int, n: int, k: int, group: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random INT4 words (every int32 is a valid packing) and bf16 scales around 0.01."""
    packed = torch.randint(-2**31, 2**31 - 1, (e, n, k // 8), dtype=torch.int32, generator=gen)
    scale = ((torch.rand(e, n, k // group, generator=gen) + 0.5) * 0.01).to(torch.bfloat16)
    return packed.to(device), scale.to(device)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def status(ratio: float | None, m: int) -> str:
    if m not in TARGETS:
        return "-"
    return "PASS" if ratio is not None and ratio >= TARGETS[m] else "MISS"


def m_bucket(m: int) -> int:
    return 1 if m == 1 else 16 if m <= 16 else 64 if m <= 64 else 256


def _splits(tiles: int, k: int, bk: int, sms: int) -> list[int]:
    from quantize.kernels.triton_w4a16 import k_per_split, split_for

    auto = split_for(tiles, k, bk, sms)
    out = {}
    for s in (1, auto, 2 * auto):
        per, actual = k_per_split(k, s, bk)
        out.setdefault(actual, s)
    return sorted(out.values())


def bench_cuda(a) -> dict:
    import triton
    from triton.testing import do_bench

    from quantize.kernels import cuda_int4
    from quantize.kernels.moe import dequant_stack, moe_align
    from quantize.kernels.triton_moe import moe_w4a16
    from quantize.kernels.triton_w4a16 import Config, w4a16_triton

    if a.dry_run:  # the same code on the CPU, kernels interpreted, tinygemm's CPU twin, wall-clock times
        dev, name, sms, cap = torch.device("cpu"), "CPU (dry run: interpreted, times meaningless)", 4, None
    else:
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        name, sms, cap = props.name, props.multi_processor_count, torch.cuda.get_device_capability(dev)
    print(f"device: {name}, {sms} SMs, sm{cap[0] if cap else '-'}{cap[1] if cap else ''}; torch {torch.__version__}, "
          f"triton {triton.__version__}; group {a.group}; times: triton.testing.do_bench median, L2 cleared before "
          f"each run")
    print("ratio = BF16 time / W4A16 time; moe8 = fused MoE over 8 experts vs one BF16 bmm over the same 8; "
          f"targets >= {TARGETS[1]}x at M=1, >= {TARGETS[16]}x at M=16")

    def bench(fn) -> float:
        if a.dry_run:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        return do_bench(fn, warmup=a.warmup_ms, rep=a.rep_ms, return_mode="median") * 1e3  # us

    gen = torch.Generator().manual_seed(0)
    limit = byte_limit(a.group)
    rows, tuned, moe_tuned = [], {}, {}
    hdr = (f"{'model':8s} {'proj':7s} {'TP':>2s} {'N':>5s} {'K':>5s} {'M':>4s} {'bf16 us':>8s} {'tiny':>6s} "
           f"{'splitK':>6s} {'(config)':22s} {'moe8':>6s} {'(config)':22s} {'limit':>6s}  dense moe")
    if not a.dry_run:  # the first row timed a cold GPU (clocks ramping): its BF16 GEMM took 99 us where
        # a larger one took 29 us (2026-12-04); about a second of large GEMMs first
        big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        do_bench(lambda: big @ big, warmup=250, rep=1000)
        del big
    print(hdr)
    t_start = time.time()
    experts = 2 if a.dry_run else MOE_EXPERTS
    for model, proj, tp, n, k in shapes(a.models, dims=DRY_RUN_MODELS if a.dry_run else MODELS):
        packed, scale = random_experts(experts, n, k, a.group, dev, gen)
        stack_fp32 = dequant_stack(packed, scale, k)  # [E, N, K], exact
        w_fp32 = stack_fp32[0]
        w_bf16 = w_fp32.to(torch.bfloat16)
        stack_bf16 = stack_fp32.to(torch.bfloat16)
        stack_t = stack_bf16.transpose(1, 2)  # [E, K, N] view: cuBLAS reads it transposed
        p0, s0 = packed[0].contiguous(), scale[0].contiguous()
        ok_tiny, why_tiny = cuda_int4.applies((n, k), a.group, cap)
        tiny, tiny_error = None, None
        if ok_tiny:
            try:
                tiny = (cuda_int4.cpu_twin(p0, s0, (n, k)) if a.dry_run
                        else cuda_int4.CudaW4A16.from_packed(p0, s0, (n, k)))
            except Exception as e:  # noqa: BLE001 - reported, the bench goes on
                tiny_error = f"repack: {type(e).__name__}: {e}"[:200]
        for m in a.m:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(dev)
            ref = x.float() @ w_fp32.t()
            row = {"model": model, "proj": proj, "tp": tp, "n": n, "k": k, "m": m, "byte_limit": round(limit, 3)}
            t_bf16 = bench(lambda: x @ w_bf16.t())
            row["bf16_us"] = t_bf16
            # torch's INT4 GEMM
            row["tinygemm"] = {"applies": ok_tiny, "why_not": why_tiny or None}
            if tiny_error:
                row["tinygemm"]["error"] = tiny_error
            if tiny is not None:
                try:
                    err = rel_err(tiny(x), ref)
                    row["tinygemm"].update(rel_err=err)
                    if err <= TOL:
                        t = bench(lambda: tiny(x))
                        row["tinygemm"].update(us=t, ratio=t_bf16 / t)
                    else:
                        row["tinygemm"].update(wrong=True)
                except Exception as e:  # noqa: BLE001
                    row["tinygemm"].update(error=f"{type(e).__name__}: {e}"[:200])
            # split-K Triton sweep
            tried, best = [], None
            for bm, bn, bk, warps, stages in SPLITK_SWEEP[m_bucket(m)][: a.max_configs]:
                tiles = triton.cdiv(n, bn) * (m if bm == 1 else triton.cdiv(m, bm))
                for split in _splits(tiles, k, bk, sms)[-1 if a.dry_run else 0:]:
                    cfg = Config(bm, bn, bk, split, warps, stages)
                    rec = _try(cfg, lambda cfg=cfg: w4a16_triton(x, p0, s0, (n, k), cfg), ref, bench)
                    if "us" in rec and (best is None or rec["us"] < best["us"]):
                        best = rec
                    tried.append(rec)
            row["splitk"] = {"best": best, "ratio": t_bf16 / best["us"] if best else None, "tried": tried}
            if best:
                tuned[(n, k, m_bucket(m))] = best["config"]
            # fused MoE: 8 experts, every token routed to all of them
            xs = x.unsqueeze(0).expand(experts, m, k).contiguous()
            t_bmm = bench(lambda: torch.bmm(xs, stack_t))
            ids = torch.stack([torch.randperm(experts, generator=gen) for _ in range(m)]).to(dev)
            ref_moe = torch.matmul(x.float(), stack_fp32.transpose(1, 2))  # [E, M, N]
            ref_pairs = ref_moe[ids.reshape(-1), torch.arange(m, device=dev).repeat_interleave(experts)]
            pairs = m * experts
            mtried, mbest = [], None
            for bm, bn, bk, warps, stages in MOE_SWEEP[m_bucket(m)][: a.max_configs]:
                align = moe_align(ids, bm, experts)
                blocks = experts * math.ceil(m / bm)
                for split in _splits(blocks * triton.cdiv(n, bn), k, bk, sms)[-1 if a.dry_run else -2:]:
                    cfg = Config(bm, bn, bk, split, warps, stages)

                    def run(cfg=cfg, align=align):
                        return moe_w4a16(x, packed, scale, align, pairs, experts, cfg, k)

                    rec = _try(cfg, run, ref_pairs, bench)
                    if "us" in rec and (mbest is None or rec["us"] < mbest["us"]):
                        mbest = rec
                    mtried.append(rec)
            if mbest:
                moe_tuned[(n, k, m_bucket(m))] = mbest["config"]
            row["moe"] = {"experts": experts, "bf16_bmm_us": t_bmm, "best": mbest,
                          "ratio": t_bmm / mbest["us"] if mbest else None, "tried": mtried}
            dense = max([r for r in (row["tinygemm"].get("ratio"), row["splitk"]["ratio"]) if r is not None],
                        default=None)
            row["dense_status"], row["moe_status"] = status(dense, m), status(row["moe"]["ratio"], m)
            row["staging"] = {"splitk": staging(tried), "moe": staging(mtried)}
            # what each reached in weight bytes per second (INT4 words + bf16 scales; BF16: 2 bytes a weight)
            int4_bytes, bf16_bytes = n * k // 2 + n * (k // a.group) * 2, n * k * 2
            row["weight_gbps"] = {
                "bf16": bf16_bytes / t_bf16 / 1e3, "bf16_bmm": experts * bf16_bytes / t_bmm / 1e3,
                "tinygemm": int4_bytes / row["tinygemm"]["us"] / 1e3 if "us" in row["tinygemm"] else None,
                "splitk": int4_bytes / best["us"] / 1e3 if best else None,
                "moe": experts * int4_bytes / mbest["us"] / 1e3 if mbest else None}
            rows.append(row)

            def fmt(r):
                return f"{r:5.2f}x" if r is not None else "   n/a"

            tiny_s = fmt(row["tinygemm"].get("ratio")) if ok_tiny else "    --"
            print(f"{model:8s} {proj:7s} {tp:2d} {n:5d} {k:5d} {m:4d} {t_bf16:8.1f} {tiny_s} "
                  f"{fmt(row['splitk']['ratio'])} {best['name'] if best else 'all failed':22s} "
                  f"{fmt(row['moe']['ratio'])} {mbest['name'] if mbest else 'all failed':22s} "
                  f"{limit:5.2f}x  {row['dense_status']:5s} {row['moe_status']}", flush=True)
            for rec in tried + mtried + [row["tinygemm"]]:
                if rec.get("wrong") or rec.get("error"):
                    print(f"    !! {rec.get('name', 'tinygemm')}: "
                          f"{rec.get('error') or 'rel. error %.3g > %g' % (rec['rel_err'], TOL)}")
        del stack_fp32, stack_bf16, stack_t, packed, scale, w_fp32, w_bf16
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    elapsed = time.time() - t_start
    print(f"\n{elapsed:.0f} s.")
    for kind in ("splitk", "moe"):
        got = [r["staging"][kind] for r in rows if r["staging"][kind] is not None]
        if got:
            print(f"STAGING {kind}: the M=1 K loop's loads staged (num_stages 3) vs not (1), same tile "
                  f"(m1n16k512), best split each: {min(got):.2f}x to {max(got):.2f}x over {len(got)} shapes "
                  f"(> 1: staging is faster)")
    gb = [(r["model"], r["proj"], r["tp"], r["weight_gbps"]) for r in rows if r["m"] == 1]
    if gb:
        print("weight GB/s at M=1 (bf16 | tinygemm | splitK | moe8 | bf16 bmm over 8):")
        for model, proj, tp, g in gb:
            print(f"    {model:8s} {proj:7s} TP{tp}: " + " | ".join(
                f"{g[key]:7.0f}" if g[key] is not None else "    n/a"
                for key in ("bf16", "tinygemm", "splitk", "moe", "bf16_bmm")))
    for table, where, found in (("TUNED", "kernels/triton_w4a16.py", tuned),
                                ("MOE_TUNED", "kernels/triton_moe.py", moe_tuned)):
        print(f"Winners for {table} in {where} ((N, K, M bucket): Config):")
        for (n, k, b), c in sorted(found.items()):
            print(f"    ({n}, {k}, {b}): Config({c['block_m']}, {c['block_n']}, {c['block_k']}, {c['split_k']}, "
                  f"{c['num_warps']}, {c['num_stages']}),")
    return {"device": name, "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
            "group": a.group, "elapsed_s": elapsed, "rows": rows,
            "tuned": [{"n": n, "k": k, "m_bucket": b, "config": c} for (n, k, b), c in sorted(tuned.items())],
            "moe_tuned": [{"n": n, "k": k, "m_bucket": b, "config": c} for (n, k, b), c in sorted(moe_tuned.items())]}


def bench_cpu(a) -> dict:
    from quantize.kernels.cpu import CpuW4A16
    from quantize.kernels.reference import dequant_fp32

    def timed(fn) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(a.reps):
            fn()
        return (time.perf_counter() - t) / a.reps * 1e6

    print(f"device: CPU, {torch.get_num_threads()} threads (no CUDA GPU): torch's int4 CPU GEMM (kernels/cpu.py) "
          f"vs the BF16 matmul; ratio = BF16 time / int4 time; the Triton kernels are not timed here")
    print(f"{'model':8s} {'proj':7s} {'TP':>2s} {'N':>5s} {'K':>5s} {'M':>4s} {'bf16 us':>9s} {'int4 us':>9s} "
          f"{'ratio':>6s} {'rel.err':>8s} {'limit':>6s}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    t_start = time.time()
    for model, proj, tp, n, k in shapes(a.models):
        packed, scale = random_experts(1, n, k, a.group, "cpu", gen)
        w_fp32 = dequant_fp32(packed[0], scale[0], (n, k))
        w_bf16 = w_fp32.to(torch.bfloat16)
        k4 = CpuW4A16.from_packed(packed[0], scale[0], (n, k))
        for m in a.m:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            err = rel_err(k4(x), x.float() @ w_fp32.t())
            t_b, t_q = timed(lambda: x @ w_bf16.t()), timed(lambda: k4(x))
            rows.append({"model": model, "proj": proj, "tp": tp, "n": n, "k": k, "m": m, "bf16_us": t_b,
                         "cpu_int4_us": t_q, "ratio": t_b / t_q, "rel_err": err, "byte_limit": byte_limit(a.group)})
            print(f"{model:8s} {proj:7s} {tp:2d} {n:5d} {k:5d} {m:4d} {t_b:9.0f} {t_q:9.0f} {t_b / t_q:5.2f}x "
                  f"{err:8.1e} {byte_limit(a.group):5.2f}x", flush=True)
    elapsed = time.time() - t_start
    print(f"\n{elapsed:.0f} s")
    return {"device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__, "group": a.group,
            "elapsed_s": elapsed, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=None,
                    help="token counts (default: 1 16 64 256 on a GPU, 1 16 on the CPU)")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--max-configs", type=int, default=5, help="tile configs per M bucket in the sweeps (GPU)")
    ap.add_argument("--warmup-ms", type=int, default=5, help="do_bench warmup (GPU)")
    ap.add_argument("--rep-ms", type=int, default=20, help="do_bench repetition time (GPU)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (CPU)")
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON")
    ap.add_argument("--dry-run", action="store_true",
                    help="without a GPU: the GPU bench's code on tiny shapes, Triton interpreted (a test runs it)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() or a.dry_run
    if a.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--dry-run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        a.m = a.m or [1, 16]
    a.m = a.m or ([1, 16, 64, 256] if cuda else [1, 16])
    if any(m < 1 for m in a.m) or a.group % 8:
        ap.error("--m values must be at least 1 and --group a multiple of 8")
    if cuda:
        from quantize.kernels.availability import triton_available

        ok, why = triton_available()
        if not ok:
            ap.error(why)
    result = bench_cuda(a) if cuda else bench_cpu(a)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
