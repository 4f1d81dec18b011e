"""The GPU path of the data-aware methods, as far as a CPU can prove it: the batched GPTQ call a
GPU makes is byte-identical to the CPU's per-chunk path; the expert groups' budget on a GPU; RTN
on --device cuda refused in one line. What needs a GPU is in tests/test_gpu.py (``gpu`` marker)."""

from __future__ import annotations

import pytest
import torch

from quantize.errors import QuantizeError
from quantize.methods import gptq, streamed
from quantize.methods.units import Unit


def _items(n: int, rows: int, cols: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for e in range(n):
        w = torch.randn(rows, cols, generator=g) * 0.02
        x = torch.randn(3 * cols, cols, generator=g) * (1 + torch.rand(cols, generator=g))  # uneven columns
        out.append((Unit("mlp.experts.gate_up_proj", e, [(f"e{e}", 0, rows)], torch.bfloat16), w,
                    (2 * x.t() @ x) / x.shape[0]))
    return out


def _bytes(res) -> list[tuple[bytes, bytes, bool]]:
    return [(r.codes.numpy().tobytes(), r.scale.view(torch.int16).numpy().tobytes(), fb) for r, fb, *_ in res]


def test_batched_gptq_is_byte_identical_to_the_per_chunk_path_on_cpu():
    """Same-shape units stacked into one call (what a GPU runs: 20 + 6 units, two shapes, so the
    batched Cholesky from 16 on is in it) give the CPU path's codes and scales bit for bit."""
    items = _items(20, 64, 128, 0) + _items(6, 32, 64, 1)
    per_chunk = gptq.quantize(items, 32, "fullrange", "static", 128, 0.01, 2)
    batched = gptq.quantize(items, 32, "fullrange", "static", 128, 0.01, 2, batched=True)
    assert _bytes(batched) == _bytes(per_chunk)
    assert [c for c in gptq._chunks(items, gptq.GPU_CHUNK)] == [list(range(20)), list(range(20, 26))]
    assert [len(c) for c in gptq._chunks(items, gptq.CHUNK)] == [8, 8, 4, 6]
    # not vacuous: one unit's Hessian changed changes that unit's codes, and only that unit's
    items[3] = (items[3][0], items[3][1], items[3][2] + torch.diag(torch.linspace(0, 5, 128)))
    moved = _bytes(gptq.quantize(items, 32, "fullrange", "static", 128, 0.01, 2, batched=True))
    assert [k for k, (a, b) in enumerate(zip(moved, _bytes(per_chunk))) if a != b] == [3]


def test_a_gpu_group_is_a_share_of_the_gpu_not_the_host_budget(monkeypatch):
    assert streamed.expert_budget("cpu", 123) == 123

    class Props:
        total_memory = 100 << 30

    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: seen.append(str(d)) or Props())
    assert streamed.expert_budget("cuda:1", 123) == int((100 << 30) * streamed.GPU_EXPERT_SHARE)
    assert seen == ["cuda:1"]  # that GPU's, its total (not what is free: the same groups every run)


def test_rtn_on_cuda_is_refused_in_one_line_before_anything_is_written(tiny, tmp_path, monkeypatch):
    from quantize.convert import convert

    src = tiny("glm_moe_dsa")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU node
    out = tmp_path / "out"
    for kw, what in (({}, "--method rtn"), ({"observer": "fullrange"}, "--method rtn"),
                     ({"scheme": "fp8-block"}, "--scheme fp8-block")):
        try:
            convert(src, out, device="cuda", **kw)
        except QuantizeError as e:
            msg = str(e)
        else:
            raise AssertionError(f"{what} on cuda was not refused")
        assert "\n" not in msg and msg.startswith(f"--device cuda: {what} streams each tensor once")
        assert "drop --device" in msg and not out.exists()


def test_deterministic_kernels_only_on_a_gpu_and_restored_after_an_error(monkeypatch):
    from quantize.methods.forward import deterministic

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    with deterministic("cpu"):
        assert torch.are_deterministic_algorithms_enabled() == before[0]  # the CPU's pass: nothing changed
    assert "CUBLAS_WORKSPACE_CONFIG" not in __import__("os").environ
    try:
        with deterministic("cuda:0"):
            assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
            assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
            raise RuntimeError("a layer failed")
    except RuntimeError:
        pass
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == before


