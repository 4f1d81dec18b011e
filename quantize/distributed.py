"""Several processes, one run: the ranks of a torch.distributed job (issue 18 item 2).

A command runs as N ranks under torchrun, started by the user (``torchrun --nproc-per-node N -m
quantize.cli convert ...``, several nodes with ``--nnodes``/``--rdzv-endpoint``) or by ``--nproc N``
(``launch``: torchrun's own launcher, in the command's process). This module is what the work
calls; docs/distributed.md is the user's side.

- ``current()``: this process's ``World`` (rank, size, device, ``is_writer``). One process is a
  World of size 1 with no process group, where every collective below returns at once: callers
  write one code path.
- ``owned(n)`` / ``owner(i, n)``: a fixed contiguous partition of n items (routed experts), a
  function of (n, size, rank) alone: never of timing. ``samples(n)``: this rank's calibration
  samples, whole ``sample_shards`` (fixed by n alone: the leaves of every sum over samples).
- ``gather(obj, what)``, ``broadcast(obj, what)``, ``barrier(what)``: rank order; an object's
  tensors travel as raw bytes on the world's backend (NCCL on GPUs), the rest of it pickled on a
  gloo group (``quantize.wire``; ``World.gather`` for the cost). A peer that died or hangs fails them
  in one line (``QuantizeError`` naming this rank, the collective, ``what`` and the peer) within
  the timeout (``--dist-timeout-s``) instead of hanging this rank.

Bytes that do not depend on the number of ranks: each item's result must depend on that item
alone, and whatever is combined is combined in ``gather``'s order (rank order, hence item order),
never with ``all_reduce``, whose summation order is the backend's.

Importing this module imports no torch (``quantize --help`` stays fast); torch comes with the
first World of more than one process or the launcher.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from .errors import PeerLost, QuantizeError
from .options import DIST_TIMEOUT_S, usable_cpus

DEFAULT_TIMEOUT_S = DIST_TIMEOUT_S  # --dist-timeout-s
# launch() marks the ranks it starts: their one-line error goes to torchrun's error file for the
# rank (TORCHELASTIC_ERROR_FILE), not to stderr, and the launcher prints the first one, once
LAUNCHED = "QUANTIZE_LAUNCHED"
# torchrun's variables: a process it started has them all (TORCHELASTIC_RUN_ID too)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_STEP = "quantize/step/"  # rendezvous-store key per rank: the last collective it entered
PROBE_S = 2.0  # after a failure, how long the store is asked which ranks never arrived
# the most of one exchange's tensor bytes on the backend's device at once, per rank (under NCCL,
# GPU memory beside what the step holds; a gather holds one span from every rank)
EXCHANGE_SPAN = 256 << 20
# the commands whose library function splits its work across ranks and writes from rank 0 alone
# (samples and routed experts: methods/runner.py, methods/streamed.py, calibrate/kv.py); any other refuses to run as
# several ranks (each would do the whole job into one output)
RANK_AWARE: set[str] = {"convert", "calibrate-kv"}


def partition(n: int, size: int, rank: int) -> range:
    """Rank ``rank``'s items of ``n`` over ``size`` ranks: contiguous blocks, the first ``n % size``
    ranks one item longer (10 over 4: 0-2, 3-5, 6-7, 8-9). Some ranks get none when n < size."""
    if n < 0 or size < 1 or not 0 <= rank < size:
        raise ValueError(f"partition({n}, {size}, {rank})")
    q, r = divmod(n, size)
    start = rank * q + min(rank, r)
    return range(start, start + q + (rank < r))


# The calibration samples' fixed shards: the leaves of every sum over samples that must not depend on
# the number of ranks (GPTQ's Linear Hessians: each shard's per-sample terms summed in sample order,
# then the shards' sums in one fixed binary tree, ``TreeSum``, on one process as on many). A rank holds whole shards, so
# at most this many ranks split the samples (the others still split the routed experts).
SAMPLE_SHARDS = 8


def sample_shards(n: int) -> list[range]:
    """The samples ``0..n-1`` in ``min(n, SAMPLE_SHARDS)`` contiguous shards (``partition``)."""
    k = max(1, min(n, SAMPLE_SHARDS))
    return [partition(n, k, j) for j in range(k)]


def samples_of(n: int, size: int, rank: int) -> range:
    """Rank ``rank``'s calibration samples of ``n``: the union of its contiguous range of whole
    ``sample_shards`` (empty past the last shard)."""
    shards = sample_shards(n)
    mine = partition(len(shards), size, rank)
    if not len(mine):
        return range(n, n)
    return range(shards[mine.start].start, shards[mine.stop - 1].stop)


def _halves(lo: int, hi: int) -> int:
    """Where the tree splits node [lo, hi): the left half the longer (``partition`` into 2)."""
    return lo + (hi - lo + 1) // 2


class TreeSum:
    """A sum over ``leaves`` fixed shards in one fixed binary tree (a node [lo, hi) is its left
    half [lo, mid) plus its right half [mid, hi), ``add(left, right)``), whichever rank holds which
    shards: so the same additions, bit for bit, for any number of ranks. Values go into their leaf
    in order (``add``: summed within the leaf, the leaf pushed when the next one starts), or whole
    leaves are pushed (``leaf``); two complete siblings are added at once, so a process holds at most one partial
    sum per tree level. A rank that holds a contiguous run of leaves ends with the maximal
    subtrees inside it (about one per rank when the ranks are a power of two), which ``combine``
    sends to rank 0 to finish the tree."""

    def __init__(self, leaves: int, add: Callable[[Any, Any], Any]):
        if leaves < 1:
            raise ValueError(f"TreeSum({leaves})")
        self.leaves, self._add = leaves, add
        self._open: tuple[int, Any] | None = None  # the leaf ``add`` is filling
        self.parent: dict[tuple[int, int], tuple[int, int]] = {}
        todo = [(0, leaves)]
        while todo:
            lo, hi = todo.pop()
            if hi - lo > 1:
                mid = _halves(lo, hi)
                self.parent[(lo, mid)] = self.parent[(mid, hi)] = (lo, hi)
                todo += [(lo, mid), (mid, hi)]
        self.stack: list[tuple[tuple[int, int], Any]] = []

    def add(self, j: int, value) -> None:
        """``value`` into leaf ``j``: added to the open leaf when that is ``j``, else the open leaf
        is pushed and ``j`` opened with ``value`` as it is."""
        if self._open is not None and self._open[0] == j:
            self._open = (j, self._add(self._open[1], value))
            return
        self.close()
        self._open = (j, value)

    def close(self) -> None:
        """Push the leaf ``add`` is filling, if any."""
        if self._open is not None:
            j, value = self._open
            self._open = None
            self.leaf(j, value)

    def leaf(self, j: int, value) -> None:
        self.push((j, j + 1), value)

    def push(self, node: tuple[int, int], value) -> None:
        if self.stack and self.stack[-1][0][1] != node[0]:
            raise QuantizeError(f"shard sum: {node} after {self.stack[-1][0]}; every rank must run the same quantize "
                                "version")
        self.stack.append((node, value))
        while len(self.stack) >= 2:
            (a, va), (b, vb) = self.stack[-2], self.stack[-1]
            up = self.parent.get(a)
            if up is None or up != self.parent.get(b) or a[0] != up[0]:
                break
            self.stack[-2:] = [(up, self._add(va, vb))]

    def combine(self, world, what: str, send: Callable = lambda v: v, receive: Callable = lambda v: v, to: int = 0):
        """The root on rank ``to`` (None on the others, after sending theirs): every rank's
        subtrees, pushed in rank order (= leaf order), its own where its rank falls. ``send`` makes
        a value fit to travel (``gather`` pickles: CPU tensors), ``receive`` undoes it on rank
        ``to`` (back to its device)."""
        self.close()
        if world is not None and world.size > 1:
            mine = [(node, send(value)) for node, value in self.stack] if world.rank != to else []
            got = world.gather(mine, what, to=to)
            if got is None:
                self.stack = []
                return None
            own, self.stack = self.stack, []
            for r, part in enumerate(got):
                for node, value in (own if r == to else [(n, receive(v)) for n, v in part]):
                    self.push(node, value)
        if [n for n, _ in self.stack] != [(0, self.leaves)]:
            raise QuantizeError(f"{what}: the shard sums cover {[n for n, _ in self.stack]}, not the "
                                f"{self.leaves} shards; every rank must run the same quantize version")
        return self.stack.pop()[1]


def balance(costs: list[float], size: int) -> list[int]:
    """Items of these costs spread over ``size`` ranks, the costliest first, each to the rank with
    the least so far (the lowest such rank): -> each item's rank. A function of the costs alone, so
    the same on every rank."""
    load = [0.0] * size
    owner = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += costs[k]
    return owner


def owner_of(i: int, n: int, size: int) -> int:
    """The rank whose ``partition(n, size, rank)`` holds item ``i``."""
    if not 0 <= i < n:
        raise ValueError(f"item {i} of {n}")
    q, r = divmod(n, size)
    big = r * (q + 1)  # the first r ranks hold q + 1 items each
    return i // (q + 1) if i < big else r + (i - big) // q


def under_torchrun() -> bool:
    """This process was started by torchrun (ours or the user's)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in TORCHRUN_ENV)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise QuantizeError(f"environment variable {name}={v!r} is not an integer; torchrun sets it, unset it "
                            "outside torchrun") from None


