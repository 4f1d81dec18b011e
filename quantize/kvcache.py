"""KV-cache capacity: bytes per token (all layers, on one TP rank) for BF16 and FP8 caches, and the
tokens that fit on a GPU next to the weights.

Per attention kind (the architecture registry's ``attention``), from the engines' cache layouts
(docs/kv-cache.md#mla-cache-row, #dsa-fp8-layout, #cache-size-per-token): each layout's ``cache_bytes``
(archs/attention.py), e.g. MLA's 576-value row replicated on every TP rank, GLM-5 DSA's 656 B FP8 row
plus its indexer keys, GQA's K and V split over ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .archs.base import Architecture

H200_GIB = 143771 / 1024  # nvidia-smi: 143771 MiB
DEFAULT_MEM_FRACTION = 0.85  # share of GPU memory for weights + KV cache (SGLang --mem-fraction-static)
DEFAULT_RESERVE_GIB = 4.0  # activations, CUDA graphs, communication buffers inside that share


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
    per_layer = arch.layout.cache_bytes(text, tp)
    per_token = {k: int(v * layers) for k, v in per_layer.items()}
    free = gpu_mem_gib * 2**30 * mem_fraction - weights_per_rank - reserve_gib * 2**30
    tokens = {k: max(0, int(free // v)) for k, v in per_token.items()}
    return KvCapacity(per_token, tokens, layers, round(gpu_mem_gib, 2), mem_fraction, reserve_gib,
                      round(weights_per_rank / 2**30, 2), tp, arch.attention)
