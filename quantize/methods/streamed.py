"""A MoE layer's pass with its routed experts streamed: what the layer pass runs for a method
whose statistics are per unit (GPTQ: ``Method.streams_experts``) and for every layer it only
carries through (no INT4 unit, or replayed on resume).

The layer is built without its routed experts (``calibrate/experts.py``: a ``StandIn`` records
what the router hands them, or returns their output). Per layer, for GPTQ:

1. **capture** every sample through the source layer (the Linear units' Hessians hooked here),
   through the layer with the Linear units at RTN, and (after GPTQ on the Linear units) with
   them quantized: three records of the experts' inputs;
2. **the routed experts, a group at a time** (at most ``--memory-budget-gib`` of weights,
   Hessians and working copies): read, their Hessians from the source capture (the same sums in
   the same sample order as the whole layer's hooks), GPTQ, the group's codes and scales written
   to their own layer file, and the experts' outputs of the three captures accumulated exactly
   as transformers' experts forward accumulates them (source, RTN and quantized weights);
3. **replay** the three passes with those outputs: the source layer's output (the reference),
   the RTN error, and the quantized layer's output for the next layer.

The RTN pass serves the report alone (its RTN loss): ``--skip-rtn-loss`` leaves it out, two
captures, expert outputs and replays instead of three, the same bytes.

Every number is the whole layer's, bit for bit (tests/test_expert_stream.py): the attention runs
twice as often (capture and replay), the routed experts' weights are read once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..calibrate.experts import accumulate, expert_bytes
from .base import Layer
from .forward import Captured, in_order
from .store import HiddenStore
from .units import Result, Unit, by_expert, cross_key, dequant, install, rtn, split

FP32 = 4


class Phases:
    """Seconds spent per phase of a streamed layer (a GPU's queue drained at each boundary, so the
    figures are the phases' own): what a layer report's ``phase_seconds`` says of where time went."""

    def __init__(self, device: str):
        import time

        self._clock = time.perf_counter
        self._cuda = torch.device(device) if str(device).startswith("cuda") else None
        self.seconds: dict[str, float] = {}
        self._t = self._clock()

    def lap(self, name: str) -> None:
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
        t = self._clock()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + t - self._t, 3)
        self._t = t


@dataclass
class Variant:
    """One capture of a streamed layer and the expert weights its outputs are computed with:
    ``weights(group, gate_up, down)`` -> the group's (gate_up, down) for this variant, from the
    source ones."""

    captured: Captured
    weights: object
    acc: HiddenStore | None = None


def _zeros_like(store: HiddenStore, budget, spill, name: str) -> HiddenStore:
    """One zero tensor per sample, shaped as ``store``'s: the per-sample expert output accumulators."""
    acc = HiddenStore(budget, spill, name)
    for h in store:
        acc.append(torch.zeros_like(h))
    return acc


def run_groups(streamer, fwd, i: int, stand, variants: list[Variant], per_expert: int, before_outputs=None,
               groups: list[range] | None = None, phases: Phases | None = None) -> None:
    """The routed experts (all of the layer's, or the given ``groups``) a group at a time: for each
    group, ``before_outputs(group, gate_up, down)`` (a method's statistics and quantization of the
    group), then each variant's outputs accumulated into its ``acc`` (created here, one zero
    tensor per sample)."""
    dev = fwd.device
    for v in variants:
        v.acc = _zeros_like(v.captured.hidden, fwd.budget, fwd.spill, f"a{i}")
    if groups is None:
        groups = streamer.expert_groups(per_expert, range(stand.num_experts))
    for g in groups:
        gate_up, down = streamer.expert_weights(i, g, dev)
        if phases is not None:
            phases.lap("expert_read")
        if before_outputs is not None:
            before_outputs(g, gate_up, down)
        for v in variants:
            gu, dn = v.weights(g, gate_up, down)
            if batched(dev):
                _outputs_on_gpu(v, g, gu, dn, stand.act_fn, dev)
                del gu, dn
                continue

            def one(s: int, v=v, gu=gu, dn=dn):
                r = v.captured[s]
                r.hidden, r.index, r.weights = r.hidden.to(dev), r.index.to(dev), r.weights.to(dev)
                a = v.acc[s].to(dev)
                with torch.no_grad():
                    accumulate(a, r, g, gu, dn, stand.act_fn)
                return a

            for s, a in enumerate(in_order(fwd.pool, fwd.workers, one, range(len(v.captured)))):
                v.acc.update(s, a)
            del gu, dn
        del gate_up, down
        if phases is not None:
            phases.lap("expert_outputs")


GPU_OUTPUT_TOKENS = 1 << 15  # on a GPU, the tokens of consecutive samples a group's experts run at once


def batched(dev) -> bool:
    """Whether a group's experts take many samples' tokens at once (a GPU) or one sample at a time
    (the CPU: the whole layer's sums bit for bit)."""
    return str(dev).startswith("cuda")


def token_chunks(tokens: list[int], limit: int) -> list[list[int]]:
    """Consecutive samples (by position; ``tokens``: each one's token count) in runs of at most
    ``limit`` tokens, one sample at least: a fixed partition, the same on every run."""
    out: list[list[int]] = []
    cur, n = [], 0
    for s, t in enumerate(tokens):
        if cur and n + t > limit:
            out.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += t
    if cur:
        out.append(cur)
    return out


def _sample_chunks(cap, dev):
    """A capture's consecutive samples as ``token_chunks`` cuts them (``GPU_OUTPUT_TOKENS``), each
    run concatenated on ``dev``: (its samples, their tokens each, one ``Routed`` of them all)."""
    from ..calibrate.experts import Routed

    for chunk in token_chunks([int(cap.index[s].shape[0]) for s in range(len(cap))], GPU_OUTPUT_TOKENS):
        rs = [cap[s] for s in chunk]
        yield chunk, [int(r.index.shape[0]) for r in rs], Routed(
            torch.cat([r.hidden.to(dev).reshape(-1, r.hidden.shape[-1]) for r in rs]),
            torch.cat([r.index.to(dev) for r in rs]), torch.cat([r.weights.to(dev) for r in rs]))


def _routed_batches(cap, dev):
    """What the router handed the experts, as (hidden [T, H], top-k index [T, K], the source stream's
    hidden at the same tokens or None: ``Captured.source``) on ``dev``: per sample on the CPU (the
    whole layer's hooks' sums, in their order, bit for bit); on a GPU the samples concatenated
    (``_sample_chunks``), so that each expert's Hessian term is one product over thousands of tokens
    instead of one per sample (the same sum, other roundings)."""
    src = cap.source

    def flat(t):
        return t.to(dev).reshape(-1, t.shape[-1])

    if not batched(dev):
        for s in range(len(cap)):
            r = cap[s]
            yield flat(r.hidden), r.index.to(dev), flat(src[s]) if src is not None else None
        return
    for chunk, _, r in _sample_chunks(cap, dev):
        yield r.hidden, r.index, torch.cat([flat(src[s]) for s in chunk]) if src is not None else None


def _outputs_on_gpu(v: Variant, g: range, gu, dn, act_fn, dev) -> None:
    """A group's experts' outputs for every sample of ``v``, on a GPU: the samples' routed tokens
    concatenated up to ``GPU_OUTPUT_TOKENS`` at a time (``token_chunks``), each expert one product
    over all of them instead of one per sample (the CPU's way, which is launch-bound on a GPU).
    Each token still gets its experts' outputs added in ascending expert order onto its sample's
    accumulator (``accumulate``); only the products' row blocking differs from a per-sample run."""
    for chunk, sizes, r in _sample_chunks(v.captured, dev):
        a = torch.cat([v.acc[s].to(dev) for s in chunk])
        with torch.no_grad():
            accumulate(a, r, g, gu, dn, act_fn)
        for s, part in zip(chunk, a.split(sizes)):
            v.acc.update(s, part)
        del r, a


def source_weights(g, gate_up, down):
    return gate_up, down


def with_results(result, units_by_expert: dict[int, list[Unit]]):
    """A variant's weights: the source group's, with every unit that has a result (``result(u)``,
    or None) replaced by ``q * scale`` (as ``Layer.put`` installs it in the whole layer)."""

    def weights(g, gate_up, down):
        gu, dn = gate_up, down
        replaced = False
        for j, e in enumerate(g):
            for u in units_by_expert.get(e, ()):
                res = result(u)
                if res is None:
                    continue
                if not replaced:
                    gu, dn, replaced = gate_up.clone(), down.clone(), True
                target = gu if u.path.endswith("gate_up_proj") else dn
                target[j].copy_(dequant(res).to(target.device))
        return gu, dn

    return weights


GPU_EXPERT_SHARE = 0.4  # of a GPU's memory, for one group of routed experts (weights, Hessians, GPTQ's copies)


def expert_budget(device: str, host_budget: int) -> int:
    """Bytes one group of routed experts may hold: on a GPU, where the group lives, a fixed share of
    its memory (its total, not what is free: the same groups, so the same bytes, on every run on
    that GPU); on the CPU, ``--memory-budget-gib``."""
    if not str(device).startswith("cuda"):
        return host_budget
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory * GPU_EXPERT_SHARE)