def test_token_chunks_are_a_fixed_partition_of_consecutive_samples():
    assert streamed.token_chunks([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    assert streamed.token_chunks([3, 3, 3, 3], 5) == [[0], [1], [2], [3]]  # one token short of two: one each
    assert streamed.token_chunks([9, 1, 1], 4) == [[0], [1, 2]]  # a sample over the limit stands alone
    assert streamed.token_chunks([], 4) == []


def test_gpu_outputs_add_each_tokens_experts_as_the_per_sample_path(tmp_path):
    """The GPU's way of computing a group's outputs (samples concatenated, one product per expert),
    run here on the CPU, against the per-sample ``accumulate``: the same sums per token, in the same
    expert order, onto the same accumulators carried across groups."""
    from quantize.calibrate.experts import Routed, accumulate
    from quantize.methods.forward import Captured
    from quantize.methods.store import Budget, HiddenStore

    g = torch.Generator().manual_seed(0)
    h, i, experts, k = 32, 16, 6, 2
    gu = torch.randn(experts, 2 * i, h, generator=g) * 0.1
    dn = torch.randn(experts, h, i, generator=g) * 0.1
    cap = Captured(HiddenStore(Budget(1 << 30), tmp_path, "x"))
    for t in (5, 7, 1, 9):
        idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
        cap.append(Routed(torch.randn(t, h, generator=g), idx, torch.rand(t, k, generator=g)))
    act = torch.nn.functional.silu
    want = [torch.zeros(cap.index[s].shape[0], h) for s in range(len(cap))]
    for grp in (range(0, 4), range(4, 6)):  # two groups, the accumulators carried from the first
        for s in range(len(cap)):
            accumulate(want[s], cap[s], grp, gu[grp.start: grp.stop], dn[grp.start: grp.stop], act)
    v = streamed.Variant(cap, streamed.source_weights, streamed._zeros_like(cap.hidden, Budget(1 << 30), tmp_path, "a"))
    old = streamed.GPU_OUTPUT_TOKENS
    try:
        streamed.GPU_OUTPUT_TOKENS = 13  # chunks of samples [0, 1, 2] (5 + 7 + 1 tokens) and [3] (9)
        for grp in (range(0, 4), range(4, 6)):
            streamed._outputs_on_gpu(v, grp, gu[grp.start: grp.stop], dn[grp.start: grp.stop], act, "cpu")
    finally:
        streamed.GPU_OUTPUT_TOKENS = old
    got = [v.acc[s] for s in range(len(cap))]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # products of other row counts: last bits may move
    # not vacuous: the second group's experts left out leave the sums short
    v2 = streamed.Variant(cap, streamed.source_weights, streamed._zeros_like(cap.hidden, Budget(1 << 30), tmp_path, "b"))
    streamed._outputs_on_gpu(v2, range(0, 4), gu[:4], dn[:4], act, "cpu")
    assert not all(torch.allclose(v2.acc[s], want[s], rtol=1e-5, atol=1e-6) for s in range(len(cap)))


NEAR_TIES = 0.01  # the share of a layer's routed pairs that may move to another expert between two ways


def _moved(a: dict, b: dict) -> float:
    """The share of a layer's routed (token, expert) pairs that two runs routed to other experts:
    ``tokens_per_expert`` records, whose totals must agree (every token goes to its top-k)."""
    ca, cb = a["counts"], b["counts"]
    assert ca.keys() == cb.keys()
    total = sum(sum(v) for v in cb.values())
    assert sum(sum(v) for v in ca.values()) == total
    return sum(abs(x - y) for m in ca for x, y in zip(ca[m], cb[m])) / 2 / total


def test_the_routing_check_tells_a_near_tie_from_a_wrong_routing():
    """The bound above by hand: one pair of 1,452 moved (what a near-tie does) passes; one expert's
    whole share sent elsewhere (81 of 1,452, what a dropped or mis-sorted top-k does) does not."""
    cpu = {"counts": {"mlp.experts": [82, 186, 292, 61, 77, 303, 144, 307]}}
    tie = {"counts": {"mlp.experts": [81, 186, 293, 61, 77, 303, 144, 307]}}
    wrong = {"counts": {"mlp.experts": [0, 186, 374, 61, 77, 303, 144, 307]}}
    assert _moved(tie, cpu) == pytest.approx(1 / 1452) and _moved(tie, cpu) <= NEAR_TIES
    assert _moved(wrong, cpu) == pytest.approx(82 / 1452) and _moved(wrong, cpu) > NEAR_TIES


@pytest.mark.parametrize("asym", [0.0, 0.5])
def test_the_gpu_branches_run_end_to_end_on_the_cpu(tiny, tmp_path, monkeypatch, asym):
    """The GPU's ways (samples batched through a group's experts for Hessians and outputs, GPTQ's
    units stacked into one call) forced on the CPU through a whole GPTQ convert: the same fallbacks
    as the CPU's way, the same routing up to near-ties, each layer's error within 10 % of it, most
    codes the same. The other product blocking moves last bits, GPTQ's error feedback other roundings
    after them, and a later layer's router can then flip a near-tie: on an AMD EPYC (AVX-512, no AMX)
    one of layer 2's 1,452 routed pairs moved to another expert; on the AMX machines before it, none did.
    ``asym``: with --asym the source stream's expert inputs are batched beside them."""
    import json

    from quantize.convert import convert

    from .conftest import load_dir, method_layers

    src = tiny("deepseek_v3")
    cal = dict(method="gptq", observer="fullrange", samples=8, seq_len=96, workers=1, asym=asym)
    convert(src, tmp_path / "cpu", **cal)
    monkeypatch.setattr(streamed, "batched", lambda dev: True)
    monkeypatch.setattr(streamed, "GPU_OUTPUT_TOKENS", 200)  # several chunks of samples
    real = gptq.quantize
    monkeypatch.setattr(gptq, "quantize", lambda *a, **k: real(*a, **{**k, "batched": True}))
    convert(src, tmp_path / "gpu-way", **cal)
    a, b = method_layers(tmp_path / "gpu-way"), method_layers(tmp_path / "cpu")
    routed = [(x.get("tokens_per_expert"), y.get("tokens_per_expert")) for x, y in zip(a, b)]
    assert len(a) == len(b) and any(ra for ra, _ in routed)
    for ra, rb in routed:
        assert (ra is None) == (rb is None)
        if ra is not None:
            assert _moved(ra, rb) <= NEAR_TIES, (ra, rb)
    assert [x.get("fallbacks") for x in a] == [x.get("fallbacks") for x in b]
    for x, y in zip(a, b):
        if x.get("units"):
            assert abs(x["rel_err"] - y["rel_err"]) <= 0.1 * y["rel_err"], (x, y)
    ta, tb = load_dir(tmp_path / "gpu-way"), load_dir(tmp_path / "cpu")
    packed = [k for k in tb if k.endswith("weight_packed")]
    same = sum(int((ta[k] == tb[k]).sum()) for k in packed) / sum(tb[k].numel() for k in packed)
    assert same >= 0.5  # int32 words of 8 codes each: a word equal only where all 8 are
    assert json.loads((tmp_path / "gpu-way" / "quantize_manifest.json").read_text())["method"]["method"] == "gptq"


class _TwoRanks:
    """Rank 1 of two, in one process: ``gather`` hands it rank 0's part (as the real exchange would after
    pickling: CPU tensors) where it is the destination, and None elsewhere."""

    size, rank = 2, 1

    def __init__(self, rank0_parts: dict):
        self.rank0_parts = rank0_parts  # destination rank -> what rank 0 sends it

    def gather(self, obj, what, *, to=None):
        if to is None:  # the counts, on every rank
            return [{"n": {"q_proj": 2}, "tokens": {"q_proj": 6}}, obj]
        return [self.rank0_parts[to], obj] if to == self.rank else None


def test_a_rank_without_samples_gets_its_units_hessians_on_the_layers_device():
    """With more ranks than sample shards (--nproc 9 and up, or --samples below --nproc) a rank holds no
    sample, so no Hessian of its own to read a device from, yet it runs the GPTQ of the units it is
    given, whose weights are on the layer's GPU. The Hessians it receives go to that device, not stay on
    the CPU they travelled on (which fails only where the layer is not on the CPU). Here the layer's
    device is ``meta``: a stand-in a CPU run can tell from the CPU."""
    h = torch.eye(4) * 3
    hooks = gptq.Hessians(torch.nn.Linear(4, 4), [], all_experts=False, samples=2)
    world = _TwoRanks({1: [((0, hooks.shards), {"q_proj": h})]})
    hooks.combine(world, "layer 0 Hessians", {"q_proj": 1}, device=torch.device("meta"))
    assert hooks.H["q_proj"].device.type == "meta" and hooks.H["q_proj"].shape == (4, 4)
    assert hooks.n == {"q_proj": 2} and hooks.tokens == {"q_proj": 6}
    # a rank that holds samples keeps its Hessians where they are (its own device) and adds the others'
    hooks = gptq.Hessians(torch.nn.Linear(4, 4), [], all_experts=False, samples=2)
    hooks.tree.add(1, {"q_proj": h.clone()})
    world = _TwoRanks({1: [((0, 1), {"q_proj": h.clone()})]})  # sums add in place: each its own tensor
    hooks.combine(world, "layer 0 Hessians", {"q_proj": 1}, device=torch.device("cpu"))
    assert torch.equal(hooks.H["q_proj"], torch.eye(4) * 6)
