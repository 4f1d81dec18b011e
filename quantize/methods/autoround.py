"""AutoRound on one decoder layer: the published algorithm (Cheng et al., "Optimize Weight Rounding
via Signed Gradient Descent for the Quantization of LLMs"), written here from the paper.

Per INT4 weight, learnable rounding offsets ``V`` (one per weight, in [-0.5, 0.5]) and two clip
factors per group, ``a`` on the group's max and ``b`` on its min (in [0.5, 1]), define

    hi = a * max(w, 0),  lo = b * min(w, 0)
    grid fullrange (default): scale = e / -8, e = hi if hi >= -lo else lo   (all 16 codes)
    grid minmax:              scale = max(hi, -lo) / 7.5                    (compressed-tensors')
    w_q = scale * clamp(round(w / scale + V), -8, 7)                        (round: straight-through)

trained with signed gradient descent (``p -= lr_t * sign(grad)``, ``lr_t`` decayed linearly from
``--lr``, default 1/iters, to 0) on the layer's output error: mean squared difference between the
layer with ``w_q`` and the source layer on the same inputs (the hidden states carried through the
quantized layers before it), over ``--batch-size`` samples per step (fixed seeded order). The
parameters with the lowest step loss are kept (the initial ones, RTN on the grid, are step 0's).
``--iters 0`` is round-to-nearest on the grid, bit for bit ``--observer fullrange``.

Routed experts are trained inside the layer's own forward, so each gets the gradient of exactly
the tokens the router sends it; an expert with fewer than ``--min-expert-tokens`` keeps its RTN
initialisation and is named. ``--all-experts`` adds, per expert, its own output error over every
token of the batch to the loss (the statistics only: the layer's output still follows the router).

Why not the ``auto-round`` package's own block API: ``AutoRound.quantize_block(block, inputs, ...)``
(auto-round 0.15.1, ``compressors/orchestrator.py``, the entry llm-compressor's AutoRoundModifier
uses) needs a compressor built from the whole model (``post_init`` on its model context), and it
tunes only ``SUPPORTED_LAYER_TYPES = (nn.Linear, Conv1D)`` (``utils/common.py``): transformers 5's
routed experts are fused 3-D parameters of one module, so the weights that make up most of GLM-5
and Kimi K2 would not be reached. The algorithm is therefore implemented here from the paper.
"""

from __future__ import annotations

import math

import torch

from .. import distributed
from ..errors import QuantizeError
from ..formats import int4
from .base import Layer, Method, Step
from .forward import Collector, Context, call_layer, in_order
from .units import Result, Unit

V_RANGE = 0.5
CLIP_RANGE = (0.5, 1.0)
# what `quantize check --source` proves of an AutoRound tensor: the published clip range, written apart
# from CLIP_RANGE on purpose, so a CLIP_RANGE loosened by mistake makes the check fail instead of agreeing
PROVEN_RANGE = (0.5, 1.0)
# a last-step loss this many times the first one: diverging (the bounded parameters cannot get there by noise)
DIVERGED = 100.0
SEED = 20240


class RouteCounter(Collector):
    """Tokens the router sends each expert, counted by a pre-hook on the experts modules (per
    sample, merged in order: see ``forward.Collector``)."""

    def __init__(self, layer, units: list[Unit]):
        super().__init__()
        self.routed: dict[tuple[str, int], int] = {}
        self._handles = []
        by_mod: dict[str, set[int]] = {}
        for u in units:
            if u.expert is not None:
                by_mod.setdefault(u.module, set()).add(u.expert)
        for path, es in by_mod.items():
            for e in es:
                self.routed[(path, e)] = 0

            def hook(module, args, path=path, es=sorted(es)):
                idx = args[1]
                part = self._part()
                for e in es:
                    part[(path, e)] = part.get((path, e), 0) + int((idx == e).any(-1).sum())
            self._handles.append(layer.get_submodule(path).register_forward_pre_hook(hook))

    def merge(self, part: dict, sample: int) -> None:  # noqa: ARG002 - counts: any order adds up the same
        for k, v in part.items():
            self.routed[k] += v

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (x.round() - x).detach()


