"""AutoRound's start from GPTQ's result (``--method autoround --init gptq``): GPTQ at ``--method
gptq``'s own defaults (Hessian-searched clipping, static act-order, dampening, block) on the
statistics ``--method gptq`` would gather for the layer, and each weight's ``gptq.coordinate_optimum``
in codes beside it, which ``tuning.Tuned.start_at`` turns into the trained parameters' step 0.

- The Linear units, and a layer built whole (``gptq_start``): on rank 0, which holds every sample.
- A MoE layer's streamed routed experts (``expert_starts``): on every rank, for the experts it owns
  and trains (``World.owned``). The experts' inputs through the source layer (rank 0's capture, the
  one ``--method gptq`` takes its expert Hessians from) go to every other rank a slice at a time
  (``_from_rank0``); each rank then reads its experts a group at a time within
  --memory-budget-gib and runs ``streamed._group_gptq`` on them: the same sums in the same sample
  order as ``--method gptq`` on one process, so ``--iters 0`` writes ``--method gptq``'s bytes for
  any number of ranks. Only the captures travel (tokens x hidden per sample, once per layer), not the
  results (codes and an fp32 optimum per weight: about 220 MB per expert at Kimi K2's width), and the
  ranks' GPTQ runs side by side.
"""

from __future__ import annotations

from dataclasses import fields, replace
from types import SimpleNamespace

import torch

from .units import Result, Unit, by_expert, rtn


def _gptq_options(opt):
    """(GPTQ, ``opt`` with every GPTQ option it leaves unset at ``--method gptq``'s default)."""
    from .gptq import GPTQ

    gptq = GPTQ()
    own = {f.name: getattr(opt, f.name) for f in fields(opt)}
    return gptq, SimpleNamespace(**(own | {k: v for k, v in gptq.defaults.items() if own.get(k) is None}))


def gptq_start(x, module, units: list[Unit], **replay) -> tuple[dict, dict]:
    """GPTQ's result for ``units`` from the statistics of ``module`` (the layer holding the source
    weights; ``replay``: a streamed layer's stand-in and its experts' outputs) on the quantized-path
    inputs, as ``--method gptq`` makes it, on this rank (it holds every sample). A unit GPTQ leaves at
    RTN starts from RTN; the fallbacks it names are not AutoRound's and are dropped (AutoRound names
    its own). Returns (per unit key its result, and for the units it ran each weight's
    ``gptq.coordinate_optimum`` in codes)."""
    from .gptq import Hessians

    gptq, with_defaults = _gptq_options(x.options)
    hooks = Hessians(module, units, x.options.all_experts, x.fwd.total or len(x.hidden))
    try:
        x.fwd(module, x.hidden, x.topk, x.index, "of the source layer (GPTQ's statistics for --init gptq)",
              keep=False, collector=hooks, **replay)
    finally:
        hooks.remove()
    hooks.combine(None, f"layer {x.index} Hessians")
    optimum: dict = {}
    results = gptq.results(replace(x, units=units, options=with_defaults, fallbacks=[]), hooks, optimum)
    return results, optimum


def _from_rank0(world, cap, fwd, i: int):
    """Rank 0's capture (every sample) on every rank: rank 0 keeps its own and broadcasts it a slice
    at a time (at most ``streamed._exchange_limit`` bytes per collective, one sample at least); the
    others store it on their budget (their scratch folder beyond it)."""
    from .forward import Captured
    from .store import HiddenStore
    from .streamed import _exchange_limit, _nbytes, broadcast_slices

    mine = world.rank == 0
    full = cap if mine else Captured(HiddenStore(fwd.budget, fwd.spill, f"xs-{i}"))
    for items in broadcast_slices(world, 0, len(cap) if mine else 0,
                                  lambda s: (cap.hidden[s], cap.index[s], cap.weights[s]), lambda r: _nbytes(r[0]),
                                  _exchange_limit(fwd), f"layer {i} routed experts' inputs (--init gptq)"):
        if not mine:
            for hidden, index, weights in items:
                full.hidden.append(hidden)
                full.index.append(index)
                full.weights.append(weights)
    return full


def expert_starts(world, fwd, stand, i: int, units: list[Unit], opt, cap) -> tuple[dict, dict]:
    """Every rank (each calls it in turn): GPTQ's result for the routed experts of layer ``i`` this
    rank owns (``units``: the layer's; ``cap``: what the router handed the experts through the
    source layer, every sample, on rank 0; None elsewhere; cleared here). Returns (per unit key its
    result on the CPU, and for the units GPTQ ran each weight's optimum in codes), as ``gptq_start``
    does."""
    from .gptq import Hessians
    from .streamed import _group_gptq, per_expert_bytes

    if world.size > 1:
        cap = _from_rank0(world, cap, fwd, i)
    gptq, with_defaults = _gptq_options(opt)
    experts = by_expert(units)
    hooks = Hessians(None, [], opt.all_experts, len(cap))
    streamer = fwd.streamer
    results: dict[str, Result] = {}
    optimum: dict = {}
    for g in streamer.expert_groups(per_expert_bytes(streamer, True), world.owned(stand.num_experts)):
        us = [u for e in g for u in experts.get(e, ())]
        if not us:
            continue
        gate_up, down = streamer.expert_weights(i, g, fwd.device)
        res, _ = _group_gptq(gptq, streamer, hooks, g, gate_up, down, us, cap, with_defaults, fwd, [], stand.act_fn,
                             i, quotients=optimum)
        results.update({k: Result(r.codes.cpu(), r.scale.cpu(), r.how) for k, r in res.items()})
        del gate_up, down, res
    cap.clear()
    return results, optimum


def start_of(w: torch.Tensor, units: list[Unit], start: tuple[dict, dict], opt, first: int = 0):
    """Per expert ``j`` of a fused experts parameter ``w`` [E, out, in] (experts ``first + j``; or the
    whole of a Linear weight [out, in]: ``j`` Ellipsis) its start (codes, scale, each weight's optimum
    in codes or None) from ``start`` (per unit key its result, and the optimum where GPTQ ran): a
    unit's own, RTN for an expert without a unit. Yields (j, codes, scale, optimum)."""
    results, optimum = start
    if w.ndim == 2:
        r = results[units[0].key]
        yield Ellipsis, r.codes, r.scale, optimum.get(units[0].key)
        return
    by_e = {u.expert: u.key for u in units}
    for j in range(w.shape[0]):
        key = by_e.get(first + j)
        r = results[key] if key is not None else rtn(w[j], opt.group_size, opt.observer, units[0].scale_dtype)
        yield j, r.codes, r.scale, optimum.get(key)
