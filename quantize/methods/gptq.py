"""GPTQ on one decoder layer: Hessians from the layer's own calibration forward, the update itself
from llm-compressor (``llmcompressor.modifiers.gptq.gptq_quantize.quantize_weight``, the function
its ``GPTQModifier`` calls), static group scales from our grid.

Hessians are accumulated as llm-compressor's ``accumulate_hessian`` does (``2 x^T x`` in fp32 per
sample, divided by the number of samples) for every ``nn.Linear`` unit. Routed experts get one
Hessian each from exactly the tokens the router sends them (``--all-experts``: from every token,
for the statistics only; the layer's output still follows the router), the ``down_proj`` one from
the expert's own activations ``act(gate) * up`` of those tokens; gate and up share theirs (one
GPTQ over the fused ``[2I, H]`` rows equals two over each half: GPTQ treats rows independently).

The grid: scales come from the RTN observer (``--observer``: minmax = compressed-tensors'
``absmax / 7.5`` bit for bit, or fullrange) on the original weight, fixed before the update (static
groups, no g_idx); llm-compressor's update rounds each column to that grid and spreads the error
over the columns not yet quantized. The codes are ``round(W_q / scale)`` of its result.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from ..distributed import TreeSum, owner_of, sample_shards
from ..formats import int4
from .base import Layer, Method, Step
from .forward import Collector
from .units import Result, Unit, cross_key, rtn, unit_key

CHUNK = 8  # units per quantize_weight call: fixed (not memory-dependent), below its batched-Cholesky switch (16)
# on a GPU: same-shape units (a group's experts) stacked into one call on one stream, at most this many
# (fixed, so the same partition and bytes on every run; a group holds fewer when the budget says so)
GPU_CHUNK = 64


def _add_all(acc: dict, terms: dict) -> dict:
    """Each term into ``acc`` (the first one taken as it is, as ``_accumulate`` starts a sum);
    returns ``acc`` (a ``TreeSum``'s addition: a node's left half plus its right)."""
    for key, h in terms.items():
        if key in acc:
            acc[key] += h
        else:
            acc[key] = h
    return acc


def _add_counts(acc: object, part: dict, names: tuple[str, ...]) -> None:
    """``part``'s integer counts (``part[name]``: key -> count) added to ``acc``'s dicts of those names."""
    for name in names:
        mine = getattr(acc, name)
        for k, v in part.get(name, {}).items():
            mine[k] = mine.get(k, 0) + v


def _on_cpu(sums: dict) -> dict:
    """Tensors fit to travel between ranks (``World.gather`` pickles; a CUDA tensor would arrive on
    the sender's GPU)."""
    return {k: h.cpu() for k, h in sums.items()}


def _accumulate(H: dict, n: dict, tokens: dict, key: str, x: torch.Tensor, count: int,
                src: torch.Tensor | None = None) -> None:
    """``2 x^T x`` (fp32, llm-compressor's accumulate_hessian) added to ``H[key]`` (or its first
    term), ``count`` to the divisor and the rows to the token count. ``src`` (GPTQ --asym): the source
    stream's inputs at the same tokens, and ``2 x^T src`` goes to ``cross_key(key)`` instead, divided
    like the Hessian (its count, no tokens)."""
    inp = math.sqrt(2) * x.reshape(-1, x.shape[-1]).to(torch.float32)
    if src is None:
        prod = inp.t().matmul(inp)
    else:
        other = math.sqrt(2) * src.reshape(-1, src.shape[-1]).to(torch.float32)
        if other.shape != inp.shape:
            raise ValueError(f"{key}: the source stream's input {tuple(other.shape)} does not pair with "
                             f"{tuple(inp.shape)}")
        prod = inp.t().matmul(other)
        key = cross_key(key)
    if key in H:
        H[key] += prod
    else:
        H[key] = prod
    n[key] = n.get(key, 0) + count
    if src is None:
        tokens[key] = tokens.get(key, 0) + inp.shape[0]


class Hessians(Collector):
    """Forward pre-hooks that accumulate every unit's Hessian during one calibration forward."""

    def __init__(self, layer: torch.nn.Module, units: list[Unit], all_experts: bool, samples: int = 0,
                 asym: bool = False):
        super().__init__()
        self.layer = layer
        self.units = units
        self.all_experts = all_experts
        # --asym: the units whose inputs are paired with the source stream's (``cross``); routed experts
        # are paired per group from the captures (``expert``) when ``pairs``
        self.pairs = asym
        self.asym = {u.key for u in units if asym and corrects(u) and u.expert is None}
        self.H: dict[str, torch.Tensor] = {}
        # the hooked samples' terms: per sample in sample order within each of the run's fixed sample
        # shards (distributed.sample_shards of ``samples``), then the shards' sums in one fixed tree
        # (distributed.TreeSum), the same additions whichever rank holds which shards (``combine``)
        self.shards = len(sample_shards(samples)) if samples else 1
        self.samples = samples
        self.tree = TreeSum(self.shards, _add_all)
        self.n: dict[str, int] = {}  # divisor: samples (Linear, as llm-compressor) or tokens (experts)
        self.tokens: dict[str, int] = {}  # tokens that fed the statistics
        self.routed: dict[tuple[str, int], int] = {}  # (experts module, e) -> tokens the router sent
        self._handles = []
        linear = [u for u in units if u.expert is None]
        self._experts = {u.key for u in units if u.expert is not None}
        experts: dict[str, list[Unit]] = {}
        for u in units:
            if u.expert is not None:
                experts.setdefault(u.module, []).append(u)
        for u in linear:
            mod = layer.get_submodule(u.module)
            self._handles.append(mod.register_forward_pre_hook(self._linear_hook(u)))
        for path, us in experts.items():
            mod = layer.get_submodule(path)
            self._handles.append(mod.register_forward_pre_hook(self._experts_hook(path, mod, us)))

    def merge(self, part: dict, sample: int) -> None:
        part.pop("source", None)
        _add_counts(self, part, ("n", "tokens", "routed"))
        terms = part.get("H", {})
        routed = {k: terms.pop(k) for k in [k for k in terms if k in self._experts]}
        _add_all(self.H, routed)  # a whole layer's routed experts: per sample in order, as a streamed group sums them
        if not terms:
            return
        self.tree.add(owner_of(sample, self.samples, self.shards) if self.samples else 0, terms)

    def combine(self, world, what: str, owners: dict[str, int] | None = None,
                device: torch.device | None = None) -> None:
        """The hooked units' Hessians of every rank's samples, each on its owner (``owners``: unit
        key -> rank; default rank 0), which the others send their subtrees of its shard sums, then
        drop them: the tree finished in shard order; the divisors and token counts summed on every
        rank, in rank order. Every rank calls it, for a layer with hooked units. What an owner
        receives goes to ``device``, the layer's (not read off its own Hessians: a rank that holds no
        sample has none, and its units' weights are on the layer's device all the same)."""
        self.tree.close()
        split = world is not None and world.size > 1
        if not split:
            _add_all(self.H, self.tree.combine(None, what))
            self.tree = TreeSum(self.shards, _add_all)
            return
        counts = world.gather({"n": self.n, "tokens": self.tokens}, f"{what} (counts)")
        self.n, self.tokens = {}, {}
        for part in counts:
            _add_counts(self, part, ("n", "tokens"))
        owners = owners or {}
        stack = self.tree.stack
        for o in sorted(set(owners.values()) | {0}):  # the same ranks on every rank (a rank may hold no sample)
            tree = TreeSum(self.shards, _add_all)
            tree.stack = [(node, {k: h for k, h in sums.items() if owners.get(unit_key(k), 0) == o})
                          for node, sums in stack]
            root = tree.combine(world, f"{what} for rank {o}" if o else what, send=_on_cpu,
                                receive=lambda sums: {k: h.to(device) for k, h in sums.items()}, to=o)
            if root is not None:
                _add_all(self.H, root)
        self.tree = TreeSum(self.shards, _add_all)

    def _add(self, key: str, x: torch.Tensor, count: int, src: torch.Tensor | None = None) -> None:
        """One sample's ``2 x^T x`` of ``key`` (``src``: its cross term) into this thread's part (merged in
        sample order)."""
        part = self._part()
        _accumulate(part.setdefault("H", {}), part.setdefault("n", {}), part.setdefault("tokens", {}), key, x, count,
                    src)

    def observe_one(self, key: str, x: torch.Tensor, count: int, src: torch.Tensor | None = None) -> None:
        """The same, straight into the totals: the same sums in the same sample order as a part
        merged, without the part. Distinct keys may be observed in parallel threads."""
        _accumulate(self.H, self.n, self.tokens, key, x, count, src)

    def _linear_hook(self, u: Unit):
        def hook(module, args):
            if self.on_source():  # the source stream's sample: kept for the quantized-path call that follows
                if u.key in self.asym:
                    self._part().setdefault("source", {})[u.key] = args[0]
                return
            self._add(u.key, args[0], 1)
            src = self._part().get("source", {}).pop(u.key, None)
            if src is not None:  # its cross term, under cross_key
                self._add(u.key, args[0], 1, src)
        return hook

    def _experts_hook(self, path: str, mod: torch.nn.Module, us: list[Unit]):
        gate_up = {u.expert: u for u in us if u.path.endswith("gate_up_proj")}
        down = {u.expert: u for u in us if u.path.endswith("down_proj")}

        def hook(module, args):
            if self.on_source():  # the source stream's side of a paired pass: no statistics of its own
                return
            hidden = args[0].reshape(-1, args[0].shape[-1])
            routed_part = self._part().setdefault("routed", {})
            for e in sorted(set(gate_up) | set(down)):
                n = self.expert(e, gate_up.get(e), down.get(e), mod.gate_up_proj[e], mod.act_fn, hidden, args[1],
                                self._add)
                routed_part[(path, e)] = routed_part.get((path, e), 0) + n
        return hook

    def expert(self, e: int, gate_up: Unit | None, down: Unit | None, w_gate_up: torch.Tensor, act_fn,
               hidden: torch.Tensor, top_k_index: torch.Tensor, add, source: torch.Tensor | None = None) -> int:
        """One sample's statistics of routed expert ``e`` (its ``gate_up`` / ``down`` units, either
        None when not INT4) from the tokens the router sends it (every token with ``--all-experts``):
        ``add(key, x, count)`` takes ``x`` (``act(gate) * up`` of the source ``w_gate_up`` for the
        down_proj Hessian). Returns the tokens the router sent it. The hook's body per expert, and
        what a streamed layer runs per expert of a group (``methods/streamed.py``). ``source`` (GPTQ
        --asym): the source stream's expert inputs at the same tokens, paired with gate/up's
        (``add(key, x, count, src)``)."""
        routed = (top_k_index == e).any(-1).reshape(-1)
        x = hidden if self.all_experts else hidden[routed]
        if x.shape[0]:
            with torch.no_grad():
                if gate_up is not None:
                    add(gate_up.key, x, x.shape[0])
                    if source is not None and self.pairs and corrects(gate_up):
                        add(gate_up.key, x, x.shape[0], source if self.all_experts else source[routed])
                if down is not None:
                    g, up = torch.nn.functional.linear(x, w_gate_up).chunk(2, dim=-1)
                    add(down.key, act_fn(g) * up, x.shape[0])
        return int(routed.sum())

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def normalized(self, key: str) -> torch.Tensor | None:
        """The unit's Hessian divided by its divisor, in place (the same values as ``h / n``): the
        accumulator is handed over, not copied (at real width one expert's is 200 MB)."""
        h = self.H.pop(key, None)
        return None if h is None else h.div_(self.n[key])


@contextmanager
def _triton_off(off: bool):
    """llm-compressor's fused Triton block update clamps scales to positive; the full-range grid
    has negative ones, so on a GPU its eager path (same math) runs instead."""
    import os

    if not off:
        yield
        return
    old = os.environ.get("LLMCOMPRESSOR_DISABLE_GPTQ_TRITON")
    os.environ["LLMCOMPRESSOR_DISABLE_GPTQ_TRITON"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LLMCOMPRESSOR_DISABLE_GPTQ_TRITON", None)
        else:
            os.environ["LLMCOMPRESSOR_DISABLE_GPTQ_TRITON"] = old


def _llmcompressor_update():
    """llm-compressor's ``quantize_weight``, imported quietly: on import it logs to STDOUT (loguru),
    which would corrupt ``convert --json``'s NDJSON stream; its log is turned off unless the user
    configured it (LLM_COMPRESSOR_LOG_*)."""
    import os

    configured = any(k.startswith("LLM_COMPRESSOR_LOG") for k in os.environ)
    if not configured:
        os.environ["LLM_COMPRESSOR_LOG_DISABLED"] = "true"
    try:
        from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    finally:
        if not configured:
            del os.environ["LLM_COMPRESSOR_LOG_DISABLED"]  # only for our import, not the process
    if not configured:
        from loguru import logger

        logger.disable("llmcompressor")
        # llm-compressor's own logging (oneshot, later in the same process) logs at a level its
        # configure_logger creates, which the disabled import skipped
        if "METRIC" not in logger._core.levels:
            logger.level("METRIC", no=38, color="<yellow>", icon="📈")
    return quantize_weight


def quantize_args(group_size: int, actorder: str | None):
    """``actorder`` "static": llm-compressor's ``weight`` ordering (its default; static groups)."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                            actorder="weight" if actorder == "static" else None, dynamic=False)


def _chunks(items: list[tuple[Unit, torch.Tensor, torch.Tensor]], size: int) -> list[list[int]]:
    """Item positions in chunks of at most ``size`` units of one shape, scale dtype and device: a
    fixed partition (item order within each shape), independent of memory and threads."""
    by_shape: dict[tuple, list[int]] = {}
    for i, (u, w, h) in enumerate(items):
        by_shape.setdefault((tuple(w.shape), u.scale_dtype, str(w.device)), []).append(i)
    return [idx[j: j + size] for idx in by_shape.values() for j in range(0, len(idx), size)]


def group_scales(w: torch.Tensor, h: torch.Tensor, group_size: int, observer: str, sdt: torch.dtype,
                 search: str = "hessian") -> torch.Tensor:
    """The static group scales GPTQ's update rounds to: ``search`` "hessian", each group's clipping
    chosen for the least error weighted by the Hessian's diagonal (``int4.weighted_scale``); "rtn",
    the observer's own scale (llm-compressor's)."""
    if search == "hessian":
        return int4.weighted_scale(w, h.diagonal(), group_size, observer, sdt)
    return rtn(w, group_size, observer, sdt).scale


def coordinate_optimum(w: torch.Tensor, h: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Per weight of ``w`` [..., out, in], the value that minimises the layer's error under the
    Hessian ``h`` [..., in, in], ``tr((w - wq) h (w - wq)^T)``, with every other weight at ``wq``
    (GPTQ's output): ``wq + ((w - wq) h) / diag(h)``. Its distance to a rounding boundary is what
    moving that one code to its neighbour costs (nan where the diagonal is 0: no input reached it)."""
    r = (w - wq).to(torch.float32)
    d = torch.diagonal(h, dim1=-2, dim2=-1).to(torch.float32).unsqueeze(-2)
    return wq.to(torch.float32) + (r @ h.to(torch.float32)) / torch.where(d > 0, d, torch.nan)


def _update(quantize_weight, qargs, items, chunk: list[int], group_size: int, observer: str, block: int,
            damp: float, search: str = "hessian", quotients: bool = False) -> list[tuple]:
    """One llm-compressor ``quantize_weight`` call over the stacked ``chunk``: (position, result,
    Hessian failed, loss) per unit, and (``quotients``) each weight's ``coordinate_optimum`` in codes
    (/ scale: [out, in] float32)."""
    ws = [items[i][1] for i in chunk]
    sdt = items[chunk[0]][0].scale_dtype
    scales = torch.stack([group_scales(w, items[i][2], group_size, observer, sdt, search) for i, w in zip(chunk, ws)])
    W = torch.stack([w.to(torch.float32) for w in ws])
    H = torch.stack([items[i][2].to(torch.float32) for i in chunk])
    zp = torch.zeros(scales.shape, dtype=torch.int8, device=scales.device)
    with torch.no_grad():
        wq, losses, fallback = quantize_weight(W, H, scales, zp, None, qargs, blocksize=block, percdamp=damp)
    del W, H
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=-1)
    codes = (wq.to(torch.float32) / s).round_().clamp_(int4.QMIN, int4.QMAX).to(torch.int8)
    quot = None
    if quotients:  # the inputs again: quantize_weight worked in W and H
        with torch.no_grad():
            quot = torch.stack([coordinate_optimum(w.to(torch.float32), items[i][2], wq[j])
                                for j, (i, w) in enumerate(zip(chunk, ws))]) / s
    fallback, losses = fallback.tolist(), losses.tolist()
    return [(i, Result(codes[j].cpu(), scales[j].cpu(), "gptq"), bool(fallback[j]), float(losses[j]),
             None if quot is None else quot[j].cpu()) for j, i in enumerate(chunk)]