def env_size() -> int:
    """The world size torchrun gave this process (1 outside torchrun)."""
    return _env_int("WORLD_SIZE", 1) if under_torchrun() else 1


def env_local_size() -> int:
    """The ranks torchrun started on this node (1 outside torchrun)."""
    return _env_int("LOCAL_WORLD_SIZE", env_size()) if under_torchrun() else 1


class World:
    """This process's place in the run. ``World()`` is one process: rank 0 of 1, no process group,
    collectives that return their input."""

    def __init__(self, rank: int = 0, size: int = 1, local_rank: int = 0, local_size: int = 1,
                 backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, group: Any = None,
                 store: Any = None):
        self.rank, self.size, self.local_rank, self.local_size = rank, size, local_rank, local_size
        self.backend, self.timeout_s = backend, timeout_s
        self._group, self._store, self._step = group, store, 0
        # an exchange's buffer goes through the backend's device at most this many bytes at a time;
        # ``stage``: through a device buffer also on the CPU (the self-test's way to run that path)
        self.span, self.stage = EXCHANGE_SPAN, False

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size}, backend={self.backend}, device={self.device})"

    @property
    def device(self) -> str:
        """Where this rank's tensors go: its own GPU under NCCL (``cuda:LOCAL_RANK``), else the CPU.
        A World of one leaves the choice to the command's ``--device``."""
        return f"cuda:{self.local_rank}" if self.backend == "nccl" else "cpu"

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes the output (shards, job record, manifest); the others compute."""
        return self.rank == 0

    @property
    def quiet(self) -> bool:
        """Print no progress or results here: rank 0 speaks for the run."""
        return self.rank != 0

    def owned(self, n: int) -> range:
        """This rank's items of ``n`` (``partition``)."""
        return partition(n, self.size, self.rank)

    def owner(self, i: int, n: int) -> int:
        return owner_of(i, n, self.size)

    def samples(self, n: int) -> range:
        """This rank's calibration samples of ``n`` (``samples_of``)."""
        return samples_of(n, self.size, self.rank)

    # -- collectives: every rank calls the same ones in the same order ---------------------------

    def gather(self, obj, what: str, *, to: int | None = None) -> list | None:
        """Every rank's ``obj``, in rank order: on every rank (``to`` None), or on rank ``to``
        alone (the others get None). ``what`` names the step in a failure ("layer 3 experts").

        How it travels (``quantize.wire``): its tensors' bytes in one host buffer per rank, sent
        by the world's backend (NCCL on GPUs) a span of at most ``EXCHANGE_SPAN`` bytes at a time,
        the rest pickled on the gloo group; this rank's own entry is ``obj`` itself. Cost: every
        rank's buffer is padded to the largest one's bytes, and all ranks receive every rank's
        buffer unless ``to`` is given. For what only the writer needs (quantized experts), pass
        ``to=0``."""
        if self.size == 1:
            return [obj] if to in (None, 0) else None
        import torch
        import torch.distributed as dist

        from . import wire

        def op():
            packed = wire.pack(obj)
            if to is None:
                metas = [None] * self.size
                dist.all_gather_object(metas, (packed.skeleton, packed.size), group=self._group)
                skeletons, sizes = [m[0] for m in metas], [m[1] for m in metas]
            else:
                sizes = [None] * self.size
                dist.all_gather_object(sizes, packed.size, group=self._group)
                skeletons = [None] * self.size if self.rank == to else None
                dist.gather_object(packed.skeleton, skeletons, dst=to, group=self._group)
            width = max(sizes)
            receives = to is None or self.rank == to
            mine = packed.buffer(width) if width else None
            del packed
            hosts = [mine if r == self.rank else torch.empty(width, dtype=torch.uint8) if receives and width else None
                     for r in range(self.size)]
            span = min(self.span, width)
            if self._staged and width:  # through the backend's device a span at a time (NCCL: GPU memory bounded)
                stage = torch.empty(span, dtype=torch.uint8, device=self.device)
                flat = torch.empty(self.size * span, dtype=torch.uint8, device=self.device) if receives else None
                self._ready()
            for off, n in self._spans(width):
                if self._staged:
                    stage[:n].copy_(mine[off:off + n])
                    out = flat[:self.size * n] if receives else None
                    if to is None:
                        dist.all_gather_single(out, stage[:n])
                    else:
                        dist.gather(stage[:n], list(out.chunk(self.size)) if out is not None else None, dst=to)
                    if receives:
                        for r, part in enumerate(out.chunk(self.size)):
                            if r != self.rank:
                                hosts[r][off:off + n].copy_(part)
                else:  # gloo on the CPU: straight into the host buffers
                    out = [h[off:off + n] for h in hosts] if receives else None
                    if to is None:
                        dist.all_gather(out, mine[off:off + n])
                    else:
                        dist.gather(mine[off:off + n], out, dst=to)
            if not receives:
                return None
            got = []
            for r in range(self.size):  # one rank's buffer at a time, freed once its tensors are out
                got.append(obj if r == self.rank else wire.unpack(skeletons[r], hosts[r]))
                hosts[r] = None
            return got

        return self._collective("gather", what, op)

    def broadcast(self, obj, what: str, *, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank (the others' ``obj`` is ignored; ``src`` gets
        ``obj`` itself). It travels as ``gather``'s do."""
        if self.size == 1:
            return obj
        import torch
        import torch.distributed as dist

        from . import wire

        def op():
            packed = wire.pack(obj) if self.rank == src else None
            box = [(packed.skeleton, packed.size) if packed is not None else None]
            dist.broadcast_object_list(box, src=src, group=self._group)
            skeleton, size = box[0]
            host = None
            if size:
                host = packed.buffer() if packed is not None else torch.empty(size, dtype=torch.uint8)
            del packed
            if self._staged and size:
                stage = torch.empty(min(self.span, size), dtype=torch.uint8, device=self.device)
                self._ready()
            for off, n in self._spans(size):
                part = host[off:off + n]
                if self._staged:
                    if self.rank == src:
                        stage[:n].copy_(part)
                    dist.broadcast(stage[:n], src=src)
                    if self.rank != src:
                        part.copy_(stage[:n])
                else:
                    dist.broadcast(part, src=src)
            return obj if self.rank == src else wire.unpack(skeleton, host)

        return self._collective("broadcast", what, op)

    @property
    def _staged(self) -> bool:
        """Whether the backend sends from its own device (NCCL: the GPU), so that a buffer goes
        through it a span at a time; gloo sends the host buffers themselves."""
        return self.device != "cpu" or self.stage

    def _ready(self) -> None:
        """Every rank has its buffers (a gloo barrier): a rank that could not allocate them has
        failed in its own line, and the others fail here in theirs, not later in a device
        collective whose timeout aborts instead of raising."""
        import torch.distributed as dist

        dist.barrier(group=self._group)

    def _spans(self, nbytes: int) -> list[tuple[int, int]]:
        return [(off, min(self.span, nbytes - off)) for off in range(0, nbytes, self.span)]

    def barrier(self, what: str) -> None:
        """Return when every rank has reached it."""
        if self.size == 1:
            return
        import torch.distributed as dist

        self._collective("barrier", what, lambda: dist.barrier(group=self._group))

    def _collective(self, name: str, what: str, op: Callable):
        self._step += 1
        try:
            self._store.set(f"{_STEP}{self.rank}", str(self._step))
            return op()
        except RuntimeError as e:  # torch.distributed's errors (DistBackendError, DistStoreError...) are these
            raise self._failure(name, what, e) from None

    def _failure(self, name: str, what: str, e: Exception) -> QuantizeError:
        from .checkpoint.output import rerun_hint

        text = " ".join(str(e).split())
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        closed = any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "Connection refused"))
        who = self._absent()
        at = f"{what!r} ({name})"
        if timed_out:
            return PeerLost(f"rank {self.rank}: {who} did not reach {at} within {self.timeout_s:g} s "
                            f"(--dist-timeout-s): it hangs or stopped without a word; {rerun_hint()}")
        if closed:
            return PeerLost(f"rank {self.rank}: {who} stopped during {at}, its connection closed: its own "
                            f"error, if it printed one, says why; {rerun_hint()}")
        return QuantizeError(f"rank {self.rank}: {at} failed: {text[:300]}; {rerun_hint()}")

    def _absent(self) -> str:
        """The ranks that never entered the collective this one failed in, by the step each
        recorded in the rendezvous store (best effort: the store may be gone with its host)."""
        others = [r for r in range(self.size) if r != self.rank]
        behind = []
        try:
            from datetime import timedelta

            self._store.set_timeout(timedelta(seconds=PROBE_S))
            for r in others:
                key = f"{_STEP}{r}"
                step = int(self._store.get(key)) if self._store.check([key]) else 0
                if step < self._step:
                    behind.append(r)
        except Exception:  # noqa: BLE001 - the store is only a hint; the error is the collective's
            behind = []
        if not behind and len(others) == 1:
            behind = others
        if not behind:
            return "another rank"
        return ("rank " if len(behind) == 1 else "ranks ") + ", ".join(map(str, behind))


