"""Routed experts streamed a group at a time (calibrate/experts.py, methods/streamed.py): the
same bits as the whole decoder layer transformers builds, for any group size, for calibration,
GPTQ and a resumed GPTQ run; the group never holds more experts than the budget allows."""

import json

import pytest
import torch

from quantize.calibrate import experts as ex
from quantize.calibrate.runner import LayerStreamer
from quantize.convert import convert

from .conftest import load_dir, method_layers, weights_only

CAL = dict(samples=4, seq_len=48, workers=1)
ARCHS = [("deepseek_v3", "vendor"), ("glm_moe_dsa", "vendor"), ("kimi_k25", "vendor")]


def _whole_layer(monkeypatch):
    """The pass as it was: every decoder layer built whole, routed experts included."""
    real = LayerStreamer.layer
    monkeypatch.setattr(LayerStreamer, "layer", lambda self, i, stream_experts=False, device=None: real(self, i, False, device))


@pytest.mark.parametrize("arch,layout", ARCHS)
def test_calibration_stream_is_the_whole_layer_bit_for_bit(tiny, arch, layout):
    st = LayerStreamer(tiny(arch, layout=layout), expert_budget=1)  # one expert at a time
    torch.manual_seed(0)
    samples = [torch.randint(0, 100, (12,)), torch.randint(0, 100, (7,))]
    seen = []
    real = st.expert_weights
    st.expert_weights = lambda i, g, device=None: (seen.append(len(g)), real(i, g, device))[1]
    streamed = [[h.clone() for h in hs] for _, hs in st.stream(samples)]
    assert seen and max(seen) == 1  # the experts really were read one at a time
    hidden = [st.embed(ids.unsqueeze(0)).to(st.dtype) for ids in samples]
    topk = [None] * len(samples)
    moe = 0
    for i in range(st.num_layers):
        layer = st.layer(i)  # transformers' whole layer, its experts module included
        moe += hasattr(layer.mlp, "experts")
        outs = [st.run_layer(layer, h, topk=t) for h, t in zip(hidden, topk)]
        hidden, topk = [o for o, _ in outs], [t for _, t in outs]
        for a, b in zip(hidden, streamed[i]):
            assert torch.equal(a, b), f"layer {i}"
    assert moe >= 1
    st.close()


def test_calibrate_kv_report_is_the_same_for_any_expert_budget(tiny, tmp_path, monkeypatch):
    from quantize.calibrate.kv import calibrate_kv

    src = tiny("deepseek_v3")
    docs = []
    for name, budget in (("one", 0.0), ("all", 4.0), ("whole", 4.0)):
        if name == "whole":
            _whole_layer(monkeypatch)
        stats = tmp_path / f"{name}.json"
        calibrate_kv(src, samples=3, seq_len=24, stats_out=stats, memory_budget_gib=budget)
        doc = json.loads(stats.read_text())
        docs.append(doc["layers"])
    assert docs[0] == docs[1] == docs[2]


def test_group_size_is_what_the_budget_holds():
    assert ex.group_size(10 * 100, 100, 64) == 10
    assert ex.group_size(10 * 100 - 1, 100, 64) == 9  # one byte short of ten experts: nine
    assert ex.group_size(0, 100, 64) == 1  # at least one expert
    assert ex.group_size(10 ** 12, 100, 64) == 64  # never more than the layer has
    assert [list(g) for g in ex.groups(5, 2)] == [[0, 1], [2, 3], [4]]


@pytest.fixture(scope="module")
def gptq_outs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    src = tiny("glm_moe_dsa")
    outs = {}
    for name, kw in {"one": dict(memory_budget_gib=0.0), "big": dict(memory_budget_gib=4.0)}.items():
        out = root / name
        convert(src, out, method="gptq", profile="all-linear", all_experts=False, **CAL, **kw)
        outs[name] = out
    return src, outs


