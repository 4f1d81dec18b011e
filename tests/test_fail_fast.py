"""Issue 18 item 4, fail fast: calibrate-kv, convert --method gptq and `quantize run` check the
options, config.json, the calibration data and tokenizer, and the layer classes (transformers'
decoder layer built on the meta device, every parameter found in the safetensors headers with the
shape it needs) before a weight is read or an output folder is opened.

"No weight read" is proven by counting the ``os.preadv`` calls on a safetensors file: every tensor
read of a source goes through ``checkpoint.index.read_tensor``, which reads with pread and nothing
else; the headers are read with ``open().read``. Each refusal also goes through tests/hostile.py
(one line, exit 2, every input byte unchanged), and its output folder must not exist."""

import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from quantize.calibrate.runner import LayerStreamer
from quantize.errors import QuantizeError
from tests.hostile import Case, run_case

INDEX = "model.safetensors.index.json"
CAL = ["--samples", "2", "--seq-len", "16"]


@pytest.fixture
def reads(monkeypatch):
    """The safetensors files read by pread (tensor data), one entry per call."""
    seen: list[str] = []
    real = os.preadv

    def preadv(fd, buffers, offset, *a):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".safetensors"):
            seen.append(path)
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", preadv)
    return seen


@pytest.fixture(scope="module")
def dsv3(tiny):
    """DeepSeek-V3 as the release stores it (block FP8): a dense layer 0, MoE layers 1 and 2."""
    return tiny("deepseek_v3")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _no_tokenizer(ctx):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ctx.src / f).unlink()


def _shard_of(folder: Path, name: str) -> Path:
    return folder / json.loads((folder / INDEX).read_text())["weight_map"][name]


def _drop(*names):
    """Setup: the shard(s) rewritten without ``names``, and the index with them."""

    def setup(ctx):
        for name in names:
            p = _shard_of(ctx.src, name)
            with safe_open(p, "pt") as f:
                kept = {k: f.get_tensor(k) for k in f.keys() if k != name}
            save_file(kept, str(p), metadata={"format": "pt"})
            idx = json.loads((ctx.src / INDEX).read_text())
            del idx["weight_map"][name]
            (ctx.src / INDEX).write_text(json.dumps(idx))

    return setup


def _reshape(name, shape):
    """Setup: ``name``'s header entry declares ``shape`` (the same number of elements: the data is
    untouched and the header stays valid safetensors)."""

    def setup(ctx):
        p = _shard_of(ctx.src, name)
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        h = json.loads(raw[8 : 8 + n])
        h[name]["shape"] = list(shape)
        text = json.dumps(h).encode()
        p.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])

    return setup


def _data(text):
    def setup(ctx):
        (ctx.tmp / "data.jsonl").write_text(text)

    return setup


def _kv(c):
    return ["calibrate-kv", c.src, "--out", c.new("kv"), "--fold", *CAL]


def _gptq(c):
    return ["convert", c.src, c.new("q"), "--method", "gptq", *CAL]


def _with_data(argv):
    return lambda c: [*argv(c), "--data", c.tmp / "data.jsonl"]


DOWN = "model.layers.2.mlp.experts.7.down_proj.weight"
GATE = "model.layers.2.mlp.gate.weight"  # the router, BF16 [8 experts, 256]

CASES = [
    Case("kv: no tokenizer", _kv, "no tokenizer files", _no_tokenizer),
    Case("gptq: no tokenizer", _gptq, "no tokenizer files", _no_tokenizer),
    Case("kv: --data missing", _with_data(_kv), "data.jsonl: no such file or folder"),
    Case("gptq: --data missing", _with_data(_gptq), "data.jsonl: no such file or folder"),
    Case("kv: --data too short", _with_data(_kv), "no usable samples", _data('{"text": "a"}\n')),
    Case("gptq: --data too short", _with_data(_gptq), "no usable samples", _data('{"text": "a"}\n')),
    Case("kv: expert tensor missing", _kv, f"{DOWN} is missing (and so is its INT4 form), but transformers' "
         "DeepseekV3DecoderLayer (layer 2) needs [256, 256]; the checkpoint is incomplete",
         _drop(DOWN, DOWN + "_scale_inv")),
    Case("gptq: expert tensor missing", _gptq, f"{DOWN} is missing", _drop(DOWN, DOWN + "_scale_inv")),
    Case("kv: router shape in the header", _kv, f"{GATE} has shape [16, 128], but transformers' "
         "DeepseekV3DecoderLayer (layer 2) needs [8, 256]; the tensors disagree with config.json",
         _reshape(GATE, (16, 128))),
    Case("gptq: router shape in the header", _gptq, f"{GATE} has shape [16, 128]", _reshape(GATE, (16, 128))),
] + ([] if __import__("torch").cuda.is_available() else [  # a GPU asked for where there is none
    Case("kv: --device cuda without a GPU", lambda c: [*_kv(c), "--device", "cuda"],
         "--device cuda: no CUDA device is available here; use --device cpu (the default)"),
    Case("kv: --device not a device", lambda c: [*_kv(c), "--device", "gpu0"], "--device gpu0: no CUDA device"),
])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_refused_before_a_weight_is_read(case, dsv3, tmp_path, reads):
    """Each refusal: one line, exit 2, the input unchanged, no output folder, no tensor data read
    (the old order read layer 0's weights for gptq, and streamed layers 0-1 before layer 2's
    missing expert for calibrate-kv)."""
    run_case(case, tmp_path, {"src": dsv3})
    assert not (tmp_path / "kv").exists() and not (tmp_path / "q").exists()
    assert reads == [], f"{case.id}: {len(reads)} tensor reads before the refusal"


