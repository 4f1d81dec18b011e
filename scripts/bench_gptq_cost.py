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


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_expert(h: int, i: int, tokens: int, group: int = 32, device: str = "cpu", experts: int = 1) -> dict:
    """``experts`` experts of width (h, i) as the layer pass does them on ``device`` (on a GPU: one
    batched GPTQ call per shape): seconds per expert for the Hessians from ``tokens`` routed tokens
    each (``hessian_s``) and for GPTQ (``gptq_s``)."""
    import torch

    from quantize.methods.gptq import quantize
    from quantize.methods.units import Unit

    g = torch.Generator(device=device).manual_seed(0)
    gu = [torch.randn(2 * i, h, generator=g, device=device) * 0.02 for _ in range(experts)]
    dn = [torch.randn(h, i, generator=g, device=device) * 0.02 for _ in range(experts)]
    x = torch.randn(tokens, h, generator=g, device=device)
    hs = []
    for warm in (True, False):  # a first pass on a GPU loads its libraries; the second is timed
        _sync(device)
        t = time.perf_counter()
        hs = []
        for e in range(experts):
            a = torch.nn.functional.silu(x @ gu[e][:i].T) * (x @ gu[e][i:].T)
            xs = x.mul(2 ** 0.5)
            ac = a.mul(2 ** 0.5)
            hs.append((xs.T @ xs / tokens, ac.T @ ac / tokens))
        _sync(device)
        hess = time.perf_counter() - t
        if not warm or not device.startswith("cuda"):
            break
    items = [(Unit("mlp.experts.gate_up_proj", e, [(f"g{e}", 0, 2 * i)], torch.bfloat16), gu[e], hs[e][0])
             for e in range(experts)]
    items += [(Unit("mlp.experts.down_proj", e, [(f"d{e}", 0, h)], torch.bfloat16), dn[e], hs[e][1])
              for e in range(experts)]
    if device.startswith("cuda"):  # warm: llm-compressor's import and CUDA's linear algebra loaded once
        quantize(items[:1] + items[experts: experts + 1], group, "fullrange", "static", 128, 0.01, 1)
    _sync(device)
    t = time.perf_counter()
    quantize(items, group, "fullrange", "static", 128, 0.01, 1)
    _sync(device)
    gptq = time.perf_counter() - t
    return {"hessian_s": hess / experts, "gptq_s": gptq / experts, "tokens": tokens, "experts": experts}


def main() -> None:
    import json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["glm-5", "kimi-k2.6"], choices=sorted(MODELS))
    ap.add_argument("--tokens", type=int, default=2048, help="routed tokens per expert (Hessian accumulation)")
    ap.add_argument("--gpu-tflops", type=float, default=20.0,
                    help="fp32 TFLOPS one GPU sustains on this work (H200: 67 peak non-tensor fp32; default ~30%%)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the experts batched as the GPU path runs them")
    ap.add_argument("--experts", type=int, default=1, help="experts done together (a GPU's batched call)")
    ap.add_argument("--json", help="write the measurements here")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    # MoE-Quant (IST-DASLab): DeepSeek-V3/R1 GPTQ in about 2 h on 8xH100, everything included: GPU-seconds per
    # routed expert of DeepSeek-V3's width, the rate a real GPTQ (column loop, memory traffic) reaches on Hopper
    h3, i3, l3, e3 = MODELS["deepseek-v3"]
    moe_quant = 2 * 3600 * 8 / (l3 * e3)
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {where}; {a.experts} expert(s) at a time, {a.tokens} routed tokens each")
    print(f"{'model':>12s} {'Hessians s/expert':>18s} {'GPTQ s/expert':>14s} {'GFLOP/expert':>13s} "
          f"{'GFLOPS':>8s} {'experts':>8s} {'measured h':>11s} {'FLOP bound h':>13s} {'MoE-Quant h':>12s}")
    rows = {}
    for name in a.model:
        h, i, layers, experts = MODELS[name]
        m = one_expert(h, i, a.tokens, device=a.device, experts=a.experts)
        s = m["hessian_s"] + m["gptq_s"]
        f = flops(h, i, a.tokens)
        total = layers * experts
        measured = total * s / a.ranks / 3600
        bound = total * f / (a.gpu_tflops * 1e12 * a.ranks) / 3600
        rate = total * moe_quant * f / flops(h3, i3, a.tokens) / a.ranks / 3600
        rows[name] = {**m, "gflop": f / 1e9, "routed_experts": total, "measured_h": measured, "bound_h": bound,
                      "moe_quant_h": rate, "ranks": a.ranks, "device": where}
        print(f"{name:>12s} {m['hessian_s']:18.3f} {m['gptq_s']:14.3f} {f / 1e9:13.0f} {f / s / 1e9:8.0f} {total:8d} "
              f"{measured:11.2f} {bound:13.2f} {rate:12.2f}")
    print(f"measured h: the routed experts' Hessians and GPTQ at the measured seconds per expert over {a.ranks} "
          f"ranks. FLOP bound: {a.gpu_tflops:g} fp32 TFLOPS each, perfect split. MoE-Quant: {moe_quant:.2f} GPU-s per "
          f"DeepSeek-V3-width expert (its 2 h on 8xH100 over {l3 * e3} experts, attention and I/O included), scaled "
          "by each model's operations per expert. None counts what this tool adds: attention (three captures and "
          "three replays per layer, split by sample), the Linear units, the exchanges between ranks")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