def test_gptq_streamed_is_the_whole_layer_bit_for_bit(gptq_outs, tmp_path, monkeypatch):
    src, outs = gptq_outs
    _whole_layer(monkeypatch)
    whole = tmp_path / "whole"
    convert(src, whole, method="gptq", profile="all-linear", **CAL)
    assert weights_only(outs["one"]) == weights_only(whole)
    assert weights_only(outs["big"]) == weights_only(whole)
    assert method_layers(outs["one"]) == method_layers(whole)  # losses, token counts, fallbacks: the same report
    job = json.loads((outs["one"] / ".quantize" / "job.json").read_text())
    assert len(job["layers"]["0001"]["parts"]) > 1  # one group file per expert (budget 0)


@pytest.mark.parametrize("kw", [dict(all_experts=True), dict(min_expert_tokens=30)])
def test_gptq_streamed_statistics_options_match_the_whole_layer(tiny, tmp_path, monkeypatch, kw):
    src = tiny("deepseek_v3")
    streamed = tmp_path / "s"
    convert(src, streamed, method="gptq", memory_budget_gib=0.0, **CAL, **kw)
    _whole_layer(monkeypatch)
    whole = tmp_path / "w"
    convert(src, whole, method="gptq", **CAL, **kw)
    assert weights_only(streamed) == weights_only(whole)
    assert method_layers(streamed) == method_layers(whole)
    if "min_expert_tokens" in kw:  # the near miss is real: some experts fell back, named, in both
        assert any(r["fallbacks"] for r in method_layers(whole))


def test_gptq_killed_mid_group_resumes_byte_identical(gptq_outs, tmp_path, monkeypatch):
    from quantize.methods import runner

    src, outs = gptq_outs
    out = tmp_path / "o"
    real = runner.Pass._save
    calls = [0]

    def dies(self, name, tensors, i):
        calls[0] += 1
        if i == 2 and "-e" in name and calls[0] > 12:  # layer 2, a few expert groups in
            raise KeyboardInterrupt
        return real(self, name, tensors, i)

    monkeypatch.setattr(runner.Pass, "_save", dies)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, method="gptq", profile="all-linear", memory_budget_gib=0.0, **CAL)
    assert sorted(json.loads((out / ".quantize" / "job.json").read_text())["layers"]) == ["0000", "0001"]
    monkeypatch.setattr(runner.Pass, "_save", real)
    events = []
    convert(src, out, method="gptq", profile="all-linear", memory_budget_gib=4.0, resume=True, emit=events.append,
            **CAL)
    replayed = [e["layer"] for e in events if e.get("event") == "layer" and e.get("replayed")]
    assert replayed == [0, 1]  # layer 1 replayed through its streamed expert files, layer 2 redone
    assert weights_only(out) == weights_only(outs["one"])


def test_a_tampered_group_file_redoes_the_layer(gptq_outs, tmp_path):
    import shutil

    src, outs = gptq_outs
    out = tmp_path / "o"
    shutil.copytree(outs["one"], out)
    (out / "quantize_manifest.json").unlink()  # an interrupted run's folder, every layer recorded
    part = sorted((out / ".quantize" / "layers").glob("0001-e*.safetensors"))[1]
    data = bytearray(part.read_bytes())
    data[-1] ^= 1
    part.write_bytes(bytes(data))
    events = []
    convert(src, out, method="gptq", profile="all-linear", memory_budget_gib=0.0, resume=True, emit=events.append,
            **CAL)
    redone = [e["layer"] for e in events if e.get("event") == "layer" and not e.get("replayed")]
    assert redone[0] == 1
    assert weights_only(out) == weights_only(outs["one"])


# AutoRound on MoE layers: each rank trains its own routed experts (methods/tuning.py), one process included
AR = dict(method="autoround", profile="all-linear", iters=2, batch_size=3, samples=5, seq_len=24, workers=1,
          memory_budget_gib=0.0, min_expert_tokens=0)


def _step_grads(monkeypatch):
    """Every step's summed gradients of the Linear units (and, for a layer built whole, of its fused
    experts), per layer and step, as ``tuning._combine`` hands them to rank 0."""
    from quantize.methods import tuning

    got = []
    real = tuning._combine

    def spy(world, t, tree, what):
        summed = real(world, t, tree, what)
        got.append((what, dict(zip(t.held, [None if g is None else g.clone() for g in summed]))))
        return summed

    monkeypatch.setattr(tuning, "_combine", spy)
    return got


