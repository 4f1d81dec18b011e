"""The resumable job record (``OUT/.quantize/job.json``) and the final manifest
(``OUT/quantize_manifest.json``, written last: its presence means the output is complete)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path

from .index import read_header
from .output import sha256_file

JOB_DIR = ".quantize"
MANIFEST = "quantize_manifest.json"


SAMPLE_CHUNKS, SAMPLE_BYTES = 16, 1 << 16  # a weight file's sampled identity: 16 chunks of 64 KiB, whole if smaller
MAX_LINEAGE = 8  # ancestors a manifest carries (convert of a convert of ...)
_HEX = frozenset("0123456789abcdef")


def _sha_hex(v) -> str | None:
    return v.lower() if isinstance(v, str) and len(v) == 64 and set(v.lower()) <= _HEX else None


def _listed_sha256(folder: Path) -> dict[str, str]:
    """The weights' SHA-256 as the folder's own records list them: this tool's manifest (``files``,
    where the size still agrees), a Hub download's ``.cache/huggingface/download/F.metadata`` (its
    etag: an LFS file's SHA-256) or a Hub cache snapshot's blob (named by its SHA-256)."""
    from ..errors import QuantizeError
    from ..parse import load_json

    out: dict[str, str] = {}
    try:
        doc = load_json(folder / MANIFEST, "quantize manifest", "record") if (folder / MANIFEST).is_file() else None
    except QuantizeError:
        doc = None
    files = doc.get("files") if isinstance(doc, dict) else None
    for name, rec in (files.items() if isinstance(files, dict) else ()):
        sha = _sha_hex(rec.get("sha256")) if isinstance(rec, dict) else None
        p = folder / name
        if sha and name.endswith(".safetensors") and "/" not in name and p.is_file() and (
                rec.get("bytes") == p.stat().st_size):
            out[name] = sha
    for p in folder.glob("*.safetensors"):
        meta = folder / ".cache" / "huggingface" / "download" / (p.name + ".metadata")
        try:
            lines = meta.read_text().splitlines() if meta.is_file() else []
        except (OSError, UnicodeDecodeError):
            lines = []
        sha = _sha_hex(lines[1].strip()) if len(lines) >= 2 else None
        if sha is None and p.is_symlink() and p.resolve().parent.name == "blobs":
            sha = _sha_hex(p.resolve().name)
        if sha and p.name not in out:
            out[p.name] = sha
    return out


def _sample_sha256(p: Path, size: int) -> str:
    """SHA-256 of ``SAMPLE_CHUNKS`` chunks at fixed, evenly spaced offsets of the file (all of it
    when it is smaller) and its size: cheap on a 5 GB shard, and another model's weights differ."""
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as fh:
        if size <= SAMPLE_CHUNKS * SAMPLE_BYTES:
            h.update(fh.read())
        else:
            for i in range(SAMPLE_CHUNKS):
                h.update(os.pread(fh.fileno(), SAMPLE_BYTES, i * (size - SAMPLE_BYTES) // (SAMPLE_CHUNKS - 1)))
    return h.hexdigest()


def weights_identity(folder: Path, files: list[str] | None = None) -> dict:
    """What a model's weights are, per safetensors file (``files``, default all of the folder's):
    its size, the SHA-256 of its header, the SHA-256 its records list (``sha256``, when they list
    one: ``_listed_sha256``: the whole file) and that of sampled bytes (``sample_sha256``, always). Neither path nor
    mtime: a copy of a model is the same model. ``same_weights`` compares two."""
    folder = Path(folder)
    names = sorted(files) if files is not None else sorted(p.name for p in folder.glob("*.safetensors"))
    listed = _listed_sha256(folder)
    out = {}
    for f in names:
        p = folder / f
        if not p.is_file():
            continue
        size = p.stat().st_size
        _, base = read_header(p)
        with open(p, "rb") as fh:
            hh = hashlib.sha256(fh.read(base)).hexdigest()
        out[f] = {"bytes": size, "header_sha256": hh, "sample_sha256": _sample_sha256(p, size),
                  **({"sha256": listed[f]} if f in listed else {})}
    return out


def same_weights(recorded, now) -> str | None:
    """None when every file of ``recorded`` (a ``weights_identity``) is in ``now`` with the same
    size, header SHA-256 and sampled SHA-256 (from the bytes: a stale record cannot stand in for
    them), and the same listed SHA-256 where both list one; else the first file that differs (or
    "no files")."""
    if not isinstance(recorded, dict) or not recorded or not isinstance(now, dict):
        return "no files"
    for f, r in sorted(recorded.items()):
        n = now.get(f)
        if not isinstance(r, dict) or not isinstance(n, dict) or not r.get("sample_sha256"):
            return f
        keys = ("bytes", "header_sha256", "sample_sha256") + (("sha256",) if r.get("sha256") and n.get("sha256")
                                                               else ())
        if any(r.get(k) != n.get(k) for k in keys):
            return f
    return None


def source_identity(folder: Path, files: list[str]) -> dict:
    """Per source file: ``weights_identity``'s entry (size, header and content SHA-256s) plus its
    mtime and, when the folder records one, the Hub revision and etag. A manifest's ``source.files``
    (``convert``): what ``eval`` compares with its baseline to prove the candidate was made from it."""
    out = weights_identity(folder, files)
    for f, entry in out.items():
        entry["mtime_ns"] = (folder / f).stat().st_mtime_ns
        meta = folder / ".cache" / "huggingface" / "download" / (f + ".metadata")
        if meta.exists():  # `hf download --local-dir` records commit and etag (= sha256 for LFS)
            lines = meta.read_text().splitlines()
            if len(lines) >= 2:
                entry["hub_commit"], entry["hub_etag"] = lines[0], lines[1]
    return out


def lineage(folder: Path) -> list[dict]:
    """The weights ``folder`` was made from, nearest first: its manifest's ``source.files`` (a
    ``source_identity``) and the ``source.lineage`` recorded beside it (what that source was made
    from); [] for a folder no command of this tool made from another (a release, make-tiny)."""
    from ..errors import QuantizeError
    from ..parse import load_json

    if not (Path(folder) / MANIFEST).is_file():
        return []
    try:
        doc = load_json(Path(folder) / MANIFEST, "quantize manifest", kind="record")
    except QuantizeError:
        return []
    src = doc.get("source")
    if not isinstance(src, dict):
        return []
    chain = [src.get("files"), *(src.get("lineage") if isinstance(src.get("lineage"), list) else [])]
    return [c for c in chain if isinstance(c, dict) and c][:MAX_LINEAGE]


def derived_from(folder: Path) -> dict:
    """What a manifest's ``source`` records of the model an output was made from: its weights
    (``files``: ``source_identity`` of every safetensors file) and ``lineage`` (what it was made from)."""
    folder = Path(folder)
    return {"files": source_identity(folder, sorted(p.name for p in folder.glob("*.safetensors"))),
            "lineage": lineage(folder)[: MAX_LINEAGE - 1]}


# the libraries whose code computes or lays out the output's bytes (llmcompressor: GPTQ's Hessian
# factorisation), by distribution name and the key a manifest lists them under
_SHAPING = (("torch", "torch"), ("safetensors", "safetensors"), ("transformers", "transformers"),
            ("compressed-tensors", "compressed_tensors"), ("llmcompressor", "llmcompressor"))
_CODE_ID: list[str] = []


def code_id() -> str:
    """SHA-256 (first 16 hex digits) of this package's own files (its sources, the C kernels, the
    embedded data; not caches or built libraries), by relative path: two builds with the same id run
    the same code, whatever their version string says. An editable install's uncommitted edit
    changes it too. Computed once per process (about 1.3 MB read)."""
    if not _CODE_ID:
        _CODE_ID.append(tree_id(Path(__file__).resolve().parents[1]))
    return _CODE_ID[0]


def tree_id(root: Path) -> str:
    """``code_id`` of the package folder ``root``: each file's path relative to it, length and
    bytes, in path order; ``__pycache__``, ``.pyc``, ``.so`` and ``.o`` files left out."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*"), key=lambda q: q.relative_to(root).as_posix()):
        if not p.is_file() or "__pycache__" in p.relative_to(root).parts or p.suffix in (".pyc", ".so", ".o"):
            continue
        data = p.read_bytes()
        h.update(f"{p.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def build_key() -> dict:
    """What a resume must find unchanged besides the options and inputs: this package's code
    (``code_id``) and the versions of the libraries that shape the bytes. A run killed under one
    build and resumed under another would write a checkpoint whose shards or layers come from two
    builds, which neither build reproduces."""
    from importlib.metadata import PackageNotFoundError, version

    v = {"quantize": code_id()}
    for dist, key in _SHAPING:
        try:
            v[key] = version(dist)
        except PackageNotFoundError:
            v[key] = None
    return v


def tool_versions() -> dict:
    """Versions of the libraries that shaped the output, from package metadata (no imports: a
    manifest must not cost seconds of start-up), and this package's ``code_id``."""
    from .. import __version__

    v = {**build_key(), "quantize": __version__, "quantize_code": code_id(), "python": platform.python_version()}
    try:
        here = Path(__file__).resolve().parents[2]
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if sha.returncode == 0:
            v["quantize_git"] = sha.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v


# A manifest is published with the model (``quantize push``): it says nothing of the machine that
# wrote it. Its paths are named relative to the output or by their last component (``shown_path``);
# the source's own path stays in the job record (``SOURCE_PATH`` in ``.quantize/job.json``, never
# uploaded), where the card finds the conversion behind a calibrate-kv output and the Hub cache
# repo the source was read from.
SOURCE_PATH = "source_path"
# an absolute (or home-relative) path inside a string: "/" or "~/" then a name, not after a word, ".",
# ":", "/", "~", "<", ">" or a backslash (so neither a URL, a Hub id "org/name", an HTML end tag nor a
# ratio like "1/iters"); a flag's value ("--out=/x", "-I/x") is one
ABS_PATH = re.compile(r"(?:(?<![\w.:/~<>\\])|(?<=(?<![\w-])-[A-Za-z]))(?:~(?=/)|/(?=[\w.@+~-]))[\w.@+=~/-]*")


def shown_path(raw: str, out: str | os.PathLike | None = None) -> str:
    """A local path as a published record names it: inside ``out`` (the output folder) its path there
    (``out`` itself its name), in a Hugging Face cache snapshot ``org/name@rev`` and the path inside it,
    any other path its last component (``/models/GLM-5-FP8`` -> ``GLM-5-FP8``)."""
    from .index import hf_snapshot

    text = str(raw)
    p = Path(os.path.expanduser(text)) if text.startswith("~") else Path(text)
    try:
        q = Path(os.path.abspath(p))
        if out is not None:
            root = Path(os.path.abspath(out))
            if q == root:
                return root.name
            if q.is_relative_to(root):
                return q.relative_to(root).as_posix()
        for up in (q, *q.parents):
            snap = hf_snapshot(up)
            if snap is not None and snap.repo_id:
                inner = q.relative_to(up).as_posix()
                return f"{snap.repo_id}@{snap.revision[:12]}" + ("" if inner == "." else "/" + inner)
    except (OSError, ValueError):
        pass
    return p.name or text


def public(value, out: str | os.PathLike | None = None):
    """``value`` (a manifest's JSON: dicts, lists, strings) with every absolute local path in its strings
    named as ``shown_path`` names it; keys and everything else as they are."""
    if isinstance(value, dict):
        return {k: public(v, out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public(v, out) for v in value]
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or "/" not in value:
        return value
    if os.path.isabs(value) or value.startswith("~/"):
        return shown_path(value, out)
    return ABS_PATH.sub(lambda m: _trailing_dot(m.group(0), out), value)


def _trailing_dot(raw: str, out) -> str:
    """``shown_path`` of a path a sentence may end: its full stop kept outside the path."""
    body = raw.rstrip(".")
    return (shown_path(body, out) if body else "") + raw[len(body):]


def _recipe_named(opts, out) -> dict:
    """An ``options`` record with its recipe named by its file name and SHA-256 (not its path)."""
    r = opts.get("recipe") if isinstance(opts, dict) else None
    if not isinstance(r, str) or not r:
        return opts
    try:
        sha = sha256_file(Path(r)) if Path(r).is_file() else None
    except OSError:
        sha = None
    return {**opts, "recipe": shown_path(r, out), **({"recipe_sha256": sha} if sha else {})}


def command_line() -> str | None:
    """The ``quantize`` command this process runs, as one shell line (``sys.argv`` after the
    program, quoted with shlex), for the manifest; None when called as a library (pytest, a
    script, a notebook), so nothing is recorded that was not typed. A path typed absolute, under
    ``~`` or through ``..`` is recorded by its last component (a manifest is published: ``public``)."""
    import shlex
    import sys

    argv = list(getattr(sys, "argv", None) or [])
    if not argv:
        return None
    prog = Path(argv[0])
    if prog.name != "quantize" and not (prog.parent.name == "quantize" and prog.name in ("cli.py", "__main__.py")):
        return None
    return shlex.join(["quantize", *(_public_arg(a) for a in argv[1:])])


def _public_arg(arg: str) -> str:
    flag, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    if not value:
        return arg
    p = Path(os.path.expanduser(value))
    if p.is_absolute() or ".." in p.parts:
        return flag + eq + (p.name or value)
    return flag + eq + public(value)


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
    (``job_files``). Nothing in it names this machine (``public``): the source by its name (and Hub repo),
    its path kept in the job record (``SOURCE_PATH``), the recipe by its name and SHA-256."""
    src = manifest.get("source")
    if isinstance(src, dict) and isinstance(src.get("path"), str):
        o.record[SOURCE_PATH] = src["path"]
        manifest = {**manifest, "source": {**source_name(src["path"]), **{k: v for k, v in src.items() if k != "path"}}}
    if isinstance(manifest.get("options"), dict):
        manifest = {**manifest, "options": _recipe_named(manifest["options"], o.path)}
    if isinstance(manifest.get("plan"), dict) and isinstance(manifest["plan"].get("options"), dict):
        plan = manifest["plan"]
        manifest = {**manifest, "plan": {**plan, "options": _recipe_named(plan["options"], o.path)}}
    manifest = public(manifest, o.path)
    manifest = {"command": command_line(), **manifest, "files": file_records(o, o.record.get("shards"))}
    # the job record keeps its own copy of what the manifest proves, written before the manifest:
    # a manifest re-hashed to match an edited file no longer agrees with the record (push, check)
    o.record["files"] = manifest["files"]
    o.record["manifest"] = name
    o.save()
    o.write_json(name, manifest)


def source_name(path: str | os.PathLike) -> dict:
    """How a published manifest names a source folder: ``name`` (its last component, or
    ``org/name@rev`` for a Hugging Face cache snapshot) and ``repo_id`` for a snapshot."""
    from .index import hf_snapshot

    snap = hf_snapshot(path)
    return {"name": shown_path(path), **({"repo_id": snap.repo_id} if snap is not None and snap.repo_id else {})}


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