_CURRENT = World()


def current() -> World:
    """This process's World: the one ``join`` made, else one process."""
    return _CURRENT


def join(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> World:
    """Join the run torchrun started (its environment, WORLD_SIZE > 1): a process group, NCCL when
    CUDA is there (one GPU per rank, ``cuda:LOCAL_RANK``) else gloo, with ``timeout_s`` on every
    collective. ``gather``/``broadcast``/``barrier`` first meet on a gloo group in both cases (a
    timeout that raises instead of aborting: a peer gone is one line there), and an object's
    tensors then travel on the world's backend (``quantize.wire``). Outside torchrun, or at size 1:
    the World of one process. Leave with ``leave``."""
    global _CURRENT
    if _CURRENT.size > 1:
        return _CURRENT
    size = env_size()
    if size <= 1:
        _CURRENT = World(timeout_s=timeout_s)
        return _CURRENT
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    local_size = env_local_size()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    td = timedelta(seconds=timeout_s)
    try:
        if backend == "nccl":
            if local_rank >= torch.cuda.device_count():
                raise QuantizeError(f"rank {rank}: local rank {local_rank} but {torch.cuda.device_count()} GPU(s) "
                                    "visible here; start at most one rank per GPU (--nproc-per-node)")
            torch.cuda.set_device(local_rank)
        store, rank, size = next(dist.rendezvous("env://", timeout=td))
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=td)
        global _JOINED
        _JOINED = True
        group = dist.new_group(backend="gloo", timeout=td) if backend != "gloo" else None
    except RuntimeError as e:
        raise QuantizeError(f"rank {rank}: could not join the other {size - 1} rank(s) within {timeout_s:g} s "
                            f"({' '.join(str(e).split())[:200]}); check --rdzv-endpoint and that every node "
                            "started") from None
    _CURRENT = World(rank, size, local_rank, local_size, backend, timeout_s, group, store)
    return _CURRENT


