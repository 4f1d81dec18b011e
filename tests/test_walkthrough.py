"""docs/walkthrough.md cannot rot: every ```bash block on the page runs, in order, in one temporary
folder, with this venv's ``quantize`` on PATH, and must exit 0; every ```text block after it (its output
excerpt, before the next ```bash block) must be found in what that block printed, or, where the
excerpt follows ``<!-- file: PATH -->``, in that file; every path a **Writes:** paragraph names must
exist once its block has run.

An excerpt line matches an output line when both are equal after: runs of spaces made one, the table
rules of rich (``│ ┃``) read as ``|``, every number read as any number (timings, sizes and scores
move), a size's byte unit as any byte unit (``2.01 MiB/s`` on a fast machine is ``941 KiB/s`` on a slow
one), a short duration (``4s``) as any (``1m02s``, ``2h05m``: quantize/events.py's forms), every hex
digest as any digest, and ``…`` as anything (what the page leaves out, or wording
other changes may still move: the eval verdict's smoke note). Lines made only of table borders and
lines that are just ``...`` are not compared. About 2 minutes on 2 cores.
"""

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# the suite's longest single test: under pytest-xdist it starts first (tests/conftest.py) rather than ending
# the run alone on one worker
pytestmark = pytest.mark.xdist_group("walkthrough")

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "walkthrough.md"
BIN = Path(sys.executable).parent  # the venv's bin: its `quantize` entry point

FENCE = re.compile(r"^```(\S*)\s*$")
FILE_MARK = re.compile(r"^<!--\s*file:\s*(\S+)\s*-->\s*$")
BORDER = re.compile(r"^[\s┏┓┗┛┡┩└┘┌┐├┤┬┴┼━─═╇╈╋┳┻╍+\-|]*$")
NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
BYTES = NUMBER + r" (?:[KMGT]i?)?B"  # quantize/events.py's _size: "512 B", "941.15 KiB", "2.01 MiB"
DURATION = r"(?:\d+h\d+m|\d+m\d+s|\d+s)"  # quantize/events.py's _duration: "4s", "1m02s", "2h05m"
DIGEST = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{8,}\b"
TOKEN = re.compile(rf"(?P<elided>…)|(?P<digest>{DIGEST})|(?P<bytes>{BYTES}\b)|(?P<duration>\b{DURATION}\b)|{NUMBER}")
# what each kind of token matches in the output (a plain number: any number)
READ_AS = {"elided": ".*", "digest": "[0-9a-f]+", "bytes": BYTES, "duration": DURATION}


@dataclass
class Step:
    line: int  # where its ```bash block starts on the page
    script: str
    excerpts: list = field(default_factory=list)  # (file or None, [lines], line on the page)
    writes: list = field(default_factory=list)


def paths(text: str) -> list[str]:
    """The file and folder names in backticks (``a/b.json``, ``kv.json``), not other code words."""
    return [t for t in re.findall(r"`([\w./-]+)`", text) if ("/" in t or "." in t) and not t.startswith("-")]


def parse(text: str) -> list[Step]:
    steps: list[Step] = []
    lines = text.splitlines()
    i, mark, para = 0, None, None
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if para is not None and (m or not line.strip()):  # a Writes paragraph ends
            if steps:
                steps[-1].writes += paths(" ".join(para))
            para = None
        if m:
            lang, start, body = m.group(1), i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if lang == "bash":
                steps.append(Step(start, "\n".join(body) + "\n"))
            elif lang == "text" and steps:
                steps[-1].excerpts.append((mark, body, start))
            mark = None
        elif FILE_MARK.match(line):
            mark = FILE_MARK.match(line).group(1)
        elif line.startswith("**Writes:**"):
            para = [line]
        elif para is not None:
            para.append(line)
        i += 1
    if para and steps:
        steps[-1].writes += paths(" ".join(para))
    return steps


def norm(s: str) -> str:
    return " ".join(s.replace("│", "|").replace("┃", "|").split())


def pattern(line: str) -> re.Pattern:
    out, pos, s = [], 0, norm(line).replace(" …", "…")  # "… " may stand for the rest of a wrapped line
    for m in TOKEN.finditer(s):
        out.append(re.escape(s[pos:m.start()]))
        out.append(READ_AS.get(m.lastgroup, NUMBER))
        pos = m.end()
    out.append(re.escape(s[pos:]))
    return re.compile("".join(out))