@pytest.fixture(scope="module")
def top4(tiny):
    """Four experts per token: the order in which the experts' input gradients are added shows in the bits."""
    return tiny("deepseek_v3", layout="bf16", overrides={"num_experts_per_tok": 4})


@pytest.fixture(scope="module")
def ar_whole(top4, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        _whole_layer(mp)
        grads = _step_grads(mp)
        out = tmp_path_factory.mktemp("ar") / "whole"
        convert(top4, out, **AR)
    finally:
        mp.undo()
    return out, grads


def _same_linear_grads(whole, ep) -> list[str]:
    """The steps where a Linear unit's gradient differs between the two runs (any bit)."""
    assert [w for w, _ in whole] == [w for w, _ in ep] and ep
    bad = []
    for (what, gw), (_, ge) in zip(whole, ep):
        for path, g in ge.items():
            if (g is None) != (gw[path] is None) or g is not None and not torch.equal(g, gw[path]):
                bad.append(f"{what}: {path}")
    return bad


def test_autoround_experts_on_their_own_rank_are_the_whole_layer_bit_for_bit(top4, ar_whole, tmp_path, monkeypatch):
    """The layer built without its routed experts, read one at a time (budget 0), each expert's forward
    and backward apart: every step's gradients, the codes, scales and losses of the layer built whole."""
    from quantize.methods import tuning

    whole, whole_grads = ar_whole
    moe = []
    real = tuning.Tuning.step
    monkeypatch.setattr(tuning.Tuning, "step", lambda self, *a: (moe.append(self.own is not None), real(self, *a))[1])
    grads = _step_grads(monkeypatch)
    out = tmp_path / "ep"
    convert(top4, out, **AR)
    assert any(moe) and not all(moe)  # the MoE layers went expert by expert; the dense layer 0 whole
    assert _same_linear_grads(whole_grads, grads) == []
    assert weights_only(out) == weights_only(whole)
    assert method_layers(out) == method_layers(whole)
    methods = {t["name"]: t["method"] for t in json.loads((out / "quantize_manifest.json").read_text())["tensors"]}
    assert methods["model.layers.1.mlp.experts.5.down_proj.weight"] == "autoround"


def test_autoround_experts_gradients_added_in_another_order_are_caught(top4, ar_whole, tmp_path, monkeypatch):
    """A near miss: the experts' input gradients added first expert first (autograd adds the last
    first) moves the Linear units' gradients by their last bits, and the comparison sees it."""
    from quantize.methods import tuning

    real = tuning.Tuning._backward
    monkeypatch.setattr(tuning.Tuning, "_backward",
                        lambda self, held, parts, leaves: real(self, held, [p[::-1] for p in parts[::-1]], leaves))
    grads = _step_grads(monkeypatch)
    convert(top4, tmp_path / "asc", **AR)
    assert _same_linear_grads(ar_whole[1], grads)


@pytest.fixture(scope="module")
def ar_gptq(top4, tmp_path_factory):
    """--init gptq on the layers built whole: their routed experts start from the fused parameters' GPTQ
    result, every expert's statistics hooked in the one layer forward (``start.gptq_start``)."""
    mp = pytest.MonkeyPatch()
    try:
        _whole_layer(mp)
        out = tmp_path_factory.mktemp("arg") / "whole"
        convert(top4, out, init="gptq", **AR)
    finally:
        mp.undo()
    return out


def test_autoround_init_gptq_streamed_experts_start_as_the_whole_layer_bit_for_bit(top4, ar_gptq, tmp_path):
    """Streamed, each rank GPTQs the routed experts it trains from the captured inputs, a group at a time
    (one expert, budget 0), and starts them one at a time (``Tuned.start_at``): the codes, scales and
    losses (first, best, last, moved scales) of the layer built whole, where GPTQ and the start run on
    the fused parameters at once."""
    out = tmp_path / "ep"
    convert(top4, out, init="gptq", **AR)
    assert weights_only(out) == weights_only(ar_gptq)
    layers = method_layers(out)
    assert layers == method_layers(ar_gptq)
    assert [x["train"]["moved_scales"] for x in layers] == [0, 0, 0]


def test_autoround_init_gptq_killed_in_an_experts_start_resumes_byte_identical(top4, ar_gptq, tmp_path, monkeypatch):
    """A run interrupted while layer 2's routed experts are GPTQ'd for their start keeps layers 0 and 1;
    --resume replays them and redoes layer 2's start from the replayed stream: the uninterrupted bytes."""
    from quantize.methods import tuning

    real = tuning.expert_starts

    def dies_in_layer_2(world, fwd, stand, i, *a):
        if i == 2:
            raise KeyboardInterrupt
        return real(world, fwd, stand, i, *a)

    out = tmp_path / "o"
    monkeypatch.setattr(tuning, "expert_starts", dies_in_layer_2)
    with pytest.raises(KeyboardInterrupt):
        convert(top4, out, init="gptq", **AR)
    assert sorted(json.loads((out / ".quantize" / "job.json").read_text())["layers"]) == ["0000", "0001"]
    monkeypatch.setattr(tuning, "expert_starts", real)
    convert(top4, out, init="gptq", resume=True, **AR)
    assert weights_only(out) == weights_only(ar_gptq)


def test_autoround_init_gptq_iters0_writes_gptqs_routed_experts(top4, tmp_path):
    """With no step the start is what is written: --method gptq's bytes, routed experts included (the
    oracle: --method gptq itself). Near miss: the RTN start's routed experts are not GPTQ's."""
    kw = {**AR, "iters": 0}
    gptq = {k: v for k, v in AR.items() if k not in ("method", "iters", "batch_size")}
    convert(top4, tmp_path / "g", method="gptq", **gptq)
    convert(top4, tmp_path / "a", init="gptq", **kw)
    convert(top4, tmp_path / "r", **kw)
    g, a, r = (weights_only(tmp_path / n) for n in "gar")
    assert a == g
    gl, rl = load_dir(tmp_path / "g"), load_dir(tmp_path / "r")
    tensors = json.loads((tmp_path / "g" / "quantize_manifest.json").read_text())["tensors"]
    ran = [t["name"] for t in tensors if ".mlp.experts." in t["name"] and t["method"] == "gptq"]
    assert len(ran) > 8  # routed experts GPTQ ran on (the others no token reached: RTN in both)
    assert all(not torch.equal(gl[k + "_packed"], rl[k + "_packed"]) for k in ran)


def test_a_starved_expert_keeps_its_starts_method(top4, tmp_path, monkeypatch):
    """An expert the router starves (below --min-expert-tokens: 28 to 44 of these tokens) is not trained
    and keeps its start: an RTN fallback, named, where the start is RTN (GPTQ too had too few tokens), and
    labelled with the start's method, not named a fallback, where GPTQ ran it. The second case is made
    here by relabelling the starts (the router's count through the RTN Linear units, which AutoRound
    uses, and GPTQ's through the source ones can differ); the bytes are the same either way."""
    from quantize.methods import tuning
    from quantize.methods.units import Result

    kw = {**AR, "min_expert_tokens": 50, "init": "gptq"}
    convert(top4, tmp_path / "a", **kw)
    starved = [f["name"] for x in method_layers(tmp_path / "a") for f in x["fallbacks"] if ".experts." in f["name"]]
    assert len(starved) == 21  # experts 1, 3, 5, 7 of layer 1 and 1, 3, 4 of layer 2, 3 weights each

    def method(out):
        tensors = json.loads((out / "quantize_manifest.json").read_text())["tensors"]
        return {t["name"].removesuffix(".weight"): t["method"] for t in tensors}

    assert {method(tmp_path / "a")[n] for n in starved} == {"rtn"}
    real = tuning.expert_starts

    def gptq_ran_all(*a):
        results, optimum = real(*a)
        return {k: Result(r.codes, r.scale, "gptq") for k, r in results.items()}, optimum

    monkeypatch.setattr(tuning, "expert_starts", gptq_ran_all)
    convert(top4, tmp_path / "b", **kw)
    assert weights_only(tmp_path / "b") == weights_only(tmp_path / "a")
    assert not [f for x in method_layers(tmp_path / "b") for f in x["fallbacks"] if ".experts." in f["name"]]
    assert {method(tmp_path / "b")[n] for n in starved} == {"gptq"}


def test_a_rank_reads_and_holds_only_its_own_experts(tiny):
    """Rank 1 of 2 (``World.owned``: experts 4-7 of 8) reads those experts, one at a time within a
    budget of one, and its training state holds them and no other."""
    from types import SimpleNamespace

    from quantize.methods.tuning import Owned
    from quantize.methods.units import Unit

    st = LayerStreamer(tiny("deepseek_v3", layout="bf16"), expert_budget=1)
    read = []
    real = st.expert_weights
    st.expert_weights = lambda i, g, device=None: (read.append(list(g)), real(i, g, device))[1]
    units = [Unit(f"mlp.experts.{p}", e, [(f"model.layers.1.mlp.experts.{e}.x", 0, 1)], torch.bfloat16)
             for e in range(8) for p in ("gate_up_proj", "down_proj")]
    opt = SimpleNamespace(observer="fullrange", group_size=32, all_experts=False, min_expert_tokens=0)
    own = Owned(st, 1, units, opt, {}, range(4, 8), "cpu")
    assert read == [[4], [5], [6], [7]]
    assert {n: tuple(t.shape)[0] for n, t in own.tuned.items()} == {"gate_up_proj": 4, "down_proj": 4}
    assert sorted(u.expert for u in own.units) == [4, 4, 5, 5, 6, 6, 7, 7]
    st.close()


def _without_rtn(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("loss_rtn", "rel_err_rtn")} for r in rows]


