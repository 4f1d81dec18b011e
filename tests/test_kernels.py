"""W4A16 kernels on the compressed-tensors layout against the fp32 reference."""

import os

import pytest
import torch

from quantize.formats import int4
from quantize.kernels.availability import triton_available
from quantize.kernels.cpu import CpuW4A16
from quantize.kernels.reference import dequant_fp32, w4a16_reference

SHAPES = [(256, 512, 32), (128, 256, 128), (192, 384, 64)]


def _weights(n, k, g, seed=0):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    return int4.quantize_pack(w, g)


@pytest.mark.parametrize("n,k,g", SHAPES)
def test_reference_equals_compressed_tensors_decompression(n, k, g):
    r = _weights(n, k, g)
    ours = dequant_fp32(r.packed, r.scale, (n, k))
    assert torch.equal(ours.to(torch.bfloat16), int4.dequantize_int4(r.packed, r.scale, (n, k)))


@pytest.mark.parametrize("n,k,g", SHAPES)
@pytest.mark.parametrize("m", [1, 8, 33])
def test_cpu_kernel(n, k, g, m):
    r = _weights(n, k, g)
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = w4a16_reference(x, r.packed, r.scale, (n, k))
    y = CpuW4A16.from_packed(r.packed, r.scale, (n, k))(x).float()
    assert float((y - ref).norm() / ref.norm()) < 5e-3
    # a wrong nibble order would not pass
    bad = CpuW4A16.from_packed(r.packed.flip(1), r.scale, (n, k))(x).float()
    assert float((bad - ref).norm() / ref.norm()) > 0.5


ok, why = triton_available()


@pytest.mark.skipif(not ok, reason=why)
@pytest.mark.parametrize("n,k,g", SHAPES)
@pytest.mark.parametrize("m", [1, 17])
def test_triton_kernel_interpreted(n, k, g, m):
    """Fused unpack + dequant + matmul, run by Triton's interpreter on the CPU (conftest sets
    TRITON_INTERPRET=1 before triton is imported; bf16 tl.dot is broken in the interpreter, so the
    kernel multiplies in fp32 there and in bf16 on a GPU)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import quantize.kernels.triton_w4a16 as tw

    r = _weights(n, k, g)
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = w4a16_reference(x, r.packed, r.scale, (n, k))
    y = tw.w4a16_triton(x, r.packed, r.scale, (n, k), block_m=16, block_n=64, block_k=64).float()
    assert float((y - ref).norm() / ref.norm()) < 5e-3
