"""llm-compressor recipe YAML (QuantizationModifier, GPTQModifier or AutoRoundModifier: config_groups /
scheme / targets / ignore; GPTQModifier's dampening_frac / block_size / actorder; AutoRoundModifier's
iters / batch_size / lr, as llmcompressor/modifiers/autoround/base.py names them) -> the subset this
tool executes: one symmetric INT4 group scheme, its targets and ignore list, and the method (rtn,
gptq for a GPTQModifier, autoround for an AutoRoundModifier). Every other key llm-compressor knows is
accepted where it changes nothing here and refused where it would; an unknown key, at any depth, is
one line naming its path with did-you-mean."""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from .errors import QuantizeError
from .formats.layout import OBSERVERS, SUPPORTED_GROUP_SIZES
from .options import ConvertOptions, spec, unknown_key
from .parse import load_yaml

# the preset schemes this tool writes (symmetric INT4, group-wise); their group size is compressed-tensors'
PRESETS = ("W4A16", "FP8_BLOCK")
# a preset's output scheme (quantize.options.SCHEMES)
PRESET_SCHEME = {"W4A16": "w4a16", "FP8_BLOCK": "fp8-block"}
MODIFIERS = ("QuantizationModifier", "GPTQModifier", "AutoRoundModifier")


@dataclass(frozen=True)
class Recipe:
    path: str
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    group_size: int
    observer: str | None = None
    kv_cache_scheme: dict | None = field(default=None)
    method: str = "rtn"  # "gptq" for a GPTQModifier, "autoround" for an AutoRoundModifier
    scheme: str = "w4a16"  # "fp8-block" for FP8_BLOCK (the preset, or a float block config group)
    damp: float | None = None  # GPTQModifier dampening_frac
    block: int | None = None  # GPTQModifier block_size
    actorder: str | None = None  # GPTQModifier actorder: "static" or "off" (calibration order only; static groups)
    iters: int | None = None  # AutoRoundModifier iters (its default 200)
    batch_size: int | None = None  # AutoRoundModifier batch_size (its default 8)
    lr: float | None = None  # AutoRoundModifier lr (its default None: 1/iters)


# llm-compressor's recipe layout (llmcompressor/recipe/recipe.py, Recipe.from_dict): top-level
# NAME_stage mappings of NAME_modifiers groups of {ModifierName: its arguments}, and `args` beside
# them. Every key is known or refused (a misspelled key used to be ignored: `group_sise: 32` ran
# group 128): the arguments are the pydantic fields of llm-compressor 0.14.0.1's modifiers and of
# compressed-tensors 0.19's QuantizationScheme / QuantizationArgs (extra="forbid" there too;
# tests/test_hostile_parse.py holds these tuples to theirs), plus what older releases saved.
STAGE, GROUP = "_stage", "_modifiers"
TOP_KEYS = ("pipeline", "args")  # pipeline: `quantize run`'s section (quantize.pipeline checks it); args: not read
STAGE_KEYS = ("run_type",)  # llm-compressor 0.x multi-stage examples (oneshot / train); not read
MODIFIER_BASE = ("index", "group", "start", "end", "update")  # a training schedule; one-shot here
QUANT_KEYS = ("config_groups", "targets", "ignore", "scheme", "kv_cache_scheme", "weight_observer",
              "input_observer", "output_observer", "observer", "bypass_divisibility_checks",
              "requires_calibration_data", *MODIFIER_BASE)
MODIFIER_KEYS = {
    "QuantizationModifier": QUANT_KEYS,
    # sequential_update / sequential_targets / offload_hessians: how older releases ran it (in their saved recipes)
    "GPTQModifier": (*QUANT_KEYS, "block_size", "dampening_frac", "actorder", "batched_quantization",
                     "sequential_update", "sequential_targets", "offload_hessians"),
    "AutoRoundModifier": (*QUANT_KEYS, "iters", "enable_torch_compile", "batch_size", "lr", "device_ids",
                          "disable_opt_rtn", "sequential_targets"),
}
# llm-compressor 0.14's other modifiers (ModifierFactory): refused by name, never "did you mean" one of ours
NOT_RUN = ("AWQModifier", "ConstantPruningModifier", "LogarithmicEqualizationModifier", "MagnitudePruningModifier",
           "Modifier", "QuIPModifier", "REAPPruningModifier", "SmoothQuantModifier", "SparseGPTModifier",
           "SpinQuantModifier", "WandaPruningModifier")