def per_expert_bytes(streamer, hessians: bool, paired: bool = False) -> int:
    """What one routed expert costs a group: its source weights and two variants' copies, plus
    (GPTQ) its Hessians with their normalised and factorised copies (``paired``, GPTQ --asym: and
    gate/up's cross term)."""
    h_dim, i_dim = streamer.expert_dims()
    w = expert_bytes(h_dim, i_dim, torch.float32)
    if not hessians:
        return 2 * w
    if paired:
        w += h_dim * h_dim * FP32
    # the accumulators, llm-compressor's stacked copy of a chunk and its factorisation's working copies
    # (measured at DeepSeek-V3's width: 4 copies per expert left a 16-expert layer at 6.4 GiB, over budget)
    return 3 * w + 6 * (h_dim * h_dim + i_dim * i_dim) * FP32


def carry(streamer, fwd, layer, stand, i: int, hidden, topk, what: str, result=None,
          units_by_expert: dict | None = None, ref: HiddenStore | None = None):
    """Every sample through a streamed layer with the layer's current weights and its routed
    experts at the source weights, or at ``result(u)`` for the units that have one: the layer's
    outputs and top-k (and the error against ``ref``), as ``Forward`` gives them for a whole layer."""
    cap = fwd.capture(layer, stand, hidden, topk, i)
    w = with_results(result, units_by_expert or {}) if result is not None else source_weights
    v = Variant(cap, w)
    run_groups(streamer, fwd, i, stand, [v], per_expert_bytes(streamer, False))
    cap.clear()
    got = fwd(layer, hidden, topk, i, what, stand=stand, replay=v.acc, ref=ref)
    v.acc.clear()
    return got


