"""AutoRound on a MoE layer with its routed experts partitioned across ranks (expert parallel),
for one process as for many: what ``--method autoround`` runs on every layer that has routed
experts. A layer's dense part (attention, router, shared experts) is built on every rank; its
routed experts are not (``calibrate/experts.py``: a ``StandIn`` takes their place). Each rank
owns a contiguous range of the experts (``World.owned``): it reads their source weights a group
at a time and holds their training state (``Tuned``: the weights, rounding offsets and clip
factors) and nobody else's, so a rank holds 1/N of the layer's experts.

One training step over the step's batch (rank 0 picks it; each rank computes its contiguous
share of the batch positions, ``distributed.samples_of``, with the Linear units' quantized
weights rank 0 sends):

A. **capture**: each share sample through the layer without gradients: what the router hands
   the experts (the hidden states, the top-k experts and their weights), sent to every rank;
B. **experts forward** on the owners: per sample, per owned expert with tokens, transformers'
   eager experts computation on exactly those tokens (``calibrate.experts.ffn``), with autograd on the
   expert's own quantized weights (one leaf per expert) and, when the layer has Linear units,
   on the expert's own copy of its input rows and routing weights; each expert's weighted
   output goes back to the sample's rank, which adds them per expert in ascending order into
   zeros (transformers' ``index_add_`` sequence: the layer's forward bit for bit);
C. **forward again, with gradients**: the stand-in returns that output as a leaf; the loss
   (squared error against the source model's output of the layer) gives its gradient, sent to
   the owners;
D. **experts backward** on the owners: each expert's weight gradient for that sample (added in
   the fixed shard tree of the batch positions, ``distributed.TreeSum``, all on the owner: no
   expert gradient travels) and, with Linear units, its input rows' and routing weights'
   gradients, sent back to the sample's rank;
E. **the rest of the backward** on the sample's rank: the input rows' gradients added per expert
   from the last to the first (autograd's order), the routing weights' put in place, and the layer's own graph run back
   from them and from the loss to the Linear units' leaves (summed in the shard tree, finished
   on rank 0, which steps them).

Rank 0 sums the per-sample losses in batch order and says whether this step is the best so far;
every rank then steps its own parameters. Every sum has a fixed order whatever the number of
ranks, so the output is the same bytes for any number of ranks (``tests/test_distributed_gptq.py``).
It is also the whole layer's autograd bit for bit (the same layer built with its experts, as a
layer without routed experts is trained here): every gradient, step by step, with up to 4 experts
per token (``tests/test_expert_stream.py``), the experts' input rows' gradients being added in the
order autograd adds them (``Tuning._backward``).

``--all-experts``: each trained expert's own output error over every token of the sample is added
to the loss, its input taken as given (no gradient into the layer below: it trains the expert).
"""

from __future__ import annotations

import math

import torch

from .. import distributed
from ..calibrate.experts import expert_bytes, ffn, rows
from ..errors import QuantizeError
from ..formats import int4
from .base import Step
from .forward import Context, call_layer, in_order
from .start import expert_starts, gptq_start, start_of
from .streamed import Variant, _tensors, per_expert_bytes, put_linear, run_groups, with_results
from .units import Result, Unit, by_expert, dequant, rtn


# fp32 copies of its routed experts' weights a rank holds while AutoRound trains a MoE layer (the
# weights, rounding offsets, clip factors, fake-quantized weights and leaves, gradients and their shard
# sums, the best step's snapshot): measured at DeepSeek-V3's width, 8 experts, as peak RSS, 17.17 GiB on one
# rank and 9.35 GiB on each of 2 (docs/methods.md): 1.96 GiB per expert of 0.16 GiB in fp32
STATE_COPIES = 12
# --init gptq adds the fixed code offsets (one fp32 copy) and, until the training state takes it, the GPTQ
# start (codes int8 and each weight's optimum fp32): measured at DeepSeek-V3's width, 8 experts on 2 ranks,
# as peak RSS, 9.42 -> 10.36 GiB per rank, 1.43 copies (docs/methods.md); rounded up
START_COPIES = 2


def state_bytes(hidden: int, intermediate: int, experts: int, copies: int = STATE_COPIES) -> int:
    """What ``experts`` routed experts' AutoRound training state costs a rank, about (``copies`` fp32
    copies of their weights: ``STATE_COPIES``, plus ``START_COPIES`` with --init gptq)."""
    return copies * experts * expert_bytes(hidden, intermediate, torch.float32)


def state_copies(options) -> int:
    return STATE_COPIES + (START_COPIES if getattr(options, "init", None) == "gptq" else 0)


