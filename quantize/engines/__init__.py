"""Real serving engines in the loop: load a written checkpoint in the engine itself and compare
what it generates with transformers on the same weights (``quantize check --engine``)."""
