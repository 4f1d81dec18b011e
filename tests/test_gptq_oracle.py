"""--method gptq against llm-compressor's own GPTQModifier (oneshot, sequential pipeline) on the same
token samples, tiny dense Llama, every decoder Linear INT4 g32, dampening 0.01, block 128, actorder
off and static. llm-compressor's grid is compressed-tensors' minmax (absmax / 7.5), so ours runs
with --observer minmax and --scale-search rtn: GPTQ's own defaults are the full-range grid and a
Hessian-weighted clip search per group, which llm-compressor has not.

Measured (4 samples x 64 tokens), actorder off: 90.0 % of codes identical (layer 0 q/k/v 98.7 %),
scales 100 % identical; KLD against the BF16 source over 512 tokens: ours 1.69e-4 (top-1 82.8 %),
llm-compressor 1.96e-4 (87.3 %), RTN 2.19e-3 (49.6 %); with 8 x 128 tokens 91.3 %, 1.26e-4 vs
1.15e-4. actorder static (llm-compressor's default and ours): 85.4 % (q/k/v 92.2 %), KLD 1.67e-4
vs 1.66e-4 — the column order itself comes from the Hessian's diagonal, so near-equal diagonal
entries may be visited in another order. Negative control: RTN's codes agree with
llm-compressor's on only 80.5-81.7 %.

The systematic difference: llm-compressor calibrates the model in its own dtype (BF16 here) with
transformers' SDPA attention, we run transformers' layer classes in FP32 (eager attention). Run in
BF16, our layer-0 q/k/v codes become 100 % identical (same Hessian accumulation, same update, same
grid); o_proj and the MLP still differ a little (attention kernel, BF16 products of act(gate)*up).
GPTQ's column-by-column error feedback turns such last-bit Hessian differences into a few flipped
roundings, and every later layer inherits them through the quantized hidden states.
"""

import shutil

import pytest
import torch

from quantize.calibrate.data import build_samples
from quantize.convert import convert
from quantize.evaluate.kld import kld
from quantize.formats import int4

from .conftest import load_dir

N, L = 4, 64
FLOORS = {"off": (0.87, 0.97), "static": (0.82, 0.9)}  # measured: 0.900 / 0.986; 0.854 / see the docstring


def _codes(d):
    t = load_dir(d)
    return {k[: -len(".weight_packed")]: (int4.unpack_int4(v, int(t[k[: -len("packed")] + "shape"][1])), t[k[: -len("packed")] + "scale"])
            for k, v in t.items() if k.endswith(".weight_packed")}


def _same(a, b, keys=None):
    keys = list(keys or a)
    assert keys and set(keys) <= set(b)
    return sum(int((a[k][0] == b[k][0]).sum()) for k in keys) / sum(a[k][0].numel() for k in keys)


@pytest.fixture(scope="module", params=["off", "static"])
def three(request, tiny, tmp_path_factory):
    import datasets
    import transformers
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    src = tiny("llama", layout="bf16")
    order = request.param
    root = tmp_path_factory.mktemp(f"oracle-{order}")
    ours, theirs, rtn = root / "ours", root / "theirs", root / "rtn"
    convert(src, ours, profile="all-linear", method="gptq", observer="minmax", samples=N, seq_len=L, damp=0.01,
            block=128, actorder=order, scale_search="rtn")  # llm-compressor's grid and scales, not our defaults
    convert(src, rtn, profile="all-linear")
    ids = build_samples(src, None, N, L).ids  # the very samples our pass used
    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ds = datasets.Dataset.from_dict({"input_ids": [i.tolist() for i in ids], "attention_mask": [[1] * len(i) for i in ids]})
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], actorder=None if order == "off" else "static",
                          dampening_frac=0.01, block_size=128)
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=N, max_seq_length=L, shuffle_calibration_samples=False)
    model.save_pretrained(theirs, save_compressed=True)
    for f in list(src.glob("tokenizer*")) + list(src.glob("special_tokens*")):
        shutil.copy(f, theirs / f.name)
    from .lineage import made_from

    made_from(theirs, src)  # llm-compressor records no source; eval-kld compares only a candidate made from src
    return src, ours, theirs, rtn, order


def test_codes_agree_with_llm_compressor_gptq(three):
    src, ours, theirs, rtn, order = three
    a, b, r = _codes(ours), _codes(theirs), _codes(rtn)
    assert len(a) == len(b) == 14
    assert all(torch.equal(a[k][1], b[k][1]) for k in a)  # the same static grid
    same = _same(a, b)
    control = _same(r, b)
    qkv = _same(a, b, [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])
    print(f"actorder {order}: identical codes ours vs llm-compressor {same:.4f} (layer-0 q/k/v {qkv:.4f}), RTN vs llm-compressor {control:.4f}")
    floor, qkv_floor = FLOORS[order]
    assert same >= floor
    assert same > control + 0.03
    # layer 0's attention inputs are the same embeddings on both sides: near-identical codes
    assert qkv >= qkv_floor


def test_kld_close_to_llm_compressor_gptq(three):
    src, ours, theirs, rtn, order = three
    k = {n: kld(src, p, tokens=512, chunk=128) for n, p in (("ours", ours), ("theirs", theirs), ("rtn", rtn))}
    print({n: (round(r.kld_mean, 6), round(r.top1_agreement, 4)) for n, r in k.items()})
    assert k["ours"].kld_mean < k["rtn"].kld_mean / 5 and k["theirs"].kld_mean < k["rtn"].kld_mean / 5
    assert 1 / 1.5 < k["ours"].kld_mean / k["theirs"].kld_mean < 1.5
