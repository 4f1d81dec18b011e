"""One declaration per command (quantize/options.py): the command line, the library function and
the `quantize run` recipe all come from it, and every bound refuses a near miss in one line."""

import dataclasses
import json
import inspect
from types import SimpleNamespace

import pytest
import yaml
from typer.main import get_command
from typer.testing import CliRunner

from quantize import options as O
from quantize import pipeline
from quantize.cli import app
from quantize.errors import QuantizeError

LIBRARY = {  # command -> (its options, its library function)
    "convert": (O.ConvertOptions, "quantize.convert:convert"),
    "plan": (O.PlanOptions, "quantize.plan:plan"),
    "shard": (O.ShardOptions, "quantize.shard:shard"),
    "check": (O.CheckOptions, "quantize.check:check"),
    "eval": (O.EvalOptions, "quantize.evaluate.run:evaluate"),
    "eval-kld": (O.KLDOptions, "quantize.evaluate.kld:kld_table"),
    "make-tiny": (O.MakeTinyOptions, "quantize.testing.tiny:make_tiny"),
    "calibrate-kv": (O.CalibrateKVOptions, "quantize.calibrate.kv:calibrate_kv"),
    "eval-pd": (O.PDOptions, "quantize.evaluate.pd:pd_fidelity"),
    "push": (O.PushOptions, "quantize.publish.push:push"),
    "card": (O.CardOptions, "quantize.publish.card:card"),
    "run": (O.RunOptions, "quantize.pipeline:run"),
}


def _fn(ref):
    import importlib

    mod, name = ref.split(":")
    return getattr(importlib.import_module(mod), name)


def _cli_params(name):
    return {p.name: p for p in get_command(app).commands[name].params}


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_command_line_and_library_are_the_declaration(name):
    model, ref = LIBRARY[name]
    fn = _fn(ref)
    assert fn.options is model
    declared = [f.name for f in dataclasses.fields(model)]
    lib = [p for p in inspect.signature(fn).parameters if p != "emit"]
    assert lib == declared  # the same names, in the same order, with the declared defaults
    for f in dataclasses.fields(model):
        assert inspect.signature(fn).parameters[f.name].default == f.default
    cli = _cli_params(name)
    for f in dataclasses.fields(model):
        s = O.spec(f)
        assert (f.name in cli) == s.cli, f.name
        if s.cli and not s.argument:
            assert cli[f.name].default == f.default, f.name  # one default, the declared one
            assert cli[f.name].help.startswith(s.help) if s.help else cli[f.name].help is None


def test_every_convert_option_is_a_recipe_key_unless_it_is_the_runs_own():
    section = pipeline.SECTIONS["convert"]
    recipe = {f.name for f in dataclasses.fields(O.ConvertOptions) if O.spec(f).recipe and not O.spec(f).argument}
    assert set(section.model_fields) == recipe
    assert {"source", "out", "recipe", "data", "resume", "overwrite"}.isdisjoint(section.model_fields)
    for k, f in section.model_fields.items():
        assert f.default == next(x.default for x in dataclasses.fields(O.ConvertOptions) if x.name == k)
    # where the recipe's default differs from the command line's, it is said in one place
    assert pipeline.SECTIONS["push"].model_fields["dry_run"].default is True
    assert pipeline.TOP.model_fields["tasks"].default == "arc_easy"


