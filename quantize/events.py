"""Progress and results as events: a callable receives dicts; the CLI renders them with rich or
prints them as NDJSON (``--json``); the manifest records the interesting ones."""

from __future__ import annotations

import json
import sys
import time
from typing import Callable

Emit = Callable[[dict], None]


def null_emit(event: dict) -> None:  # noqa: ARG001
    return None


class JsonEmitter:
    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def __call__(self, event: dict) -> None:
        self.stream.write(json.dumps({"t": round(time.time(), 3), **event}, default=str) + "\n")
        self.stream.flush()


class RichEmitter:
    """A progress bar by bytes with ETA; a line per shard; warnings in yellow."""

    def __init__(self, console=None):
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.progress = None
        self.task = None

    def __call__(self, event: dict) -> None:
        from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)

        kind = event.get("event")
        if kind == "start":
            # the unit counted: bytes (a size and a speed), or tensors / layers / chunks... (a count, named)
            unit = event.get("unit", "bytes")
            count = ((DownloadColumn(binary_units=True), TransferSpeedColumn()) if unit == "bytes"
                     else (MofNCompleteColumn(), TextColumn(unit)))
            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), *count, TimeRemainingColumn(),
                TextColumn("{task.fields[tensor]}"), console=self.console, transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task(event.get("stage", "convert"), total=event.get("total_bytes"), tensor="",
                                               completed=event.get("done_bytes", 0))
        elif kind == "tensor" and self.progress is not None:
            self.progress.update(self.task, completed=event["done_bytes"], tensor=event["name"][-60:])
        elif kind == "shard" and self.progress is not None:
            self.progress.console.print(f" -- {event['file']}  {event['bytes'] / 2**20:,.1f} MiB  "
                                        f"sha256 {event['sha256'][:12]}")
        elif kind == "skip":
            self.console.print(f" -- {event['file']}: already complete, kept (resume)")
        elif kind == "warning":
            self.console.print(f"[yellow] !! {event['message']}")
        elif kind in ("done", "error") and self.progress is not None:
            self.progress.stop()
            self.progress = None