def _group_gptq(method, streamer, hooks, g: range, gate_up, down, us: list[Unit], cap_s, opt, fwd, fallbacks,
                act_fn, i: int, phases: Phases | None = None, quotients: dict | None = None
                ) -> tuple[dict[str, Result], dict[str, Result]]:
    """One group of routed experts under GPTQ: their Hessians from the source capture (per sample,
    merged in sample order, as the whole layer's hooks; on a GPU a chunk of samples at a time,
    ``_routed_batches``), then GPTQ per unit: (results, RTN start). ``quotients``: filled as
    ``GPTQ.results`` fills it (AutoRound's start, ``methods/start.py``)."""
    # per sample in order, the group's experts side by side (each thread its own accumulator), each
    # product added as it is made: the whole layer's sums without a per-sample copy of the group's Hessians
    path = streamer.experts_path
    gate_up_units = {u.expert: u for u in us if u.path.endswith("gate_up_proj")}
    down_units = {u.expert: u for u in us if u.path.endswith("down_proj")}
    experts = sorted(set(gate_up_units) | set(down_units))
    for hidden, index, source in _routed_batches(cap_s, fwd.device):

        def obs(e: int, hidden=hidden, index=index, source=source):
            return e, hooks.expert(e, gate_up_units.get(e), down_units.get(e), gate_up[e - g.start], act_fn, hidden,
                                   index, hooks.observe_one, source)

        for e, n in fwd.pool.map(obs, experts):
            hooks.routed[(path, e)] = hooks.routed.get((path, e), 0) + n
    if phases is not None:
        phases.lap("expert_hessians")
    originals = {u.key: (gate_up if u.path.endswith("gate_up_proj") else down)[u.expert - g.start] for u in us}
    init = {u.key: rtn(originals[u.key], opt.group_size, opt.observer, u.scale_dtype) for u in us}
    res = method.results(Layer(i, None, us, originals, init, None, None, None, fallbacks, opt, fwd), hooks, quotients)
    for u in us:
        for d in (hooks.H, hooks.n, hooks.tokens):
            d.pop(u.key, None)
            d.pop(cross_key(u.key), None)
    if phases is not None:
        phases.lap("expert_gptq")
    return res, init