def test_a_token_id_past_the_embedding_is_refused_and_the_last_row_passes(dsv3, tmp_path, reads):
    """The bound: the tokenizer's id 511 is the embedding's last row (passes), 512 is one past it
    (refused in one line naming the tensor, before any read)."""
    from quantize.methods import prepare

    src = _copy(dsv3, tmp_path / "src")
    tok = json.loads((src / "tokenizer.json").read_text())
    (tmp_path / "e.txt").write_text("e e e e")  # the tiny tokenizer splits into characters
    opts = SimpleNamespace(data=str(tmp_path / "e.txt"), samples=1, seq_len=16)
    for new_id, ok in ((511, True), (512, False)):
        tok["model"]["vocab"]["e"] = new_id
        (src / "tokenizer.json").write_text(json.dumps(tok))
        if ok:
            calib = prepare(src, opts)
            assert max(int(x.max()) for x in calib.ids) == 511
        else:
            with pytest.raises(QuantizeError, match=r"the tokenizer gives token id 512, but "
                               r"model\.embed_tokens\.weight has 512 rows; the tokenizer is another model's"):
                prepare(src, opts)
    assert reads == []


@pytest.mark.parametrize("arch,layout,kinds", [
    ("deepseek_v3", "vendor", [[0], [1, 2]]),  # block FP8: a dense layer, then MoE
    ("glm_moe_dsa", "vendor", [[0], [1, 2]]),  # + the DSA indexer
    ("kimi_k25", "vendor", [[0], [1, 2]]),  # Moonshot's INT4 routed experts (weight_packed)
    ("llama", "bf16", [[0, 1]]),
])
def test_near_misses_pass_without_a_read(arch, layout, kinds, tiny, reads):
    st = LayerStreamer(tiny(arch, layout=layout))
    try:
        assert st.check_layers() == kinds
    finally:
        st.close()
    assert reads == []


def test_our_int4_output_and_an_unused_extra_tensor_pass(converted, dsv3, tmp_path, reads):
    """Near misses: a converted (INT4 pack-quantized) model's layers pass; so does a source with a
    tensor the layer class does not take (transformers' class decides what is needed)."""
    out = converted("deepseek_v3")
    reads.clear()  # making the output read its source
    st = LayerStreamer(out)
    try:
        assert st.check_layers() == [[0], [1, 2]]
    finally:
        st.close()
    src = _copy(dsv3, tmp_path / "src")
    import torch

    save_file({"model.layers.1.mlp.extra.weight": torch.zeros(2, 2, dtype=torch.bfloat16)},
              str(src / "extra.safetensors"), metadata={"format": "pt"})
    idx = json.loads((src / INDEX).read_text())
    idx["weight_map"]["model.layers.1.mlp.extra.weight"] = "extra.safetensors"
    (src / INDEX).write_text(json.dumps(idx))
    st = LayerStreamer(src)
    try:
        st.check_layers()
    finally:
        st.close()
    assert reads == []


@pytest.mark.parametrize("arch,layout", [("deepseek_v3", "vendor"), ("glm_moe_dsa", "vendor"),
                                         ("kimi_k25", "vendor"), ("llama", "bf16")])
def test_the_check_resolves_the_names_layer_reads(arch, layout, tiny):
    """``sources`` (the check's names) and ``layer`` (what the stream reads) agree name for name,
    so a layer that passes the check loads: the guarantee prepare's real layer 0 used to give."""
    import torch

    st = LayerStreamer(tiny(arch, layout=layout))
    read: list[str] = []
    real = st.tensor
    st.tensor = lambda name, device=None: (read.append(name), real(name, device))[1]
    try:
        for i in range(st.num_layers):
            cls = getattr(st.modeling, st.prefix + "DecoderLayer")
            with torch.device("meta"):
                meta = cls(st.config, layer_idx=i)
            want = [n for k, v in meta.state_dict().items() for n, _ in st.sources(i, k, tuple(v.shape))]
            read.clear()
            st.layer(i)
            assert len(read) == len(want) and sorted(read) == sorted(want), i
    finally:
        st.close()


