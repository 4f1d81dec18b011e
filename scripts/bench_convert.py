#!/usr/bin/env python3
"""Benchmark: quantize convert vs llmcompressor model_free_ptq vs plain read+write, one run.

Makes a synthetic block-FP8 checkpoint with GLM-5 shapes (hidden 6144, moe_intermediate 2048,
kv_a_proj_with_mqa 576 rows, 1 GiB shards, real on-disk names), then runs, each in its own process
so peak RSS is its own: (1) `quantize convert`; (2) the disk floor: reading every source byte and
writing as many bytes as convert wrote, fsync'd; (3) `model_free_ptq` with compressed-tensors'
FP8BlockDequantizer. Prints source GB/s, ratios and peak RSS.

A run has a fixed cost (starting Python, importing torch and compressed-tensors, the plan), which a
few-GB source cannot hide and a 700 GB release does. So convert and the floor also run on a
one-layer checkpoint of the same widths, and the line through the two sizes splits each into a fixed
cost and a marginal rate: the fraction of the floor a whole release gets is printed from those
(GLM-5.2's FP8 release, 706 GiB). Not a test: machines are noisy, so only ratios measured side by
side in this one run mean anything.

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
DRY = (256, 128, 64)  # --dry-run's widths: the script's code on a few MB
RELEASE_BYTES = 706 * 2**30  # GLM-5.2's FP8 release (README: quantize plan)


def make_checkpoint(d: Path, gb: float, shard_bytes: int = 1 << 30, seed: int = 0, codes: str = "vendor",
                    widths: tuple[int, int, int] = (HIDDEN, MOE_I, KV_A), layers: int | None = None) -> int:
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

    HIDDEN, MOE_I, KV_A = widths  # noqa: N806 (the module's names, here the widths asked for)
    expert_bytes = 3 * HIDDEN * MOE_I
    per_layer_experts = 16
    layers = layers or layers_for(gb, widths)
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


def layers_for(gb: float, widths: tuple[int, int, int] = (HIDDEN, MOE_I, KV_A)) -> int:
    """MoE layers of 16 experts making about ``gb`` GB of FP8 experts."""
    return max(1, round(gb * 1e9 / (3 * widths[0] * widths[1] * 16)))


def fit(small: tuple[float, float], big: tuple[float, float]) -> tuple[float, float] | None:
    """Two runs of one tool, (bytes, seconds) at two sizes -> (fixed seconds, marginal bytes per second):
    the line through both. None when the bigger run was not slower (noise swamped the difference)."""
    (b1, t1), (b2, t2) = small, big
    if b2 <= b1 or t2 <= t1:
        return None
    rate = (b2 - b1) / (t2 - t1)
    return t1 - b1 / rate, rate


def fraction_at(size: float, floor: tuple[float, float], tool: tuple[float, float]) -> float:
    """The floor's time over the tool's at ``size`` source bytes, each ``fixed + size / rate``."""
    return (floor[0] + size / floor[1]) / (tool[0] + size / tool[1])


def summarize(res: dict) -> tuple[dict, str]:
    """``measure``'s runs by size ("big", and "small" when there is one) -> (the figures, the line that
    says them): the whole run's fraction of the floor at the big size; with two sizes, each tool's fixed
    cost and marginal rate (``fit``), the marginal fraction and the fraction at GLM-5.2's release."""
    big = res["big"]
    total, whole = big["bytes"], big["floor"]["seconds"] / big["quantize"]["seconds"]
    summary = {"whole_run": round(whole, 3)}
    line = f"\nquantize / floor throughput: {whole:.2f} for the whole run at {total / 1e9:.2f} GB"
    if "small" not in res:
        return summary, line + " (one size only: no fixed / marginal split)"
    pts = {k: fit((res["small"]["bytes"], res["small"][k]["seconds"]), (total, big[k]["seconds"]))
           for k in ("floor", "quantize")}
    if None in pts.values():
        return summary, line + "; no marginal rate (the one-layer run was not faster than the whole one: noise)"
    (qf, qr), (ff, fr) = pts["quantize"], pts["floor"]
    at = fraction_at(RELEASE_BYTES, pts["floor"], pts["quantize"])
    summary.update(fixed_s=round(qf, 2), marginal=round(qr / fr, 3), marginal_gbps=round(qr / 1e9, 4),
                   floor_marginal_gbps=round(fr / 1e9, 4), release_fraction=round(at, 3))
    return summary, line + (f"; marginal {qr / fr:.2f} ({qr / 1e9:.3f} against {fr / 1e9:.3f} GB/s past a fixed "
                            f"{qf:.1f} s against the floor's {ff:.1f} s); {at:.2f} at GLM-5.2's "
                            f"{RELEASE_BYTES / 2**30:.0f} GiB release")


