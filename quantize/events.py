"""Progress and results as events: a callable receives dicts; the CLI renders them with rich on a
terminal, as plain lines in a log (``LogEmitter``: stderr not a terminal) or as NDJSON
(``--json``); the manifest records the interesting ones."""

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
    """A progress bar by bytes (or by a count: layers, modules...) with ETA; a line per shard;
    warnings in yellow. A new "start" ends the bar before it (a data-aware method's layers, then
    convert's bytes)."""

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
            self.stop()  # a data-aware method's layer bar ends where convert's own starts
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
        elif kind == "layer" and self.progress is not None:
            self.progress.update(self.task, completed=event["layer"] + 1, tensor=f"layer {event['layer']}")
        elif kind == "shard" and self.progress is not None:
            self.progress.console.print(f" -- {event['file']}  {event['bytes'] / 2**20:,.1f} MiB  "
                                        f"sha256 {event['sha256'][:12]}")
        elif kind == "skip":
            self.console.print(f" -- {event['file']}: already complete, kept (resume)")
        elif kind == "warning":
            self.console.print(f"[yellow] !! {event['message']}")
        elif kind in ("done", "error"):
            self.stop()

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


LOG_INTERVAL_S = 30.0  # a log's byte/tensor progress: one line at most this often (plus the start and the end)


def _plain(text: str) -> str:
    """One line, nothing a terminal would interpret: control characters (ESC, CR, newlines, tabs)
    become spaces."""
    return "".join(c if c.isprintable() else " " for c in str(text))


def _size(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:,.2f} {unit}"
    return f"{n:,.0f} B"


