#!/usr/bin/env python3
"""What GPTQ costs per routed expert at a model's real width, measured here, and the projection for
a whole model on N GPUs. Not a test.

One expert is GPTQ'd as the layer pass does it (``quantize.methods.gptq.quantize``: llm-compressor's
``quantize_weight`` on our static groups): its fused gate|up ``[2I, H]`` with an ``[H, H]`` Hessian
and its down ``[H, I]`` with an ``[I, I]`` one, plus the Hessians' accumulation from ``--tokens``
routed tokens. The work is counted in floating-point operations (the Cholesky factorisation and
inverse of each Hessian, ~H^3 each, and the column-by-column update, ~2 x rows x cols^2 per weight),
so the measured seconds give this machine's rate, and the projection divides the whole model's
operations by an assumed per-GPU rate (``--gpu-tflops``, fp32 as llm-compressor computes) times
the ranks; it says what it leaves out.

    python scripts/bench_gptq_cost.py [--model glm-5 kimi-k2.6] [--tokens 2048] [--gpu-tflops 20] [--ranks 8]
"""

from __future__ import annotations

import argparse
import time

MODELS = {  # hidden, moe_intermediate, MoE layers, routed experts per layer (config.json of the releases)
    "glm-5": (6144, 2048, 75, 256),  # 78 layers, first_k_dense_replace 3
    "kimi-k2.6": (7168, 2048, 60, 384),  # 61 layers, first_k_dense_replace 1
    "deepseek-v3": (7168, 2048, 58, 256),
}


def flops(h: int, i: int, tokens: int) -> float:
    """One expert: Hessians (2 x tokens x dim^2 each), Cholesky + inverse (~dim^3 each), and the
    update of [2I, H] over H columns and of [H, I] over I columns (~2 rows cols^2)."""
    hess = 2 * tokens * (h * h + i * i)
    chol = h ** 3 + i ** 3
    update = 2 * (2 * i) * h * h + 2 * h * i * i
    return hess + chol + update


def one_expert(h: int, i: int, tokens: int, group: int = 32) -> float:
    import torch

    from quantize.methods.gptq import quantize
    from quantize.methods.units import Unit

    torch.manual_seed(0)
    x = torch.randn(tokens, h)
    gu = torch.randn(2 * i, h) * 0.02
    dn = torch.randn(h, i) * 0.02
    t = time.perf_counter()
    a = torch.nn.functional.silu(x @ gu[:i].T) * (x @ gu[i:].T)
    h_gu, h_dn = 2 * x.T @ x / tokens, 2 * a.T @ a / tokens
    items = [(Unit("mlp.experts.gate_up_proj", 0, [("g", 0, 2 * i)], torch.bfloat16), gu, h_gu),
             (Unit("mlp.experts.down_proj", 0, [("d", 0, h)], torch.bfloat16), dn, h_dn)]
    quantize(items, group, "fullrange", "static", 128, 0.01, 1)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["glm-5", "kimi-k2.6"], choices=sorted(MODELS))
    ap.add_argument("--tokens", type=int, default=2048, help="routed tokens per expert (Hessian accumulation)")
    ap.add_argument("--gpu-tflops", type=float, default=20.0,
                    help="fp32 TFLOPS one GPU sustains on this work (H200: 67 peak non-tensor fp32; default ~30%%)")
    ap.add_argument("--ranks", type=int, default=8)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    # MoE-Quant (IST-DASLab): DeepSeek-V3/R1 GPTQ in about 2 h on 8xH100, everything included: GPU-seconds per
    # routed expert of DeepSeek-V3's width, the rate a real GPTQ (column loop, memory traffic) reaches on Hopper
    h3, i3, l3, e3 = MODELS["deepseek-v3"]
    moe_quant = 2 * 3600 * 8 / (l3 * e3)
    print(f"{'model':>12s} {'expert s here':>14s} {'GFLOP/expert':>13s} {'GFLOPS here':>12s} {'experts':>8s} "
          f"{'FLOP bound h':>13s} {'at MoE-Quant rate h':>20s}")
    for name in a.model:
        h, i, layers, experts = MODELS[name]
        s = one_expert(h, i, a.tokens)
        f = flops(h, i, a.tokens)
        total = layers * experts
        bound = total * f / (a.gpu_tflops * 1e12 * a.ranks) / 3600
        rate = total * moe_quant * f / flops(h3, i3, a.tokens) / a.ranks / 3600
        print(f"{name:>12s} {s:14.1f} {f / 1e9:13.0f} {f / s / 1e9:12.1f} {total:8d} {bound:13.2f} {rate:20.2f}")
    print(f"FLOP bound: routed experts only, {a.ranks} GPUs at {a.gpu_tflops:g} fp32 TFLOPS each, perfect split. "
          f"MoE-Quant rate: {moe_quant:.2f} GPU-s per DeepSeek-V3-width expert (its 2 h on 8xH100 over "
          f"{l3 * e3} experts, attention and I/O included), scaled by each model's operations per expert. "
          "Both leave out what this tool adds: attention on rank 0 (twice per capture), the captures sent to "
          "every rank and the expert outputs sent back")


if __name__ == "__main__":
    main()
