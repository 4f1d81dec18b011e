"""Data-aware methods (--method gptq / autoround): layer-sequential, MoE-aware, resumable, the
output format unchanged. Tiny fixtures, a few short samples: seconds per conversion."""

import json
import os
import signal
import subprocess
import sys
import weakref

import pytest
import torch

from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.evaluate.kld import kld
from quantize.formats import int4

from .conftest import load_dir, weights_only

CAL = dict(samples=4, seq_len=64)


def _manifest(out):
    return json.loads((out / "quantize_manifest.json").read_text())


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama", layout="bf16")


@pytest.fixture(scope="module")
def outs(llama, tmp_path_factory):
    """Tiny dense llama, every decoder Linear INT4 g32: RTN, GPTQ, AutoRound (20 steps) and its
    iters-0 grid, on the same calibration samples; none names an observer, so each runs on its
    method's default grid (RTN minmax, GPTQ and AutoRound fullrange)."""
    root = tmp_path_factory.mktemp("methods")
    res = {}
    for name, kw in {"rtn": {}, "gptq": dict(method="gptq", **CAL),
                     "gptq_rtn_scales": dict(method="gptq", scale_search="rtn", **CAL),
                     "autoround": dict(method="autoround", iters=20, **CAL),
                     "autoround0": dict(method="autoround", iters=0, **CAL),
                     "autoround_gptq": dict(method="autoround", iters=20, init="gptq", **CAL),
                     "autoround_gptq0": dict(method="autoround", iters=0, init="gptq", **CAL),
                     "fullrange": dict(observer="fullrange")}.items():
        convert(llama, root / name, profile="all-linear", workers=2, **kw)
        res[name] = root / name
    return res


def _load(path):
    import transformers
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                         quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


def test_gptq_format_unchanged_loads_and_differs_from_rtn(outs):
    rtn, gptq = outs["fullrange"], outs["gptq"]  # RTN on GPTQ's default grid
    a, b = load_dir(rtn), load_dir(gptq)
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)
    qa = json.loads((rtn / "config.json").read_text())["quantization_config"]
    qb = json.loads((gptq / "config.json").read_text())["quantization_config"]
    assert qa == qb  # pack-quantized, static groups, no g_idx: what the engines load
    assert qb == json.loads((outs["rtn"] / "config.json").read_text())["quantization_config"]  # the grid is not in it
    packed = [k for k in a if k.endswith("weight_packed")]
    assert len(packed) == 14
    # the same grid (static full-range scales of the source weight, each group's clip searched within
    # [0.8, 1] of its range: the same sign, at most RTN's magnitude), other codes
    searched = 0
    for k in packed:
        m = k[: -len(".weight_packed")]
        ra, rb = a[m + ".weight_scale"].float(), b[m + ".weight_scale"].float()
        ratio = rb / ra
        assert (ratio >= 0.8 * (1 - 2**-7)).all() and (ratio <= 1 + 2**-7).all(), m
        searched += int((ratio < 1).sum())
    assert searched > 0  # the search moved some groups
    c = load_dir(outs["gptq_rtn_scales"])  # --scale-search rtn: the grid's RTN scales, bit for bit
    assert all(torch.equal(a[k[: -len("packed")] + "scale"], c[k[: -len("packed")] + "scale"]) for k in packed)
    changed = sum(not torch.equal(a[k], b[k]) for k in packed)
    assert changed == len(packed)
    # transformers (compressed-tensors' decompression) reads back exactly our q * scale
    sd = _load(gptq).state_dict()
    w = int4.dequantize_int4(b["model.layers.1.mlp.down_proj.weight_packed"], b["model.layers.1.mlp.down_proj.weight_scale"],
                             tuple(b["model.layers.1.mlp.down_proj.weight_shape"].tolist()), dtype=torch.float32)
    assert torch.allclose(sd["model.layers.1.mlp.down_proj.weight"].float(), w, rtol=2 ** -8, atol=0)


def test_gptq_defaults_to_the_fullrange_grid(outs, llama, tmp_path):
    """--method gptq with no --observer runs on the full-range grid: the full-range RTN scales fixed
    before the update (bit for bit, negative ones included), code -8 in use, the grid recorded in the
    options and the report, lower layer loss and KLD than fullrange RTN, read back by transformers as
    q * scale, and proven by check --source. Near miss: --observer minmax, the old default, gives
    compressed-tensors' positive scales and another checkpoint."""
    from quantize.check import check

    out = outs["gptq"]
    man = _manifest(out)
    assert man["options"]["observer"] == "fullrange" and man["method"]["grid"] == "fullrange"
    a, b = load_dir(outs["fullrange"]), load_dir(outs["gptq_rtn_scales"])
    for k in (k for k in a if k.endswith("weight_scale")):
        assert torch.equal(a[k], b[k]), k
    b = load_dir(out)
    s = b["model.layers.0.mlp.down_proj.weight_scale"]
    assert (s < 0).any() and (s > 0).any()
    codes = int4.unpack_int4(b["model.layers.0.mlp.down_proj.weight_packed"], int(b["model.layers.0.mlp.down_proj.weight_shape"][1]))
    assert int(codes.min()) == -8 and int(codes.max()) == 7
    rep = man["method"]
    assert all(r["loss"] < r["loss_rtn"] for r in rep["layers"])
    assert kld(llama, out, tokens=256, chunk=64).kld_mean < kld(llama, outs["fullrange"], tokens=256, chunk=64).kld_mean
    sd = _load(out).state_dict()
    w = int4.dequantize_int4(b["model.layers.1.mlp.up_proj.weight_packed"], b["model.layers.1.mlp.up_proj.weight_scale"],
                             tuple(b["model.layers.1.mlp.up_proj.weight_shape"].tolist()), dtype=torch.float32)
    assert torch.allclose(sd["model.layers.1.mlp.up_proj.weight"].float(), w, rtol=2 ** -8, atol=0)
    chk = check(out, source=llama)
    assert chk.ok and chk.verified["tensors_method_vs_source"] == 14, chk.failures
    mm = tmp_path / "gptq-minmax"
    convert(llama, mm, profile="all-linear", method="gptq", observer="minmax", scale_search="rtn", workers=2, **CAL)
    c, r = load_dir(mm), load_dir(outs["rtn"])
    assert _manifest(mm)["method"]["grid"] == "minmax"
    for k in (k for k in c if k.endswith("weight_scale")):
        assert torch.equal(c[k], r[k]) and (c[k] > 0).all(), k  # RTN minmax's scales, all positive
    assert weights_only(mm) != weights_only(out)


