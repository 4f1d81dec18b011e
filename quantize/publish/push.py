"""``quantize push``: upload a quantize output to the Hugging Face Hub (or the Hub at HF_ENDPOINT).

Pre-flight, before a byte goes up: the folder is a finished quantize output (its manifest), every
index entry is present and every header valid (``CheckpointIndex.open``), config.json parses, and
every file matches the SHA-256 the manifest records (``quantize check``'s ``verify_files``); a
tampered or incomplete folder is refused, naming the file. The manifest is checked, not trusted:
it must record files, agree with the file list the writing command kept in ``.quantize/job.json``
(``job_files``; README.md aside, which a card replaces) and record every file the index, config.json
(``auto_map``), the side files and the card's licence link name. A folder whose record keeps no file
list (written before records kept one, or copied without ``.quantize/``) is pushed on the manifest
alone, with a warning; an unreadable record is refused. config.json's quantization_config must
describe the tensors as ``quantize check`` proves it (``verify_quant_config``: a config edited and
re-hashed into both records passes every SHA-256, not this). Nothing that names this machine goes
up (``privacy.scan``: its paths, the home folder, the user's home, the host name; in the files
quantize writes, any absolute path), one line naming the file otherwise. Only what the manifest
proves goes up, plus the manifest and the card: never ``.quantize/`` (the job record, lock and push state) nor
``*.partial``. The card is (re)generated unless README.md is one the user wrote.

Resume. Files are committed in batches (``batch_gib`` of weights per commit, the small files with
the last batch, so config.json and the index land last). Before uploading, the Hub is asked which
files it already holds at the target revision (``paths-info``): a file whose LFS SHA-256 (or git
blob id) equals ours is not sent again. Within an interrupted batch, LFS objects that were uploaded
but not yet committed are not sent again either: the LFS batch API answers "already present" for
them (with Xet storage, hf_xet deduplicates the chunks). ``.quantize/push.json`` keeps the pull
request of a ``--create-pr`` push so a rerun continues it, and what each commit carried.

The token comes from ``huggingface_hub.get_token()`` (HF_TOKEN or the saved login) and goes only
into the request headers; it is never printed, logged, or written to any file. Nor is the userinfo of
``HF_ENDPOINT`` (``https://user:TOKEN@host``): every message, URL and record shows it as ``***``
(``redact``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoint.index import INDEX_NAME, CheckpointIndex
from ..checkpoint.manifest import MANIFEST
from ..checkpoint.output import (
    RECORD,
    RECORD_DIR,
    SIDE_DIRS,
    SIDE_FILES,
    TMP_SUFFIX,
    confined,
    read_record,
    sha256_file,
    write_text_atomic,
)
from ..errors import QuantizeError
from ..events import Emit, null_emit
from ..options import PushOptions, takes
from ..parse import load_json
from .card import (
    README,
    _front_matter,
    folder_lock,
    load_manifest,
    readme_kind,
    record_disagreement,
    refused_readme,
    render,
    repo_id_error,
    source_card,
    source_path,
    verify,
    write_card,
)
from .privacy import scan

STATE = "push.json"  # in .quantize/
PATHS_INFO_CHUNK = 100


@dataclass
class PushFile:
    path: str
    bytes: int
    sha256: str
    status: str = "to upload"  # "to upload" | "on the Hub already" | "uploaded"


@dataclass
class PushResult:
    model: str
    repo_id: str
    revision: str
    dry_run: bool
    files: list[PushFile]
    not_uploaded: list[str]  # files in the folder that the manifest does not prove
    card: str  # what happened to README.md
    commits: list[str] = field(default_factory=list)
    pr_url: str | None = None
    url: str | None = None
    warnings: list[str] = field(default_factory=list)  # said on stderr: what was not checked, and why

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def sent_bytes(self) -> int:
        return sum(f.bytes for f in self.files if f.status == "uploaded")

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "sent_bytes": self.sent_bytes}


def _upload_set(folder: Path, manifest: dict) -> tuple[list[PushFile], list[str]]:
    """The files that go up (every file the manifest proves, README.md, the manifest) and the
    folder's other files, which do not."""
    recorded = manifest.get("files") or {}
    files = []
    for name, rec in sorted(recorded.items()):
        if name == README:
            continue
        p = confined(folder, name, str(folder / MANIFEST))
        files.append(PushFile(name, int(rec["bytes"]), str(rec["sha256"])))
        if not p.is_file():
            raise QuantizeError(
                f"{p}: recorded in the manifest but missing; the folder is incomplete, nothing was pushed"
            )
    weights = [f for f in files if f.path.endswith(".safetensors")]
    rest = [f for f in files if not f.path.endswith(".safetensors")]
    taken = {f.path for f in files} | {README, MANIFEST}
    others = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if (
            rel.split("/")[0] in (RECORD_DIR, ".cache")
            or rel in taken
            or not p.is_file()
            or p.name.endswith(TMP_SUFFIX)
        ):
            continue
        others.append(rel)
    return weights + rest, others