def _duration(s: float) -> str:
    s = int(round(max(0.0, s)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class LogEmitter:
    """Plain lines for a log (stderr is not a terminal: nohup, Slurm, a pipe), where rich hides its
    bar: ``[stage] done/total  percent  rate  ETA ...``. A layer (calibrate-kv's, a data-aware
    method's) is one line each; byte or tensor progress (convert's shards, shard, check) one line
    at most every ``LOG_INTERVAL_S`` seconds, plus the start and the end. Warnings are lines too;
    an error ends the progress with a line saying where it stopped (the command prints the error
    itself). Each line is flushed at once; no ANSI codes, no carriage returns. ``clock``: seconds,
    monotonic (tests pass their own)."""

    def __init__(self, stream=None, clock: Callable[[], float] = time.monotonic):
        self.stream = stream or sys.stderr
        self.clock = clock
        self.stage: str | None = None  # the running progress (a "start" event), or None
        self.unit, self.total, self.done, self.done0, self.t0, self.last = "bytes", None, 0, 0, 0.0, 0.0

    def _line(self, text: str) -> None:
        self.stream.write(_plain(text) + "\n")
        self.stream.flush()

    # -- progress ------------------------------------------------------------------------------
    def _begin(self, stage: str, unit: str, total, done: int = 0) -> None:
        self.stage, self.unit, self.total, self.done, self.done0 = stage, unit, total, done, done
        self.t0 = self.last = self.clock()

    def _amount(self, n: float) -> str:
        return _size(n) if self.unit == "bytes" else f"{n:,.0f}"

    def _position(self) -> str:
        """``done/total unit  percent``."""
        unit = "" if self.unit == "bytes" else f" {self.unit}"
        if not self.total:
            return f"{self._amount(self.done)}{unit}"
        if self.unit == "bytes":
            head = f"{_size(self.done)} / {_size(self.total)}"
        else:
            head = f"{self.done:,}/{self.total:,}{unit}"
        return f"{head}  {100 * self.done / self.total:.0f}%"

    def _rate(self, now: float) -> str:
        """The rate since the start (this run's work: what a resume kept is not counted) and the
        time left at that rate."""
        dt, work = now - self.t0, self.done - self.done0
        if dt <= 0 or work <= 0:
            return "rate ? ETA ?"
        per_s = work / dt
        if self.unit == "bytes":
            rate = f"{_size(per_s)}/s"
        elif per_s >= 1:
            rate = f"{per_s:,.2f} {self.unit}/s"
        else:
            rate = f"{1 / per_s:,.1f} s/{self.unit.rstrip('s') or self.unit}"
        left = f"ETA {_duration((self.total - self.done) / per_s)}" if self.total else "ETA ?"
        return f"{rate}  {left}"

    def _progress(self, now: float, tail: str = "") -> None:
        self.last = now
        self._line(f"[{self.stage}] {self._position()}  {self._rate(now)}" + (f"  {tail}" if tail else ""))

    # -- events --------------------------------------------------------------------------------
    def __call__(self, event: dict) -> None:
        kind = event.get("event")
        now = self.clock()
        if kind == "start":
            self._begin(event.get("stage", "convert"), event.get("unit", "bytes"), event.get("total_bytes"),
                        event.get("done_bytes", 0) or 0)
            extra = [f"{event[k]} {k}" for k in ("shards", "workers") if event.get(k) is not None]
            kept = f", {self._amount(self.done)} kept from an interrupted run" if self.done else ""
            total = "?" if self.total is None else f"{_size(self.total) if self.unit == 'bytes' else self.total}"
            unit = "" if self.unit == "bytes" else f" {self.unit}"
            self._line(f"[{self.stage}] start: {total}{unit}" + (f" ({', '.join(extra)})" if extra else "") + kept)
        elif kind == "tensor":
            if self.stage is None:
                return
            self.done = event.get("done_bytes", self.done)
            if self.unit == "layers" or now - self.last >= LOG_INTERVAL_S:
                self._progress(now, str(event.get("name", ""))[-80:])
        elif kind == "layer":  # a data-aware method's layer: always a line
            if self.stage is None:  # no "start" came (a caller of its own): the count from here
                self._begin(event.get("method") or "layers", "layers", event.get("of"))
            self.done = event["layer"] + 1
            if event.get("of") is not None:
                self.total = event["of"]
            self._progress(now, _layer_tail(event))
        elif kind == "shard":
            self._line(f"[{self.stage or 'convert'}] wrote {event['file']}  {_size(event['bytes'])}  "
                       f"sha256 {event['sha256'][:12]}")
        elif kind == "skip":
            self._line(f"[{self.stage or 'convert'}] kept {event['file']}: already complete (resume)")
        elif kind == "warning":
            self._line(f"[{self.stage or 'quantize'}] warning: {event['message']}")
        elif kind == "error":
            if self.stage is not None:
                self._line(f"[{self.stage}] stopped at {self._position()} after {_duration(now - self.t0)} "
                           "(the error follows)")
            self.stage = None
        elif kind == "done":
            if self.stage is not None:
                work, dt = self.done - self.done0, now - self.t0
                rate = f" ({self._rate(now).split('  ')[0]})" if work > 0 and dt > 0 else ""
                self._line(f"[{self.stage}] done: {self._position()} in {_duration(dt)}{rate}")
            self.stage = None

    def stop(self) -> None:
        """The progress ends without an event (a pipeline stage that finished): no line."""
        self.stage = None


def _layer_tail(e: dict) -> str:
    """What a data-aware method's layer did: its INT4 weights, loss before/after, seconds, and
    its routed experts: quantized by the method, or left at RTN (too few routed tokens)."""
    i = e["layer"]
    if e.get("replayed"):
        return f"layer {i}: recorded by an interrupted run, replayed"
    if not e.get("units"):
        return f"layer {i}: no INT4 weight here, carried through"
    parts = [f"layer {i}: {e['units']} INT4 weights"]
    if e.get("loss") is not None and e.get("loss_rtn") is not None:
        parts[0] += f", loss RTN {e['loss_rtn']:.4g} -> {e.get('method', 'method')} {e['loss']:.4g}"
    elif e.get("loss") is not None:
        parts[0] += f", loss {e.get('method', 'method')} {e['loss']:.4g} (RTN's not measured)"
    if e.get("seconds") is not None:
        parts[0] += f", {e['seconds']:.1f} s"
    if e.get("experts"):
        parts.append(f"experts: {e['experts_quantized']} quantized, {e['experts_rtn']} at RTN (too few routed tokens)")
    other = e.get("fallbacks", 0) - e.get("fallbacks_starved", 0)
    if other > 0:
        parts.append(f"{other} other weights at RTN (named in the warnings)")
    return "; ".join(parts)
