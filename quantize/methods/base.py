"""What a data-aware method is to the layer pass: the ``Method`` protocol, the ``Layer`` a
method's step gets and the ``Step`` it gives back. The pass (``runner``) owns everything common:
the streams of hidden states, the RTN start, the loss after the method, the layer files and the
reports; a method supplies only its per-layer step (statistics hooks and the quantization) and
what its reports and the model card say about it. The methods are listed in ``registry.METHODS``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Protocol

import torch

from ..options import DEFAULT_GRID, ConvertOptions, method_options, spec
from .forward import Forward
from .store import HiddenStore
from .units import Result, Unit, dequant, install


@dataclass
class Layer:
    """One decoder layer with INT4 units, as a method's ``layer_step`` gets it."""

    index: int
    module: torch.nn.Module  # transformers' layer, holding the source weights
    units: list[Unit]
    originals: dict[str, torch.Tensor]  # unit key -> the source weight
    rtn: dict[str, Result]  # unit key -> round-to-nearest on the method's grid (the loss before)
    hidden: HiddenStore  # the inputs on the quantized path
    topk: list
    targets: HiddenStore | None  # the source model's own outputs of this layer (``source_stream`` methods)
    fallbacks: list[dict]  # a step appends {"name", "reason"} for each weight it leaves at RTN
    options: object  # the plan's ConvertOptions
    fwd: Forward  # every sample through a layer, on the pass's pool and stores
    sources: HiddenStore | None = None  # the source model's own inputs of this layer (GPTQ --asym)
    source_topk: list | None = None  # and their DSA top-k

    @property
    def asym(self) -> bool:
        """GPTQ --asym above 0 (a method without the option: off)."""
        return bool(getattr(self.options, "asym", 0))

    @property
    def source_target(self) -> bool:
        """Whether the layer's loss is measured against the source model's own output of it (``targets``):
        GPTQ --asym aims there."""
        return self.asym and self.targets is not None

    @property
    def paired(self) -> bool:
        """Whether GPTQ pairs this layer's inputs with the source stream's (``--asym``, and the source
        stream differs from the quantized path: before the first quantized layer it is the same)."""
        return self.asym and self.sources is not None and self.sources is not self.hidden

    def put(self, res: dict) -> None:
        """Install ``res`` (results, or ``originals``) as the layer's weights: ``q * scale`` as the
        engines compute, or the source weights themselves."""
        for u in self.units:
            w = self.originals[u.key] if res is self.originals else dequant(res[u.key])
            install(self.module, u, w.to(self.fwd.device))


@dataclass
class Step:
    """What a method's step leaves for the pass: per unit its result, the reference outputs the
    quantized layer's error is measured against (the pass clears them unless they are the
    layer's ``targets``), the tokens the router sent each routed expert, the error with the RTN
    weights (and the squared norm of the reference), and the method's own per-layer report."""

    results: dict[str, Result]
    ref: HiddenStore
    routed: dict[tuple[str, int], int]
    err_rtn: float
    ref_sq: float
    report: dict = field(default_factory=dict)


class Method(Protocol):
    """A data-aware method. ``name``: its ``--method`` value (and what the manifest records for
    the tensors it made); ``grid``: its default observer; ``source_stream``: the source model's
    own hidden states are carried beside the quantized path and given as ``Layer.targets``;
    ``streams_experts``: a MoE layer is built without its routed experts, which ``streamed_step``
    reads a group at a time (GPTQ: ``methods/streamed.py``) or each rank its own (AutoRound:
    ``methods/tuning.py``) instead of the whole layer being built;
    ``splits_samples``: on several ranks every rank runs the layer pass on its own share of the
    calibration samples (``distributed.samples_of``) instead of rank 0 holding them all;
    ``report_fields``: the options the run report records (after the common ones); ``title``,
    ``loss_target`` and ``card_section``: what the model card says of it."""

    name: str
    source_stream: bool
    streams_experts: bool  # a MoE layer's routed experts go a group at a time (methods/streamed.py)
    splits_samples: bool  # on several ranks, each runs the pass on its own calibration samples
    report_fields: tuple[str, ...]
    title: str
    loss_target: str

    def layer_step(self, layer: Layer) -> Step:
        """Statistics hooks, the quantization of ``layer.units``, and the RTN error; leaves the
        layer's weights as it likes (the pass then installs the results)."""
        ...

    def streamed_step(self, fwd: Forward, module, stand, layer: Layer, write_group) -> tuple[Step, HiddenStore]:
        """``layer_step`` for a MoE layer built without its routed experts (``stand`` in their place,
        ``layer.originals``/``rtn`` holding the Linear units only): the experts' results go to
        ``write_group(first expert, tensors, {module: method})`` a group at a time, and the step
        gives back the quantized layer's routed outputs per sample (``Forward(..., replay=)``)."""
        ...

    def card_section(self, report: dict) -> str:
        """The card's words for this method's settings, from the run report (the manifest's
        ``method``)."""
        ...

    def target_of(self, report: dict) -> str:
        """What the run's per-layer loss was measured against (``loss_target`` unless its options moved it)."""
        return self.loss_target

    def grid_proof(self, scale: torch.Tensor, rtn_scale: torch.Tensor, observer: str) -> str | None:
        """What ``quantize check --source`` proves of a tensor this method made, against the
        round-to-nearest scales the source implies on ``observer``'s grid: None when they fit,
        else why not (one clause)."""
        ...

    @property
    def grid(self) -> str:
        """Its default observer, as ``quantize.options.DEFAULT_GRID`` declares it."""
        return DEFAULT_GRID[self.name]

    @property
    def options(self) -> tuple[str, ...]:
        """The convert options this method takes, as ``quantize.options.ConvertOptions`` declares them."""
        return tuple(k for k, methods in method_options().items() if self.name in methods)

    @property
    def defaults(self) -> dict:
        """The declared defaults of this method's options (``Spec.method_default``)."""
        return {f.name: spec(f).method_default for f in fields(ConvertOptions)
                if f.name in self.options and spec(f).method_default is not None}
