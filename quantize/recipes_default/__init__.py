"""Recipes shipped with the package: ``tiny-glm.yaml`` is what ``quantize run`` runs without a recipe."""