def check_memory(streamer, device: str, world, free: int | None = None, copies: int = STATE_COPIES) -> None:
    """Before any weight is read: the routed experts' training state a rank holds under AutoRound
    (its share of the largest MoE layer's experts, ``state_bytes``) fits in the memory it has: the
    GPU's free memory (``--device cuda``), or this node's free memory shared by its ranks. One line
    saying how many GPUs would hold it otherwise. ``free``: the bytes to check against (a test's)."""
    n = int(getattr(streamer.config, "n_routed_experts", 0) or 0)
    if not streamer.experts_path or n <= 0:
        return
    h, i = streamer.expert_dims()
    gpu = device.startswith("cuda")
    if free is None:
        if gpu:
            free = torch.cuda.mem_get_info(torch.device(device))[0]
        else:
            import psutil

            free = psutil.virtual_memory().available // max(1, world.local_size)
    from ..distributed import partition

    def share(ranks: int) -> int:  # the largest share's state: rank 0's (World.owned)
        return state_bytes(h, i, len(partition(n, ranks, 0)), copies)

    owned = len(partition(n, world.size, 0))
    need = share(world.size)
    if need <= free:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    what = (f"--method autoround: a rank would hold about {gib(need)} of a MoE layer's routed-expert training state "
            f"({n} experts over {world.size} rank(s): {owned} each, x {copies} fp32 copies of {h} x {i} "
            f"gate|up|down), more than the {gib(free)} free {'on its GPU' if gpu else 'for it on this node'}")
    if gpu:
        ranks = next(r for r in range(world.size + 1, n + 1) if share(r) <= free) if share(n) <= free else None
        fix = (f"spread the experts over {ranks} GPUs or more (--nproc {ranks}, or torchrun over several nodes)"
               if ranks else "even one expert per GPU does not fit")
    else:
        fix = "the ranks of one node share its memory: run on GPUs (--device cuda --nproc N) or over several nodes"
    raise QuantizeError(f"{what}; {fix}, or use --method gptq (its experts go a group at a time within "
                        "--memory-budget-gib)")


V_RANGE = 0.5
CLIP_RANGE = (0.5, 1.0)
HALF = 0.49  # a start's quotient lies within this of its code (``Tuned.start_at``)
# a last-step loss this many times the first one: diverging (the bounded parameters cannot get there by noise)
DIVERGED = 100.0
SEED = 20240


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (x.round() - x).detach()