def test_transformers_refusing_a_layer_is_one_line_before_a_read(dsv3, tmp_path, reads):
    src = _copy(dsv3, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_act"] = "no_such_activation"
    (src / "config.json").write_text(json.dumps(cfg))
    st = LayerStreamer(src)
    try:
        with pytest.raises(QuantizeError, match=r"transformers cannot build decoder layer 0 \(KeyError: .*\); "
                                                r"use --method rtn$"):
            st.check_layers(build_fix="use --method rtn")
    finally:
        st.close()
    assert reads == []


# -- quantize run: calibrate-kv's tokenizer is the source's, checked before convert runs --------------------

def _run_recipe(stages):
    def setup(ctx):
        from quantize import pipeline

        doc = yaml.safe_load(pipeline.default_recipe().read_text())
        doc["pipeline"].update(source=str(ctx.src), out=str(ctx.tmp / "run"), stages=stages,
                               kv={"target": "sglang", "samples": 2, "seq_len": 16})
        (ctx.tmp / "r.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))

    return setup


def test_run_refuses_a_missing_tokenizer_before_convert(dsv3, tmp_path, reads):
    """convert (RTN) then calibrate-kv: the kv stage's tokenizer (the converted model's, copied
    from the source) used to be looked for after the whole conversion."""
    def setup(ctx):
        _no_tokenizer(ctx)
        _run_recipe(["convert", "calibrate-kv"])(ctx)

    msg = run_case(Case("run: no tokenizer", lambda c: ["run", c.tmp / "r.yaml"], "no tokenizer files", setup),
                   tmp_path, {"src": dsv3})
    assert str(tmp_path / "src") in msg and not (tmp_path / "run").exists() and reads == []


def test_run_preflight_near_misses(dsv3, tmp_path, reads):
    """With the tokenizer the preflight passes; without one, a run whose stages tokenize nothing
    (RTN convert alone) is not refused for it."""
    from quantize import pipeline

    for name, stages, drop in (("ok", ["convert", "calibrate-kv"], False), ("rtn", ["convert"], True)):
        ctx = SimpleNamespace(src=_copy(dsv3, tmp_path / name / "src"), tmp=tmp_path / name)
        if drop:
            _no_tokenizer(ctx)
        _run_recipe(stages)(ctx)
        pipeline._calibration_preflight(pipeline.load_pipeline(ctx.tmp / "r.yaml"))
    assert reads == []


def test_autoround_whose_expert_state_cannot_fit_is_refused_before_a_read(dsv3, tmp_path, reads, monkeypatch):
    """AutoRound holds a rank's share of a MoE layer's routed experts' training state whole
    (tuning.state_bytes); where the memory free for it is less, one line before a weight is read,
    naming what it needs; with exactly enough, the check passes."""
    import psutil

    from quantize.distributed import World
    from quantize.methods import tuning

    st = LayerStreamer(dsv3)
    h, i = st.expert_dims()
    need = tuning.state_bytes(h, i, 8)  # the tiny DeepSeek-V3: 8 routed experts, all on the one rank
    assert need == 12 * 8 * 3 * h * i * 4
    tuning.check_memory(st, "cpu", World(), free=need)  # exactly enough: passes
    with pytest.raises(QuantizeError, match=r"a rank would hold about .* GiB .*\(8 experts over 1 rank\(s\): 8 each, "
                                            r"x 12 fp32 copies .*run on GPUs \(--device cuda --nproc N\)"):
        tuning.check_memory(st, "cpu", World(), free=need - 1)
    # on GPUs: the smallest number of them that holds each rank's share (2 experts each: 4 GPUs)
    with pytest.raises(QuantizeError, match=r"on its GPU; spread the experts over 4 GPUs or more \(--nproc 4"):
        tuning.check_memory(st, "cuda", World(), free=tuning.state_bytes(h, i, 2))
    with pytest.raises(QuantizeError, match="even one expert per GPU does not fit"):
        tuning.check_memory(st, "cuda", World(), free=tuning.state_bytes(h, i, 1) - 1)
    tuning.check_memory(st, "cuda", World(rank=0, size=4, local_size=4), free=tuning.state_bytes(h, i, 2))  # 4 ranks
    # the command: one line, nothing written, nothing read
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=need - 1))
    run_case(Case("autoround: expert state", lambda c: ["convert", c.src, c.new("q"), "--method", "autoround",
                                                        *CAL], "more than the"), tmp_path, {"src": dsv3})
    assert not (tmp_path / "q").exists() and reads == []
    # --init gptq holds START_COPIES more (the code offsets, the GPTQ start until taken): 14 copies
    assert tuning.state_copies(SimpleNamespace(init="gptq")) == 14 and tuning.state_copies(SimpleNamespace()) == 12
    start = tuning.state_bytes(h, i, 8, 14)
    assert start == 14 * 8 * 3 * h * i * 4
    tuning.check_memory(st, "cpu", World(), free=start, copies=14)
    with pytest.raises(QuantizeError, match=r"x 14 fp32 copies"):
        tuning.check_memory(st, "cpu", World(), free=start - 1, copies=14)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=need))  # enough for --init rtn
    run_case(Case("autoround --init gptq: expert state", lambda c: ["convert", c.src, c.new("g"), "--method",
                                                                    "autoround", "--init", "gptq", *CAL],
                  "x 14 fp32 copies"), tmp_path / "init", {"src": dsv3})  # its own folder: a second copy
    assert not (tmp_path / "init" / "g").exists() and reads == []
