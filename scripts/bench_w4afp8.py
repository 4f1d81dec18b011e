"""W4AFP8 figures (issue 36), each side by side in one run:

1. plan at TP 8 on an H200 for GLM-5.x (transformers' GlmMoeDsaConfig defaults, Z.ai's block-FP8
   quantization_config) and Kimi K2.6 (quantize/testing/kimi-k2.6-config.json, Moonshot's INT4):
   bytes per GPU and FP8 KV tokens per GPU for the FP8 release as shipped (the source), W4A16 (g32),
   W4AFP8 (g128, the rest kept FP8);
2. convert throughput of --scheme w4afp8 against W4A16 RTN on the same tiny source (best of --repeat);
3. KL divergence against the source for W4A16 g128 (FP8 kept) and W4AFP8 at the same weights:
   the difference is the FP8 activations' own cost (eval-kld, local: evaluate/w4a8.py), dynamic per
   token (vLLM's W4A8-FP8) and static per layer (SGLang's native w4afp8, scales calibrated from routed
   tokens); and for a Kimi INT4 source (group 32), what re-grouping to W4AFP8's group 128 costs;
4. with --smollm2 (a trained model, every decoder Linear INT4 g64 RTN: 576 is not a multiple of 128): KL
   against the source on GSM8K test and ARC text for W4A16 and for the same weights with every decoder
   Linear's input through FP8 e4m3, dynamic per token (vLLM's dense W4A8-FP8) and static per tensor
   (amax over GSM8K-train text / 448, rounded up to bf16, as the SGLang calibration does): the
   activations' cost where the random tiny models have no outliers.

    python scripts/bench_w4afp8.py [--tokens 4096] [--repeat 3] [--smollm2 DIR --data-dir DATA]
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
sys.path.insert(0, str(ROOT / "scripts"))  # bench_methods' texts

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


def _decoder_linears(model):
    """(name, module) of every ``nn.Linear`` inside the decoder layers (not the LM head)."""
    import torch

    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in f".{n}"]


def _fp8_inputs(model, scales: dict[str, float] | None) -> list:
    """Every decoder ``nn.Linear`` of ``model`` (not the LM head) gets its input through FP8 e4m3:
    per token (``scales`` None) or with ``scales[name]``, one static scale per tensor. -> the hooks."""
    from quantize.evaluate.w4a8 import _fake_fp8
    from quantize.formats.w4afp8 import fake_fp8_static

    hooks = []
    for name, m in _decoder_linears(model):
        fq = _fake_fp8 if scales is None else (lambda x, s=scales[name]: fake_fp8_static(x, s))
        hooks.append(m.register_forward_pre_hook(lambda mod, args, fq=fq: (fq(args[0]),) + args[1:]))
    return hooks


def _static_scales(src: Path, train: Path, samples: int, seq_len: int) -> dict[str, float]:
    """Per decoder Linear of the source model: the largest |input| over ``samples`` GSM8K-train texts
    (at most ``seq_len`` tokens each) / 448, rounded up to a bf16 value (SGLang's calibration rule)."""
    import torch

    from quantize.evaluate.kld import _tokenizer, load_model
    from quantize.formats.w4afp8 import input_scale

    model, tok = load_model(src, torch.float32), _tokenizer(src)
    amax: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: amax.__setitem__(
                 n, max(amax.get(n, 0.0), float(args[0].abs().max()))))
             for n, m in _decoder_linears(model)]
    recs = [json.loads(line) for line in train.read_text().splitlines() if line.strip()][:samples]
    with torch.no_grad():
        for r in recs:
            ids = tok(f"{r['question']}\n{r['answer']}", return_tensors="pt").input_ids[:, :seq_len]
            model(ids)
    for h in hooks:
        h.remove()
    return {n: input_scale(a) for n, a in amax.items()}


def smollm2_table(tmp: Path, smollm2: Path, data: Path, tokens: int) -> list[str]:
    """SmolLM2 W4A16 RTN against the same weights with FP8 inputs, dynamic and static, and the source's own
    weights with FP8 inputs (what the activations cost alone). Group 64: its
    hidden size (576) is not a multiple of W4AFP8's 128, so the engines' W4AFP8 layout cannot hold it; the
    activations' own cost is what this measures, and it does not depend on the weights' group."""
    import torch

    import bench_methods
    from quantize.convert import convert
    from quantize.evaluate.kld import kld, load_model, model_key

    bench_methods.DATA = data
    text = bench_methods.texts(tmp / "text")
    out = tmp / "smollm2-g64"
    convert(smollm2, out, profile="all-linear", group_size=64)
    static = _static_scales(smollm2, data / "gsm8k" / "train.jsonl", 128, 512)
    rows = ["| SmolLM2-135M, every decoder Linear INT4 g64 (RTN) | text | KLD mean | same top-1 |",
            "|---|---|---:|---:|"]
    for label, scales, weights in (
            ("W4A16", False, out), ("W4AFP8, dynamic per-token FP8 inputs (same weights)", None, out),
            ("W4AFP8, static per-tensor FP8 inputs (same weights)", static, out),
            ("BF16 weights, dynamic per-token FP8 inputs (the activations alone)", None, smollm2),
            ("BF16 weights, static per-tensor FP8 inputs (the activations alone)", static, smollm2)):
        # bench only: the model scored as the candidate is ``weights`` (the source itself for the last two)
        model = load_model(weights, torch.float32)
        if scales is not False:
            _fp8_inputs(model, scales)
        for name, path in text.items():
            r = kld(smollm2, out, text=path, tokens=tokens, loaded={model_key(out, torch.float32, "cpu"): model})
            rows.append(f"| {label} | {name} | {r.kld_mean:.4f} | {r.top1_agreement:.2%} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smollm2", type=Path, help="SmolLM2 transformers checkpoint (scripts/smollm2_to_hf.py OUT)")
    ap.add_argument("--data-dir", type=Path, help="local eval data (GSM8K train/test, ARC), with --smollm2")
    ap.add_argument("--only-smollm2", action="store_true", help="only the SmolLM2 table")
    a = ap.parse_args()
    if a.smollm2 and not a.data_dir:
        ap.error("--smollm2 needs --data-dir")
    with tempfile.TemporaryDirectory(prefix="bench-w4afp8-") as t:
        tmp = Path(t)
        blocks = [] if a.only_smollm2 else [lambda: plan_table(tmp), lambda: convert_speed(tmp, a.repeat),
                                             lambda: kld_table(tmp, a.tokens)]
        if a.smollm2:
            blocks.append(lambda: smollm2_table(tmp, a.smollm2, a.data_dir, a.tokens))
        for block in blocks:
            print("\n".join(block()), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
