#!/usr/bin/env python3
"""Seconds to the error (issue 18 item 4, fail fast), on DeepSeek-V3's real widths.

Builds a DeepSeek-V3 checkpoint with ``make-tiny`` at hidden 7168, moe_intermediate 2048,
intermediate 18432, block FP8, three layers (a dense one, two MoE), 16 routed experts (about 2.9 GB),
then two broken copies (hard links, so the shards are not duplicated): one without its tokenizer,
one missing a routed expert's ``down_proj`` in the last layer. Times each command to its one-line
error, each in its own process (imports included, page cache warm after the first):

- calibrate-kv SRC --samples 2 --seq-len 16 (the issue's command)
- convert SRC OUT --method gptq --samples 2 --seq-len 16
- run RECIPE (stages convert, calibrate-kv) on the tokenizer-less copy

``--before CHECKOUT`` also times another checkout of the tool (e.g. ``git worktree add --detach
/tmp/old b7fa15d``) and prints both side by side. Not a test.

    python scripts/bench_fail_fast.py [--before /tmp/old] [--work /tmp/ff-bench] [--experts 16] [--repeat 3]
                                      [--only "no tokenizer"] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")
INDEX = "model.safetensors.index.json"


def build(src: Path, a) -> None:
    if (src / "quantize_manifest.json").exists():
        return  # made by an earlier run of this script (--keep)
    from quantize.testing.tiny import make_tiny

    t = time.time()
    make_tiny("deepseek_v3", src, layout="fp8", overrides={
        "hidden_size": a.hidden, "moe_intermediate_size": a.moe_intermediate, "intermediate_size": a.intermediate,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": a.experts})
    print(f"fixture {src}: {sum(p.stat().st_size for p in src.glob('*.safetensors')) / 2**30:.2f} GiB "
          f"in {time.time() - t:.0f} s", flush=True)


def linked_copy(src: Path, dst: Path) -> Path:
    """``dst``: every file of ``src`` hard-linked (a file to change is unlinked first, never written through)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def without_tensors(folder: Path, names: list[str]) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    idx = json.loads((folder / INDEX).read_text())
    for name in names:
        p = folder / idx["weight_map"].pop(name)
        with safe_open(p, "pt") as f:
            kept = {k: f.get_tensor(k) for k in f.keys() if k != name}
        p.unlink()  # a hard link to the fixture: a new file, not the shared one rewritten
        save_file(kept, str(p), metadata={"format": "pt"})
        del kept
    (folder / INDEX).unlink()
    (folder / INDEX).write_text(json.dumps(idx, indent=2))


def recipe(path: Path, src: Path, out: Path) -> Path:
    import yaml

    doc = yaml.safe_load((HERE / "quantize" / "recipes_default" / "tiny-glm.yaml").read_text())
    doc["pipeline"].update(source=str(src), out=str(out), stages=["convert", "calibrate-kv"],
                           kv={"target": "sglang", "samples": 2, "seq_len": 16})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def timed(tree: Path, argv: list[str], outs: list[Path], timeout: float) -> tuple[float, str]:
    for o in outs:
        shutil.rmtree(o, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "quantize.cli", *map(str, argv)], env=env, capture_output=True,
                           text=True, timeout=timeout, cwd=tree)  # `-m` puts the working folder first on sys.path
        lines = [x for x in p.stderr.splitlines() if x.startswith("error:")] or p.stderr.splitlines()[-1:]
        msg = f"exit {p.returncode}: {lines[-1] if lines else ''}"
    except subprocess.TimeoutExpired:
        msg = f"no error within {timeout:.0f} s"
    dt = time.time() - t
    for o in outs:
        shutil.rmtree(o, ignore_errors=True)
    return dt, msg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="another checkout of the tool, timed beside this one")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ff-bench"))
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--moe-intermediate", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=18432)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1, help="runs per command (the median is shown)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a command may take to fail")
    ap.add_argument("--only", default="", help="time only the cases whose name holds this text")
    ap.add_argument("--keep", action="store_true", help="keep the fixture and its copies in --work")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    w = a.work
    w.mkdir(parents=True, exist_ok=True)
    src = w / "dsv3"
    build(src, a)
    notok = linked_copy(src, w / "notok")
    for f in TOKENIZER:
        (notok / f).unlink()
    missing = linked_copy(src, w / "missing")
    down = f"model.layers.2.mlp.experts.{a.experts - 1}.down_proj.weight"
    without_tensors(missing, [down, down + "_scale_inv"])
    out, run = w / "out", w / "run"
    cases = [
        ("no tokenizer: calibrate-kv", ["calibrate-kv", notok, "--samples", "2", "--seq-len", "16"]),
        ("no tokenizer: convert --method gptq", ["convert", notok, out, "--method", "gptq", "--samples", "2",
                                                 "--seq-len", "16"]),
        ("no tokenizer: run (convert, calibrate-kv)", ["run", recipe(w / "r.yaml", notok, run)]),
        (f"missing {down.split('layers.')[1]}: calibrate-kv", ["calibrate-kv", missing, "--samples", "2",
                                                               "--seq-len", "16"]),
        (f"missing {down.split('layers.')[1]}: convert --method gptq", ["convert", missing, out, "--method", "gptq",
                                                                        "--samples", "2", "--seq-len", "16"]),
    ]
    cases = [c for c in cases if a.only in c[0]]
    trees = [("before", a.before.resolve())] if a.before else []
    trees.append(("after", HERE))
    rows = []
    for name, argv in cases:
        row = [name]
        for label, tree in trees:
            runs = [timed(tree, argv, [out, run], a.timeout) for _ in range(a.repeat)]
            row += [statistics.median(t for t, _ in runs), runs[-1][1]]
            print(f"{label:6} {row[-2]:8.1f} s  {name}  ({runs[-1][1][:160]})", flush=True)
        rows.append(row)
    print()
    head = "| case | " + " | ".join(f"{label} (s)" for label, _ in trees) + " |"
    print(head + "\n|" + "---|" * (len(trees) + 1))
    for row in rows:
        print(f"| {row[0]} | " + " | ".join(f"{row[1 + 2 * i]:.1f}" for i in range(len(trees))) + " |")
    if not a.keep:
        shutil.rmtree(w, ignore_errors=True)


if __name__ == "__main__":
    main()