def test_gptq_lowers_layer_loss_and_kld(outs, llama):
    rep = _manifest(outs["gptq"])["method"]
    assert rep["method"] == "gptq" and rep["grid"] == "fullrange" and rep["samples"] == 4 and rep["seq_len"] == 64
    assert [r["layer"] for r in rep["layers"]] == [0, 1]
    for r in rep["layers"]:
        assert r["units"] == 7 and r["fallbacks"] == []
        assert r["loss"] < 0.5 * r["loss_rtn"], r
    k_rtn = kld(llama, outs["rtn"], tokens=256, chunk=64).kld_mean
    k_gptq = kld(llama, outs["gptq"], tokens=256, chunk=64).kld_mean
    assert k_gptq < 0.8 * k_rtn, (k_gptq, k_rtn)
    # the manifest's per-tensor statistics say which method made each tensor
    assert {t["method"] for t in _manifest(outs["gptq"])["tensors"]} == {"gptq"}
    # and its wall, step by step, has the data-aware steps (the layer pass at least its layers' seconds)
    wall = _manifest(outs["gptq"])["wall_seconds"]
    assert set(wall) == {"plan", "calibration_data", "setup", "layers", "resume_check", "shards", "config_wait"}
    assert wall["layers"] >= sum(r["seconds"] for r in rep["layers"])


def _weighted_oracle(w: torch.Tensor, d: torch.Tensor, g: int) -> torch.Tensor:
    """One row's full-range group scales chosen by the Hessian-diagonal-weighted error, written out from
    the definition: the signed extreme e (bf16 weight) shrunk by p, scale = bf16(bf16(e p) / -8), codes =
    round(clamp(bf16(w / scale), -8, 7)), error sum_j d_j (w_j - q_j scale)^2 in float64; the first p wins ties."""
    wb = w.to(torch.bfloat16)
    out = []
    for k in range(0, w.numel(), g):
        grp, dj = wb[k: k + g].float(), d[k: k + g].double().clamp_min(0)
        e = grp[grp.abs().argmax()]
        best, best_err = None, None
        for i in range(21):
            p = 1.0 - i * 0.2 / 20
            s = (torch.tensor(float(e) * p).to(torch.bfloat16).float() / -8).to(torch.bfloat16)
            s = s if float(s) != 0 else torch.tensor(torch.finfo(torch.bfloat16).eps, dtype=torch.bfloat16)
            q = (grp / s.float()).to(torch.bfloat16).float().clamp(-8, 7).round()
            err = float((dj * (grp.double() - q.double() * float(s)) ** 2).sum())
            if best_err is None or err < best_err:
                best, best_err = s, err
        out.append(best)
    return torch.stack(out)


def test_gptq_codes_are_llm_compressors_update(llama, tmp_path, monkeypatch):
    """Our layer pass hands quantize_weight the weight, its Hessian (2 x^T x / samples of the
    layer's own input) and the static grid; re-running llm-compressor's function on what we
    captured gives our codes exactly."""
    from llmcompressor.modifiers.gptq import gptq_quantize

    from quantize.methods import gptq as G

    calls = []
    real = gptq_quantize.quantize_weight

    def spy(W, H, scale, zp, gs, qargs, blocksize, percdamp):
        calls.append((W.clone(), H.clone(), scale.clone(), qargs, blocksize, percdamp))
        return real(W, H, scale, zp, gs, qargs, blocksize=blocksize, percdamp=percdamp)

    monkeypatch.setattr(gptq_quantize, "quantize_weight", spy)
    out = tmp_path / "o"
    convert(llama, out, profile="all-linear", method="gptq", damp=0.05, block=64, workers=1, **CAL)
    assert len(calls) == 2 * 4  # per layer, one call per weight shape: q/o, k/v, gate/up, down
    t = load_dir(out)
    ours = {k[: -len(".weight_packed")]: int4.unpack_int4(v, int(t[k[: -len("packed")] + "shape"][1])).float()
            for k, v in t.items() if k.endswith(".weight_packed")}
    matched = set()
    unweighted = 0  # groups where the unweighted error would have picked another scale: the weighting matters
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # as the pass runs it (a Cholesky's last bits depend on the thread count)
    try:
        for W, H, scale, qargs, blocksize, percdamp in calls:
            assert blocksize == 64 and percdamp == 0.05 and qargs.group_size == 32 and qargs.actorder == "weight"  # llm-compressor's default
            zp = torch.zeros(scale.shape, dtype=torch.int8)
            wq = real(W.clone(), H.clone(), scale, zp, None, qargs, blocksize=64, percdamp=0.05)[0]
            codes = (wq / scale.float().repeat_interleave(32, -1)).round()
            assert torch.equal(codes, codes.clamp(-8, 7))  # on the grid
            for j in range(W.shape[0]):
                hit = [m for m, c in ours.items() if c.shape == codes[j].shape and torch.equal(c, codes[j])
                       and torch.equal(t[m + ".weight_scale"], scale[j])]
                assert len(hit) == 1
                matched.add(hit[0])
            # the static scales: per group, the full-range scale of the range shrunk by p in 1, 0.99, ..., 0.8 with
            # the least error weighted by the Hessian's diagonal, re-derived here in float64 (a few rows)
            for c in range(min(2, W.shape[0])):
                for r in (0, W.shape[1] - 1):
                    assert torch.equal(_weighted_oracle(W[c, r], H[c].diagonal(), 32), scale[c, r]), (c, r)
                    unweighted += int((_weighted_oracle(W[c, r], torch.ones(W.shape[-1]), 32) != scale[c, r]).sum())
            # negative control: another Hessian gives other codes
            other = real(W.clone(), torch.eye(W.shape[-1]).expand_as(H).clone(), scale, zp, None, qargs, blocksize=64, percdamp=0.05)[0]
            assert not torch.equal((other / scale.float().repeat_interleave(32, -1)).round(), codes)
    finally:
        torch.set_num_threads(old)
    assert matched == set(ours) and len(matched) == 14
    assert unweighted > 0
    assert G.CHUNK < 16  # llm-compressor switches to batched Cholesky at 16


# ------------------------------------------------------------------------------------------------
# MoE: each routed expert sees exactly the tokens the router sends it

@pytest.fixture(scope="module")
def dsv3(tiny):
    return tiny("deepseek_v3", layout="bf16")