@pytest.mark.parametrize("kw,fragment", [
    ({"group_size": 48}, "--group-size 48: not served by the engines' INT4 kernels; use one of 32, 64, 128"),
    ({"memory_budget_gib": -0.001}, "--memory-budget-gib -0.001: must be 0 or more GiB"),
    ({"memory_budget_gib": float("inf")}, "--memory-budget-gib inf: not a finite number; must be 0 or more GiB"),
    ({"memory_budget_gib": float("nan")}, "--memory-budget-gib nan: not a finite number; must be 0 or more GiB"),
    ({"samples": 0, "method": "gptq"}, "--samples 0: must be at least 1"),
    ({"seq_len": 1, "method": "gptq"}, "--seq-len 1: must be at least 2 tokens"),
    ({"damp": 0.0, "method": "gptq"}, "--damp 0.0: the Hessian dampening fraction must be in (0, 1]"),
    ({"damp": 1.0001, "method": "gptq"}, "--damp 1.0001: the Hessian dampening fraction must be in (0, 1]"),
    ({"iters": -1, "method": "autoround"}, "--iters -1: must be 0"),
    ({"lr": 0.0, "method": "autoround"}, "--lr 0.0: the learning rate must be a positive number"),
    ({"batch_size": 0, "method": "autoround"}, "--batch-size 0: must be at least 1 sample"),
    ({"min_expert_tokens": -1, "method": "gptq"}, "--min-expert-tokens -1: must be 0 or more tokens"),
    ({"actorder": "group", "method": "gptq"}, "--actorder group: use static"),
    ({"observer": "minmaxx"}, "--observer minmaxx: unknown; use one of minmax, mse, fullrange, fullrange-mse"),
    ({"data": " ", "method": "gptq"}, "--data ' ': empty"),
    ({"samples": True, "method": "gptq"}, "--samples True: not int"),
    # 0 is a value: an option of a data-aware method beside RTN is refused, not dropped
    ({"iters": 0}, "--iters is an option of --method autoround, but the method is rtn"),
    ({"min_expert_tokens": 0}, "--min-expert-tokens is an option of --method gptq or --method autoround"),
])
def test_convert_refuses_a_near_miss_in_one_line(tmp_path, kw, fragment):
    from quantize.convert import convert

    src = tmp_path / "src"  # never read: options are refused before any file is
    with pytest.raises(QuantizeError) as e:
        convert(src, tmp_path / "out", **kw)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kw", [{"memory_budget_gib": 0.0}, {"samples": 1, "method": "gptq"},
                                {"seq_len": 2, "method": "gptq"}, {"damp": 1.0, "method": "gptq"},
                                {"iters": 0, "method": "autoround"}, {"min_expert_tokens": 0, "method": "gptq"}])
def test_the_edge_values_themselves_are_accepted(kw):
    o = O.ConvertOptions(**kw)
    o.validate()
    o.resolve(None)


def test_plan_and_check_bounds(tmp_path):
    from quantize.check import check
    from quantize.plan import plan

    for kw, frag in [({"tp": 0}, "--tp 0: must be from 1 to 4096"), ({"gpu_mem_gib": 0.0}, "--gpu-mem-gib 0.0"),
                     ({"gpu_mem_gib": 1e400}, "--gpu-mem-gib inf"), ({"mem_fraction": 1.01}, "--mem-fraction 1.01"),
                     ({"reserve_gib": -1.0}, "--reserve-gib -1.0")]:
        with pytest.raises(QuantizeError, match=frag.replace("(", r"\(").replace(".", r"\.")):
            plan(tmp_path, **kw)
    for kw, frag in [({"tokens": 0}, "--tokens 0: must be from 1 to 4096 rows"), ({"tp": 0}, "--tp 0: must be from 1 to 4096")]:
        with pytest.raises(QuantizeError, match=frag):
            check(tmp_path, **kw)