_JOINED = False  # this process joined a group of ranks (``join``): ``end_process`` ends it


def end_process(code: int | None) -> None:
    """The end of a process that joined a group of ranks: stdio flushed, exit with ``code`` now,
    without the interpreter's teardown, where torch.distributed's C++ threads can abort a rank that
    has finished ("terminate called without an active exception", SIGABRT: seen once in the test
    suite, after a complete two-rank conversion), which the launcher would report as the run's
    failure. Every file is written and closed by then; only atexit handlers are skipped. A process
    that never joined returns (and ends as usual)."""
    if not _JOINED:
        return
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(0 if code is None else code)


def leave() -> None:
    """Destroy the process group ``join`` made (nothing for a World of one)."""
    global _CURRENT
    w, _CURRENT = _CURRENT, World()
    if w.size > 1:
        import torch.distributed as dist

        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing is left to tear down
            pass


@contextmanager
def world(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None):
    """``with world(600) as w:`` -- ``join``, then ``leave`` on the way out (inside another
    ``world``, the outer one's World, left by the outer one)."""
    outer = current().size > 1
    w = join(timeout_s, backend)
    try:
        yield w
    finally:
        if not outer:
            leave()


def gather(obj, what: str, *, to: int | None = None) -> list | None:
    return current().gather(obj, what, to=to)


