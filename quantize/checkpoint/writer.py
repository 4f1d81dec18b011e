"""Streaming safetensors writer: the header is computed from the plan before any data exists, then
tensors are appended in order; the file lives under a temporary name until ``finish`` fsyncs and
renames it. A SHA-256 of the file is computed as the bytes go out: a chunk of ``HASH_BESIDE`` bytes or
more is hashed on the writer's own hashing thread while the same bytes are written (both release the
GIL), so a chunk costs the slower of the two rather than their sum. SHA-256 (1.7-1.8 GB/s on one
core with SHA-NI) and the page-cache copy (about 2.8 GB/s to tmpfs) are each about a core's work:
on a many-core node the writer, one thread in plan order, is what convert waits for.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import QuantizeError
from .index import itemsize, st_dtype

TMP_SUFFIX = ".partial"
COPY_CHUNK = 8 << 20
HASH_BESIDE = 1 << 20  # a chunk this big is hashed beside its write; a smaller one here (a thread hop costs more)


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def _header(entries: list[Entry], metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """The safetensors header and the data bytes after it (each entry's size computed once)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in sorted(metadata.items())}
    off = 0
    for e in entries:
        n = e.nbytes
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, off


def header_bytes(entries: list[Entry], metadata: dict[str, str] | None = None) -> bytes:
    return _header(entries, metadata)[0]


def file_size(entries: list[Entry], metadata: dict[str, str] | None = None) -> int:
    head, data = _header(entries, metadata)
    return len(head) + data


def _disk_full(path: Path, e: OSError) -> QuantizeError:
    from .output import rerun_hint

    return QuantizeError(
        f"{path}: no space left on the output disk; free space (the plan says how many bytes the "
        f"output needs) and {rerun_hint()}"
    )


class StreamWriter:
    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        self.entries = entries
        self._next = 0
        self._sha = hashlib.sha256()
        self._hasher: ThreadPoolExecutor | None = None  # made for the first big chunk
        self._fh = open(self.tmp, "wb")
        self.bytes_written = 0
        self._write(header_bytes(entries, metadata))

    def _write(self, data) -> None:
        """Write and hash ``data``; both are done when this returns (the caller may reuse the buffer)."""
        hashed = None
        if len(data) >= HASH_BESIDE:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256")
            hashed = self._hasher.submit(self._sha.update, data)
        try:
            self._fh.write(data)
        except OSError as e:
            if hashed is not None:
                hashed.result()
            self.abort()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _disk_full(self.path, e) from e
            raise QuantizeError(f"{self.tmp}: write failed ({e.strerror})") from e
        if hashed is None:
            self._sha.update(data)
        else:
            hashed.result()
        self.bytes_written += len(data)

    def _stop_hasher(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def _expect(self, name: str, nbytes: int) -> Entry:
        if self._next >= len(self.entries):
            raise RuntimeError(f"{self.path}: unexpected tensor {name} after the last planned one")
        e = self.entries[self._next]
        if e.name != name or e.nbytes != nbytes:
            raise RuntimeError(f"{self.path}: expected {e.name} ({e.nbytes} bytes), got {name} ({nbytes} bytes)")
        self._next += 1
        return e

    def write_tensor(self, name: str, t) -> None:
        import torch

        e = self._expect(name, t.numel() * t.element_size())
        if st_dtype(t.dtype) != e.dtype or tuple(t.shape) != e.shape:
            raise RuntimeError(f"{name}: planned {e.dtype}{list(e.shape)}, got {st_dtype(t.dtype)}{list(t.shape)}")
        t = t.contiguous()
        if t.numel():  # flat bytes: len() of the view is its byte count (a 2-D view's len is its rows)
            self._write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))

    def copy_bytes(
        self, name: str, src_fd: int, offset: int, nbytes: int, buf: bytearray | None = None, on_chunk=None
    ) -> None:
        """Copy a tensor's bytes verbatim from a source file in chunks (no tensor in memory)."""
        self._expect(name, nbytes)
        buf = buf if buf is not None else bytearray(min(COPY_CHUNK, max(nbytes, 1)))
        view = memoryview(buf)
        done = 0
        while done < nbytes:
            n = os.preadv(src_fd, [view[: min(len(buf), nbytes - done)]], offset + done)
            if n <= 0:
                raise QuantizeError(
                    f"source tensor {name}: short read at byte {offset + done}; the shard changed or is truncated"
                )
            if on_chunk is not None:
                on_chunk(view[:n])
            self._write(view[:n])
            done += n

    def close(self) -> str:
        """All planned tensors written: flush to the kernel; returns the file's SHA-256. The file
        is not durable (nor under its final name) until ``commit``."""
        if self._next != len(self.entries):
            raise RuntimeError(f"{self.path}: {len(self.entries) - self._next} planned tensors were not written")
        self._stop_hasher()
        try:
            self._fh.flush()
        except OSError as e:
            self.abort()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _disk_full(self.path, e) from e
            raise
        return self._sha.hexdigest()

    def commit(self) -> None:
        """fsync, rename to the final name, fsync the folder (may run on another thread)."""
        try:
            os.fsync(self._fh.fileno())
            self._fh.close()
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as e:
            self.abort()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _disk_full(self.path, e) from e
            raise

    def finish(self) -> str:
        sha = self.close()
        self.commit()
        return sha

    def abort(self) -> None:
        """Drop the temporary file. The handle is closed without flushing what is still buffered:
        after a failed write (disk full) a flush would fail again, and the bytes are discarded anyway."""
        self._stop_hasher()
        fh = self._fh
        if not fh.closed:
            try:
                fh.raw.close()  # the descriptor first: the buffered object then closes without a flush
                fh.close()
            except (OSError, ValueError):
                pass
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