def _against_record(folder: Path, manifest: dict) -> list[str]:
    """The manifest is checked, not trusted: it must record files, agree with the job record the
    writing command left (``job_files``) on every file but README.md, and the record must be
    readable. -> warnings (a folder without such a record: the manifest alone, said so)."""
    path = folder / MANIFEST
    if not [n for n in manifest["files"] if n != README]:
        raise QuantizeError(
            f"{path}: records no files ('files' is empty), so it proves nothing; nothing was pushed, "
            "convert the folder again"
        )
    rec_path = folder / RECORD_DIR / RECORD
    rec = read_record(folder) if rec_path.is_file() else None
    if rec is not None and (rec.get("corrupt") or ("files" in rec and not isinstance(rec["files"], dict))):
        raise QuantizeError(
            f"{rec_path}: not a readable job record (its 'files' is what the manifest is compared with); "
            "nothing was pushed; convert the folder again"
        )
    if rec is None or "files" not in rec:
        return [
            f"{rec_path if rec is not None else folder / RECORD_DIR}: "
            + ("records no files" if rec is not None else "missing")
            + " (a folder written before quantize kept them, or copied without .quantize/), so the manifest "
            "was checked against the files but not against what the writing command recorded; convert again "
            "to have both"
        ]
    if why := record_disagreement(folder, manifest):
        raise QuantizeError(f"{why}; nothing was pushed, convert the folder again")
    return []


def _referenced(folder: Path, index: CheckpointIndex, card_text: str | None) -> list[tuple[str, str]]:
    """(file, who names it): what the upload needs besides the weights' own manifest entries: the
    index and every shard its weight_map names, config.json and the code its auto_map names, the
    side files the conversion copies (tokenizer, chat template, licence), the card's licence file."""
    out = [("config.json", "the checkpoint"), *((f, INDEX_NAME + " (weight_map)") for f in index.files)]
    if (folder / INDEX_NAME).is_file():
        out.append((INDEX_NAME, "the checkpoint"))
    auto = index.config.get("auto_map")
    for v in (auto.values() if isinstance(auto, dict) else []):
        for ref in v if isinstance(v, list) else [v]:
            # "module.Class" is a file here; "repo--module.Class" is another repo's
            if isinstance(ref, str) and "--" not in ref and "." in ref:
                out.append((ref.rsplit(".", 1)[0].replace(".", "/") + ".py", "config.json (auto_map)"))
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != README and any(fnmatch.fnmatch(p.name, pat) for pat in SIDE_FILES):
            out.append((p.name, "the side files a checkpoint ships (tokenizer, chat template, licence)"))
    for d, pats in SIDE_DIRS.items():
        for p in sorted((folder / d).iterdir()) if (folder / d).is_dir() else []:
            if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in pats):
                out.append((f"{d}/{p.name}", "the named chat templates a checkpoint ships"))
    link = _front_matter(card_text).get("license_link") if card_text else None
    if isinstance(link, str) and "://" not in link and link.strip() and (folder / link.strip()).is_file():
        out.append((link.strip(), "the card (license_link)"))
    return out


def _covered(folder: Path, manifest: dict, index: CheckpointIndex, card_text: str | None) -> None:
    files = manifest["files"]
    for name, who in _referenced(folder, index, card_text):
        if name not in files:
            raise QuantizeError(
                f"{folder / name}: named by {who} but not recorded in {MANIFEST}, so it would not be pushed "
                "(or not be proven); nothing was pushed, convert the folder again"
            )


def _config_agrees(folder: Path, index: CheckpointIndex) -> None:
    """config.json's quantization_config describes the tensors, as ``quantize check`` proves it
    (``verify_quant_config``): a config edited and re-hashed into the manifest and the job record
    passes every SHA-256, not this."""
    from ..check import verify_quant_config
    from ..errors import CheckFailed

    try:
        verify_quant_config(folder, index)
    except CheckFailed as e:
        raise QuantizeError(f"{e}; nothing was pushed") from None