@pytest.mark.parametrize("edit,message", [
    ({"convert": {"damp": 0}}, "pipeline.convert.damp is 0"),  # an int where a number is declared: accepted...
    ({"convert": {"memory_budget_gib": -1}}, "pipeline.convert.memory_budget_gib -1.0: must be 0 or more GiB"),
    ({"convert": {"group_size": 48}}, "pipeline.convert.group_size 48: not served"),
    ({"convert": {"samples": True}}, "pipeline.convert.samples is True, not int or null"),
    ({"kv": {"samples": 0}}, "pipeline.kv.samples 0: must be at least 1"),
    ({"kv": {"clip": 0.89}}, "pipeline.kv.clip 0.89: a percentile between 0.9 and 1"),
    ({"kv": {"clip": 1.0}}, "pipeline.kv.clip 1.0: a percentile between 0.9 and 1"),  # 1 is absmax: leave clip off
    ({"kv": {"target": "sglng"}}, "pipeline.kv.target sglng: unknown; use one of sglang, vllm, compressed-tensors; did you mean 'sglang'?"),
    ({"shard": {"tp": 0}}, "pipeline.shard.tp 0: must be from 1 to 4096"),
    ({"pd": {"bootstrap_port": -1}}, "pipeline.pd.bootstrap_port -1: must be a port"),
    ({"pd": {"kv_cache_dtype": "fp8"}}, "pipeline.pd.kv_cache_dtype fp8: use fp8_e4m3"),
    ({"eval": {"if_no_data": "maybe"}}, "pipeline.eval.if_no_data maybe: use fail or skip"),
    ({"max_drop": -0.5}, "pipeline.max_drop -0.5: must be 0 or more points"),
    ({"limit": 0}, "pipeline.limit 0: must be at least 1 document"),
])
def test_recipe_refuses_a_near_miss_in_one_line(tmp_path, edit, message):
    doc = yaml.safe_load(pipeline.default_recipe().read_text())
    doc["pipeline"]["out"] = str(tmp_path / "run")
    for k, v in edit.items():
        if isinstance(v, dict):
            doc["pipeline"].setdefault(k, {}).update(v)
        else:
            doc["pipeline"][k] = v
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(doc))
    if message.endswith("is 0"):  # damp: 0 is an int, accepted as the number 0.0, then refused by its range
        message = "pipeline.convert.damp 0.0: the Hessian dampening fraction must be in (0, 1]"
    with pytest.raises(QuantizeError) as e:
        pipeline.load_pipeline(p)
    assert message in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_the_edge_values_are_accepted_in_a_recipe(tmp_path):
    doc = yaml.safe_load(pipeline.default_recipe().read_text())
    doc["pipeline"].update(out=str(tmp_path / "run"), max_drop=0, limit=1)
    doc["pipeline"].setdefault("convert", {}).update(memory_budget_gib=0)
    doc["pipeline"].setdefault("pd", {}).update(bootstrap_port=65535)
    doc["pipeline"].setdefault("kv", {}).update(clip=0.9, samples=1, seq_len=2)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(doc))
    opts = pipeline.load_pipeline(p).opts
    assert opts["convert"]["memory_budget_gib"] == 0.0 and opts["max_drop"] == 0.0 and opts["kv"]["clip"] == 0.9


def test_a_new_option_is_one_field():
    """What a newcomer writes to add an option: one field. The command line and the recipe
    section both have it, with its help, default and bound."""

    @dataclasses.dataclass
    class WithDummy(O.ConvertOptions):
        dummy_knob: int = O.opt(3, "a dummy option", check=lambda v: v >= 1, why="must be at least 1")

    assert any(p.name == "dummy_knob" and p.default.default == 3 for p in O.cli_parameters(WithDummy))
    section = O.recipe_section(WithDummy)
    assert section.model_fields["dummy_knob"].default == 3
    with pytest.raises(QuantizeError, match="pipeline.convert.dummy_knob 0: must be at least 1"):
        O.parse_section("r.yaml", "pipeline.convert.", {"dummy_knob": 0}, section)
    with pytest.raises(QuantizeError, match="--dummy-knob 0: must be at least 1"):
        WithDummy(dummy_knob=0).validate()
    assert WithDummy(dummy_knob=5).to_dict()["dummy_knob"] == 5  # recorded in the manifest


def test_eval_gate_exit_code_is_decided_once_through_the_cli(monkeypatch, tmp_path):
    """A regression exits 1 whether the report is printed as a table or as JSON; a pass exits 0."""
    import quantize.evaluate.run as run

    def report(passed):
        task = SimpleNamespace(task="arc_easy", n=10, baseline=80.0, baseline_stderr=1.0, candidate=70.0, candidate_stderr=1.0,
                               delta=-10.0, ci_low=-12.0, ci_high=-8.0, passed=passed, conclusive=True)
        return SimpleNamespace(passed=passed, tasks=[task], to_dict=lambda: {"passed": passed}, log=None, kld=None)

    for passed, code in ((False, 1), (True, 0)):
        monkeypatch.setattr(run, "evaluate", lambda *a, _p=passed, **k: report(_p))
        for extra in ([], ["--json"]):
            res = CliRunner().invoke(app, ["eval", "--baseline", str(tmp_path), "--candidate", str(tmp_path), *extra])
            assert res.exit_code == code, (passed, extra, res.output)
    res = CliRunner().invoke(app, ["eval", "--candidate", str(tmp_path)])
    assert res.exit_code == 2 and "--baseline is required" in res.output