def _spy_gptq(monkeypatch):
    """The Hessians GPTQ gets, per layer with INT4 units in order: one dict per layer, merged over
    its calls (a MoE layer's routed experts come a group at a time)."""
    from quantize.methods import gptq as G

    seen: list[dict] = []
    layer_of: list[int] = []
    real, real_results = G.quantize, G.GPTQ.results

    def results(x, hooks, quotients=None):
        if not seen or layer_of[-1] != x.index:
            layer_of.append(x.index)
            seen.append({})
        return real_results(x, hooks, quotients)

    def spy(items, *a, **kw):
        seen[-1].update({u.key: h.clone() for u, _, h in items})
        return real(items, *a, **kw)

    monkeypatch.setattr(G, "quantize", spy)
    monkeypatch.setattr(G.GPTQ, "results", staticmethod(results))
    return seen


def _reference_expert_inputs(src, ids_list, layer):
    """Per sample, the experts' input and the router's top-k at ``layer`` of the whole model
    (transformers' DeepseekV3ForCausalLM, fp32), by hooks on that model."""
    import transformers

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    got = []
    h = model.model.layers[layer].mlp.experts.register_forward_pre_hook(lambda m, a: got.append((a[0].clone(), a[1].clone())))
    with torch.no_grad():
        for ids in ids_list:
            model(input_ids=ids.unsqueeze(0))
    h.remove()
    return got, model.model.layers[layer].mlp.experts


def test_experts_hessians_from_routed_tokens_only(dsv3, tmp_path, monkeypatch):
    """Layer 1 is the first MoE layer (layer 0 is dense and stays BF16 under --profile experts), so
    its inputs are the source model's: every expert's gate/up Hessian must be 2 X_e^T X_e / n_e
    over exactly the tokens transformers' router sends expert e, and the down Hessian the same
    over act(gate) * up of those tokens; the report's token counts are the router's."""
    from quantize.calibrate.data import build_samples

    seen = _spy_gptq(monkeypatch)
    out = tmp_path / "o"
    convert(dsv3, out, method="gptq", min_expert_tokens=0, **CAL)
    ids = build_samples(dsv3, None, 4, 64).ids
    ref, experts = _reference_expert_inputs(dsv3, ids, 1)
    layer1 = seen[0]  # layer 0 has no INT4 weight, so the first call is layer 1's
    counts = [0] * 8
    for e in range(8):
        xs = [x[(idx == e).any(-1)] for x, idx in ref]
        counts[e] = sum(len(x) for x in xs)
        x = torch.cat(xs)
        h_gu = 2 * x.T @ x / len(x)
        g, u = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        a = experts.act_fn(g) * u
        h_d = 2 * a.T @ a / len(a)
        assert torch.allclose(layer1[f"mlp.experts.gate_up_proj[{e}]"], h_gu, rtol=1e-4, atol=1e-5), e
        assert torch.allclose(layer1[f"mlp.experts.down_proj[{e}]"], h_d, rtol=1e-4, atol=1e-5), e
    # negative control: all tokens give another Hessian
    x_all = torch.cat([x for x, _ in ref])
    assert not torch.allclose(layer1["mlp.experts.gate_up_proj[0]"], 2 * x_all.T @ x_all / len(x_all), rtol=1e-2)
    rep = _manifest(out)["method"]["layers"][1]
    assert rep["tokens_per_expert"]["counts"] == {"mlp.experts": counts}
    assert rep["tokens_per_expert"]["min"] == min(counts) and rep["tokens_per_expert"]["max"] == max(counts)
    assert sum(counts) == 2 * sum(len(i) for i in ids)  # top-2


def test_all_experts_feeds_every_token_and_starved_experts_fall_back(dsv3, tmp_path, monkeypatch):
    seen = _spy_gptq(monkeypatch)
    # below the threshold every expert falls back to RTN, each named
    starved = tmp_path / "starved"
    convert(dsv3, starved, method="gptq", min_expert_tokens=10**6, **CAL)
    rep = _manifest(starved)["method"]
    names = {f["name"] for f in rep["rtn"] if "--min-expert-tokens" in f["reason"]}
    assert len(names) == 2 * 8 * 3  # two MoE layers x 8 experts x gate/up/down
    from quantize.publish.card import card

    text = card(starved).text  # the card names them, per layer (counted by hand: layers 1 and 2, 8 experts each)
    assert "Routed experts left at round-to-nearest" in text
    assert "- layer 1: 0, 1, 2, 3, 4, 5, 6, 7 (8 experts)\n- layer 2: 0, 1, 2, 3, 4, 5, 6, 7 (8 experts)" in text
    rtn = tmp_path / "rtn"
    convert(dsv3, rtn, observer="fullrange")  # RTN on GPTQ's default grid
    a, b = load_dir(starved), load_dir(rtn)
    assert all(torch.equal(a[k], b[k]) for k in a if ".experts." in k)
    assert {t["method"] for t in _manifest(starved)["tensors"]} == {"rtn"}
    # --all-experts: the statistics from every token (above a threshold no routed count reaches)
    seen.clear()
    full = tmp_path / "all"
    convert(dsv3, full, method="gptq", all_experts=True, min_expert_tokens=200, **CAL)
    rep_all = _manifest(full)["method"]
    assert [f for f in rep_all["rtn"] if "--min-expert-tokens" in f["reason"]] == []
    layer1 = seen[0]
    gu = [layer1[f"mlp.experts.gate_up_proj[{e}]"] for e in range(8)]
    assert all(torch.equal(gu[0], h) for h in gu[1:])  # same tokens for every expert
    assert not torch.equal(layer1["mlp.experts.down_proj[0]"], layer1["mlp.experts.down_proj[1]"])
    # ... for the statistics only: the router still decides the layer output (same counts)
    assert rep_all["layers"][1]["tokens_per_expert"] == rep["layers"][1]["tokens_per_expert"]
    assert max(rep_all["layers"][1]["tokens_per_expert"]["counts"]["mlp.experts"]) < 200 <= rep_all["tokens"]


def test_moe_output_loads_in_transformers(dsv3, tmp_path):
    import transformers

    out = tmp_path / "o"
    convert(dsv3, out, method="gptq", **CAL)
    m = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    t = load_dir(out)
    for e in (0, 5):
        deq = [int4.dequantize_int4(t[f"model.layers.2.mlp.experts.{e}.{p}.weight_packed"], t[f"model.layers.2.mlp.experts.{e}.{p}.weight_scale"],
                                    tuple(t[f"model.layers.2.mlp.experts.{e}.{p}.weight_shape"].tolist()), dtype=torch.float32)
               for p in ("gate_proj", "up_proj")]
        assert torch.allclose(m.model.layers[2].mlp.experts.gate_up_proj[e].float(), torch.cat(deq), rtol=2 ** -8, atol=0)
    rep = _manifest(out)["method"]
    mtp = [f for f in rep["rtn"] if "outside the decoder layers" in f["reason"]]
    assert all(".layers.3." in f["name"] for f in mtp)  # the MTP layer, named


