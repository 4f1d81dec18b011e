"""Hostile input, the core commands (convert, plan, calibrate-kv, make-tiny, run): issue 8's
attacks on headers, indexes, snapshots and output folders, and issue 16's on options, calibration
data, statistics files and recipes. Each row: the command line, how its input was made hostile, the
fragment of its one-line error and its exit code; tests/hostile.py checks the one line, the absence
of a traceback and, by SHA-256, that no input changed."""

import json
import os
import re
import struct

import pytest

from tests.hostile import Case, edit_json, run_case

SHARD = "model-00002-of-00003.safetensors"


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _put(path, header, data, raw_header: bytes | None = None):
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def hdr(fn, shard=SHARD):
    """Setup: ``fn(header, data) -> (header, data)`` applied to a source shard."""

    def setup(ctx):
        p = ctx.src / shard
        h, d = _header(p)
        _put(p, *fn(h, d))

    return setup


def raw_hdr(text: bytes, shard=SHARD):
    def setup(ctx):
        p = ctx.src / shard
        _, d = _header(p)
        _put(p, None, d, raw_header=text)

    return setup


def first(h):
    return next(k for k in h if k != "__metadata__")


def _set(h, key, value):
    h[first(h)][key] = value
    return h


def cfg(fn):
    return lambda ctx: edit_json(ctx.src / "config.json", fn)


def idx(fn):
    return lambda ctx: edit_json(ctx.src / "model.safetensors.index.json", fn)


def write(rel, data, where="src"):
    def setup(ctx):
        p = getattr(ctx, where) / rel if where else ctx.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())

    return setup


def both(*setups):
    def setup(ctx):
        for s in setups:
            s(ctx)

    return setup


def convert(*extra):
    return lambda c: ["convert", c.src, c.new("o"), *extra]


def foreign_out(ctx):
    (ctx.tmp / "mine").mkdir()
    (ctx.tmp / "mine" / "precious.txt").write_text("x")


def out_symlink(ctx):
    (ctx.tmp / "real").mkdir()
    os.symlink(ctx.tmp / "real", ctx.tmp / "link")


def _fifo_for(path):
    path.unlink()
    os.mkfifo(path)


def _big_int_header(ctx):
    p = ctx.src / SHARD
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n].decode().replace('"shape":[', '"shape":[' + "1" * 5000 + ",", 1)
    _put(p, None, raw[8 + n :], raw_header=text.encode())