SCHEME_KEYS = ("targets", "weights", "input_activations", "output_activations", "format")
ARGS_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
             "scale_dtype", "zp_dtype", "observer", "observer_kwargs")
OBSERVER_KEYS = ("weights", "input", "output")  # a modifier's `observer:` mapping


def _mapping(path: Path, where: str, node) -> dict:
    if node is None:
        return {}
    if not isinstance(node, dict):
        raise QuantizeError(f"{path}: {where.rstrip('.')} must be a mapping, not {type(node).__name__} {node!r}; "
                            "fix the recipe")
    return node


def _keys(path: Path, where: str, node, known) -> dict:
    """``node`` (a mapping, or None) whose keys are all ``known``; one line naming the key's path otherwise."""
    node = _mapping(path, where, node)
    for k in node:
        if k not in known:
            raise unknown_key(path, where, k, known)
    return node


def _check_args(path: Path, where: str, node) -> None:
    """A QuantizationArgs mapping (a config group's weights or activations, kv_cache_scheme)."""
    args = _keys(path, where, node, ARGS_KEYS)
    if args.get("observer_kwargs"):
        raise QuantizeError(f"{path}: {where}observer_kwargs {args['observer_kwargs']!r}: this tool's observers "
                            "take no arguments; drop it")


def _check_modifier(path: Path, where: str, kind: str, mod) -> None:
    mod = _keys(path, where, mod, MODIFIER_KEYS[kind])
    groups = mod.get("config_groups")
    for gname, group in groups.items() if isinstance(groups, dict) else ():
        g = _keys(path, f"{where}config_groups.{gname}.", group, SCHEME_KEYS)
        for part in ("weights", "input_activations", "output_activations"):
            _check_args(path, f"{where}config_groups.{gname}.{part}.", g.get(part))
    _check_args(path, f"{where}kv_cache_scheme.", mod.get("kv_cache_scheme"))
    _keys(path, f"{where}observer.", mod.get("observer"), OBSERVER_KEYS)


def _no_modifier(path: Path, hint: str = "") -> QuantizeError:
    return QuantizeError(f"{path}: no QuantizationModifier found; a recipe needs "
                         f"quant_stage.quant_modifiers.QuantizationModifier (or GPTQModifier, AutoRoundModifier){hint}")


def _find_modifier(path: Path, doc) -> tuple[str, str, dict]:
    """The one modifier this tool runs, where llm-compressor reads it (NAME_stage.NAME_modifiers),
    once every key of the recipe is known (a typo at any depth: one line with did-you-mean)."""
    if not isinstance(doc, dict):
        raise _no_modifier(path, f" (the file is a {type(doc).__name__}, not a mapping)")
    stages = [k for k in doc if isinstance(k, str) and k.endswith(STAGE)]
    others = [k for k in doc if k not in TOP_KEYS and k not in stages]
    if not stages:  # e.g. `stage:` or `quant_stag:`
        close = difflib.get_close_matches(str(others[0]), ["quant_stage"], n=1) if others else []
        raise _no_modifier(path, f"; did you mean quant_stage for {others[0]!r}?" if close else "")
    for k in others:
        if k in MODIFIERS:
            raise QuantizeError(f"{path}: {k} at the top of the recipe; llm-compressor reads a modifier only under "
                                f"NAME_stage.NAME_modifiers: write quant_stage: quant_modifiers: {k}: ...")
        raise unknown_key(path, "", k, [*TOP_KEYS, *dict.fromkeys([*stages, "quant_stage"])])
    found = []
    for sk in stages:
        stage = _mapping(path, f"{sk}.", doc[sk])
        groups = [k for k in stage if isinstance(k, str) and k.endswith(GROUP)]
        for gk in stage:
            if gk in STAGE_KEYS:
                continue
            if gk not in groups:
                raise unknown_key(path, f"{sk}.", gk, [*dict.fromkeys([*groups, "quant_modifiers"]), *STAGE_KEYS])
            for name, args in _mapping(path, f"{sk}.{gk}.", stage[gk]).items():
                if name not in MODIFIERS:
                    close = [] if name in NOT_RUN else difflib.get_close_matches(str(name), MODIFIERS, n=1)
                    fix = f"did you mean {close[0]!r}?" if close else f"this tool runs {', '.join(MODIFIERS)}; drop it"
                    raise QuantizeError(f"{path}: {sk}.{gk}.{name}: not a modifier this tool runs; {fix}")
                found.append((f"{sk}.{gk}.{name}", name, args))
    if not found:
        raise _no_modifier(path)
    for where, name, args in found:
        _check_modifier(path, where + ".", name, args)
    if len(found) > 1:
        raise QuantizeError(f"{path}: {len(found)} modifiers ({', '.join(w for w, _, _ in found)}); this tool runs "
                            "one, keep one")
    where, name, args = found[0]
    return where + ".", name, args or {}


