"""W4A16 kernels on the compressed-tensors layout against compressed-tensors' own unpacking and
dequantization (``unpack_from_int32`` + ``dequantize``), not against our own unpack.

Where no GPU is visible (CI) conftest sets TRITON_INTERPRET=1 and the Triton kernels run in Triton's
interpreter on the CPU; torch's CUDA INT4 GEMM cannot run there, so its repack is checked through the
CPU twin of that GEMM. On a GPU node the same kernels run on the GPU (``pytest -m gpu``) and the
interpreted tests skip, each with its reason. Every kernel test has a near miss that must fail."""

import os

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize

from quantize.formats import int4
from quantize.kernels import cuda_int4, moe
from quantize.kernels.availability import triton_available
from quantize.kernels.cpu import CpuW4A16
from quantize.kernels.reference import dequant_fp32

SHAPES = [(256, 512, 32), (128, 256, 128), (192, 384, 64)]
TOL = 5e-3  # a bf16 output against the fp32 reference (relative L2)
MOE_TOL = 2e-2  # a whole layer, bf16 between its GEMMs (quantize.check.MOE_RTOL)
MISS = 0.1  # a near miss is off by far more than rounding (20x TOL)

HAVE_TRITON, NO_TRITON = triton_available()
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="TRITON_INTERPRET is not 1 (conftest sets it only where no GPU is visible; the gpu tests run "
           "these kernels on the GPU there)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU node)")


def _weights(n, k, g, seed=0):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    return int4.quantize_pack(w, g)


def _ct_dequant(r, n, k, g) -> torch.Tensor:
    """What compressed-tensors' PackedQuantizationCompressor.decompress computes from the packed
    words: its unpack, then its dequantize with the scheme we write (bf16)."""
    q = unpack_from_int32(r.packed, 4, torch.Size((n, k)))
    return dequantize(q, r.scale, None, QuantizationArgs.model_validate(int4.weights_args(g)))


def _ct_reference(x, r, n, k, g) -> torch.Tensor:
    """x @ W.T in fp32 with W as compressed-tensors decompresses it."""
    return x.float() @ _ct_dequant(r, n, k, g).float().t()


def _rel(y, ref) -> float:
    return float((y.float().cpu() - ref).norm() / ref.norm())


def _nibbles_reversed(packed: torch.Tensor) -> torch.Tensor:
    """A near miss of the layout: the 8 nibbles of every word in the opposite order."""
    out = torch.zeros_like(packed)
    for i in range(8):
        out |= ((packed >> (4 * i)) & 0xF) << (4 * (7 - i))
    return out


@pytest.mark.parametrize("n,k,g", SHAPES)
def test_reference_equals_compressed_tensors_decompression(n, k, g):
    r = _weights(n, k, g)
    q = unpack_from_int32(r.packed, 4, torch.Size((n, k)))
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    assert torch.equal(int4.unpack_int4(r.packed, k), q)
    theirs = _ct_dequant(r, n, k, g)
    assert theirs.dtype == torch.bfloat16 and theirs.shape == (n, k)
    assert torch.equal(dequant_fp32(r.packed, r.scale, (n, k)).to(torch.bfloat16), theirs)
    assert torch.equal(int4.dequantize_int4(r.packed, r.scale, (n, k)), theirs)


@pytest.mark.parametrize("n,k,g", SHAPES)
@pytest.mark.parametrize("m", [1, 8, 33])
def test_cpu_kernel(n, k, g, m):
    r = _weights(n, k, g)
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = _ct_reference(x, r, n, k, g)
    y = CpuW4A16.from_packed(r.packed, r.scale, (n, k))(x).float()
    assert _rel(y, ref) < TOL
    # a wrong nibble order would not pass
    bad = CpuW4A16.from_packed(r.packed.flip(1), r.scale, (n, k))(x).float()
    assert _rel(bad, ref) > 0.5


# ---- torch's CUDA INT4 GEMM: the repack, through its CPU twin ----

