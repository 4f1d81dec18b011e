"""convert --scheme w4afp8 --engine sglang: SGLang 0.5.23's native w4afp8 layout (docs/engines.md#w4afp8,
route A), field by field against the facts read from its source, with the static per-expert FP8 input
scales calibrated from routed tokens checked against an oracle computed here from transformers' whole
model; near misses that must fail (nibble order, the uint4b8 offset, a scale rounded down, a starved
expert one token short)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantize.archs.base import EXPERT_ROLES, ROLES
from quantize.calibrate.act_scales import LayerAmax, scales
from quantize.checkpoint.index import CheckpointIndex
from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.formats import w4afp8 as W
from quantize.options import ConvertOptions
from quantize.plan import SGLANG_FP8_ROLES

from .conftest import load_dir

KW = dict(scheme="w4afp8", engine="sglang", samples=4, seq_len=64)


# -- the format math ----------------------------------------------------------------------------


def test_native_nibbles_against_a_hand_decoder_and_compressed_tensors():
    """Element 2j in the low nibble of byte j, two's complement (SGLang's compressed-tensors repack,
    compressed_tensors_w4a8_fp8_moe.py L37-73); compressed-tensors' own pack_to_int32 is the oracle for
    the packed form, and its bytes XOR 0x88 are the native ones."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (6, 256), generator=g, dtype=torch.int8)
    b = W.pack(q)
    assert b.dtype == torch.int8 and tuple(b.shape) == (6, 128)
    u = b.view(torch.uint8).to(torch.int16)
    lo, hi = u & 0xF, u >> 4
    signed = lambda n: n - 16 * (n >= 8)  # noqa: E731
    assert torch.equal(signed(lo), q[:, 0::2].to(torch.int16)) and torch.equal(signed(hi), q[:, 1::2].to(torch.int16))
    assert torch.equal(W.unpack(b), q)
    packed = pack_to_int32(q, 4)
    assert torch.equal(W.from_packed(packed), b) and torch.equal(W.to_packed(b), packed)
    # near misses: the high nibble first, or compressed-tensors' q + 8 kept (no XOR), decode to other codes
    swapped = ((u & 0xF) << 4 | (u >> 4)).to(torch.uint8).view(torch.int8)
    assert not torch.equal(W.unpack(swapped), q)
    assert not torch.equal(W.unpack(packed.view(torch.uint8).view(torch.int8)), q)


def test_input_scale_rounds_up_to_bf16():
    """SGLang holds the input scale as bf16: the written value is a bf16 value, never below amax / 448,
    so the largest calibrated activation stays within e4m3's range; round-to-nearest would not."""
    down = 0
    for amax in torch.linspace(0.01, 50.0, 997).tolist():
        s = W.input_scale(amax)
        assert float(torch.tensor(s).to(torch.bfloat16)) == s
        assert s >= amax / 448 and amax / s <= 448
        nearest = float(torch.tensor(amax / 448).to(torch.bfloat16))
        assert s == nearest or (nearest < amax / 448 and s > nearest)
        down += nearest < amax / 448
    assert down > 100  # the near miss happens: nearest rounding would overflow 448 for these
    assert W.input_scale(0.0) > 0


def test_starved_experts_take_the_layer_scale_one_token_short():
    st = LayerAmax([1.0, 4.0, 2.0], [0.5, 0.25, 3.0], [10, 9, 40])
    got = scales({1: st}, {1: 3, 4: 3}, min_tokens=10)
    assert got.layers[0]["starved"] == [1]  # 9 tokens, one short of 10
    assert got.scales[1][0] == (W.input_scale(1.0), W.input_scale(0.5))
    assert got.scales[1][1] == (W.input_scale(4.0), W.input_scale(3.0))  # the layer's largest, both GEMMs
    assert got.scales[1][2] == (W.input_scale(2.0), W.input_scale(3.0))
    assert scales({1: st}, {1: 3}, min_tokens=9).layers[0]["starved"] == []
    # a MoE layer the stream never ran (the MTP layer): the largest calibrated scales, named
    assert got.uncalibrated == [4] and got.scales[4] == [(W.input_scale(4.0), W.input_scale(3.0))] * 3
    with pytest.raises(QuantizeError, match="routed no token"):
        scales({}, {1: 3}, 1)


