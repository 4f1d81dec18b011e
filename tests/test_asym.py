"""GPTQ's asymmetric calibration (``convert --method gptq --asym F``, GPTAQ-style): the Linears that read
the residual stream aim at the source model's own outputs on its own inputs. The target against a
least-squares solve of the explicit inputs, the paired statistics against a hand computation, which
units are corrected, and end to end: where the streams are equal nothing changes, where they differ
exactly the residual-stream units change; two ranks give one process's bytes; the option's bounds."""

import json

import pytest
import torch

from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.methods.gptq import Hessians, asym_target, corrects
from quantize.methods.units import cross_key
from quantize.methods.units import Unit

from .conftest import load_dir, method_layers, weights_only

KW = dict(method="gptq", profile="all-linear", samples=4, seq_len=48, workers=1)


def _streams(n=400, d=12, out=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)  # the source stream's inputs
    xq = x + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)  # the quantized path's
    w = torch.randn(out, d, generator=g, dtype=torch.float64)
    return x, xq, w


def test_asym_target_is_the_least_squares_weight_on_the_quantized_inputs():
    x, xq, w = _streams()
    n = x.shape[0]
    h, c = 2 * xq.t() @ xq / n, 2 * xq.t() @ x / n
    # oracle: the weight whose outputs on xq best match the source weight's on x, by least squares
    t = torch.linalg.lstsq(xq, x @ w.t()).solution.t()
    got = asym_target(w, h, c, 0.0, 1.0)
    assert torch.allclose(got, t, atol=1e-9), (got - t).abs().max()
    half = asym_target(w, h, c, 0.0, 0.5)
    assert torch.allclose(half, w + 0.5 * (t - w), atol=1e-9)
    assert torch.equal(asym_target(w, h, c, 0.01, 0.0), w)
    # near misses: the cross term transposed (x^T xq), or the streams swapped, are other weights
    assert not torch.allclose(asym_target(w, h, c.t(), 0.0, 1.0), t, atol=1e-3)
    hs = 2 * x.t() @ x / n
    assert not torch.allclose(asym_target(w, hs, c.t(), 0.0, 1.0), t, atol=1e-3)


def test_equal_streams_leave_the_weight_as_it_is_under_dampening():
    x, _, w = _streams()
    h = 2 * x.t() @ x / x.shape[0]
    assert torch.allclose(asym_target(w, h, h.clone(), 0.01, 1.0), w, atol=1e-12)
    # a dampened H against an undampened C = H would shrink it: the step is taken on C - H
    wrong = torch.linalg.solve(h + 0.01 * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype), h @ w.t()).t()
    assert not torch.allclose(wrong, w, atol=1e-6)


def test_corrected_units_are_those_reading_the_residual_stream():
    def u(path, roles, expert=None):
        return Unit(path, expert, [], torch.bfloat16, roles)

    yes = [u("self_attn.q_proj.weight", ["attn_q"]), u("self_attn.k_proj.weight", ["attn_k"]),
           u("self_attn.v_proj.weight", ["attn_v"]), u("self_attn.q_a_proj.weight", ["attn_q_a"]),
           u("self_attn.kv_a_proj_with_mqa.weight", ["attn_kv_a"]), u("mlp.gate_proj.weight", ["dense_gate"]),
           u("mlp.up_proj.weight", ["dense_up"]), u("mlp.shared_experts.gate_proj.weight", ["shared_gate"]),
           u("mlp.shared_experts.up_proj.weight", ["shared_up"])]
    no = [u("self_attn.o_proj.weight", ["attn_o"]), u("self_attn.q_b_proj.weight", ["attn_q_b"]),
          u("self_attn.kv_b_proj.weight", ["attn_kv_b"]), u("mlp.down_proj.weight", ["dense_down"]),
          u("mlp.shared_experts.down_proj.weight", ["shared_down"]),
          u("mlp.experts.down_proj", ["expert_down"], expert=3), u("x.weight", [])]
    yes.append(u("mlp.experts.gate_up_proj", ["expert_gate", "expert_up"], expert=3))
    assert [corrects(x) for x in yes] == [True] * len(yes)
    assert [corrects(x) for x in no] == [False] * len(no)


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 4, bias=False)
        self.b = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x):
        return self.b(self.a(x))