def _finish_set(folder: Path, files: list[PushFile]) -> list[PushFile]:
    """``files`` then the manifest, then the card (the repo shows a card once everything is up)."""
    out = list(files)
    for name in (MANIFEST, README):
        p = folder / name
        if p.is_file():
            out.append(PushFile(name, p.stat().st_size, sha256_file(p)))
    return out


def _batches(files: list[PushFile], batch_bytes: int) -> list[list[PushFile]]:
    """Weights in batches of about ``batch_bytes``; everything else with the last batch."""
    weights = [f for f in files if f.path.endswith(".safetensors")]
    rest = [f for f in files if not f.path.endswith(".safetensors")]
    out: list[list[PushFile]] = []
    size = 0
    for f in weights:
        if not out or (size + f.bytes > batch_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(f)
        size += f.bytes
    if rest:
        if out:
            out[-1] += rest
        else:
            out.append(rest)
    return out


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@]*@")


def redact(text: str, *secrets: str | None) -> str:
    """``text`` with the userinfo of every URL in it (``https://user:TOKEN@host``) and each of
    ``secrets`` (the token, the endpoint's user name and password) replaced by ``***``."""
    from urllib.parse import unquote

    text = _USERINFO.sub(r"\1***@", str(text))
    for sec in secrets:
        for form in {sec, unquote(sec)} if sec else ():
            if len(form) >= 4:
                text = text.replace(form, "***")
    return text


def _endpoint_secrets(endpoint: str | None) -> list[str]:
    from urllib.parse import urlsplit

    try:
        u = urlsplit(endpoint or "")
        return [x for x in (u.username, u.password) if x]
    except ValueError:
        return []


def _scrub(msg: str, token: str | None, endpoint: str | None = None) -> str:
    return " ".join(redact(msg, token, *_endpoint_secrets(endpoint)).split())