class _Streamer:
    """What ``act_scales.observe`` reads of ``LayerStreamer``: the config's expert count, the tap it
    sets, and ``stream``, which here calls the tap with ``taps`` (layer -> [(expert, x, inner)]) and
    yields each layer after its taps; ``stop_after`` raises before layer 0 is yielded."""

    config = type("Config", (), {"n_routed_experts": 4})()

    def __init__(self, taps, stop_after=False):
        self.taps, self.stop_after, self.expert_tap = taps, stop_after, None

    def stream(self, samples):
        for i, calls in self.taps.items():
            for e, x, inner in calls:
                self.expert_tap(i, e, x, inner)
            if self.stop_after:
                raise LookupError("stopped before the layer was read")
            yield i, []


def test_expert_maxima_by_hand_bf16_rounded():
    """Per layer and expert: the largest |x| after bf16 rounding, of either GEMM input, and the tokens
    (rows) routed; an expert never tapped keeps 0 and 0 tokens."""
    from quantize.calibrate.act_scales import observe

    x = torch.tensor([[0.5, -1.00390625], [2.0, 0.25]])  # 1.00390625 is 1 + 2**-8: bf16 rounds it to 1.0
    inner = torch.tensor([[-3.015625], [1.0]])  # 3 + 2**-6: exact in bf16 (7 fraction bits); 3 + 2**-7 is not
    taps = {0: [(1, x, inner), (1, x[:1] * 4, inner[1:]), (3, x[:0], inner[:0])], 2: [(0, x[1:], -inner)]}
    seen = observe(_Streamer(taps), [torch.zeros(1)])
    assert sorted(seen) == [0, 2]
    # layer 0 expert 1: gemm1 max(2.0, |-1.00390625 * 4| = 4.015625 -> bf16 4.0); gemm2 3.015625
    assert seen[0].gemm1 == [0.0, 4.0, 0.0, 0.0] and seen[0].gemm2 == [0.0, 3.015625, 0.0, 0.0]
    assert seen[0].tokens == [0, 3, 0, 0]  # 2 + 1 rows; expert 3's empty call adds none
    assert seen[2].gemm1 == [2.0, 0.0, 0.0, 0.0] and seen[2].gemm2 == [3.015625, 0.0, 0.0, 0.0]
    assert seen[2].tokens == [1, 0, 0, 0]


def test_the_taps_read_nothing_on_the_host_before_a_layer_is_done():
    """A tap runs per expert and sample; on a GPU a host read there (``float``, ``.item()``) waits for
    the device each time. With the tapped tensors on ``meta`` any such read raises, so a stream that
    stops before its layer is read ends with its own error, not a read's."""
    from quantize.calibrate.act_scales import observe

    x, inner = torch.empty((3, 8), device="meta"), torch.empty((3, 4), device="meta")
    with pytest.raises(RuntimeError):
        float(x.abs().amax())  # the near miss: a read of a meta tensor is caught
    taps = {0: [(e % 4, x, inner) for e in range(6)]}
    with pytest.raises(LookupError, match="stopped before"):
        observe(_Streamer(taps, stop_after=True), [torch.zeros(1)])
    with pytest.raises((RuntimeError, NotImplementedError)):  # read when the layer is done: here, on meta
        observe(_Streamer(taps), [torch.zeros(1)])


# -- the written checkpoint -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def native(tiny, tmp_path_factory):
    src = tiny("glm_moe_dsa", layout="bf16")
    root = tmp_path_factory.mktemp("w4afp8-sglang")
    convert(src, root / "sg", **KW)
    convert(src, root / "vl", scheme="w4afp8")
    return src, root / "sg", root / "vl"


def _roles(folder):
    from quantize import archs

    index = CheckpointIndex.open(folder)
    arch = archs.resolve(index.config, str(folder / "config.json"))
    return {n: arch.role_of(n)[0] for n in index.tensors}


