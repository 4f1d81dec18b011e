"""KV-cache capacity: bytes per token (all layers, on one TP rank) for BF16 and FP8 caches, and the
tokens that fit on a GPU next to the weights.

Per attention kind (the architecture registry's ``attention``), from the engines' cache layouts
(docs/kv-cache.md#mla-cache-row, #dsa-fp8-layout, #cache-size-per-token):
* ``mla`` (DeepSeek-V3, Kimi K2.x): one row per token per layer, ``kv_lora_rank + qk_rope_head_dim``
  (512 + 64 = 576) values, read as both K and V, replicated on every TP rank (the latent is not
  split by heads). FP8: one byte per value (the per-tensor scale is negligible).
* ``dsa`` (GLM-5.x): the same 576-value row in BF16; SGLang/vLLM's FP8 layout is 656 B per token per
  layer (512 FP8 latent + 4 fp32 tile scales + 64 BF16 rope values); plus the DSA indexer's key
  cache, ``index_head_dim`` FP8 values + one fp32 scale per token per layer, in both cases.
* ``gqa``: K and V, ``num_key_value_heads * head_dim`` each per layer, split over ranks
  (replicated when there are fewer KV heads than ranks).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .archs.base import Architecture

H200_GIB = 143771 / 1024  # nvidia-smi: 143771 MiB
DEFAULT_MEM_FRACTION = 0.85  # share of GPU memory for weights + KV cache (SGLang --mem-fraction-static)
DEFAULT_RESERVE_GIB = 4.0  # activations, CUDA graphs, communication buffers inside that share


def _mla(cfg: dict, tp: int) -> dict[str, float]:
    row = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
    return {"bf16": row * 2, "fp8": row}


def _dsa(cfg: dict, tp: int) -> dict[str, float]:
    kvl, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    indexer = int(cfg.get("index_head_dim", 128)) + 4
    fp8_row = kvl + 4 * math.ceil(kvl / 128) + 2 * rope  # 656 for GLM-5
    return {"bf16": (kvl + rope) * 2 + indexer, "fp8": fp8_row + indexer}


def _gqa(cfg: dict, tp: int) -> dict[str, float]:
    nh = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nh)
    per_rank = max(1, math.ceil(kv / tp))
    return {"bf16": 2 * per_rank * hd * 2, "fp8": 2 * per_rank * hd}


PER_LAYER = {"mla": _mla, "dsa": _dsa, "gqa": _gqa}


@dataclass
class KvCapacity:
    kv_bytes_per_token: dict[str, int]  # per GPU (rank), all layers
    kv_tokens_per_gpu: dict[str, int]
    layers: int
    gpu_mem_gib: float
    mem_fraction: float
    reserve_gib: float
    weights_per_rank_gib: float
    tp: int
    layout: str

    def to_dict(self) -> dict:
        return asdict(self)


def capacity(arch: Architecture, config: dict, weights_per_rank: int, tp: int, gpu_mem_gib: float = H200_GIB,
             mem_fraction: float = DEFAULT_MEM_FRACTION, reserve_gib: float = DEFAULT_RESERVE_GIB) -> KvCapacity:
    text = arch.text_config(config)
    layers = int(text["num_hidden_layers"])  # the MTP layer's cache only exists with speculative decoding
    per_layer = PER_LAYER[arch.attention](text, tp)
    per_token = {k: int(v * layers) for k, v in per_layer.items()}
    free = gpu_mem_gib * 2**30 * mem_fraction - weights_per_rank - reserve_gib * 2**30
    tokens = {k: max(0, int(free // v)) for k, v in per_token.items()}
    return KvCapacity(per_token, tokens, layers, round(gpu_mem_gib, 2), mem_fraction, reserve_gib,
                      round(weights_per_rank / 2**30, 2), tp, arch.attention)