def _why(e: BaseException, token: str | None, endpoint: str | None = None) -> str:
    """The first line of an exception and of its causes (huggingface_hub wraps an upload's HTTP
    error in a RuntimeError)."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if first and first not in parts:
            parts.append(first)
        e = e.__cause__ or e.__context__
    return _scrub(": ".join(parts[:3]), token, endpoint)


def _status(e: BaseException) -> int | None:
    while e is not None:
        r = getattr(e, "response", None)
        if r is not None and getattr(r, "status_code", None):
            return int(r.status_code)
        e = e.__cause__ or e.__context__
    return None


def _load_state(folder: Path, key: dict) -> dict:
    try:
        st = load_json(folder / RECORD_DIR / STATE, "push record", kind="record")
    except QuantizeError:
        st = None  # missing or unreadable: start afresh (the Hub's own files are still not sent again)
    if not isinstance(st, dict) or st.get("key") != key:
        st = {"key": key, "pr_revision": None, "pr_url": None, "commits": []}
    return st


def _save_state(folder: Path, st: dict) -> None:
    write_text_atomic(folder / RECORD_DIR / STATE, json.dumps(st, indent=1))


def _on_hub(api, repo_id: str, revision: str, files: list[PushFile], folder: Path) -> set[str]:
    """The files the Hub holds at ``revision`` with exactly our content."""
    from huggingface_hub.utils.sha import git_hash

    remote = {}
    paths = [f.path for f in files]
    for i in range(0, len(paths), PATHS_INFO_CHUNK):
        for r in api.get_paths_info(repo_id, paths[i : i + PATHS_INFO_CHUNK], revision=revision, repo_type="model"):
            remote[r.path] = r
    same = set()
    for f in files:
        r = remote.get(f.path)
        if r is None or getattr(r, "size", None) != f.bytes:
            continue
        lfs = getattr(r, "lfs", None)
        if lfs is not None:
            if lfs.sha256 == f.sha256:
                same.add(f.path)
        elif f.bytes <= 64 << 20 and r.blob_id == git_hash((folder / f.path).read_bytes()):
            same.add(f.path)
    return same


@takes(PushOptions)
def push(
    model, repo_id, private, revision, create_pr, dry_run, message, batch_gib, base_model, license,
    emit: Emit = null_emit,
) -> PushResult:
    """``quantize push``: check ``model`` and upload it to ``repo_id`` (created if missing;
    ``private`` for a new repo), on branch ``revision`` (created from main if missing) or, with
    ``create_pr``, as a pull request; ``dry_run`` checks and lists, needs no token, sends nothing.
    A rerun after an interruption sends only what the Hub does not hold yet. ``base_model``: the
    card's base_model (``card.base_model``'s order: before the one the last card kept, the manifest's
    or the source's); ``license``: the card's licence (``card``'s --license)."""
    from .. import __version__

    folder = Path(model)
    if why := repo_id_error(repo_id):
        raise QuantizeError(why)
    if message is not None and not message.strip():
        raise QuantizeError("--message: empty; give a commit message or leave the option out")
    token = None
    if not dry_run:
        from huggingface_hub import constants, get_token

        token = get_token()
        if not token:
            raise QuantizeError(
                "no Hugging Face token: log in with `hf auth login` or set HF_TOKEN to a token with "
                "write access "
                "(`quantize push --dry-run` needs none)"
            )
        if constants.is_offline_mode():
            raise QuantizeError(
                "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so huggingface_hub sends no "
                "request; set HF_HUB_OFFLINE=0 to push"
            )
    manifest = load_manifest(folder)
    base = revision or "main"
    lock = None if dry_run else folder_lock(folder)  # a dry run writes nothing, not even the lock's pid
    if lock is not None:
        lock.__enter__()
    try:
        index = CheckpointIndex.open(folder)  # config.json, index, every entry present, every header valid
        warnings = _against_record(folder, manifest)
        failures, proven = verify(folder)
        if failures:
            raise QuantizeError(
                f"{failures[0]}"
                + (f" ({len(failures) - 1} more)" if len(failures) > 1 else "")
                + "; the folder is not what quantize wrote, so nothing was pushed: restore the file or convert again"
            )
        _config_agrees(folder, index)
        kind = readme_kind(folder, manifest)
        readme_text = (folder / README).read_text(errors="replace") if kind == "user" else source_card(folder, manifest)
        _covered(folder, manifest, index, readme_text)
        del index
        files, others = _upload_set(folder, manifest)
        if kind == "user" and not (folder / README).is_file():
            raise refused_readme(folder)  # a folder or a dangling link named README.md: nothing to upload
        # the card as it will be uploaded: read with every other file for this machine's paths and names
        text = None if kind == "user" else render(
            folder, manifest, _stored(folder), repo_id, proven, base_model, license).text
        names = [f.path for f in files] + [MANIFEST, README]
        scan(folder, names, {README: text} if text is not None else {}, source_path(folder, manifest), kind != "user")
        if kind == "user":
            card = "README.md: the card you wrote (or edited), uploaded as it is"
        elif dry_run:
            card = (
                f"README.md: would be {'generated' if kind == 'missing' else 'regenerated'} from the folder's records"
            )
        else:
            write_card(folder, manifest, None, repo_id, proven, base_model, license)
            scan(folder, [MANIFEST, README], source=source_path(folder, manifest))  # as written: its README entry
            card = f"README.md: {'generated' if kind == 'missing' else 'regenerated'} from the folder's records"
        files = _finish_set(folder, files)
        if dry_run and kind != "user":  # the card as it would be written
            data = text.encode()
            files = [f for f in files if f.path != README] + [
                PushFile(README, len(data), hashlib.sha256(data).hexdigest())
            ]
        res = PushResult(str(folder), repo_id, base, dry_run, files, others, card, warnings=warnings)
        if dry_run:
            return res
        endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or None
        try:
            _upload(
                folder,
                res,
                token,
                endpoint,
                private,
                revision,
                create_pr,
                message or f"Upload {folder.resolve().name} (quantize {__version__})",
                int(batch_gib * 2**30),
                emit,
            )
        except QuantizeError as e:
            emit({"event": "error", "message": str(e)})  # ends a progress line the upload left open
            raise
        return res
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def _stored(folder: Path) -> list[dict]:
    from .card import _stored_reports

    return _stored_reports(folder)


def _upload(
    folder: Path,
    res: PushResult,
    token: str,
    endpoint: str | None,
    private: bool,
    revision: str | None,
    create_pr: bool,
    message: str,
    batch_bytes: int,
    emit: Emit,
) -> None:
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError

    api = HfApi(endpoint=endpoint, token=token)
    repo_id, base = res.repo_id, res.revision
    secrets = (token, *_endpoint_secrets(endpoint or constants.ENDPOINT))
    shown = redact(endpoint or constants.ENDPOINT, *secrets)  # the endpoint as messages and push.json say it
    key = {"endpoint": shown, "repo_id": repo_id, "revision": base, "create_pr": create_pr}
    stage = "creating the repo"
    try:
        res.url = redact(
            str(api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")), *secrets
        )
        if revision and revision != "main" and not revision.startswith("refs/"):
            stage = f"creating branch {revision}"
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        st = _load_state(folder, key)
        target = st.get("pr_revision") or base
        stage = f"asking which files {repo_id}@{target} already holds"
        try:
            same = _on_hub(api, repo_id, target, res.files, folder)
        except RevisionNotFoundError:
            if target == base:
                raise
            st = {
                "key": key,
                "pr_revision": None,
                "pr_url": None,
                "commits": [],
            }  # that pull request is gone: open another
            target = base
            same = _on_hub(api, repo_id, target, res.files, folder)
        res.pr_url = redact(st["pr_url"], *secrets) if isinstance(st.get("pr_url"), str) else None
        for f in res.files:
            if f.path in same:
                f.status = "on the Hub already"
        todo = [f for f in res.files if f.path not in same]
        batches = _batches(todo, batch_bytes)
        emit(
            {
                "event": "start",
                "stage": "push",
                "files": len(todo),
                "skipped": len(same),
                "commits": len(batches),
                "bytes": sum(f.bytes for f in todo),
            }
        )
        earlier = len(st["commits"])  # an interrupted run's commits count too: (2/3), (3/3) after a resume
        for i, batch in enumerate(batches, 1):
            first_pr = create_pr and not st.get("pr_revision")
            ops = []
            for f in batch:
                op = CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(folder / f.path))
                op.upload_info.sha256 = bytes.fromhex(f.sha256)  # proven by the pre-flight: no second read to hash
                ops.append(op)
            names = ", ".join(f.path for f in batch[:3]) + (", ..." if len(batch) > 3 else "")
            stage = f"uploading commit {i}/{len(batches)} ({names})"
            n = earlier + len(batches)
            info = api.create_commit(
                repo_id,
                ops,
                commit_message=message if n == 1 else f"{message} ({earlier + i}/{n})",
                revision=base if first_pr else target,
                create_pr=True if first_pr else None,
                repo_type="model",
            )
            if first_pr:
                pr_url = redact(info.pr_url, *secrets) if info.pr_url else None
                st["pr_revision"], st["pr_url"] = info.pr_revision, pr_url
                target, res.pr_url = info.pr_revision, pr_url
            st["commits"].append({"oid": info.oid, "files": {f.path: f.sha256 for f in batch}})
            _save_state(folder, st)
            res.commits.append(info.oid)
            for f in batch:
                f.status = "uploaded"
            emit(
                {
                    "event": "commit",
                    "index": i,
                    "of": len(batches),
                    "oid": info.oid,
                    "files": len(batch),
                    "bytes": sum(f.bytes for f in batch),
                }
            )
    except QuantizeError:
        raise
    except (HfHubHTTPError, RuntimeError, ValueError, OSError) as e:
        code = _status(e)
        if code == 401:
            raise QuantizeError(
                f"the Hub at {shown} refused the token (401) while {stage}; log in again "
                "with "
                "`hf auth login` or set HF_TOKEN to a token with write access"
            ) from None
        if code == 403 and stage == "creating the repo":
            raise QuantizeError(
                f"REPO_ID {repo_id}: the token may not create or write this repo (403); use a "
                "namespace you can write to"
            ) from None
        raise QuantizeError(
            f"push to {repo_id} failed while {stage}: {_why(e, token, endpoint or constants.ENDPOINT)}; "
            "rerun the same command to "
            "resume "
            "(files already on the Hub are not sent again)"
        ) from None
    except Exception as e:  # noqa: BLE001 - httpx transport errors (connection refused, timeouts)
        import httpx

        if isinstance(e, httpx.HTTPError):
            raise QuantizeError(
                f"push to {repo_id} failed while {stage}: {_why(e, token, endpoint)}; check HF_ENDPOINT and the "
                "network, then rerun "
                "the same command to resume (files already on the Hub are not sent again)"
            ) from None
        raise