def _strings(path: Path, key: str, val) -> tuple[str, ...]:
    """A recipe list of names (None -> empty); anything else is refused in one line."""
    if val is None:
        return ()
    if not isinstance(val, list):
        raise QuantizeError(
            f"{path}: {key} must be a list of strings, not {type(val).__name__} {val!r}; write {key}: "
            f"[{val!r}] or fix the recipe"
        )
    bad = [v for v in val if not isinstance(v, str)]
    if bad:
        raise QuantizeError(
            f"{path}: {key} must be a list of strings, but holds {bad[0]!r}; quote it or fix the recipe"
        )
    return tuple(val)


def _patterns(path: Path, val) -> tuple[str, ...]:
    """``ignore``: module names (substring match) or ``re:`` regexes, each of which must compile."""
    pats = _strings(path, "ignore", val)
    for p in pats:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise QuantizeError(f"{path}: ignore pattern {p!r} does not compile ({e}); fix the regex") from e
    return pats


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    doc = load_yaml(path, "recipe")
    at, kind, mod = _find_modifier(path, doc)
    if mod.get("kv_cache_scheme") is not None:
        raise QuantizeError(f"{path}: {at}kv_cache_scheme: convert writes no KV-cache scales; calibrate them with "
                            "`quantize calibrate-kv` (docs/kv-cache.md) and drop kv_cache_scheme")
    weight_observer = _weight_observer(path, at, mod)
    actorder_given = "actorder" in mod
    actorder = mod.get("actorder")
    ignore = _patterns(path, mod.get("ignore"))
    groups = mod.get("config_groups")
    scheme = mod.get("scheme")
    if groups:
        if not isinstance(groups, dict):
            raise QuantizeError(
                f"{path}: config_groups must be a mapping of group name -> scheme, not a "
                f"{type(groups).__name__}; fix the recipe"
            )
        if len(groups) != 1:
            raise QuantizeError(
                f"{path}: {len(groups)} config_groups; this tool writes one INT4 group scheme, merge them into one"
            )
        ((gname, group),) = groups.items()
        gw = f"{at}config_groups.{gname}.weights"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            got = ("missing" if "weights" not in group else "null" if group["weights"] is None
                   else f"{group['weights']!r}, not a mapping") if isinstance(group, dict) else f"{group!r}"
            raise QuantizeError(
                f"{path}: {gw} is {got}; a config group needs its weights scheme, a mapping such as {{num_bits: 4, "
                "type: int, symmetric: true, strategy: group, group_size: 32}, fix the recipe"
            )
        w = group["weights"]
        for k, tp, want in (("num_bits", int, "an integer (4: INT4, 8: FP8 block)"),
                            ("symmetric", bool, "true or false"), ("dynamic", bool, "true or false")):
            if k in w and type(w[k]) is not tp:
                raise QuantizeError(f"{path}: {gw}.{k} is {w[k]!r}, a {type(w[k]).__name__}; it must be {want}, "
                                    "written unquoted")
        if w.get("type") == "float" and w.get("num_bits") == 8:
            if weight_observer is not None:
                raise QuantizeError(f"{path}: {at}: a weight observer ({weight_observer}) beside FP8 block weights, "
                                    "which are round to nearest on absmax / 448; drop it")
            return _fp8_block_recipe(path, kind, mod, ignore, gname, group)
        if group.get("input_activations") or group.get("output_activations"):
            raise QuantizeError(
                f"{path}: config group {gname} quantizes activations; convert writes weight-only "
                "W4A16, drop input_activations"
            )
        bad = {
            k: w.get(k)
            for k, want in (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group"),
                            ("dynamic", False), ("block_structure", None), ("scale_dtype", None), ("zp_dtype", None))
            if w.get(k, want) != want
        }
        if group.get("format") not in (None, "pack-quantized"):
            bad["format"] = group["format"]
        if bad:
            raise QuantizeError(
                f"{path}: config group {gname} asks for {bad}; this tool writes symmetric INT4 "
                "group-wise weights (num_bits 4, type int, symmetric true, strategy group, static, the default scale "
                "dtype, format pack-quantized)"
            )
        group_size = w.get("group_size", 128)
        if type(group_size) is not int:  # not bool, str or float
            raise QuantizeError(
                f"{path}: config group {gname} group_size {group_size!r} must be an integer, one of "
                f"{SUPPORTED_GROUP_SIZES}; fix the recipe"
            )
        targets = _strings(path, "targets", group.get("targets")) or ("Linear",)
        observer = weight_observer or w.get("observer")
        if "actorder" in w:
            if (
                actorder_given
                and w.get("actorder") != actorder
                and w.get("actorder") is not None
                and actorder is not None
            ):
                raise QuantizeError(
                    f"{path}: actorder {actorder!r} of the {kind} conflicts with actorder "
                    f"{w.get('actorder')!r} of config group {gname}; keep one"
                )
            actorder_given = actorder_given or w.get("actorder") is not None
            actorder = actorder if actorder is not None else w.get("actorder")
    elif isinstance(scheme, dict):
        raise QuantizeError(f"{path}: {at}scheme is a mapping; this tool reads a preset name: write scheme: W4A16 "
                            "(or FP8_BLOCK) with targets: [...], or a config_groups block")
    elif isinstance(scheme, str):
        if scheme not in PRESETS:
            raise QuantizeError(
                f"{path}: scheme {scheme!r} is not supported; use W4A16, FP8_BLOCK or a config_groups block with "
                "num_bits 4"
            )
        if PRESET_SCHEME[scheme] == "fp8-block":
            if weight_observer is not None:
                raise QuantizeError(f"{path}: {at}: a weight observer ({weight_observer}) beside FP8_BLOCK, whose "
                                    "weights are round to nearest on absmax / 448; drop it")
            return _fp8_block_recipe(path, kind, mod, ignore, None, None)
        group_size = _preset_group_size(scheme)
        targets = _strings(path, "targets", mod.get("targets")) or ("Linear",)
        observer = weight_observer
    else:
        raise QuantizeError(f"{path}: {kind} has neither config_groups nor a scheme; add one")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise QuantizeError(
            f"{path}: group_size {group_size} is not served by Marlin/Machete; use one of {SUPPORTED_GROUP_SIZES}"
        )
    if observer in ("memoryless_mse", "static_mse"):
        observer = "mse"
    if observer in ("static_minmax", "memoryless_minmax"):
        observer = "minmax"
    if observer is not None and observer not in OBSERVERS:
        raise QuantizeError(f"{path}: observer {observer!r} is not supported; use one of {', '.join(OBSERVERS)}")
    common = (str(path), targets, ignore, group_size, observer, mod.get("kv_cache_scheme"))
    if kind == "QuantizationModifier":
        return Recipe(*common)
    if kind == "AutoRoundModifier":
        lr = mod.get("lr")
        if lr is not None and not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < float("inf")):
            raise QuantizeError(
                f"{path}: AutoRoundModifier lr {lr!r} must be a positive number or null (1/iters); fix the recipe"
            )
        return Recipe(
            *common,
            method="autoround",
            iters=_whole(path, "iters", mod.get("iters", default("iters")), 0),
            batch_size=_whole(path, "batch_size", mod.get("batch_size", default("batch_size")), 1),
            lr=None if lr is None else float(lr),
        )
    return Recipe(
        *common,
        method="gptq",
        damp=_number(path, "dampening_frac", mod.get("dampening_frac", default("damp")), float),
        block=_number(path, "block_size", mod.get("block_size", default("block")), int),
        actorder=_actorder(path, actorder if actorder_given else default("actorder")),
    )