def test_old_eval_modes_are_their_own_commands():
    names = set(get_command(app).commands)
    assert {"eval", "eval-kld", "eval-pd"} <= names
    assert "kld" not in _cli_params("eval") and "pd_prefill" not in _cli_params("eval")
    assert {"prefill_model", "decode_model", "source"} <= set(_cli_params("eval-pd"))


def test_a_new_observer_is_one_row_in_each_table(tiny, tmp_path, monkeypatch):
    """docs/extending.md's dummy observer: a name (layout.OBSERVERS) and a grid (int4.GRIDS) are all
    it takes for convert to accept it and write it."""
    import torch

    from quantize.convert import convert
    from quantize.formats import int4, layout
    from .conftest import load_dir

    monkeypatch.setitem(layout.OBSERVERS, "halfrange", "a dummy: scale = group absmax / 4")
    monkeypatch.setitem(int4.GRIDS, "halfrange",
                        int4.Grid(int4._absmax, lambda a, dt: int4._minmax_scale(a * (7.5 / 4), dt)))
    src = tiny("llama", layout="bf16")
    convert(src, tmp_path / "half", observer="halfrange", profile="all-linear")
    convert(src, tmp_path / "minmax", profile="all-linear")
    half, mm = load_dir(tmp_path / "half"), load_dir(tmp_path / "minmax")
    name = next(k for k in half if k.endswith("q_proj.weight_scale"))
    assert torch.allclose(half[name].float(), mm[name].float() * (7.5 / 4), rtol=1e-2)
    manifest = json.loads((tmp_path / "half" / "quantize_manifest.json").read_text())
    assert manifest["options"]["observer"] == "halfrange"


def _recipe_file(tmp_path, modifier: str, observer: str | None):
    from quantize.recipe import load_recipe

    obs = f", observer: {observer}" if observer else ""
    p = tmp_path / f"{modifier}-{observer}.yaml"
    p.write_text(f"""quant_stage:
  quant_modifiers:
    {modifier}:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32{obs}}}
""")
    return load_recipe(p)


def test_each_method_resolves_to_its_default_grid_and_an_explicit_one_wins(tmp_path):
    """Issue 18 item 3: RTN stays on minmax (model_free_ptq's grid), GPTQ and AutoRound run on the
    full-range grid unless --observer or the recipe names one; the resolved grid is what the options,
    the resume key and the manifest carry."""
    assert O.DEFAULT_GRID == {"rtn": "minmax", "gptq": "fullrange", "autoround": "fullrange"}
    got = {m: O.ConvertOptions(method=m).resolve(None) for m in O.METHODS}
    assert {m: o.observer for m, o in got.items()} == O.DEFAULT_GRID
    assert O.ConvertOptions().resolve(None).observer == "minmax"
    assert got["gptq"].key_dict()["observer"] == "fullrange"
    assert O.ConvertOptions(method="gptq", observer="minmax").resolve(None).observer == "minmax"
    assert O.ConvertOptions(observer="fullrange").resolve(None).observer == "fullrange"
    # a recipe: its modifier picks the method, its observer (if any) the grid
    cases = {("GPTQModifier", None): "fullrange", ("GPTQModifier", "minmax"): "minmax",
             ("QuantizationModifier", None): "minmax", ("QuantizationModifier", "fullrange"): "fullrange"}
    for (mod, obs), want in cases.items():
        assert O.ConvertOptions().resolve(_recipe_file(tmp_path, mod, obs)).observer == want, (mod, obs)


def test_method_names_agree_with_the_method_table():
    from quantize.methods.registry import METHODS

    assert O.DATA_AWARE == tuple(METHODS) and O.METHODS == ("rtn", *METHODS)
    assert set(O.DEFAULT_GRID) == set(O.METHODS)
    assert {m for f in dataclasses.fields(O.ConvertOptions) for m in O.spec(f).methods} == set(METHODS)