# ------------------------------------------------------------------------------------------------
# streaming: one layer at a time, hidden states spilled beyond the budget, memory flat in depth

def test_one_layer_in_memory_and_flat_in_depth(tiny, tmp_path, monkeypatch):
    import gc

    from quantize.calibrate.runner import LayerStreamer

    live: list = []
    most = [0]
    real = LayerStreamer.layer

    def layer(self, i, stream_experts=False, device=None):
        gc.collect()
        alive = [r for r in live if r() is not None]
        most[0] = max(most[0], len(alive) + 1)
        m = real(self, i, stream_experts, device)
        live.append(weakref.ref(m))
        return m

    monkeypatch.setattr(LayerStreamer, "layer", layer)
    peaks = {}
    for n in (4, 16):
        src = tiny("llama", layout="bf16", overrides={"num_hidden_layers": n})
        convert(src, tmp_path / f"l{n}", profile="all-linear", method="gptq", **CAL)
        rep = _manifest(tmp_path / f"l{n}")["method"]
        assert len(rep["layers"]) == n
        peaks[n] = rep["hidden_bytes_peak_in_memory"]
    assert most[0] == 1  # when a layer is built, no earlier one is alive
    assert peaks[4] == peaks[16] > 0


def test_spilled_hidden_states_give_the_same_bytes(llama, outs, tmp_path):
    out = tmp_path / "spill"
    convert(llama, out, profile="all-linear", method="gptq", workers=2, memory_budget_gib=0, **CAL)
    rep = _manifest(out)["method"]
    assert rep["hidden_bytes_spilled"] > 0 and rep["hidden_bytes_peak_in_memory"] == 0
    assert weights_only(out) == weights_only(outs["gptq"])
    assert not (out / ".quantize" / "hidden").exists()  # spill files removed


# ------------------------------------------------------------------------------------------------
# resumable per layer, deterministic

def test_interrupted_mid_layer_redoes_that_layer_only(dsv3, tmp_path, monkeypatch):
    from quantize.methods import gptq as G

    ref = tmp_path / "ref"
    convert(dsv3, ref, method="gptq", workers=1, **CAL)
    out = tmp_path / "out"
    real = G.GPTQ.results

    def dies_in_second_moe_layer(x, hooks, quotients=None):
        if x.index == 2 and any(u.expert == 3 for u in x.units):
            raise KeyboardInterrupt  # a kill in the middle of layer 2's GPTQ (some expert groups done)
        return real(x, hooks, quotients)

    monkeypatch.setattr(G.GPTQ, "results", staticmethod(dies_in_second_moe_layer))
    with pytest.raises(KeyboardInterrupt):
        convert(dsv3, out, method="gptq", workers=1, memory_budget_gib=0.0, **CAL)
    job = json.loads((out / ".quantize" / "job.json").read_text())
    assert sorted(job["layers"]) == ["0000", "0001"] and job["state"] == "running"
    assert not (out / "quantize_manifest.json").exists()
    files = sorted((out / ".quantize" / "layers").glob("0001*.safetensors"))
    assert files and all(f.name in {p["file"] for p in job["layers"]["0001"]["parts"]} for f in files)
    layer1 = {f.name: f.read_bytes() for f in files}
    monkeypatch.setattr(G.GPTQ, "results", staticmethod(real))
    with pytest.raises(QuantizeError, match="different"):
        convert(dsv3, out, method="gptq", damp=0.02, workers=1, resume=True, **CAL)
    # the job records the resolved grid: minmax (the old default) is another run, fullrange named
    # explicitly the same one
    with pytest.raises(QuantizeError, match="--resume with different options"):
        convert(dsv3, out, method="gptq", observer="minmax", workers=1, resume=True, **CAL)
    events = []
    convert(dsv3, out, method="gptq", observer="fullrange", workers=1, resume=True, emit=events.append, **CAL)
    layers = [e for e in events if e.get("event") == "layer"]
    assert [(e["layer"], bool(e.get("replayed"))) for e in layers] == [(0, True), (1, True), (2, False)]
    assert {f.name: f.read_bytes() for f in sorted((out / ".quantize" / "layers").glob("0001*.safetensors"))} == layer1
    assert weights_only(out) == weights_only(ref)
    ma, mb = _manifest(out), _manifest(ref)
    timeless = lambda rs: [{k: v for k, v in r.items() if k not in ("seconds", "phase_seconds")} for r in rs]  # noqa: E731
    assert ma["tensors"] == mb["tensors"] and timeless(ma["method"]["layers"]) == timeless(mb["method"]["layers"])