def quantize(items: list[tuple[Unit, torch.Tensor, torch.Tensor]], group_size: int, observer: str, actorder: str | None,
             block: int, damp: float, workers: int, batched: bool | None = None,
             search: str = "hessian", quotients: bool = False) -> list[tuple]:
    """``items``: (unit, weight [out, in] fp32, Hessian [in, in]) -> (result, Hessian failed and
    RTN was used, GPTQ loss, with ``quotients`` each weight's ``coordinate_optimum`` in codes, else
    None) per item, in order. ``batched``: the GPU's way (below) on any device; None: on a GPU only.

    On the CPU: chunks of ``CHUNK`` same-shape units go to llm-compressor in a fixed partition,
    each on one torch thread (a Cholesky factorization differs in its last bits between thread
    counts; this way the output does not), several chunks in parallel on ``workers`` threads.

    On a GPU: no threads (CUDA's lazily loaded linear-algebra library must not be first called
    from two threads at once, and one stream serializes them anyway): the same-shape units, up
    to ``GPU_CHUNK``, stacked into one batched call (llm-compressor batches its Cholesky from 16
    on), one after another on the calling thread."""
    quantize_weight = _llmcompressor_update()
    qargs = quantize_args(group_size, actorder)
    gpu = any(w.is_cuda for _, w, _ in items) if batched is None else batched
    chunks = _chunks(items, GPU_CHUNK if gpu else CHUNK)
    negative = int4.GRIDS[observer].signed

    def run(chunk: list[int]):
        return _update(quantize_weight, qargs, items, chunk, group_size, observer, block, damp, search, quotients)

    if gpu:
        with _triton_off(negative):
            done = [run(chunk) for chunk in chunks]
    else:
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with _triton_off(negative), ThreadPoolExecutor(max(1, workers)) as pool:
                done = list(pool.map(run, chunks))
        finally:
            torch.set_num_threads(old)
    out: list = [None] * len(items)
    for res in done:
        for i, *got in res:
            out[i] = tuple(got)
    return out


