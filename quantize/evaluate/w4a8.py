"""A W4AFP8 candidate measured locally as the engines compute it: its routed experts' GEMM inputs
fake-quantized to FP8 e4m3 per token (vLLM 0.33's W4A8-FP8 MoE: dynamic per-token scales on the
hidden states and again on act(gate) * up, docs/engines.md#w4afp8), the weights dequantized as for
any INT4 candidate. Without this a W4AFP8 folder would be scored as W4A16 (transformers drops the
activation scheme when it decompresses), which is the figure the user is trying to see past.

SGLang's native w4afp8 (``convert --scheme w4afp8 --engine sglang``) is computed as SGLang computes
it instead: both GEMM inputs through e4m3 with the layer's static scale (the largest of its experts'
``input_scale``s)."""

from __future__ import annotations

import os
import re
import types
from pathlib import Path

import torch

from ..errors import QuantizeError
from ..formats.w4afp8 import fake_fp8_static
from ..kernels.reference import fp8_per_token


def fp8_token_groups(cfg: dict) -> list[str]:
    """The config groups of ``cfg``'s quantization_config that are W4AFP8: INT4 weights with input
    activations FP8, dynamic, one scale per token (what ``convert --scheme w4afp8`` writes). An FP8
    weight group with the same activations (compressed-tensors' FP8_DYNAMIC, a W8A8 baseline) is not."""
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}
    out = []
    for name, g in (qc.get("config_groups") or {}).items():
        a = g.get("input_activations") if isinstance(g, dict) else None
        w = g.get("weights") if isinstance(g, dict) else None
        if (isinstance(a, dict) and a.get("type") == "float" and a.get("num_bits") == 8
                and a.get("strategy") == "token" and a.get("dynamic") is True
                and isinstance(w, dict) and w.get("type") == "int" and w.get("num_bits") == 4):
            out.append(name)
    return out


def _fake_fp8(x: torch.Tensor) -> torch.Tensor:
    codes, s = fp8_per_token(x)
    return (codes.float() * s).to(x.dtype)


def _experts_forward_through(self, hidden_states, top_k_index, top_k_weights, first, second):
    """transformers' fused-experts forward (GlmMoeDsaExperts / DeepseekV3 experts: gate_up_proj
    [E, 2I, H], down_proj [E, H, I]) with the first GEMM's input through ``first`` and the second's
    through ``second`` (each: x -> x fake-quantized)."""
    out = torch.zeros_like(hidden_states)
    x8 = first(hidden_states)  # per token or per layer: the same codes whichever expert a token is routed to
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = int(e[0])
        if e == self.num_experts:
            continue
        pos, tok = torch.where(mask[e])
        gate, up = torch.nn.functional.linear(x8[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(second(self.act_fn(gate) * up), self.down_proj[e])
        out.index_add_(0, tok, (h * top_k_weights[tok, pos, None]).to(out.dtype))
    return out


def _w4a8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """vLLM's W4A8-FP8 numerics: both GEMM inputs fake-quantized to FP8 per token."""
    return _experts_forward_through(self, hidden_states, top_k_index, top_k_weights, _fake_fp8, _fake_fp8)


def _w4a8_static_forward(self, hidden_states, top_k_index, top_k_weights):
    """SGLang's native w4afp8 numerics: one static scale per GEMM input for the whole layer (the
    largest of its experts' input scales, as SGLang 0.5.23 reduces them on load, w4afp8.py L271-284),
    ``self.w4a8_scales`` = (first GEMM's, second GEMM's)."""
    a1, a2 = self.w4a8_scales
    return _experts_forward_through(self, hidden_states, top_k_index, top_k_weights,
                                    lambda x: fake_fp8_static(x, a1), lambda x: fake_fp8_static(x, a2))


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def native_scales(path) -> dict[int, tuple[float, float]]:
    """Per layer of SGLang's native w4afp8 checkpoint at ``path``: (the largest gate/up input scale,
    the largest down input scale) over its routed experts, what SGLang computes with."""
    from ..checkpoint.index import CheckpointIndex, read_tensor

    index = CheckpointIndex.open(Path(path))
    out: dict[int, list[float]] = {}
    fds: dict = {}
    try:
        for name, ref in index.tensors.items():
            if ".experts." not in name or not name.endswith(".input_scale"):
                continue
            m = _LAYER.search(name)
            if m is None:
                continue
            v = float(read_tensor(index.folder, ref, fds).float().max())
            cur = out.setdefault(int(m.group(1)), [0.0, 0.0])
            k = 1 if ".down_proj." in name else 0
            cur[k] = max(cur[k], v)
    finally:
        for fd in fds.values():
            os.close(fd)
    return {i: (a, b) for i, (a, b) in out.items()}


def _experts_modules(model):
    for name, m in model.named_modules():
        p, d = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if (isinstance(p, torch.nn.Parameter) and isinstance(d, torch.nn.Parameter) and p.dim() == 3
                and hasattr(m, "act_fn") and hasattr(m, "num_experts")):
            yield name, m


def apply(model, cfg: dict, path) -> int:
    """Patch every fused routed-experts module of ``model`` when ``cfg`` declares FP8 per-token input
    activations (vLLM's W4A8-FP8) or is SGLang's native w4afp8 (static scales from the checkpoint);
    -> the number patched (0: not a W4AFP8 model). One line when the model declares them but has no
    experts module this knows (scoring it as W4A16 would misreport it)."""
    native = ((cfg.get("quantization_config") or {}).get("quant_method")) == "w4afp8"
    if not native and not fp8_token_groups(cfg):
        return 0
    scales = native_scales(path) if native else {}
    n = 0
    for name, m in _experts_modules(model):
        if native:
            layer = _LAYER.search(name + ".")
            got = scales.get(int(layer.group(1))) if layer else None
            if got is None or min(got) <= 0:
                raise QuantizeError(f"{path}: SGLang's w4afp8 needs the input_scale of every routed expert, but "
                                    f"{name}'s are missing; the checkpoint is incomplete (SGLang would read 1.0)")
            m.w4a8_scales = got
            m.forward = types.MethodType(_w4a8_static_forward, m)
        else:
            m.forward = types.MethodType(_w4a8_experts_forward, m)
        n += 1
    if n == 0:
        raise QuantizeError(f"{path}: its quantization_config asks for FP8 per-token activations (W4AFP8), but the "
                            "model transformers built has no fused experts module to apply them to; it would be "
                            "scored as W4A16, so it is not scored (serve it instead: --serve vllm)")
    return n