def _tensors(us: list[Unit], res: dict[str, Result]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A group's layer-file tensors and each module's method."""
    tensors, how = {}, {}
    for u in us:
        tensors.update(split(u, res[u.key]))
        for name, _, _ in u.names:
            how[name] = res[u.key].how
    return tensors, how


def put_linear(layer, linear: list[Unit], originals: dict, res: dict | None, device) -> None:
    """Install the Linear units of a streamed layer: ``res``'s results (``q * scale``), or the source
    weights (``res`` None)."""
    for u in linear:
        install(layer, u, (originals[u.key] if res is None else dequant(res[u.key])).to(device))


def gptq_step(method, streamer, fwd, layer, stand, x: Layer, write_group, Hessians, shared_results):
    """GPTQ on a streamed layer (module docstring): the Linear units' results, the reference
    store, the routed token counts, the RTN error, the reference's squared norm, and the
    quantized layer's routed expert outputs (for ``Forward(..., stand=, replay=)``), as
    ``GPTQ.layer_step`` gives them for the whole layer. ``x.originals`` and ``x.rtn`` hold the
    Linear units only; ``write_group(first expert, tensors, {module: method})`` stores one group.

    Several ranks (``quantize.distributed``; every rank runs this for its own calibration samples,
    ``fwd.world``): the captures run on each rank's samples, the Linear units' Hessians are
    combined on rank 0 (``gptq.shared_results``), and the routed experts are split in fixed
    contiguous ranges (``World.owned``), each rank GPTQ-ing its own from every rank's captures
    (``_split_experts``). ``Hessians`` and ``shared_results``: the method's statistics hooks and
    its update of the Linear units (``methods/gptq.py``, which calls this)."""
    opt, i = x.options, x.index
    world = fwd.world
    linear = [u for u in x.units if u.expert is None]
    experts = by_expert(x.units)
    phases = Phases(fwd.device)
    hooks = Hessians(layer, linear, opt.all_experts, fwd.total or len(x.hidden), x.paired)
    try:
        cap_s = fwd.capture(layer, stand, x.hidden, x.topk, i, collector=hooks,
                            source=x.sources if hooks.pairs else None, source_topk=x.source_topk)
    finally:
        hooks.remove()
    phases.lap("capture")

    def put(res):
        put_linear(layer, linear, x.originals, res, fwd.device)

    rtn_loss = not opt.skip_rtn_loss  # the report's RTN loss: its own capture, expert outputs and replay
    cap_r = None
    if rtn_loss:
        put(x.rtn)
        cap_r = fwd.capture(layer, stand, x.hidden, x.topk, i)
        phases.lap("capture")
    results = shared_results(method, Layer(i, layer, linear, x.originals, x.rtn, x.hidden, x.topk, None, x.fallbacks,
                                           opt, fwd), hooks)
    for u in linear:
        hooks.H.pop(u.key, None)
    phases.lap("linear_gptq")
    put(results)
    cap_q = fwd.capture(layer, stand, x.hidden, x.topk, i)
    phases.lap("capture")
    kinds = ("source", "rtn", "quantized") if rtn_loss else ("source", "quantized")
    caps = (cap_s, cap_r, cap_q) if rtn_loss else (cap_s, cap_q)
    if world is not None and world.size > 1:
        accs = _split_experts(world, method, streamer, fwd, stand, hooks, caps, kinds, experts, x, write_group,
                              reference=not x.source_target)
        phases.lap("experts")  # the routed experts' phases and the exchanges between ranks together
    else:
        cur: dict[str, Result] = {}  # this group's results
        cur_rtn: dict[str, Result] = {}

        def group_step(g, gate_up, down):
            cur.clear()
            cur_rtn.clear()
            us = [u for e in g for u in experts.get(e, ())]
            if not us:
                return
            res, init = _group_gptq(method, streamer, hooks, g, gate_up, down, us, cap_s, opt, fwd, x.fallbacks,
                                    stand.act_fn, i, phases)
            cur.update(res)
            cur_rtn.update(init)
            write_group(g.start, *_tensors(us, res))

        weights = {"source": source_weights, "rtn": with_results(lambda u: cur_rtn.get(u.key), experts),
                   "quantized": with_results(lambda u: cur.get(u.key), experts)}
        # the source weights' outputs: the reference (--asym has its own, the targets)
        variants = {k: Variant(c, weights[k]) for k, c in zip(kinds, caps) if k != "source" or not x.source_target}
        run_groups(streamer, fwd, i, stand, list(variants.values()), per_expert_bytes(streamer, True, hooks.pairs),
                   before_outputs=group_step,
                   phases=phases)
        accs = {k: v.acc for k, v in variants.items()}
    for c in caps:
        c.clear()
    put(None)
    if x.source_target:  # --asym: the loss against the source model's own output, which it aims at
        ref = x.targets
    else:
        ref, _ = fwd(layer, x.hidden, x.topk, i, "of the source layer", stand=stand, replay=accs["source"])
        accs["source"].clear()
    e_rtn = tot = None  # --skip-rtn-loss: not measured (the pass takes the norm from its own replay)
    if rtn_loss:
        put(x.rtn)
        _, _, (e_rtn, tot) = fwd(layer, x.hidden, x.topk, i, "after the RTN layer", keep=False, ref=ref, stand=stand,
                                 replay=accs["rtn"])
        accs["rtn"].clear()
    put(results)
    phases.lap("replay")
    return results, ref, hooks.routed, e_rtn, tot, accs["quantized"], phases.seconds


EXCHANGE_BYTES = 256 << 20  # the most of one exchange between ranks in flight at once (less under a small budget)


def exchange_slices(sizes: list[int], limit: int) -> list[range]:
    """Consecutive items (by position in ``sizes``, their bytes) in runs of at most ``limit`` bytes,
    one item at least: what one collective of ``_split_experts`` carries."""
    out, start, acc = [], 0, 0
    for k, b in enumerate(sizes):
        if k > start and acc + b > limit:
            out.append(range(start, k))
            start, acc = k, 0
        acc += b
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _exchange_limit(fwd) -> int:
    return max(1, min(EXCHANGE_BYTES, fwd.budget.limit // 8))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def broadcast_slices(world, o: int, count: int, read, nbytes, limit: int, what: str):
    """Rank ``o``'s items ``read(0 .. count - 1)`` (``count`` matters on ``o`` alone) broadcast to every
    rank, a slice of consecutive items at a time (at most ``limit`` bytes by ``nbytes(item)`` per
    collective, one item at least): yields each slice's items, on every rank, until ``o`` has sent them all."""
    s, held, more = 0, None, True
    while more:
        msg = None
        if world.rank == o:
            items, n = [], 0
            while s < count:
                r = held or read(s)
                b = nbytes(r)
                held = None
                if items and n + b > limit:
                    held = r  # the next slice's first item, already read
                    break
                items.append(r)
                n += b
                s += 1
            msg = (items, s < count)
        items, more = world.broadcast(msg, what, src=o)
        yield items


def _all_captures(world, caps, fwd, i: int, limit: int):
    """Every rank's samples' captures (``caps``: source, RTN, quantized Linear units) on every rank,
    in sample order (rank by rank), sent by each rank a slice at a time (at most ``limit`` bytes
    per collective, one sample at least) into stores on this rank's budget (spilled beyond it).
    -> (the captures, each sample's input (shape, dtype), its bytes, its top-k)."""
    from .forward import Captured

    src = caps[0].source  # GPTQ --asym: the source stream's expert inputs travel with the source capture
    full = [Captured(HiddenStore(fwd.budget, fwd.spill, f"x{v}-{i}"),
                     HiddenStore(fwd.budget, fwd.spill, f"xs-{i}") if v == 0 and src is not None else None)
            for v in range(len(caps))]
    shapes, sizes, topk = [], [], []

    def read(s: int) -> list:
        return [(c.hidden[s], c.index[s], c.weights[s]) for c in caps] + (
            [(src[s], None, None)] if src is not None else [])

    for o in range(world.size):
        for items in broadcast_slices(world, o, len(caps[0]), read, lambda r: sum(_nbytes(x[0]) for x in r), limit,
                                      f"layer {i} routed experts' inputs from rank {o}"):
            for r in items:
                for v, (hidden, index, weights) in enumerate(r[:len(full)]):
                    full[v].hidden.append(hidden)
                    full[v].index.append(index)
                    full[v].weights.append(weights)
                if src is not None:
                    full[0].source.append(r[len(full)][0])
                shapes.append((r[0][0].shape, r[0][0].dtype))
                sizes.append(_nbytes(r[0][0]))
                topk.append(r[0][1].shape[-1])
            del items
    for c in caps:
        c.clear()
    return full, shapes, sizes, topk


def _split_experts(world, method, streamer, fwd, stand, hooks, caps, kinds: tuple[str, ...],
                   by_expert: dict[int, list[Unit]], x: Layer, write_group,
                   reference: bool = True) -> dict[str, HiddenStore | None]:
    """The routed experts of a streamed GPTQ layer on several ranks, each holding its own samples'
    captures (``caps``, of ``kinds``: source, RTN (absent under --skip-rtn-loss), quantized Linear
    units). Every rank gets every rank's captures
    (rank order = sample order; ``_all_captures``), takes its contiguous range of experts a group at
    a time, their Hessians from the source capture of every sample (the same sums in the same sample
    order as one process), GPTQ, and each expert's weighted output for the tokens routed to it in the
    captures (``contributions``, kept per sample in stores on the budget). Those go to the rank
    holding the sample, a slice of its samples at a time, which adds them rank by rank, i.e. expert
    by expert ascending, into zeros: transformers' ``index_add_`` sequence, the same as one
    process's ``accumulate``. What any collective carries is bounded (``exchange_slices``), and
    what a rank holds lives on its --memory-budget-gib (disk beyond). Rank 0 writes every group
    file and gets every rank's fallbacks and token counts. Returns this rank's samples' expert-output
    stores by kind (``reference`` False: the source weights' outputs not computed and None; GPTQ
    --asym measures against the source model's own outputs instead)."""
    from ..calibrate.experts import contributions
    from ..distributed import samples_of

    i, opt, dev = x.index, x.options, fwd.device
    limit = _exchange_limit(fwd)
    full, shapes, sizes, topk = _all_captures(world, caps, fwd, i, limit)
    n, nv = len(full[0]), len(full)
    outs = [HiddenStore(fwd.budget, fwd.spill, f"o{v}-{i}") for v in range(nv)]  # this rank's experts' outputs
    where: list[list[list]] = [[[] for _ in range(n)] for _ in range(nv)]  # [v][s] -> [(position, rows, counts)]
    mine = {"groups": [], "fallbacks": [], "routed": {}}
    for g in streamer.expert_groups(per_expert_bytes(streamer, True, hooks.pairs), world.owned(stand.num_experts)):
        gate_up, down = streamer.expert_weights(i, g, dev)
        us = [u for e in g for u in by_expert.get(e, ())]
        res, init = ({}, {})
        if us:
            res, init = _group_gptq(method, streamer, hooks, g, gate_up, down, us, full[0], opt, fwd,
                                    mine["fallbacks"], stand.act_fn, i)
            if world.is_writer:
                write_group(g.start, *_tensors(us, res))
            else:  # CPU tensors travel (an RTN fallback's are on this rank's device)
                tensors, how = _tensors(us, res)
                mine["groups"].append((g.start, {k: t.cpu() for k, t in tensors.items()}, how))
        weights = {"source": source_weights, "rtn": with_results(lambda u: init.get(u.key), by_expert),
                   "quantized": with_results(lambda u: res.get(u.key), by_expert)}
        for v, (c, w) in enumerate(zip(full, [weights[k] for k in kinds])):
            if v == 0 and not reference:
                continue
            gu, dn = w(g, gate_up, down)
            with torch.no_grad():
                for s in range(n):
                    r = c[s]
                    r.hidden, r.index, r.weights = r.hidden.to(dev), r.index.to(dev), r.weights.to(dev)
                    parts = list(contributions(r, g, gu, dn, stand.act_fn))
                    if parts:  # the group's experts' rows and outputs, one tensor each, split again on arrival
                        where[v][s].append((len(outs[v]), torch.cat([t for t, _ in parts]).cpu(),
                                            [t.numel() for t, _ in parts]))
                        outs[v].append(torch.cat([h for _, h in parts]))
                    del parts
            del gu, dn
        del gate_up, down
    mine["routed"] = dict(hooks.routed)
    accs = [HiddenStore(fwd.budget, fwd.spill, f"a{i}") for _ in range(nv)]
    for o in range(world.size):  # each rank's samples' outputs, from every rank, a slice of them at a time
        own = list(samples_of(n, world.size, o))
        # every rank cuts the same slices: by what the samples' outputs can be at most (top-k rows each)
        for sl in exchange_slices([nv * topk[s] * sizes[s] for s in own], limit):
            samples = [own[k] for k in sl]
            msg = [[[(rows, counts, outs[v][pos]) for pos, rows, counts in where[v][s]] for s in samples]
                   for v in range(nv)]
            got = world.gather(msg, f"layer {i} routed experts' outputs for rank {o}", to=o)
            del msg
            for v in range(nv):
                for s in samples:
                    where[v][s] = None  # sent
            if got is None:
                continue
            for v in range(0 if reference else 1, nv):
                for k, s in enumerate(samples):
                    shape, dtype = shapes[s]
                    a = torch.zeros(shape, dtype=dtype)
                    for part in got:  # rank order = expert order
                        for rows, counts, out in part[v][k]:
                            for t, h in zip(rows.split(counts), out.split(counts)):
                                a.index_add_(0, t.to(a.device), h.to(a.device, a.dtype))
                    accs[v].append(a)
            del got
    for store in (*outs, *full):
        store.clear()
    del full, where
    if not reference:
        accs[0].clear()
        accs[0] = None
    accs = dict(zip(kinds, accs))
    got = world.gather(mine, f"layer {i} routed experts' results", to=0)
    if got is not None:
        x.fallbacks.extend(mine["fallbacks"])
        for o in got[1:]:  # rank order = expert order, after rank 0's own
            for start, tensors, how in o["groups"]:
                write_group(start, tensors, how)
            x.fallbacks.extend(o["fallbacks"])
            for k, c in o["routed"].items():
                hooks.routed[k] = hooks.routed.get(k, 0) + c
    return accs


def virtual_shapes(streamer, stand) -> dict[str, tuple]:
    """The fused expert parameters a streamed layer does not hold, by path (``units.layer_units``)."""
    if stand is None:
        return {}
    p = streamer.experts_path
    return {f"{p}.gate_up_proj": (stand.num_experts, *stand.gate_up_shape),
            f"{p}.down_proj": (stand.num_experts, *stand.down_shape)}