def broadcast(obj, what: str, *, src: int = 0):
    return current().broadcast(obj, what, src=src)


def barrier(what: str) -> None:
    current().barrier(what)


def owned(n: int) -> range:
    return current().owned(n)


def owner(i: int, n: int) -> int:
    return current().owner(i, n)


def follow(world: World, jobs: dict[str, Callable]) -> Any:
    """A rank other than 0: run each job rank 0 broadcasts (``(kind, job)``: ``jobs[kind](job)``)
    until it sends ``("done", result)``; returns that result. An unknown kind is one line."""
    while True:
        kind, job = world.broadcast(None, "the next job from rank 0")
        if kind == "done":
            return job
        if kind not in jobs:
            raise QuantizeError(f"rank {world.rank}: rank 0 sent a job this rank does not know ({kind!r}): every "
                                "rank must run the same quantize version")
        jobs[kind](job)


def check_nproc(nproc: int) -> None:
    """The library's side of ``nproc``: a library function runs in the ranks it is called from and
    starts none (the command line's ``--nproc`` does, or torchrun)."""
    w = current()
    if nproc != 1 and nproc != w.local_size:
        raise QuantizeError(
            f"--nproc {nproc}: this call runs in {w.local_size} process(es) here; the command line starts the "
            f"ranks (`quantize ... --nproc {nproc}`), or run this under `torchrun --nproc-per-node {nproc}`"
        )


