"""The resumable job record (``OUT/.quantize/job.json``) and the final manifest
(``OUT/quantize_manifest.json``, written last: its presence means the output is complete)."""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from pathlib import Path

from .index import read_header
from .output import sha256_file

JOB_DIR = ".quantize"
MANIFEST = "quantize_manifest.json"


def source_identity(folder: Path, files: list[str]) -> dict:
    """Per source file: size, mtime and a SHA-256 of its header (cheap; a changed tensor layout or
    re-download changes it), plus the Hub revision when the folder records one."""
    out = {}
    for f in files:
        p = folder / f
        if not p.exists():
            continue
        st = p.stat()
        header, base = read_header(p)
        with open(p, "rb") as fh:
            hh = hashlib.sha256(fh.read(base)).hexdigest()
        entry = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": hh}
        meta = folder / ".cache" / "huggingface" / "download" / (f + ".metadata")
        if meta.exists():  # `hf download --local-dir` records commit and etag (= sha256 for LFS)
            lines = meta.read_text().splitlines()
            if len(lines) >= 2:
                entry["hub_commit"], entry["hub_etag"] = lines[0], lines[1]
        out[f] = entry
    return out


def tool_versions() -> dict:
    """Versions of the libraries that shaped the output, from package metadata (no imports: a
    manifest must not cost seconds of start-up)."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    v = {"quantize": __version__, "python": platform.python_version()}
    for dist, key in (("torch", "torch"), ("safetensors", "safetensors"), ("transformers", "transformers"),
                      ("compressed-tensors", "compressed_tensors")):
        try:
            v[key] = version(dist)
        except PackageNotFoundError:
            v[key] = None
    try:
        here = Path(__file__).resolve().parents[2]
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if sha.returncode == 0:
            v["quantize_git"] = sha.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v


def command_line() -> str | None:
    """The ``quantize`` command this process runs, as one shell line (``sys.argv`` after the
    program, quoted with shlex), for the manifest; None when called as a library (pytest, a
    script, a notebook), so nothing is recorded that was not typed."""
    import shlex
    import sys

    argv = list(getattr(sys, "argv", None) or [])
    if not argv:
        return None
    prog = Path(argv[0])
    if prog.name != "quantize" and not (prog.parent.name == "quantize" and prog.name in ("cli.py", "__main__.py")):
        return None
    return shlex.join(["quantize", *argv[1:]])


def file_records(o, weights: dict[str, dict] | None = None) -> dict[str, dict]:
    """SHA-256 and size of every file in the output (the record's figures for shards hashed as
    they were written; the rest hashed here), the manifest and the job record excepted."""
    weights = weights or {}
    out = {}
    for p in sorted(o.path.rglob("*")):
        rel = p.relative_to(o.path).as_posix()
        if rel.split("/")[0] == JOB_DIR or rel == MANIFEST or not p.is_file():
            continue
        out[rel] = weights.get(rel) or {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


def write_manifest(o, manifest: dict, name: str = MANIFEST) -> None:
    """The manifest, written last: its presence means the output is complete, and ``files``
    lets ``quantize check`` (and push) prove every byte. The job record (``.quantize/job.json``)
    gets the same ``files`` first, so a manifest is compared with the record, not trusted alone
    (``job_files``)."""
    manifest = {"command": command_line(), **manifest, "files": file_records(o, o.record.get("shards"))}
    # the job record keeps its own copy of what the manifest proves, written before the manifest:
    # a manifest re-hashed to match an edited file no longer agrees with the record (push, check)
    o.record["files"] = manifest["files"]
    o.record["manifest"] = name
    o.save()
    o.write_json(name, manifest)


def folded(folder: Path) -> bool:
    """Whether ``folder`` is ``calibrate-kv --fold``'s output (its manifest says so): a model whose
    cached MLA latent is rescaled, so that only a cache it wrote itself is read right."""
    try:
        doc = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("kind") == "calibrate-kv" and doc.get("mode") == "fold"


def job_files(folder: Path) -> dict | None:
    """The ``files`` the writing command recorded in ``folder/.quantize/job.json`` when it wrote
    its manifest (None for a folder without such a record: written before records kept files)."""
    from .output import read_record

    from ..errors import QuantizeError

    path = Path(folder) / JOB_DIR / "job.json"
    rec = read_record(Path(folder))
    if rec is None and not path.exists() and not path.is_symlink() and not (Path(folder) / JOB_DIR).is_file():
        return None
    if not rec or rec.get("corrupt") or ("files" in rec and not isinstance(rec["files"], dict)):
        raise QuantizeError(
            f"{path}: the job record is not one this tool wrote (not a JSON object of its fields), so nothing it "
            "says can be trusted; re-create the folder with the command that wrote it"
        )
    return rec.get("files")