CASES = [
    # -- safetensors headers (issue 8) ---------------------------------------------------------------
    Case("header: length past the end", convert(), "does not fit", write(SHARD, struct.pack("<Q", 1 << 20) + b"{}")),
    Case("header: length over the format's limit", convert(), "exceeds the safetensors limit",
         write(SHARD, struct.pack("<Q", 1 << 40) + b"{}")),
    Case("header: not JSON", convert(), "not valid UTF-8 JSON", raw_hdr(b'{"a": ')),
    Case("header: not an object entry", convert(), "exactly dtype, shape and",
         hdr(lambda h, d: (_set(h, "extra", 1), d))),
    Case("header: unknown dtype", convert(), "not a safetensors dtype", hdr(lambda h, d: (_set(h, "dtype", "Q4"), d))),
    Case("header: negative shape", convert(), "non-negative integers",
         hdr(lambda h, d: (_set(h, "shape", [-1]), d))),
    Case("header: float offsets", convert(), "data_offsets", hdr(lambda h, d: (_set(h, "data_offsets", [0.0, 1.5]), d))),
    Case("header: trailing bytes", convert(), "trailing bytes", hdr(lambda h, d: (h, d + b"\0" * 16))),
    Case("header: truncated data", convert(), "truncated", hdr(lambda h, d: (h, d[:-64]))),
    Case("header: metadata not strings", convert(), "__metadata__ must be an object of strings",
         hdr(lambda h, d: ({**h, "__metadata__": {"format": 1}}, d))),
    Case("header: nested too deep", convert(), "nests too deep", raw_hdr(b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}")),
    Case("header: empty file", convert(), "too short", write(SHARD, b"")),
    # -- indexes -------------------------------------------------------------------------------------
    Case("index: entry outside the folder", convert(), "points outside",
         idx(lambda d: d["weight_map"].update({"lm_head.weight": "../x.safetensors"}))),
    Case("index: absolute entry", convert(), "points outside",
         idx(lambda d: d["weight_map"].update({"lm_head.weight": "/etc/passwd"}))),
    Case("index: missing shard", convert(), "missing", lambda c: (c.src / SHARD).unlink()),
    Case("index: weight_map not an object", convert(), "weight_map", idx(lambda d: {"weight_map": []})),
    Case("index: a tensor the header lacks", convert(), "its header does not",
         idx(lambda d: d["weight_map"].update({"model.ghost.weight": SHARD}))),
    Case("index: not UTF-8", convert(), "not UTF-8", write("model.safetensors.index.json", b"\xff{}")),
    Case("index: too big", convert(), "bytes, more than",
         lambda c: os.truncate(c.src / "model.safetensors.index.json", (256 << 20) + 1)),
    Case("source: dangling symlink shard", convert(), "dangling symlink",
         lambda c: ((c.src / SHARD).unlink(), os.symlink(c.tmp / "gone", c.src / SHARD))),
    Case("source: pickle only", lambda c: ["convert", c.tmp / "pkl", c.new("o")], "pickle",
         both(write("pkl/config.json", '{"architectures": ["LlamaForCausalLM"]}', None),
              write("pkl/pytorch_model.bin", b"\x80\x04", None)), needs=()),
    # -- config.json ---------------------------------------------------------------------------------
    Case("config: missing", convert(), "config.json: missing", lambda c: (c.src / "config.json").unlink()),
    Case("config: an array", convert(), "must be a JSON object", write("config.json", "[1]")),
    Case("config: architectures a string", convert(), "'architectures' must be a list",
         cfg(lambda d: d.update(architectures="GlmMoeDsaForCausalLM"))),
    Case("config: weight_block_size nonsense", convert(), "weight_block_size",
         cfg(lambda d: d["quantization_config"].update(weight_block_size=[0, 128]))),
    Case("config: deep", lambda c: ["plan", c.src], "nests deeper", write("config.json", '{"a":' + "[" * 500 + "]" * 500 + "}")),
    Case("config: fewer layers than the tensors", lambda c: ["plan", c.src], "holds layer 3",
         cfg(lambda d: d.update(num_hidden_layers=2))),
    Case("config: more layers than the tensors", lambda c: ["plan", c.src], "no tensors of layer 4",
         cfg(lambda d: d.update(num_hidden_layers=5))),
    Case("config: hidden_size not the embedding's", convert(), "hidden_size is 512",
         cfg(lambda d: d.update(hidden_size=512))),
    Case("config: vocab_size not the embedding's", convert(), "vocab_size is 4096",
         cfg(lambda d: d.update(vocab_size=4096))),
    Case("config: fewer experts than the tensors", convert(), "holds expert 7",
         cfg(lambda d: d.update(n_routed_experts=4))),
    Case("config: more experts than the tensors", lambda c: ["plan", c.src], "no tensors of expert 8",
         cfg(lambda d: d.update(n_routed_experts=16))),
    Case("header: a 5000-digit integer", convert(), "a number no tensor can have",
         lambda c: _big_int_header(c)),
    Case("source: a FIFO shard", convert(), "not a regular file", lambda c: _fifo_for(c.src / SHARD)),
    Case("source: a FIFO tokenizer.json", convert(), "not a regular file",
         lambda c: _fifo_for(c.src / "tokenizer.json")),
    Case("check: an ignore pattern that does not compile", lambda c: ["check", c.out], "does not compile",
         lambda c: edit_json(c.out / "config.json", lambda d: d["quantization_config"]["ignore"].append("re:([")),
         needs=("out",), code=1),
    Case("check: a job record that is a JSON array", lambda c: ["check", c.out], "not one this tool wrote",
         write(".quantize/job.json", "[]", "out"), needs=("out",)),
    # -- output folders (issue 8) ----------------------------------------------------------------------
    Case("out: inside the source", lambda c: ["convert", c.src, c.src / "o"], "overlaps the input"),
    Case("out: the source itself", lambda c: ["convert", c.src, c.src, "--overwrite"], "overlaps the input"),
    Case("out: not ours", lambda c: ["convert", c.src, c.tmp / "mine"], "did not write it", foreign_out,
         inputs=lambda c: [c.src, c.tmp / "mine"]),
    Case("out: not ours, --overwrite", lambda c: ["convert", c.src, c.tmp / "mine", "--overwrite"],
         "did not write it", foreign_out, inputs=lambda c: [c.src, c.tmp / "mine"]),
    Case("out: a symlink", lambda c: ["convert", c.src, c.tmp / "link"], "is a symlink", out_symlink,
         inputs=lambda c: [c.src, c.tmp / "real"]),
    Case("out: a file", lambda c: ["convert", c.src, c.tmp / "f"], "is a file", write("f", "x", None),
         inputs=lambda c: [c.src, c.tmp / "f"]),
    Case("out: --resume and --overwrite", convert("--resume", "--overwrite"), "together"),
    # -- options (issue 16 R7, R11) -----------------------------------------------------------------
    Case("convert: --iters 0 beside rtn", convert("--iters", "0"), "--iters"),
    Case("convert: --min-expert-tokens 0 beside rtn", convert("--min-expert-tokens", "0"), "--min-expert-tokens"),
    Case("convert: --group-size 7", convert("--group-size", "7"), "--group-size 7"),
    # --scheme w4afp8 (issue 36): what the engines' W4A8 kernels cannot serve, one line before OUT opens
    Case("convert: w4afp8 --engine vllm with --samples (dynamic activations)",
         convert("--scheme", "w4afp8", "--samples", "4"),
         "--samples: --engine vllm quantizes the experts' activations dynamically (per token, at serving time), so "
         "no activation scale is calibrated"),
    Case("convert: w4afp8 --group-size 32", convert("--scheme", "w4afp8", "--group-size", "32"),
         "--group-size 32: the W4A8 MoE kernels of vLLM 0.33 and SGLang 0.5.23 take group 128 only"),
    Case("convert: w4afp8 --profile all-linear", convert("--scheme", "w4afp8", "--profile", "all-linear"),
         "--profile all-linear: --scheme w4afp8 quantizes the routed experts only"),
    Case("convert: w4afp8 --observer fullrange", convert("--scheme", "w4afp8", "--observer", "fullrange"),
         "--observer fullrange: its negative scales are not proven"),
    Case("convert: --engine without w4afp8", convert("--engine", "vllm"),
         "--engine vllm picks a W4AFP8 layout, but the scheme is w4a16"),
    Case("convert: w4afp8 --engine tpu", convert("--scheme", "w4afp8", "--engine", "tpu"), "--engine tpu"),
    Case("convert: --memory-budget-gib nan", convert("--memory-budget-gib", "nan"), "--memory-budget-gib nan"),
    Case("convert: --workers 0", convert("--workers", "0"), "--workers 0: must be at least 1"),
    Case("convert: --damp inf beside gptq", convert("--method", "gptq", "--damp", "inf"), "--damp inf"),
    Case("convert: --asym nan beside gptq", convert("--method", "gptq", "--asym", "nan"),
         "--asym nan: not a finite number; must be a fraction from 0 (off) to 1"),
    Case("convert: --asym 1.01 beside gptq", convert("--method", "gptq", "--asym", "1.01"),
         "--asym 1.01: must be a fraction from 0 (off) to 1"),
    Case("convert: --asym without gptq", convert("--asym", "0.5"),
         "--asym is an option of --method gptq, but the method is rtn"),
    Case("convert: --base-model without a namespace", convert("--base-model", "GLM-5-FP8"),
         "--base-model GLM-5-FP8: not a Hub repo id naming its namespace"),
    Case("convert: --base-model three parts", convert("--base-model", "a/b/c"), "--base-model a/b/c: not a Hub repo id"),
    Case("convert: --base-model a path", convert("--base-model", "../models/GLM-5"), "--base-model ../models/GLM-5:"),
    Case("calibrate-kv: --base-model with '--'",
         lambda c: ["calibrate-kv", c.out, "--out", c.new("kv"), "--base-model", "org/bad--name"],
         "--base-model org/bad--name: not a Hub repo id", needs=("out",)),
    Case("shard: --max-part-gib nan", lambda c: ["shard", c.out, c.new("s"), "--max-part-gib", "nan"],
         "--max-part-gib nan", needs=("out",)),
    Case("check: --tokens -5", lambda c: ["check", c.out, "--tokens", "-5"], "--tokens -5", needs=("out",)),
    Case("check: --tp 0", lambda c: ["check", c.out, "--tp", "0"], "--tp 0", needs=("out",)),
    Case("check: --tokens 10**12", lambda c: ["check", c.out, "--tokens", str(10**12)], "must be from 1 to 4096",
         needs=("out",)),
    Case("check: --engine-tolerance nan", lambda c: ["check", c.out, "--engine-tolerance", "nan"],
         "--engine-tolerance nan: not a finite number", needs=("out",)),
    Case("check: --engine-tolerance without --engine", lambda c: ["check", c.out, "--engine-tolerance", "0.1"],
         "options of --engine vllm", needs=("out",)),
    Case("check: --source is the model", lambda c: ["check", c.out, "--source", c.out], "proves nothing",
         needs=("out",)),
    Case("make-tiny: --num-shards 0", lambda c: ["make-tiny", "glm_moe_dsa", c.new("t"), "--num-shards", "0"],
         "--num-shards 0", needs=()),
    Case("make-tiny: --seed -1", lambda c: ["make-tiny", "glm_moe_dsa", c.new("t"), "--seed", "-1"], "--seed -1",
         needs=()),
    # -- calibration data and statistics (calibrate-kv, GPTQ) -----------------------------------------
    Case("calibrate-kv: --stats-out inside the model",
         lambda c: ["calibrate-kv", c.out, "--stats-out", c.out / "config.json"], "lies inside the input",
         needs=("out",)),
    Case("calibrate-kv: --stats-out over a foreign file",
         lambda c: ["calibrate-kv", c.out, "--stats-out", c.tmp / "notes.json"], "not a kv-stats file",
         write("notes.json", '{"mine": 1}', None), needs=("out",), inputs=lambda c: [c.out, c.tmp / "notes.json"]),
    Case("calibrate-kv: --stats-out a folder", lambda c: ["calibrate-kv", c.out, "--stats-out", c.tmp],
         "is a folder", needs=("out",)),
    Case("calibrate-kv: --stats binary", lambda c: ["calibrate-kv", c.out, "--stats", c.tmp / "s.json"],
         "not UTF-8", write("s.json", b"\x89PNG\r\n\x1a\n\xff", None), needs=("out",)),
    Case("calibrate-kv: --stats with NaN",
         lambda c: ["calibrate-kv", c.out, "--stats", c.tmp / "s.json"], "not a calibrate-kv stats file",
         write("s.json", json.dumps({"layers": [{"layer": 0, "amax": float("nan"), "scale": 1.0, "percentile": 1.0,
                                                 "overflow_unit": 0, "subnormal_unit": 0, "zero_unit": 0,
                                                 "overflow_calibrated": 0, "subnormal_calibrated": 0,
                                                 "zero_calibrated": 0}]}), None), needs=("out",)),
    Case("calibrate-kv: --stats a folder", lambda c: ["calibrate-kv", c.out, "--stats", c.tmp],
         "is a folder", needs=("out",)),
    Case("calibrate-kv: --data binary",
         lambda c: ["calibrate-kv", c.out, "--data", c.tmp / "d.txt", "--samples", "2", "--seq-len", "8"],
         "binary data", write("d.txt", b"ab\0cd", None), needs=("out",)),
    Case("calibrate-kv: --data line an array",
         lambda c: ["calibrate-kv", c.out, "--data", c.tmp / "d.jsonl", "--samples", "2", "--seq-len", "8"],
         "not an object or a string", write("d.jsonl", '"a b c"\n[1, 2]\n', None), needs=("out",)),
    Case("calibrate-kv: --data deep line",
         lambda c: ["calibrate-kv", c.out, "--data", c.tmp / "d.jsonl", "--samples", "2", "--seq-len", "8"],
         "nests deeper", write("d.jsonl", "[" * 100 + "]" * 100 + "\n", None), needs=("out",)),
    Case("calibrate-kv: --samples 0", lambda c: ["calibrate-kv", c.out, "--samples", "0"], "--samples 0",
         needs=("out",)),
    Case("calibrate-kv: --clip nan", lambda c: ["calibrate-kv", c.out, "--clip", "nan"], "--clip nan",
         needs=("out",)),
    Case("make-tiny: --override vocab_size=1",
         lambda c: ["make-tiny", "glm_moe_dsa", c.new("t"), "--override", "vocab_size=1"], "vocab_size=1", needs=()),
    Case("make-tiny: --override hidden_size=-3",
         lambda c: ["make-tiny", "glm_moe_dsa", c.new("t"), "--override", "hidden_size=-3"], "hidden_size=-3",
         needs=()),
    Case("make-tiny: --override num_experts_per_tok=99",
         lambda c: ["make-tiny", "glm_moe_dsa", c.new("t"), "--override", "num_experts_per_tok=99"],
         "routes to more experts than a layer has", needs=()),
    Case("make-tiny: --override first_k_dense_replace=99",
         lambda c: ["make-tiny", "glm_moe_dsa", c.new("t"), "--override", "first_k_dense_replace=99"],
         "more dense layers than the model has", needs=()),
    Case("make-tiny: llama --override hidden_size=250",
         lambda c: ["make-tiny", "llama", c.new("t"), "--override", "hidden_size=250"],
         "not a multiple of num_attention_heads", needs=()),
    Case("make-tiny: --override num_hidden_layers=null",
         lambda c: ["make-tiny", "glm_moe_dsa", c.new("t"), "--override", "num_hidden_layers=null"],
         "num_hidden_layers=null", needs=()),
]


def _recipe(edit):
    """Setup: the default recipe, edited, as ctx.tmp/r.yaml (out inside ctx.tmp)."""
    import yaml

    from quantize import pipeline

    def setup(ctx):
        doc = yaml.safe_load(pipeline.default_recipe().read_text())
        doc["pipeline"]["out"] = str(ctx.tmp / "run")
        edit(doc)
        (ctx.tmp / "r.yaml").write_text(yaml.safe_dump(doc))

    return setup


def run_recipe(c):
    return ["run", c.tmp / "r.yaml", "--plan"]


CASES += [
    Case("run: stages []", run_recipe, "pipeline.stages is empty", _recipe(lambda d: d["pipeline"].update(stages=[])),
         needs=()),
    Case("run: convert iters 0 beside rtn", run_recipe, "pipeline.convert: --iters is an option of",
         _recipe(lambda d: d["pipeline"].setdefault("convert", {}).update(iters=0)), needs=()),
    Case("run: pd bootstrap_port -1", run_recipe, "bootstrap_port",
         _recipe(lambda d: d["pipeline"].setdefault("pd", {}).update(bootstrap_port=-1)), needs=()),
    Case("run: max_drop .nan", run_recipe, "not a finite number",
         _recipe(lambda d: d["pipeline"].update(max_drop=float("nan"))), needs=()),
    Case("run: shard tp 10**30", run_recipe, "must be from 1 to 4096",
         _recipe(lambda d: d["pipeline"].setdefault("shard", {}).update(tp=10**30)), needs=()),
    Case("run: a key twice", run_recipe, "appears twice",
         lambda c: (_recipe(lambda d: None)(c), (c.tmp / "r.yaml").write_text(
             (c.tmp / "r.yaml").read_text().replace("pipeline:\n", "pipeline:\n  out: elsewhere\n", 1))), needs=()),
    Case("run --plan: out is the recipe file", lambda c: ["run", c.tmp / "r.yaml", "--plan", "--out", c.tmp / "r.yaml"],
         "is a file", _recipe(lambda d: None), needs=()),
    Case("run --plan: out inside the source", lambda c: ["run", c.tmp / "r.yaml", "--plan", "--out", c.src / "run"],
         "overlaps the input", lambda c: _recipe(lambda d: d["pipeline"].update(source=str(c.src)))(c)),
    Case("run: limit 0", run_recipe, "limit", _recipe(lambda d: d["pipeline"].update(limit=0)), needs=()),
    Case("run: base_model without a namespace", run_recipe, "pipeline.base_model GLM-5-FP8: not a Hub repo id",
         _recipe(lambda d: d["pipeline"].update(base_model="GLM-5-FP8")), needs=()),
    Case("run: base_model a number", run_recipe, "pipeline.base_model is 5, not str or null",
         _recipe(lambda d: d["pipeline"].update(base_model=5)), needs=()),
    Case("run: base_model in the convert section", run_recipe, "move it to pipeline.base_model",
         _recipe(lambda d: d["pipeline"].setdefault("convert", {}).update(base_model="zai-org/GLM-5-FP8")), needs=()),
    Case("run: a 5000-digit limit", run_recipe, "digits",
         lambda c: (_recipe(lambda d: None)(c), (c.tmp / "r.yaml").write_text(
             re.sub(r"(?m)^(\s+limit:).*$", r"\1 1" + "0" * 5000, (c.tmp / "r.yaml").read_text(), count=1))),
         needs=()),
]


# -- issue 35: bounds and messages ----------------------------------------------------------------
HUGE = "1.7e308"  # overflowed int(GiB * 2**30) after OUT was opened, leaving the job record "running"
ONE_WORD = write("d.txt", "hello\n", None)  # the tiny tokenizer: 5 tokens


def _garbage_engine(ctx):
    """An engine python whose version probe prints a banner and no version."""
    p = ctx.tmp / "bin" / "python"
    p.parent.mkdir()
    p.write_text('#!/bin/sh\necho "Welcome to the cluster!"\necho "vllm: ??? garbage"\nexit 0\n')
    p.chmod(0o755)


ISSUE35 = [
    Case("convert: --memory-budget-gib 1.7e308", convert("--method", "gptq", "--memory-budget-gib", HUGE),
         "--memory-budget-gib 1.7e+308: must be 0 or more GiB, at most this machine's memory"),
    Case("calibrate-kv: --memory-budget-gib 1.7e308",
         lambda c: ["calibrate-kv", c.out, "--out", c.new("kv"), "--memory-budget-gib", HUGE],
         "--memory-budget-gib 1.7e+308: must be 0 or more GiB, at most this machine's memory", needs=("out",)),
    Case("run: convert.memory_budget_gib 1.7e308", lambda c: ["run", c.tmp / "r.yaml", "--set",
                                                             "convert.memory_budget_gib=1.7e+308"],
         "memory_budget_gib 1.7e+308: must be 0 or more GiB, at most this machine's memory",
         _recipe(lambda d: None), needs=()),
    Case("run: kv.memory_budget_gib 1.7e308", lambda c: ["run", c.tmp / "r.yaml", "--set",
                                                        "kv.memory_budget_gib=1.7e+308"],
         "memory_budget_gib 1.7e+308: must be 0 or more GiB, at most this machine's memory",
         _recipe(lambda d: None), needs=()),
    Case("calibrate-kv --fold: one word of calibration text",
         lambda c: ["calibrate-kv", c.kimi_out, "--out", c.new("kv"), "--fold", "--data", c.tmp / "d.txt"],
         "d.txt: 5 tokens in 1 usable samples (1 texts read, 0 shorter than 2 tokens), fewer than one sample of "
         "--seq-len 2048 and fewer than --samples 512; pass more text or lower --samples to 1 (enough text: at "
         "least 2048 tokens)", ONE_WORD,
         needs=("kimi_out",), inputs=lambda c: [c.kimi_out, c.tmp / "d.txt"]),
    Case("convert --method gptq: one word of calibration text",
         lambda c: ["convert", c.src, c.new("o"), "--method", "gptq", "--data", c.tmp / "d.txt"],
         "fewer than one sample of --seq-len 2048 and fewer than --samples 128", ONE_WORD,
         inputs=lambda c: [c.src, c.tmp / "d.txt"]),
    Case("make-tiny: --num-shards 100000", lambda c: ["make-tiny", "glm_moe_dsa", c.new("t"), "--num-shards", "100000"],
         "make-tiny --num-shards 100000: more files than the", needs=()),
    Case("eval --serve: an engine whose version probe prints garbage",
         lambda c: ["eval", "--baseline", c.src, "--candidate", c.out, "--serve", "vllm", "--engine-python",
                    c.tmp / "bin" / "python", "--tasks", "arc_easy", "--limit", "1", "--data-dir", "shipped"],
         "could not read the vllm version of", _garbage_engine, needs=("src", "out")),
]


@pytest.mark.parametrize("case", ISSUE35, ids=str)
def test_hostile_bounds(case, tmp_path, hostile_sources):
    run_case(case, tmp_path, hostile_sources)
    assert not any((tmp_path / n).exists() for n in ("o", "kv", "t", "run"))  # refused before OUT was opened


def test_memory_budget_edges():
    """The bound's edge, the machine's memory, is accepted; the next float above it is not."""
    import math

    from quantize import options as O
    from quantize.errors import QuantizeError

    for model in (O.ConvertOptions, O.CalibrateKVOptions):
        O.validate(model(memory_budget_gib=O.MAX_BUDGET_GIB))
        O.validate(model(memory_budget_gib=0.0))
        with pytest.raises(QuantizeError, match="at most this machine's memory"):
            O.validate(model(memory_budget_gib=math.nextafter(O.MAX_BUDGET_GIB, math.inf)))
    assert O.MAX_BUDGET_GIB >= O.physical_memory_gib() > 0


def test_calibration_floor_edges(tmp_path, hostile_sources):
    """A set of one short text: seq_len tokens in all is enough (the edge), one token fewer is not,
    unless the set fills every sample asked for."""
    from quantize.calibrate.data import build_samples
    from quantize.errors import QuantizeError

    d = tmp_path / "d.txt"
    d.write_text("hello\n")  # 5 tokens
    src = hostile_sources["src"]
    assert sum(len(i) for i in build_samples(src, str(d), samples=2, seq_len=5).ids) == 5
    assert len(build_samples(src, str(d), samples=1, seq_len=6).ids) == 1  # every sample asked for is filled
    with pytest.raises(QuantizeError, match=r"5 tokens in 1 usable samples .* fewer than one sample of --seq-len 6 "
                                            r"and fewer than --samples 2; pass more text or lower --samples to 1 "
                                            r"\(enough text: at least 6 tokens\)$"):
        build_samples(src, str(d), samples=2, seq_len=6)


def test_num_shards_edges(tmp_path, hostile_sources):
    """--num-shards up to the tensor count is accepted (at most one file a tensor); one more is not."""
    from quantize.errors import QuantizeError
    from quantize.testing.tiny import make_tiny

    n = len(json.loads((hostile_sources["src"] / "model.safetensors.index.json").read_text())["weight_map"])
    make_tiny("glm_moe_dsa", tmp_path / "edge", num_shards=n)
    assert 1 < len(list((tmp_path / "edge").glob("*.safetensors"))) <= n  # small tensors share a file
    with pytest.raises(QuantizeError, match=f"--num-shards {n + 1}: more files than the {n} tensors"):
        make_tiny("glm_moe_dsa", tmp_path / "over", num_shards=n + 1)
    assert not (tmp_path / "over").exists()


@pytest.mark.parametrize("printed,want", [("0.32.0", "0.32.0"), ("a banner\n0.33.0rc1+cpu", "0.33.0rc1+cpu"),
                                          ("garbage", "could not read the vllm version"), ("", "could not read"),
                                          ("0.31.9", "older than 0.32")])
def test_engine_version_probe(tmp_path, printed, want):
    """The version is the probe's last line; one that is no version is said to be unreadable, with
    what was printed, never "older"."""
    from quantize.engines.serve import ENGINES, engine_version
    from quantize.errors import QuantizeError

    p = tmp_path / "python"
    p.write_text("#!/bin/sh\n" + "".join(f"echo '{ln}'\n" for ln in printed.splitlines()) + "exit 0\n")
    p.chmod(0o755)
    if want[0].isdigit():
        assert engine_version(ENGINES["vllm"], p) == want
        return
    with pytest.raises(QuantizeError, match=want) as e:
        engine_version(ENGINES["vllm"], p)
    assert "\n" not in str(e.value) and (printed[:5] in str(e.value))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hostile(case, tmp_path, hostile_sources):
    run_case(case, tmp_path, hostile_sources)


def test_the_table_covers_each_command_it_names():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


def test_config_against_tensors_near_misses():
    """The layer rule's edges: the MTP layer after the decoder layers is allowed (and may be stripped,
    as some releases do), one more is not; experts 0..n-1 exactly."""
    from quantize.checkpoint.config import ModelConfig, check_against_tensors
    from quantize.errors import QuantizeError

    cfg = ModelConfig.from_dict({"num_hidden_layers": 3, "num_nextn_predict_layers": 1, "hidden_size": 8,
                                 "vocab_size": 16, "num_attention_heads": 2, "n_routed_experts": 2}, "config.json")

    def shapes(n_layers, n_exp=2):
        out = {"model.embed_tokens.weight": (16, 8)}
        for i in range(n_layers):
            out[f"model.layers.{i}.self_attn.o_proj.weight"] = (8, 8)
            for e in range(n_exp):
                out[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"] = (8, 4)
        return out

    check_against_tensors(cfg, shapes(4), "d")  # 3 decoder layers + the MTP layer
    check_against_tensors(cfg, shapes(3), "d")  # the MTP layer stripped
    for bad, frag in ((shapes(5), "holds layer 4"), (shapes(2), "no tensors of layer 2"),
                      (shapes(4, 3), "holds expert 2"), (shapes(4, 1), "no tensors of expert 1"),
                      ({**shapes(4), "model.embed_tokens.weight": (16, 9)}, "hidden_size is 8"),
                      ({**shapes(4), "model.embed_tokens.weight": (17, 8)}, "vocab_size is 16")):
        with pytest.raises(QuantizeError, match=frag):
            check_against_tensors(cfg, bad, "d")


def test_shards_in_a_sub_folder_convert(tmp_path, hostile_sources):
    """A valid layout, not an attack: an index may name its shards in a folder; the output keeps
    the layout (it ended mid-write in a FileNotFoundError)."""
    import shutil

    from quantize.convert import convert

    src = tmp_path / "src"
    shutil.copytree(hostile_sources["src"], src)
    (src / "sub").mkdir()
    (src / SHARD).rename(src / "sub" / SHARD)
    edit_json(src / "model.safetensors.index.json",
              lambda d: d["weight_map"].update({k: "sub/" + v for k, v in d["weight_map"].items() if v == SHARD}))
    convert(src, tmp_path / "o")
    assert (tmp_path / "o" / "sub" / SHARD).is_file() and (tmp_path / "o" / "quantize_manifest.json").is_file()