# -- saying a rank's error once -------------------------------------------------------------------


def report(line: str, exit_code: int, consequence: bool = False) -> None:
    """A rank's one-line error (``error: ...``) before it exits with ``exit_code``. On stderr; under
    ``launch``, into torchrun's error file for the rank instead, and the launcher prints the first
    rank's and exits with its code (``consequence``: a peer's loss, shown only when no rank said
    why on its own). Under a user's own torchrun, both: torchrun's failure summary then shows the line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE") if under_torchrun() else None
    if path:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            now = time.time()
            Path(path).write_text(json.dumps({
                # torchrun's own layout (torch.distributed.elastic.multiprocessing.errors), which its summary reads
                "message": {"message": line, "extraInfo": {"timestamp": str(int(now))}},  # no py_callstack: shown
                # the launcher's: the first failure by a finer clock, and its code (torchrun may stop it first)
                "quantize": {"line": line, "time": now, "exit_code": exit_code, "consequence": consequence},
            }))
            if os.environ.get(LAUNCHED):
                return
        except OSError:
            pass
    print(line, file=sys.stderr, flush=True)


def report_error(e: QuantizeError) -> None:
    """``report`` of a user error: its line and exit code, a peer's loss (``PeerLost``) marked as
    the consequence it is."""
    report(f"error: {e}", e.exit_code, isinstance(e, PeerLost))


# -- the --nproc launcher -------------------------------------------------------------------------


def _first_failure(failures: dict) -> tuple[str, int]:
    """The line and exit code to show for torchrun's failed ranks: the earliest one-line error a
    rank reported of its own (a peer's loss only when none did), else the first rank that died (not
    one torchrun stopped after it)."""
    import signal

    said = []
    for rank, f in failures.items():
        data = f.error_file_data if isinstance(getattr(f, "error_file_data", None), dict) else {}
        q = data.get("quantize")
        if isinstance(q, dict) and isinstance(q.get("line"), str):
            said.append((bool(q.get("consequence")), float(q.get("time", 0)), rank, q["line"],
                         int(q.get("exit_code", 1))))
    if said:
        *_, line, code = min(said)
        return line, code
    stopped = -int(signal.SIGTERM)  # what torchrun sends the others once one has failed
    died = sorted(failures.items(), key=lambda kv: (kv[1].exitcode == stopped, kv[1].timestamp, kv[0]))
    rank, f = died[0]
    if f.exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-f.exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-f.exitcode}"
        return f"error: rank {rank} {how} (out of memory?); its output, if any, is above", 1
    return f"error: rank {rank} exited with code {f.exitcode}; its output is above", 1


def launch(module: str, argv: list[str], nproc: int, interrupted: str = "interrupted") -> int:
    """Run ``python -m module *argv`` as ``nproc`` ranks on this machine under torchrun
    (``torch.distributed.run`` with ``--standalone``, its agent in this process: it starts, watches
    and stops the ranks) and return the exit code: 0, or the first failed rank's, whose one-line
    error is printed here once instead of torchrun's report. The ranks get this environment, the
    package this process runs (PYTHONPATH first), and a share of the cores each (OMP_NUM_THREADS,
    unless set)."""
    import logging
    import tempfile

    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name in list(logging.root.manager.loggerDict):  # the agent's own log lines: its report is ours
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root + (os.pathsep + path if path else "")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))
    os.environ[LAUNCHED] = "1"
    # torchrun's per-rank logs and error files: a private folder, removed with the run
    with tempfile.TemporaryDirectory(prefix="quantize-ranks-", ignore_cleanup_errors=True) as logs:
        try:
            args = run.parse_args(["--standalone", "--nproc-per-node", str(nproc), "--log-dir", logs, "-m", module])
            # set, not parsed: torchrun's parser would take the command's --nproc for its --nproc-per-node
            args.training_script_args = list(argv)
            run.run(args)
            return 0
        except ChildFailedError as e:
            line, code = _first_failure(e.failures)
            print(line, file=sys.stderr, flush=True)
            return code
        except (KeyboardInterrupt, SignalException):
            print(interrupted, file=sys.stderr, flush=True)
            return 130
        except Exception as e:  # noqa: BLE001 - torchrun could not start the ranks (rendezvous, ports)
            print(f"error: torchrun could not start {nproc} ranks here: {' '.join(str(e).split())[:300]}",
                  file=sys.stderr, flush=True)
            return 1


# -- a self-test the tests run under torchrun -----------------------------------------------------


def _message(rank: int) -> dict:
    """What the self-test's ranks exchange: tensors of every kind ``quantize.wire`` sends raw (of
    rank-dependent sizes, so buffers are padded) beside ones it pickles, a function of ``rank``."""
    import torch

    g = torch.Generator().manual_seed(rank)
    big = torch.randn((1 << 16) + 37 * rank, generator=g)
    return {"rank": rank, "bf16": torch.randn(3, 5 + rank, generator=g).to(torch.bfloat16),
            "rows": [torch.arange(7 * rank), torch.tensor(rank % 2 == 0), torch.empty(0, 4)],
            "fp8": torch.randn(9, generator=g).to(torch.float8_e4m3fn), "big": big, "part": big[3:11],
            "strided": torch.randn(4, 6, generator=g).t(), "param": torch.nn.Parameter(torch.ones(2) * rank)}


def _same(a, b) -> bool:
    """Equal bit for bit (tensors: type, dtype, shape, strides and bytes), recursively."""
    import torch

    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _selftest(argv: list[str]) -> int:
    """``python -m quantize.distributed selftest [--nproc N] [--timeout-s T] [--items N]
    [--vanish R] [--hang R] [--fail R] [--timings DIR] [--backend gloo|nccl]``: gather, partition and broadcast across
    the ranks, then a barrier that rank R leaves (exits 0 without a word), hangs at, or fails
    before (one line); the writer prints the result as JSON. ``--timings DIR``: each rank writes
    how long its last collective took, for the failure latencies."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m quantize.distributed selftest")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--items", type=int, default=10)
    for what in ("vanish", "hang", "fail"):
        p.add_argument(f"--{what}", type=int, default=None, metavar="RANK")
    p.add_argument("--timings", type=Path, default=None)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="nccl: a GPU per rank")
    a = p.parse_args(argv)
    if a.nproc > 1 and not under_torchrun():
        return launch("quantize.distributed", ["selftest", *argv], a.nproc)
    a.started = time.monotonic()
    try:
        with world(a.timeout_s, a.backend) as w:
            try:
                return _selftest_run(w, a)
            except QuantizeError as e:  # said before leaving: a peer sees the connection close after this line
                return _selftest_failed(a, e)
    except QuantizeError as e:  # joining failed
        return _selftest_failed(a, e)
    except KeyboardInterrupt:
        report("interrupted", 130)
        return 130