def _cast_ste(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (kept in fp32) in the forward, the identity in the backward: the
    training forward sees the very values the export writes (auto-round casts its scale to the export
    dtype inside the forward the same way)."""
    return x + (x.to(dtype).float() - x).detach()


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
        self.off: torch.Tensor | None = None  # fixed code offsets: where a start other than RTN put the codes
        self.moved = 0  # groups whose start scale is not the given one (``start_at``)

    def start_at(self, j, codes: torch.Tensor, scale: torch.Tensor, optimum: torch.Tensor | None = None) -> None:
        """Start expert ``j`` of a fused parameter (or the whole of a Linear weight: ``j`` Ellipsis)
        from another method's result (``--init gptq``, ``methods/start.py``): each group's clip factors
        at the shrink its scale was chosen with (``int4.shrink_of``: the same scale, bit for bit, from a
        source in the scale dtype; ``moved`` counts the groups where it is not), and fixed offsets
        that put every quotient at ``optimum`` (in codes: GPTQ's ``coordinate_optimum`` / scale, the
        value each weight would best take with every other code fixed; nan, or not given: the
        quotient's own fraction on the start's code), kept within half a code of the start's, so
        the step-0 weight is ``codes x scale`` bit for bit and the offsets ``V`` act on what moving a
        code to its neighbour costs. One expert at a time: the working copies are one expert's."""
        k = self.shape[-1]
        observer = "fullrange" if self.fullrange else "minmax"
        wg = self.wg[j]
        w2 = wg.reshape(-1, k)
        p = int4.shrink_of(w2, scale.reshape(-1, k // self.group).to(w2.device), self.group, observer, self.sdt)
        if self.off is None:
            self.off = torch.zeros_like(self.wg)
        with torch.no_grad():
            self.a[j].copy_(torch.nan_to_num(p.reshape(self.a[j].shape), nan=1.0))
            self.b[j].copy_(self.a[j])
            s = self._scale(self._extreme(j))
            self.moved += int((s.to(self.sdt) != scale.to(s.device, self.sdt).reshape(s.shape)).sum())
            c = (wg / s.unsqueeze(-1)).to(self.sdt).float()
            q = codes.to(c.device, torch.float32).reshape(c.shape)
            off = q - c.round()  # no optimum given: this quotient's fraction, on the start's code
            if optimum is not None:  # within half a code of the start's (a code the optimum rounds away from)
                x = optimum.to(c.device, torch.float32).reshape(c.shape)
                x = torch.minimum(torch.maximum(x, q - HALF), q + HALF)
                off = torch.where(x.isnan(), off, x - c)
            # where that does not round to the code (a tie, a clamped code, the last bits of a sum), the
            # quotient is put on the code itself
            bad = (c + off).round().clamp(int4.QMIN, int4.QMAX) != q
            off[bad] = (q - c)[bad]
            self.off[j] = off

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.V, self.a, self.b]

    def _extreme(self, j=Ellipsis):
        hi, lo = self.wmax[j] * self.a[j], self.wmin[j] * self.b[j]
        if self.fullrange:
            pick_hi = torch.where(hi > -lo, True, torch.where(hi < -lo, False, self.tie_hi[j]))
            return torch.where(pick_hi, hi, lo)
        return torch.maximum(hi, -lo)

    def _scale(self, e: torch.Tensor) -> torch.Tensor:
        """The group scale as ``final`` exports it: the extreme rounded to the scale dtype, divided
        (fp32), rounded again (``formats.int4``'s order), each rounding straight-through."""
        e = _cast_ste(e, self.sdt)
        s = _cast_ste(e / int4.QMIN if self.fullrange else e / int4.HALF_RANGE, self.sdt)
        return torch.where(s == 0, torch.full_like(s, torch.finfo(self.sdt).eps), s)

    def fake(self) -> torch.Tensor:
        """The layer weight the export writes for the current state (``final``'s codes x scale, bit for
        bit): the quotient rounded to the scale dtype as ``formats.int4`` rounds it, straight-through."""
        s = self._scale(self._extreme()).unsqueeze(-1)
        x = _cast_ste(self.wg / s, self.sdt)
        if self.off is not None:
            x = x + self.off
        q = torch.clamp(_round_ste(x + self.V), int4.QMIN, int4.QMAX)
        return (q * s).reshape(self.shape)

    def final(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [..., out, in], scale [..., out, G] in the scale dtype): the bf16 scale of the
        trained range, codes rounded as ``formats.int4`` rounds (quotient in the scale dtype)."""
        with torch.no_grad():
            e = self._extreme().to(self.sdt)
            s = int4._fullrange_scale(e, self.sdt) if self.fullrange else int4._minmax_scale(e, self.sdt)
            x = (self.wg / s.float().unsqueeze(-1)).to(self.sdt).float()
            if self.off is not None:
                x = x + self.off
            x = x + self.V
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


def _add_grads(a: list, b: list) -> list:
    """Two lists of gradients (None where a sample does not reach a leaf) added item by item."""
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b)]


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


def _set_param(layer, path: str, p: torch.nn.Parameter) -> None:
    mod, _, name = path.rpartition(".")
    setattr(layer.get_submodule(mod) if mod else layer, name, p)


class Owned:
    """This rank's routed experts of one layer: per fused parameter (``gate_up_proj``,
    ``down_proj``) the ``Tuned`` state of the owned range, the experts that train, and each
    step's per-expert leaves."""

    def __init__(self, streamer, i: int, units: list[Unit], opt, routed: dict, owned: range, device: str,
                 start: tuple[dict, dict] | None = None):
        self.range, self.device = owned, device
        self.units = [u for u in units if u.expert is not None and u.expert in owned]
        self.paths = sorted({u.path for u in self.units})
        self.unit: dict[tuple[str, int], Unit] = {(u.path, u.expert): u for u in self.units}
        fullrange = int4.GRIDS[opt.observer].signed
        gate_up = down = None
        if len(owned):  # read a group at a time into one tensor per parameter
            for g in streamer.expert_groups(expert_bytes(*streamer.expert_dims()), owned):
                gu, dn = streamer.expert_weights(i, g, device)
                if gate_up is None:
                    gate_up = torch.empty((len(owned), *gu.shape[1:]), dtype=torch.float32, device=device)
                    down = torch.empty((len(owned), *dn.shape[1:]), dtype=torch.float32, device=device)
                gate_up[g.start - owned.start: g.stop - owned.start].copy_(gu)  # no fp32 copy of the group beside it
                down[g.start - owned.start: g.stop - owned.start].copy_(dn)
                del gu, dn
        src = {"gate_up_proj": gate_up, "down_proj": down}
        self.tuned: dict[str, Tuned] = {}
        self.source: dict[str, torch.Tensor] = {}  # the fused parameters without a unit, as read
        for name, w in src.items():
            path = next((p for p in self.paths if p.endswith(name)), None)
            if path is None:
                self.source[name] = w
                continue
            sdt = next(u.scale_dtype for u in self.units if u.path == path)
            t = self.tuned[name] = Tuned(path, w, opt.group_size, fullrange, sdt)
            if start is not None:  # --init gptq: this rank's experts' GPTQ results (``start.expert_starts``)
                for j, codes, scale, optimum in start_of(w, [u for u in self.units if u.path == path], start, opt,
                                                         owned.start):
                    t.start_at(j, codes, scale, optimum)
            del w
        del src, gate_up, down
        # starved experts keep their start (RTN, or --init gptq's), their updates masked
        self.starved: set[str] = set()
        for u in self.units:
            if not opt.all_experts and routed.get((u.module, u.expert), 0) < opt.min_expert_tokens:
                self.tuned[u.path.rsplit(".", 1)[1]].mask[u.expert - owned.start] = 0
                self.starved.add(u.key)
        self.moved = sum(t.moved for t in self.tuned.values())
        self.how = {k: r.how for k, r in start[0].items()} if start is not None else {}  # a starved unit keeps it
        self.trained_all = {e for e in owned if all((p, e) in self.unit for p in self.paths) and len(self.paths) == 2}
        self.fakes: dict[str, torch.Tensor] = {}
        self.leaves: dict[tuple[str, int], torch.Tensor] = {}

    def source_weight(self, name: str, j: int) -> torch.Tensor:
        t = self.tuned.get(name)
        return t.wg[j].reshape(t.shape[1:]) if t is not None else self.source[name][j]

    def begin_step(self) -> None:
        """This step's quantized weights (graph to the trained parameters) and a leaf per expert."""
        self.fakes = {name: t.fake() for name, t in self.tuned.items()}
        self.leaves = {(name, e): f[e - self.range.start].detach().requires_grad_(True)
                       for name, f in self.fakes.items() for e in self.range}

    def weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = e - self.range.start
        return tuple(self.leaves[(n, e)] if n in self.tuned else self.source[n][j] for n in ("gate_up_proj",
                                                                                           "down_proj"))

    def backward(self, sums: dict[tuple[str, int], torch.Tensor | None]) -> None:
        """The step's summed gradients of the per-expert leaves back through the grid, once."""
        outs, grads = [], []
        for name, f in self.fakes.items():
            per = [sums.get((name, e)) for e in self.range]
            if all(g is None for g in per):
                continue
            zero = torch.zeros_like(f[0])
            outs.append(f)
            grads.append(torch.stack([zero if g is None else g for g in per]))
        if outs:
            torch.autograd.backward(outs, grads)
        self.fakes, self.leaves = {}, {}

    def results(self) -> dict[str, Result]:
        finals = {name: t.final() for name, t in self.tuned.items()}
        out = {}
        for u in self.units:
            codes, scale = finals[u.path.rsplit(".", 1)[1]]
            j = u.expert - self.range.start
            out[u.key] = Result(codes[j].cpu().contiguous(), scale[j].cpu().contiguous(),
                                self.how.get(u.key, "rtn") if u.key in self.starved else "autoround")
        return out


def _to_each(world, items: list, n: int, what: str):
    """``items`` (one per batch position of ``n``) sent to the rank computing each position
    (``samples_of``): on this rank, every rank's items for its own positions, in rank order."""
    mine = None
    for o in range(world.size):
        got = world.gather([items[q] for q in distributed.samples_of(n, world.size, o)], what, to=o)
        if got is not None:
            mine = got
    return mine


class Tuning:
    """One layer's AutoRound on this rank: its build of the layer (a MoE layer's dense part, its
    routed experts replaced by ``stand``; a layer without routed experts whole), its owned
    experts, and the phases of a step, which every rank runs in the same order."""

    def __init__(self, world, streamer, ctx, layer, stand, i: int, units: list[Unit], opt, routed: dict,
                 device: str, pool, workers: int, start: tuple[dict, dict] | None = None):
        self.world, self.streamer, self.ctx, self.layer, self.stand = world, streamer, ctx, layer, stand
        self.i, self.opt, self.device, self.pool, self.workers = i, opt, device, pool, max(1, workers)
        # the parameters the built layer holds and rank 0 trains (its leaves each step)
        self.held = list(dict.fromkeys(u.path for u in units if stand is None or u.expert is None))
        self.grad_in = bool(self.held)  # gradients flow back through the experts' inputs to them
        layer.requires_grad_(False)
        self.own = Owned(streamer, i, units, opt, routed, world.owned(stand.num_experts), device, start) \
            if stand is not None else None
        # --init gptq on streamed experts, on rank 0: every rank's experts' moved scales, and what each starved
        # expert keeps (its start's method: GPTQ's, or RTN where GPTQ too had too few tokens)
        self.moved, self.kept = None, {}
        if start is not None:
            got = world.gather((self.own.moved, {k: self.own.how.get(k, "rtn") for k in self.own.starved}),
                               f"layer {i} AutoRound experts' start", to=0)
            if got is not None:
                self.moved = sum(m for m, _ in got)
                for _, kept in got:
                    self.kept.update(kept)
        self.best = self._snapshot()

    def _snapshot(self) -> list:
        return [t.snapshot() for t in self.own.tuned.values()] if self.own is not None else []

    def _whole(self, samples, positions: range, n: int, denom: int, leaves: dict):
        """A step on a layer built whole: each sample's loss and its gradients of ``leaves``."""
        lv = list(leaves.values())

        def one(sample):
            h, topk, target = sample
            out, _ = call_layer(self.streamer, self.ctx, self.layer, h, topk)
            loss = (out - target.to(out.device)).pow(2).sum() / denom
            return float(loss.detach()), torch.autograd.grad(loss, lv, allow_unused=True)

        shards = len(distributed.sample_shards(n))
        tree = distributed.TreeSum(shards, _add_grads)
        losses = []
        for q, (loss, grads) in zip(positions, in_order(self.pool, self.workers, one, samples)):
            losses.append(loss)
            tree.add(distributed.owner_of(q, n, shards), list(grads))
        tree.close()
        return losses, {}, tree

    # -- A, B: the experts' inputs to every rank, their outputs back --------------------------
    def _capture(self, sample):
        h, topk, _ = sample
        self.stand.capture()
        with torch.no_grad():
            call_layer(self.streamer, self.ctx, self.layer, h, topk)
        r = self.stand.take()
        return r.hidden.cpu(), r.index.cpu(), r.weights.cpu()

    def _experts_forward(self, r):
        """Per owned expert the router sent tokens: (expert, rows, positions, its input rows and
        routing weights as leaves, its weighted output with the graph), and (--all-experts) each
        trained expert's own squared error over every token (with the graph)."""
        hidden, index, weights = (t.to(self.device) for t in r)
        kept, extra = [], []
        for e in self.own.range:
            gu, dn = self.own.weights(e)
            found = rows(index, e)
            if found is not None:
                token_idx, pos = found
                x = hidden[token_idx].detach().requires_grad_(self.grad_in)
                w = weights[token_idx, pos].detach().requires_grad_(self.grad_in)
                kept.append((e, token_idx, pos, x, w, ffn(x, gu, dn, self.stand.act_fn) * w[:, None]))
            if self.opt.all_experts and e in self.own.trained_all:
                j = e - self.own.range.start
                with torch.no_grad():
                    ref = ffn(hidden, self.own.source_weight("gate_up_proj", j),
                               self.own.source_weight("down_proj", j), self.stand.act_fn)
                extra.append((e, (ffn(hidden, gu, dn, self.stand.act_fn) - ref).pow(2).sum()))
        return kept, extra

    # -- C: the layer with gradients, the experts' output as a leaf --------------------------
    def _forward(self, sample, cap, parts: list, denom: int):
        h, topk, target = sample
        out = torch.zeros(cap[0].shape, dtype=cap[0].dtype, device=self.device)
        for part in parts:  # rank order = expert order: transformers' index_add_ sequence
            for token_idx, _, y in part:
                out.index_add_(0, token_idx.to(self.device), y.to(self.device, out.dtype))
        out.requires_grad_(True)
        self.stand.replay(out, record=True)
        o, _ = call_layer(self.streamer, self.ctx, self.layer, h, topk)
        r = self.stand.take()
        if not torch.equal(r.index.cpu(), cap[1]):
            raise QuantizeError(f"decoder layer {self.i}: the router chose other experts in two passes of the same "
                                "weights (a nondeterministic kernel); run on the CPU or report it")
        loss = (o - target.to(o.device)).pow(2).sum() / denom
        g_out, = torch.autograd.grad(loss, out, retain_graph=self.grad_in)
        return float(loss.detach()), (loss, r) if self.grad_in else None, g_out.cpu()

    # -- D: the experts' backward on their owner ----------------------------------------------
    def _experts_backward(self, kept, extra, g_out: torch.Tensor, denom: int):
        g_out = g_out.to(self.device)
        outs = [y for *_, y in kept] + [t for _, t in extra]
        grads = [g_out[token_idx] for _, token_idx, *_ in kept] + [torch.full_like(t, 1.0 / denom) for _, t in extra]
        keys = list(self.own.leaves)
        inputs = [self.own.leaves[k] for k in keys]
        if self.grad_in:
            inputs += [t for _, _, _, x, w, _ in kept for t in (x, w)]
        if not outs or not inputs:
            return {}, []
        got = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
        leaf = dict(zip(keys, got[:len(keys)]))
        back = []
        if self.grad_in:
            rest = got[len(keys):]
            for k, (_, token_idx, pos, *_) in enumerate(kept):
                back.append((token_idx.cpu(), pos.cpu(), rest[2 * k].cpu(), rest[2 * k + 1].cpu()))
        return leaf, back

    # -- E: the rest of the backward, to the Linear units ------------------------------------
    def _backward(self, held, parts: list, leaves: list):
        loss, r = held
        dh = torch.zeros_like(r.hidden)
        dw = torch.zeros_like(r.weights)
        # the experts' input rows' gradients added from the LAST expert to the first: the order in which
        # autograd's engine adds them on a whole layer (transformers' experts take a view of the hidden
        # states; each expert's backward runs, and delivers its rows to that view, in reverse creation
        # order), so the Linear units' gradients are the whole layer's bit for bit
        for part in reversed(parts):  # rank order = expert order
            for token_idx, pos, dx, dwt in reversed(part):
                dh.index_add_(0, token_idx.to(dh.device), dx.to(dh.device, dh.dtype))
                dw[token_idx.to(dw.device), pos.to(dw.device)] = dwt.to(dw.device, dw.dtype)
        outs, grads = [loss], [None]
        for t, g in ((r.hidden, dh), (r.weights, dw)):
            if t.requires_grad:
                outs.append(t)
                grads.append(g)
        return torch.autograd.grad(outs, leaves, grads, allow_unused=True)

    def step(self, samples: list, positions: range, n: int, denom: int, leaves: dict):
        """One training step's phases on this rank for its ``samples`` (batch ``positions`` of ``n``)
        with the Linear units' quantized weights installed as ``leaves``: (this rank's per-position
        losses, the owned experts' --all-experts terms per batch position, the Linear units'
        gradient tree over the step's shards). The owned experts' gradients are on their
        parameters when it returns."""
        if self.stand is None:
            return self._whole(samples, positions, n, denom, leaves)
        world, i = self.world, self.i
        shards = len(distributed.sample_shards(n))
        caps = list(in_order(self.pool, self.workers, self._capture, samples))
        every = [c for part in world.gather(caps, f"layer {i} AutoRound experts' inputs") for c in part]
        del caps
        self.own.begin_step()
        fw = list(in_order(self.pool, self.workers, self._experts_forward, every))
        sent = [[(token_idx.cpu(), pos.cpu(), y.detach().cpu()) for _, token_idx, pos, _, _, y in kept]
                for kept, _ in fw]
        parts = _to_each(world, sent, n, f"layer {i} AutoRound experts' outputs")
        del sent
        mine = [every[q] for q in positions]

        def forward(k):
            return self._forward(samples[k], mine[k], [p[k] for p in parts], denom)

        cs = list(in_order(self.pool, self.workers, forward, range(len(positions))))
        del parts
        g_all = [g for part in world.gather([c[2] for c in cs], f"layer {i} AutoRound output gradients") for g in part]
        keys = list(self.own.leaves)
        tree = distributed.TreeSum(shards, _add_grads) if keys else None
        backs, extras = [], {}

        def backward(q):
            kept, extra = fw[q]
            return self._experts_backward(kept, extra, g_all[q], denom)

        for q, (leaf, back) in enumerate(in_order(self.pool, self.workers, backward, range(n))):
            if tree is not None:
                tree.add(distributed.owner_of(q, n, shards), [leaf.get(k) for k in keys])
            backs.append(back)
            extras[q] = [(e, float(t.detach())) for e, t in fw[q][1]]
            fw[q] = None
        if tree is not None:
            self.own.backward(dict(zip(keys, tree.combine(None, f"layer {i} AutoRound expert gradients"))))
        else:
            self.own.fakes, self.own.leaves = {}, {}
        del g_all, fw
        linear_tree = distributed.TreeSum(shards, _add_grads)
        if self.grad_in:
            back_parts = _to_each(world, backs, n, f"layer {i} AutoRound experts' input gradients")
            del backs
            lv = list(leaves.values())

            def rest(k):
                return self._backward(cs[k][1], [p[k] for p in back_parts], lv)

            for k, grads in enumerate(in_order(self.pool, self.workers, rest, range(len(positions)))):
                linear_tree.add(distributed.owner_of(positions[k], n, shards),
                                [None if g is None else g for g in grads])
                cs[k] = (cs[k][0], None, None)
        linear_tree.close()
        return [c[0] for c in cs], extras, linear_tree

    def update(self, best: bool, lr: float) -> None:
        """Step the owned experts (snapshot first when rank 0 says this step is the best)."""
        if self.own is None:
            return
        if best:
            self.best = self._snapshot()
        for t in self.own.tuned.values():
            t.step(lr)

    def results(self) -> dict[str, Result]:
        """The owned experts' results at the best step."""
        if self.own is None:
            return {}
        for t, snap in zip(self.own.tuned.values(), self.best):
            t.restore(snap)
        return self.own.results()


def _write_groups(streamer, n_experts: int, size: int) -> list[range]:
    """The groups the experts' results are sent to rank 0 in (each within one rank's range, at
    most ``--memory-budget-gib`` of source weights and copies): the same list on every rank."""
    pe = per_expert_bytes(streamer, False)
    return [g for r in range(size) for g in streamer.expert_groups(pe, distributed.partition(n_experts, size, r))]


def _send_results(world, streamer, stand, results: dict[str, Result], by_expert: dict, i: int) -> None:
    """A rank other than 0: its experts' results to rank 0, a group at a time, as rank 0 asks."""
    for g in _write_groups(streamer, stand.num_experts, world.size):
        mine = g.start in world.owned(stand.num_experts)
        payload = {u.key: results[u.key] for e in g for u in by_expert.get(e, ())} if mine else None
        world.gather(payload, f"layer {i} AutoRound experts' results", to=0)


def _rtn_weights(by_expert: dict[int, list[Unit]], opt):
    """A variant's weights (``streamed.Variant``): the group's experts at RTN on the method's grid."""

    def weights(g, gate_up, down):
        gu, dn = gate_up.clone(), down.clone()
        for j, e in enumerate(g):
            for u in by_expert.get(e, ()):
                target = gu if u.path.endswith("gate_up_proj") else dn
                target[j].copy_(dequant(rtn(target[j], opt.group_size, opt.observer, u.scale_dtype)).to(target.device))
        return gu, dn

    return weights


def _train(world, tuning: Tuning, x, tuned: dict[str, Tuned], layer, rtn_start: bool = True) -> dict:
    """Rank 0's loop over the steps: picks each batch, sends the other ranks their shares with the
    Linear units' quantized weights, sums the losses, steps the Linear units, and says whether a
    step is the best so far. Returns the training report. ``rtn_start``: a last loss DIVERGED times
    the first is refused (from another method's start, far below RTN's loss, the steps may climb
    that far without the learning rate being wrong: the best step, the start at worst, is kept)."""
    opt, i, hidden, topk, targets = x.options, x.index, x.hidden, x.topk, x.targets
    n = len(hidden)
    bs = min(opt.batch_size, n)
    gen = torch.Generator().manual_seed(SEED + i)
    order: list[int] = []
    losses: list[float] = []
    best, best_loss, best_step = [t.snapshot() for t in tuned.values()], math.inf, 0
    for step in range(opt.iters):
        if len(order) < bs:
            order += torch.randperm(n, generator=gen).tolist()
        batch, order = order[:bs], order[bs:]
        denom = sum(targets[s].numel() for s in batch)
        fakes = {path: t.fake() for path, t in tuned.items()}
        leaves = {path: torch.nn.Parameter(w.detach()) for path, w in fakes.items()}
        for path, p in leaves.items():
            _set_param(layer, path, p)
        shares = [distributed.samples_of(len(batch), world.size, k) for k in range(world.size)]
        if world.size > 1:
            world.broadcast(("step", {"fakes": {p: w.detach().cpu() for p, w in fakes.items()}, "denom": denom,
                                      "batch": len(batch),
                                      "samples": [[tuple(_cpu(t) for t in (hidden[batch[q]], topk[batch[q]],
                                                                           targets[batch[q]])) for q in share]
                                                  for share in shares[1:]]}),
                            f"layer {i} AutoRound step {step}")
        samples = [(hidden[batch[q]], topk[batch[q]], targets[batch[q]]) for q in shares[0]]
        mine, extras, ltree = tuning.step(samples, shares[0], len(batch), denom, leaves)
        summed = _combine(world, tuning, ltree, f"layer {i} AutoRound step {step}")
        got = world.gather({"losses": mine, "extras": extras}, f"layer {i} AutoRound step {step} losses", to=0)
        per_q = [v for o in got for v in o["losses"]]  # rank order = batch order
        total = 0.0
        for q, loss in enumerate(per_q):
            extra = 0.0
            for o in got:  # rank order = expert order
                for _, t in o["extras"].get(q, ()):
                    extra += t
            total += loss + extra / denom
        if summed is not None:
            paths = list(leaves)
            live = [j for j in range(len(paths)) if summed[j] is not None]
            if live:
                torch.autograd.backward([fakes[paths[j]] for j in live], [summed[j] for j in live])
        if not math.isfinite(total):
            raise QuantizeError(f"decoder layer {i}: the AutoRound loss became {total} at step {step}; lower --lr "
                                f"(now {opt.lr:g}) or use --method gptq")
        losses.append(total)
        is_best = total < best_loss
        if is_best:
            best_loss, best_step = total, step
            best = [t.snapshot() for t in tuned.values()]
        lr_t = opt.lr * (1 - step / opt.iters)
        if world.size > 1:
            world.broadcast(("update", {"best": is_best, "lr": lr_t}), f"layer {i} AutoRound step {step} update")
        tuning.update(is_best, lr_t)
        for t in tuned.values():
            t.step(lr_t)
    if world.size > 1:
        world.broadcast(("end", None), f"layer {i} AutoRound")
    if rtn_start and losses and losses[-1] > DIVERGED * losses[0]:
        raise QuantizeError(f"decoder layer {i}: the AutoRound loss diverged ({losses[0]:.4g} at step 0, "
                            f"{losses[-1]:.4g} at the last step); lower --lr (now {opt.lr:g}) or --iters")
    for path, t in tuned.items():  # the layer's own parameters back (the caller installs the results)
        _set_param(layer, path, torch.nn.Parameter(t.wg.reshape(t.shape).clone(), requires_grad=False))
    for t, snap in zip(tuned.values(), best):
        t.restore(snap)
    return {"iters": opt.iters, "lr": opt.lr, "batch_size": bs, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "best_loss": best_loss if losses else None,
            "best_step": best_step if losses else None}


def _combine(world, tuning: Tuning, tree, what: str):
    """The Linear units' gradients of a step: every rank's subtrees finished on rank 0 (None elsewhere,
    and everywhere when the layer has no Linear unit)."""
    if not tuning.grad_in:
        return None
    dev = tuning.device
    return tree.combine(world, what, send=lambda v: [None if g is None else g.cpu() for g in v],
                        receive=lambda v: [None if g is None else g.to(dev) for g in v])


def train(fwd, layer, stand, x, routed: dict, start: tuple[dict, dict] | None = None, expert_cap=None
          ) -> tuple[dict[str, Result], dict[str, Result], dict]:
    """Rank 0's AutoRound of layer ``x`` (the built ``layer`` holding the source weights; a MoE
    layer's routed experts in ``stand``'s place, each rank training its own): the other ranks told
    to build it, the experts the router starves (below --min-expert-tokens) named in
    ``x.fallbacks`` and kept at their start, the steps. ``start``: ``gptq_start``'s, for the units of
    the built layer (``--init gptq``; else they start from RTN); ``expert_cap`` (``--init gptq`` on a
    streamed layer): what the router handed the routed experts through the source layer, from which
    every rank GPTQs the experts it trains (``start.expert_starts``). Returns (the results of the units
    the built layer holds, rank 0's own experts' results, the training report)."""
    opt, i, world = x.options, x.index, distributed.current()
    fullrange = int4.GRIDS[opt.observer].signed
    tuned: dict[str, Tuned] = {}
    held = [u for u in x.units if stand is None or u.expert is None]
    for u in held:
        if u.path not in tuned:
            w = layer.get_parameter(u.path).detach().clone()
            t = tuned[u.path] = Tuned(u.path, w, opt.group_size, fullrange, u.scale_dtype)
            for j, codes, scale, optimum in start_of(w, [v for v in held if v.path == u.path], start, opt) \
                    if start else ():
                t.start_at(j, codes, scale, optimum)
    how = {k: r.how for k, r in start[0].items()} if start else {}  # what a starved unit keeps: its start
    starved: dict[str, int] = {}  # unit key -> the tokens the router sent it
    for u in x.units:
        if u.expert is None or opt.all_experts or u.key in starved:
            continue
        c = routed.get((u.module, u.expert), 0)
        if c < opt.min_expert_tokens:
            starved[u.key] = c
            if u.path in tuned:  # a fused parameter of a layer built whole
                tuned[u.path].mask[u.expert] = 0
    if world.size > 1:  # the other ranks build this layer and compute their share of each step (tune_rank)
        world.broadcast(("autoround", {"layer": i, "units": x.units, "options": opt, "routed": routed,
                                       "workers": fwd.workers, "budget": fwd.streamer.expert_budget,
                                       "stream": stand is not None, "expert_start": expert_cap is not None,
                                       "memory": fwd.budget.limit, "out": fwd.out}), f"layer {i} AutoRound")
    own_start = expert_starts(world, fwd, stand, i, x.units, opt, expert_cap) if expert_cap is not None else None
    tuning = Tuning(world, fwd.streamer, fwd.ctx, layer, stand, i, x.units, opt, routed, fwd.device, fwd.pool,
                    fwd.workers, own_start)
    del own_start
    kept = how | tuning.kept
    for u in x.units:  # a starved unit keeps its start: an RTN fallback, named, unless it is GPTQ's result
        if u.key in starved and kept.get(u.key, "rtn") == "rtn":
            for name, _, _ in u.names:
                x.fallbacks.append({"name": name, "reason": f"{starved[u.key]} routed calibration tokens < "
                                                            f"--min-expert-tokens {opt.min_expert_tokens}"})
    report = _train(world, tuning, x, tuned, layer, rtn_start=not (start or expert_cap is not None))
    if start or expert_cap is not None:
        report["moved_scales"] = sum(t.moved for t in tuned.values()) + (tuning.moved or 0)
    finals = {path: t.final() for path, t in tuned.items()}
    results = {}
    for u in held:
        codes, scale = finals[u.path]
        if u.expert is not None:
            codes, scale = codes[u.expert], scale[u.expert]
        results[u.key] = Result(codes.cpu().contiguous(), scale.cpu().contiguous(),
                                how.get(u.key, "rtn") if u.key in starved else "autoround")
    return results, tuning.results(), report


def stream_step(streamer, fwd, layer, stand, x, write_group):
    """AutoRound on a MoE layer (module docstring), on rank 0: the RTN layer's error and the
    routing the quantized path sees (the routed experts a group at a time), the training (every
    rank its own experts), the experts' results written a group at a time as they arrive, and
    the quantized layer's routed outputs for the next layer. Returns (``Step``, those outputs)."""
    opt, i = x.options, x.index
    world = distributed.current()
    linear = [u for u in x.units if u.expert is None]
    experts = by_expert(x.units)

    def put(res):
        put_linear(layer, linear, x.originals, res, fwd.device)

    ref = x.targets
    put(x.rtn)
    cap = fwd.capture(layer, stand, x.hidden, x.topk, i)
    routed = {(u.module, u.expert): 0 for u in x.units if u.expert is not None}
    for s in range(len(cap)):
        idx = cap.index[s]
        for key in routed:
            routed[key] += int((idx == key[1]).any(-1).sum())
    v = Variant(cap, _rtn_weights(experts, opt))
    run_groups(streamer, fwd, i, stand, [v], per_expert_bytes(streamer, False))
    cap.clear()
    _, _, (e_rtn, tot) = fwd(layer, x.hidden, x.topk, i, "after the RTN layer", keep=False, ref=ref, stand=stand,
                             replay=v.acc)
    put(None)
    start = cap_s = None
    if opt.init == "gptq" and linear:  # the source layer's statistics, as --method gptq takes them (the Linear
        start = gptq_start(x, layer, linear, stand=stand, replay=v.acc)  # units' do not depend on the experts')
    v.acc.clear()
    if opt.init == "gptq" and experts:
        cap_s = fwd.capture(layer, stand, x.hidden, x.topk, i)
    results, own, report = train(fwd, layer, stand, x, routed, start, cap_s)
    put(results)
    cap_q = fwd.capture(layer, stand, x.hidden, x.topk, i)
    cur: dict[str, Result] = {}

    def receive(g, gate_up, down):
        owner = distributed.owner_of(g.start, stand.num_experts, world.size)
        mine = {u.key: own[u.key] for e in g for u in experts.get(e, ())} if owner == 0 else None
        got = world.gather(mine, f"layer {i} AutoRound experts' results", to=0)
        cur.clear()
        cur.update(got[owner])
        us = [u for e in g for u in experts.get(e, ())]
        if us:
            write_group(g.start, *_tensors(us, cur))

    vq = Variant(cap_q, with_results(lambda u: cur.get(u.key), experts))
    run_groups(streamer, fwd, i, stand, [vq], per_expert_bytes(streamer, False), before_outputs=receive,
               groups=_write_groups(streamer, stand.num_experts, world.size))
    cap_q.clear()
    return Step(results, ref, routed, e_rtn, tot, report={"train": report}), vq.acc


def tune_rank(world, streamer, layer, job: dict, device: str, spill=None) -> None:
    """A rank other than 0 of an AutoRound layer (``train`` sends ``job``): this rank's build of
    the layer (a MoE layer's dense part and this rank's routed experts), with ``--init gptq`` its
    experts' GPTQ start (``start.expert_starts``: rank 0's captures held on the job's memory budget,
    ``spill`` beyond it), each step's phases for its share of the batch, and its experts' results
    sent to rank 0. ``layer``: this rank's build of it on ``device`` (``runner._build(...,
    stream_experts=job["stream"])``)."""
    from concurrent.futures import ThreadPoolExecutor

    from .forward import Forward
    from .store import Budget

    i, opt = job["layer"], job["options"]
    streamer.expert_budget = job["budget"]
    stand = streamer.stand_in(layer) if job["stream"] else None
    ctx = Context(streamer, device)
    on = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    with ThreadPoolExecutor(max(1, job["workers"]), thread_name_prefix="autoround") as pool:
        start = None
        if job.get("expert_start"):
            fwd = Forward(streamer, ctx, pool, job["workers"], device, Budget(job["memory"]), spill)
            start = expert_starts(world, fwd, stand, i, job["units"], opt, None)
        tuning = Tuning(world, streamer, ctx, layer, stand, i, job["units"], opt, job["routed"], device, pool,
                        job["workers"], start)
        del start
        while True:
            kind, step = world.broadcast(None, f"layer {i} AutoRound's next step")
            if kind == "end":
                break
            leaves = {p: torch.nn.Parameter(w.to(device)) for p, w in step["fakes"].items()}
            for path, leaf in leaves.items():
                _set_param(layer, path, leaf)
            samples = [(on(h), on(t), on(y)) for h, t, y in step["samples"][world.rank - 1]]
            n = step["batch"]
            mine, extras, ltree = tuning.step(samples, distributed.samples_of(n, world.size, world.rank), n,
                                              step["denom"], leaves)
            _combine(world, tuning, ltree, f"layer {i} AutoRound step")
            world.gather({"losses": mine, "extras": extras}, f"layer {i} AutoRound step losses", to=0)
            _, upd = world.broadcast(None, f"layer {i} AutoRound step update")
            tuning.update(upd["best"], upd["lr"])
        own = tuning.results()
    if stand is not None:
        _send_results(world, streamer, stand, own, by_expert(job["units"]), i)
