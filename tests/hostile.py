"""The hostile-input harness: a case is a command line, a way to make its input hostile, the
fragment its one-line error must hold and its exit code. ``run_case`` runs it in-process through the
real command line (typer), then checks what every case must hold:

- the exit code is the expected one (2: bad input, 1: a verification failed);
- stderr is exactly one line, ``error: ...``, holding the fragment; no traceback, no exception
  other than the exit;
- no input folder or file changed: the SHA-256 of every file under each input (and the set of
  files) is the same after the command as before it.

Cases live in ``test_hostile_*.py`` as tables (lists of ``Case``); a case's ``setup`` receives a
``Ctx`` with fresh copies of what it asks for and returns nothing; ``argv`` is a function of the
``Ctx`` (paths are only known once the copies exist)."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from typer.testing import CliRunner


@dataclass
class Case:
    id: str
    argv: Callable[["Ctx"], list[str]]
    expect: str  # a fragment of the one-line error (case-sensitive)
    setup: Callable[["Ctx"], None] | None = None
    code: int = 2
    needs: tuple[str, ...] = ("src",)  # what the ctx copies: src, out (a converted output), shard, run...
    inputs: Callable[["Ctx"], list[Path]] | None = None  # default: every copied folder in ``needs``
    env: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.id


class Ctx:
    """Fresh copies of the session's artifacts for one case, under ``tmp``."""

    def __init__(self, tmp: Path, sources: dict[str, Path], needs: tuple[str, ...]):
        self.tmp = tmp
        self.paths: dict[str, Path] = {}
        for n in needs:
            dst = tmp / n
            shutil.copytree(sources[n], dst, symlinks=True)
            self.paths[n] = dst

    def __getattr__(self, name: str) -> Path:
        try:
            return self.__dict__["paths"][name]
        except KeyError:
            raise AttributeError(name) from None

    def new(self, name: str) -> Path:
        """A path for the command's output that does not exist yet."""
        return self.tmp / name


def tree_hashes(paths) -> dict[str, str]:
    """SHA-256 of every file under ``paths`` (a symlink by its target name), keyed by path."""
    out = {}
    for root in paths:
        root = Path(root)
        items = [root] if root.is_file() or root.is_symlink() and not root.is_dir() else sorted(root.rglob("*"))
        if not root.exists() and not root.is_symlink():
            out[str(root)] = "<absent>"
            continue
        for p in items:
            if p.is_symlink():
                out[str(p)] = "link:" + str(p.readlink())
            elif p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            elif p.is_dir():
                out[str(p)] = "dir"
    return out


def run_case(case: Case, tmp: Path, sources: dict[str, Path], monkeypatch=None) -> str:
    from quantize.cli import app

    ctx = Ctx(tmp, sources, case.needs)
    if case.setup is not None:
        case.setup(ctx)
    watched = case.inputs(ctx) if case.inputs else list(ctx.paths.values())
    before = tree_hashes(watched)
    argv = [str(a) for a in case.argv(ctx)]
    res = CliRunner().invoke(app, argv, env=case.env or None)
    after = tree_hashes(watched)
    err = res.stderr.strip()
    shown = f"\n$ quantize {' '.join(argv)}\nexit {res.exit_code}\nstderr: {err}\nstdout: {res.stdout[-2000:]}"
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        import traceback

        tb = "".join(traceback.format_exception(res.exception))
        raise AssertionError(f"{case.id}: raised instead of one line:{shown}\n{tb}")
    assert res.exit_code == case.code, f"{case.id}: exit {res.exit_code}, expected {case.code}{shown}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{case.id}: not one error line{shown}"
    assert "Traceback" not in res.output, f"{case.id}: traceback{shown}"
    assert case.expect in lines[0], f"{case.id}: {case.expect!r} not in the message{shown}"
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"{case.id}: the command changed its input: {changed[:5]}{shown}"
    return lines[0]


def edit_json(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    res = fn(doc)
    path.write_text(json.dumps(doc if res is None else res))