@pytest.mark.parametrize("whole", [False, True])
def test_skip_rtn_loss_writes_the_same_bytes_without_the_rtn_passes(gptq_outs, tmp_path, monkeypatch, whole):
    """--skip-rtn-loss leaves out the passes that serve the report's RTN loss alone: the same bytes,
    the same loss and relative error (the reference's norm then from the quantized pass), the RTN
    figures None; per MoE layer two captures instead of three (streamed) and no pass "after the RTN
    layer" (streamed replay or whole layer). Counted in the same test on the default run (the near
    miss: three captures and an RTN pass per layer)."""
    from quantize.methods.forward import Forward

    src, outs = gptq_outs
    if whole:
        _whole_layer(monkeypatch)
    seen: list[str] = []
    real_capture, real_call = Forward.capture, Forward.__call__
    monkeypatch.setattr(Forward, "capture", lambda self, *a, **kw: (seen.append("capture"),
                                                                    real_capture(self, *a, **kw))[1])
    monkeypatch.setattr(Forward, "__call__", lambda self, *a, **kw: (seen.append(a[4]), real_call(self, *a, **kw))[1])
    runs = {}
    for name, skip in (("default", False), ("skip", True)):
        seen.clear()
        out = tmp_path / name
        convert(src, out, method="gptq", profile="all-linear", all_experts=False, memory_budget_gib=0.0,
                skip_rtn_loss=skip, **CAL)
        runs[name] = (out, list(seen))
    (d, seen_d), (s, seen_s) = runs["default"], runs["skip"]
    assert weights_only(s) == weights_only(d) == weights_only(outs["one"])
    layers = method_layers(s)
    assert _without_rtn(layers) == _without_rtn(method_layers(d))
    quantized = [r for r in layers if r.get("units")]
    moe = sum(r.get("tokens_per_expert") is not None for r in quantized)
    assert quantized and moe and all(r["loss_rtn"] is None and r["rel_err_rtn"] is None for r in quantized)
    assert all(r["loss_rtn"] is not None for r in method_layers(d) if r.get("units"))
    rtn_passes = [w.count("after the RTN layer") for w in (seen_d, seen_s)]
    assert rtn_passes == [len(quantized), 0], rtn_passes
    captures = [w.count("capture") for w in (seen_d, seen_s)]
    assert captures == ([0, 0] if whole else [3 * moe, 2 * moe]), captures
    m = json.loads((s / "quantize_manifest.json").read_text())["method"]
    assert m["skip_rtn_loss"] is True
    # the same bytes: recorded, but not in the resume key nor in a pipeline's stage hash
    from quantize.options import ConvertOptions
    from quantize.pipeline import METHOD_KEYS

    assert ConvertOptions(method="gptq", skip_rtn_loss=True).key_dict() == ConvertOptions(method="gptq").key_dict()
    assert "skip_rtn_loss" not in METHOD_KEYS and "damp" in METHOD_KEYS