def test_paired_statistics_are_the_cross_products_of_the_two_streams():
    torch.manual_seed(0)
    layer = _Two()
    units = [Unit("a.weight", None, [("a", 0, 4)], torch.bfloat16, ["attn_q"]),
             Unit("b.weight", None, [("b", 0, 3)], torch.bfloat16, ["attn_o"])]
    hooks = Hessians(layer, units, False, samples=2, asym=True)
    xs = [torch.randn(1, 5, 6) for _ in range(2)]
    xq = [x + 0.1 * torch.randn_like(x) for x in xs]
    with torch.no_grad():
        for s in range(2):
            hooks.begin()
            hooks.source_side(True)
            layer(xs[s])
            hooks.source_side(False)
            layer(xq[s])
            hooks.merge(hooks.end(), s)
    hooks.combine(None, "test")
    hooks.remove()
    a = torch.cat([x.reshape(-1, 6) for x in xq])
    b = torch.cat([x.reshape(-1, 6) for x in xs])
    c = hooks.normalized(cross_key("a.weight"))
    assert torch.allclose(c, 2 * a.t() @ b / 2, atol=1e-5)  # sum over samples of 2 xq^T x, / samples
    assert not torch.allclose(c, 2 * b.t() @ a / 2, atol=1e-3)  # the transpose is not it
    assert torch.allclose(hooks.normalized("a.weight"), 2 * a.t() @ a / 2, atol=1e-5)  # H from the quantized path
    assert cross_key("b.weight") not in hooks.H  # o_proj-like: not paired


@pytest.fixture(scope="module")
def llama_runs(tiny, tmp_path_factory):
    src = tiny("llama", layout="bf16")
    root = tmp_path_factory.mktemp("asym")
    for name, a in (("off", 0.0), ("half", 0.5)):
        convert(src, root / name, asym=a, **KW)
    return src, root


def _tensors(out):
    return load_dir(out)


def test_only_the_residual_stream_units_change_where_the_streams_first_differ(llama_runs):
    """Layer 0 sees equal streams (nothing quantized before it): its bytes are the symmetric run's. Layer 1
    gets the same quantized-path inputs in both runs, so its o_proj and down_proj (not paired) keep their
    bytes and exactly q/k/v/gate/up change; the record says --asym."""
    _, root = llama_runs
    off, half = _tensors(root / "off"), _tensors(root / "half")
    assert off.keys() == half.keys()
    changed = sorted(k for k in off if not torch.equal(off[k], half[k]))
    layer0 = [k for k in changed if ".layers.0." in k]
    assert layer0 == []
    layer1 = sorted({k.split(".layers.1.")[1].rsplit(".", 1)[0] for k in changed if ".layers.1." in k})
    assert layer1 == ["mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"]
    m = json.loads((root / "half" / "quantize_manifest.json").read_text())["method"]
    assert m["asym"] == 0.5
    assert json.loads((root / "off" / "quantize_manifest.json").read_text())["method"]["asym"] == 0.0


def test_asym_lowers_the_error_against_the_source_models_own_outputs(llama_runs, tmp_path):
    """The point of it: on the tiny llama, the KL against the source over the shipped text is strictly
    below the symmetric run's (equal figures fail; how much it gains on held-out text of a trained model
    is the benchmark's job, scripts/bench_methods.py)."""
    from quantize.evaluate.kld import kld

    src, root = llama_runs
    r_off = kld(src, root / "off", tokens=256, chunk=64)
    r_half = kld(src, root / "half", tokens=256, chunk=64)
    assert r_half.kld_mean < r_off.kld_mean, (r_half.kld_mean, r_off.kld_mean)


def test_routed_experts_gate_up_change_where_the_streams_first_differ_and_down_does_not(tiny, tmp_path):
    """--profile experts on the tiny GLM-5: only routed experts are INT4. The first MoE layer after a
    quantized one gets the same quantized-path inputs in both runs: each expert's gate/up moves, its
    down_proj (its Hessian from the source gate/up on those inputs) keeps its bytes; the first MoE layer
    (equal streams) is unchanged."""
    src = tiny("glm_moe_dsa")
    kw = dict(KW, profile="experts")
    convert(src, tmp_path / "off", asym=0.0, **kw)
    convert(src, tmp_path / "half", asym=0.5, **kw)
    off, half = _tensors(tmp_path / "off"), _tensors(tmp_path / "half")
    changed = {k for k in off if not torch.equal(off[k], half[k])}
    layers = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in off if ".experts." in k})
    first, second = layers[0], layers[1]
    assert not [k for k in changed if f".layers.{first}." in k]
    moved = {k.split(".experts.")[1].split(".")[1] for k in changed if f".layers.{second}." in k}
    assert moved == {"gate_proj", "up_proj"}, moved
    n_experts = len({k.split(".experts.")[1].split(".")[0] for k in off if f".layers.{second}.mlp.experts." in k})
    gate = {k.split(".experts.")[1].split(".")[0] for k in changed
            if f".layers.{second}." in k and ".gate_proj.weight_packed" in k}
    assert len(gate) >= n_experts // 2, (len(gate), n_experts)  # the fed experts moved (a starved one stays RTN)


