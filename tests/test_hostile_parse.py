"""Hostile input, the parsers: JSON and YAML of any depth, encoding, alias expansion or size are
one line naming the file (quantize.parse)."""

from pathlib import Path

import pytest

from tests.hostile import Case, edit_json, run_case

DEEP = "[" * 100_000 + "]" * 100_000
LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)


def _write(rel: str, data, where: str = "src"):
    def setup(ctx):
        p = getattr(ctx, where) / rel
        p.write_bytes(data if isinstance(data, bytes) else data.encode())

    return setup


def _recipe(text):
    def setup(ctx):
        (ctx.tmp / "r.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())

    return setup


CASES = [
    Case("plan: deep config.json", lambda c: ["plan", c.src], "nests deeper than 64 levels",
         _write("config.json", '{"a": ' + DEEP + "}")),
    Case("plan: config.json not UTF-8", lambda c: ["plan", c.src], "not UTF-8", _write("config.json", b"\xff\xfe{}")),
    Case("convert: deep index", lambda c: ["convert", c.src, c.new("o")], "nests deeper than 64 levels",
         _write("model.safetensors.index.json", '{"weight_map": ' + DEEP + "}")),
    Case("check: deep manifest", lambda c: ["check", c.out], "nests deeper", _write("quantize_manifest.json", DEEP, "out"),
         needs=("out",), code=2),
    Case("run: recursive recipe alias", lambda c: ["run", c.tmp / "r.yaml"], "refers to itself",
         _recipe("pipeline: &a [*a]\n"), needs=()),
    Case("run: billion laughs recipe", lambda c: ["run", c.tmp / "r.yaml"], "values", _recipe(LAUGHS), needs=()),
    Case("run: non-UTF-8 recipe", lambda c: ["run", c.tmp / "r.yaml"], "not UTF-8", _recipe(b"pipeline: \xff\n"),
         needs=()),
    Case("run: recipe is a folder", lambda c: ["run", c.tmp], "is a folder", needs=()),
    Case("convert: deep recipe", lambda c: ["convert", c.src, c.new("o"), "--recipe", c.tmp / "r.yaml"],
         "nests deeper", _recipe("[" * 5000 + "]" * 5000)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hostile(case, tmp_path, hostile_sources):
    run_case(case, tmp_path, hostile_sources)


USAGE = [
    Case("convert: --group-size abc", lambda c: ["convert", c.src, c.new("o"), "--group-size", "abc"],
         "quantize convert: Invalid value for '--group-size'"),
    Case("shard: --tp 1e999", lambda c: ["shard", c.out, c.new("s"), "--tp", "1e999"], "Invalid value for '--tp'",
         needs=("out",)),
    Case("convert: missing argument", lambda c: ["convert"], "Missing argument", needs=()),
    Case("convert: unknown option", lambda c: ["convert", c.src, c.new("o"), "--bogus"], "No such option: --bogus"),
    Case("unknown command", lambda c: ["nosuch"], "No such command 'nosuch'", needs=()),
]


@pytest.mark.parametrize("case", USAGE, ids=str)
def test_usage_errors_are_one_line_too(case, tmp_path, hostile_sources):
    """What click refuses before our code runs (a value of the wrong type, an unknown option or
    command, a missing argument) is one line naming the command, not a usage box."""
    assert "--help" in run_case(case, tmp_path, hostile_sources)


def test_help_still_exits_0():
    from typer.testing import CliRunner

    from quantize.cli import app

    res = CliRunner().invoke(app, ["convert", "--help"])
    assert res.exit_code == 0 and "--group-size" in res.stdout


# -- recipes as strict as --set (issue 35): every key known at any depth, or one line with did-you-mean ----------
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHIPPED = sorted(RECIPES.glob("*.yaml")) + [Path(__file__).resolve().parents[1] / "quantize/recipes_default/tiny-glm.yaml"]
EXPERTS = RECIPES / "glm-5.2-w4a16-experts.yaml"
AT = "quant_stage.quant_modifiers.QuantizationModifier."


def _edited(old: str, new: str, base: Path = EXPERTS):
    """Setup: ``base`` with ``old`` replaced by ``new`` once, as ctx.tmp/r.yaml."""

    def setup(ctx):
        text = base.read_text()
        assert text.count(old) >= 1, old
        (ctx.tmp / "r.yaml").write_text(text.replace(old, new, 1))

    return setup


def _convert_recipe(c):
    return ["convert", c.src, c.new("o"), "--recipe", c.tmp / "r.yaml"]


def _inputs(c):
    return [c.src, c.tmp / "r.yaml"]


TYPOS = [  # (where, old, new, fragment): one typo at each depth
    ("a top-level key", "quant_stage:\n", "argz: {}\nquant_stage:\n", "argz: unknown key; did you mean 'args'?"),
    ("the stage", "quant_stage:\n", "quant_stag:\n", "no QuantizationModifier found; a recipe needs quant_stage"
     ".quant_modifiers.QuantizationModifier (or GPTQModifier, AutoRoundModifier); did you mean quant_stage for "
     "'quant_stag'?"),
    ("a stage's group", "  quant_modifiers:", "  quant_modifier:",
     "quant_stage.quant_modifier: unknown key; did you mean 'quant_modifiers'?"),
    ("the modifier", "QuantizationModifier:", "QuantizationModifer:",
     "quant_stage.quant_modifiers.QuantizationModifer: not a modifier this tool runs; did you mean "
     "'QuantizationModifier'?"),
    ("a modifier argument", "      ignore:", "      ignores:", AT + "ignores: unknown key; did you mean 'ignore'?"),
    ("a config group key", "          targets:", "          target:",
     AT + "config_groups.group_0.target: unknown key; did you mean 'targets'?"),
    ("a weights key", "group_size: 32", "group_sise: 32",
     AT + "config_groups.group_0.weights.group_sise: unknown key; did you mean 'group_size'?"),
    ("an observer mapping key", "      ignore:", "      observer: {weight: mse}\n      ignore:",
     AT + "observer.weight: unknown key; did you mean 'weights'?"),
    ("a kv_cache_scheme key", "      ignore:", "      kv_cache_scheme: {num_bit: 8}\n      ignore:",
     AT + "kv_cache_scheme.num_bit: unknown key; did you mean 'num_bits'?"),
    ("an activations key", "          weights:", "          input_activations: {dynamc: true}\n          weights:",
     AT + "config_groups.group_0.input_activations.dynamc: unknown key; did you mean 'dynamic'?"),
]
MEANINGS = [  # keys llm-compressor knows whose value this tool would not honour: refused, not ignored
    ("num_bits a string", "num_bits: 4", 'num_bits: "4"',
     AT + "config_groups.group_0.weights.num_bits is '4', a str; it must be an integer"),
    ("symmetric a string", "symmetric: true", 'symmetric: "true"', "weights.symmetric is 'true', a str; it must be "
     "true or false"),
    ("dynamic weights", "strategy: group", "strategy: group\n            dynamic: true", "asks for {'dynamic': True}"),
    ("a scale dtype", "strategy: group", "strategy: group\n            scale_dtype: float32",
     "asks for {'scale_dtype': 'float32'}"),
    ("observer_kwargs", "observer: minmax", "observer: mse\n            observer_kwargs: {maxshrink: 0.5}",
     "weights.observer_kwargs {'maxshrink': 0.5}: this tool's observers take no arguments; drop it"),
    ("kv_cache_scheme", "      ignore:", "      kv_cache_scheme: {num_bits: 8, type: float}\n      ignore:",
     AT + "kv_cache_scheme: convert writes no KV-cache scales; calibrate them with `quantize calibrate-kv`"),
    ("another modifier", "    QuantizationModifier:", "    SmoothQuantModifier: {smoothing_strength: 0.8}\n"
     "    QuantizationModifier:", "quant_modifiers.SmoothQuantModifier: not a modifier this tool runs; this tool runs "
     "QuantizationModifier, GPTQModifier, AutoRoundModifier; drop it"),
    ("two modifiers", "    QuantizationModifier:", "    GPTQModifier: {scheme: W4A16}\n    QuantizationModifier:",
     "2 modifiers (quant_stage.quant_modifiers.GPTQModifier, quant_stage.quant_modifiers.QuantizationModifier)"),
    ("a modifier at the top", "quant_stage:\n", "QuantizationModifier: {scheme: W4A16}\nquant_stage:\n",
     "QuantizationModifier at the top of the recipe"),
    ("a format not written", "          targets:", "          format: marlin-24\n          targets:",
     "asks for {'format': 'marlin-24'}"),
    ("a modifier's weight observer not a name", "      ignore:", "      weight_observer: [mse]\n      ignore:",
     AT + "weight_observer is ['mse']; name an observer"),
]


def _weights_null(ctx):
    text = EXPERTS.read_text()
    head, _, rest = text.partition("          weights:\n")
    (ctx.tmp / "r.yaml").write_text(head + "          weights: null\n")


RECIPE_CASES = [Case(f"convert --recipe: a typo in {w}", _convert_recipe, frag, _edited(old, new), inputs=_inputs)
                for w, old, new, frag in TYPOS]
RECIPE_CASES += [Case(f"convert --recipe: {w}", _convert_recipe, frag, _edited(old, new), inputs=_inputs)
                 for w, old, new, frag in MEANINGS]
RECIPE_CASES += [
    Case("convert --recipe: weights null", _convert_recipe,
         AT + "config_groups.group_0.weights is null; a config group needs its weights scheme", _weights_null,
         inputs=_inputs),
    Case("convert --recipe: scheme a mapping", _convert_recipe, AT + "scheme is a mapping; this tool reads a preset",
         lambda c: (c.tmp / "r.yaml").write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n"
                                                 "      scheme: {W4A16: [Linear]}\n"), inputs=_inputs),
]
DEFAULT = Path(__file__).resolve().parents[1] / "quantize/recipes_default/tiny-glm.yaml"


def _run_recipe(old, new):
    def setup(ctx):
        text = DEFAULT.read_text().replace("demo-out/run", str(ctx.tmp / "run"))
        assert old in text, old
        (ctx.tmp / "r.yaml").write_text(text.replace(old, new, 1))

    return setup


RECIPE_CASES += [
    Case("run: a typo in the llm-compressor part", lambda c: ["run", c.tmp / "r.yaml", "--plan"],
         AT + "config_groups.group_0.weights.group_sise: unknown key; did you mean 'group_size'?",
         _run_recipe("group_size: 32", "group_sise: 32"), needs=()),
    Case("run: a typo in the pipeline section's name", lambda c: ["run", c.tmp / "r.yaml", "--plan"],
         "no `pipeline:` section (did you mean pipeline for 'pipline'?)", _run_recipe("pipeline:", "pipline:"),
         needs=()),
    Case("run: a typo in a pipeline key", lambda c: ["run", c.tmp / "r.yaml", "--plan"],
         "pipeline.max_dorp: unknown key; did you mean 'max_drop'?", _run_recipe("max_drop:", "max_dorp:"), needs=()),
    Case("run: a typo in a pipeline section key", lambda c: ["run", c.tmp / "r.yaml", "--plan"],
         "pipeline.kv.seq_lne: unknown key; did you mean 'seq_len'?", _run_recipe("seq_len:", "seq_lne:"), needs=()),
]


@pytest.mark.parametrize("case", RECIPE_CASES, ids=str)
def test_recipe_keys_known_or_refused(case, tmp_path, hostile_sources):
    run_case(case, tmp_path, hostile_sources)
    assert not (tmp_path / "o").exists() and not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    from quantize.recipe import load_recipe

    r = load_recipe(recipe)
    assert (r.scheme, r.group_size, r.observer, r.method) == ("w4a16", 32, "minmax", "rtn")


def _saved_by_llm_compressor(tmp_path):
    """Recipes as llm-compressor 0.14 itself saves them (Recipe.yaml: every non-null field, e.g.
    block_structure / scale_dtype / observer_kwargs spelled out): each loads."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.recipe import Recipe

    s = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                        strategy="group", group_size=32))
    mods = {"gptq-preset": GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
            "gptq-groups": GPTQModifier(config_groups={"group_0": s}, ignore=["lm_head"], actorder=None),
            "rtn-groups": QuantizationModifier(config_groups={"group_0": s}, ignore=["lm_head"]),
            "autoround": AutoRoundModifier(config_groups={"group_0": s}, ignore=["lm_head"], iters=5),
            "fp8-preset": QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=["lm_head"]),
            "fp8-groups": QuantizationModifier(config_groups={"g": preset_name_to_scheme("FP8_BLOCK", ["Linear"])})}
    out = {}
    for name, m in mods.items():
        out[name] = tmp_path / f"{name}.yaml"
        Recipe.from_modifiers(m).yaml(str(out[name]))
    return out


def test_recipes_llm_compressor_saves_load(tmp_path):
    """The near misses: every key llm-compressor writes is known (the saved recipes spell out each
    default), as are `args`, a stage's `run_type`, the older GPTQ keys and a modifier's observer."""
    from quantize.recipe import load_recipe

    got = {n: load_recipe(p) for n, p in _saved_by_llm_compressor(tmp_path).items()}
    assert {n: (r.method, r.scheme, r.group_size) for n, r in got.items()} == {
        "gptq-preset": ("gptq", "w4a16", 128), "gptq-groups": ("gptq", "w4a16", 32),
        "rtn-groups": ("rtn", "w4a16", 32), "autoround": ("autoround", "w4a16", 32),
        "fp8-preset": ("rtn", "fp8-block", 32), "fp8-groups": ("rtn", "fp8-block", 32)}
    text = EXPERTS.read_text()
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text("args: {}\n" + text.replace("quant_stage:\n", "quant_stage:\n  run_type: oneshot\n").replace(
        "QuantizationModifier:", "GPTQModifier:\n      sequential_update: true\n      offload_hessians: false\n"
        "      sequential_targets: [DeepseekV3DecoderLayer]\n      observer: {weights: mse, input: minmax}\n"
        "      dampening_frac: 0.01\n      start: 0\n      index: 0\n      group: quant"))
    r = load_recipe(legacy)
    assert (r.method, r.observer, r.damp, r.group_size) == ("gptq", "mse", 0.01, 32)  # the modifier's observer wins
    wo = tmp_path / "wo.yaml"
    wo.write_text(text.replace("      ignore:", "      weight_observer: mse\n      ignore:", 1))
    assert load_recipe(wo).observer == "mse"


def test_the_known_keys_are_llm_compressors():
    """The key tuples of quantize.recipe are the pydantic fields of llm-compressor's modifiers and
    compressed-tensors' scheme / args (less their private state fields), plus the legacy keys."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    from quantize import recipe as R

    legacy = {"sequential_update", "sequential_targets", "offload_hessians"}
    for cls in (QuantizationModifier, GPTQModifier, AutoRoundModifier):
        theirs = {k for k in cls.model_fields if not k.endswith("_")}
        assert theirs == set(R.MODIFIER_KEYS[cls.__name__]) - legacy, cls.__name__
    from llmcompressor.modifiers import ModifierFactory

    ModifierFactory.refresh()
    names = {*ModifierFactory._main_registry, *ModifierFactory._experimental_registry,
             *ModifierFactory._registered_registry}
    assert names == {*R.MODIFIERS, *R.NOT_RUN}
    assert set(QuantizationScheme.model_fields) == set(R.SCHEME_KEYS)
    assert set(QuantizationArgs.model_fields) == set(R.ARGS_KEYS)
