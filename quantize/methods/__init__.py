"""Data-aware INT4 methods: GPTQ (llm-compressor's update) and AutoRound (signed gradient descent),
run layer by layer through transformers' own decoder layers before ``convert`` writes the shards
(``runner``). The output format is the one RTN writes: pack-quantized, static groups, no g_idx."""

from .runner import Calibration, LayerCache, prepare, run

__all__ = ["Calibration", "LayerCache", "prepare", "run"]
