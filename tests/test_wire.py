"""How an object travels between ranks (quantize/wire.py): its tensors as raw bytes in one buffer,
the rest pickled with references. The ranks themselves (gloo) are tests/test_distributed.py's
self-test; here the packing alone, in one process."""

import pickle

import torch

from quantize import wire
from quantize.distributed import _message, _same


def _roundtrip(obj):
    p = wire.pack(obj)
    return p, wire.unpack(p.skeleton, p.buffer() if p.size else None)


def test_every_kind_of_tensor_arrives_bit_for_bit_with_its_own_storage():
    for rank in (0, 1, 3):
        msg = _message(rank)
        p, got = _roundtrip(msg)
        assert _same(got, msg)
        assert got["part"].untyped_storage().nbytes() == 8 * 4  # not the sender's whole storage, not the buffer's
        assert got["big"].data_ptr() != msg["big"].data_ptr()
        assert type(got["param"]) is torch.nn.Parameter and got["strided"].stride() == (1, 6)


def test_the_bytes_go_into_the_buffer_and_only_references_into_the_pickle():
    big = torch.randn(1 << 20)  # 4 MiB
    p, got = _roundtrip({"x": big, "n": 3})
    assert p.size == 4 << 20 and len(p.skeleton) < 1000 < len(pickle.dumps(big)) // 1000
    assert torch.equal(got["x"], big) and got["n"] == 3
    # a tensor of other strides is pickled whole, into the skeleton; a Parameter's data goes raw, and it
    # arrives a Parameter
    p, got = _roundtrip([big.reshape(1024, 1024).t(), torch.nn.Parameter(torch.ones(3))])
    assert p.size == wire.ALIGN and len(p.skeleton) > 4 << 20
    assert got[0].stride() == (1, 1024) and type(got[1]) is torch.nn.Parameter and got[1].requires_grad
    assert not wire.travels_raw(big.reshape(1024, 1024).t()) and wire.travels_raw(big[5:9])


def test_offsets_are_aligned_for_every_dtype_and_a_flipped_byte_is_seen():
    msg = [torch.ones(3, dtype=torch.uint8), torch.arange(5, dtype=torch.float64), torch.ones(1, dtype=torch.bfloat16)]
    p = wire.pack(msg)
    assert p.size == 3 * wire.ALIGN
    buf = p.buffer()
    got = wire.unpack(p.skeleton, buf)
    assert _same(got, msg)
    buf[wire.ALIGN + 8] ^= 1  # the float64's second element
    bad = wire.unpack(p.skeleton, buf)
    assert _same(bad[0], msg[0]) and _same(bad[2], msg[2]) and not _same(bad[1], msg[1])
    assert not _same(bad, msg)


def test_a_message_without_tensors_needs_no_buffer_and_padding_is_never_read():
    p, got = _roundtrip({"a": [1, "two", (3.0,)]})
    assert p.size == 0 and got == {"a": [1, "two", (3.0,)]}
    p = wire.pack([torch.arange(4)])
    wide = p.buffer(10 * wire.ALIGN)
    assert wide.numel() == 10 * wire.ALIGN and torch.equal(wire.unpack(p.skeleton, wide)[0], torch.arange(4))


def test_a_tensor_named_twice_travels_once_and_arrives_as_one_and_empty_ones_stay_apart():
    t = torch.arange(1000, dtype=torch.float32)
    e1, e2 = torch.empty(0, 3), torch.empty(0, 5)
    p, got = _roundtrip({"a": t, "b": [t, e1], "c": e2, "d": torch.ones(4)})
    assert p.size == 4032 + wire.ALIGN  # t once (4000 bytes, padded to 64s), then d
    assert got["a"] is got["b"][0] and torch.equal(got["a"], t)
    assert got["b"][1].shape == (0, 3) and got["c"].shape == (0, 5) and got["b"][1] is not got["c"]
    assert torch.equal(got["d"], torch.ones(4))  # at the empty tensors' offset, its own bytes
