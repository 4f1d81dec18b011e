"""The candidate was made from the baseline: proven before ``eval`` and ``eval-kld`` do any work.

A model of the same architecture and tokenizer with other weights (another seed, another
fine-tune) passes every other check, and its scores would be reported as a quantization's loss.
So the candidate must be the baseline itself (the same weights: the same folder or a copy), or an
output of this tool made from it: its manifest's ``source.files`` (``convert``; ``calibrate-kv``
records its own source the same way) or one of the ancestors recorded with them
(``source.lineage``) must be the baseline's weights, computed the same way
(``checkpoint.manifest.weights_identity``: per file the size, the header's SHA-256, and the
SHA-256 the baseline's own records list, else that of sampled bytes). A saved baseline carries
the baseline's ``weights_identity`` in its identity (``kld.model_identity``) and is checked the
same way.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.manifest import MANIFEST, lineage, same_weights, weights_identity
from ..errors import QuantizeError


def converted_from(baseline: Path | None, candidate: Path, what_a: str = "--baseline", what_b: str = "--candidate",
                   saved: dict | None = None) -> None:
    """``candidate`` is ``baseline`` or was made from it (``saved``: the baseline's recorded
    ``weights_identity``, when only a saved baseline is given); one line naming both otherwise."""
    candidate = Path(candidate)
    if baseline is not None and Path(baseline).resolve() == candidate.resolve():
        return  # the same folder
    base = weights_identity(Path(baseline)) if saved is None else saved
    named = f"{what_a} {baseline}" if saved is None else what_a
    if not base:
        raise QuantizeError(f"{what_b} {candidate}: cannot be proven a conversion of {named}, which has no "
                            "safetensors weights to compare; pass the model folder it was converted from")
    chain = lineage(candidate)
    for ident in chain:
        if same_weights(ident, base) is None:
            return
    own = weights_identity(candidate)
    if own and set(own) == set(base) and same_weights(own, base) is None:
        return  # the same weights: a copy of the baseline
    if chain and not all(isinstance(e, dict) and e.get("sample_sha256") for e in chain[0].values()):
        why = (f"its {MANIFEST} was written by an older quantize, without its source's weights' hashes; convert it "
               "again")
    elif chain:
        why = f"its {MANIFEST} records a source with other weights: {same_weights(chain[0], base)} differs"
    else:
        why = f"no {MANIFEST} of it records its source, and its own weights are others"
    raise QuantizeError(f"{what_b} {candidate}: not converted from {named} ({why}); compare a model with its own "
                        f"conversion (quantize convert's output of that folder)")
