"""quantize push against a Hub on loopback (tests/hub_server.py, reached through HF_ENDPOINT): the
files and commits that arrive, the card, pre-flight refusals that send nothing, the token nowhere
but the request headers, and resumption that does not send finished files again."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from quantize.check import verify_files
from quantize.errors import QuantizeError
from quantize.publish.push import push

from .hub_server import serve

TOKEN = "hf_SeCrEtToKeN123"
REPO = "test-org/glm-int4"
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


@pytest.fixture
def folder(converted, tmp_path):
    d = tmp_path / "glm-int4"
    shutil.copytree(converted("glm_moe_dsa", group_size=32), d)
    return d


@pytest.fixture
def hub():
    with serve(TOKEN) as (url, state):
        yield url, state


def _env(url: str, tmp_path: Path, token: str | None = TOKEN) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE")}
    env.update(HF_ENDPOINT=url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf-home"))
    if token:
        env["HF_TOKEN"] = token
    return env


def _quantize(args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantize.cli", *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def inproc(monkeypatch, tmp_path):
    """push() in this process: the conftest's offline switch off, LFS transfer, an empty HF_HOME."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def use(url: str) -> None:
        monkeypatch.setenv("HF_ENDPOINT", url)

    return use


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("\n---\n", 1)[0][4:])


def _token_nowhere(folder: Path, state, *outputs: str) -> None:
    """The token is in no output, no file of the folder (records included), no file or commit
    message the Hub received; it did reach the Hub, in the Authorization header only."""
    for out in outputs:
        assert TOKEN not in out
    for p in folder.rglob("*"):
        if p.is_file():
            assert TOKEN.encode() not in p.read_bytes(), p
    for repo in state.repos.values():
        for c in repo.commits.values():
            assert TOKEN not in c.summary + c.description
            for path in c.tree:
                assert TOKEN.encode() not in (repo.file(path, c.ref) or b""), path
    assert f"Bearer {TOKEN}" in state.auth_seen


def _main_files(state, repo=REPO, ref="main") -> dict[str, bytes]:
    r = state.repos[repo]
    return {p: r.file(p, ref) for p in r.tree(ref)}


def test_dry_run_lists_files_and_bytes_needs_no_token_and_sends_nothing(folder, tmp_path):
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    r = _quantize(["push", folder, REPO, "--dry-run"], _env("http://127.0.0.1:9", tmp_path, token=None))  # nothing listens there
    assert r.returncode == 0, r.stderr
    manifest = json.loads((folder / "quantize_manifest.json").read_text())
    lines = dict(line.rsplit(None, 2)[:2] for line in r.stdout.splitlines() if line.endswith(" B"))
    expect = set(manifest["files"]) | {"quantize_manifest.json", "README.md"}
    assert set(lines) == expect
    for name in expect - {"README.md"}:
        assert int(lines[name].replace(",", "")) == (folder / name).stat().st_size
    total = sum(int(v.replace(",", "")) for v in lines.values())
    assert f"{len(expect)} files, {total:,} bytes" in r.stdout and "nothing was sent" in r.stdout
    assert "README.md: would be generated" in r.stdout
    assert not any(".quantize" in k for k in lines)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before  # writes nothing, not even the lock