def missing(excerpt: list[str], output: str) -> list[str]:
    """The excerpt's lines that no line of ``output`` matches."""
    have = [norm(x) for x in output.splitlines()]
    return [line for line in excerpt
            if line.strip() not in ("", "...") and not BORDER.match(line)
            and not any(pattern(line).fullmatch(h) for h in have)]


def test_the_matcher():
    assert pattern("done x: 7.65 MiB -> 7.84 MiB in 3.8 s").fullmatch(norm("done x: 7.7 MiB -> 8 MiB  in 12 s"))
    assert pattern("│ expert_down │ 24 │ 1.71e-03 │").fullmatch(norm("|  expert_down  |  24 | 2.5e-04 |"))
    assert pattern("sha256 b49370bc40f1 …").fullmatch("sha256 0123456789ab and more")
    assert pattern("pass…: 1 task(s)").fullmatch("pass (smoke: 8 items): 1 task(s)")
    assert not pattern("check passed: m").fullmatch("check FAILED: m")
    # a size's unit moves with the machine's speed, a duration's form with its length; nothing else does
    done = pattern("[convert] done: 7.65 MiB / 7.65 MiB 100% in 4s (2.01 MiB/s)")
    assert done.fullmatch("[convert] done: 7.65 MiB / 7.65 MiB 100% in 8s (941.15 KiB/s)")
    assert done.fullmatch("[convert] done: 7.65 MiB / 7.65 MiB 100% in 1m02s (512 B/s)")
    assert done.fullmatch("[convert] done: 1.2 GiB / 1.2 GiB 100% in 2h05m (3.1 GiB/s)")
    assert not done.fullmatch("[convert] done: 7.65 MiB / 7.65 MiB 100% in 4s (2.01 MiB)")  # the rate's /s
    assert not done.fullmatch("[convert] done: 7.65 MiB / 7.65 MiB 100% in 4s (2.01 tok/s)")  # not bytes
    assert not done.fullmatch("[convert] done: 7.65 ms / 7.65 MiB 100% in 4s (2.01 MiB/s)")
    assert not done.fullmatch("[convert] done: 7.65 MiB / 7.65 MiB 100% in 4 (2.01 MiB/s)")  # the unit s
    assert not done.fullmatch("[convert] done: 7.65 MiB / 7.65 MiB 100% in 4m (2.01 MiB/s)")
    assert pattern("in 3.8 s (0.002 GB/s); 72").fullmatch("in 17.2 s (0.466 MB/s); 72")  # cli.py's _rate
    assert missing(["┏━━┳━━┓", "...", "a 1"], "a 2\n") == []
    assert missing(["a b"], "a c\n") == ["a b"]


def test_the_page_parses():
    steps = parse(PAGE.read_text())
    assert len(steps) >= 9, "the walkthrough lost its ```bash blocks"
    scripts = "".join(s.script for s in steps)
    for cmd in ("make-tiny ", "convert ", "check ", "calibrate-kv ", "shard ", "eval ", "eval-kld ", "card ",
                "push ", "run "):
        assert f"quantize {cmd}" in scripts, f"the walkthrough no longer runs quantize {cmd}"
    assert "--dry-run" in scripts, "push must stay a dry run: nothing leaves the machine"
    assert all(s.excerpts or s.writes for s in steps[1:]), "a step shows neither its output nor its files"


def test_the_walkthrough_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "QUANTIZE_SGLANG_PYTHON")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               NO_COLOR="1", TMPDIR=str(tmp_path))
    work = tmp_path / "walk"
    work.mkdir()
    for step in parse(PAGE.read_text()):
        r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step.script], cwd=work, env=env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=600)
        where = f"docs/walkthrough.md:{step.line}"
        assert r.returncode == 0, f"{where}: exit {r.returncode}\n{step.script}\n{r.stdout[-4000:]}"
        for path in step.writes:
            assert (work / path).exists(), f"{where}: the page says it writes {path}; it did not\n{r.stdout[-2000:]}"
        for name, excerpt, line in step.excerpts:
            got = r.stdout if name is None else (work / name).read_text()
            bad = missing(excerpt, got)
            assert not bad, (f"docs/walkthrough.md:{line}: not in {name or 'the output'} of the block at {where}:\n"
                             + "\n".join(bad) + f"\n--- what it printed/wrote:\n{got[-4000:]}")
