#!/usr/bin/env python3
"""Benchmark: quantize convert vs llmcompressor model_free_ptq vs plain read+write, one run.

Makes a synthetic block-FP8 checkpoint with GLM-5 shapes (hidden 6144, moe_intermediate 2048,
kv_a_proj_with_mqa 576 rows, 1 GiB shards, real on-disk names), then runs, each in its own process
so peak RSS is its own: (1) the floor, reading every source byte and writing the same number of
bytes with fsync; (2) `quantize convert`; (3) `model_free_ptq` with compressed-tensors'
FP8BlockDequantizer. Prints source GB/s, ratios and peak RSS. Not a test: machines are noisy, so
only ratios measured side by side in this one run mean anything.

    python scripts/bench_convert.py --gb 4.2 --work bench-out
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

HIDDEN, MOE_I, KV_A = 6144, 2048, 576


def make_checkpoint(d: Path, gb: float, shard_bytes: int = 1 << 30, seed: int = 0, codes: str = "vendor") -> int:
    import torch
    from safetensors.torch import save_file

    from quantize.formats.fp8 import block_grid

    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def fp8(shape):
        if codes == "uniform":  # every finite e4m3 code equally likely: 1/16 of them subnormal
            raw = torch.randint(0, 0x7E, shape, generator=g, dtype=torch.uint8)
            sign = torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
            return (raw | sign).view(torch.float8_e4m3fn)
        # codes as a vendor's block quantization makes them: Gaussian weights, each block's extreme near
        # e4m3's 448, so subnormal codes are rare (uniformly random codes are 1/16 subnormal, whose
        # fp32 arithmetic costs the CPU a microcode assist each: 3.4x the conversion time measured)
        return (torch.randn(shape, generator=g) * 100.0).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)

    def scale(shape):
        return torch.rand(block_grid(shape), generator=g) * 1e-3 + 1e-4

    expert_bytes = 3 * HIDDEN * MOE_I
    per_layer_experts = 16
    layers = max(1, round(gb * 1e9 / (expert_bytes * per_layer_experts)))
    tensors: list[tuple[str, object]] = []
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors.append((p + "input_layernorm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16)))
        w = fp8((KV_A, HIDDEN))
        tensors += [(p + "self_attn.kv_a_proj_with_mqa.weight", w),
                    (p + "self_attn.kv_a_proj_with_mqa.weight_scale_inv", scale(w.shape))]
        tensors.append((p + "mlp.gate.weight",
                        torch.randn(per_layer_experts, HIDDEN, generator=g).to(torch.bfloat16) * 0.02))
        for e in range(per_layer_experts):
            for proj, shape in (("gate_proj", (MOE_I, HIDDEN)), ("up_proj", (MOE_I, HIDDEN)),
                                ("down_proj", (HIDDEN, MOE_I))):
                w = fp8(shape)
                tensors += [(f"{p}mlp.experts.{e}.{proj}.weight", w),
                            (f"{p}mlp.experts.{e}.{proj}.weight_scale_inv", scale(shape))]
    shards, cur, size = [], {}, 0
    for name, t in tensors:
        b = t.numel() * t.element_size()
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += b
    shards.append(cur)
    weight_map, total = {}, 0
    for i, s in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in s})
        total += sum(t.numel() * t.element_size() for t in s.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": HIDDEN,
        "moe_intermediate_size": MOE_I, "num_hidden_layers": layers, "n_routed_experts": per_layer_experts,
        # what the strict config reader requires (GLM-5's values; the plan reads only the tensors present)
        "vocab_size": 154880, "num_attention_heads": 64, "num_key_value_heads": 64, "first_k_dense_replace": 0,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "kv_lora_rank": 512, "q_lora_rank": 2048,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_shared_experts": 1,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return total


RUNNER = r"""
import json, os, resource, sys, time
t0 = time.time()
kind, src, out = sys.argv[1], sys.argv[2], sys.argv[3]
extra = {}
if kind == "floor":
    import os
    from pathlib import Path
    os.makedirs(out, exist_ok=True)
    for p in sorted(Path(src).glob("*.safetensors")):
        with open(p, "rb") as f, open(Path(out) / p.name, "wb") as g:
            while True:
                b = f.read(8 << 20)
                if not b:
                    break
                g.write(b)
            g.flush(); os.fsync(g.fileno())