def _models():
    import dataclasses

    return [m for m in vars(O).values() if isinstance(m, type) and dataclasses.is_dataclass(m)
            and issubclass(m, O.Options) and m is not O.Options]


def test_every_numeric_option_declares_its_range():
    """Issue 16 item 4: an int or float option without a declared check would take -5, 0 or 1e300
    silently; every one has a range (or a fixed set of values)."""
    import dataclasses

    unchecked = [
        f"{m.__name__}.{f.name}"
        for m in _models()
        for f in dataclasses.fields(m)
        if O._base(O.hints(m)[f.name])[0] in (int, float) and O.spec(f).check is None and not O.spec(f).choices
    ]
    assert not unchecked, unchecked


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_every_float_option_refuses_non_finite_values(bad):
    import dataclasses

    n = 0
    for m in _models():
        for f in dataclasses.fields(m):
            if O._base(O.hints(m)[f.name])[0] is not float:
                continue
            obj = m()
            object.__setattr__(obj, f.name, bad)
            with pytest.raises(QuantizeError, match=O.spec(f).flag or O.flag(f.name)):
                O.validate(obj)
            n += 1
    assert n >= 10  # the float options exist (a renamed type would make this loop vacuous)


def test_a_finite_float_near_the_bound_still_passes_the_finiteness_rule():
    O.validate(O.ConvertOptions(memory_budget_gib=0.0))  # finite, at the bound: accepted
    O.validate(O.ConvertOptions(memory_budget_gib=O.MAX_BUDGET_GIB))  # the machine's memory: the upper edge
    with pytest.raises(QuantizeError, match="--memory-budget-gib -0.001"):
        O.validate(O.ConvertOptions(memory_budget_gib=-1e-3))


def test_help_shows_flags_as_flags_and_values_with_their_type():
    """A flag (--resume, --json, --merge, --help) takes no value, so --help shows no "<bool>" after
    it; an option that takes one keeps its type (--tp <int>)."""
    import re

    for name in ["", *get_command(app).commands]:
        out = CliRunner().invoke(app, [name, "--help"] if name else ["--help"], terminal_width=200).output
        assert "<bool>" not in out, name
        assert re.search(r"--help\s+Show this message", out), name
    shard = CliRunner().invoke(app, ["shard", "--help"], terminal_width=200).output
    assert re.search(r"--tp\s+<int>", shard) and re.search(r"--merge\s+reassemble", shard)
    assert re.search(r"--resume\s+continue", CliRunner().invoke(app, ["convert", "--help"], terminal_width=200).output)


# ---- the CPUs a run may use (convert's default --workers, each rank's OMP_NUM_THREADS) ----

@pytest.mark.parametrize("files,quota", [
    ({"cpu.max": "max 100000\n"}, None),  # cgroup v2, no limit
    ({"cpu.max": "250000 100000\n"}, 3),  # --cpus 2.5: rounded up
    ({"cpu.max": "100000 100000\n"}, 1),
    ({"cpu.max": "50000 100000\n"}, 1),  # half a CPU: still one worker
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # cgroup v1, no limit
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),  # nothing to read: no cgroup CPU controller here
])
def test_cgroup_cpu_quota(tmp_path, files, quota):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert O.cgroup_cpu_quota(str(tmp_path)) == quota


def test_usable_cpus_is_the_affinity_capped_by_the_quota(tmp_path, monkeypatch):
    """os.cpu_count() counts the host's CPUs; a container (--cpus) or a job step bound to some cores
    may use fewer, and convert's default workers (one per usable CPU) must not count the others."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert O.usable_cpus(str(tmp_path)) == 16  # no quota: the affinity, not the host's 64
    (tmp_path / "cpu.max").write_text("400000 100000\n")
    assert O.usable_cpus(str(tmp_path)) == 4
    (tmp_path / "cpu.max").write_text("3200000 100000\n")  # a quota above the affinity: the affinity
    assert O.usable_cpus(str(tmp_path)) == 16
