"""Below how many documents a task's gate cannot conclude: the one rule the eval report, its Markdown,
the command lines (``eval``, ``quantize run``) and the model card share.

A task scored on fewer documents is a smoke test of the gate: its verdict says so, it is never
"conclusive", and the card keeps it out of the Hub's model-index (which would publish it as the
model's score)."""

from __future__ import annotations

SMOKE_ITEMS = 100


def is_smoke(n: int) -> bool:
    """A task scored on ``n`` documents is a smoke test (``n`` < ``SMOKE_ITEMS``)."""
    return n < SMOKE_ITEMS


def smoke_note(counts) -> str | None:
    """``"smoke: N items, below the M a gate needs"`` for the fewest of ``counts`` (documents per
    task) when any is a smoke test; None otherwise."""
    small = [n for n in counts if is_smoke(n)]
    return f"smoke: {min(small)} items, below the {SMOKE_ITEMS} a gate needs" if small else None