def test_sigkill_then_resume_is_byte_identical(tiny, tmp_path):
    src = tiny("glm_moe_dsa")
    args = ["--method", "gptq", "--samples", "8", "--seq-len", "128", "--workers", "1"]
    ref = tmp_path / "ref"
    convert(src, ref, method="gptq", samples=8, seq_len=128, workers=1)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "quantize.cli", "convert", str(src), str(out), "--json", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if json.loads(line).get("event") == "layer":  # layer 0 recorded: kill during layer 1
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "quantize_manifest.json").exists()
    p = subprocess.run(cmd + ["--resume"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert weights_only(out) == weights_only(ref)
    assert not list((out / ".quantize" / "layers").glob("*.partial"))


def test_deterministic_across_thread_counts(dsv3, tmp_path):
    for w in (1, 2):
        convert(dsv3, tmp_path / f"w{w}", method="gptq", workers=w, **CAL)
    assert weights_only(tmp_path / "w1") == weights_only(tmp_path / "w2")


# ------------------------------------------------------------------------------------------------
# AutoRound

def test_autoround_iters0_is_fullrange_rtn_bit_for_bit(outs):
    assert weights_only(outs["autoround0"]) == weights_only(outs["fullrange"])
    assert _manifest(outs["autoround0"])["method"]["grid"] == "fullrange"  # AutoRound's default grid


def test_autoround_init_gptq_iters0_is_gptq_bit_for_bit(outs):
    """--init gptq starts from the layer's GPTQ result (its codes and searched scales, every scale
    reproduced by the clip factors: none moved); with no step that is what is written. Near miss:
    the RTN start is not."""
    assert weights_only(outs["autoround_gptq0"]) == weights_only(outs["gptq"])
    assert weights_only(outs["autoround0"]) != weights_only(outs["gptq"])
    rep = _manifest(outs["autoround_gptq0"])["method"]
    assert rep["init"] == "gptq" and _manifest(outs["autoround0"])["method"]["init"] == "rtn"
    assert [x["train"]["moved_scales"] for x in rep["layers"]] == [0, 0]
    assert "from GPTQ's result" in _card_text(outs["autoround_gptq0"])
    assert "from round-to-nearest" in _card_text(outs["autoround0"])


def test_autoround_init_gptq_keeps_the_best_step_from_gptqs_start(outs):
    """With steps, --init gptq trains from GPTQ's weights (step 0's loss is theirs) and writes the
    best step's: the steps move the weights (the last loss is not the first), and where no step beat
    the start (this fixture: GPTQ is far below RTN and the steps go uphill from it) GPTQ's bytes."""
    layers = _manifest(outs["autoround_gptq"])["method"]["layers"]
    for x in layers:
        t = x["train"]
        assert t["best_loss"] <= t["first_loss"] != t["last_loss"] and t["moved_scales"] == 0
    a, g = load_dir(outs["autoround_gptq"]), load_dir(outs["gptq"])
    packed = [k for k in a if k.endswith("weight_packed")]
    same = all(torch.equal(a[k], g[k]) for k in packed)
    assert same == all(x["train"]["best_step"] == 0 for x in layers)


def test_autoround_lowers_layer_loss_and_kld(outs, llama):
    rep = _manifest(outs["autoround"])["method"]
    assert rep["method"] == "autoround" and rep["iters"] == 20 and rep["lr"] == pytest.approx(1 / 20) and rep["batch_size"] == 8
    for r in rep["layers"]:
        assert r["train"]["best_loss"] <= r["train"]["first_loss"]
        assert r["loss"] < 0.7 * r["loss_rtn"], r
    k_rtn = kld(llama, outs["fullrange"], tokens=256, chunk=64).kld_mean
    k_ar = kld(llama, outs["autoround"], tokens=256, chunk=64).kld_mean
    assert k_ar < 0.8 * k_rtn, (k_ar, k_rtn)
    a, b = load_dir(outs["autoround"]), load_dir(outs["fullrange"])
    assert sum(not torch.equal(a[k], b[k]) for k in a if k.endswith("weight_packed")) == 14


def test_autoround_moe_experts_trained_and_starved_named(dsv3, tmp_path):
    out = tmp_path / "o"
    convert(dsv3, out, method="autoround", iters=4, min_expert_tokens=40, **CAL)
    rep = _manifest(out)["method"]
    counts = rep["layers"][1]["tokens_per_expert"]["counts"]["mlp.experts"]
    starved = [e for e, c in enumerate(counts) if c < 40]
    named = {f["name"] for f in rep["rtn"] if "--min-expert-tokens" in f["reason"]}
    assert named >= {f"model.layers.1.mlp.experts.{e}.{p}" for e in starved for p in ("gate_proj", "up_proj", "down_proj")}
    methods = {t["name"]: t["method"] for t in _manifest(out)["tensors"]}
    trained = [e for e, c in enumerate(counts) if c >= 40]
    assert trained and all(methods[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] == "autoround" for e in trained)
    assert all(methods[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] == "rtn" for e in starved)
    # a starved expert keeps the RTN codes of the grid
    fr = tmp_path / "fr"
    convert(dsv3, fr, observer="fullrange")
    a, b = load_dir(out), load_dir(fr)
    for e in starved:
        k = f"model.layers.1.mlp.experts.{e}.down_proj.weight_packed"
        assert torch.equal(a[k], b[k])


def test_autoround_deterministic_across_thread_counts(llama, tmp_path):
    for w in (1, 2):
        convert(llama, tmp_path / f"w{w}", profile="all-linear", method="autoround", iters=3, workers=w, **CAL)
    assert weights_only(tmp_path / "w1") == weights_only(tmp_path / "w2")


# ------------------------------------------------------------------------------------------------
# recipes and bad input

def _recipe(tmp_path, modifier: str, body: str, stem: str) -> str:
    """A one-group INT4 g32 recipe of ``modifier`` with ``body`` (its own keys), written as STEM-N.yaml."""
    p = tmp_path / f"{stem}-{len(list(tmp_path.glob(f'{stem}*.yaml')))}.yaml"
    p.write_text(f"""quant_stage:
  quant_modifiers:
    {modifier}:
{body}      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}}
""")
    return str(p)


def _gptq_recipe(tmp_path, extra=""):
    return _recipe(tmp_path, "GPTQModifier", "      dampening_frac: 0.05\n      block_size: 64\n" + extra, "gptq")


def test_gptq_recipe_means_method_gptq(llama, tmp_path):
    from quantize.plan import ConvertOptions, build_plan

    r = _gptq_recipe(tmp_path, "      actorder: null\n")
    via_recipe = tmp_path / "recipe"
    convert(llama, via_recipe, recipe=r, **CAL)
    via_flags = tmp_path / "flags"
    convert(llama, via_flags, profile="all-linear", method="gptq", damp=0.05, block=64, actorder="off", **CAL)
    a, b = load_dir(via_recipe), load_dir(via_flags)  # the config's ignore list is the recipe's; the tensors are the same
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    opts = _manifest(via_recipe)["options"]
    assert opts["method"] == "gptq" and opts["damp"] == 0.05 and opts["block"] == 64 and opts["actorder"] == "off"
    # llm-compressor's default actorder (static = weight ordering; static groups either way)
    assert build_plan(llama, ConvertOptions(recipe=_gptq_recipe(tmp_path))).options.actorder == "static"
    with pytest.raises(QuantizeError, match=r"--actorder static conflicts with actorder off"):
        build_plan(llama, ConvertOptions(recipe=r, actorder="static"))
    with pytest.raises(QuantizeError, match=r"--method autoround conflicts with .*gptq-0.yaml, whose modifier means method gptq"):
        build_plan(llama, ConvertOptions(recipe=r, method="autoround"))
    with pytest.raises(QuantizeError, match=r"--damp 0.1 conflicts with dampening_frac 0.05"):
        build_plan(llama, ConvertOptions(recipe=r, damp=0.1))
    with pytest.raises(QuantizeError, match=r"actorder 'group' is not written by this tool"):
        build_plan(llama, ConvertOptions(recipe=_gptq_recipe(tmp_path, "      actorder: group\n")))


def _autoround_recipe(tmp_path, body="      iters: 5\n      batch_size: 2\n"):
    return _recipe(tmp_path, "AutoRoundModifier", body, "ar")


def test_autoround_recipe_means_method_autoround(llama, tmp_path):
    """llm-compressor's AutoRoundModifier (iters / batch_size / lr, its names and defaults) selects
    --method autoround on AutoRound's full-range grid; the same tensors as the flags."""
    from quantize.plan import ConvertOptions, build_plan

    via_recipe = tmp_path / "recipe"
    convert(llama, via_recipe, recipe=_autoround_recipe(tmp_path), **CAL)
    via_flags = tmp_path / "flags"
    convert(llama, via_flags, profile="all-linear", method="autoround", iters=5, batch_size=2, **CAL)
    a, b = load_dir(via_recipe), load_dir(via_flags)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    rep = _manifest(via_recipe)["method"]
    assert rep["method"] == "autoround" and rep["iters"] == 5 and rep["batch_size"] == 2 and rep["grid"] == "fullrange"
    dflt = build_plan(llama, ConvertOptions(recipe=_autoround_recipe(tmp_path, ""))).options
    assert (dflt.method, dflt.iters, dflt.batch_size, dflt.lr, dflt.observer) == ("autoround", 200, 8, 1 / 200, "fullrange")
    with pytest.raises(QuantizeError, match=r"--iters 7 conflicts with iters 5"):
        build_plan(llama, ConvertOptions(recipe=_autoround_recipe(tmp_path), iters=7))
    with pytest.raises(QuantizeError, match=r"--method gptq conflicts with .*, whose modifier means method autoround"):
        build_plan(llama, ConvertOptions(recipe=_autoround_recipe(tmp_path), method="gptq"))
    for body, msg in (("      iters: -1\n", "AutoRoundModifier iters -1 must be a whole number >= 0"),
                      ("      batch_size: 0\n", "AutoRoundModifier batch_size 0 must be a whole number >= 1"),
                      ("      lr: fast\n", "AutoRoundModifier lr 'fast' must be a positive number or null")):
        with pytest.raises(QuantizeError, match=msg):
            build_plan(llama, ConvertOptions(recipe=_autoround_recipe(tmp_path, body)))


def _refused(src, out, match, **kw):
    with pytest.raises(QuantizeError, match=match) as e:
        convert(src, out, **kw)
    assert "\n" not in str(e.value)
    assert not (out / "quantize_manifest.json").exists() and not (out / "config.json").exists()
    return str(e.value)


def test_bad_method_input_is_one_line(llama, tmp_path):
    o = tmp_path / "o"
    _refused(llama, o, r"^--samples 0: must be at least 1", method="gptq", samples=0)
    _refused(llama, o, r"^--seq-len 1: must be at least 2", method="gptq", seq_len=1)
    _refused(llama, o, r"^--method gpt: unknown; use one of rtn, gptq, autoround", method="gpt")
    _refused(llama, o, r"^--damp is an option of --method gptq, but the method is rtn; add --method gptq or drop --damp", damp=0.1)
    _refused(llama, o, r"^--iters is an option of --method autoround, but the method is gptq", method="gptq", iters=5)
    _refused(llama, o, r"^--data is an option of --method gptq or --method autoround", data="x.jsonl")
    _refused(llama, o, r"^--all-experts is an option of", all_experts=True)
    _refused(llama, o, r"^--lr -1.0: the learning rate must be a positive number", method="autoround", lr=-1.0)
    _refused(llama, o, r"^--actorder group: use static .* or off", method="gptq", actorder="group")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _refused(llama, o, r"no usable samples", method="gptq", data=str(empty), profile="all-linear")
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "one sample of text"}\n{"text": "and another one"}\n')
    msg = _refused(llama, o, r"2 usable samples .* fewer than --samples 4; pass more text or lower --samples to 2",
                   method="gptq", data=str(short), profile="all-linear", **CAL)
    assert str(short) in msg
    assert not o.exists()  # refused before the output folder was created
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "convert", str(llama), str(o), "--damp", "0.1"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--damp is an option of --method gptq" in p.stderr


def _copy_with(src, tmp_path, fn, name="bad"):
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    d = tmp_path / name
    shutil.copytree(src, d)
    for f in d.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            t = {k: fh.get_tensor(k) for k in fh.keys()}
        if fn(t):
            save_file(t, str(f), metadata={"format": "pt"})
    return d


def test_nan_hidden_states_name_the_layer(llama, tmp_path):
    def poison(t):
        k = "model.layers.1.input_layernorm.weight"
        if k in t:
            t[k] = torch.full_like(t[k], float("inf"))
            return True
        return False

    bad = _copy_with(llama, tmp_path, poison)
    msg = _refused(bad, tmp_path / "o", r"^decoder layer 1: NaN or Inf in the hidden states", profile="all-linear", method="gptq", **CAL)
    assert "layer 0" not in msg
    job = json.loads((tmp_path / "o" / ".quantize" / "job.json").read_text())
    assert job["state"] == "running" and sorted(job["layers"]) == ["0000"]


def test_diverging_autoround_loss_names_the_layer(llama, tmp_path, monkeypatch):
    from quantize.methods import autoround as A

    real = A.Tuned.fake
    monkeypatch.setattr(A.Tuned, "fake", lambda self: real(self) * float("nan"))
    _refused(llama, tmp_path / "o", r"^decoder layer 0: the AutoRound loss became nan at step 0; lower --lr", profile="all-linear",
             method="autoround", iters=2, **CAL)


def test_layers_transformers_cannot_build(tiny, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny("llama", layout="bf16"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_act"] = "no_such_activation"
    (bad / "config.json").write_text(json.dumps(cfg))
    _refused(bad, tmp_path / "o", r"transformers cannot build decoder layer 0 .*; use --method rtn", profile="all-linear", method="gptq", **CAL)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------
# quantize eval-kld: several candidates of one source in one table

def test_kld_table_of_several_candidates(outs, llama, tmp_path):
    from quantize.evaluate.kld import kld_table

    cands = [outs["rtn"], outs["gptq"], outs["autoround"]]
    table = kld_table(llama, cands, tokens=192, chunk=64, out=tmp_path / "t.json")
    assert [r.candidate for r in table.reports] == [str(c) for c in cands]
    for c, r in zip(cands, table.reports):
        alone = kld(llama, c, tokens=192, chunk=64)  # the baseline kept exactly: the same figures as one at a time
        assert r.kld_mean == pytest.approx(alone.kld_mean, rel=1e-6) and r.top1_agreement == alone.top1_agreement
        assert r.baseline == str(llama) and r.tokens == 192
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["kind"] == "kld-table" and len(doc["candidates"]) == 3
    with pytest.raises(QuantizeError, match="given twice"):
        kld_table(llama, [outs["rtn"], outs["rtn"]], tokens=64, chunk=64)
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "eval-kld", "--baseline", str(llama), "--tokens", "128", "--chunk", "64",
                        *[a for c in cands for a in ("--candidate", str(c))]], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "250"})
    assert p.returncode == 0, p.stderr[-1500:]
    rows = [line for line in p.stdout.splitlines() if any(str(c) in line for c in cands)]
    assert len(rows) == 3