class Tuned:
    """The trainable state of one layer parameter (an nn.Linear weight, or a fused [E, out, in])."""

    def __init__(self, path: str, w0: torch.Tensor, group: int, fullrange: bool, scale_dtype: torch.dtype):
        self.path, self.group, self.fullrange, self.sdt = path, group, fullrange, scale_dtype
        *lead, out, k = w0.shape
        self.shape = w0.shape
        self.wg = w0.detach().to(torch.float32).reshape(*lead, out, k // group, group)
        self.wmax = self.wg.amax(-1).clamp(min=0)
        self.wmin = self.wg.amin(-1).clamp(max=0)
        # the side RTN's signed extreme takes on a tie (the first element of largest magnitude)
        ext = self.wg.gather(-1, self.wg.abs().argmax(-1, keepdim=True)).squeeze(-1)
        self.tie_hi = ext > 0
        self.V = torch.zeros_like(self.wg, requires_grad=True)
        self.a = torch.ones_like(self.wmax, requires_grad=True)
        self.b = torch.ones_like(self.wmax, requires_grad=True)
        self.mask = torch.ones(lead[0], dtype=torch.float32, device=w0.device) if lead else None  # per expert

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.V, self.a, self.b]

    def _extreme(self):
        hi, lo = self.wmax * self.a, self.wmin * self.b
        if self.fullrange:
            pick_hi = torch.where(hi > -lo, True, torch.where(hi < -lo, False, self.tie_hi))
            return torch.where(pick_hi, hi, lo)
        return torch.maximum(hi, -lo)

    def _scale(self, e: torch.Tensor) -> torch.Tensor:
        s = e / int4.QMIN if self.fullrange else e / int4.HALF_RANGE
        return torch.where(s == 0, torch.full_like(s, torch.finfo(self.sdt).eps), s)

    def fake(self) -> torch.Tensor:
        s = self._scale(self._extreme()).unsqueeze(-1)
        q = torch.clamp(_round_ste(self.wg / s + self.V), int4.QMIN, int4.QMAX)
        return (q * s).reshape(self.shape)

    def final(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [..., out, in], scale [..., out, G] in the scale dtype): the bf16 scale of the
        trained range, codes rounded as ``formats.int4`` rounds (quotient in the scale dtype)."""
        with torch.no_grad():
            e = self._extreme().to(self.sdt)
            s = int4._fullrange_scale(e, self.sdt) if self.fullrange else int4._minmax_scale(e, self.sdt)
            x = (self.wg / s.float().unsqueeze(-1)).to(self.sdt).float() + self.V
            q = x.round().clamp(int4.QMIN, int4.QMAX).to(torch.int8)
            return q.reshape(self.shape), s

    def step(self, lr: float) -> None:
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    continue
                d = p.grad.sign()
                if self.mask is not None:
                    d = d * self.mask.view(-1, *([1] * (p.ndim - 1)))
                p.sub_(lr * d)
                p.grad = None
            self.V.clamp_(-V_RANGE, V_RANGE)
            self.a.clamp_(*CLIP_RANGE)
            self.b.clamp_(*CLIP_RANGE)

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def restore(self, snap: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, s in zip(self.params, snap):
                p.copy_(s)


def _all_experts_hook(w0_gu, w0_d, experts: list[int], tls):
    """--all-experts: every trainable expert's own output error over every token at the experts'
    input, added to the running sample's loss (``tls.extra``, one list per thread)."""
    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        idx = torch.tensor(experts, device=x.device)
        gu_q, d_q = module.gate_up_proj[idx], module.down_proj[idx]
        with torch.no_grad():
            g, u = torch.einsum("th,eoh->eto", x, w0_gu[idx]).chunk(2, dim=-1)
            ref = torch.einsum("eti,ehi->eth", module.act_fn(g) * u, w0_d[idx])
        g, u = torch.einsum("th,eoh->eto", x, gu_q).chunk(2, dim=-1)
        y = torch.einsum("eti,ehi->eth", module.act_fn(g) * u, d_q)
        tls.extra.append((y - ref).pow(2).sum())
    return hook


