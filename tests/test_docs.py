"""The project carries its own facts: every ``docs/<file>.md#<section>`` cited in code, config or
the README names a file and a heading that exist, and nothing cites the documents that lie outside
the repository (a clone or a pip install does not have them). References to eval DATA outside the
repository (``--data-dir`` in the layout of ``../shared/data``) are data, not documentation."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCANNED = ("quantize", "kernels", "scripts", "tests", "recipes")
SUFFIXES = {".py", ".toml", ".yaml", ".yml", ".md"}
CITE = re.compile(r"docs/([\w-]+\.md)(#[\w-]+(?:,\s*#[\w-]+)*)?")
# a documentation file outside the repository: ../shared/NAME.md (not ../shared/data/...)
OUTSIDE = re.compile(r"\.\./shared/(?!data/)[\w.-]+\.md|\b(?:FORMATS|EVAL-OFFLINE|DESIGN)\.md\b")


def _files():
    yield ROOT / "README.md"
    yield ROOT / "pyproject.toml"
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in SUFFIXES and p != Path(__file__).resolve():
                yield p


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            a = slug(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def test_slug_matches_github():
    assert slug("Marlin shape rules") == "marlin-shape-rules"
    assert slug("GLM-5 FP8 releases") == "glm-5-fp8-releases"
    assert slug("MLA kv_b_proj") == "mla-kv_b_proj"
    assert slug("transformers as a reference") == "transformers-as-a-reference"


def test_every_cited_docs_section_exists():
    table = {p.name: anchors(p) for p in DOCS.glob("*.md")}
    bad = []
    for f in _files():
        for lineno, line in enumerate(f.read_text().splitlines(), 1):
            for m in CITE.finditer(line):
                name, frag = m.group(1), m.group(2)
                where = f"{f.relative_to(ROOT)}:{lineno}"
                if name not in table:
                    bad.append(f"{where}: docs/{name} does not exist")
                    continue
                for a in re.findall(r"#([\w-]+)", frag or ""):
                    if a not in table[name]:
                        bad.append(f"{where}: docs/{name} has no section #{a}")
    assert not bad, "\n".join(bad)


def test_links_inside_docs_resolve():
    table = {p.name: anchors(p) for p in DOCS.glob("*.md")}
    bad = []
    for p in DOCS.glob("*.md"):
        for target, frag in re.findall(r"\]\(([\w-]*\.md)?(?:#([\w-]+))?\)", p.read_text()):
            name = target or p.name
            if name not in table or (frag and frag not in table[name]):
                bad.append(f"docs/{p.name}: ({target}#{frag})")
    assert not bad, "\n".join(bad)


def test_no_documentation_outside_the_repository_is_cited():
    bad = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
           for f in _files() for i, line in enumerate(f.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not bad, "cite docs/ instead:\n" + "\n".join(bad)
