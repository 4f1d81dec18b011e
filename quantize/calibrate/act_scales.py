"""Static FP8 input scales of the routed experts, calibrated from the tokens routed to each expert:
what SGLang's native ``w4afp8`` reads per expert (``w1/w3.input_scale`` for the first GEMM's input,
the hidden states; ``w2.input_scale`` for the second's, act(gate) * up), docs/engines.md#w4afp8.

The source streams through its decoder layers as calibrate-kv streams it (``LayerStreamer``:
transformers' layer classes, the routed experts a group at a time within ``--memory-budget-gib``),
and each expert's two GEMM inputs are observed as the experts run on exactly the tokens routed to
them (``LayerStreamer.expert_tap``): per expert, the largest magnitude of each input (taken on the
bf16-rounded values, what a bf16 engine holds) and the token count. Several ranks split the samples
(``World.samples``) and rank 0 merges: a maximum and a sum, the same numbers for any ``--nproc``.

From those: scale = amax / 448 rounded up to bf16 (``formats.w4afp8.input_scale``). An expert routed
fewer than ``min_tokens`` tokens (``--min-expert-tokens``) is starved: it gets its layer's scale (the
largest amax over the layer's experts) and is named. A MoE layer the stream does not run (the MTP
draft layer) gets the largest scale of the calibrated layers, and is named too. SGLang 0.5.23 loads
the per-expert values and then uses the maximum over a layer's (local) experts (``w4afp8.py``
L271-284), so the per-expert values matter to an engine that keeps them and to the report; the
layer maximum is what SGLang computes with.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from ..errors import QuantizeError
from ..events import Emit, null_emit
from ..formats.w4afp8 import input_scale

VERSION = 1


@dataclass
class LayerAmax:
    """One MoE layer's observations, per expert: the largest |x| of each GEMM input, tokens routed."""

    gemm1: list[float]
    gemm2: list[float]
    tokens: list[int]

    @classmethod
    def empty(cls, n: int) -> "LayerAmax":
        return cls([0.0] * n, [0.0] * n, [0] * n)

    def merge(self, other: "LayerAmax") -> None:
        for e in range(len(self.tokens)):
            self.gemm1[e] = max(self.gemm1[e], other.gemm1[e])
            self.gemm2[e] = max(self.gemm2[e], other.gemm2[e])
            self.tokens[e] += other.tokens[e]


def _amax(t: torch.Tensor) -> torch.Tensor:
    """The largest |t| of the bf16-rounded values, a 0-d fp32 tensor on t's device (read by no one
    here: a GPU is not made to wait for it; an empty t's is 0)."""
    if not t.numel():
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().to(torch.bfloat16).abs().amax().float()


def observe(streamer, ids: list[torch.Tensor], world=None, emit: Emit = null_emit) -> dict[int, LayerAmax] | None:
    """Every streamed MoE layer's per-expert observations over the samples ``ids``; several ranks:
    each streams its share of the samples, rank 0 returns the merged observations (the others None).

    The maxima stay on the experts' device while a layer runs, one [2, experts] tensor per layer, and
    are read once when the layer is done: a tap is called per expert and sample, and a host read there
    would make the GPU drain its queue that often. Token counts are shapes, known on the host."""
    split = world is not None and world.size > 1
    own = world.samples(len(ids)) if split else range(len(ids))
    seen: dict[int, LayerAmax] = {}
    maxima: dict[int, torch.Tensor] = {}  # layer -> [gemm1, gemm2] x experts, fp32 on the device, unread
    n = int(getattr(streamer.config, "n_routed_experts", 0) or 0)

    def tap(i: int, e: int, x: torch.Tensor, inner: torch.Tensor) -> None:
        st = seen.get(i)
        if st is None:
            st = seen[i] = LayerAmax.empty(n)
            maxima[i] = torch.zeros((2, n), dtype=torch.float32, device=x.device)
        m = maxima[i]
        m[:, e] = torch.maximum(m[:, e], torch.stack([_amax(x), _amax(inner)]).to(m.device))
        st.tokens[e] += int(x.shape[0])

    def read(i: int) -> None:
        m = maxima.pop(i, None)
        if m is not None:
            seen[i].gemm1, seen[i].gemm2 = m.tolist()  # bf16 values, exact in fp32 and in a float

    streamer.expert_tap = tap
    try:
        for i, _ in streamer.stream([ids[k] for k in own]):
            read(i)
            emit({"event": "tensor", "name": f"layer {i}: the routed experts' input maxima", "done_bytes": i + 1})
    finally:
        streamer.expert_tap = None
    for i in list(maxima):  # a layer tapped after the last one yielded (none today)
        read(i)
    if not split:
        return seen
    got = world.gather(seen, "the experts' activation maxima", to=0)
    if got is None:
        return None
    merged: dict[int, LayerAmax] = {}
    for part in got:  # rank order; max and integer sums: the same for any order
        for i, st in part.items():
            merged.setdefault(i, LayerAmax.empty(len(st.tokens))).merge(st)
    return merged


