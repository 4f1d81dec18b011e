"""The streaming safetensors writer: the SHA-256 it returns is the file's (hashlib over the bytes read
back), whether a chunk was hashed beside its write or here, and its byte count is the file's size."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import quantize.checkpoint.writer as writer
from quantize.checkpoint.writer import Entry, StreamWriter
from quantize.errors import QuantizeError


REAL_SHA256 = hashlib.sha256


def _hashers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("sha256")]


def test_a_two_dimensional_byte_tensor_counts_its_bytes_not_its_rows(tmp_path):
    """A 2-D uint8 tensor's memoryview has len() == rows: the count (and the hash-beside threshold)
    must see its bytes."""
    t = torch.arange(3 * 1000, dtype=torch.int32).remainder(251).to(torch.uint8).reshape(3, 1000)
    path = tmp_path / "u8.safetensors"
    w = StreamWriter(path, [Entry("t", "U8", (3, 1000))])
    w.write_tensor("t", t)
    sha = w.finish()
    raw = path.read_bytes()
    assert w.bytes_written == len(raw) == 8 + struct.unpack("<Q", raw[:8])[0] + 3000
    assert sha == hashlib.sha256(raw).hexdigest()
    assert torch.equal(load_file(path)["t"], t)


class SlowSha:
    """A SHA-256 that takes its time and reads the bytes only at the end of each update, on the
    thread that calls it: a writer that returned before the hash was done would let the caller
    refill the buffer first, and the digest would be of other bytes."""

    threads: set[str] = set()

    def __init__(self):
        self._h = REAL_SHA256()

    def update(self, data) -> None:
        SlowSha.threads.add(threading.current_thread().name)
        if len(data) >= 64:
            time.sleep(0.01)
        self._h.update(bytes(data))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@pytest.mark.parametrize("beside", [64, 1 << 62], ids=["hashed-beside", "hashed-here"])
def test_the_digest_is_the_files_with_a_reused_copy_buffer(tmp_path, monkeypatch, beside):
    monkeypatch.setattr(writer, "HASH_BESIDE", beside)
    monkeypatch.setattr(writer.hashlib, "sha256", SlowSha)
    SlowSha.threads = set()
    src = tmp_path / "src.bin"
    payload = bytes((i * 7 + 3) % 256 for i in range(1000))
    src.write_bytes(payload)
    a = torch.randn(40, 33, dtype=torch.float32)
    b = torch.tensor([5], dtype=torch.int32)  # below any threshold: hashed here in both cases
    entries = [Entry("a", "F32", (40, 33)), Entry("copied", "U8", (1000,)), Entry("b", "I32", (1,))]
    path = tmp_path / "out.safetensors"
    w = StreamWriter(path, entries, {"k": "v"})
    w.write_tensor("a", a)
    fd = os.open(src, os.O_RDONLY)
    try:
        w.copy_bytes("copied", fd, 0, 1000, bytearray(96))  # 11 chunks through one 96-byte buffer
    finally:
        os.close(fd)
    w.write_tensor("b", b)
    sha = w.finish()
    raw = path.read_bytes()
    assert sha == REAL_SHA256(raw).hexdigest()
    assert w.bytes_written == len(raw)
    got = load_file(path)
    assert torch.equal(got["a"], a) and bytes(got["copied"].numpy()) == payload and torch.equal(got["b"], b)
    beside_threads = {n for n in SlowSha.threads if n.startswith("sha256")}
    assert bool(beside_threads) == (beside == 64), SlowSha.threads
    assert not _hashers()  # finish stopped the hashing thread


def test_a_failed_write_waits_for_its_hash_and_leaves_no_thread(tmp_path, monkeypatch):
    real_open = open
    monkeypatch.setattr(
        writer, "open", lambda p, mode="r", *a, **kw: real_open("/dev/full" if str(p).endswith(".partial") else p,
                                                                 mode, *a, **kw), raising=False
    )
    monkeypatch.setattr(writer, "HASH_BESIDE", 64)
    w = StreamWriter(tmp_path / "x.safetensors", [Entry("t", "U8", (1 << 20,))])
    with pytest.raises(QuantizeError, match="no space left"):
        w.write_tensor("t", torch.zeros(1 << 20, dtype=torch.uint8))
        w.finish()
    assert not _hashers()
    assert not list(tmp_path.iterdir())


def test_the_header_matches_the_plan(tmp_path):
    entries = [Entry("x", "BF16", (2, 4)), Entry("y", "F32", (3,))]
    path = tmp_path / "h.safetensors"
    w = StreamWriter(path, entries)
    w.write_tensor("x", torch.ones(2, 4, dtype=torch.bfloat16))
    w.write_tensor("y", torch.zeros(3))
    w.finish()
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    assert head["x"]["data_offsets"] == [0, 16] and head["y"]["data_offsets"] == [16, 28]
    assert len(raw) == 8 + n + 28 and n % 8 == 0
