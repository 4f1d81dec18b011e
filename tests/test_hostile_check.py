"""Hostile input, check / shard / merge / plan: a config.json that does not describe the tensors, a
manifest that disagrees with the job record or proves nothing, an edited shard manifest or
unsharded/ folder, corrupt shard-manifest fields, impossible config fields and FP8 dtypes, are each
one line (CheckFailed exit 1 for a defect in a written artifact, exit 2 for bad input); and the
near misses: a correct output and a correct shard pass, the shard merges byte for byte."""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantize.checkpoint.config import INT_FIELDS, ModelConfig
from quantize.errors import QuantizeError
from tests.hostile import Case, edit_json, run_case

QC = "quantization_config"


def _cfg(where, fn):
    def setup(ctx):
        edit_json(getattr(ctx, where) / "config.json", lambda d: (fn(d), None)[1])  # edit in place

    return setup


def _group(fn):
    return _cfg("out", lambda c: fn(c[QC]["config_groups"]["config_group_0"]))


def _w(key, value):
    return _group(lambda g: g["weights"].__setitem__(key, value))


def _qc(key, value):
    return _cfg("out", lambda c: c[QC].__setitem__(key, value))


def _manifest(fn, where="out", name="quantize_manifest.json"):
    def setup(ctx):
        edit_json(getattr(ctx, where) / name, lambda d: (fn(d), None)[1])  # edit in place

    return setup


def _drop_file(m):
    m["files"].pop("tokenizer.json")


def _drop_config(m):
    m["files"].pop("config.json")


def _rehash(folder, rel):
    """A file edited and its manifest entry re-hashed (the job record left alone)."""
    p = folder / rel
    p.write_bytes(p.read_bytes().replace(b"\"hidden_act\"", b"\"hidden_act\" ", 1))
    m = json.loads((folder / "quantize_manifest.json").read_text())
    m["files"][rel] = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "bytes": p.stat().st_size}
    (folder / "quantize_manifest.json").write_text(json.dumps(m))


def _shard_tensor(name, fn):
    return _manifest(lambda m: fn(m["tensors"][next(iter(m["tensors"]))]) if name is None else fn(m), "shard",
                     "shard_manifest.json")


def _flip_bf16_slice(ctx):
    """A BF16 slice of rank 1 flipped, its slice checksum in the shard manifest re-hashed."""
    sh = ctx.shard
    f = sh / "rank-01" / "part-000.safetensors"
    with safe_open(f, "pt") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = fh.metadata()
    name = "model.layers.0.self_attn.o_proj.weight"
    t[name].view(torch.uint8).view(-1)[:4] ^= 0x10
    save_file(t, str(f), metadata=meta)
    m = json.loads((sh / "shard_manifest.json").read_text())
    x = t[name].contiguous().view(torch.uint8).numpy().tobytes()
    m["tensors"][name]["ranks"][1]["sha256"] = hashlib.sha256(x).hexdigest()
    (sh / "shard_manifest.json").write_text(json.dumps(m, indent=1))


def _edit_unsharded_config(ctx):
    p = ctx.shard / "unsharded" / "config.json"
    p.write_text(p.read_text().replace('"num_hidden_layers": 3', '"num_hidden_layers": 2'))


def _fp8(name, fn):
    """A source tensor's header entry changed (dtype / shape) with its bytes kept consistent."""

    def setup(ctx):
        idx = json.loads((ctx.src / "model.safetensors.index.json").read_text())
        f = ctx.src / idx["weight_map"][name]
        with safe_open(f, "pt") as fh:
            t = {k: fh.get_tensor(k) for k in fh.keys()}
            meta = fh.metadata()
        fn(t)
        save_file(t, str(f), metadata=meta)

    return setup


SCALE = "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"
FP8W = "model.layers.1.mlp.experts.0.up_proj.weight"
SRC_CHECK = lambda c: ["check", c.out, "--source", c.src]  # noqa: E731
OUT_CHECK = lambda c: ["check", c.out]  # noqa: E731
SH_CHECK = lambda c: ["check", c.shard]  # noqa: E731
MERGE = lambda c: ["shard", "--merge", c.shard, c.new("m")]  # noqa: E731
OS = ("out", "src")