RUNNER = r"""
import json, os, resource, sys, time
t0 = time.time()
kind, src, out = sys.argv[1], sys.argv[2], sys.argv[3]
extra = {}
if kind == "floor":  # every source byte read; the first `left` of them written, fsync'd per file
    import os
    from pathlib import Path
    os.makedirs(out, exist_ok=True)
    left = int(sys.argv[4])
    for p in sorted(Path(src).glob("*.safetensors")):
        with open(p, "rb") as f, open(Path(out) / p.name, "wb") as g:
            while True:
                b = f.read(8 << 20)
                if not b:
                    break
                if left > 0:
                    g.write(b[:left])
                    left -= min(left, len(b))
            g.flush(); os.fsync(g.fileno())
elif kind == "quantize":
    from quantize.convert import convert
    convert(src, out, group_size=32)
    m = json.load(open(os.path.join(out, "quantize_manifest.json")))
    extra = {"own_seconds": m["seconds"], "kernels": m["kernels"]}
elif kind.startswith("writer-"):  # convert's writer alone: `left` bytes of 6 MiB tensors, into the page cache
    import torch
    import quantize.checkpoint.writer as W
    if kind == "writer-inline":
        W.HASH_BESIDE = 1 << 62
    os.makedirs(out, exist_ok=True)
    n = max(1, int(sys.argv[4]) // (6 << 20))
    ts = [torch.randint(0, 256, (6 << 20,), dtype=torch.uint8) for _ in range(4)]
    w = W.StreamWriter(os.path.join(out, "w.safetensors"), [W.Entry(f"t{i}", "U8", (6 << 20,)) for i in range(n)])
    t1 = time.perf_counter()
    for i in range(n):
        w.write_tensor(f"t{i}", ts[i % 4])
    w.close()
    extra = {"writer_seconds": time.perf_counter() - t1, "writer_bytes": n * (6 << 20)}
    w.abort()
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
seconds = time.time() - t0
written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
print(json.dumps({"seconds": seconds, "peak_rss": int(hwm) * 1024, "written": written, **extra}))
"""


