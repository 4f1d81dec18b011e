"""The data-aware methods by ``--method`` name: what the layer pass, and whatever describes a
method (the plan's options, the model card), look a method up in."""

from __future__ import annotations

from .autoround import AutoRound
from .base import Method
from .gptq import GPTQ

METHODS: dict[str, Method] = {"gptq": GPTQ(), "autoround": AutoRound()}
