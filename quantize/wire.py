"""How an object travels between ranks (``World.gather`` / ``World.broadcast``): its tensors as raw
bytes in one host buffer, sent by the world's own backend (NCCL on GPUs: NVLink or the network, not
a TCP copy of a pickle; ``World`` moves it through the GPU a span at a time), and the rest of it
pickled with each tensor replaced by a reference (its dtype, shape and place in the buffer;
``pickle``'s ``persistent_id``), small enough for the gloo group whose timeout raises.

A tensor travels this way when it is a plain, contiguous, strided CPU or CUDA tensor without
autograd (a ``Parameter``, a view with other strides, a sparse or quantized tensor is pickled
whole, as before). It arrives with its own storage (never a view of the buffer), contiguous, on
the CPU when it was sent from the CPU and on this rank's GPU when it was sent from a GPU. Its
bytes are the sender's, bit for bit. A tensor the object names twice travels once and arrives as
one tensor named twice, as pickling keeps it.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

import torch

ALIGN = 64  # each tensor's offset in the buffer: a multiple of every dtype's element size


@dataclass(frozen=True)
class Ref:
    """A tensor's place in a message's buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    cuda: bool


def travels_raw(t) -> bool:
    """Whether ``t`` goes into the buffer (the module docstring) rather than into the pickle."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type in ("cpu", "cuda")
            and not t.requires_grad and not t.is_quantized and t.is_contiguous() and not t.is_conj()
            and not t.is_neg())


class _Pickler(pickle.Pickler):
    def __init__(self, f):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors, self.size = [], 0
        self.seen: dict[int, Ref] = {}  # by id: a tensor named twice travels once (self.tensors keeps it alive)

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor) or not travels_raw(obj):
            return None
        if id(obj) in self.seen:
            return self.seen[id(obj)]
        n = obj.numel() * obj.element_size()
        ref = Ref(self.size, n, obj.dtype, tuple(obj.shape), obj.device.type == "cuda")
        self.tensors.append(obj)
        self.seen[id(obj)] = ref
        self.size += -(-n // ALIGN) * ALIGN
        return ref


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, load):
        super().__init__(f)
        self.load_ref = load

    def persistent_load(self, pid):
        return self.load_ref(pid)


@dataclass
class Packed:
    """A message ready to travel: ``skeleton`` (the pickle), ``size`` (the buffer's bytes) and the
    tensors in buffer order (``buffer`` makes the buffer when it is sent)."""

    skeleton: bytes
    size: int
    tensors: list

    def buffer(self, size: int | None = None) -> torch.Tensor:
        """The tensors' bytes at their offsets in host memory, in ``size`` bytes (at least
        ``self.size``; the rest is padding, never read)."""
        buf = torch.empty(max(self.size, size or 0), dtype=torch.uint8)
        off = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            if n:
                buf[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += -(-n // ALIGN) * ALIGN
        return buf


def pack(obj) -> Packed:
    f = io.BytesIO()
    p = _Pickler(f)
    p.dump(obj)
    return Packed(f.getvalue(), p.size, p.tensors)


def unpack(skeleton: bytes, buf: torch.Tensor | None):
    """The object ``pack`` made ``skeleton`` of, its tensors read from ``buf`` (its bytes received,
    in host memory): a tensor sent from a GPU goes to this process's current GPU."""
    if buf is None:
        buf = torch.empty(0, dtype=torch.uint8)
    loaded: dict[Ref, torch.Tensor] = {}  # a tensor the sender named twice (one Ref) arrives as one

    def load(ref: Ref) -> torch.Tensor:
        if ref in loaded:
            return loaded[ref]
        t = buf[ref.offset:ref.offset + ref.nbytes].view(ref.dtype).reshape(ref.shape)
        t = t.to(torch.device("cuda", torch.cuda.current_device())) if ref.cuda else t.clone()
        if ref.nbytes:  # empty tensors share offsets: each its own
            loaded[ref] = t
        return t

    return _Unpickler(io.BytesIO(skeleton), load).load()