def run(kind: str, src: Path, out: Path, write: int = 0) -> dict:
    """One tool in its own process; the previous run's output is deleted and synced first so its
    write-back does not bleed into this measurement. ``write``: the bytes the floor writes."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    p = subprocess.run([sys.executable, "-c", RUNNER, kind, str(src), str(out), str(write)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    return res


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def measure(src: Path, work: Path, name: str) -> dict:
    """convert, then the floor writing as many bytes as convert wrote."""
    q = run("quantize", src, work / f"quantize-{name}")
    return {"bytes": _size(src), "quantize": q, "floor": run("floor", src, work / f"floor-{name}", q["written"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.2, help="source size in GB")
    ap.add_argument("--work", type=Path, default=Path("bench-out"))
    ap.add_argument("--skip-baseline", action="store_true", help="skip model_free_ptq (slow)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints between runs")
    ap.add_argument("--codes", choices=("vendor", "uniform"), default="vendor",
                    help="FP8 codes as a vendor's block quantization makes them (default), or uniformly random "
                         "(1/16 subnormal: what the conversion costs on a source full of tiny values)")
    ap.add_argument("--json", type=Path, help="also write every measurement here")
    ap.add_argument("--dry-run", action="store_true", help=f"widths {DRY} (a few MB): the script's code, no figure")
    a = ap.parse_args()
    widths = DRY if a.dry_run else (HIDDEN, MOE_I, KV_A)
    big_layers = layers_for(a.gb, widths)
    sizes = {"big": big_layers} if big_layers < 2 else {"big": big_layers, "small": 1}
    for name, layers in sizes.items():
        src = a.work / f"src-{name}"
        if not (src / "config.json").exists():
            t = time.time()
            total = make_checkpoint(src, a.gb, codes=a.codes, widths=widths, layers=layers)
            print(f"made {total / 1e9:.2f} GB synthetic FP8 checkpoint ({layers} layers) in {time.time() - t:.0f} s")
    res = {name: measure(a.work / f"src-{name}", a.work, name) for name in sizes}
    big = res["big"]
    if not a.skip_baseline:
        big["model_free_ptq"] = run("model_free_ptq", a.work / "src-big", a.work / "mfp")
    total = big["bytes"]
    print(f"\nsource: {total / 1e9:.2f} GB in {len(list((a.work / 'src-big').glob('*.safetensors')))} shards, "
          f"{os.cpu_count()} cores; convert wrote {big['quantize']['written'] / 1e9:.2f} GB, and so did the floor "
          f"(after reading every source byte)")
    print(f"{'':22s} {'seconds':>8s} {'GB/s':>7s} {'peak RSS':>9s}")
    for name, m in res.items():
        for k in ("floor", "quantize", "model_free_ptq"):
            if k in m:
                r = m[k]
                label = f"{k} ({m['bytes'] / 1e9:.2f} GB)"
                print(f"{label:22s} {r['seconds']:8.1f} {m['bytes'] / r['seconds'] / 1e9:7.3f} "
                      f"{r['peak_rss'] / 2**30:7.2f} GiB")
    q = big["quantize"]["seconds"]
    summary, line = summarize(res)
    print(line)
    if "model_free_ptq" in big:
        print(f"quantize / model_free_ptq throughput: {big['model_free_ptq']['seconds'] / q:.1f}x")
    r = big["quantize"]
    k, ph = r["kernels"], r["kernels"]["phase_seconds"]
    why = f" ({k['reason']})" if k.get("reason") else ""
    print(f"quantize, where the time went: {q - r['own_seconds']:.1f} s start-up (imports) and "
          f"{r['own_seconds']:.1f} s converting; {k['path']} kernels{why}, {k['workers']} workers computing "
          f"{ph['compute']:.1f} s in all ({ph['compute'] / k['workers']:.1f} s each); the writer thread writing "
          f"and hashing {ph['write']:.1f} s, waiting for results {ph['wait']:.1f} s; fsync and rename "
          f"{ph['commit']:.1f} s beside them")
    # the writer thread alone (convert writes in plan order from one thread): what it sustains on
    # this machine bounds convert on a node with cores to spare, whatever the workers do
    wb = min(1 << 30, big["quantize"]["written"])
    writer = {m: run(f"writer-{m}", a.work / "src-big", a.work / f"writer-{m}", wb) for m in ("inline", "beside")}
    rate = {m: r["writer_bytes"] / r["writer_seconds"] / 1e9 for m, r in writer.items()}
    ratio = big["quantize"]["written"] / total
    print(f"the writer thread alone, {wb / 1e9:.2f} GB into the page cache: {rate['inline']:.2f} GB/s hashing "
          f"each tensor after its write, {rate['beside']:.2f} GB/s hashing beside it "
          f"({rate['beside'] / rate['inline']:.2f}x); at convert's {ratio:.2f} bytes written per source byte that "
          f"bounds convert at {rate['beside'] / ratio:.2f} GB/s of source however many cores compute")
    summary["writer_gbps"] = {m: round(v, 3) for m, v in rate.items()}
    if a.json:
        a.json.write_text(json.dumps({"runs": res, "summary": summary, "release_bytes": RELEASE_BYTES,
                                      "writer": writer}, indent=1))
    for d in a.work.glob("*"):
        if (d.name.startswith(("floor-", "quantize-", "writer-")) or d.name == "mfp"
                or (d.name.startswith("src-") and not a.keep)):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
