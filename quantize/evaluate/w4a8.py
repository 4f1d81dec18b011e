"""A W4AFP8 candidate measured locally as the engines compute it: its routed experts' GEMM inputs
fake-quantized to FP8 e4m3 per token (vLLM 0.33's W4A8-FP8 MoE: dynamic per-token scales on the
hidden states and again on act(gate) * up, docs/engines.md#w4afp8), the weights dequantized as for
any INT4 candidate. Without this a W4AFP8 folder would be scored as W4A16 (transformers drops the
activation scheme when it decompresses), which is the figure the user is trying to see past."""

from __future__ import annotations

import types

import torch

from ..errors import QuantizeError
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


def _w4a8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' fused-experts forward (GlmMoeDsaExperts / DeepseekV3 experts: gate_up_proj
    [E, 2I, H], down_proj [E, H, I]) with both GEMM inputs fake-quantized to FP8 per token."""
    out = torch.zeros_like(hidden_states)
    x8 = _fake_fp8(hidden_states)  # per token: the same codes whichever expert a token is routed to
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = int(e[0])
        if e == self.num_experts:
            continue
        pos, tok = torch.where(mask[e])
        gate, up = torch.nn.functional.linear(x8[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(_fake_fp8(self.act_fn(gate) * up), self.down_proj[e])
        out.index_add_(0, tok, (h * top_k_weights[tok, pos, None]).to(out.dtype))
    return out


def apply(model, cfg: dict, path) -> int:
    """Patch every fused routed-experts module of ``model`` when ``cfg`` declares FP8 per-token input
    activations; -> the number patched (0: not a W4AFP8 model). One line when the model declares
    them but has no experts module this knows (scoring it as W4A16 would misreport it)."""
    if not fp8_token_groups(cfg):
        return 0
    n = 0
    for m in model.modules():
        p, d = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if (isinstance(p, torch.nn.Parameter) and isinstance(d, torch.nn.Parameter) and p.dim() == 3
                and hasattr(m, "act_fn") and hasattr(m, "num_experts")):
            m.forward = types.MethodType(_w4a8_experts_forward, m)
            n += 1
    if n == 0:
        raise QuantizeError(f"{path}: its quantization_config asks for FP8 per-token activations (W4AFP8), but the "
                            "model transformers built has no fused experts module to apply them to; it would be "
                            "scored as W4A16, so it is not scored (serve it instead: --serve vllm)")
    return n