class GPTQ(Method):
    """``--method gptq``: Hessians and reference outputs from the source layer on the carried
    (quantized-path) inputs, as llm-compressor's sequential pipeline; the update per unit."""

    name = "gptq"
    source_stream = False
    streams_experts = True  # statistics per unit: a MoE layer's routed experts go a group at a time
    splits_samples = True  # on several ranks each runs its own samples (Hessians combined in a fixed shard tree)
    report_fields = ("damp", "block", "actorder", "scale_search", "asym", "skip_rtn_loss")
    title = ("GPTQ: llm-compressor's `quantize_weight` (its GPTQ update) on static groups, Hessians from this "
             "model's own layer-by-layer calibration forward")
    loss_target = "the source layer's output on the same (quantized-path) inputs"

    def layer_step(self, layer: Layer) -> Step:
        x = layer
        hooks = Hessians(x.module, x.units, x.options.all_experts, x.fwd.total or len(x.hidden), x.paired)
        try:
            # --asym measures the loss against what it aims at, the source model's own output (``targets``):
            # this pass's outputs are then not kept
            ref, _ = x.fwd(x.module, x.hidden, x.topk, x.index, "of the source layer", keep=not x.source_target,
                           collector=hooks, source=x.sources if hooks.asym else None, source_topk=x.source_topk)
        finally:
            hooks.remove()
        results = shared_results(self, x, hooks)
        if x.source_target:
            ref = x.targets
        if x.options.skip_rtn_loss:  # the report's RTN loss not measured (the pass takes the norm from its own)
            return Step(results, ref, hooks.routed, None, None)
        x.put(x.rtn)
        _, _, (e_rtn, tot) = x.fwd(x.module, x.hidden, x.topk, x.index, "after the RTN layer", keep=False, ref=ref)
        return Step(results, ref, hooks.routed, e_rtn, tot)

    def streamed_step(self, fwd, module, stand, layer: Layer, write_group):
        from .streamed import gptq_step

        results, ref, routed, e_rtn, tot, acc_q, phases = gptq_step(self, fwd.streamer, fwd, module, stand, layer,
                                                                    write_group, Hessians, shared_results)
        return Step(results, ref, routed, e_rtn, tot, {"phase_seconds": phases}), acc_q

    def target_of(self, report: dict) -> str:
        if report.get("asym"):
            return "the source model's own output of this layer (--asym aims there; it includes the error the " \
                   "layers before it left)"
        return self.loss_target

    def grid_proof(self, scale: torch.Tensor, rtn_scale: torch.Tensor, observer: str) -> str | None:
        """GPTQ fixes its scales before its update: the RTN ones bit for bit (--scale-search rtn), or
        (hessian) each the grid's scale of the group's range shrunk by at most WEIGHTED_MAXSHRINK, so
        each |scale| lies within [1 - WEIGHTED_MAXSHRINK, 1] x RTN's (each end widened by the scale
        dtype's rounding), with the same sign."""
        if int4.bitwise_diff(scale, rtn_scale) is None:
            return None
        tiny = torch.finfo(torch.float32).tiny
        s, r = scale.float().reshape(-1), rtn_scale.float().reshape(-1)
        ratio = s / r.abs().clamp_min(tiny) * r.sign()
        lo, hi = (1 - int4.WEIGHTED_MAXSHRINK) * (1 - 2**-7), 1 + 2**-7
        bad = int(((ratio < lo) | (ratio > hi)).sum())
        if not bad:
            return None
        return (f"{bad} GPTQ group scales lie outside [{1 - int4.WEIGHTED_MAXSHRINK:g}, 1] x the {observer} grid's "
                f"(min {float(ratio.min()):.3f}, max {float(ratio.max()):.3f}): not made from this source")

    def card_section(self, report: dict) -> str:
        search = report.get("scale_search") or "rtn"
        return (f"act-order {report.get('actorder') or 'off'} (static groups, no g_idx), "
                f"dampening {report.get('damp')}, block {report.get('block')}, group scales "
                + ("searched against the Hessian-weighted error" if search == "hessian" else "the grid's RTN ones")
                + (f"; asymmetric calibration {report['asym']:g} (the weights that read the residual stream aim "
                   "at the source model's own outputs)" if report.get("asym") else ""))

    @staticmethod
    def results(x: Layer, hooks: Hessians, quotients: dict | None = None) -> dict[str, Result]:
        """GPTQ per unit; RTN (named in ``x.fallbacks``) for an expert below --min-expert-tokens,
        a unit no token reached, or a Hessian llm-compressor could not factorize. ``quotients``:
        filled per unit it ran with each weight's ``coordinate_optimum`` in codes."""
        opt = x.options
        results: dict[str, Result] = {}
        items = []
        why: dict[str, str] = {}  # unit key -> why it stays at RTN; named in the units' order below
        for u in x.units:
            n = hooks.tokens.get(u.key, 0)
            h = hooks.normalized(u.key)
            if u.expert is not None and n < opt.min_expert_tokens or h is None:
                results[u.key] = rtn(x.originals[u.key], opt.group_size, opt.observer, u.scale_dtype)
                why[u.key] = f"{n} calibration tokens < --min-expert-tokens {opt.min_expert_tokens}"
                continue
            w = x.originals[u.key]
            c = hooks.normalized(cross_key(u.key))
            if c is not None:  # --asym: the update aims at the source stream's output
                w = asym_target(w, h, c, opt.damp, opt.asym)
            items.append((u, w, h))
        done = quantize(items, opt.group_size, opt.observer, opt.actorder, opt.block, opt.damp, x.fwd.workers,
                        search=opt.scale_search or "hessian", quotients=quotients is not None)
        for (u, _, _), (res, failed, _loss, quot) in zip(items, done):
            if failed:
                res = Result(res.codes, res.scale, "rtn")
                why[u.key] = "Hessian not positive definite after dampening (raise --damp or add samples)"
            elif quot is not None:
                quotients[u.key] = quot
            results[u.key] = res
        for u in x.units:
            if u.key in why:
                x.fallbacks.extend({"name": name, "reason": why[u.key]} for name, _, _ in u.names)
        return {u.key: results[u.key] for u in x.units}


