"""The GPU path of the data-aware methods, as far as a CPU can prove it: the batched GPTQ call a
GPU makes is byte-identical to the CPU's per-chunk path; the expert groups' budget on a GPU; RTN
on --device cuda refused in one line. What needs a GPU is in tests/test_gpu.py (``gpu`` marker)."""

from __future__ import annotations

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
    return [(r.codes.numpy().tobytes(), r.scale.view(torch.int16).numpy().tobytes(), fb) for r, fb, _ in res]


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
    for kw in ({}, {"observer": "fullrange"}):
        try:
            convert(src, out, device="cuda", **kw)
        except QuantizeError as e:
            msg = str(e)
        else:
            raise AssertionError("RTN on cuda was not refused")
        assert "\n" not in msg and msg.startswith("--device cuda: --method rtn streams each tensor once")
        assert "drop --device" in msg and not out.exists()
