"""llm-compressor recipe YAML (QuantizationModifier: config_groups / scheme / targets / ignore)
-> the subset this tool executes: one symmetric INT4 group scheme, its targets and ignore list."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import QuantizeError
from .formats.layout import OBSERVERS, SUPPORTED_GROUP_SIZES

PRESETS = {"W4A16": 128}


@dataclass(frozen=True)
class Recipe:
    path: str
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    group_size: int
    observer: str | None = None
    kv_cache_scheme: dict | None = field(default=None)


def _find_modifier(node) -> dict | None:
    if isinstance(node, dict):
        for key, val in node.items():
            if key in ("QuantizationModifier", "GPTQModifier") and isinstance(val, dict):
                return val
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
        raise QuantizeError(f"{path}: {key} must be a list of strings, not {type(val).__name__} {val!r}; write {key}: [{val!r}] or fix the recipe")
    bad = [v for v in val if not isinstance(v, str)]
    if bad:
        raise QuantizeError(f"{path}: {key} must be a list of strings, but holds {bad[0]!r}; quote it or fix the recipe")
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
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise QuantizeError(f"{path}: cannot read recipe ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise QuantizeError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); fix the recipe") from e
    mod = _find_modifier(doc)
    if mod is None:
        raise QuantizeError(f"{path}: no QuantizationModifier found; a recipe needs quant_stage.quant_modifiers.QuantizationModifier")
    ignore = _patterns(path, mod.get("ignore"))
    groups = mod.get("config_groups")
    scheme = mod.get("scheme")
    if groups:
        if not isinstance(groups, dict):
            raise QuantizeError(f"{path}: config_groups must be a mapping of group name -> scheme, not a {type(groups).__name__}; fix the recipe")
        if len(groups) != 1:
            raise QuantizeError(f"{path}: {len(groups)} config_groups; this tool writes one INT4 group scheme, merge them into one")
        (gname, group), = groups.items()
        if not isinstance(group, dict) or not isinstance(group.get("weights") or {}, dict):
            raise QuantizeError(f"{path}: config group {gname} must be a mapping with a 'weights' mapping; fix the recipe")
        w = group.get("weights") or {}
        if group.get("input_activations") or group.get("output_activations"):
            raise QuantizeError(f"{path}: config group {gname} quantizes activations; convert writes weight-only W4A16, drop input_activations")
        bad = {k: w.get(k) for k, want in (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group")) if w.get(k, want) != want}
        if bad:
            raise QuantizeError(f"{path}: config group {gname} asks for {bad}; this tool writes symmetric INT4 group-wise weights (num_bits 4, type int, symmetric true, strategy group)")
        group_size = w.get("group_size", 128)
        if type(group_size) is not int:  # not bool, str or float
            raise QuantizeError(f"{path}: config group {gname} group_size {group_size!r} must be an integer, one of {SUPPORTED_GROUP_SIZES}; fix the recipe")
        targets = _strings(path, "targets", group.get("targets")) or ("Linear",)
        observer = w.get("observer")
    elif isinstance(scheme, str):
        if scheme not in PRESETS:
            raise QuantizeError(f"{path}: scheme {scheme!r} is not supported; use W4A16 or a config_groups block with num_bits 4")
        group_size = PRESETS[scheme]
        targets = _strings(path, "targets", mod.get("targets")) or ("Linear",)
        observer = None
    else:
        raise QuantizeError(f"{path}: QuantizationModifier has neither config_groups nor a scheme; add one")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise QuantizeError(f"{path}: group_size {group_size} is not served by Marlin/Machete; use one of {SUPPORTED_GROUP_SIZES}")
    if observer in ("memoryless_mse", "static_mse"):
        observer = "mse"
    if observer in ("static_minmax", "memoryless_minmax"):
        observer = "minmax"
    if observer is not None and observer not in OBSERVERS:
        raise QuantizeError(f"{path}: observer {observer!r} is not supported; use one of {', '.join(OBSERVERS)}")
    return Recipe(str(path), targets, ignore, group_size, observer, mod.get("kv_cache_scheme"))
