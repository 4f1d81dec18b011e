"""The CLI process's cyclic garbage collector while a command imports its libraries.

A command imports torch and most also compressed-tensors (with transformers and pydantic): about
470,000 long-lived objects. Python's collector runs a full collection each time the heap has grown by
a quarter, so those imports trigger several, each walking every object so far and each holding the
GIL, which stalls convert's worker and writer threads with it. Every full collection later in the run
walks them all again. On convert's bench source (4.26 GB, 2 cores, output on tmpfs) the collector
cost 2.8 s of a 10.9 s run.

So the CLI's ``main`` holds collections off (``hold``) from its start. ``settle``, once the
command's libraries are in, freezes every object that exists then (``gc.freeze``: no later collection
walks them) and turns the collector back on; from then on it runs as usual over what the run itself
allocates. Only the CLI holds: called in a user's own process (or the tests) without ``hold``,
``settle`` changes nothing. A timer settles after ``HOLD_LIMIT_S`` whatever happens, so no path (a
rank serving its share of a layer pass, a command without a settle point) runs longer with the
collector off. At exit the frozen objects are unfrozen, so the interpreter's teardown collects them as
it would have (triton's nanobind bindings report a frozen object still alive then as a leak).

``settle`` does not collect first: the cyclic garbage those imports leave is about 10,000 objects,
7 MiB of memory (measured after torch, quantize.convert and compressed-tensors), frozen with the rest,
while a full collection then costs about 0.46 s with the GIL held.
"""

from __future__ import annotations

import atexit
import gc
import threading

HOLD_LIMIT_S = 60.0

_lock = threading.Lock()
_state = {"held": False, "settled": False}
_timer: list[threading.Timer] = []


def hold(limit_s: float = HOLD_LIMIT_S) -> None:
    """Collections off until ``settle`` (at most ``limit_s`` seconds). The CLI's entry point only."""
    with _lock:
        if _state["held"]:
            return
        _state["held"] = True
        gc.disable()
        t = threading.Timer(limit_s, settle)
        t.daemon = True
        t.start()
        _timer.append(t)


def settle() -> bool:
    """The libraries are in: freeze what exists and collect as usual from now on. Does nothing
    unless ``hold`` ran in this process and nothing settled yet; says whether it settled."""
    with _lock:
        if not _state["held"] or _state["settled"]:
            return False
        _state["settled"] = True
        for t in _timer:
            t.cancel()
        gc.freeze()
        gc.enable()
        atexit.register(gc.unfreeze)
        return True
