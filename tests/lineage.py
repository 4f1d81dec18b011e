"""Hand-made candidates in tests (a baseline's copy with a layer changed by the test itself, a
third-party quantization) record the model they were made from, as ``quantize convert`` records
its source: ``eval`` and ``eval-kld`` compare only a candidate proven made from the baseline
(quantize/evaluate/provenance.py)."""

import json
from pathlib import Path


def made_from(folder, base) -> Path:
    """``folder``'s quantize_manifest.json records ``base`` as its source (its weights' identity and
    lineage, ``checkpoint.manifest.derived_from``); -> ``folder``."""
    from quantize.checkpoint.manifest import MANIFEST, derived_from

    p = Path(folder) / MANIFEST
    doc = json.loads(p.read_text()) if p.is_file() else {}
    doc["source"] = derived_from(Path(base))
    p.write_text(json.dumps(doc))
    return Path(folder)