def _all_experts_hooks(layer, units: list[Unit], source, tls) -> list:
    """--all-experts' hooks on every experts module whose gate_up and down are both trained,
    ``source(path)`` giving a fused parameter's source weight (fp32): the same on rank 0 and on
    the ranks that compute a share of each step (``tune_rank``)."""
    paths = {u.path for u in units}
    by_mod: dict[str, list[int]] = {}
    for u in units:
        if u.expert is not None and u.path.endswith("gate_up_proj"):
            by_mod.setdefault(u.module, []).append(u.expert)
    handles = []
    for path, es in by_mod.items():
        if path + ".gate_up_proj" not in paths or path + ".down_proj" not in paths:
            continue
        mod = layer.get_submodule(path)
        handles.append(mod.register_forward_pre_hook(_all_experts_hook(source(path + ".gate_up_proj"),
                                                                       source(path + ".down_proj"), sorted(es), tls)))
    return handles


def _sample_grads(streamer, ctx, layer, tls, leaves: dict, h, topk, target, denom: int):
    """One sample's share of a step: its loss (over ``denom``, the step's element count) and the
    gradient of each installed leaf (None where the sample does not reach it)."""
    tls.extra = []
    out, _ = call_layer(streamer, ctx, layer, h, topk)
    loss = (out - target.to(out.device)).pow(2).sum()
    for x in tls.extra:
        loss = loss + x
    loss = loss / denom
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return float(loss.detach()), grads


def _add_grads(a: list, b: list) -> list:
    """Two lists of gradients (None where a sample does not reach a leaf) added item by item."""
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b)]


def _step_sums(got: list, positions: range, n: int, device):
    """This rank's samples of a step (``got``: (loss, gradients) per batch position in
    ``positions``, of ``n``): their losses, and a ``TreeSum`` over the step's fixed shards holding
    this rank's shard sums (each the shard's gradients added in batch order)."""
    shards = len(distributed.sample_shards(n))
    tree = distributed.TreeSum(shards, _add_grads)
    losses: list[float] = []
    for q, (loss, grads) in zip(positions, got):
        losses.append(loss)
        tree.add(distributed.owner_of(q, n, shards), [None if g is None else g.to(device) for g in grads])
    tree.close()
    return losses, tree


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


def _set_param(layer, path: str, p: torch.nn.Parameter) -> None:
    mod, _, name = path.rpartition(".")
    setattr(layer.get_submodule(mod) if mod else layer, name, p)


