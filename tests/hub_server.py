"""A Hugging Face Hub on loopback: the endpoints huggingface_hub 1.33 calls to create a repo, a
branch, and commits of regular and LFS files (basic transfer), read through ``HF_ENDPOINT``.

Implemented (found by reading huggingface_hub's ``hf_api.py``, ``_commit_api.py`` and ``lfs.py``):

* ``POST /api/repos/create`` (409 when the repo exists)
* ``GET  /api/models/{repo}/revision/{rev}`` (repo info)
* ``POST /api/models/{repo}/branch/{branch}`` (409 when it exists)
* ``POST /api/models/{repo}/paths-info/{rev}`` (form-encoded ``paths``)
* ``POST /api/models/{repo}/preupload/{rev}`` (upload mode per file, and the remote oid)
* ``POST /{repo}.git/info/lfs/objects/batch`` (no ``actions`` for an object already stored)
* ``PUT  /_lfs/{repo}/{oid}`` (the upload URL the batch hands out; checks size and SHA-256)
* ``POST /api/validate-yaml`` (the card's metadata must parse)
* ``GET  /api/agent-harnesses`` (huggingface_hub's user-agent registry; answered empty)
* ``POST /api/models/{repo}/commit/{rev}`` (NDJSON; ``create_pr=1`` opens ``refs/pr/N``)

Writes need ``Authorization: Bearer <token>`` with the server's token. Every request is recorded
(method, path, status, uploaded object) so tests can assert what was sent; ``fail_put`` and
``stall_put`` interrupt an upload (a 403 answer, or a PUT held open until the client is killed).
Anything else answers 404 and is recorded, so a missing endpoint shows up in ``unknown``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".model", ".tiktoken")
LFS_THRESHOLD = 10 * 1024 * 1024  # the Hub stores files of 10 MB or more with LFS


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Blob:
    size: int
    git_oid: str
    lfs_sha256: str | None = None  # LFS files: the content's SHA-256
    data: bytes | None = None  # regular files: the content


@dataclass
class Commit:
    oid: str
    parent: str | None
    ref: str
    summary: str
    description: str
    tree: dict[str, Blob]
    added: list[str]


@dataclass
class Repo:
    repo_id: str
    private: bool | None
    refs: dict[str, str] = field(default_factory=dict)  # "main", "dev", "refs/pr/1" -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content (uploaded, committed or not)
    prs: int = 0

    def tree(self, ref: str) -> dict[str, Blob] | None:
        oid = self.refs.get(ref)
        return None if oid is None else self.commits[oid].tree

    def file(self, path: str, ref: str = "main") -> bytes | None:
        """The content of ``path`` at ``ref`` (LFS files resolved from the store)."""
        tree = self.tree(ref)
        b = tree.get(path) if tree else None
        if b is None:
            return None
        return b.data if b.lfs_sha256 is None else self.lfs[b.lfs_sha256]

    def history(self, ref: str = "main") -> list[Commit]:
        """Commits reachable from ``ref``, oldest first."""
        out, oid = [], self.refs.get(ref)
        while oid:
            out.append(self.commits[oid])
            oid = self.commits[oid].parent
        return out[::-1]


@dataclass
class Request:
    method: str
    path: str
    status: int
    lfs_oid: str | None = None  # PUT of an LFS object
    body_bytes: int = 0


class HubState:
    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.unknown: list[str] = []
        self.auth_seen: list[str] = []  # Authorization headers as received
        self.fail_put: set[int] = set()  # 1-based indices of LFS PUTs to answer 403 (not retried)
        self.stall_put: set[int] = set()  # 1-based indices of LFS PUTs to hold open until `release`
        self.stalled = threading.Event()  # set when a PUT is being held
        self.release = threading.Event()
        self.puts = 0
        self.lock = threading.RLock()
        self._n = 0

    def oid(self) -> str:
        with self.lock:
            self._n += 1
            return hashlib.sha1(f"commit-{self._n}".encode()).hexdigest()

    def puts_of(self, sha256: str, ok_only: bool = True) -> int:
        return sum(1 for r in self.requests if r.method == "PUT" and r.lfs_oid == sha256 and (r.status == 200 or not ok_only))


REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("GET", re.compile(rf"^/api/models/{REPO}/revision/(?P<rev>[^/]+)$"), "repo_info"),
    ("POST", re.compile(rf"^/api/models/{REPO}/branch/(?P<rev>[^/]+)$"), "create_branch"),
    ("POST", re.compile(rf"^/api/models/{REPO}/paths-info/(?P<rev>[^/]+)$"), "paths_info"),
    ("POST", re.compile(rf"^/api/models/{REPO}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/models/{REPO}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("POST", re.compile(rf"^/{REPO}\.git/info/lfs/objects/batch$"), "lfs_batch"),
    ("PUT", re.compile(rf"^/_lfs/{REPO}/(?P<oid>[0-9a-f]{{64}})$"), "lfs_put"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("GET", re.compile(r"^/api/agent-harnesses$"), "agent_harnesses"),
]
WRITES = {"create_repo", "create_branch", "preupload", "commit", "lfs_batch"}  # the LFS PUT URL is pre-signed, as S3's


def _handler(state: HubState):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        # -- plumbing -------------------------------------------------------------------------
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _send(self, code: int, doc=None, headers: dict | None = None) -> int:
            body = json.dumps(doc if doc is not None else {}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
            return code

        def _error(self, code: int, msg: str, error_code: str | None = None) -> int:
            return self._send(code, {"error": msg}, {"X-Error-Message": msg, **({"X-Error-Code": error_code} if error_code else {})})

        def _route(self, method: str):
            url = urlsplit(self.path)
            self.query = parse_qs(url.query)
            for m, rx, name in ROUTES:
                if m == method and (match := rx.match(url.path)):
                    return name, {k: unquote(v) for k, v in match.groupdict().items()}
            return None, {}

        def _dispatch(self, method: str):
            name, args = self._route(method)
            rec = Request(method, self.path, 0)
            auth = self.headers.get("Authorization")
            if auth:
                state.auth_seen.append(auth)
            try:
                if name is None:
                    self._body()
                    state.unknown.append(f"{method} {self.path}")
                    rec.status = self._error(404, f"no such endpoint: {method} {urlsplit(self.path).path}")
                elif name in WRITES and auth != f"Bearer {state.token}":
                    self._body()
                    rec.status = self._error(401, "Invalid credentials in Authorization header")
                else:
                    rec.status = getattr(self, name)(rec, **args)
            finally:
                with state.lock:
                    state.requests.append(rec)

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        def do_PUT(self):
            self._dispatch("PUT")

        def _repo(self, repo_id: str) -> Repo | None:
            return state.repos.get(repo_id)

        def _base(self) -> str:
            return f"http://{self.headers['Host']}"

        # -- endpoints ------------------------------------------------------------------------
        def create_repo(self, rec):
            req = json.loads(self._body() or b"{}")
            repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else f"user/{req['name']}"
            with state.lock:
                if repo_id in state.repos:  # the Hub names the repo's URL in its 409 too
                    msg = "You already created this model repo"
                    return self._send(409, {"error": msg, "url": f"{self._base()}/{repo_id}"}, {"X-Error-Message": msg})
                repo = state.repos[repo_id] = Repo(repo_id, {"private": True, "public": False}.get(req.get("visibility")))
                ga = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
                oid = state.oid()
                repo.commits[oid] = Commit(oid, None, "main", "initial commit", "", {".gitattributes": Blob(len(ga), git_blob_oid(ga), data=ga)}, [".gitattributes"])
                repo.refs["main"] = oid
            return self._send(200, {"url": f"{self._base()}/{repo_id}", "name": repo_id, "id": repo_id})

        def repo_info(self, rec, repo, rev):
            r = self._repo(repo)
            if r is None:
                return self._error(404, "Repository not found", "RepoNotFound")
            if rev not in r.refs:
                return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            tree = r.tree(rev)
            return self._send(200, {"id": repo, "modelId": repo, "sha": r.refs[rev], "private": bool(r.private),
                                    "siblings": [{"rfilename": p} for p in sorted(tree)]})

        def create_branch(self, rec, repo, rev):
            req = json.loads(self._body() or b"{}")
            r = self._repo(repo)
            if r is None:
                return self._error(404, "Repository not found", "RepoNotFound")
            if rev in r.refs:
                return self._error(409, "Reference already exists")
            start = req.get("startingPoint") or "main"
            r.refs[rev] = r.refs.get(start) or r.refs["main"]
            return self._send(200, {})

        def paths_info(self, rec, repo, rev):
            form = parse_qs(self._body().decode())
            r = self._repo(repo)
            if r is None:
                return self._error(404, "Repository not found", "RepoNotFound")
            tree = r.tree(rev)
            if tree is None:
                return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            out = []
            for p in form.get("paths", []):
                b = tree.get(p)
                if b is not None:
                    d = {"type": "file", "path": p, "size": b.size, "oid": b.git_oid}
                    if b.lfs_sha256:
                        d["lfs"] = {"oid": b.lfs_sha256, "size": b.size, "pointerSize": 134}
                    out.append(d)
            return self._send(200, out)

        def preupload(self, rec, repo, rev):
            req = json.loads(self._body())
            r = self._repo(repo)
            if r is None:
                return self._error(404, "Repository not found", "RepoNotFound")
            tree = r.tree(rev)
            if tree is None:
                return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            files = []
            for f in req["files"]:
                sample = base64.b64decode(f["sample"])
                lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_THRESHOLD or b"\0" in sample
                b = tree.get(f["path"])
                remote = None if b is None else (b.lfs_sha256 or b.git_oid)
                files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": remote})
            return self._send(200, {"files": files, "commitOid": r.refs[rev]})

        def lfs_batch(self, rec, repo):
            req = json.loads(self._body())
            r = self._repo(repo)
            if r is None:
                return self._error(404, "Repository not found", "RepoNotFound")
            objs = []
            for o in req["objects"]:
                d = {"oid": o["oid"], "size": o["size"]}
                if o["oid"] not in r.lfs:  # already stored (committed or not): no action, nothing is sent
                    d["actions"] = {"upload": {"href": f"{self._base()}/_lfs/{repo}/{o['oid']}", "header": {}}}
                objs.append(d)
            return self._send(200, {"transfer": "basic", "objects": objs})

        def lfs_put(self, rec, repo, oid):
            with state.lock:
                state.puts += 1
                n = state.puts
            rec.lfs_oid = oid
            if n in state.stall_put:  # hold the upload open; the test kills the client meanwhile
                state.stalled.set()
                state.release.wait(60)
                self.close_connection = True
                return 0
            data = self._body()
            rec.body_bytes = len(data)
            if n in state.fail_put:
                return self._error(403, "upload refused (test: interrupted upload)")
            if hashlib.sha256(data).hexdigest() != oid:
                return self._error(400, "content does not match its oid")
            r = self._repo(repo)
            if r is None:
                return self._error(404, "Repository not found", "RepoNotFound")
            r.lfs[oid] = data
            return self._send(200, {})

        def agent_harnesses(self, rec):  # huggingface_hub's user-agent registry: an empty one
            return self._send(200, {"standardEnvVars": [], "harnesses": {}})

        def validate_yaml(self, rec):
            import yaml

            req = json.loads(self._body())
            text = req.get("content", "")
            m = re.match(r"^---\s*\n(.*?)\n---\s*\n", text, re.S)
            try:
                meta = yaml.safe_load(m.group(1)) if m else {}
            except yaml.YAMLError as e:
                return self._send(400, {"errors": [{"message": str(e)}]})
            if m and not isinstance(meta, dict):
                return self._send(400, {"errors": [{"message": "metadata must be a mapping"}]})
            return self._send(200, {"errors": [], "warnings": []})

        def commit(self, rec, repo, rev):
            lines = [json.loads(x) for x in self._body().splitlines() if x.strip()]
            r = self._repo(repo)
            if r is None:
                return self._error(404, "Repository not found", "RepoNotFound")
            if rev not in r.refs:
                return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            header = next(x["value"] for x in lines if x["key"] == "header")
            with state.lock:
                tree = dict(r.tree(rev))
                added = []
                for x in lines:
                    v = x["value"]
                    if x["key"] == "file":
                        data = base64.b64decode(v["content"])
                        tree[v["path"]] = Blob(len(data), git_blob_oid(data), data=data)
                    elif x["key"] == "lfsFile":
                        if v["oid"] not in r.lfs:
                            return self._error(422, f"LFS object {v['oid']} of {v['path']} was never uploaded")
                        tree[v["path"]] = Blob(len(r.lfs[v["oid"]]), git_blob_oid(b"lfs " + v["oid"].encode()), lfs_sha256=v["oid"])
                    elif x["key"] in ("deletedFile", "deletedFolder"):
                        tree.pop(v["path"], None)
                        continue
                    else:
                        continue
                    added.append(v["path"])
                create_pr = self.query.get("create_pr") == ["1"]
                ref = rev
                if create_pr:
                    r.prs += 1
                    ref = f"refs/pr/{r.prs}"
                oid = state.oid()
                r.commits[oid] = Commit(oid, r.refs[rev], ref, header["summary"], header.get("description", ""), tree, added)
                r.refs[ref] = oid
            doc = {"commitUrl": f"{self._base()}/{repo}/commit/{oid}", "commitOid": oid}
            if create_pr:
                doc["pullRequestUrl"] = f"{self._base()}/{repo}/discussions/{r.prs}"
            return self._send(200, doc)

    return H


@contextmanager
def serve(token: str):
    """A fresh Hub on 127.0.0.1 (a free port); yields (base URL, HubState); stops after."""
    state = HubState(token)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", state
    finally:
        state.release.set()
        srv.shutdown()
        srv.server_close()
        t.join(timeout=10)