def corrects(u: Unit) -> bool:
    """Whether ``--asym`` corrects unit ``u``: one whose roles all read the residual stream
    (``archs.base.RESIDUAL_INPUT_ROLES``: an attention or MLP input projection, a routed expert's
    gate/up), not one that reads another projection of the layer (o, q_b, kv_b, down)."""
    from ..archs.base import RESIDUAL_INPUT_ROLES

    return bool(u.roles) and all(r in RESIDUAL_INPUT_ROLES for r in u.roles)


def asym_target(w: torch.Tensor, h: torch.Tensor, c: torch.Tensor, damp: float, alpha: float) -> torch.Tensor:
    """GPTAQ's asymmetric target (Li et al. 2025): the weight whose outputs on the quantized-path inputs
    X~ best match the source weight's on the source stream's inputs X, argmin ||X~ T^T - X W^T||,
    T = W C^T H^-1 = W + W (C - H)^T H^-1 (``h`` = 2 X~^T X~ / n, ``c`` = 2 X~^T X / n, [in, in]; H
    dampened by ``damp`` of its mean diagonal as GPTQ's update is, so equal streams give W itself);
    -> W + ``alpha`` (T - W), in float64, in ``w``'s dtype. Then GPTQ rounds it against H."""
    hd = h.double().clone()  # dampened in place below: never the caller's tensor
    wd = w.double()
    rhs = (c.double() - hd) @ wd.t()
    d = hd.diagonal()
    d += damp * float(d.mean())
    step = torch.linalg.solve(hd, rhs).t()
    return (wd + alpha * step).to(w.dtype)