def tune(streamer, ctx, layer, units: list[Unit], originals: dict, hidden, topk: list, fp_out, routed: dict, opt,
         i: int, fallbacks: list, device: str, pool, workers: int) -> tuple[dict[str, Result], dict]:
    """Train the layer's rounding and clipping; samples of a step run in parallel threads (``pool``,
    ``workers`` at a time), each returning its own gradients, summed in sample order (the same for
    any thread count)."""
    import threading

    fullrange = int4.GRIDS[opt.observer].signed
    layer.requires_grad_(False)
    tuned: dict[str, Tuned] = {}
    for u in units:
        if u.path not in tuned:
            tuned[u.path] = Tuned(u.path, layer.get_parameter(u.path).detach().clone(), opt.group_size, fullrange,
                                  u.scale_dtype)
    # starved experts keep their RTN initialisation (their updates are masked)
    starved: set[str] = set()
    for u in units:
        if u.expert is None or opt.all_experts:
            continue
        n = routed.get((u.module, u.expert), 0)
        if n < opt.min_expert_tokens:
            t = tuned[u.path]
            t.mask[u.expert] = 0
            if u.key not in starved:
                starved.add(u.key)
                for name, _, _ in u.names:
                    fallbacks.append({"name": name, "reason": f"{n} routed calibration tokens < --min-expert-tokens "
                                                              f"{opt.min_expert_tokens}"})
    tls = threading.local()
    handles = _all_experts_hooks(layer, units, lambda p: tuned[p].wg.reshape(tuned[p].shape), tls) \
        if opt.all_experts else []
    world = distributed.current()
    if world.size > 1:  # the other ranks build this layer and compute their share of each step (tune_rank)
        world.broadcast(("autoround", {"layer": i, "units": units, "options": opt, "workers": workers}),
                        f"layer {i} AutoRound")
    n = len(hidden)
    bs = min(opt.batch_size, n)
    gen = torch.Generator().manual_seed(SEED + i)
    order: list[int] = []
    losses: list[float] = []
    best, best_loss, best_step = [t.snapshot() for t in tuned.values()], math.inf, 0
    try:
        for step in range(opt.iters):
            if len(order) < bs:
                order += torch.randperm(n, generator=gen).tolist()
            batch, order = order[:bs], order[bs:]
            denom = sum(fp_out[s].numel() for s in batch)
            # the quantized weights once per step, installed as the layer's parameters (leaves):
            # each sample's backward stops at them, their summed gradient then goes back through
            # the grid once
            fakes = {path: t.fake() for path, t in tuned.items()}
            leaves = {path: torch.nn.Parameter(w.detach()) for path, w in fakes.items()}
            for path, p in leaves.items():
                _set_param(layer, path, p)
            paths = list(leaves)
            # the step's samples in whole fixed shards (distributed.samples_of over the batch positions),
            # rank 0 the first: each sample's gradients are its own whichever rank computes them, summed
            # in batch order within a shard and over the shards in one fixed tree (``_step_sums``)
            shares = [distributed.samples_of(len(batch), world.size, k) for k in range(world.size)]
            if world.size > 1:
                world.broadcast(("step", {"fakes": {p: w.detach().cpu() for p, w in fakes.items()}, "denom": denom,
                                          "batch": len(batch),
                                          "samples": [[tuple(_cpu(t) for t in (hidden[batch[q]], topk[batch[q]],
                                                                               fp_out[batch[q]])) for q in share]
                                                      for share in shares[1:]]}),
                                f"layer {i} AutoRound step {step}")

            def one(s: int):
                return _sample_grads(streamer, ctx, layer, tls, leaves, hidden[s], topk[s], fp_out[s], denom)

            got = list(in_order(pool, workers, one, [batch[q] for q in shares[0]]))
            per_sample, tree = _step_sums(got, shares[0], len(batch), device)
            if world.size > 1:
                for o in world.gather(None, f"layer {i} AutoRound step {step}", to=0)[1:]:
                    per_sample += o["losses"]
                    for node, sums in o["subtrees"]:
                        tree.push(node, [None if g is None else g.to(device) for g in sums])
            summed = tree.combine(None, f"layer {i} AutoRound step {step}")
            total = 0.0
            for loss in per_sample:  # batch order
                total += loss
            live = [j for j in range(len(paths)) if summed[j] is not None]
            if live:
                torch.autograd.backward([fakes[paths[j]] for j in live], [summed[j] for j in live])
            if not math.isfinite(total):
                raise QuantizeError(f"decoder layer {i}: the AutoRound loss became {total} at step {step}; lower --lr "
                                    f"(now {opt.lr:g}) or use --method gptq")
            losses.append(total)
            if total < best_loss:
                best_loss, best_step = total, step
                best = [t.snapshot() for t in tuned.values()]
            lr_t = opt.lr * (1 - step / opt.iters)
            for t in tuned.values():
                t.step(lr_t)
    finally:
        for h in handles:
            h.remove()
    if world.size > 1:  # (after a failure here the others see this rank's connection close instead)
        world.broadcast(("end", None), f"layer {i} AutoRound")
    if losses and losses[-1] > DIVERGED * losses[0]:
        raise QuantizeError(f"decoder layer {i}: the AutoRound loss diverged ({losses[0]:.4g} at step 0, "
                            f"{losses[-1]:.4g} at the last step); lower --lr (now {opt.lr:g}) or --iters")
    for path, t in tuned.items():  # the layer's own parameters back (the caller installs the results)
        _set_param(layer, path, torch.nn.Parameter(t.wg.reshape(t.shape).clone(), requires_grad=False))
    for t, snap in zip(tuned.values(), best):
        t.restore(snap)
    finals = {path: t.final() for path, t in tuned.items()}
    results = {}
    for u in units:
        codes, scale = finals[u.path]
        if u.expert is not None:
            codes, scale = codes[u.expert], scale[u.expert]
        how = "rtn" if u.key in starved else "autoround"
        results[u.key] = Result(codes.cpu().contiguous(), scale.cpu().contiguous(), how)
    train = {"iters": opt.iters, "lr": opt.lr, "batch_size": bs, "first_loss": losses[0] if losses else None,
             "last_loss": losses[-1] if losses else None, "best_loss": best_loss if losses else None,
             "best_step": best_step if losses else None}
    return results, train