@pytest.mark.parametrize("init", ["rtn", "gptq"])
def test_autoround_interrupted_resumes_byte_identical(llama, outs, tmp_path, monkeypatch, init):
    """AutoRound's targets come from the source model's own hidden states, carried beside the
    quantized path; a resumed run rebuilds both streams by replaying the recorded layers (and,
    --init gptq, layer 1's GPTQ start from them)."""
    from quantize.methods import autoround as A

    real = A.train_layer
    calls = [0]

    def dies_in_layer_1(*a, **kw):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    out = tmp_path / "o"
    monkeypatch.setattr(A, "train_layer", dies_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        convert(llama, out, profile="all-linear", method="autoround", iters=20, init=init, workers=2, **CAL)
    assert sorted(json.loads((out / ".quantize" / "job.json").read_text())["layers"]) == ["0000"]
    monkeypatch.setattr(A, "train_layer", real)
    convert(llama, out, profile="all-linear", method="autoround", iters=20, init=init, workers=1, resume=True,
            **CAL)
    assert weights_only(out) == weights_only(outs["autoround" if init == "rtn" else "autoround_gptq"])


# the model card says what the manifest records about the method, and no more

def _card_text(folder):
    from quantize.publish.card import render

    return render(folder, _manifest(folder), [], None, 0).text


def test_card_records_method_grid_data_and_per_layer_report(outs):
    g = _card_text(outs["gptq"])
    m = _manifest(outs["gptq"])["method"]
    assert "`gptq`: GPTQ: llm-compressor's `quantize_weight`" in g and "grid `fullrange`" in g
    assert f"act-order {m['actorder']}" in g and f"dampening {m['damp']}" in g
    assert f"SHA-256 {m['data_sha256'][:16]}" in g and f"{m['samples']} samples, at most {m['seq_len']} tokens each, {m['tokens']:,} tokens" in g
    assert "data-free" not in g  # the RTN wording must not describe a calibrated conversion
    rows = [line for line in g.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    layers = [x for x in m["layers"] if x.get("units")]
    assert len(rows) == len(layers) >= 2
    assert f"{layers[0]['loss_rtn']:.4g}" in rows[0] and f"{layers[0]['loss']:.4g}" in rows[0]
    a = _card_text(outs["autoround"])
    assert "`autoround`: AutoRound-class tuning" in a and "grid `fullrange`" in a and "20 iterations" in a
    r = _card_text(outs["rtn"])
    assert "observer `minmax`" in r and "data-free (no calibration set)" in r and "Per decoder layer" not in r
    # GPTQ's and AutoRound's default grid has negative scales: their cards warn of vLLM's int8 path, RTN's does not
    assert "Do not set `VLLM_MARLIN_INPUT_DTYPE=int8`" in g and "Do not set `VLLM_MARLIN_INPUT_DTYPE=int8`" in a
    assert "VLLM_MARLIN_INPUT_DTYPE" not in r


def test_card_names_experts_that_fell_back(dsv3, tmp_path):
    out = tmp_path / "starved"
    convert(dsv3, out, method="gptq", min_expert_tokens=10**6, **CAL)
    text = _card_text(out)
    assert "48 weights: " in text and "--min-expert-tokens" in text  # 2 MoE layers x 8 experts x gate/up/down
    assert "experts)" in text  # the tokens-per-expert column is filled for the MoE layers


@pytest.mark.parametrize("fullrange", [True, False])
def test_autoround_trains_on_the_weights_it_exports(fullrange):
    """The training forward (``Tuned.fake``) is what ``final`` writes, bit for bit: the scale rounded to
    the scale dtype and the quotient rounded as formats.int4 rounds it (auto-round casts its scale in the
    forward likewise), while the gradients still reach V, a and b (straight-through). Near miss: the
    fp32 scale and quotient (the forward before) differ from the export for some weights."""
    from quantize.methods.tuning import Tuned

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.02
    t = Tuned("x", w, 32, fullrange, torch.bfloat16)
    with torch.no_grad():
        t.V.uniform_(-0.5, 0.5, generator=g)
        t.a.uniform_(0.5, 1, generator=g)
        t.b.uniform_(0.5, 1, generator=g)
    f = t.fake()
    q, s = t.final()
    exported = (q.float().view(64, 8, 32) * s.float().unsqueeze(-1)).view(64, 256)
    assert torch.equal(f.detach(), exported)
    f.pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in t.params)
    with torch.no_grad():  # the fp32 forward, re-derived here: not the exported weights
        hi, lo = t.wmax * t.a, t.wmin * t.b
        if fullrange:
            e = torch.where(hi > -lo, hi, torch.where(hi < -lo, lo, torch.where(t.tie_hi, hi, lo)))
            s32 = e / -8
        else:
            s32 = torch.maximum(hi, -lo) / 7.5
        q32 = (t.wg / s32.unsqueeze(-1) + t.V).round().clamp(-8, 7)
        assert not torch.equal((q32 * s32.unsqueeze(-1)).view(64, 256), exported)


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32])
def test_autoround_start_puts_every_code_where_the_start_has_it(source_dtype):
    """``Tuned``'s start from another result (GPTQ's): the clip factors at the shrink each scale was
    searched with (int4.shrink_of, checked here against weighted_scale's own choice), the step-0
    weight ``codes x scale`` bit for bit, each quotient keeping its own fraction (the offsets are
    whole codes, but for ties), and gradients reaching V, a and b. A source not in the scale
    dtype may need another scale for a group (counted in ``moved``); the codes are kept all the same."""
    from quantize.methods.tuning import Tuned

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(48, 256, generator=g) * 0.02).to(source_dtype).float()
    imp = torch.rand(256, generator=g)
    scale = int4.weighted_scale(w, imp, 32, "fullrange", torch.bfloat16)
    p = int4.shrink_of(w, scale, 32, "fullrange", torch.bfloat16)
    assert not p.isnan().any() and (p < 1).any() and (p == 1).any()
    # the shrink found gives the scale back, by weighted_scale's own formula
    rng = w.to(torch.bfloat16).view(48, 8, 32)
    ext = rng.gather(-1, rng.abs().argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(((ext.float() * p).to(torch.bfloat16).float() / -8).to(torch.bfloat16), scale)
    codes = torch.randint(-8, 8, (48, 256), generator=g, dtype=torch.int8)  # any codes: GPTQ's are its own
    t = Tuned("x", w, 32, True, torch.bfloat16)
    t.start_at(Ellipsis, codes, scale)  # nothing rounded given: own fractions
    q, s = t.final()
    assert torch.equal(q, codes)
    if source_dtype == torch.bfloat16:
        assert t.moved == 0 and torch.equal(s, scale)
    assert torch.equal(t.fake().detach(), (codes.float().view(48, 8, 32) * s.float().unsqueeze(-1)).view(48, 256))
    c = (t.wg / s.float().unsqueeze(-1)).to(torch.bfloat16).float()
    whole = t.off == t.off.round()
    kept = (c + t.off)[whole] - codes.view(48, 8, 32)[whole]  # exact but where a tiny quotient meets a shift
    assert whole.float().mean() > 0.99 and torch.allclose(kept, (c - c.round())[whole], rtol=0, atol=2**-20)
    t.fake().pow(2).sum().backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in t.params)
    # each weight's optimum given (nan: not known), within half a code of its code: those quotients are
    # the start's, the codes the same; beyond it, it is held at 0.49 from the code
    rounded = codes.float() + torch.rand(48, 256, generator=g) * 0.98 - 0.49
    rounded[1, :4] = codes[1, :4].float() + torch.tensor([0.7, -0.9, 0.5, -0.5])
    rounded[0, :32] = float("nan")
    t2 = Tuned("x", w, 32, True, torch.bfloat16)
    t2.start_at(Ellipsis, codes, scale, rounded)
    assert torch.equal(t2.final()[0], codes)
    x = (c + t2.off).view(48, 256)
    assert torch.allclose(x[1, :4], codes[1, :4].float() + torch.tensor([0.49, -0.49, 0.49, -0.49]), atol=2**-18)
    rounded[1, :4] = x[1, :4]
    assert torch.allclose(x[1:], rounded[1:], rtol=0, atol=2**-18)
    assert torch.equal(t2.off.view(48, 256)[0, :32], t.off.view(48, 256)[0, :32])
    assert not torch.allclose(x[1:], (c + t.off).view(48, 256)[1:], rtol=0, atol=0.01)  # near miss: own fractions


