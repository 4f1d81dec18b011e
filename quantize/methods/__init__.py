"""Data-aware INT4 methods: GPTQ (llm-compressor's update) and AutoRound (signed gradient descent),
run layer by layer through transformers' own decoder layers before ``convert`` writes the shards
(``runner``). The output format is the one RTN writes: pack-quantized, static groups, no g_idx.

Modules, each importing only those listed before it: ``units`` and ``store`` (bookkeeping),
``forward`` (samples through a layer), ``base`` (the ``Method`` protocol), ``gptq`` and
``autoround`` (one method each), ``registry`` (``METHODS``: name -> method), ``runner`` (the
layer pass, which looks the method up in ``METHODS``)."""

from .base import Layer, Method, Step
from .registry import METHODS
from .runner import Calibration, LayerCache, prepare, run

__all__ = ["METHODS", "Calibration", "Layer", "LayerCache", "Method", "Step", "prepare", "run"]
