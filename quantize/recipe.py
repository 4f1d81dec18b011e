"""llm-compressor recipe YAML (QuantizationModifier, GPTQModifier or AutoRoundModifier: config_groups /
scheme / targets / ignore; GPTQModifier's dampening_frac / block_size / actorder; AutoRoundModifier's
iters / batch_size / lr, as llmcompressor/modifiers/autoround/base.py names them) -> the subset this
tool executes: one symmetric INT4 group scheme, its targets and ignore list, and the method (rtn,
gptq for a GPTQModifier, autoround for an AutoRoundModifier)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from .errors import QuantizeError
from .formats.layout import OBSERVERS, SUPPORTED_GROUP_SIZES
from .options import ConvertOptions, spec
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


def _find_modifier(node) -> tuple[str, dict] | None:
    if isinstance(node, dict):
        for key, val in node.items():
            if key in MODIFIERS and isinstance(val, dict):
                return key, val
            found = _find_modifier(val)
            if found is not None:
                return found
    elif isinstance(node, list):
        for item in node:
            found = _find_modifier(item)
            if found is not None:
                return found
    return None


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
    found = _find_modifier(doc)
    if found is None:
        raise QuantizeError(
            f"{path}: no QuantizationModifier found; a recipe needs "
            "quant_stage.quant_modifiers.QuantizationModifier (or GPTQModifier, AutoRoundModifier)"
        )
    kind, mod = found
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
        if not isinstance(group, dict) or not isinstance(group.get("weights") or {}, dict):
            raise QuantizeError(
                f"{path}: config group {gname} must be a mapping with a 'weights' mapping; fix the recipe"
            )
        w = group.get("weights") or {}
        if w.get("type") == "float" and w.get("num_bits") == 8:
            return _fp8_block_recipe(path, kind, mod, ignore, gname, group)
        if group.get("input_activations") or group.get("output_activations"):
            raise QuantizeError(
                f"{path}: config group {gname} quantizes activations; convert writes weight-only "
                "W4A16, drop input_activations"
            )
        bad = {
            k: w.get(k)
            for k, want in (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group"))
            if w.get(k, want) != want
        }
        if bad:
            raise QuantizeError(
                f"{path}: config group {gname} asks for {bad}; this tool writes symmetric INT4 "
                "group-wise weights (num_bits 4, type int, symmetric true, strategy group)"
            )
        group_size = w.get("group_size", 128)
        if type(group_size) is not int:  # not bool, str or float
            raise QuantizeError(
                f"{path}: config group {gname} group_size {group_size!r} must be an integer, one of "
                f"{SUPPORTED_GROUP_SIZES}; fix the recipe"
            )
        targets = _strings(path, "targets", group.get("targets")) or ("Linear",)
        observer = w.get("observer")
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
    elif isinstance(scheme, str):
        if scheme not in PRESETS:
            raise QuantizeError(
                f"{path}: scheme {scheme!r} is not supported; use W4A16, FP8_BLOCK or a config_groups block with "
                "num_bits 4"
            )
        if PRESET_SCHEME[scheme] == "fp8-block":
            return _fp8_block_recipe(path, kind, mod, ignore, None, None)
        group_size = _preset_group_size(scheme)
        targets = _strings(path, "targets", mod.get("targets")) or ("Linear",)
        observer = None
    else:
        raise QuantizeError(f"{path}: QuantizationModifier has neither config_groups nor a scheme; add one")
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
        targets = _strings(path, "targets", group.get("targets")) or ("Linear",)
    else:
        targets = _strings(path, "targets", mod.get("targets")) or ("Linear",)
    return Recipe(str(path), targets, ignore, 32, None, mod.get("kv_cache_scheme"), scheme="fp8-block")


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