def test_gptq_coordinate_optimum_minimises_the_error_one_weight_at_a_time():
    """``gptq.coordinate_optimum``: each weight's value that minimises the layer error
    ``tr((w - q) H (w - q)^T)`` with every other weight at ``q``. Oracle: that error computed here in
    float64 for each weight moved alone over a grid of values around the claimed optimum, whose
    smallest value is at the grid's middle point; a dead input (zero diagonal) is nan."""
    from quantize.methods import gptq as G

    g = torch.Generator().manual_seed(3)
    out, k = 3, 12
    w = torch.randn(out, k, generator=g, dtype=torch.float64)
    x = torch.randn(40, k, generator=g, dtype=torch.float64) * torch.linspace(0.3, 2.0, k, dtype=torch.float64)
    x[:, 5] = 0  # no input reaches column 5
    h = x.t() @ x
    q = w.round()  # any other weights: RTN's here
    t = G.coordinate_optimum(w.float(), h.float(), q.float()).double()
    assert t[:, 5].isnan().all() and not t[:, :5].isnan().any()

    def err(m):
        r = w - m
        return torch.trace(r @ h @ r.t())

    steps = torch.linspace(-0.05, 0.05, 11, dtype=torch.float64)
    for i in range(out):
        for j in [c for c in range(k) if c != 5]:
            losses = []
            for d in steps:
                m = q.clone()
                m[i, j] = t[i, j] + d
                losses.append(float(err(m)))
            assert min(range(11), key=losses.__getitem__) == 5, (i, j, losses)
    # near miss: the source weight is not the optimum once the other weights are rounded
    assert not torch.allclose(t[:, :5], w[:, :5], atol=1e-3)


