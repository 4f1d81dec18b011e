"""W4A16 kernels on the compressed-tensors layout against compressed-tensors' own unpacking and
dequantization (``unpack_from_int32`` + ``dequantize``), not against our own unpack."""

import os

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize

from quantize.formats import int4
from quantize.kernels.availability import triton_available
from quantize.kernels.cpu import CpuW4A16
from quantize.kernels.reference import dequant_fp32

SHAPES = [(256, 512, 32), (128, 256, 128), (192, 384, 64)]


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
    ref = _ct_reference(x, r, n, k, g)
    y = tw.w4a16_triton(x, r.packed, r.scale, (n, k), block_m=16, block_n=64, block_k=64).float()
    assert float((y - ref).norm() / ref.norm()) < 5e-3