@dataclass
class ActScales:
    """The scales written, per layer index and expert: (w13 scale, w2 scale); and what the report says."""

    scales: dict[int, list[tuple[float, float]]]
    min_tokens: int
    layers: list[dict] = field(default_factory=list)  # per layer: tokens min/median/max, starved experts
    uncalibrated: list[int] = field(default_factory=list)  # MoE layers no calibration ran through (MTP)
    data: dict = field(default_factory=dict)  # the calibration: samples, tokens, source

    def of(self, layer: int, expert: int, proj: str) -> float:
        """The scale written for ``proj`` (gate_proj / up_proj -> the first GEMM's, down_proj -> the
        second's) of ``expert`` in ``layer``."""
        try:
            w13, w2 = self.scales[layer][expert]
        except (KeyError, IndexError):
            raise QuantizeError(f"no activation scale for layer {layer} expert {expert}: the calibration did not "
                                "cover it; rerun with --overwrite") from None
        return w2 if proj == "down_proj" else w13

    def to_dict(self) -> dict:
        """What ``OUT/.quantize/act_scales.json`` keeps for a resume: the report and the scales."""
        return {"version": VERSION, **self.report(),
                "scales": {str(i): [list(p) for p in v] for i, v in sorted(self.scales.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> "ActScales":
        if d.get("version") != VERSION:
            raise ValueError("version")
        return cls({int(i): [(float(a), float(b)) for a, b in v] for i, v in d["scales"].items()},
                   int(d["min_tokens"]), list(d["layers"]), [int(i) for i in d["uncalibrated"]], dict(d["data"]))

    def report(self) -> dict:
        """What the manifest records (the scales themselves are in the checkpoint)."""
        return {"min_tokens": self.min_tokens, "layers": self.layers, "uncalibrated": self.uncalibrated,
                "data": self.data}


def scales(seen: dict[int, LayerAmax], moe_layers: dict[int, int], min_tokens: int) -> ActScales:
    """The scales of every MoE layer in ``moe_layers`` (layer index -> its experts), from ``seen``."""
    out: dict[int, list[tuple[float, float]]] = {}
    report: list[dict] = []
    calibrated = [i for i in moe_layers if i in seen]
    if not calibrated:
        raise QuantizeError("the calibration routed no token to any routed expert: no activation scale can be "
                            "measured; pass calibration text (--data) with more samples (--samples)")
    for i in calibrated:
        st, n = seen[i], moe_layers[i]
        if len(st.tokens) != n:
            raise QuantizeError(f"layer {i}: the calibration saw {len(st.tokens)} routed experts, the checkpoint has "
                                f"{n}; the config and the tensors disagree")
        top1, top2 = max(st.gemm1), max(st.gemm2)
        starved = [e for e in range(n) if st.tokens[e] < min_tokens]
        out[i] = [(input_scale(top1), input_scale(top2)) if e in starved
                  else (input_scale(st.gemm1[e]), input_scale(st.gemm2[e])) for e in range(n)]
        report.append({"layer": i, "tokens_min": min(st.tokens), "tokens_median": statistics.median(st.tokens),
                       "tokens_max": max(st.tokens), "starved": starved,
                       "gemm1_amax": top1, "gemm2_amax": top2})
    w13 = max(s for i in calibrated for s, _ in out[i])
    w2 = max(s for i in calibrated for _, s in out[i])
    rest = sorted(i for i in moe_layers if i not in seen)
    for i in rest:
        out[i] = [(w13, w2)] * moe_layers[i]
    return ActScales(out, min_tokens, report, rest)
