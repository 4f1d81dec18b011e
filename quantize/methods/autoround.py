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

import torch

from .base import Layer, Method, Step
from .forward import Collector
from .start import gptq_start
from .tuning import CLIP_RANGE, V_RANGE, Tuned, stream_step, train as train_layer  # noqa: F401 - the grid
from .units import Unit

# what `quantize check --source` proves of an AutoRound tensor: the published clip range, written apart
# from CLIP_RANGE on purpose, so a CLIP_RANGE loosened by mistake makes the check fail instead of agreeing
PROVEN_RANGE = (0.5, 1.0)


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


class AutoRound(Method):
    """``--method autoround``: the layer's targets are the source model's own outputs of it (the
    full-precision stream), which the quantized layer learns to reproduce from the quantized-path
    inputs, so it also corrects the error the layers before it left (auto-round's quantized-input
    mode); the routing counted is the one the quantized path sees."""

    name = "autoround"
    source_stream = True
    streams_experts = True  # a MoE layer's routed experts: each rank trains its own (methods/tuning.py)
    splits_samples = False  # rank 0 holds every sample; each step's samples are split (tune_rank)
    report_fields = ("iters", "lr", "batch_size", "init")
    title = ("AutoRound-class tuning: learnable rounding offsets and per-group min/max scale factors trained by "
             "signed gradient descent on each decoder layer's output error (Cheng et al.)")
    loss_target = "the source model's own output of this layer (so it includes the error the layers before it left)"

    def layer_step(self, layer: Layer) -> Step:
        x = layer
        ref = x.targets
        start = gptq_start(x, x.module, x.units) if x.options.init == "gptq" else None
        counter = RouteCounter(x.module, x.units)  # the routing the quantized path sees
        x.put(x.rtn)
        try:
            _, _, (e_rtn, tot) = x.fwd(x.module, x.hidden, x.topk, x.index, "after the RTN layer", keep=False, ref=ref,
                                       collector=counter)
        finally:
            counter.remove()
        x.put(x.originals)
        results, _, train = train_layer(x.fwd, x.module, None, x, counter.routed, start)
        return Step(results, ref, counter.routed, e_rtn, tot, report={"train": train})

    def streamed_step(self, fwd, module, stand, layer: Layer, write_group):
        return stream_step(fwd.streamer, fwd, module, stand, layer, write_group)

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
        start = "from GPTQ's result" if report.get("init") == "gptq" else "from round-to-nearest"
        return f"{report.get('iters')} iterations, lr {report.get('lr')}, batch {report.get('batch_size')}, {start}"
