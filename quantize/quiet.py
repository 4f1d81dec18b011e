"""Other libraries' output, kept out of the way: lm-eval's and transformers' progress bars, load
reports and warnings, and what their subprocesses print (lm-eval runs ``git``), go to a log file
while ``captured`` is open; the command then names the file in one line. ``verbose`` leaves them on
the terminal.

The capture is at the file-descriptor level (stdout and stderr of this process and of its
children), so it holds for C extensions and subprocesses too. Python's ``warnings`` go to the same
file. Nothing of this tool's own output is printed while it is open.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


def new_log(what: str) -> Path:
    """A new log file in the system's temporary folder, named after the command."""
    fd, path = tempfile.mkstemp(prefix=f"quantize-{what}-", suffix=".log")
    os.close(fd)
    return Path(path)


@contextmanager
def captured(log: Path | None):
    """stdout and stderr (file descriptors 1 and 2, and Python's ``warnings``) into ``log`` (append)
    for the block; ``log`` None: nothing is captured."""
    if log is None:
        yield None
        return
    import warnings

    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    saved = []
    with open(log, "ab", buffering=0) as f:
        try:
            for fd in (1, 2):
                saved.append((fd, os.dup(fd)))
                os.dup2(f.fileno(), fd)
        except OSError:  # no such descriptor (an embedding host): leave the output where it is
            for fd, old in saved:
                os.dup2(old, fd)
                os.close(old)
            yield None
            return
        old_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            f.write(warnings.formatwarning(message, category, filename, lineno, line).encode(errors="replace"))

        warnings.showwarning = show
        try:
            yield log
        finally:
            warnings.showwarning = old_show
            for s in (sys.stdout, sys.stderr):
                try:
                    s.flush()
                except (OSError, ValueError):
                    pass
            for fd, old in saved:
                os.dup2(old, fd)
                os.close(old)


def kept(log: Path | None) -> Path | None:
    """``log`` if anything was written to it; an empty one is removed (it said nothing)."""
    if log is None:
        return None
    try:
        if log.stat().st_size:
            return log
        log.unlink()
    except OSError:
        pass
    return None
