"""What ``quantize push`` refuses to publish: this machine. Every file it is about to upload (the
manifest, the card, config.json, the index, the side files, each safetensors header) is read for

- the output folder's absolute path and its parent folder (when that is two levels deep or more:
  ``/tmp`` alone says nothing), and the source's path the job record keeps;
- the home folder as a path (``$HOME/...``), ``/home/<user>``, ``/Users/<user>`` and
  ``C:\\Users\\<user>`` (the user name alone is not matched: "root" or "a" is a word of any text);
- the host name (``socket.gethostname()``, and its first label) as a whole word, when it is 4
  characters or more and not ``localhost``: in the files quantize writes anywhere, in the others
  (a tokenizer's vocabulary may hold any word) only where it names a host (``//host``, ``@host``,
  ``host:port``);
- in the files quantize writes (the manifest, a generated card, config.json, the index), any
  absolute path at all: those name files by their path in the folder or by role.

Tensor data is not read (only each safetensors header, its metadata included). ``scan`` raises
one line naming the file and what it holds."""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.index import INDEX_NAME, read_header
from ..checkpoint.manifest import ABS_PATH, MANIFEST
from ..errors import QuantizeError

MIN_HOST = 4  # a host name shorter than this ("vm", "a1") is a word of any text, not an identity
COMMON_HOSTS = {"localhost", "localhost.localdomain", "localdomain"}
TEXT_MAX = 256 << 20  # a side file larger than this is read in part only (a tokenizer is some MB)


@dataclass
class Marker:
    pattern: re.Pattern
    what: str
    everywhere: bool = True  # False: only in the files quantize writes


def _path_re(p: str) -> re.Pattern:
    return re.compile(re.escape(p.rstrip("/\\")) + r"(?![\w-]|\.[\w-])")  # "/x/model." ends a sentence


def markers(folder: Path, source: str | None = None) -> list[Marker]:
    """What identifies this machine, for ``folder`` (and the source the job record names)."""
    out: list[Marker] = []
    seen: set[str] = set()

    def path(p, what: str) -> None:
        p = str(p).rstrip("/\\")
        if len(Path(p).parts) > 2 and p not in seen:  # two levels deep or more ("/" is a part)
            seen.add(p)
            out.append(Marker(_path_re(p), what))

    here = Path(folder)
    for f in dict.fromkeys([os.path.abspath(here), str(here.resolve())]):
        path(f, "the output folder's path")
        path(Path(f).parent, "the path of the folder it is in")
    if source and os.path.isabs(source):
        path(source, "the source's path")
    home = os.path.expanduser("~")
    if home and home not in ("/", "~") and len(Path(home).parts) >= 2:
        out.append(Marker(re.compile(re.escape(home.rstrip("/")) + r"/[\w.~-]"), "a path in your home folder"))
    try:
        user = getpass.getuser()
    except (OSError, KeyError, ImportError):
        user = ""
    if user:
        u = re.escape(user)
        out.append(Marker(re.compile(rf"(?:/home/|/Users/|[A-Za-z]:\\\\?Users\\\\?){u}(?![\w-]|\.[\w-])"),
                          "your user's home folder"))
    host = socket.gethostname() or ""
    for h in dict.fromkeys([host, host.split(".")[0]]):
        if len(h) >= MIN_HOST and h.lower() not in COMMON_HOSTS and not h.isdigit():
            e = re.escape(h)
            out.append(Marker(re.compile(rf"(?<![\w.-]){e}(?![\w-])", re.I), "this machine's host name", False))
            out.append(Marker(re.compile(rf"(?:(?<=//)|(?<=@)){e}(?![\w-])|(?<![\w.-]){e}(?=:\d)", re.I),
                              "this machine's host name"))
    return out


def _ours(name: str, generated_card: bool) -> bool:
    """The files quantize writes itself (the rest are the source's, copied as they were)."""
    return name in (MANIFEST, "config.json", INDEX_NAME) or (name == "README.md" and generated_card)


def _absolute(name: str, text: str) -> str | None:
    """An absolute path in the strings of a JSON document; in the card, one the card names by role
    (``card.delocalize``: two names or more; "--model /m" in a report's launch line says nothing)."""
    if name == "README.md":
        from .card import _LOCAL_PATH

        m = _LOCAL_PATH.search(text)
        return m.group(0) if m else None
    try:
        doc = json.loads(text)
    except ValueError:
        m = ABS_PATH.search(text)
        return m.group(0) if m else None
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str) and "/" in v:
            if os.path.isabs(v) or v.startswith("~/"):
                return v
            m = ABS_PATH.search(v)
            if m:
                return m.group(0)
    return None


def _read(path: Path) -> str:
    if path.name.endswith(".safetensors"):
        header, _ = read_header(path)
        return json.dumps(header.get("__metadata__") or {})  # the tensor data is not read
    with open(path, "rb") as f:
        return f.read(TEXT_MAX).decode("utf-8", errors="replace")


_PATH_TAIL = re.compile(r"[\w.@+=~/-]*")


def _shown(s: str) -> str:
    s = " ".join(s.split())
    return s if len(s) <= 120 else s[:117] + "..."


def scan(folder: Path, names: list[str], texts: dict[str, str] | None = None, source: str | None = None,
         generated_card: bool = True) -> None:
    """Refuse (one line naming the file and what it holds) when a file of ``names`` (paths in
    ``folder``; ``texts`` gives a file's text as it will be uploaded, e.g. the card push renders)
    names this machine. ``generated_card``: README.md is quantize's card (else the user's)."""
    texts = texts or {}
    marks = markers(folder, source)
    for name in names:
        text = texts[name] if name in texts else _read(Path(folder) / name)
        ours = _ours(name, generated_card)
        for m in marks:
            if not (m.everywhere or ours):
                continue
            hit = m.pattern.search(text)
            if hit:
                whole = hit.group(0) + _PATH_TAIL.match(text, hit.end()).group(0)  # the rest of the path
                raise QuantizeError(_refusal(folder, name, f"{m.what} ({_shown(whole.rstrip('.'))})", ours))
        if ours and not name.endswith(".safetensors"):
            p = _absolute(name, text)
            if p is not None:
                raise QuantizeError(_refusal(folder, name, f"an absolute path ({_shown(p)})", ours))


def _refusal(folder: Path, name: str, what: str, ours: bool) -> str:
    if name == MANIFEST:
        fix = "convert again with this quantize, which names paths relative to the output or by role"
    elif name == "README.md":
        fix = ("rerun `quantize card` with this quantize" if ours
               else "edit README.md, your card, which push uploads as it is")
    else:
        fix = ("remove it from the source's copy of the file and convert again (an edited file no longer matches "
               "the manifest)")
    return f"{Path(folder) / name}: holds {what}, which push would publish; nothing was pushed: {fix}"