def test_pack_texts_joins_and_cuts_counted_by_hand():
    from quantize.calibrate.data import pack_texts

    texts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    got = [t.tolist() for t in pack_texts(iter(texts), 0, 3, 4)]
    assert got == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]  # EOS after each text, cut every 4
    assert [t.tolist() for t in pack_texts(iter(texts), 0, 9, 4)] == got  # the partial last one is dropped
    assert [t.tolist() for t in pack_texts(iter(texts), None, 9, 4)] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert len(pack_texts(iter(texts), 0, 1, 4)) == 1


def test_pack_calibrates_on_full_length_samples(llama, tmp_path):
    """--pack: every calibration sample is exactly --seq-len tokens (the method's report counts them);
    too little text for the samples asked is one line; beside RTN it is refused (a method option)."""
    out = tmp_path / "p"
    convert(llama, out, profile="all-linear", method="gptq", pack=True, samples=4, seq_len=64, workers=1)
    rep = _manifest(out)["method"]
    assert rep["samples"] == 4 and rep["tokens"] == 4 * 64
    assert _manifest(out)["options"]["pack"] is True
    with pytest.raises(QuantizeError, match="packed samples of 4096 tokens .* fewer than --samples 64"):
        convert(llama, tmp_path / "q", profile="all-linear", method="gptq", pack=True, samples=64, seq_len=4096)
    assert not (tmp_path / "q").exists()
    with pytest.raises(QuantizeError, match="--pack is an option of --method gptq or --method autoround"):
        convert(llama, tmp_path / "r", pack=True)


def test_skip_rtn_loss_is_gptqs_alone(llama, tmp_path):
    with pytest.raises(QuantizeError, match="skip-rtn-loss"):
        convert(llama, tmp_path / "ar", method="autoround", skip_rtn_loss=True, **CAL)
    assert not (tmp_path / "ar").exists()


@pytest.mark.parametrize("pack", [False, True])
def test_calibration_texts_longer_than_the_tokenizer_max_raise_no_false_alarm(llama, tmp_path, pack):
    """A calibration text longer than the tokenizer's ``model_max_length`` (512 here) is cut to
    --seq-len before the model sees it, so transformers' "will result in indexing errors" warning is
    false there and is not logged; the near miss, the same text through the tokenizer as it is
    called by default, logs it (so the handler would have seen it)."""
    import logging

    from quantize.calibrate.data import build_samples, load_tokenizer

    data = tmp_path / "long.txt"
    data.write_text(" ".join(["the"] * 2000) + "\n")
    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("transformers")
    h = Grab(level=logging.WARNING)
    log.addHandler(h)
    try:
        s = build_samples(llama, str(data), 2 if pack else 1, 64, pack=pack)
        assert [len(i) for i in s.ids] == ([64, 64] if pack else [64])
        assert not [m for m in seen if "indexing errors" in m]
        load_tokenizer(llama)(data.read_text())  # a fresh tokenizer: its warn-once state is its own
        assert [m for m in seen if "indexing errors" in m]
    finally:
        log.removeHandler(h)
