"""W4AFP8 figures (issue 36), each side by side in one run:

1. plan at TP 8 on an H200 for GLM-5.x (transformers' GlmMoeDsaConfig defaults, Z.ai's block-FP8
   quantization_config) and Kimi K2.6 (quantize/testing/kimi-k2.6-config.json, Moonshot's INT4):
   bytes per GPU and FP8 KV tokens per GPU for the FP8 release as shipped (the source), W4A16 (g32),
   W4AFP8 (g128, the rest kept FP8);
2. convert throughput of --scheme w4afp8 against W4A16 RTN on the same tiny source (best of --repeat);
3. KL divergence against the source for W4A16 g128 (FP8 kept) and W4AFP8 at the same weights:
   the difference is the FP8 activations' own cost (eval-kld, local: evaluate/w4a8.py), dynamic per
   token (vLLM's W4A8-FP8) and static per layer (SGLang's native w4afp8, scales calibrated from routed
   tokens); and for a Kimi INT4 source (group 32), what re-grouping to W4AFP8's group 128 costs.

    python scripts/bench_w4afp8.py [--tokens 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 2**30


def _glm5(d: Path) -> Path:
    from transformers import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig().to_dict()
    cfg.update(architectures=["GlmMoeDsaForCausalLM"], num_nextn_predict_layers=1,
               quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]})
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _kimi(d: Path) -> Path:
    d.mkdir()
    shutil.copy(ROOT / "quantize" / "testing" / "kimi-k2.6-config.json", d / "config.json")
    return d


def plan_table(tmp: Path) -> list[str]:
    from quantize import kvcache
    from quantize.plan import plan

    rows = ["| model | output | weights per GPU (GiB) | FP8 KV tokens per GPU |", "|---|---|---:|---:|"]
    for name, make in (("GLM-5.x", _glm5), ("Kimi K2.6", _kimi)):
        src = make(tmp / name.replace(" ", "_"))
        for label, kw in (("source as shipped", None),
                          ("W4A16 g32 (default)", {}),
                          ("W4A16 g32 --keep-fp8", {"keep_fp8": True}),
                          ("W4AFP8 g128 (vllm)", {"scheme": "w4afp8"}),
                          ("W4AFP8 g128 (sglang)", {"scheme": "w4afp8", "engine": "sglang"})):
            extra = {"requantize": True} if name.startswith("Kimi") and kw and kw.get("scheme") else {}
            p = plan(src, 8, None, None, (kw or {}).get("keep_fp8", False), None, (kw or {}).get("scheme"),
                     (kw or {}).get("engine"),
                     extra.get("requantize", False), kvcache.H200_GIB, kvcache.DEFAULT_MEM_FRACTION,
                     kvcache.DEFAULT_RESERVE_GIB)
            s = p.summary()
            if kw is None:  # the source's own bytes per GPU: the even split plus what the output replicates
                per_gpu = s["even_split_source_bytes"] + (s["per_rank_output_bytes"] - s["even_split_output_bytes"])
                kv = kvcache.capacity(p.arch, p.config, per_gpu, 8).kv_tokens_per_gpu["fp8"]
            else:
                per_gpu = s["per_rank_output_bytes"]
                kv = p.kv.kv_tokens_per_gpu["fp8"]
            rows.append(f"| {name} | {label} | {per_gpu / GiB:.1f} | {kv / 1e6:.2f} M |")
    return rows


def convert_speed(tmp: Path, repeat: int) -> list[str]:
    from quantize.convert import convert
    from quantize.testing.tiny import make_tiny

    src = make_tiny("glm_moe_dsa", tmp / "speed-src", "vendor", 0, 1, {"n_routed_experts": 64}, False, False)
    best: dict[str, float] = {}
    for i in range(repeat):
        for label, kw in (("w4a16", {}), ("w4afp8", {"scheme": "w4afp8"}),
                          ("sglang", {"scheme": "w4afp8", "engine": "sglang", "samples": 16, "seq_len": 256})):
            out = tmp / f"speed-{label}-{i}"
            t0 = time.perf_counter()
            convert(src, out, **kw)
            best[label] = min(best.get(label, 1e9), time.perf_counter() - t0)
            shutil.rmtree(out)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    return [f"convert of a {size / 2**20:.0f} MiB tiny GLM-5 (64 experts), best of {repeat}: "
            f"W4A16 RTN {best['w4a16']:.2f} s, W4AFP8 (vllm) {best['w4afp8']:.2f} s, "
            f"ratio {best['w4afp8'] / best['w4a16']:.2f}x; W4AFP8 (sglang, its activation-scale calibration on "
            f"16 x 256 tokens included) {best['sglang']:.2f} s, ratio {best['sglang'] / best['w4a16']:.2f}x"]


# SGLang's native layout: static scales calibrated on the shipped corpus (its default: up to 128 samples)
SGLANG = {"scheme": "w4afp8", "engine": "sglang"}


def kld_table(tmp: Path, tokens: int) -> list[str]:
    from quantize.convert import convert
    from quantize.evaluate.kld import kld
    from quantize.testing.tiny import make_tiny

    rows = ["| source | candidate | KLD mean | same top-1 |", "|---|---|---:|---:|"]
    for arch in ("glm_moe_dsa", "deepseek_v3"):
        src = make_tiny(arch, tmp / f"kld-{arch}", "vendor", 0, 1, None, False, False)
        for label, kw in (("W4A16 g128, FP8 kept", {"group_size": 128, "keep_fp8": True}),
                          ("W4AFP8 vllm: dynamic per-token FP8 (same weights)", {"scheme": "w4afp8"}),
                          ("W4AFP8 sglang: static per-layer FP8 (same weights)", SGLANG)):
            out = tmp / f"kld-{arch}-{len(rows)}"
            convert(src, out, **kw)
            r = kld(src, out, tokens=tokens)
            rows.append(f"| tiny {arch} | {label} | {r.kld_mean:.5f} | {r.top1_agreement:.2%} |")
            if kw is SGLANG:
                rows.append(_dynamic_what_if(f"tiny {arch}", src, out, tokens))
    # Kimi K2.x ships INT4 by group 32: W4AFP8's group 128 re-groups its codes (--requantize). The source
    # itself is the baseline, so the W4A16 pass-through is 0 and the rest is what re-grouping (and FP8) cost
    src = make_tiny("kimi_k25", tmp / "kld-kimi", "vendor", 0, 1, None, False, False)
    for label, kw in (("W4A16 g32 passed through", {}),
                      ("W4A16 g128 re-grouped", {"group_size": 128, "requantize": True}),
                      ("W4AFP8 g128 re-grouped, vllm (dynamic)", {"scheme": "w4afp8", "requantize": True}),
                      ("W4AFP8 g128 re-grouped, sglang (static)", {**SGLANG, "requantize": True})):
        out = tmp / f"kld-kimi-{len(rows)}"
        convert(src, out, **kw)
        r = kld(src, out, tokens=tokens)
        rows.append(f"| tiny kimi_k25 (INT4 g32) | {label} | {r.kld_mean:.5f} | {r.top1_agreement:.2%} |")
        if kw.get("engine") == "sglang":
            rows.append(_dynamic_what_if("tiny kimi_k25 (INT4 g32)", src, out, tokens))
    return rows


def _dynamic_what_if(name: str, src: Path, out: Path, tokens: int) -> str:
    """The SGLang output's own weights with vLLM's dynamic per-token activations instead of its static
    scales: what static scales cost, apart from the layout's other changes (Kimi's BF16 Linears to FP8)."""
    from quantize.evaluate import kld as K
    from quantize.evaluate import w4a8

    static = w4a8._w4a8_static_forward
    w4a8._w4a8_static_forward = w4a8._w4a8_experts_forward  # bench only: the same model, dynamic activations
    try:
        r = K.kld(src, out, tokens=tokens)
    finally:
        w4a8._w4a8_static_forward = static
    return (f"| {name} | the same sglang weights, dynamic per-token FP8 instead | {r.kld_mean:.5f} | "
            f"{r.top1_agreement:.2%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-w4afp8-") as t:
        tmp = Path(t)
        for block in (plan_table(tmp), convert_speed(tmp, a.repeat), kld_table(tmp, a.tokens)):
            print("\n".join(block), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
