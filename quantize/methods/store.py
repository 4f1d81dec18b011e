"""Calibration hidden states, one tensor per sample: in memory up to a byte budget shared by every
store of the run, beyond it in files under a spill folder (``OUT/.quantize/hidden/``). A spilled
tensor comes back bit for bit, so spilling never changes a result; it only bounds memory."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch


class Budget:
    """Bytes of hidden states the run may hold in memory (all stores together)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.used = 0
        self.peak = 0
        self.spilled = 0  # bytes written to disk, over the whole run


class HiddenStore:
    _ids = itertools.count()

    def __init__(self, budget: Budget, spill_dir: Path, name: str):
        self.budget = budget
        self.dir = Path(spill_dir)
        self.name = f"{name}-{next(self._ids)}"
        self._items: list[torch.Tensor | Path] = []
        self._mem: list[int] = []
        self.numel = 0

    def __len__(self) -> int:
        return len(self._items)

    def append(self, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        n = t.numel() * t.element_size()
        self.numel += t.numel()
        if self.budget.used + n <= self.budget.limit:
            self._items.append(t)
            self._mem.append(n)
            self.budget.used += n
            self.budget.peak = max(self.budget.peak, self.budget.used)
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{self.name}-{len(self._items):06d}.pt"
        torch.save(t, path)
        self._items.append(path)
        self._mem.append(0)
        self.budget.spilled += n

    def __getitem__(self, i: int) -> torch.Tensor:
        item = self._items[i]
        if isinstance(item, Path):
            return torch.load(item, weights_only=True)
        return item

    def update(self, i: int, t: torch.Tensor) -> None:
        """Replace item ``i`` with ``t`` (same shape and dtype), where it lives: in memory or its
        spill file (an accumulator carried across passes)."""
        item = self._items[i]
        t = t.detach().cpu().contiguous()
        if isinstance(item, Path):
            torch.save(t, item)
        else:
            self._items[i] = t

    def __iter__(self):
        for i in range(len(self._items)):
            yield self[i]

    def clear(self) -> None:
        for item, n in zip(self._items, self._mem):
            if isinstance(item, Path):
                try:
                    os.unlink(item)
                except FileNotFoundError:
                    pass
            self.budget.used -= n
        self._items.clear()
        self._mem.clear()
        self.numel = 0