def gptq_cost(w: torch.Tensor) -> float:
    """What one unit's GPTQ costs, about: its update (rows x columns^2) and its Hessian's
    factorisation (columns^3)."""
    rows, cols = w.shape[0], w.shape[-1]
    return float(rows * cols * cols + cols ** 3)


def shared_results(method, x: Layer, hooks: Hessians) -> dict[str, Result]:
    """``method.results`` for units whose Hessians sum every rank's samples (the Linear units; with
    the samples split over ranks, ``x.fwd.world``): the units spread over the ranks by their cost
    (``distributed.balance``), each unit's Hessian combined on its rank, which runs its update;
    every rank then gets every result. The fallbacks go to rank 0, which reports them in the units'
    order, as one process does."""
    from dataclasses import replace

    from ..distributed import balance

    world = x.fwd.world
    if not x.units:  # nothing to quantize here (a streamed layer under --profile experts), on every rank alike
        return {}
    split = world is not None and world.size > 1
    linear = [u for u in x.units if u.expert is None]
    owners = {}
    if split:  # a routed expert here (a whole layer's, one process's path) stays with rank 0
        owners = dict(zip([u.key for u in linear], balance([gptq_cost(x.originals[u.key]) for u in linear],
                                                           world.size)))
    if linear:  # Linear units hooked: their Hessians in the shards' tree
        hooks.combine(world, f"layer {x.index} Hessians", owners, device=torch.device(x.fwd.device))
    if not split:
        return method.results(x, hooks)
    mine = [u for u in x.units if owners.get(u.key, 0) == world.rank]
    fallbacks: list[dict] = []
    res = method.results(replace(x, units=mine, fallbacks=fallbacks), hooks) if mine else {}
    # CPU tensors travel (an RTN fallback's are on the layer's device)
    res = {k: Result(r.codes.cpu(), r.scale.cpu(), r.how) for k, r in res.items()}
    got = world.gather((res, fallbacks), f"layer {x.index} GPTQ of the Linear units")
    if world.is_writer:
        order = {name: k for k, u in enumerate(x.units) for name, _, _ in u.names}
        x.fallbacks.extend(sorted((f for _, fb in got for f in fb), key=lambda f: order.get(f["name"], -1)))
    return {u.key: got[owners.get(u.key, 0)][0][u.key] for u in x.units}
