"""House rules that hold for every file: lines at most 120 characters in quantize/, kernels/ and
scripts/; the package's imports flow one way (no module imports one that imports it back, lazy
imports inside functions included); no code cites documents outside the repository."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 120


def _sources():
    for top in ("quantize", "kernels", "scripts"):
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".c", ".j2") and "__pycache__" not in p.parts:
                if top == "quantize" and p.is_relative_to(ROOT / "quantize" / "kernels"):
                    continue  # a link to kernels/, read there
                yield p


def test_lines_are_at_most_120_characters():
    long = [f"{p.relative_to(ROOT)}:{i}: {len(line)}" for p in _sources()
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > LIMIT]
    assert not long, f"{len(long)} lines over {LIMIT} characters, e.g. {long[:5]}"


def test_the_line_check_sees_a_long_line(tmp_path, monkeypatch):
    (tmp_path / "quantize").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "x.py").write_text("a = 1\n" + "b = '" + "x" * (LIMIT - 5) + "'\n")  # 121 characters
    (tmp_path / "scripts" / "y.py").write_text("c = '" + "x" * (LIMIT - 6) + "'\n")  # 120: within the limit
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="1 lines over 120"):
        test_lines_are_at_most_120_characters()


def _imports(lazy: bool) -> dict[str, set[str]]:
    mods = {}
    for p in (ROOT / "quantize").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree) if lazy else tree.body:
            if isinstance(n, ast.ImportFrom):
                base = ".".join(pkg[: len(pkg) - n.level + 1] + ([n.module] if n.module else [])) if n.level else n.module
                for c in [base] + [f"{base}.{a.name}" for a in n.names]:
                    if c in mods and c != m:
                        edges[m].add(c)
            elif isinstance(n, ast.Import):
                edges[m].update(a.name for a in n.names if a.name in mods and a.name != m)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    found = []

    def visit(u, path):
        state[u] = 1
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                found.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path + [v])
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


@pytest.mark.parametrize("lazy", [False, True], ids=["module level", "with lazy imports"])
def test_imports_flow_one_way(lazy):
    edges = _imports(lazy)
    assert len(edges) > 40 and sum(map(len, edges.values())) > 100  # the graph was read
    assert _cycles(edges) == []


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
