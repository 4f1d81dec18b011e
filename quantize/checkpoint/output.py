"""The one output layer: every command that writes a folder (convert, shard, merge, calibrate-kv,
make-tiny, demo) opens it through ``Output.open``, which owns the guard, the lock, the job record,
the copier of the source's side files and the atomic small-file writes.

The guard. ``--overwrite`` and ``--resume`` act only on a folder whose record
(``OUT/.quantize/job.json``) says this tool wrote it for the same kind of job; never on a folder
that equals, contains or lies inside any input; never through a symlink. A folder without our
record is never deleted or written into, whatever the flags say. ``--resume`` where nothing was
written yet (OUT missing or empty) starts the job, so a retry loop converges.

The lock. ``OUT/.quantize/lock`` is held with ``flock`` for the whole run: a second run into the same
OUT is refused in one line, so two ``--resume`` or two ``--overwrite`` runs cannot interleave.

The record is written before anything else (and, on ``--overwrite``, before the old contents are
removed), so a folder killed at any point is still recognisably ours. Kept shards are trusted on
``--resume`` only when their SHA-256 matches the record.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ..errors import QuantizeError
from .index import hf_blobs, inside

RECORD_DIR = ".quantize"
RECORD = "job.json"
LOCK = "lock"
TMP_SUFFIX = ".partial"
HASH_CHUNK = 8 << 20

# How each kind of job continues after a failure it did not cause (disk full, a kill): only convert
# takes --resume; `quantize run` keeps its finished stages by itself; every other command starts
# over into its own folder with --overwrite. Messages name the fix of the job that is running.
RESUME_HINT = {"convert": "rerun with --resume", "run": "rerun the same `quantize run` (finished stages are kept)"}
OVERWRITE_HINT = "rerun with --overwrite"
_RERUN = ["rerun the command"]  # a stack: the innermost open output's hint last (threads see it too)


def rerun_hint() -> str:
    """How the job now running continues after a failure (see ``RESUME_HINT``)."""
    return _RERUN[-1]

# What a checkpoint needs besides its weights and the config.json each command writes itself:
# generation config, tokenizer and chat template files, processor configs, custom code named by
# auto_map, the card and licence. Never `original/*.pth`, stray weights or folders.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tiktoken.model",
    "*.tiktoken",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "configuration_*.py",
    "modeling_*.py",
    "tokenization_*.py",
    "processing_*.py",
    "image_processing*.py",
    "README.md",
    "LICENSE",
    "LICENSE.*",
    "NOTICE",
)
# folders of side files, and what of each is copied: transformers' CHAT_TEMPLATE_DIR
# (transformers/utils/hub.py, 5.17), the named chat templates (NAME.jinja) its tokenizer loads beside
# the default one (tokenization_utils_base.py: chat_template_NAME)
SIDE_DIRS = {"additional_chat_templates": ("*.jinja",)}


def _oserror(path: Path, e: OSError, doing: str) -> QuantizeError:
    """One line for the ways a filesystem says no."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return QuantizeError(
            f"{path}: no space left on the output disk while {doing}; free space and {rerun_hint()}"
        )
    if e.errno == errno.EROFS:
        return QuantizeError(f"{path}: the output filesystem is read-only; choose an OUT on a writable disk")
    if e.errno in (errno.EACCES, errno.EPERM):
        return QuantizeError(f"{path}: permission denied while {doing}; choose an OUT you can write")
    if e.errno == errno.ENAMETOOLONG:
        return QuantizeError(f"{path}: file name too long for this filesystem; choose a shorter OUT")
    if e.errno == errno.ENOTDIR:
        return QuantizeError(f"{path}: a part of this path is a file, not a folder; choose another OUT")
    return QuantizeError(f"{path}: {e.strerror or e} while {doing}")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` under a temporary name, fsync, rename: a reader sees the old file or the new
    one, never half of one. Disk full / read-only become one line."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise _oserror(path, e, f"writing {path.name}") from e


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_files(paths: list[Path], workers: int = 4) -> list[str]:
    """The SHA-256 of each of ``paths``, read on up to ``workers`` threads (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max(1, min(workers, len(paths) or 1))) as pool:
        return list(pool.map(sha256_file, paths))


def confined(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` for a name read from one of our own records: a plain relative path that
    stays inside ``folder`` (no absolute path, no ``..``, no symlink out)."""
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts or not (folder / p).resolve().is_relative_to(folder.resolve()):
        raise QuantizeError(
            f"{what}: names {name!r}, a path outside {folder}; the record is corrupt or hostile, re-create it"
        )
    return folder / p


def _cache_root(folder: Path) -> Path | None:
    """The Hugging Face cache repo (``models--org--name``) of a ``.../snapshots/<rev>`` folder."""
    blobs = hf_blobs(Path(folder).resolve())
    return blobs.parent if blobs is not None else None


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def read_record(out: Path) -> dict | None:
    """The job record of ``out``, None when there is none; a record that is not ours is None too."""
    from ..parse import load_json

    path = out / RECORD_DIR / RECORD
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = load_json(path, "job record", kind="record", want=None)
    except QuantizeError:
        return {"kind": None, "corrupt": True}
    if not isinstance(data, dict):
        return {"kind": None, "corrupt": True}
    data.setdefault(
        "kind", "convert" if "key" in data and "shards" in data else None
    )  # records before kinds: convert's
    return data


def take_lock(folder: Path, busy: Callable[[str], Exception], unopenable: Callable[[OSError], Exception]) -> int:
    """Take ``folder/.quantize/lock`` (the one lock of every command that writes a folder: ``flock``,
    exclusive, never waiting) and write this process's pid into it; -> its descriptor, held until
    closed. Raises ``busy(the holder's pid, or "")`` while another run holds it and
    ``unopenable(the OSError)`` when the lock file cannot be made (``folder`` must exist)."""
    rec = Path(folder) / RECORD_DIR
    try:
        rec.mkdir(exist_ok=True)
        fd = os.open(rec / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise unopenable(e) from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy(os.pread(fd, 64, 0).decode(errors="replace").strip()) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _busy(out: Path, holder: str) -> QuantizeError:
    return QuantizeError(
        f"{out}: another quantize run is writing this folder{f' (pid {holder})' if holder else ''}; "
        "wait for it to end or choose another OUT"
    )


def _refuse_if_busy(out: Path) -> None:
    """Probe the lock of an existing output without creating anything: a run in progress is named
    before any other verdict on the folder."""
    lock = out / RECORD_DIR / LOCK
    if out.is_symlink() or not lock.is_file() or lock.is_symlink():
        return
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(out, os.pread(fd, 64, 0).decode(errors="replace").strip()) from None
    finally:
        os.close(fd)


def _has_content(out: Path) -> bool:
    """Anything in ``out`` besides an empty record folder (a run that died before its record)."""
    for p in out.iterdir():
        if p.name == RECORD_DIR and p.is_dir() and not p.is_symlink():
            if any(q.name != LOCK for q in p.iterdir()):
                return True
            continue
        return True
    return False


def _input_roots(i) -> list[Path]:
    """An input, resolved, and the Hub cache repo holding it when it is a snapshot."""
    return [Path(i).resolve()] + ([r.resolve()] if (r := _cache_root(Path(i))) is not None else [])


def refuse_overlap(out: Path, inputs) -> None:
    """``out`` must neither equal, contain nor lie inside any input (nor its Hub cache)."""
    o = Path(out).resolve()
    for i in inputs:
        if any(_overlaps(o, r) for r in _input_roots(i)):
            raise QuantizeError(f"{out}: overlaps the input {i}; choose an OUT outside it (inputs are never modified)")


class Output:
    """An output folder opened for one job: locked, recorded, guarded. Use as a context manager
    (the lock is released on exit; a finished job calls ``complete`` first)."""

    def __init__(self, path: Path, kind: str, lock_fd: int, record: dict, resumed: bool):
        self.path = path
        self.kind = kind
        self._lock_fd = lock_fd
        self.record = record
        self.resumed = resumed

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        out: str | os.PathLike,
        kind: str,
        inputs: list[str | os.PathLike] = (),
        resume: bool = False,
        overwrite: bool = False,
        key: dict | None = None,
    ) -> "Output":
        out = Path(out)
        if resume and overwrite:
            raise QuantizeError(f"{out}: --resume and --overwrite together; pass one of them")
        try:
            if out.is_symlink():
                raise QuantizeError(
                    f"{out}: is a symlink; pass the real folder (outputs are never written through a symlink)"
                )
            if out.exists() and not out.is_dir():
                raise QuantizeError(f"{out}: exists and is a file, not a folder; choose another OUT")
            out.resolve()  # a path the filesystem cannot resolve (too long, a loop) is one line here
            _refuse_if_busy(out)
        except OSError as e:
            raise _oserror(out, e, "looking at the output folder") from e
        refuse_overlap(out, inputs)
        cls._check_state(out, kind, resume, overwrite)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _oserror(out, e, "creating the output folder") from e
        fd = take_lock(
            out,
            busy=lambda holder: _busy(out, holder),
            unopenable=lambda e: _oserror(out, e, "creating the output folder"),
        )
        try:
            # state again, under the lock: another run may have changed it since the first look
            cls._check_state(out, kind, resume, overwrite)
            record = read_record(out)
            resumed = bool(resume and record and record.get("kind") == kind)
            if not resumed:
                record = {
                    "kind": kind,
                    "inputs": [str(Path(i).resolve()) for i in inputs],
                    "state": "running",
                    "key": key or {},
                    "shards": {},
                    "stats": {},
                }
            self = cls(out, kind, fd, record, resumed)
        except BaseException:
            os.close(fd)
            raise
        _RERUN.append(RESUME_HINT.get(kind, OVERWRITE_HINT))
        self._hint = True
        try:
            self.save()  # ours from here on, whatever happens next
            if not resumed:
                self._clear()
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _check_state(out: Path, kind: str, resume: bool, overwrite: bool) -> None:
        if not out.exists() or not _has_content(out):
            return  # nothing written yet: start (``--resume`` included)
        rec = read_record(out)
        if rec is None or rec.get("corrupt") and not rec.get("kind"):
            what = "has no quantize job record" if rec is None else "has a corrupt quantize job record"
            raise QuantizeError(
                f"{out}: exists and {what}, so this tool did not write it and will not touch it; "
                "choose another OUT or remove it yourself"
            )
        if rec.get("kind") != kind:
            raise QuantizeError(
                f"{out}: holds a `quantize {rec.get('kind')}` output, not a {kind} one; choose another OUT for {kind}"
            )
        if not (resume or overwrite):
            if kind in RESUME_HINT and kind != "run":
                raise QuantizeError(
                    f"{out}: already exists; pass --resume to continue an interrupted run or --overwrite to replace it"
                )
            raise QuantizeError(f"{out}: already exists; pass --overwrite to replace it (or choose another OUT)")

    # -- record --------------------------------------------------------------------------------
    @property
    def record_path(self) -> Path:
        return self.path / RECORD_DIR / RECORD

    def save(self) -> None:
        write_text_atomic(self.record_path, json.dumps(self.record, indent=1, sort_keys=True))

    def check_key(self, key: dict) -> None:
        """On resume: the options and inputs must be the interrupted run's."""
        old = self.record.get("key") or {}
        diff = [k for k in sorted(set(old) | set(key)) if old.get(k) != key.get(k)]
        if diff == ["build"]:  # the same options and inputs, another build of the tool or its libraries
            was, now = old.get("build") or {}, key["build"]
            changed = ", ".join(
                f"{k} {was.get(k) or 'unrecorded'} -> {now.get(k) or 'none'}" for k in sorted(set(was) | set(now))
                if was.get(k) != now.get(k)
            )
            raise QuantizeError(
                f"{self.record_path}: the interrupted run was written by another build ({changed}); resuming "
                "would mix two builds' bytes: resume with the build that started it, or --overwrite to start over"
            )
        if diff:
            raise QuantizeError(
                f"{self.record_path}: --resume with different {', '.join(diff)} than the interrupted "
                "run; rerun with the same options, or --overwrite to start over"
            )

    def mark_done(self, file: str, sha256: str, nbytes: int, stats: list[dict] | None = None) -> None:
        self.record["shards"][file] = {"sha256": sha256, "bytes": nbytes}
        if stats is not None:
            self.record["stats"][file] = stats
        self.save()

    def kept(self, files: list[str], workers: int = 4) -> set[str]:
        """Of ``files``, those already written whose SHA-256 matches the record (read in full:
        size alone does not prove a shard). A mismatch is dropped from the record, to be redone."""
        cand = [
            f
            for f in files
            if (rec := self.record["shards"].get(f))
            and (self.path / f).is_file()
            and (self.path / f).stat().st_size == rec["bytes"]
        ]
        shas = sha256_files([self.path / f for f in cand], workers)
        good = {f for f, s in zip(cand, shas) if s == self.record["shards"][f]["sha256"]}
        for f in list(self.record["shards"]):
            if f in files and f not in good:
                del self.record["shards"][f]
                self.record["stats"].pop(f, None)
        self.save()
        return good

    def complete(self) -> None:
        self.record["state"] = "complete"
        self.save()

    # -- writing -------------------------------------------------------------------------------
    def _clear(self) -> None:
        """Remove what an earlier job of ours left (``--overwrite``), keeping only the lock and the
        record just written."""
        for p in list(self.path.iterdir()):
            if p.name == RECORD_DIR:
                for q in p.iterdir():
                    if q.name not in (LOCK, RECORD):
                        _remove(q)
                continue
            _remove(p)

    def scratch(self, name: str) -> Path:
        """A working folder of this job inside the record folder (``OUT/.quantize/<name>``): never
        uploaded, never part of the checkpoint, removed with ``clear_scratch``."""
        if not name or "/" in name or name in (LOCK, RECORD) or name.startswith("."):
            raise ValueError(f"scratch name {name!r}")
        return self.path / RECORD_DIR / name

    def clear_scratch(self, name: str) -> None:
        p = self.scratch(name)
        if p.exists() or p.is_symlink():
            _remove(p)

    def write_text(self, name: str, text: str) -> Path:
        path = self.path / name
        write_text_atomic(path, text)
        return path

    def write_json(self, name: str, obj, sort_keys: bool = True, indent: int = 1) -> Path:
        return self.write_text(name, json.dumps(obj, indent=indent, sort_keys=sort_keys, default=str))

    def copy_side_files(self, files: list[Path], link: bool = False, subdir: str = "") -> list[str]:
        """Copy the source's side files (from ``side_files``) by content, into ``subdir`` of the
        output when given; ``link`` hard-links where possible (unchanged weights of calibrate-kv),
        copying across filesystems."""
        names = []
        if subdir:
            (self.path / subdir).mkdir(exist_ok=True)
        for p in files:
            name = side_name(p)
            dst = self.path / subdir / name
            tmp = dst.with_name(dst.name + TMP_SUFFIX)
            try:
                dst.parent.mkdir(exist_ok=True)
                if tmp.exists():
                    tmp.unlink()
                if link:
                    try:
                        os.link(p.resolve(), tmp)
                    except OSError:
                        shutil.copyfile(p, tmp)
                else:
                    shutil.copyfile(p, tmp)  # follows a snapshot's symlink: the content, not the link
                os.replace(tmp, dst)
            except OSError as e:
                raise _oserror(dst, e, f"copying {name}") from e
            names.append(name)
        return names

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        if getattr(self, "_hint", False):
            if len(_RERUN) > 1:
                _RERUN.pop()
            self._hint = False

    def __enter__(self) -> "Output":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


class RankScratch:
    """The scratch folders of a rank other than 0, for the output rank 0 opened at ``out``:
    ``OUT/.quantize/<name>/rank-N`` where this node sees OUT's record folder (one node, or a shared
    disk), so rank 0's ``Output.clear_scratch`` on a rerun clears what a killed rank left; else a
    private temporary folder. Only its own folders are made, and removed (``clear_scratch``,
    ``close``); nothing else in OUT is touched."""

    def __init__(self, out: Path, rank: int):
        import tempfile

        self.rank = rank
        record = Path(out) / RECORD_DIR
        self._record = record if record.is_dir() else None
        self._tmp = None if self._record is not None else tempfile.TemporaryDirectory(prefix="quantize-rank-")
        self._made: set[Path] = set()

    def scratch(self, name: str) -> Path:
        if not name or "/" in name or name in (LOCK, RECORD) or name.startswith("."):
            raise ValueError(f"scratch name {name!r}")
        p = self._record / name / f"rank-{self.rank}" if self._record is not None else Path(self._tmp.name) / name
        self._made.add(p)
        return p

    def clear_scratch(self, name: str) -> None:
        p = self.scratch(name)
        try:  # rank 0 may be clearing the same record folder at the end of its run
            if p.exists() or p.is_symlink():
                _remove(p)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        for p in list(self._made):
            try:
                if p.exists() or p.is_symlink():
                    _remove(p)
            except FileNotFoundError:
                pass
        if self._tmp is not None:
            self._tmp.cleanup()


def side_files(src: Path, patterns: tuple[str, ...] = SIDE_FILES) -> list[Path]:
    """The source's side files to copy (and those of its ``SIDE_DIRS``), checked before any shard
    is written: a dangling symlink or one that leaves both the folder and its Hub cache is named
    in one line."""
    src = Path(src)
    out = [p for p in sorted(src.iterdir()) if any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
           and _side_file(src, p, p.name)]
    for d, pats in SIDE_DIRS.items():
        sub = src / d
        if not sub.is_dir():
            continue
        if not inside(src, d):
            raise QuantizeError(f"{sub}: symlink to {sub.resolve()}, outside the checkpoint and its Hub cache; copy "
                                "the folder in instead")
        out += [p for p in sorted(sub.iterdir()) if any(fnmatch.fnmatch(p.name, pat) for pat in pats)
                and _side_file(src, p, f"{d}/{p.name}")]
    return out


def side_name(p: Path) -> str:
    """A side file's name in the output: ``NAME``, or ``DIR/NAME`` in one of ``SIDE_DIRS`` (a folder
    of that name holding no config.json: not a checkpoint that happens to be named so)."""
    in_dir = p.parent.name in SIDE_DIRS and not (p.parent / "config.json").is_file()
    return f"{p.parent.name}/{p.name}" if in_dir else p.name


def _side_file(src: Path, p: Path, rel: str) -> bool:
    """Whether ``p`` (``rel`` in ``src``) is copied: a regular file, or a link to one inside the
    checkpoint or its Hub cache; a folder is skipped; anything else is one line."""
    if p.is_symlink():
        if not p.exists():
            raise QuantizeError(
                f"{p}: dangling symlink (its target {os.readlink(p)} is missing); re-download it or remove the link"
            )
        if not inside(src, rel):
            raise QuantizeError(
                f"{p}: symlink to {p.resolve()}, outside the checkpoint and its Hub cache; copy the file in instead"
            )
    if p.is_dir():
        return False  # a folder named like a side file (e.g. a LICENSE/ folder) is not copied
    if not p.is_file():
        raise QuantizeError(
            f"{p}: not a regular file (a FIFO or device), so it cannot be copied into the output; replace it "
            "with the file itself"
        )
    return True


# -- single files: reports, saved baselines, statistics ------------------------------------------
# A file written outside an output folder (``eval --out``, ``--markdown``, ``eval-kld
# --save-baseline``, ``calibrate-kv --stats-out``) follows the same rules as a folder: never inside
# an input (nor equal to one, nor in its Hub cache), never through a symlink, never over a file this
# tool did not write, atomic. What proves a file ours is in the file: a JSON report carries
# ``written_by`` (the kind and the SHA-256 of the rest of the document), a Markdown report ends with a
# comment holding the SHA-256 of the text above it, a safetensors file carries ``quantize_kind`` in
# its metadata. A file whose proof is absent or no longer matches (edited by hand) is not replaced.
SIGNATURE = "written_by"
_MD_TRAILER = "<!-- written by quantize {kind}; sha256 of the text above: {sha} -->\n"


def _canonical(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)


def signed_json(doc: dict, kind: str) -> str:
    """``doc`` as the JSON text of a report of ``kind``, carrying its own proof of origin."""
    body = {k: v for k, v in doc.items() if k != SIGNATURE}
    body = json.loads(_canonical(body))  # what a reader will see: Paths as strings, tuples as lists
    sig = {"tool": "quantize", "kind": kind, "sha256": hashlib.sha256(_canonical(body).encode()).hexdigest()}
    return json.dumps({**body, SIGNATURE: sig}, indent=1, default=str)


def signed_markdown(text: str, kind: str) -> str:
    text = text if text.endswith("\n") else text + "\n"
    return text + _MD_TRAILER.format(kind=kind, sha=hashlib.sha256(text.encode()).hexdigest())


def _written_by_us(path: Path, kind: str) -> bool:
    """``path`` holds a file of ``kind`` that this tool wrote and nobody edited since."""
    from ..parse import json_text

    try:
        with open(path, "rb") as f:
            head = f.read(9)
            if head[8:9] == b"{" and not head.startswith(b"{"):  # safetensors: u64 length, then its JSON
                from .index import read_header

                try:
                    header, _ = read_header(path)
                except QuantizeError:
                    return False
                return (header.get("__metadata__") or {}).get("quantize_kind") == kind
            if os.fstat(f.fileno()).st_size > 64 << 20:
                return False
            raw = head + f.read()
    except OSError:
        return False
    if raw.startswith(b"{"):  # a signed JSON report
        try:
            doc = json_text(raw.decode("utf-8"), path, "report")
        except (QuantizeError, UnicodeDecodeError):
            return False
        sig = doc.get(SIGNATURE) if isinstance(doc, dict) else None
        if not isinstance(sig, dict) or sig.get("kind") != kind:
            return False
        body = {k: v for k, v in doc.items() if k != SIGNATURE}
        return sig.get("sha256") == hashlib.sha256(_canonical(body).encode()).hexdigest()
    text = raw.decode("utf-8", errors="replace")
    body, sep, last = text.rstrip("\n").rpartition("\n")
    body += sep
    return last + "\n" == _MD_TRAILER.format(kind=kind, sha=hashlib.sha256(body.encode()).hexdigest())


def report_target(path: str | os.PathLike, kind: str, inputs=(), what: str = "--out") -> Path:
    """Check, before any work, that ``path`` may receive a file of ``kind``: not a folder or a
    symlink, not inside (or equal to) any of ``inputs`` or their Hub caches, and either absent or a
    file this tool wrote as ``kind``. -> the path. One line naming the option otherwise."""
    p = Path(path)
    try:
        if p.is_symlink():
            raise QuantizeError(f"{what} {p}: is a symlink; pass a real path (files are never written through a link)")
        if p.is_dir():
            raise QuantizeError(f"{what} {p}: is a folder; name a file inside it, e.g. {p / ('report.' + _ext(kind))}")
        if p.parent.exists() and not p.parent.is_dir():
            raise QuantizeError(f"{what} {p}: {p.parent} is a file, not a folder; choose another path")
        real = p.resolve()
    except OSError as e:
        raise _oserror(p, e, f"checking {what}") from e
    for i in inputs:
        if i is None:
            continue
        if any(real.is_relative_to(r) for r in _input_roots(i)):  # equal to it, or inside it
            raise QuantizeError(
                f"{what} {p}: lies inside the input {i}; write it elsewhere (inputs are never modified)"
            )
    if p.exists() and not _written_by_us(p, kind):
        raise QuantizeError(
            f"{what} {p}: exists and is not a {kind} file this tool wrote (or was edited since); "
            "choose another path or move it away yourself"
        )
    return p


def _ext(kind: str) -> str:
    return {"markdown": "md", "kld-baseline": "safetensors"}.get(kind, "json")


def write_report(path: str | os.PathLike, content, kind: str, inputs=(), what: str = "--out") -> Path:
    """Write a report (a dict: signed JSON; a str: signed Markdown) at ``path`` under the rules
    of ``report_target``, atomically; the folder is made when missing."""
    p = report_target(path, kind, inputs, what)
    text = signed_json(content, kind) if isinstance(content, dict) else signed_markdown(content, kind)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _oserror(p, e, f"creating the folder of {what}") from e
    write_text_atomic(p, text)
    return p