def tune_rank(world, streamer, layer, job: dict, device: str) -> None:
    """A rank other than 0 of an AutoRound run, for one layer (``tune`` on rank 0 sends ``job``;
    ``layer``: this rank's build of it on ``device``, the source weights): each step, this rank's
    share of the samples through the layer with rank 0's quantized weights, their losses and
    gradients summed here per shard of the step and up the shards' tree as far as this rank's
    shards reach (``_step_sums``), those subtrees sent back to rank 0 (CPU tensors), which
    finishes the tree."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    i, opt, units = job["layer"], job["options"], job["units"]
    workers = max(1, job["workers"])
    layer.requires_grad_(False)
    tls = threading.local()
    handles = _all_experts_hooks(layer, units, lambda p: layer.get_parameter(p).detach().to(torch.float32), tls) \
        if opt.all_experts else []
    ctx = Context(streamer, device)
    on = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="autoround") as pool:
            while True:
                kind, step = world.broadcast(None, f"layer {i} AutoRound's next step")
                if kind == "end":
                    return
                leaves = {p: torch.nn.Parameter(w.to(device)) for p, w in step["fakes"].items()}
                for path, leaf in leaves.items():
                    _set_param(layer, path, leaf)

                def one(x, leaves=leaves, denom=step["denom"]):
                    h, topk, target = x
                    return _sample_grads(streamer, ctx, layer, tls, leaves, h, on(topk), target, denom)

                got = list(in_order(pool, workers, one, step["samples"][world.rank - 1]))
                losses, tree = _step_sums(got, distributed.samples_of(step["batch"], world.size, world.rank),
                                          step["batch"], device)
                subtrees = [(node, [None if g is None else g.cpu() for g in sums]) for node, sums in tree.stack]
                world.gather({"losses": losses, "subtrees": subtrees}, f"layer {i} AutoRound step", to=0)
    finally:
        for h in handles:
            h.remove()


class AutoRound(Method):
    """``--method autoround``: the layer's targets are the source model's own outputs of it (the
    full-precision stream), which the quantized layer learns to reproduce from the quantized-path
    inputs, so it also corrects the error the layers before it left (auto-round's quantized-input
    mode); the routing counted is the one the quantized path sees."""

    name = "autoround"
    source_stream = True
    streams_experts = False  # one loss over the whole layer's output: its experts are trained together
    splits_samples = False  # rank 0 holds every sample; each step's samples are split (tune_rank)
    report_fields = ("iters", "lr", "batch_size")
    title = ("AutoRound-class tuning: learnable rounding offsets and per-group min/max scale factors trained by "
             "signed gradient descent on each decoder layer's output error (Cheng et al.)")
    loss_target = "the source model's own output of this layer (so it includes the error the layers before it left)"

    def layer_step(self, layer: Layer) -> Step:
        x = layer
        ref = x.targets
        counter = RouteCounter(x.module, x.units)  # the routing the quantized path sees
        x.put(x.rtn)
        try:
            _, _, (e_rtn, tot) = x.fwd(x.module, x.hidden, x.topk, x.index, "after the RTN layer", keep=False, ref=ref,
                                       collector=counter)
        finally:
            counter.remove()
        x.put(x.originals)
        f = x.fwd
        results, train = tune(f.streamer, f.ctx, x.module, x.units, x.originals, x.hidden, x.topk, ref, counter.routed,
                              x.options, x.index, x.fallbacks, f.device, f.pool, f.workers)
        return Step(results, ref, counter.routed, e_rtn, tot, report={"train": train})

    def grid_proof(self, scale: torch.Tensor, rtn_scale: torch.Tensor, observer: str) -> str | None:
        """Each |scale| lies within PROVEN_RANGE of RTN's on its grid (each end widened by the scale
        dtype's rounding)."""
        tiny = torch.finfo(torch.float32).tiny
        ratio = (scale.float().abs() / rtn_scale.float().abs().clamp_min(tiny)).reshape(-1)
        lo, hi = PROVEN_RANGE[0] * (1 - 2**-7), PROVEN_RANGE[1] * (1 + 2**-7)
        bad = int(((ratio < lo) | (ratio > hi)).sum())
        if not bad:
            return None
        return (f"{bad} AutoRound group scales lie outside [{PROVEN_RANGE[0]:g}, {PROVEN_RANGE[1]:g}] x the {observer} "
                f"grid's "
                f"(min {float(ratio.min()):.3f}, max {float(ratio.max()):.3f}): not made from this source")

    def card_section(self, report: dict) -> str:
        return f"{report.get('iters')} iterations, lr {report.get('lr')}, batch {report.get('batch_size')}"