elif kind == "quantize":
    from quantize.convert import convert
    convert(src, out, group_size=32)
    m = json.load(open(os.path.join(out, "quantize_manifest.json")))
    extra = {"own_seconds": m["seconds"], "kernels": m["kernels"]}
elif kind == "model_free_ptq":
    import torch
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import model_free_ptq
    ignore = ["re:.*mlp\\.gate$", "re:.*self_attn.*", "re:.*layernorm.*"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                             strategy="group", group_size=32))
    model_free_ptq(model_stub=src, save_directory=out, scheme=scheme, ignore=ignore,
                   converter=FP8BlockDequantizer(ignore=["re:.*mlp\\.gate$", "re:.*layernorm.*"]), max_workers=2,
                   device="cpu")
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"seconds": time.time() - t0, "peak_rss": int(hwm) * 1024, **extra}))
"""


def run(kind: str, src: Path, out: Path) -> dict:
    """One tool in its own process; the previous run's output is deleted and synced first so its
    write-back does not bleed into this measurement."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    p = subprocess.run([sys.executable, "-c", RUNNER, kind, str(src), str(out)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.2, help="source size in GB")
    ap.add_argument("--work", type=Path, default=Path("bench-out"))
    ap.add_argument("--skip-baseline", action="store_true", help="skip model_free_ptq (slow)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint between runs")
    ap.add_argument("--codes", choices=("vendor", "uniform"), default="vendor",
                    help="FP8 codes as a vendor's block quantization makes them (default), or uniformly random "
                         "(1/16 subnormal: what the conversion costs on a source full of tiny values)")
    a = ap.parse_args()
    src = a.work / "src"
    if not (src / "config.json").exists():
        t = time.time()
        total = make_checkpoint(src, a.gb, codes=a.codes)
        print(f"made {total / 1e9:.2f} GB synthetic FP8 checkpoint in {time.time() - t:.0f} s")
    total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    res = {"floor": run("floor", src, a.work / "floor")}
    res["quantize"] = run("quantize", src, a.work / "quantize")
    if not a.skip_baseline:
        res["model_free_ptq"] = run("model_free_ptq", src, a.work / "mfp")
    print(f"\nsource: {total / 1e9:.2f} GB in {len(list(src.glob('*.safetensors')))} shards, {os.cpu_count()} cores")
    print(f"{'':16s} {'seconds':>8s} {'GB/s':>7s} {'peak RSS':>9s}")
    for k, r in res.items():
        print(f"{k:16s} {r['seconds']:8.1f} {total / r['seconds'] / 1e9:7.3f} {r['peak_rss'] / 2**30:7.2f} GiB")
    q = res["quantize"]["seconds"]
    print(f"\nquantize / floor throughput: {res['floor']['seconds'] / q:.2f}")
    if "model_free_ptq" in res:
        print(f"quantize / model_free_ptq throughput: {res['model_free_ptq']['seconds'] / q:.1f}x")
    r = res["quantize"]
    k, ph = r["kernels"], r["kernels"]["phase_seconds"]
    why = f" ({k['reason']})" if k.get("reason") else ""
    print(f"quantize, where the time went: {q - r['own_seconds']:.1f} s start-up (imports) and "
          f"{r['own_seconds']:.1f} s converting; {k['path']} kernels{why}, {k['workers']} workers computing "
          f"{ph['compute']:.1f} s in all ({ph['compute'] / k['workers']:.1f} s each); the writer thread writing "
          f"and hashing {ph['write']:.1f} s, waiting for results {ph['wait']:.1f} s; fsync and rename "
          f"{ph['commit']:.1f} s beside them")
    for k in ("floor", "quantize", "mfp"):
        shutil.rmtree(a.work / k, ignore_errors=True)
    if not a.keep:
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