def _weight_observer(path: Path, at: str, mod: dict) -> str | None:
    """The modifier's own weight observer, over the scheme's as llm-compressor reads it: its
    ``observer: {weights: ...}`` mapping first, then ``weight_observer``."""
    for key, val in (("observer.weights", (mod.get("observer") or {}).get("weights")),
                     ("weight_observer", mod.get("weight_observer"))):
        if val is not None:
            if not isinstance(val, str):
                raise QuantizeError(f"{path}: {at}{key} is {val!r}; name an observer, one of {', '.join(OBSERVERS)}")
            return val
    return None


FP8_BLOCK_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                     "block_structure": [128, 128], "dynamic": False}
FP8_BLOCK_INPUTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128,
                    "dynamic": True}


def _fp8_block_recipe(path: Path, kind: str, mod: dict, ignore, gname, group) -> Recipe:
    """A recipe asking for llm-compressor's FP8_BLOCK (the preset, or a config group spelling it
    out): e4m3 weights with one scale per 128x128 block, dynamic per-128-group FP8 activations."""
    if kind != "QuantizationModifier":
        raise QuantizeError(f"{path}: FP8 block weights under a {kind}; FP8 block is round to nearest, use a "
                            "QuantizationModifier")
    if group is not None:
        for part, want in (("weights", FP8_BLOCK_WEIGHTS), ("input_activations", FP8_BLOCK_INPUTS)):
            got = group.get(part)
            if part == "input_activations" and got is None:
                continue  # weight-only FP8 block is what the weights hold too; activations are dynamic anyway
            bad = {k: (got or {}).get(k) for k, v in want.items() if (got or {}).get(k, v) != v}
            if not isinstance(got, dict) or bad:
                raise QuantizeError(f"{path}: config group {gname} {part} asks for {bad or got!r}; the FP8 scheme "
                                    f"written is FP8_BLOCK ({part}: {want})")
        if group.get("format") not in (None, "float-quantized") or group.get("output_activations") is not None:
            part = "format" if group.get("format") not in (None, "float-quantized") else "output_activations"
            raise QuantizeError(f"{path}: config group {gname} {part} is {group[part]!r}; the FP8 scheme written is "
                                "FP8_BLOCK (format float-quantized, no output activations)")
        targets = _strings(path, "targets", group.get("targets")) or ("Linear",)
    else:
        targets = _strings(path, "targets", mod.get("targets")) or ("Linear",)
    return Recipe(str(path), targets, ignore, 32, None, None, scheme="fp8-block")