CASES = [
    # R4: quantization_config against the tensors
    Case("check: quantization_config deleted", SRC_CHECK, "no quantization_config",
         _cfg("out", lambda c: c.pop(QC)), code=1, needs=OS),
    Case("check: group_size 128", SRC_CHECK, "weights.group_size is 128", _w("group_size", 128), code=1, needs=OS),
    Case("check: num_bits 8", OUT_CHECK, "weights.num_bits is 8", _w("num_bits", 8), code=1, needs=("out",)),
    Case("check: asymmetric", OUT_CHECK, "weights.symmetric is False", _w("symmetric", False), code=1,
         needs=("out",)),
    Case("check: strategy channel", OUT_CHECK, "is not one compressed-tensors reads",
         _w("strategy", "channel"), code=1, needs=("out",)),
    Case("check: type float", OUT_CHECK, "weights.type is 'float'", _w("type", "float"), code=1, needs=("out",)),
    Case("check: format float-quantized", OUT_CHECK, "quantization_config.format is 'float-quantized'",
         _qc("format", "float-quantized"), code=1, needs=("out",)),
    Case("check: group format naive", OUT_CHECK, "config_group_0.format is 'naive-quantized'",
         _group(lambda g: g.__setitem__("format", "naive-quantized")), code=1, needs=("out",)),
    Case("check: quant_method", OUT_CHECK, "quant_method is 'gptq'", _qc("quant_method", "gptq"), code=1,
         needs=("out",)),
    Case("check: ignore drops attention", OUT_CHECK, "self_attn",
         _cfg("out", lambda c: c[QC].__setitem__("ignore", [i for i in c[QC]["ignore"] if "self_attn" not in i])),
         code=1, needs=("out",)),
    Case("check: ignore covers experts", OUT_CHECK, "leaves model.layers.1.mlp.experts.0",
         _cfg("out", lambda c: c[QC]["ignore"].append("re:.*experts.*")), code=1, needs=("out",)),
    Case("check: targets nothing", OUT_CHECK, "unquantized",
         _group(lambda g: g.__setitem__("targets", ["re:nothing$"])), code=1, needs=("out",)),
    Case("check: activations quantized", OUT_CHECK, "input_activations is set (W4AFP8), but the tensors of "
         "model.layers.1.mlp.experts.0.down_proj are INT4 by group 32",
         _group(lambda g: g.__setitem__("input_activations", {"num_bits": 8, "type": "float"})), code=1,
         needs=("out",)),
    # R3: the manifest against the job record and the folder
    Case("check: manifest files {}", SRC_CHECK, "proves nothing", _manifest(lambda m: m.__setitem__("files", {})),
         code=1, needs=OS),
    Case("check: a file dropped from the manifest", OUT_CHECK, "does not list tokenizer.json",
         _manifest(_drop_file), code=1, needs=("out",)),
    Case("check: config.json dropped from manifest and record", OUT_CHECK, "does not record config.json",
         lambda c: (_manifest(_drop_config)(c), _manifest(_drop_config, name=".quantize/job.json")(c)), code=1,
         needs=("out",)),
    Case("check: config edited, manifest re-hashed", SRC_CHECK, "differs from the job record",
         lambda c: _rehash(c.out, "config.json"), code=1, needs=OS),
    Case("check: job record deleted", OUT_CHECK, "job.json: missing",
         lambda c: (c.out / ".quantize" / "job.json").unlink(), code=1, needs=("out",)),
    # R5: the shard, slice by slice, and unsharded/
    Case("check: BF16 slice flipped, checksum re-hashed", SH_CHECK, "not the manifest `quantize shard` wrote",
         _flip_bf16_slice, code=1, needs=("shard",)),
    Case("merge: BF16 slice flipped, checksum re-hashed", MERGE, "not the manifest `quantize shard` wrote",
         _flip_bf16_slice, code=1, needs=("shard",)),
    Case("check: unsharded/config.json edited", SH_CHECK, "unsharded/config.json: changed",
         _edit_unsharded_config, code=1, needs=("shard",)),
    Case("merge: unsharded/config.json edited", MERGE, "unsharded/config.json: changed",
         _edit_unsharded_config, code=1, needs=("shard",)),
    Case("check: a file added to unsharded/", SH_CHECK, "not carried",
         lambda c: (c.shard / "unsharded" / "extra.json").write_text("{}"), code=1, needs=("shard",)),
    # R8: corrupt shard-manifest fields
    Case("check: shard tp a string", SH_CHECK, "'tp' must be an integer",
         _shard_tensor("", lambda m: m.__setitem__("tp", "2")), needs=("shard",)),
    Case("merge: shard tp negative", MERGE, "'tp' must be an integer",
         _shard_tensor("", lambda m: m.__setitem__("tp", -2)), needs=("shard",)),
    Case("merge: shard tensors missing", MERGE, "'tensors' must be an object",
         _shard_tensor("", lambda m: m.pop("tensors")), needs=("shard",)),
    Case("check: shard ranks not a list", SH_CHECK, ".ranks must be a list of 2",
         _shard_tensor(None, lambda r: r.__setitem__("ranks", 7)), needs=("shard",)),
    Case("merge: shard shape negative", MERGE, ".shape must be a list of non-negative",
         _shard_tensor(None, lambda r: r.__setitem__("shape", [-1, 4])), needs=("shard",)),
    Case("merge: shard dim out of range", MERGE, ".dim must be null or an axis",
         _shard_tensor(None, lambda r: r.__setitem__("dim", 5)), needs=("shard",)),
    Case("check: shard split unknown", SH_CHECK, ".split must be one of",
         _shard_tensor(None, lambda r: r.__setitem__("split", "diag")), needs=("shard",)),
    Case("merge: shard dtype unknown", MERGE, ".dtype must be a safetensors dtype",
         _shard_tensor(None, lambda r: r.__setitem__("dtype", 3)), needs=("shard",)),
    Case("merge: shard rank file outside", MERGE, "a path outside",
         _shard_tensor(None, lambda r: r["ranks"][0].__setitem__("file", "../../etc/passwd")), needs=("shard",)),
    Case("check: shard rank record missing sha", SH_CHECK, ".ranks[1] must be an object",
         _shard_tensor(None, lambda r: r["ranks"][1].pop("sha256")), needs=("shard",)),
    Case("merge: shard files names an unknown tensor", MERGE, "must list tensors the manifest records",
         _shard_tensor("", lambda m: next(iter(m["files"].values())).append("nope")), needs=("shard",)),
    Case("merge: unsharded_files outside", MERGE, "a path outside",
         _shard_tensor("", lambda m: m.__setitem__("unsharded_files", ["../x"])), needs=("shard",)),
    Case("check: shard manifest a list", SH_CHECK, "must be a JSON object",
         lambda c: (c.shard / "shard_manifest.json").write_text("[]"), needs=("shard",)),
    # R13: no --resume for shard
    Case("shard: OUT exists", lambda c: ["shard", c.out, c.shard, "--tp", "2"], "pass --overwrite to replace it",
         needs=("out", "shard")),
    # item 1 / R9: config fields and FP8 dtypes
    Case("plan: num_hidden_layers null", lambda c: ["plan", c.src], "'num_hidden_layers' is null",
         _cfg("src", lambda c: c.__setitem__("num_hidden_layers", None))),
    Case("plan: hidden_size a string", lambda c: ["plan", c.src], "'hidden_size' must be an integer",
         _cfg("src", lambda c: c.__setitem__("hidden_size", "256"))),
    Case("plan: vocab_size missing", lambda c: ["plan", c.src], "'vocab_size' is missing",
         _cfg("src", lambda c: c.pop("vocab_size"))),
    Case("shard: heads 0", lambda c: ["shard", c.out, c.new("s"), "--tp", "2"], "'num_attention_heads' is 0",
         _cfg("out", lambda c: c.__setitem__("num_attention_heads", 0)), needs=("out",)),
    Case("check: layers a float", OUT_CHECK, "'num_hidden_layers' must be an integer",
         _cfg("out", lambda c: c.__setitem__("num_hidden_layers", 3.0)), needs=("out",)),
    Case("convert: I32 weight_scale_inv", lambda c: ["convert", c.src, c.new("o")], "a block FP8 scale must be",
         _fp8(SCALE, lambda t: t.__setitem__(SCALE, t[SCALE].view(torch.int32)))),
    Case("convert: 1-D FP8 weight", lambda c: ["convert", c.src, c.new("o")], "an FP8 weight is 2-D",
         _fp8(FP8W, lambda t: t.__setitem__(FP8W, t[FP8W].reshape(-1)))),
    Case("check --source: I32 scale in the source", SRC_CHECK, "a block FP8 scale must be",
         _fp8(SCALE, lambda t: t.__setitem__(SCALE, t[SCALE].view(torch.int32))), needs=OS),
    # R11
    Case("plan: --gpu-mem-gib 1e300", lambda c: ["plan", c.src, "--gpu-mem-gib", "1e300"], "--gpu-mem-gib"),
    Case("plan: --gpu-mem-gib nan", lambda c: ["plan", c.src, "--gpu-mem-gib", "nan"], "--gpu-mem-gib"),
    Case("plan: --gpu-mem-gib inf", lambda c: ["plan", c.src, "--gpu-mem-gib", "inf"], "--gpu-mem-gib"),
    Case("plan: --reserve-gib 1e300", lambda c: ["plan", c.src, "--reserve-gib", "1e300"], "--reserve-gib"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hostile(case, tmp_path, hostile_sources):
    run_case(case, tmp_path, hostile_sources)


# -- near misses ---------------------------------------------------------------------------------


def test_correct_output_passes_check(hostile_sources, tmp_path):
    from typer.testing import CliRunner

    from quantize.cli import app

    res = CliRunner().invoke(app, ["check", str(hostile_sources["out"]), "--source", str(hostile_sources["src"])])
    assert res.exit_code == 0, res.output


def test_correct_shard_passes_check_and_merges_byte_identical(hostile_sources, tmp_path):
    from quantize.check import check
    from quantize.shard import merge

    rep = check(hostile_sources["shard"])
    assert rep.ok, rep.failures
    merge(hostile_sources["shard"], tmp_path / "m")
    out = hostile_sources["out"]
    for p in out.iterdir():
        if p.is_file():
            assert p.read_bytes() == (tmp_path / "m" / p.name).read_bytes(), p.name


def test_bf16_slice_flipped_with_everything_rehashed_is_caught_by_recomputing(hostile_sources, tmp_path):
    """An attacker who re-hashes the slice checksum, the manifest's outputs and the job record too:
    only recomputing the slice from the unsharded checkpoint sees it."""
    from quantize.check import check
    from tests.hostile import Ctx

    ctx = Ctx(tmp_path, hostile_sources, ("shard",))
    _flip_bf16_slice(ctx)
    sh = ctx.shard
    m = json.loads((sh / "shard_manifest.json").read_text())
    f = sh / "rank-01" / "part-000.safetensors"
    m["outputs"]["rank-01/part-000.safetensors"] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                                                    "bytes": f.stat().st_size}
    text = json.dumps(m, indent=1)
    (sh / "shard_manifest.json").write_text(text)
    rec = json.loads((sh / ".quantize" / "job.json").read_text())
    rec["files"] = m["outputs"]
    rec["manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (sh / ".quantize" / "job.json").write_text(json.dumps(rec))
    rep = check(sh)
    assert not rep.ok
    assert any("o_proj.weight of rank 1 differs from its slice recomputed" in x for x in rep.failures), rep.failures


GOOD = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 128,
        "num_attention_heads": 4}


@pytest.mark.parametrize("field", sorted(INT_FIELDS))
def test_config_field_bounds_near_misses(field):
    lo, hi, _ = INT_FIELDS[field]
    for v in (lo, hi):
        ModelConfig.from_dict({**GOOD, field: v}, "config.json")  # the ends pass
    for v in (lo - 1, hi + 1, float(lo), True if lo != 1 else "1"):
        with pytest.raises(QuantizeError, match=f"'{field}'"):
            ModelConfig.from_dict({**GOOD, field: v}, "config.json")


def test_config_view_reads_text_config():
    k = ModelConfig.from_dict({"architectures": ["KimiK25ForConditionalGeneration"],
                               "text_config": {**GOOD, "n_routed_experts": 8, QC: {"format": "x"}}}, "c")
    assert (k.num_hidden_layers, k.hidden_size, k.vocab_size, k.experts) == (2, 64, 128, 8)
    assert k.num_key_value_heads == 4 and k.quantization_config == {"format": "x"}
    with pytest.raises(QuantizeError, match="'text_config.vocab_size' is missing"):
        ModelConfig.from_dict({"text_config": {k: v for k, v in GOOD.items() if k != "vocab_size"}}, "c")


def test_fp8_scale_dtype_near_misses():
    from quantize.formats import layout

    for ok in ("F32", "BF16", "F8_E8M0", "U8"):
        assert layout.fp8_scale_error(ok, "block") is None
    for bad in ("I32", "I8", "F16", "F8_E4M3"):
        assert layout.fp8_scale_error(bad, "block")
    assert layout.fp8_scale_error("U8", "channel") and layout.fp8_scale_error("F32", "channel") is None
    assert layout.fp8_weight_error((4, 4)) is None and layout.fp8_weight_error((16,)) and layout.fp8_weight_error(())


def test_plan_gpu_mem_bound_near_miss(hostile_sources):
    from quantize.options import MAX_GPU_MEM_GIB
    from quantize.plan import plan

    plan(hostile_sources["src"], gpu_mem_gib=MAX_GPU_MEM_GIB)  # the bound itself passes
    with pytest.raises(QuantizeError, match="--gpu-mem-gib"):
        plan(hostile_sources["src"], gpu_mem_gib=MAX_GPU_MEM_GIB * (1 + 1e-9))