@pytest.mark.parametrize("n,k,g", SHAPES)
def test_int4pack_bytes_are_compressed_tensors_nibbles(n, k, g):
    """torch's uint8 [N, K/2] (element 2p high nibble, 2p+1 low) read back is compressed-tensors'
    unpack plus 8, element for element; the bytes without the nibble swap are not."""
    r = _weights(n, k, g)
    b = cuda_int4.to_int4pack_bytes(r.packed, k)
    assert b.dtype == torch.uint8 and b.shape == (n, k // 2)
    theirs = unpack_from_int32(r.packed, 4, torch.Size((n, k))).to(torch.int32) + 8
    assert torch.equal(cuda_int4.int4pack_bytes_to_nibbles(b), theirs)
    # torch's own test helper packs exactly so (common_quantization._group_quantize_tensor, on a GPU)
    assert torch.equal(b, (theirs[:, ::2] << 4 | theirs[:, 1::2]).to(torch.uint8))
    raw = r.packed.contiguous().view(torch.uint8)  # near miss: compressed-tensors' bytes as they are
    assert not torch.equal(cuda_int4.int4pack_bytes_to_nibbles(raw), theirs)


@pytest.mark.parametrize("n,k,g", SHAPES)
@pytest.mark.parametrize("m", [1, 17])
def test_int4pack_repack_through_cpu_twin(n, k, g, m):
    """The repacked nibbles and scales_and_zeros through torch's CPU INT4 GEMM equal the reference;
    a near miss (scales not transposed to [K/g, N, 2]) does not."""
    r = _weights(n, k, g)
    assert cuda_int4.applies((n, k), g) == (True, "")
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = _ct_reference(x, r, n, k, g)
    assert _rel(cuda_int4.cpu_twin(r.packed, r.scale, (n, k))(x), ref) < TOL
    nib = cuda_int4.int4pack_bytes_to_nibbles(cuda_int4.to_int4pack_bytes(r.packed, k))
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nib, 1)
    s = r.scale.to(torch.bfloat16)
    wrong = torch.stack([s.reshape(-1, n), torch.zeros(k // g, n, dtype=torch.bfloat16)], -1).contiguous()
    bad = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, g, wrong)
    assert _rel(bad, ref) > MISS


def test_int4pack_applies():
    assert cuda_int4.applies((6144, 2048), 32, (9, 0)) == (True, "")
    assert cuda_int4.applies((512, 7168), 128) == (True, "")
    assert cuda_int4.inner_k_tiles(256) == 8 and cuda_int4.inner_k_tiles(96) == 2
    for shape, g, cap, why in [((4096, 6144), 32, (7, 5), "8.0"), ((4096, 6144), 16, None, "group 16"),
                               ((4100, 6144), 32, None, "N 4100"), ((4096, 6160), 16, None, "group"),
                               ((4096, 6144 + 32), 96, None, "group 96"), ((4096, 80), 40, None, "group 40")]:
        ok, msg = cuda_int4.applies(shape, g, cap)
        assert not ok and why in msg, (shape, g, msg)
    assert cuda_int4.applies((64, 32 * 3), 32) == (True, "")  # K 96: innerKTiles 2


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,g", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 33])
def test_int4pack_cuda(n, k, g, m):
    r = _weights(n, k, g)
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = _ct_reference(x, r, n, k, g)
    y = cuda_int4.CudaW4A16.from_packed(r.packed.cuda(), r.scale.cuda(), (n, k))(x.cuda())
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < TOL
    bad = cuda_int4.CudaW4A16.from_packed(_nibbles_reversed(r.packed).cuda(), r.scale.cuda(), (n, k))(x.cuda())
    assert _rel(bad, ref) > MISS


# ---- split-K Triton W4A16 ----

def _configs():
    from quantize.kernels.triton_w4a16 import Config

    # GEMV path (BLOCK_M 1), split 1 and 3; tl.dot path, split 1 and 4, BLOCK_K below and above the group
    return [None, Config(1, 32, 64, 3), Config(16, 64, 64, 1), Config(16, 32, 128, 4), Config(32, 64, 32, 2)]


def _split_k_case(n, k, g, m, device):
    from quantize.kernels.triton_w4a16 import w4a16_triton

    r = _weights(n, k, g)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = _ct_reference(x, r, n, k, g)
    p, s, xd = r.packed.to(device), r.scale.to(device), x.to(device)
    for cfg in _configs():
        if cfg is not None and cfg.block_m == 1 and m > 3 and device == "cpu":
            continue  # one program per row: slow in the interpreter, and the same code as m 1..3
        y = w4a16_triton(xd, p, s, (n, k), cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert _rel(y, ref) < TOL, cfg
        if cfg is not None and cfg.split_k > 1:  # the split-K reduction is deterministic
            assert torch.equal(w4a16_triton(xd, p, s, (n, k), cfg), y)
    # near misses: nibbles in the wrong order; the scale of the wrong group (transposed groups)
    assert _rel(w4a16_triton(xd, _nibbles_reversed(r.packed).to(device), s, (n, k)), ref) > MISS
    shifted = s.roll(1, dims=1)
    assert _rel(w4a16_triton(xd, p, shifted, (n, k)), ref) > MISS


@needs_triton
@interpreted
@pytest.mark.parametrize("n,k,g", [(128, 512, 32), (96, 200, 40), (128, 256, 128)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_split_k_triton_interpreted(n, k, g, m):
    """Split-K W4A16, run by Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1 before
    triton is imported where no GPU is visible): fp32 dot and output there, bf16 on a GPU."""
    _split_k_case(n, k, g, m, "cpu")


@needs_triton
@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,g", [(256, 512, 32), (96, 200, 40), (128, 256, 128), (4096, 6144, 32), (512, 256, 32)])
@pytest.mark.parametrize("m", [1, 3, 16, 64, 257])
def test_split_k_triton_cuda(n, k, g, m):
    _split_k_case(n, k, g, m, "cuda")


def test_split_k_config_heuristic(monkeypatch):
    from quantize.kernels import triton_w4a16 as tw
    from quantize.kernels.triton_w4a16 import default_config, k_per_split

    assert default_config(1, 512, 7168) == tw.TUNED[(512, 7168, 1)]  # a measured shape: the H200 sweep's winner
    assert default_config(9, 512, 7168) == tw.TUNED[(512, 7168, 16)]  # M 2..16 share a bucket
    monkeypatch.setattr(tw, "TUNED", {})  # the heuristic, for a shape never measured
    c = default_config(1, 512, 7168, sms=132)  # Kimi gate/up at TP8, decode
    per, split = k_per_split(7168, c.split_k, c.block_k)
    assert c.block_m == 1 and per % c.block_k == 0 and (512 // c.block_n) * split >= 132  # a program or more per SM
    assert default_config(16, 4096, 6144).block_m == 16 and default_config(256, 4096, 6144).split_k >= 1
    assert k_per_split(200, 3, 64) == (128, 2)  # splits rounded to BLOCK_K; empty ones dropped


# ---- fused MoE W4A16 ----

def _experts(e, n, k, g, seed):
    rs = [_weights(n, k, g, seed=seed * 100 + i) for i in range(e)]
    return torch.stack([r.packed for r in rs]), torch.stack([r.scale for r in rs])


def _moe_inputs(e, h, i, t, topk, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, s13 = _experts(e, 2 * i, h, g, seed + 1)
    w2, s2 = _experts(e, h, i, g, seed + 2)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.rand(t, e, generator=gen).argsort(-1)[:, :topk]
    wts = torch.softmax(torch.randn(t, topk, generator=gen), -1)
    return x, ids, wts, w13, s13, w2, s2


@pytest.mark.parametrize("t,topk,e,bm", [(5, 2, 4, 16), (9, 2, 4, 4), (3, 3, 8, 1), (1, 8, 8, 16)])
def test_moe_align(t, topk, e, bm):
    ids = torch.rand(t, e, generator=torch.Generator().manual_seed(t)).argsort(-1)[:, :topk]
    sorted_ids, expert_ids, npost = moe.moe_align(ids, bm, e)
    flat = ids.reshape(-1)
    n = int(npost)
    assert sorted_ids.numel() == expert_ids.numel() * bm and n % bm == 0 and n <= sorted_ids.numel()
    real = sorted_ids[sorted_ids < t * topk]
    assert sorted(real.tolist()) == list(range(t * topk))  # every pair once
    assert bool((sorted_ids[n:] == t * topk).all())
    for b in range(n // bm):
        blk = sorted_ids[b * bm:(b + 1) * bm]
        blk = blk[blk < t * topk]
        assert len(blk) and bool((flat[blk.long()] == expert_ids[b]).all())  # one expert per block
        assert blk.tolist() == sorted(blk.tolist())  # the pairs keep their order within an expert


def test_moe_reference_is_transformers_math():
    """The reference equals a direct computation of DeepseekV3's experts (per pair: down(silu(gate)
    * up) times its weight, summed over top-k); the CPU per-expert path agrees within bf16."""
    x, ids, wts, w13, s13, w2, s2 = _moe_inputs(4, 64, 32, 6, 2, 32)
    ref = moe.moe_reference(x, ids, wts, w13, s13, w2, s2)
    g13, g2 = moe.dequant_stack(w13, s13, 64), moe.dequant_stack(w2, s2, 32)
    direct = torch.zeros(6, 64)
    for t in range(6):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (x[t].float() @ g13[e].t()).chunk(2)
            direct[t] += wts[t, j] * (torch.nn.functional.silu(gate) * up) @ g2[e].t()
    assert torch.allclose(direct, ref, rtol=1e-5, atol=1e-6)
    assert _rel(moe.moe_layer_cpu(x, ids, wts, w13, s13, w2, s2), ref) < MOE_TOL


def _moe_case(device, cases):
    from quantize.kernels.triton_moe import moe_layer
    from quantize.kernels.triton_w4a16 import Config

    for (e, h, i, t, topk, g), configs in cases:
        x, ids, wts, w13, s13, w2, s2 = _moe_inputs(e, h, i, t, topk, g)
        ref = moe.moe_reference(x, ids, wts, w13, s13, w2, s2)
        d = [a.to(device) for a in (x, ids, wts, w13, s13, w2, s2)]
        for c in configs:
            cfg = None if c is None else Config(*c)
            y = moe_layer(*d, config13=cfg, config2=cfg)
            assert y.shape == (t, h) and y.dtype == torch.bfloat16
            assert _rel(y, ref) < MOE_TOL, (e, h, i, t, topk, g, cfg)
            if cfg is not None and cfg.split_k > 1:
                assert torch.equal(moe_layer(*d, config13=cfg, config2=cfg), y)
        # near misses: the nibbles of gate_up reversed; down's scales transposed across experts;
        # the router's weights applied to the wrong slots
        xd, idd, wd, w13d, s13d, w2d, s2d = d
        assert _rel(moe_layer(xd, idd, wd, _nibbles_reversed(w13).to(device), s13d, w2d, s2d), ref) > MISS
        assert _rel(moe_layer(xd, idd, wd, w13d, s13d, w2d, s2d.roll(1, dims=0)), ref) > MISS
        assert _rel(moe_layer(xd, idd, wd.flip(1), w13d, s13d, w2d, s2d), ref) > 0.05


@needs_triton
@interpreted
def test_fused_moe_interpreted():
    """All experts in one launch per GEMM, in Triton's interpreter: E=4, groups of 32, T 5..9 tokens,
    top-2, against the fp32 reference of the layer; tl.dot and GEMV paths, split-K."""
    _moe_case("cpu", [((4, 128, 64, 5, 2, 32), [None, (16, 64, 64, 2), (1, 64, 128, 1)]),
                      ((4, 64, 128, 9, 2, 32), [(16, 128, 32, 1), (32, 64, 64, 3)])])


@needs_triton
@needs_cuda
@pytest.mark.gpu
def test_fused_moe_cuda():
    _moe_case("cuda", [((4, 128, 64, 5, 2, 32), [None, (16, 64, 64, 2), (1, 64, 128, 1), (1, 32, 64, 3)]),
                       ((8, 256, 128, 33, 4, 32), [None, (16, 64, 64, 1), (32, 64, 128, 2), (64, 128, 64, 1)]),
                       ((8, 2048, 256, 1, 8, 32), [None, (1, 32, 256, 4), (16, 64, 128, 8)])])


# ---- check: one MoE layer of a written checkpoint through the fused kernel ----

def test_check_runs_a_moe_layer(converted):
    from quantize.check import MOE_RTOL, check

    rep = check(converted("glm_moe_dsa", group_size=32))
    assert rep.ok, rep.failures
    rec = rep.moe_layer
    assert rec and rec["experts"] >= 2 and rec["top_k"] >= 2 and rec["tokens"] >= 1, rec
    assert rep.to_dict()["moe_layer_rel_err"] == rec["rel_err"] < MOE_RTOL
    want = ("triton fused MoE (CUDA)" if torch.cuda.is_available() else
            "triton fused MoE (interpreted)" if HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1" else
            "torch int4 CPU GEMM per expert")
    assert rec["path"] == want


def test_check_fails_a_wrong_moe_kernel(converted, monkeypatch):
    """A near miss of the layer kernel (down's scales of the wrong expert) fails check, naming the layer."""
    import quantize.check as chk
    from quantize.kernels import moe as moe_mod

    real_cpu = moe_mod.moe_layer_cpu

    def wrong(x, ids, w, w13, s13, w2, s2, *a, **kw):
        return real_cpu(x.cpu(), ids.cpu(), w.cpu(), w13.cpu(), s13.cpu(), w2.cpu(), s2.roll(1, dims=0).cpu())

    monkeypatch.setattr(moe_mod, "moe_layer_cpu", wrong)
    if HAVE_TRITON:
        import quantize.kernels.triton_moe as tm

        monkeypatch.setattr(tm, "moe_layer", wrong)
    rep = chk.check(converted("glm_moe_dsa", group_size=32))
    assert not rep.ok and rep.moe_layer["rel_err"] > chk.MOE_RTOL
    assert any("MoE layer" in f and "differs from the reference" in f for f in rep.failures), rep.failures


# ---- scripts/bench_kernels.py: the GPU bench's code, dry ----

@needs_triton
@interpreted
def test_bench_dry_run(tmp_path):
    """The GPU bench's code path (sweeps, reference checks, fused MoE, JSON) on tiny shapes with the
    kernels interpreted and tinygemm's CPU twin, so the one run on a GPU does not die of a typo."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(root / "scripts" / "bench_kernels.py"), "--dry-run", "--m", "1", "16",
                        "--models", "GLM-5", "--max-configs", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "!!" not in p.stdout, p.stdout  # no config failed its reference check
    d = json.loads(out.read_text())
    assert len(d["rows"]) == 8 and len(d["tuned"]) == 8
    for r in d["rows"]:
        assert r["splitk"]["best"]["rel_err"] < 1e-2 and r["moe"]["best"]["rel_err"] < 1e-2, r
        assert r["tinygemm"]["rel_err"] < 1e-2 and r["dense_status"] in ("PASS", "MISS")
        if r["m"] != 1:
            assert r["staging"] == {"splitk": None, "moe": None}  # the staging pair is the M=1 sweep's
            continue
        # the staging ratio and the weight rate, recomputed here from the times the bench recorded
        for kind, tried in (("splitk", r["splitk"]["tried"]), ("moe", r["moe"]["tried"])):
            t = {p: min(x["us"] for x in tried if x["name"].startswith("m1n16k512s") and x["name"].endswith(p))
                 for p in ("w4p3", "w4p1")}
            assert r["staging"][kind] == pytest.approx(t["w4p1"] / t["w4p3"], rel=1e-12)
        n, k = r["n"], r["k"]
        int4_bytes = n * k // 2 + n * (k // 32) * 2
        assert r["weight_gbps"]["splitk"] == pytest.approx(int4_bytes / r["splitk"]["best"]["us"] / 1e3, rel=1e-12)
        experts = r["moe"]["experts"]  # 2 in the dry run
        assert r["weight_gbps"]["moe"] == pytest.approx(experts * int4_bytes / r["moe"]["best"]["us"] / 1e3, rel=1e-12)
    assert "STAGING splitk: the M=1 K loop's loads staged" in p.stdout


# ---- kernels/aot.py: every shipped config built for sm90 here, without a GPU ----

def _aot_missing() -> str | None:
    if not HAVE_TRITON:
        return NO_TRITON
    from quantize.kernels import aot

    return aot.missing()


needs_aot = pytest.mark.skipif(_aot_missing() is not None, reason=str(_aot_missing()))
SM90_BLOCK_SHARED = 227 * 1024  # the most shared memory one block may have on sm90 (CUDA C++ Programming Guide)


def _aot(*args: str):
    """``python -m quantize.kernels.aot --json ARGS`` without the interpreter (it replaces the JIT kernels)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "quantize.kernels.aot", "--json", *args], capture_output=True,
                       text=True, timeout=600, env=env)
    return p, (json.loads(p.stdout) if p.stdout.strip() else [])


def _compile_key(kind: str, config: str) -> tuple[str, str, bool]:
    """A config's compile: its name without the number of K splits, and whether K is split at all (an
    fp32 workspace or the bf16 output)."""
    import re

    split = int(re.search(r"s(\d+)", config).group(1))
    return kind, re.sub(r"s\d+", "", config), split > 1


@needs_aot
def test_every_shipped_kernel_config_builds_for_sm90():
    """Each distinct compile of TUNED, MOE_TUNED and the heuristics' tiles, built for sm90 by the JIT's own
    specialization and Triton's ptxas: none fails, spills or needs more shared memory than a block may
    have. A GPU lease then never meets a kernel that does not build."""
    from quantize.kernels.triton_moe import MOE_TUNED
    from quantize.kernels.triton_w4a16 import TUNED, heuristic_tiles

    p, recs = _aot()
    assert p.returncode == 0, p.stderr[-3000:]
    built = {_compile_key(r["kind"], r["config"]) for r in recs}
    # what must be among them, listed here from the tables and the heuristic: every measured entry's
    # compile, and each M bucket's heuristic tile with one split and with several
    want = {_compile_key("splitk", str(c)) for c in TUNED.values()} | \
        {_compile_key("moe", str(c)) for c in MOE_TUNED.values()}
    for m in (1, 16, 64, 256):
        tile = "m{}n{}k{}s{{}}w{}p{}".format(*heuristic_tiles(m, 4096))
        want |= {_compile_key(kind, tile.format(split)) for kind in ("splitk", "moe") for split in (1, 2)}
    assert want <= built, sorted(want - built)
    assert len(built) == len(recs)  # each compile once
    for r in recs:
        assert r["error"] is None and r["regs"] > 0 and r["spill_bytes"] == 0, r
        assert 0 < r["shared_bytes"] <= SM90_BLOCK_SHARED and r["programs_per_sm"] >= 1, r
        assert r["loop_ops"] > 0, r  # the K loop was found in the SASS


@needs_aot
def test_aot_flags_spills_and_shared_memory_and_reads_staging():
    """Near misses the shipped check must catch: a GEMV tile too large for registers (it spills) and a
    dot tile one stage over the shared memory a block may have (the same tile one stage fewer builds).
    And the SASS reading: both paths' K loops stage their loads (cp.async) from num_stages 2 on, and with
    num_stages 1 they do not."""
    p, recs = _aot("--config", "splitk", "4096", "6144", "1", "m1n256k1024s1w4p3",
                   "--config", "splitk", "4096", "6144", "256", "m128n256k128s1w8p4",
                   "--config", "splitk", "4096", "6144", "256", "m128n256k128s1w8p3")
    assert p.returncode == 1
    spill, over, fits = recs
    assert spill["spill_bytes"] > 0 and "aot: splitk m1n256k1024s1w4p3 (N=4096 K=6144 M=1): spills" in p.stderr
    assert over["spill_bytes"] == 0 and over["shared_bytes"] > SM90_BLOCK_SHARED and over["programs_per_sm"] == 0
    assert f"needs {over['shared_bytes']} bytes of shared memory" in p.stderr
    assert fits["shared_bytes"] <= SM90_BLOCK_SHARED and "m128n256k128s1w8p3" not in p.stderr
    p, recs = _aot("--config", "splitk", "4096", "6144", "16", "m16n64k128s1w4p1",
                   "--config", "splitk", "4096", "6144", "16", "m16n64k128s1w4p4",
                   "--config", "moe", "4096", "6144", "1", "m1n16k512s1w4p1",
                   "--config", "moe", "4096", "6144", "1", "m1n16k512s1w4p3")
    assert p.returncode == 0, p.stderr[-3000:]
    dot1, dot4, gemv1, gemv3 = recs
    assert not dot1["async_copies"] and dot4["async_copies"]
    assert not gemv1["async_copies"] and gemv3["async_copies"]
    assert dot1["shared_bytes"] < dot4["shared_bytes"] and gemv1["shared_bytes"] < gemv3["shared_bytes"]
