"""Hostile INT4 sources (issue 17's bad input): Moonshot's layout made wrong one way at a time. Each
case: one line naming the tensor or key, a non-zero exit, the source unchanged, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

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

# issue 35: the messages say what is wrong with the value, and the fix the command in use has
EXPERTS_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "glm-5.2-w4a16-experts.yaml"


def _int4_glm(drop: str):
    """Setup: ctx.tmp/int4, the GLM tiny converted by the experts recipe less its ``drop`` ignore
    line, so that role is INT4 in what the case then converts."""

    def setup(c):
        from quantize.convert import convert as conv

        lines = [ln for ln in EXPERTS_RECIPE.read_text().splitlines() if drop not in ln]
        (c.tmp / "r.yaml").write_text("\n".join(lines) + "\n")
        conv(c.src, c.tmp / "int4", recipe=str(c.tmp / "r.yaml"))

    return setup


CASES += [
    Case("convert: num_bits a string", convert(), "config_groups.group_0.weights.num_bits is '4', a str; it must "
         "be an integer (4 for INT4)", _w(num_bits="4"), needs=K),
    Case("plan: weights null", plan, "quantization_config.config_groups.group_0.weights is null; a pack-quantized "
         "group needs its weights scheme", _qc(lambda q: q["config_groups"]["group_0"].update(weights=None)), needs=K),
    Case("convert: weights missing", convert(), "config_groups.group_0.weights is missing",
         _qc(lambda q: (q["config_groups"]["group_0"].pop("weights"), None)[1]), needs=K),
    Case("convert: an INT4 eh_proj under --profile experts",
         lambda c: ["convert", c.tmp / "int4", c.new("o"), "--profile", "experts"],
         "model.layers.3.eh_proj is INT4 in the source, but --profile experts keeps it high precision; INT4 weights "
         "are not widened back, no profile makes mtp_proj tensors INT4: pass a --recipe that targets it",
         _int4_glm("eh_proj"), needs=("src",), inputs=lambda c: [c.tmp / "int4"]),
    Case("convert: INT4 shared experts under --profile experts", lambda c: ["convert", c.tmp / "int4", c.new("o")],
         "--profile experts keeps it high precision; INT4 weights are not widened back, use --profile all-linear",
         _int4_glm("shared_experts"), needs=("src",), inputs=lambda c: [c.tmp / "int4"]),
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


def test_an_int4_eh_proj_passes_with_a_recipe_that_targets_it(tmp_path, hostile_sources):
    """The near miss of the eh_proj case: the recipe that made it INT4 keeps it INT4, bit for bit."""
    from types import SimpleNamespace

    from quantize.convert import convert as conv

    c = SimpleNamespace(src=hostile_sources["src"], tmp=tmp_path)
    _int4_glm("eh_proj")(c)
    conv(tmp_path / "int4", tmp_path / "again", recipe=str(tmp_path / "r.yaml"))
    idx = json.loads((tmp_path / "again" / "model.safetensors.index.json").read_text())
    assert "model.layers.3.eh_proj.weight_packed" in idx["weight_map"]
