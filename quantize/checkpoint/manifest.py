"""The resumable job record (``OUT/.quantize/job.json``) and the final manifest
(``OUT/quantize_manifest.json``, written last: its presence means the output is complete)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

from ..errors import QuantizeError
from .index import read_header
from .writer import atomic_write_text

JOB_DIR = ".quantize"
JOB_FILE = "job.json"
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


def source_revision(folder: Path) -> str | None:
    """The Hub commit of a snapshot folder (``.../snapshots/<sha>``) or a local-dir download."""
    if folder.resolve().parent.name == "snapshots":
        return folder.resolve().name
    metas = sorted((folder / ".cache" / "huggingface" / "download").glob("*.metadata"))
    if metas:
        return metas[0].read_text().splitlines()[0]
    return None


def tool_versions() -> dict:
    import compressed_tensors
    import safetensors
    import torch
    import transformers

    from .. import __version__

    v = {
        "quantize": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "transformers": transformers.__version__,
        "compressed_tensors": compressed_tensors.__version__,
    }
    try:
        here = Path(__file__).resolve().parents[2]
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if sha.returncode == 0:
            v["quantize_git"] = sha.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v


class JobRecord:
    def __init__(self, out: Path, data: dict):
        self.out = out
        self.data = data

    @property
    def path(self) -> Path:
        return self.out / JOB_DIR / JOB_FILE

    @classmethod
    def create(cls, out: Path, key: dict) -> "JobRecord":
        (out / JOB_DIR).mkdir(parents=True, exist_ok=True)
        rec = cls(out, {"state": "running", "key": key, "shards": {}, "stats": {}})
        rec.save()
        return rec

    @classmethod
    def load(cls, out: Path) -> "JobRecord":
        path = out / JOB_DIR / JOB_FILE
        try:
            data = json.loads(path.read_text())
            data["key"], data["shards"]
        except FileNotFoundError as e:
            raise QuantizeError(f"{path}: no job record, so {out} was not written by an interrupted convert; use --overwrite or another OUT") from e
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise QuantizeError(f"{path}: job record is corrupt; rerun with --overwrite") from e
        return cls(out, data)

    def check_key(self, key: dict) -> None:
        old = self.data["key"]
        diff = [k for k in sorted(set(old) | set(key)) if old.get(k) != key.get(k)]
        if diff:
            raise QuantizeError(f"{self.path}: --resume with different {', '.join(diff)} than the interrupted run; rerun with the same options, or --overwrite to start over")

    def mark_done(self, file: str, sha256: str, nbytes: int, stats: list[dict]) -> None:
        self.data["shards"][file] = {"sha256": sha256, "bytes": nbytes}
        self.data["stats"][file] = stats
        self.save()

    def done(self, file: str, out: Path) -> bool:
        rec = self.data["shards"].get(file)
        p = out / file
        return bool(rec) and p.exists() and p.stat().st_size == rec["bytes"]

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=1, sort_keys=True))


def write_manifest(out: Path, manifest: dict) -> None:
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True, default=str))


def is_quantize_output(out: Path) -> bool:
    return (out / JOB_DIR / JOB_FILE).exists() or (out / MANIFEST).exists()


def remove_output(out: Path) -> None:
    import shutil

    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        os.unlink(out)
