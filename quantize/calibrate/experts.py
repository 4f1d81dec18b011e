"""Routed experts streamed through a decoder layer, a group of experts at a time.

A whole MoE layer in fp32 is 70 GB at DeepSeek-V3's 256 experts and about 105 GB at Kimi K2.6's
384, so the layer pass does not build it. The layer is built with its attention, router and shared
experts, and its routed experts module (``mlp.experts``, transformers' fused ``gate_up_proj``
[E, 2I, H] / ``down_proj`` [E, H, I]) replaced by a ``StandIn`` without weights. Every sample goes
through the layer twice:

1. **capture**: the stand-in records what the router hands the experts (the flattened hidden
   states, ``top_k_index``, ``top_k_weights``) and returns zeros; the layer's output is discarded
   (statistics hooks, e.g. the KV cache observers and GPTQ's Hessians, fire here, once);
2. the routed experts are read (``LayerStreamer.expert_weights``: BF16, block FP8 or INT4,
   dequantized as the whole layer would hold them) a group at a time, each group run on exactly
   the tokens routed to it (``accumulate``) and freed;
3. **replay**: the stand-in returns the accumulated expert output of that sample, so the layer's
   output is the whole layer's.

``accumulate`` is transformers' eager experts forward (``DeepseekV3Experts.forward``,
``GlmMoeDsaExperts.forward`` in transformers 5.17: per expert in ascending order, the tokens from
``torch.where`` of its routing mask, ``act(gate) * up``, ``down``, times the routing weight,
``index_add_`` into one zero-initialised output) split at group boundaries with the SAME output
tensor carried across groups, so every addition happens in the same order as in the whole layer:
the result is bit for bit the whole layer's, for any group size (tests/test_expert_stream.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..errors import QuantizeError



@dataclass
class Routed:
    """What the router handed the routed experts for one sample."""

    hidden: torch.Tensor  # [T, H], the experts' input
    index: torch.Tensor  # [T, K] top-k expert indices
    weights: torch.Tensor  # [T, K] routing weights


class StandIn(torch.nn.Module):
    """Takes the place of a layer's routed experts module: records its input (capture) or returns
    a precomputed output (replay), per thread, so samples may run in parallel threads."""

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        gu, down = experts.gate_up_proj, experts.down_proj
        self.num_experts = int(gu.shape[0])
        self.gate_up_shape = tuple(gu.shape[1:])
        self.down_shape = tuple(down.shape[1:])
        self.act_fn = experts.act_fn
        self.experts_class = type(experts).__name__
        self._tls = threading.local()

    def capture(self) -> None:
        self._tls.output, self._tls.routed, self._tls.record = None, None, False

    def replay(self, output: torch.Tensor, record: bool = False) -> None:
        """Return ``output`` as the experts' output; ``record``: also keep what the router handed
        them, as it is (with its autograd graph: AutoRound's experts backward, ``methods/tuning.py``)."""
        self._tls.output, self._tls.routed, self._tls.record = output, None, record

    def take(self) -> Routed:
        routed = getattr(self._tls, "routed", None)
        if routed is None:
            raise QuantizeError("the decoder layer never called its routed experts; this layer class is not "
                                "supported for expert streaming")
        self._tls.routed = None
        return routed

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = getattr(self._tls, "output", None)
        if out is not None:
            if tuple(out.shape) != tuple(hidden_states.shape):
                raise QuantizeError(f"expert replay: output {tuple(out.shape)} for input {tuple(hidden_states.shape)}")
            if getattr(self._tls, "record", False):
                self._tls.routed = Routed(hidden_states, top_k_index, top_k_weights)
            return out.to(device=hidden_states.device, dtype=hidden_states.dtype)
        self._tls.routed = Routed(hidden_states.detach().clone(), top_k_index.detach().clone(),
                                  top_k_weights.detach().clone())
        return torch.zeros_like(hidden_states)


def stand_in(layer: torch.nn.Module, path: str | None) -> StandIn | None:
    """Replace the routed experts module at ``path`` (the architecture's ``hf["experts"]``) of a
    layer built on the meta device by a ``StandIn``; None when the layer has none (a dense layer)."""
    if not path:
        return None
    parent_path, _, name = path.rpartition(".")
    try:
        parent = layer.get_submodule(parent_path) if parent_path else layer
    except AttributeError:
        return None
    experts = getattr(parent, name, None)
    if experts is None or not all(getattr(getattr(experts, p, None), "ndim", 0) == 3
                                  for p in ("gate_up_proj", "down_proj")):
        return None
    s = StandIn(experts)
    setattr(parent, name, s)
    return s


def expert_bytes(hidden: int, intermediate: int, dtype: torch.dtype = torch.float32) -> int:
    """One routed expert's weights in memory: gate|up [2I, H] and down [H, I]."""
    return 3 * hidden * intermediate * torch.tensor([], dtype=dtype).element_size()


def group_size(budget_bytes: int, per_expert: int, n_experts: int) -> int:
    """Experts read at once: as many as fit in ``budget_bytes`` (at least one)."""
    return max(1, min(n_experts, int(budget_bytes) // max(1, per_expert)))


def groups(n_experts: int, size: int) -> list[range]:
    return [range(a, min(n_experts, a + size)) for a in range(0, n_experts, size)]


def rows(index: torch.Tensor, e: int):
    """Expert ``e``'s (token rows, top-k positions) as transformers' experts forward finds them
    (``torch.where`` of its routing mask), or None when the router sent it nothing."""
    mask = index == e  # [T, K]; transformers' expert_mask[e] is its transpose [K, T]
    if not bool(mask.any()):
        return None
    top_k_pos, token_idx = torch.where(mask.t())
    return token_idx, top_k_pos


def ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn, tap=None) -> torch.Tensor:
    """One routed expert on rows ``x``, as transformers' eager experts forward computes it;
    ``tap(x, inner)``: shown both GEMM inputs (read only: the result is the same bits)."""
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    inner = act_fn(gate) * up
    if tap is not None:
        tap(x, inner)
    return torch.nn.functional.linear(inner, down)


def contributions(r: Routed, experts: range, gate_up: torch.Tensor, down: torch.Tensor, act_fn, tap=None):
    """Per expert of ``experts`` (ascending; ``gate_up[j]``/``down[j]`` are expert ``experts[j]``)
    that the router sent tokens to: (those tokens' rows, the expert's weighted output for them),
    computed as transformers' eager experts forward computes them. ``tap(e, x, inner)``: each
    expert's two GEMM inputs, as they are computed."""
    for j, e in enumerate(experts):
        found = rows(r.index, e)
        if found is None:
            continue
        token_idx, top_k_pos = found
        out = ffn(r.hidden[token_idx], gate_up[j], down[j], act_fn,
                  None if tap is None else (lambda x, inner, e=e: tap(e, x, inner)))
        yield token_idx, out * r.weights[token_idx, top_k_pos, None]


def accumulate(out: torch.Tensor, r: Routed, experts: range, gate_up: torch.Tensor, down: torch.Tensor,
               act_fn, tap=None) -> None:
    """Add the outputs of ``experts`` for the tokens routed to them into ``out``, as transformers'
    eager experts forward does for the whole set: the same ops in the same order on the same
    output tensor (``index_add_`` per expert, ascending)."""
    for token_idx, h in contributions(r, experts, gate_up, down, act_fn, tap):
        out.index_add_(0, token_idx, h.to(out.dtype))