def test_asym_on_a_streamed_moe_layer_and_two_ranks_give_one_process_bytes(tiny, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = tiny("glm_moe_dsa")
    one = tmp_path / "one"
    convert(src, one, asym=0.5, memory_budget_gib=0.0, **KW)
    sym = tmp_path / "sym"
    convert(src, sym, asym=0.0, memory_budget_gib=0.0, **KW)
    assert weights_only(one) != weights_only(sym)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    two = tmp_path / "two"
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "convert", str(src), str(two), "--method", "gptq",
                        "--profile", "all-linear", "--samples", "4", "--seq-len", "48", "--workers", "1",
                        "--memory-budget-gib", "0", "--asym", "0.5", "--nproc", "2"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert weights_only(two) == weights_only(one)
    assert method_layers(two) == method_layers(one)


@pytest.mark.parametrize("value", [-0.01, 1.01])
def test_asym_outside_zero_to_one_is_refused(tiny, tmp_path, value):
    src = tiny("llama", layout="bf16")
    with pytest.raises(QuantizeError, match="asym"):
        convert(src, tmp_path / "o", asym=value, **KW)
    assert not (tmp_path / "o").exists()


def test_asym_is_gptqs_option_only(tiny, tmp_path):
    src = tiny("llama", layout="bf16")
    with pytest.raises(QuantizeError, match="asym"):
        convert(src, tmp_path / "o", method="autoround", asym=0.5, samples=4, seq_len=48)
    convert(src, tmp_path / "edge", asym=1.0, **KW)  # the bounds themselves are taken


def test_interrupted_then_resumed_gives_the_same_bytes_and_another_fraction_is_another_run(llama_runs, tmp_path,
                                                                                              monkeypatch):
    """A kill in layer 1's update (the tiny llama has 2), then --resume: the recorded layers are replayed (the source stream rebuilt
    beside them) and the bytes are the uninterrupted run's; --resume with another --asym is refused."""
    from quantize.methods import gptq as G

    src, root = llama_runs
    out = tmp_path / "out"
    real = G.GPTQ.results

    def dies_in_layer_1(x, hooks):
        if x.index == 1:
            raise KeyboardInterrupt
        return real(x, hooks)

    monkeypatch.setattr(G.GPTQ, "results", staticmethod(dies_in_layer_1))
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, asym=0.5, **KW)
    monkeypatch.setattr(G.GPTQ, "results", staticmethod(real))
    with pytest.raises(QuantizeError, match="different"):
        convert(src, out, asym=0.25, resume=True, **KW)
    events = []
    convert(src, out, asym=0.5, resume=True, emit=events.append, **KW)
    assert [e["layer"] for e in events if e.get("event") == "layer" and e.get("replayed")] == [0]
    assert weights_only(out) == weights_only(root / "half")


def test_the_card_says_asymmetric_calibration_only_when_it_was_used(llama_runs):
    from quantize.publish.card import render

    _, root = llama_runs

    def card(name):
        d = root / name
        return render(d, json.loads((d / "quantize_manifest.json").read_text()), [], None, 0).text

    assert "asymmetric calibration 0.5 (the weights that read the residual stream aim at the source model's" \
        in card("half")
    assert "asymmetric calibration" not in card("off")
    assert "against the source model's own output of this layer (--asym aims there" in card("half")
    assert "against the source layer's output on the same (quantized-path) inputs" in card("off")


def test_an_asym_runs_layer_loss_is_against_the_source_models_own_output(llama_runs):
    """Layer 0 sees equal streams: the same reference, the same RTN error. From layer 1 on the reference
    is the source model's own output, which also holds what the layers before left: RTN's error against it
    is not the symmetric run's (same quantized-path inputs in layer 1, same RTN weights)."""
    _, root = llama_runs
    off, half = method_layers(root / "off"), method_layers(root / "half")
    assert half[0]["loss_rtn"] == off[0]["loss_rtn"]
    assert half[1]["loss_rtn"] != off[1]["loss_rtn"]