def default(name: str):
    """A method option's declared default (``quantize.options``): what an llm-compressor modifier
    that leaves the key out means (their defaults and ours are the same by design)."""
    return spec(next(f for f in fields(ConvertOptions) if f.name == name)).method_default


@functools.lru_cache(maxsize=None)
def _preset_group_size(scheme: str) -> int:
    """A preset's group size as compressed-tensors defines the scheme (``preset_name_to_scheme``; W4A16:
    128). Imported here, not with this module: compressed-tensors brings torch, seconds that
    loading a config_groups recipe (and ``quantize plan``) does not need."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(scheme, ["Linear"]).weights.group_size


def _whole(path: Path, key: str, val, least: int) -> int:
    """An AutoRoundModifier count: iters >= 0, batch_size >= 1."""
    if not (isinstance(val, int) and not isinstance(val, bool) and val >= least):
        raise QuantizeError(
            f"{path}: AutoRoundModifier {key} {val!r} must be a whole number >= {least}; fix the recipe"
        )
    return val


def _number(path: Path, key: str, val, kind):
    """A GPTQModifier number: dampening_frac in (0, 1], block_size >= 1."""
    ok = (
        isinstance(val, (int, float))
        and not isinstance(val, bool)
        and (kind is float or isinstance(val, int))
        and (0 < val <= 1 if kind is float else val >= 1)
    )
    if not ok:
        want = "a number in (0, 1], e.g. 0.01" if kind is float else "a whole number of columns, e.g. 128"
        raise QuantizeError(f"{path}: GPTQModifier {key} {val!r} must be {want}; fix the recipe")
    return kind(val)


def _actorder(path: Path, val) -> str | None:
    """llm-compressor's GPTQModifier defaults to actorder static (= weight: columns visited by
    decreasing Hessian diagonal, groups static, format unchanged); null: plain column order. The
    removed "group"/"dynamic" ordering would need g_idx, which pack-quantized 0.19 does not carry."""
    if val is None:
        return "off"
    if val in ("static", "weight"):
        return "static"
    raise QuantizeError(
        f"{path}: GPTQModifier actorder {val!r} is not written by this tool (pack-quantized has no "
        "g_idx); use actorder: null or static"
    )
