#!/usr/bin/env python3
"""W4A16 kernel benchmark over GLM-5 and Kimi K2 routed-expert shapes at TP1 and TP8.

With a CUDA GPU: Triton W4A16 (fused unpack + dequant + matmul) against torch's BF16 matmul, as
ratios (goal on H200: >= 2.5x at M=1; the byte-count limit is ~3.9x). Without one: the CPU path
(torch's int4 GEMM after repacking) against dequantize-then-matmul. Ratios measured side by side
in one run; nothing here is a test.

    python scripts/bench_kernels.py [--m 1 8 32 128 512] [--reps 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from quantize.formats import int4
from quantize.kernels.cpu import CpuW4A16

# (model, proj, N, K) at TP1; TP8 splits N (gate/up, column) or K (down, row) by 8
SHAPES = [("GLM-5", "gate/up", 2048, 6144), ("GLM-5", "down", 6144, 2048),
          ("Kimi-K2", "gate/up", 2048, 7168), ("Kimi-K2", "down", 7168, 2048)]


def _time(fn, reps: int, sync=lambda: None) -> float:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--group", type=int, default=32)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        from quantize.kernels.triton_w4a16 import w4a16_triton
        print(f"device: {torch.cuda.get_device_name()}  (Triton W4A16 vs torch BF16 matmul; ratio > 1 = W4A16 faster)")
    else:
        print(f"device: CPU, {torch.get_num_threads()} threads  "
              f"(CPU int4 path vs dequantize-then-matmul; ratio > 1 = int4 path faster)")
    print(f"{'model':8s} {'proj':8s} {'TP':>3s} {'N':>5s} {'K':>5s} " + " ".join(f"{'M=' + str(m):>9s}" for m in a.m))
    g = torch.Generator().manual_seed(0)
    for model, proj, n, k in SHAPES:
        for tp in (1, 8):
            nn, kk = (n // tp, k) if proj == "gate/up" else (n, k // tp)
            w = (torch.randn(nn, kk, generator=g) * 0.02).to(torch.bfloat16)
            r = int4.quantize_pack(w, a.group)
            cells = []
            for m in a.m:
                x = torch.randn(m, kk, generator=g).to(torch.bfloat16)
                if cuda:
                    xc, pc, sc, wd = x.cuda(), r.packed.cuda(), r.scale.cuda(), w.cuda()
                    sync = torch.cuda.synchronize
                    t_q = _time(lambda: w4a16_triton(xc, pc, sc, (nn, kk)), a.reps, sync)
                    t_b = _time(lambda: xc @ wd.t(), a.reps, sync)
                else:
                    k4 = CpuW4A16.from_packed(r.packed, r.scale, (nn, kk))
                    t_q = _time(lambda: k4(x), a.reps)
                    t_b = _time(lambda: x @ int4.dequantize_int4(r.packed, r.scale, (nn, kk)).t(), a.reps)
                cells.append(f"{t_b / t_q:8.2f}x")
            print(f"{model:8s} {proj:8s} {tp:3d} {nn:5d} {kk:5d} " + " ".join(cells))


if __name__ == "__main__":
    main()
