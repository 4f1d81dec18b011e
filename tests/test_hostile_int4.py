"""Hostile INT4 sources (issue 17's bad input): Moonshot's layout made wrong one way at a time. Each
case: one line naming the tensor or key, a non-zero exit, the source unchanged, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hostile import Case, edit_json, run_case

M = "language_model.model.layers.1.mlp.experts.0.gate_proj"


def _tensors(fn):
    """Edit the shard holding expert 0's gate_proj of layer 1 (``fn(tensors)``), keeping the index."""

    def setup(c):
        idx_path = c.kimi / "model.safetensors.index.json"
        idx = json.loads(idx_path.read_text())
        f = c.kimi / idx["weight_map"][M + ".weight_packed"]
        t = load_file(f)
        fn(t)
        save_file(t, f, metadata={"format": "pt"})
        wm = {k: v for k, v in idx["weight_map"].items() if v != f.name or k in t}
        wm.update({k: f.name for k in t})
        idx["weight_map"] = wm
        idx_path.write_text(json.dumps(idx))

    return setup


def _qc(fn):
    return lambda c: edit_json(c.kimi / "config.json", lambda d: fn(d["quantization_config"]))


def _w(**kw):
    return _qc(lambda q: q["config_groups"]["group_0"]["weights"].update(kw))


def convert(*extra):
    return lambda c: ["convert", str(c.kimi), str(c.new("o")), *extra]


def plan(c):
    return ["plan", str(c.kimi)]


def calibrate(c):
    return ["calibrate-kv", str(c.kimi), "--samples", "2", "--seq-len", "16"]


K = ("kimi",)
BAD = [
    ("config symmetric false", _w(symmetric=False), "asymmetric INT4"),
    ("a weight_zero_point tensor", _tensors(lambda t: t.update({M + ".weight_zero_point": torch.zeros(32, 8, dtype=torch.int32)})),
     f"{M}.weight_zero_point: asymmetric INT4"),
    ("config actorder group", _w(actorder="group"), "act-order"),
    ("a weight_g_idx tensor", _tensors(lambda t: t.update({M + ".weight_g_idx": torch.zeros(256, dtype=torch.int32)})),
     f"{M}.weight_g_idx: act-order"),
    ("group size not dividing K", _w(group_size=48), "not a multiple of the group size 48"),
    ("group size of another scale shape", _w(group_size=64), "weight_scale is [256, 8], but a [256, 256] weight in groups of 64"),
    ("weight_shape disagrees", _tensors(lambda t: t.update({M + ".weight_shape": torch.tensor([256, 128])})),
     f"{M}.weight_shape says [256, 128]"),
    ("weight_shape rows disagree", _tensors(lambda t: t.update({M + ".weight_shape": torch.tensor([255, 256])})),
     f"{M}.weight_shape says [255, 256]"),
    ("missing weight_scale", _tensors(lambda t: t.pop(M + ".weight_scale")), f"{M} has no weight_scale"),
    ("missing weight_shape", _tensors(lambda t: t.pop(M + ".weight_shape")), f"{M} has no weight_shape"),
    ("missing weight_packed", _tensors(lambda t: t.pop(M + ".weight_packed")), f"{M} has no weight_packed"),
    ("packed as int64", _tensors(lambda t: t.update({M + ".weight_packed": t[M + ".weight_packed"].long()})),
     "packed INT4 codes are a 2-D int32"),
    ("a group whose targets match nothing",
     _qc(lambda q: q["config_groups"].update(group_1={**q["config_groups"]["group_0"], "targets": ["re:.*nope.*"]})),
     "config_groups.group_1 targets ['re:.*nope.*'], which match no INT4 tensor"),
    ("the experts ignored", _qc(lambda q: q["ignore"].append("re:.*experts.*")), "is stored INT4, but the quantization_config"),
    ("no quantization_config", lambda c: edit_json(c.kimi / "config.json", lambda d: (d.pop("quantization_config"), None)[1]),
     "declares no compressed-tensors INT4"),
    ("another format", _qc(lambda q: q["config_groups"]["group_0"].update(format="marlin-24")), "'marlin-24'"),
    ("activations quantized", _qc(lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float"})), "input_activations is set"),
    ("INT8 pack-quantized", _w(num_bits=8), "only INT4"),
    ("channel strategy", _w(strategy="channel"), "strategy is 'channel'"),
    ("group size a string", _w(group_size="32"), "group_size is '32'"),
]

CASES = [Case(f"convert: {name}", convert(), expect, setup, needs=K) for name, setup, expect in BAD]
CASES += [Case(f"plan: {name}", plan, expect, setup, needs=K) for name, setup, expect in BAD[:6] + BAD[12:14]]
CASES += [
    Case("convert: another group size without --requantize", convert("--group-size", "64"), "add --requantize",
         needs=K),
    Case("convert: GPTQ without --requantize", convert("--method", "gptq"), "method gptq would re-quantize",
         needs=K),
    Case("convert: the experts kept high precision",
         lambda c: ["convert", str(c.kimi), str(c.new("o")), "--recipe", str(c.tmp / "r.yaml")], "keeps it high precision",
         lambda c: (c.tmp / "r.yaml").write_text(
             "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      ignore: ['re:.*experts.*', "
             "'re:.*lm_head$', 're:.*embed_tokens.*', 're:.*mlp\\\\.gate$', 're:.*vision_tower.*', "
             "'re:.*mm_projector.*']\n      config_groups:\n        g:\n          targets: [Linear]\n"
             "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}\n"),
         needs=K, inputs=lambda c: [c.kimi, c.tmp / "r.yaml"]),
    Case("convert: fp8-block with a group size", convert("--scheme", "fp8-block", "--group-size", "32"),
         "--group-size is an INT4 option", needs=K),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hostile_int4(case, tmp_path, hostile_sources):
    run_case(case, tmp_path, hostile_sources)
    assert not (tmp_path / "o").exists()  # nothing written


def test_near_misses_pass(tmp_path, hostile_sources):
    """What the table spoils, left right: each corrected field converts (or plans)."""
    from quantize.convert import convert as conv
    from quantize.plan import plan as pl

    src = hostile_sources["kimi"]
    assert pl(src).source_format == "ct-int4"
    conv(src, tmp_path / "ok")  # the release as shipped
    conv(src, tmp_path / "g", group_size=32, observer="minmax")  # its own scheme, named explicitly
    conv(src, tmp_path / "rq", group_size=64, requantize=True)