def test_push_sends_proven_files_and_card_token_only_in_headers(folder, hub, tmp_path):
    url, state = hub
    (folder / "notes.txt").write_text("scratch")  # not proven by the manifest: stays home
    r = _quantize(["push", folder, REPO, "--private", "--message", "first INT4 upload"], _env(url, tmp_path))
    assert r.returncode == 0, r.stderr
    assert state.unknown == []
    repo = state.repos[REPO]
    assert repo.private is True
    files = _main_files(state)
    manifest = json.loads((folder / "quantize_manifest.json").read_text())
    assert set(files) == set(manifest["files"]) | {"quantize_manifest.json", "README.md", ".gitattributes"}
    for name, data in files.items():
        if name != ".gitattributes":
            assert data == (folder / name).read_bytes(), name
    assert not any(p.startswith(".quantize") or p.endswith(".partial") or p == "notes.txt" for p in files)
    assert "notes.txt" in r.stderr  # named as not uploaded
    # one commit on top of the repo's first, with the message; the weights as LFS objects
    hist = repo.history()
    assert [c.summary for c in hist[1:]] == ["first INT4 upload"]
    assert set(hist[-1].added) == set(files) - {".gitattributes"}
    assert all(repo.tree("main")[s].lfs_sha256 == manifest["files"][s]["sha256"] for s in SHARDS)
    # the card: generated, the same on the Hub as at home, its metadata what the Hub reads
    card = files["README.md"].decode()
    assert card == (folder / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["library_name"] == "transformers" and "int4" in meta["tags"] and "compressed-tensors" in meta["tags"]
    assert "base_model" not in meta  # a local source: the card says why instead
    assert "base_model is not set" in card and "pass --base-model REPO" in card
    assert f"--model-path {REPO} " in card and "--kv-cache-dtype fp8_e4m3" in card
    # the folder still proves every file (the manifest now records the card)
    assert verify_files(folder)[0] == []
    _token_nowhere(folder, state, r.stdout, r.stderr)
    # pushing again sends nothing: every file is on the Hub with our content
    n = len(state.requests)
    r2 = _quantize(["push", folder, REPO], _env(url, tmp_path))
    assert r2.returncode == 0, r2.stderr
    assert not [q for q in state.requests[n:] if q.method == "PUT" or "/commit/" in q.path]
    assert "pushed 0 files" in r2.stdout and f"{len(files) - 1} already on the Hub" in r2.stdout


def test_interrupted_push_resumes_without_resending_committed_files(folder, hub, tmp_path):
    url, state = hub
    state.fail_put = {2}  # the second shard's upload is refused: the run stops there
    env = _env(url, tmp_path)
    r = _quantize(["push", folder, REPO, "--batch-gib", "0.001"], env)  # one shard per commit
    assert r.returncode == 2
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "rerun the same command to resume" in err[0] and SHARDS[1] in err[0]
    assert "Traceback" not in r.stderr
    repo = state.repos[REPO]
    assert set(repo.tree("main")) == {".gitattributes", SHARDS[0]}  # the first commit stands
    r = _quantize(["push", folder, REPO, "--batch-gib", "0.001"], env)
    assert r.returncode == 0, r.stderr
    man = json.loads((folder / "quantize_manifest.json").read_text())["files"]
    assert state.puts_of(man[SHARDS[0]]["sha256"], ok_only=False) == 1  # never sent again
    assert state.puts_of(man[SHARDS[1]]["sha256"], ok_only=False) == 2  # refused once, then sent
    assert state.puts_of(man[SHARDS[2]]["sha256"], ok_only=False) == 1
    assert [c.summary.rsplit(" ", 1)[-1] for c in repo.history()[1:]] == ["(1/3)", "(2/3)", "(3/3)"]
    files = _main_files(state)
    assert all(files[n] == (folder / n).read_bytes() for n in [*man, "quantize_manifest.json"])
    _token_nowhere(folder, state, r.stdout, r.stderr)


def test_upload_not_yet_committed_is_not_sent_again(folder, hub, tmp_path):
    """One commit for everything; the run stops at the second shard, after the first was uploaded
    but before any commit: the rerun's LFS batch finds the first stored and does not send it."""
    url, state = hub
    state.fail_put = {2}  # huggingface_hub uploads a commit's files in parallel: which one fails varies
    env = _env(url, tmp_path)
    assert _quantize(["push", folder, REPO], env).returncode == 2
    assert set(state.repos[REPO].tree("main")) == {".gitattributes"}
    stored = {q.lfs_oid for q in state.requests if q.method == "PUT" and q.status == 200}
    failed = {q.lfs_oid for q in state.requests if q.method == "PUT" and q.status == 403}
    assert stored and len(failed) == 1
    r = _quantize(["push", folder, REPO], env)
    assert r.returncode == 0, r.stderr
    for oid in stored:  # uploaded before the interruption: never sent again
        assert state.puts_of(oid, ok_only=False) == 1
    assert state.puts_of(failed.pop(), ok_only=False) == 2
    assert len(state.repos[REPO].history()) == 2  # the repo's first commit and ours
    assert all(_main_files(state)[s] == (folder / s).read_bytes() for s in SHARDS)


def test_killed_push_resumes_without_resending(folder, hub, tmp_path):
    url, state = hub
    state.stall_put = {2}  # hold the second shard's upload open, then kill the process mid-upload
    env = _env(url, tmp_path)
    cmd = [sys.executable, "-m", "quantize.cli", "push", str(folder), REPO, "--batch-gib", "0.001"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert state.stalled.wait(180), "the upload never started"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        state.release.set()
    out, err = (x.decode() for x in p.communicate(timeout=30))
    assert set(state.repos[REPO].tree("main")) == {".gitattributes", SHARDS[0]}
    assert json.loads((folder / ".quantize" / "push.json").read_text())["commits"][0]["files"].keys() == {SHARDS[0]}
    r = _quantize(["push", folder, REPO, "--batch-gib", "0.001"], env)
    assert r.returncode == 0, r.stderr
    man = json.loads((folder / "quantize_manifest.json").read_text())["files"]
    assert state.puts_of(man[SHARDS[0]]["sha256"], ok_only=False) == 1
    assert "2 already on the Hub" not in r.stdout and "1 already on the Hub" in r.stdout
    assert all(_main_files(state)[s] == (folder / s).read_bytes() for s in SHARDS)
    _token_nowhere(folder, state, out, err, r.stdout, r.stderr)


def test_create_pr_and_its_resume_continue_one_pull_request(folder, hub, tmp_path):
    url, state = hub
    state.fail_put = {2}
    env = _env(url, tmp_path)
    assert _quantize(["push", folder, REPO, "--create-pr", "--batch-gib", "0.001"], env).returncode == 2
    r = _quantize(["push", folder, REPO, "--create-pr", "--batch-gib", "0.001"], env)
    assert r.returncode == 0, r.stderr
    repo = state.repos[REPO]
    assert repo.prs == 1 and "/discussions/1" in r.stdout
    assert set(repo.tree("main")) == {".gitattributes"}  # main untouched
    pr = _main_files(state, ref="refs/pr/1")
    assert all(pr[s] == (folder / s).read_bytes() for s in SHARDS) and "README.md" in pr
    assert json.loads((folder / ".quantize" / "push.json").read_text())["pr_revision"] == "refs/pr/1"


def test_revision_branch_and_user_card_in_process(folder, hub, inproc):
    url, state = hub
    inproc(url)
    (folder / "README.md").write_text("# my own card\n\nwritten by me\n")
    res = push(folder, REPO, revision="w4a16-g32")
    assert res.card.startswith("README.md: the card you wrote")
    assert (folder / "README.md").read_text() == "# my own card\n\nwritten by me\n"  # never overwritten
    assert state.repos[REPO].file("README.md", "w4a16-g32") == b"# my own card\n\nwritten by me\n"
    assert set(state.repos[REPO].tree("main")) == {".gitattributes"}
    assert all(state.repos[REPO].file(s, "w4a16-g32") == (folder / s).read_bytes() for s in SHARDS)
    assert res.sent_bytes == res.total_bytes == sum((folder / f.path).stat().st_size for f in res.files)


def test_base_model_on_push_reaches_the_card_on_the_hub_and_stays_for_the_next_push(folder, hub, inproc):
    url, state = hub
    inproc(url)
    push(folder, REPO, base_model="zai-org/GLM-5-FP8")
    card = state.repos[REPO].file("README.md", "main").decode()
    assert card == (folder / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["base_model"] == "zai-org/GLM-5-FP8" and meta["base_model_relation"] == "quantized"
    assert "base_model is not set" not in card
    # a push without it regenerates the same card (card.json keeps it): nothing new to send
    n = len(state.requests)
    res = push(folder, REPO)
    assert _front_matter((folder / "README.md").read_text())["base_model"] == "zai-org/GLM-5-FP8"
    assert not [q for q in state.requests[n:] if q.method == "PUT" or "/commit/" in q.path]
    assert all(f.status == "on the Hub already" for f in res.files)
    # the near miss: another one replaces it on the Hub
    push(folder, REPO, base_model="zai-org/GLM-5")
    assert _front_matter(state.repos[REPO].file("README.md", "main").decode())["base_model"] == "zai-org/GLM-5"


def test_preflight_refuses_tampered_or_incomplete_folders_before_any_request(folder, hub, tmp_path, inproc):
    url, state = hub
    inproc(url)
    # a flipped byte in a shard's data: named, with exit 2 and one line from the CLI
    shard = folder / SHARDS[1]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = _quantize(["push", folder, REPO], _env(url, tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and SHARDS[1] in r.stderr and "SHA-256" in r.stderr
    assert "nothing was pushed" in r.stderr
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    # a missing shard: the index names it
    moved = shard.rename(folder.parent / "away.safetensors")
    with pytest.raises(QuantizeError, match=SHARDS[1]):
        push(folder, REPO)
    moved.rename(shard)
    # a broken config.json
    cfg = (folder / "config.json").read_text()
    (folder / "config.json").write_text(cfg[:-20])
    with pytest.raises(QuantizeError, match="config.json"):
        push(folder, REPO)
    (folder / "config.json").write_text(cfg)
    # an unrecorded weight file
    (folder / "extra.safetensors").write_bytes((folder / SHARDS[0]).read_bytes())
    with pytest.raises(QuantizeError, match="extra.safetensors"):
        push(folder, REPO)
    (folder / "extra.safetensors").unlink()
    # not a quantize output at all
    (folder / "quantize_manifest.json").rename(folder.parent / "m.json")
    with pytest.raises(QuantizeError, match="not a finished quantize output"):
        push(folder, REPO)
    assert state.requests == []  # nothing reached the Hub
    assert not (folder / "README.md").exists()


def test_token_and_repo_id_errors_are_one_line(folder, inproc, monkeypatch):
    for bad in ("a/b/c", "org/bad--name", "no-namespace", "org/.hidden"):
        with pytest.raises(QuantizeError, match="REPO_ID"):
            push(folder, bad)
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(QuantizeError, match="hf auth login") as e:
        push(folder, REPO)
    assert "\n" not in str(e.value) and "HF_TOKEN" in str(e.value)
    assert push(folder, REPO, dry_run=True).dry_run  # a dry run needs no token
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(QuantizeError, match="HF_HUB_OFFLINE"):
        push(folder, REPO)


def test_unreachable_hub_is_one_line_without_token(folder, inproc, monkeypatch):
    inproc("http://127.0.0.1:9")
    from huggingface_hub.utils import _http

    monkeypatch.setattr(_http.time, "sleep", lambda s: None)  # the client's own retries, without their waits
    t = time.time()
    with pytest.raises(QuantizeError, match="rerun the same command") as e:
        push(folder, REPO)
    assert TOKEN not in str(e.value) and "\n" not in str(e.value) and time.time() - t < 120


def _private(tmp_path: Path) -> tuple[list[bytes], list[re.Pattern]]:
    """What names this machine: the test's own folder and each of its parents under /tmp (they hold
    the user name: /tmp/pytest-of-USER/...), the home folder as a path, and patterns for the user name
    as a path component and the host name as a word (when it is not trivially short)."""
    import getpass
    import socket

    paths = {str(p) for t in (tmp_path, tmp_path.resolve()) for p in (t, *t.parents)
             if p.is_relative_to("/tmp") and len(p.parts) > 2}
    home = os.path.expanduser("~")
    if len(Path(home).parts) >= 2:
        paths.add(home.rstrip("/") + "/")
    user, host = getpass.getuser(), socket.gethostname()
    pats = [re.compile(rb"[/\\]" + re.escape(user.encode()) + rb"(?=[/\\\"'\s]|$)")]
    if len(host) >= 4:
        pats.append(re.compile(rb"(?<![\w.-])" + re.escape(host.encode()) + rb"(?![\w-])", re.I))
    return sorted(p.encode() for p in paths), pats


def _uploaded(state) -> list[tuple[str, bytes, bool]]:
    """(what, bytes, text?) of everything the Hub received: repo ids, commit messages, every file of
    every commit (an LFS file's content from the store; for weights the header is the text part)."""
    out = []
    for rid, repo in state.repos.items():
        out.append((f"repo id {rid}", rid.encode(), True))
        for c in repo.commits.values():
            out.append((f"{rid} commit message", (c.summary + "\n" + c.description).encode(), True))
            for path, b in c.tree.items():
                data = b.data if b.lfs_sha256 is None else repo.lfs[b.lfs_sha256]
                if path.endswith(".safetensors"):
                    n = int.from_bytes(data[:8], "little")
                    out.append((f"{rid}:{path} header", data[: 8 + n], True))
                    out.append((f"{rid}:{path}", data, False))
                else:
                    out.append((f"{rid}:{path}", data, True))
        out += [(f"{rid} LFS object {k[:12]}", v, False) for k, v in repo.lfs.items()]
    return out


def test_a_full_run_pushed_names_nothing_of_this_machine(hub, tmp_path):
    """make-tiny, convert, calibrate-kv, shard, check, eval (a smoke test) and card (`quantize run`),
    then a real push of its model; and a calibrate-kv --out checkpoint with its --stats-out report on the
    card: no uploaded byte holds this test's folder (or a parent of it under /tmp), the home folder,
    the user name as a path component or the host name."""
    url, state = hub
    env = _env(url, tmp_path)
    run = tmp_path / "run"
    r = _quantize(["run", "--out", run], env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _quantize(["push", run / "model", "test-org/tiny-run"], env)
    assert r.returncode == 0, r.stderr
    src, conv, kv = tmp_path / "ds", tmp_path / "ds-int4", tmp_path / "ds-kv"
    chain = [["make-tiny", "deepseek_v3", src], ["convert", src, conv, "--base-model", "deepseek-ai/DeepSeek-V3"],
             ["calibrate-kv", conv, "--out", kv, "--target", "compressed-tensors", "--samples", "2", "--seq-len", "16",
              "--stats-out", tmp_path / "kv.json"], ["card", kv, "--eval", tmp_path / "kv.json"],
             ["push", kv, "test-org/tiny-kv"]]
    # the commands as typed, in one process (torch imported once): sys.argv is what each records
    script = ("import json, sys\nfrom quantize.cli import app\nfor a in json.loads(sys.argv[1]):\n"
              "    sys.argv = ['quantize', *a]\n    try:\n        app(a, prog_name='quantize')\n"
              "    except SystemExit as e:\n        assert not e.code, (a, e.code)\n")
    r = subprocess.run([sys.executable, "-c", script, json.dumps([[str(x) for x in a] for a in chain])], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert set(state.repos) == {"test-org/tiny-run", "test-org/tiny-kv"}
    sent = _uploaded(state)
    assert sum(len(d) for _, d, _ in sent) > 16 << 20  # the weights are there, grepped too
    paths, pats = _private(tmp_path)
    # not vacuous: the job record, which stays home, does hold this machine's path of the source
    assert str((run / "source").resolve()).encode() in (run / "model" / ".quantize" / "job.json").read_bytes()
    for what, data, text in sent:
        for p in paths:
            assert p not in data, (what, p)
        for pat in pats if text else []:
            assert not pat.search(data), (what, pat.pattern, pat.search(data))
    # what the records say instead: the source by name, the recipe by name and SHA-256, the command typed
    m = json.loads(state.repos["test-org/tiny-run"].file("quantize_manifest.json"))
    assert m["source"]["name"] == "source" and "path" not in m["source"]
    assert m["command"] == "quantize run --out run"
    assert m["options"]["recipe"] == "tiny-glm.yaml" and len(m["options"]["recipe_sha256"]) == 64
    assert m["kernels"]["library"] is None or "/" not in m["kernels"]["library"]
    k = json.loads(state.repos["test-org/tiny-kv"].file("quantize_manifest.json"))
    assert k["source"]["name"] == "ds-int4" and k["report"].get("stats_path") in (None, "kv.json")
    assert k["command"].startswith("quantize calibrate-kv ") and str(tmp_path) not in k["command"]
    # the card still finds the conversion behind the calibrate-kv output (the job record keeps the path)
    card = state.repos["test-org/tiny-kv"].file("README.md").decode()
    assert "base_model: deepseek-ai/DeepSeek-V3" in card and "| source | `ds` |" in card