def test_the_layout_is_what_sglang_reads_field_by_field(native):
    src, out, _ = native
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "w4afp8"  # the one key W4AFp8Config.from_config reads
    t, s, roles = load_dir(out), load_dir(src), _roles(out)
    assert not [n for n in t if n.endswith(("weight_packed", "weight_shape", ".weight_scale"))]
    experts = sorted({n.rsplit(".", 1)[0] for n in t if roles[n] in EXPERT_ROLES})
    assert experts
    for e in experts:
        o, k = s[e + ".weight"].shape
        assert t[e + ".weight"].dtype == torch.int8 and tuple(t[e + ".weight"].shape) == (o, k // 2)
        assert t[e + ".weight_scale_inv"].dtype == torch.float32 and tuple(t[e + ".weight_scale_inv"].shape) == (
            o, k // 128)
        a = t[e + ".input_scale"]
        assert a.dtype == torch.float32 and tuple(a.shape) == (1,) and float(a) > 0
        if e.endswith("gate_proj"):  # w1 and w3 of one expert must agree (layer.py L1419-1445)
            assert torch.equal(a, t[e[: -len("gate_proj")] + "up_proj.input_scale"])
    linears = {n for n in t if n.endswith(".weight") and t[n].dim() == 2 and ROLES[roles[n]][0]}
    for n in linears:
        base = n[: -len(".weight")]
        if roles[n] in SGLANG_FP8_ROLES:  # every LinearBase through Fp8LinearMethod: 128x128 block FP8
            rows, cols = t[n].shape
            assert t[n].dtype == torch.float8_e4m3fn, n
            assert t[base + ".weight_scale_inv"].dtype == torch.float32
            assert tuple(t[base + ".weight_scale_inv"].shape) == (-(-rows // 128), -(-cols // 128))
        elif roles[n] not in EXPERT_ROLES:
            assert t[n].dtype == torch.bfloat16 and base + ".weight_scale_inv" not in t, n
    assert {roles[n] for n in linears if t[n].dtype == torch.bfloat16} >= {"lm_head", "router", "mtp_proj"}
    # the BF16 source's Linears, block FP8 with fp32 scales: within e4m3's rounding of the source
    n = next(n for n in linears if roles[n] == "attn_o")
    from quantize.formats.fp8 import dequant_block

    w = dequant_block(t[n], t[n[: -len(".weight")] + ".weight_scale_inv"], (128, 128), dtype=torch.float32)
    assert torch.allclose(w, s[n].float(), rtol=0.07, atol=1e-6)


def test_codes_are_the_vllm_codes_bit_for_bit(native):
    """The same RTN codes as the compressed-tensors W4A8-FP8 output, only re-encoded: each native byte
    is the packed word's byte XOR 0x88, the fp32 scale is the bf16 scale exactly."""
    _, sg, vl = native
    t, v = load_dir(sg), load_dir(vl)
    mods = [n[: -len(".weight_packed")] for n in v if n.endswith(".weight_packed")]
    assert mods
    for m in mods:
        assert torch.equal(t[m + ".weight"].view(torch.uint8),
                           v[m + ".weight_packed"].contiguous().view(torch.uint8) ^ 0x88)
        assert torch.equal(t[m + ".weight_scale_inv"], v[m + ".weight_scale"].float())


def _oracle(src, ids):
    """Per MoE layer and expert, from transformers' whole model (float32, eager): the largest |x| (as
    bf16) of each GEMM input over the tokens routed to the expert, and their count."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, config=cfg, dtype=torch.float32).eval()
    seen: dict[int, dict] = {}

    def hook(layer):
        def pre(mod, args):
            x, index = args[0], args[1]
            st = seen.setdefault(layer, {})
            for e in range(mod.num_experts):
                tok = (index == e).any(-1).nonzero().flatten()
                if not tok.numel():
                    continue
                xe = x[tok]
                gate, up = torch.nn.functional.linear(xe, mod.gate_up_proj[e]).chunk(2, dim=-1)
                inner = mod.act_fn(gate) * up
                a, b, n = st.get(e, (0.0, 0.0, 0))
                bf = lambda z: float(z.to(torch.bfloat16).abs().amax())  # noqa: E731
                st[e] = (max(a, bf(xe)), max(b, bf(inner)), n + int(tok.numel()))
        return pre

    for name, mod in model.named_modules():
        if name.endswith("mlp.experts") and hasattr(mod, "gate_up_proj"):
            mod.register_forward_pre_hook(hook(int(name.split("layers.")[1].split(".")[0])))
    with torch.no_grad():
        for x in ids:
            model(input_ids=x.unsqueeze(0))
    return seen


def test_input_scales_against_the_whole_model(native):
    """Every expert's written input scales equal amax / 448 rounded up to bf16 of the oracle's maxima
    (the whole model's routed tokens, counted here), and the MTP layer's are the calibrated layers' largest."""
    from quantize.methods.runner import prepare

    src, out, _ = native
    opts = ConvertOptions(source=src, out=out, **KW).resolve(None)
    seen = _oracle(src, prepare(src, opts).ids)
    t = load_dir(out)
    man = json.loads((out / "quantize_manifest.json").read_text())["activation_scales"]
    assert man["min_tokens"] == 16 and man["data"]["samples"] == 4
    assert [r["layer"] for r in man["layers"]] == sorted(seen) and man["uncalibrated"] == [3]
    top = [0.0, 0.0]
    for r in man["layers"]:
        i, st = r["layer"], seen[r["layer"]]
        counts = [st.get(e, (0, 0, 0))[2] for e in range(8)]
        assert (r["tokens_min"], r["tokens_max"]) == (min(counts), max(counts))
        assert r["starved"] == [e for e in range(8) if counts[e] < 16]
        layer_max = (max(v[0] for v in st.values()), max(v[1] for v in st.values()))
        for e in range(8):
            want = layer_max if e in r["starved"] else st[e][:2]
            base = f"model.layers.{i}.mlp.experts.{e}."
            assert float(t[base + "gate_proj.input_scale"]) == W.input_scale(want[0]), (i, e)
            assert float(t[base + "down_proj.input_scale"]) == W.input_scale(want[1]), (i, e)
        top = [max(top[0], layer_max[0]), max(top[1], layer_max[1])]
    assert float(t["model.layers.3.mlp.experts.5.up_proj.input_scale"]) == W.input_scale(top[0])
    assert float(t["model.layers.3.mlp.experts.5.down_proj.input_scale"]) == W.input_scale(top[1])


def test_local_eval_uses_the_static_scales_and_refuses_without_them(native, tmp_path):
    """eval / eval-kld run the experts with SGLang's numerics: each GEMM input through e4m3 at the
    layer's largest input scale; a checkpoint missing them is refused (SGLang would silently use 1.0)."""
    from quantize.evaluate import w4a8
    from quantize.evaluate.kld import load_model

    _, out, _ = native
    m = load_model(out, torch.float32)
    patched = {n: mod.w4a8_scales for n, mod in m.named_modules() if hasattr(mod, "w4a8_scales")}
    t = load_dir(out)
    assert set(patched) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    for n, (a1, a2) in patched.items():
        i = n.split(".")[2]
        assert a1 == max(float(v) for k, v in t.items()
                         if k.startswith(f"model.layers.{i}.mlp.experts.") and k.endswith(("gate_proj.input_scale",
                                                                                           "up_proj.input_scale")))
        assert a2 == max(float(v) for k, v in t.items()
                         if k.startswith(f"model.layers.{i}.mlp.experts.") and k.endswith("down_proj.input_scale"))
    x = torch.tensor([[0.001, 1.0, -3.0]])
    assert torch.equal(W.fake_fp8_static(x, 1.0), x.to(torch.float8_e4m3fn).float())
    # without the scales: one line
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(out, bad)
    for f in bad.glob("*.safetensors"):
        d = load_file(f)
        save_file({k: v for k, v in d.items() if not (".layers.2." in k and k.endswith("input_scale"))}, f,
                  metadata={"format": "pt"})
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items()
                         if not (".layers.2." in k and k.endswith("input_scale"))}
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(QuantizeError, match="input_scale of every routed expert"):
        w4a8.apply(m, json.loads((bad / "config.json").read_text()), bad)


def test_an_int4_group_128_source_passes_its_codes_through(tiny, tmp_path):
    """An INT4 source by group 128 (this tool's W4A16 g128 output): its codes survive bit for bit in
    SGLang's bytes; Kimi's group 32 needs --requantize, said in one line."""
    g128 = tmp_path / "g128"
    convert(tiny("glm_moe_dsa", layout="bf16"), g128, group_size=128)
    out = tmp_path / "sg"
    convert(g128, out, **KW)
    s, t = load_dir(g128), load_dir(out)
    mods = [n[: -len(".weight_packed")] for n in s if n.endswith(".weight_packed")]
    assert mods
    for m in mods:
        assert torch.equal(t[m + ".weight"], W.from_packed(s[m + ".weight_packed"]))
        assert torch.equal(t[m + ".weight_scale_inv"], s[m + ".weight_scale"].float())
    man = json.loads((out / "quantize_manifest.json").read_text())
    assert all(x.get("passed_through") for x in man["tensors"] if ".experts." in x["name"])
    with pytest.raises(QuantizeError, match="group 32 .* add --requantize"):
        convert(tiny("kimi_k25"), tmp_path / "k", **KW)
    assert not (tmp_path / "k").exists()


def test_kimi_requantized_its_bf16_linears_become_block_fp8(tiny, tmp_path):
    """Kimi K2.x ships attention and shared experts BF16: SGLang's w4afp8 casts every LinearBase to FP8
    with no ignore list, so they are written 128x128 block FP8; the vision tower and projector stay BF16
    (built without quant_config, sglang/srt/models/kimi_k25.py L680-700)."""
    out = tmp_path / "k"
    convert(tiny("kimi_k25"), out, requantize=True, **KW)
    t, roles = load_dir(out), _roles(out)
    for n, v in t.items():
        if n.endswith(".weight") and v.dim() == 2 and ROLES[roles[n]][0]:
            want = torch.int8 if roles[n] in EXPERT_ROLES else torch.float8_e4m3fn if roles[n] in SGLANG_FP8_ROLES \
                else torch.bfloat16
            assert v.dtype == want, (n, roles[n], v.dtype)
    assert any(roles[n] in ("vision", "projector") for n in t)


def test_two_ranks_and_a_resume_give_the_same_bytes(native, tmp_path):
    """The calibration's samples split over two ranks (gloo, real processes): the same maxima, so the
    same checkpoint; a run stopped after the calibration resumes from its kept scales (not measured
    again) to the same bytes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from .conftest import weights_only

    src, one, _ = native
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    two = tmp_path / "two"
    args = ["--scheme", "w4afp8", "--engine", "sglang", "--samples", "4", "--seq-len", "64"]
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "convert", str(src), str(two), *args, "--nproc", "2"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert weights_only(two) == weights_only(one)
    # stopped once the scales are measured, before any shard: --resume reads them back, it does not measure
    # again (a kept file changed by hand shows which was used)
    class Stop(Exception):
        pass

    def stop(ev):
        if ev.get("event") == "start" and ev.get("stage") == "convert":
            raise Stop

    three = tmp_path / "three"
    with pytest.raises(Stop):
        convert(src, three, emit=stop, **KW)
    kept = three / ".quantize" / "act_scales.json"
    assert kept.is_file() and not list(three.glob("*.safetensors"))
    convert(src, three, resume=True, **KW)
    assert weights_only(three) == weights_only(one)
    doc = json.loads(kept.read_text())
    doc["scales"]["1"][0] = [0.5, 0.25]
    kept.write_text(json.dumps(doc))
    four = tmp_path / "four"
    with pytest.raises(Stop):
        convert(src, four, emit=stop, **KW)
    (four / ".quantize" / "act_scales.json").write_text(json.dumps(doc))
    convert(src, four, resume=True, **KW)
    t = load_dir(four)
    assert float(t["model.layers.1.mlp.experts.0.gate_proj.input_scale"]) == 0.5
    assert float(t["model.layers.1.mlp.experts.0.down_proj.input_scale"]) == 0.25


# -- check --------------------------------------------------------------------------------------


def _tampered(out, tmp_path, edit):
    """A copy of ``out`` with ``edit(tensors)`` applied to every shard's tensors (the index kept in step)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    names = {}
    for f in bad.glob("*.safetensors"):
        d = load_file(f)
        edit(d)
        save_file(d, f, metadata={"format": "pt"})
        names.update({k: f.name for k in d})
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    idx["weight_map"] = names
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    return bad


E0 = "model.layers.1.mlp.experts.0."


def test_check_proves_the_native_layout_against_the_source(native):
    from quantize.check import check

    src, out, _ = native
    r = check(out, source=src)
    assert r.ok, r.failures[:3]
    assert r.verified["layout"] == "sglang w4afp8"
    assert r.verified["tensors_exact_vs_source"] == len(CheckpointIndex.open(src).tensors)  # every one, one for one
    assert all(row.unpack_ok and row.w4a8_rel_err < 0.05 for row in r.rows) and len(r.rows) == 72
    assert check(out, tp=2).ok and not check(out, tp=4).ok  # intermediate 256 / 4 = 64: not a multiple of 128


def _set(name, f):
    def edit(d):
        if name in d:
            d[name] = f(d[name])
    return edit


def _drop(name):
    def edit(d):
        d.pop(name, None)
    return edit


@pytest.mark.parametrize("edit, says", [
    (_set(E0 + "gate_proj.weight_scale_inv", lambda v: v.t().contiguous()), "weight_scale_inv is F32 \\[2, 256\\]"),
    (_drop(E0 + "down_proj.input_scale"), "down_proj.input_scale is missing"),
    (_set(E0 + "up_proj.input_scale", lambda v: v * 2), "differs from its up_proj's"),
    (_set(E0 + "up_proj.weight", lambda v: W.to_packed(v)), "int8 nibble pairs"),  # compressed-tensors' int32 words
    (_set("model.layers.1.self_attn.o_proj.weight", lambda v: v.float().to(torch.bfloat16)), "o_proj.weight is BF16"),
])
def test_check_refuses_a_layout_sglang_misreads(native, tmp_path, edit, says):
    from quantize.check import check
    from quantize.errors import CheckFailed

    _, out, _ = native
    with pytest.raises(CheckFailed, match=says):
        check(_tampered(out, tmp_path, edit))


def test_check_finds_swapped_nibbles_against_the_source(native, tmp_path):
    """Nibbles swapped in one expert: the layout still reads, the bytes no longer re-derive."""
    from quantize.check import check

    src, out, _ = native

    def swap(d):
        k = E0 + "gate_proj.weight"
        if k in d:
            u = d[k].view(torch.uint8)
            d[k] = ((u << 4) | (u >> 4)).view(torch.int8)

    r = check(_tampered(out, tmp_path, swap), source=src)
    assert any(f"{E0}gate_proj.weight: INT4 codes/scales differ" in f for f in r.failures), r.failures


def test_the_card_gives_the_sglang_line_and_names_what_the_calibration_did_not_reach(native, tmp_path):
    import shutil

    from quantize.publish.card import card

    _, out, _ = native
    d = tmp_path / "c"
    shutil.copytree(out, d)
    text = card(d).text
    assert "python -m sglang.launch_server --model-path" in text and "vllm serve" not in text
    assert "SGLang's native `w4afp8` layout" in text and "- w4afp8" in text
    assert "4 \\\ncalibration samples" not in text and "4 calibration samples" in text
    assert "layer 3: not calibrated (the MTP draft layer" in text
    man = json.loads((d / "quantize_manifest.json").read_text())
    starved = [(r["layer"], r["starved"]) for r in man["activation_scales"]["layers"] if r["starved"]]
    for layer, es in starved:  # named by hand from the manifest
        assert f"layer {layer}: {', '.join(map(str, es))} ({len(es)} expert" in text
    if not starved:
        assert "none: every expert of every calibrated layer was routed enough tokens" in text


def test_shard_refuses_the_native_layout_and_the_card_takes_the_tp_sglang_allows(native, tmp_path):
    """quantize shard writes no per-rank SGLang w4afp8 (one line, nothing written); the card's launch TP is
    the largest whose intermediate / TP is a multiple of 128 (tiny: 256 -> TP 2, not 4), the rule check --tp
    applies."""
    import shutil

    from quantize.publish.card import card
    from quantize.shard import plan_shard, shard

    _, out, _ = native
    with pytest.raises(QuantizeError, match="not sharded by this version"):
        shard(out, tmp_path / "s", tp=2)
    assert not (tmp_path / "s").exists()
    from quantize.plan import sglang_w4a8_violation

    plan_shard(out, 2)
    with pytest.raises(QuantizeError, match="TP 4"):  # the FP8 block rule says it first here
        plan_shard(out, 4)
    assert sglang_w4a8_violation(256, 256, 4) == "moe_intermediate_size 256 / TP 4 is not a multiple of 128"
    assert sglang_w4a8_violation(256, 256, 2) is None
    # GLM-5.x / Kimi K2.x (hidden 6144 / 7168, intermediate 2048): TP 16 still fits SGLang (128), not TP 32
    assert sglang_w4a8_violation(6144, 2048, 16) is None and sglang_w4a8_violation(7168, 2048, 32) is not None
    assert sglang_w4a8_violation(6208, 2048, 1) == "hidden_size 6208 is not a multiple of 128"
    d = tmp_path / "c"
    shutil.copytree(out, d)
    assert "--model-path c --tp 2 --kv-cache-dtype fp8_e4m3" in card(d).text