def _selftest_run(w, a) -> int:
    """The self-test's exchanges and its planted failures, in the World ``w``."""
    ranks = w.gather(w.rank, "selftest ranks")
    parts = w.gather(list(w.owned(a.items)), "selftest partition")
    token = w.broadcast(f"from rank {w.rank}", "selftest broadcast")
    tensors = []
    # tensors gathered to every rank, to the writer, broadcast from the last rank: in one span,
    # then in spans of 4 KiB through a staging buffer (the path NCCL's device buffers take)
    for span, stage in ((w.span, False), (4096, True)):
        w.span, w.stage = span, stage
        last = w.size - 1
        every = w.gather(_message(w.rank), "selftest tensors")
        to_writer = w.gather(_message(w.rank), "selftest tensors to the writer", to=0)
        from_last = w.broadcast(_message(w.rank) if w.rank == last else None, "selftest tensors", src=last)
        at_0 = to_writer is None if w.rank else all(_same(m, _message(r)) for r, m in enumerate(to_writer))
        tensors.append(all(_same(m, _message(r)) for r, m in enumerate(every))
                       and _same(from_last, _message(last)) and at_0)
    w.span, w.stage = EXCHANGE_SPAN, False
    tensors = w.gather(tensors, "selftest tensors checked", to=0)
    if w.rank == a.vanish:
        os._exit(0)  # a process gone without a word or an error code
    if w.rank == a.hang:
        time.sleep(10 * a.timeout_s + 60)
    if w.rank == a.fail:
        raise QuantizeError(f"rank {w.rank}: a planted failure (selftest --fail {a.fail})")
    a.started = time.monotonic()
    w.barrier("selftest barrier")
    at_writer = w.gather({"rank": w.rank, "owns": list(w.owned(a.items))}, "selftest results", to=0)
    if w.is_writer:
        print(json.dumps({"size": w.size, "ranks": ranks, "parts": parts, "token": token,
                          "at_writer": at_writer, "device": w.device, "backend": w.backend,
                          "tensors": tensors}), flush=True)
    return 0


def _selftest_failed(a, e: QuantizeError) -> int:
    if a.timings is not None:
        a.timings.mkdir(parents=True, exist_ok=True)
        (a.timings / f"rank-{os.environ.get('RANK', 0)}.json").write_text(
            json.dumps({"failed_after_s": time.monotonic() - a.started}))
    report_error(e)
    return e.exit_code


if __name__ == "__main__":
    if sys.argv[1:2] != ["selftest"]:
        sys.exit("usage: python -m quantize.distributed selftest [--help]")
    sys.exit(_selftest(sys.argv[2:]))
