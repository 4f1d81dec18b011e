"""Samples through one decoder layer, shared by the layer pass (``runner``) and the methods
(``gptq``, ``autoround``): transformers' layer forward (``call_layer``) with its rotary
embeddings, positions and mask (``Context``), the pool runs in sample order (``in_order``), the
statistics hooks fill per sample and merge in order (``Collector``), and every sample of a
hidden-state store through a layer (``Forward``). Below every other module of the package but
``units`` and ``store``: nothing here imports the runner or a method."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import QuantizeError
from .store import Budget, HiddenStore


class Context:
    """Rotary embeddings, positions and the causal mask per sequence length (built once)."""

    def __init__(self, streamer, device: str):
        self.streamer = streamer
        self.device = device
        self._by_len: dict[int, tuple] = {}

    def __call__(self, h: torch.Tensor):
        n = h.shape[1]
        if n not in self._by_len:
            pos, pe, mask = self.streamer._context(h.cpu())
            mv = lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t  # noqa: E731
            self._by_len[n] = (mv(pos), tuple(mv(t) for t in pe), mv(mask))
        return self._by_len[n]


@contextmanager
def deterministic(device: str):
    """On a GPU, torch's deterministic kernels while the pass runs: the routed experts' outputs are
    summed with ``index_add_``, which CUDA otherwise does with atomics in whatever order the threads
    land, and a last-bit difference there moves every later layer's Hessians and codes. cuBLAS needs
    its fixed workspace for the same (set before CUDA starts; the CLI's processes start here)."""
    if not str(device).startswith("cuda"):
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def in_order(pool, width: int, fn, items):
    """``fn`` over ``items`` on ``pool``, results in item order, ``width`` submitted at a time (so at
    most a window of results is held beside the caller's): the same sums for any thread count."""
    items = list(items)
    for w0 in range(0, len(items), max(1, width)):
        yield from pool.map(fn, items[w0: w0 + max(1, width)])


def clear(*stores) -> None:
    """Clear each distinct hidden-state store once (the quantized and the source stream may share one)."""
    for store in {id(x): x for x in stores}.values():
        store.clear()


def call_layer(streamer, ctx: Context, layer, h: torch.Tensor, topk):
    """One sample through one layer (transformers' forward, as ``LayerStreamer.run_layer``), with
    or without autograd (the caller decides): (hidden out, DSA top-k for the next layer)."""
    pos, pe, mask = ctx(h)
    kw = {"prev_topk_indices": topk} if streamer.arch.hf.get("topk") else {}
    out = layer(h.to(ctx.device), attention_mask=mask, position_embeddings=pe, position_ids=pos, past_key_values=None,
                use_cache=False, **kw)
    if isinstance(out, tuple):
        return out[0], (out[1] if len(out) > 1 else None)
    return out, None


class Collector:
    """Statistics gathered by forward hooks while samples run in parallel threads: each thread
    fills its own per-sample part (``begin`` / ``end``), and the parts are merged in sample order
    (``merge(part, sample)``, ``sample`` the run-wide index of the sample), so the sums are the
    same for any number of threads."""

    def __init__(self):
        self._tls = threading.local()

    def begin(self) -> None:
        self._tls.part = {}

    def end(self) -> dict:
        part, self._tls.part = self._tls.part, None
        return part

    def _part(self) -> dict:
        return self._tls.part

    def source_side(self, on: bool) -> None:
        """Whether the hooks now see the source stream's sample (paired with the next call's)."""
        self._tls.source = on

    def on_source(self) -> bool:
        return getattr(self._tls, "source", False)


def _finite(t: torch.Tensor, i: int, what: str) -> None:
    if not torch.isfinite(t).all():
        raise QuantizeError(f"decoder layer {i}: NaN or Inf in the hidden states {what}; the source weights or the "
                            "calibration text overflow here (re-download the source if its weights are damaged, "
                            "use other calibration text, or use --method rtn)")


def _sq(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(sum of squared differences, sum of squares of b): per-token sums, then in token order
    (a fixed reduction order: the same figures for any thread count)."""
    d = (a.float() - b.float()).pow(2).sum(-1).double().reshape(-1)
    r = b.float().pow(2).sum(-1).double().reshape(-1)
    return float(d.sum()), float(r.sum())


def _source_side(streamer, ctx: Context, layer, collector: Collector, h: torch.Tensor, topk) -> None:
    """One sample of the source stream through ``layer`` with ``collector``'s hooks on its source side."""
    collector.source_side(True)
    try:
        call_layer(streamer, ctx, layer, h, topk)
    finally:
        collector.source_side(False)


class Forward:
    """Every sample of a store through a layer, on the pass's pool, into stores on the pass's
    budget and spill folder: what the runner and a method's layer step both run."""

    def __init__(self, streamer, ctx: Context, pool, workers: int, device: str, budget: Budget, spill: Path,
                 samples: range | None = None, total: int | None = None, world=None):
        self.streamer, self.ctx, self.pool, self.workers, self.device = streamer, ctx, pool, workers, device
        self.budget, self.spill = budget, spill
        # the calibration samples this process's stores hold (run-wide indices) of ``total``, and the
        # World they are split over (None: this process holds them all)
        self.samples, self.total, self.world = samples, total, world
        self.out: str | None = None  # the output folder, where another rank's scratch folder goes (RankScratch)

    @property
    def first(self) -> int:
        return self.samples.start if self.samples is not None else 0

    def errors(self, per_sample: list[tuple[float, float]], what: str) -> tuple[float, float]:
        """(sum of squared errors, sum of squared references) over every sample of the run, added
        in sample order from 0.0 (with the samples split: on rank 0, from every rank's, in rank
        order = sample order; the other ranks get zeros, their reports are not written)."""
        if self.world is not None and self.world.size > 1:
            got = self.world.gather(per_sample, what, to=0)
            per_sample = [e for part in got for e in part] if got is not None else []
        err, tot = 0.0, 0.0
        for e, r in per_sample:
            err, tot = err + e, tot + r
        return err, tot

    def __call__(self, layer, hidden: HiddenStore, topk: list, i: int, what: str,
                 keep: bool = True, ref: HiddenStore | None = None, collector=None,
                 stand=None, replay: HiddenStore | None = None, source: HiddenStore | None = None,
                 source_topk: list | None = None):
        """Every sample through ``layer``: (outputs store or None, top-k[, (sq err, sq ref) vs ``ref``]).
        Samples run in parallel threads (``workers``), each op on one torch thread, in windows of
        ``workers`` samples whose results are taken in sample order: the figures do not depend
        on the thread count, and at most a window of outputs is held beside the store.

        ``stand``: the layer's routed experts stand-in (``calibrate/experts.py``), given each
        sample's experts output from ``replay``. ``source``: each sample of the source stream runs
        first, its hooks told so (``Collector.source_side``), so ``collector`` pairs the two."""
        out = HiddenStore(self.budget, self.spill, f"l{i}") if keep else None
        new_topk, errs = [], []

        def one(s: int):
            if collector is not None:
                collector.begin()
            if stand is not None:
                stand.replay(replay[s])
            with torch.no_grad():
                if source is not None:
                    _source_side(self.streamer, self.ctx, layer, collector, source[s], source_topk[s])
                o, t2 = call_layer(self.streamer, self.ctx, layer, hidden[s], topk[s])
                e = _sq(o, ref[s].to(o.device)) if ref is not None else None
            return o, t2, e, collector.end() if collector is not None else None

        for s, (o, t2, e, part) in enumerate(in_order(self.pool, self.workers, one, range(len(hidden)))):
            _finite(o, i, what)
            if collector is not None:
                collector.merge(part, self.first + s)
            if e is not None:
                errs.append(e)
            if out is not None:
                out.append(o)
            new_topk.append(t2)
        if ref is not None:
            return out, new_topk, self.errors(errs, f"layer {i} error {what}")
        return out, new_topk

    def capture(self, layer, stand, hidden: HiddenStore, topk: list, i: int, collector=None,
                source: HiddenStore | None = None, source_topk: list | None = None) -> "Captured":
        """Every sample through ``layer`` with its routed experts captured (``stand``): what the
        router hands them, per sample, and the DSA top-k for the next layer (the layer's own
        outputs are not the layer's and are dropped). ``collector``'s hooks observe this pass
        (``source``: paired with the source stream's sample, as in ``__call__``, whose expert inputs
        at the same tokens are kept too, ``Captured.source``)."""
        cap = Captured(HiddenStore(self.budget, self.spill, f"x{i}"),
                       HiddenStore(self.budget, self.spill, f"xs{i}") if source is not None else None)

        def one(s: int):
            if collector is not None:
                collector.begin()
            with torch.no_grad():
                src = None
                if source is not None:
                    stand.capture()
                    _source_side(self.streamer, self.ctx, layer, collector, source[s], source_topk[s])
                    src = stand.take().hidden  # the source stream's expert inputs, at the same tokens
                stand.capture()
                call_layer(self.streamer, self.ctx, layer, hidden[s], topk[s])
            return stand.take(), src, collector.end() if collector is not None else None

        for s, (r, src, part) in enumerate(in_order(self.pool, self.workers, one, range(len(hidden)))):
            _finite(r.hidden, i, "before the routed experts")
            if collector is not None:
                collector.merge(part, self.first + s)
            cap.append(r)
            if src is not None:
                cap.source.append(src)
        return cap


class Captured:
    """What the router handed a layer's routed experts, per sample (the inputs on the store's
    budget, the routing beside them)."""

    def __init__(self, hidden: HiddenStore, source: HiddenStore | None = None):
        self.hidden = hidden
        self.source = source  # GPTQ --asym: the source stream's expert inputs, token for token
        self.index: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.hidden)

    def append(self, r) -> None:
        self.hidden.append(r.hidden)
        self.index.append(r.index.cpu())
        self.weights.append(r.weights.detach().cpu())

    def __getitem__(self, s: int):
        from ..calibrate.experts import Routed

        return Routed(self.hidden[s], self.index[s], self.weights[s])

    def clear(self) -> None:
        self.hidden.clear()
        if self.source is not None:
            self.source.clear()
        self.index.clear()
        self.weights.clear()
