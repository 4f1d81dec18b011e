"""Every command's options, declared once.

Each command has one dataclass here. A field is one option: its name (the library function's
keyword, the recipe key, and ``--name-with-dashes`` on the command line), its type, its default, its
help, the values it accepts and the one line said when it is refused. From that declaration:

- the Typer command is built (``quantize.cli``: ``command(Model)``),
- the library function takes it (``takes(Model)``: keyword defaults and validation come from here),
- the ``quantize run`` recipe sections are pydantic models made from it (``recipe_section``), with
  did-you-mean for an unknown key,
- the manifest and the card read ``to_dict()`` (the fields marked ``record``).

A new option is one field. This module imports no torch: ``quantize --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import re
import types
import typing
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

from .archs.base import PROFILES
from .errors import QuantizeError
from .formats.layout import OBSERVERS, SUPPORTED_GROUP_SIZES
from .kvcache import DEFAULT_MEM_FRACTION, DEFAULT_RESERVE_GIB, H200_GIB

MISSING = dataclasses.MISSING
SEED_WHY = "a seed is an integer from 0 to 2**63 - 1"
MAX_TP = 4096  # tensor-parallel ranks: far past any deployment (8 per node, 64 across nodes)
TP_WHY = f"must be from 1 to {MAX_TP}"
MAX_CHECK_TOKENS = 4096  # check's random activation rows: a kernel check, not a benchmark (memory: rows x K)
MAX_NPROC = 1024  # ranks on one machine: one per GPU or a share of the cores
NPROC_WHY = f"must be from 1 to {MAX_NPROC} ranks on this machine"
DIST_TIMEOUT_S = 600.0  # seconds a rank waits for the others (quantize.distributed)
MAX_DIST_TIMEOUT_S = 7 * 86400.0  # a week: past any layer's compute, and within what a timedelta holds
DIST_TIMEOUT_WHY = f"must be a positive number of seconds up to {MAX_DIST_TIMEOUT_S:.0f} (a week)"


@dataclass(frozen=True)
class Spec:
    """What a field declares beyond its type and default."""

    help: str = ""
    flag: str | None = None  # the command line's spelling; None: --name-with-dashes (bools: a flag)
    argument: bool = False  # a positional argument on the command line
    required: bool = True  # an argument: required on the command line
    metavar: str | None = None
    cli: bool = True  # offered on the command line
    choices: tuple = ()  # the values accepted (None always means "not given")
    check: Callable[[Any], bool] | None = None  # a given value must pass it
    why: str = ""  # said when a value is refused: "{flag} {value}: {why}"; {choices} is filled in
    record: bool = True  # in the manifest, the plan summary and the resume key
    key: bool = True  # a recorded field: part of the resume key and the plan's fingerprint (False: recorded,
    # but the output's bytes do not depend on it, so a resume with another value continues the same output)
    recipe: bool = True  # settable in the command's section of a `quantize run` recipe
    methods: tuple[str, ...] = ()  # convert: the data-aware methods that use it (refused beside others)
    method_default: Any = None  # convert: its value when one of ``methods`` runs and it was not given
    modifier_key: str | None = None  # convert: the llm-compressor modifier's key for the same setting


def opt(default: Any = MISSING, help: str = "", **spec) -> Any:
    """A field of an options dataclass (see ``Spec``)."""
    return field(default=default, metadata={"spec": Spec(help=help, **spec)})


def same(model: type, name: str, **changes) -> Any:
    """The field ``name`` of another command's options (one declaration, two commands)."""
    f = next(f for f in fields(model) if f.name == name)
    return field(default=f.default, metadata={"spec": replace(f.metadata["spec"], **changes)})


def spec(f: dataclasses.Field) -> Spec:
    return f.metadata.get("spec") or Spec()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def hints(model: type) -> dict[str, Any]:
    return typing.get_type_hints(model)


def _base(tp) -> tuple[Any, bool]:
    """``int | None`` -> (int, True)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _shown(v) -> str:
    return repr(v) if isinstance(v, str) and (not v.strip() or not v.isprintable()) else str(v)


def _non_finite(v) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def _why(f: dataclasses.Field, v=None) -> str:
    """What ``f`` accepts, said when ``v`` is refused (a nan or inf first says so: it would pass
    every comparison written as "refuse when not ...")."""
    s = spec(f)
    if s.why:
        base = s.why.format(choices=", ".join(map(str, s.choices)))
    else:
        base = f"use one of {', '.join(map(str, s.choices))}" if s.choices else ""
    if _non_finite(v):
        return "not a finite number" + (f"; {base}" if base and s.why else "")
    return base


def _passes(f: dataclasses.Field, v) -> bool:
    s = spec(f)
    if v is None:
        return True
    return not (_non_finite(v) or (s.choices and v not in s.choices) or (s.check is not None and not s.check(v)))


def refusal(f: dataclasses.Field, v) -> QuantizeError:
    return QuantizeError(f"{spec(f).flag or flag(f.name)} {_shown(v)}: {_why(f, v)}")


def _type_ok(tp, v) -> bool:
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is str:
        return isinstance(v, str)
    return True  # paths (str or PathLike), lists: their commands read them


def validate(obj) -> None:
    """Type, accepted values and range of every given field, in declaration order; the first
    refusal is one line naming the option and what it accepts."""
    th = hints(type(obj))
    for f in fields(obj):
        v = getattr(obj, f.name)
        tp, optional = _base(th[f.name])
        if v is None and (optional or f.default is None):
            continue
        s = spec(f)
        if not _type_ok(tp, v):
            raise QuantizeError(f"{s.flag or flag(f.name)} {_shown(v)}: not {getattr(tp, '__name__', tp)}")
        if not _passes(f, v):
            raise refusal(f, v)


def given(obj, name: str) -> bool:
    """The user set ``name``: not None (an optional) or True (a flag). 0 is a value."""
    v = getattr(obj, name)
    return v is not None and v is not False


class Options:
    """Base of the options dataclasses: ``validate``, ``to_dict`` (the recorded fields)."""

    def validate(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if spec(f).record and not spec(f).argument}

    def key_dict(self) -> dict:
        """The recorded fields the output's bytes depend on: what a resume key and a plan's
        fingerprint hash (``to_dict`` less the fields declared ``key=False``)."""
        unkeyed = {f.name for f in fields(self) if not spec(f).key}
        return {k: v for k, v in self.to_dict().items() if k not in unkeyed}


# -- the library side --------------------------------------------------------------------------


def takes(model: type, *, keep: tuple[str, ...] = ()):
    """Decorate a library function whose keywords are ``model``'s fields: callers may pass any
    subset (the rest take the declared defaults); unknown names are a TypeError as for any
    function; values are validated before the function runs. The function receives the options
    object as ``options`` when it has that parameter, else each field as a keyword."""

    names = [f.name for f in fields(model)]

    def deco(fn):
        sig = inspect.signature(fn)
        as_object = "options" in sig.parameters
        if not as_object:
            missing = [n for n in names if n not in sig.parameters]
            if missing:
                raise TypeError(f"{fn.__qualname__} lacks the declared options {missing}")
        extra = [p for p in sig.parameters.values() if p.name not in names and p.name != "options"]

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            pos = [n for n in names if n not in kw][: len(args)]
            if len(pos) < len(args):
                raise TypeError(f"{fn.__qualname__}() takes {len(pos)} positional arguments but {len(args)} were given")
            kw.update(zip(pos, args))
            own = {k: kw.pop(k) for k in list(kw) if k in names}
            o = model(**own)
            o.validate()
            return fn(options=o, **kw) if as_object else fn(**{n: getattr(o, n) for n in names}, **kw)

        params = [
            inspect.Parameter(
                f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default, annotation=hints(model)[f.name]
            )
            for f in fields(model)
        ]
        wrapper.__signature__ = sig.replace(
            parameters=params
            + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in extra if p.kind != p.VAR_KEYWORD]
        )
        wrapper.options = model
        return wrapper

    return deco


# -- the recipe side -----------------------------------------------------------------------------


def _type_names(tp) -> str:
    base, optional = _base(tp)
    name = {int: "int", float: "number", str: "str", bool: "bool", list: "list"}.get(
        base, getattr(base, "__name__", str(base))
    )
    return f"{name} or null" if optional else name


def unknown_key(path, where: str, key, known, what: str = "key") -> QuantizeError:
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
    fix = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(map(str, known))}"
    return QuantizeError(f"{path}: {where}{key}: unknown {what}; {fix}")


def _recipe_type(tp):
    """The YAML side of a field's type: paths are strings there."""
    base, optional = _base(tp)
    if base is Path:
        base = str
    elif typing.get_origin(base) is list and typing.get_args(base) == (Path,):
        base = list[str]
    return Optional[base] if optional else base


def recipe_section(*parts, defaults: dict | None = None):
    """A pydantic model (``extra="forbid"``, strict types) of recipe keys: each part is an options
    dataclass (its recipe fields) or ``(dataclass, names)`` (just those). A key's type and default
    are its command's own unless ``defaults`` overrides one for the recipe."""
    import pydantic

    defaults = defaults or {}
    spec_fields, owners = {}, {}
    for part in parts:
        model, only = part if isinstance(part, tuple) else (part, None)
        th = hints(model)
        for f in fields(model):
            if (only is not None and f.name not in only) or (only is None and (not spec(f).recipe or spec(f).argument)):
                continue
            spec_fields[f.name] = (_recipe_type(th[f.name]), defaults.get(f.name, f.default))
            owners[f.name] = f
    cfg = pydantic.ConfigDict(extra="forbid", strict=True)
    m = pydantic.create_model("Section", __config__=cfg, **spec_fields)
    m.declared = owners
    return m


def parse_section(path, where: str, doc, section) -> dict:
    """Validate one recipe section: an unknown key with did-you-mean, a wrongly typed value named
    with the types it accepts, then the command's own accepted values and ranges; one line each."""
    import pydantic

    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise QuantizeError(
            f"{path}: {where.rstrip('.') or 'pipeline'} must be a mapping, not {type(doc).__name__}; fix the recipe"
        )
    for k in doc:
        if k not in section.model_fields:
            raise unknown_key(path, where, k, list(section.model_fields))
    try:
        out = section.model_validate(doc).model_dump()
    except pydantic.ValidationError as e:
        key = e.errors()[0]["loc"][0]
        raise QuantizeError(
            f"{path}: {where}{key} is {doc[key]!r}, not {_type_names(section.model_fields[key].annotation)}; "
            "fix the recipe"
        ) from None
    for name, f in section.declared.items():
        v = out[name]
        if name in doc and not _passes(f, v):
            choices = spec(f).choices
            if choices and not spec(f).why and v not in choices:
                raise unknown_key(path, f"{where}{name}: ", v, choices, "value")
            close = difflib.get_close_matches(str(v), list(map(str, choices)), n=1) if v not in choices else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise QuantizeError(f"{path}: {where}{name} {_shown(v)}: {_why(f, v)}{hint}; fix the recipe")
    return out


# -- the command line side -----------------------------------------------------------------------


def _cli_type(tp):
    base, optional = _base(tp)
    return Optional[base] if optional else base


def cli_parameters(model: type) -> list[inspect.Parameter]:
    """Typer parameters for ``model``'s command-line fields: arguments first, in declaration order."""
    import typer

    th = hints(model)
    args, opts = [], []
    for f in fields(model):
        s = spec(f)
        if not s.cli:
            continue
        tp = _cli_type(th[f.name])
        if s.argument:
            default = typer.Argument(... if s.required else f.default, help=s.help, metavar=s.metavar)
            args.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=tp))
            continue
        decl = s.flag or flag(f.name)
        if tp is bool and "/" not in decl and f.default is True:
            decl = f"{decl}/--no-{decl[2:]}"
        text = s.help + (f" (default {s.method_default})" if s.method_default is not None else "")
        default = typer.Option(None if f.default is MISSING else f.default, decl, help=text or None, metavar=s.metavar)
        opts.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=tp))
    return args + opts


# -- the commands' options -------------------------------------------------------------------------

METHODS = ("rtn", "gptq", "autoround")
DEFAULT_METHOD = "rtn"
# output schemes: group-wise INT4 (pack-quantized) or 128x128 block FP8 (float-quantized, llm-compressor's FP8_BLOCK)
SCHEMES = ("w4a16", "fp8-block", "w4afp8")
DEFAULT_SCHEME = "w4a16"
# --scheme w4afp8 (INT4 routed experts, FP8 activations; docs/engines.md#w4afp8): the engine whose layout is
# written. vllm: compressed-tensors W4A8-FP8 (dynamic per-token FP8 activations, no scale written). sglang:
# its native `w4afp8` layout (int8 codes, block FP8 Linears, static per-expert activation scales, calibrated).
W4AFP8_ENGINES = ("vllm", "sglang")
W4AFP8_GROUP = 128  # both engines' CUTLASS W4A8 MoE kernels take group 128 only
# the calibration options SGLang's native w4afp8 uses under any method: its static activation scales
ACT_CALIBRATION = ("data", "samples", "seq_len", "min_expert_tokens")
ACT_SAMPLES = 128  # SGLang's w4afp8 without --samples: at most this many samples, fewer if the data holds fewer
W4AFP8_OBSERVERS = ("minmax", "mse")  # positive scales: the W4A8 scale conversion is not proven on negative ones
DATA_AWARE = ("gptq", "autoround")
# GPTQ column order: "static" visits columns by decreasing Hessian diagonal with the groups fixed
# beforehand (llm-compressor's default, its "static"/"weight"; the file format is unchanged, no
# g_idx); "off": left to right. The old dynamic "group" order needs g_idx: not written.
ACTORDERS = ("static", "off")
# gptq's group scales, fixed before its update: hessian (each group's clip searched against the error weighted
# by the input Hessian's diagonal, imatrix-style; formats/int4.py weighted_scale) or rtn (the observer's own)
SCALE_SEARCHES = ("hessian", "rtn")
INITS = ("rtn", "gptq")  # autoround's start
KV_TARGETS = ("sglang", "vllm", "compressed-tensors")
KV_CACHE_DTYPES = ("fp8_e4m3", "bf16")
SERVE_ENGINES = ("vllm", "sglang")  # quantize.engines.serve.ENGINES
SERVE_KV_DTYPES = ("auto", "fp8_e4m3")  # what --kv-cache-dtype both engines accept with these spellings


def _positive(v) -> bool:
    return v > 0 and math.isfinite(v)


def _hub_repo(v) -> bool:
    from .hub import repo_id_error  # huggingface_hub's validate_repo_id, and a namespace

    return repo_id_error(v) is None


BASE_MODEL_WHY = (
    "not a Hub repo id naming its namespace; use namespace/name (letters, digits, '-', '_', '.'), "
    "e.g. zai-org/GLM-5-FP8"
)


def _nonneg(v) -> bool:
    return v >= 0 and math.isfinite(v)


def physical_memory_gib() -> float:
    """This machine's physical memory in GiB (os.sysconf; psutil where sysconf does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):
        import psutil

        return psutil.virtual_memory().total / 2**30


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """This process's cgroup CPU quota in whole CPUs, rounded up (a container's ``--cpus 2.5``: 3):
    cgroup v2's ``cpu.max`` ("max" or "QUOTA PERIOD"), else v1's ``cpu/cpu.cfs_quota_us`` (-1: none)
    over ``cpu/cpu.cfs_period_us``. None where there is no quota or nothing readable."""
    from pathlib import Path

    base = Path(root)
    try:
        fields = (base / "cpu.max").read_text().split()
        if fields and fields[0] == "max":
            return None
        quota, period = int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        try:
            quota = int((base / "cpu" / "cpu.cfs_quota_us").read_text())
            period = int((base / "cpu" / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def usable_cpus(cgroup: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process may use: its affinity (taskset, a Slurm step's binding) capped by its
    cgroup's CPU quota. ``os.cpu_count()`` counts the host's, which a container or a job step may not
    have: convert's default workers and each rank's threads are sized by this."""
    import os

    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup)
    return max(1, min(n, quota) if quota else n)


@contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` for the block (a pool of workers, each on one thread),
    and back after."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# a memory budget (--memory-budget-gib): at most what this machine holds (1.7e308 GiB overflowed mid-run),
# or convert's default on a machine with less (the default must pass everywhere)
MAX_BUDGET_GIB = max(physical_memory_gib(), 4.0)


def _budget(v) -> bool:
    return _nonneg(v) and v <= MAX_BUDGET_GIB


BUDGET_WHY = f"must be 0 or more GiB, at most this machine's memory ({MAX_BUDGET_GIB:.1f} GiB)"


@dataclass
class ConvertOptions(Options):
    """``quantize convert``. None: not given by the user. ``resolve`` fills it from the recipe or
    the defaults (group 32, profile experts, the method's observer in ``DEFAULT_GRID``); a built
    plan's options are never None where they apply. ``method`` None is round-to-nearest
    (``--method rtn`` resolves to None too, so an RTN run's options, resume key and manifest are
    what they were before data-aware methods existed); a data-aware option stays None under a
    method that does not use it."""

    source: Path | None = opt(
        None, "source checkpoint folder (block FP8, compressed-tensors FP8, or BF16/FP16)", argument=True, record=False
    )
    out: Path | None = opt(
        None, "output folder (must not exist unless --resume/--overwrite)", argument=True, record=False
    )
    scheme: str | None = opt(
        None,
        "w4a16 (default: group-wise INT4 pack-quantized, the decode artifact) or fp8-block (e4m3 weights, one scale "
        "per 128x128 block, float-quantized as llm-compressor's FP8_BLOCK writes it: the prefill artifact); default: "
        "the recipe's",
        choices=SCHEMES,
        why="unknown; use one of {choices}",
    )
    engine: str | None = opt(
        None,
        "--scheme w4afp8: the engine whose W4AFP8 layout is written: vllm (default: compressed-tensors W4A8-FP8, "
        "dynamic FP8 activations) or sglang (its native w4afp8 layout: int8 codes, block FP8 elsewhere, static "
        "per-expert FP8 input scales calibrated from routed tokens: --data / --samples / --seq-len)",
        choices=W4AFP8_ENGINES,
        why="unknown; use one of {choices}",
    )
    group_size: int | None = opt(
        None,
        "INT4 group size along K: 32 (default), 64 or 128",
        choices=SUPPORTED_GROUP_SIZES,
        why="not served by the engines' INT4 kernels; use one of {choices}",
    )
    profile: str | None = opt(
        None,
        "experts (default: routed experts INT4, Kimi's layout) or all-linear",
        choices=PROFILES,
        why="unknown; use one of {choices}",
    )
    observer: str | None = opt(
        None,
        "minmax (default for rtn, bit-identical to compressed-tensors RTN), mse (clipping search), "
        "fullrange (all 16 codes: scale = signed extreme / -8; the default for gptq and autoround; negative scales, "
        "served as written by the W4A16 kernels of SGLang 0.5.23 and vLLM 0.33.0 (read in their source) but not "
        "by vLLM's opt-in VLLM_MARLIN_INPUT_DTYPE=int8, docs/engines.md#negative-scales), fullrange-mse",
        choices=OBSERVERS,
        why="unknown; use one of {choices}",
    )
    keep_fp8: bool = opt(False, "leave non-INT4 FP8 weights FP8 (block) instead of BF16")
    recipe: str | None = opt(
        None,
        "llm-compressor recipe YAML (targets / ignore / group size; a GPTQModifier means "
        "--method gptq, an AutoRoundModifier --method autoround)",
        recipe=False,
    )
    # data-aware methods (quantize/methods/): gptq | autoround, and their options
    method: str | None = opt(
        None,
        "rtn (default: round-to-nearest, no data), gptq (llm-compressor's GPTQ update, layer by "
        "layer on calibration text) or autoround (signed-gradient rounding and clipping)",
        choices=METHODS,
        why="unknown; use one of {choices}",
    )
    data: str | None = opt(
        None,
        "gptq/autoround: calibration text, jsonl/txt/parquet file or folder, or hf:NAME (default: the shipped corpus)",
        methods=DATA_AWARE,
        check=lambda v: bool(v.strip()),
        why="empty; pass a .jsonl/.txt/.parquet file or folder, or hf:NAME",
        recipe=False,
    )
    pack: bool = opt(
        False,
        "gptq/autoround: calibration samples of exactly --seq-len tokens, the texts joined (EOS between) and cut, "
        "as auto-round calibrates; default: one text per sample, truncated",
        methods=DATA_AWARE,
    )
    samples: int | None = opt(
        None,
        "gptq/autoround: calibration samples",
        methods=DATA_AWARE,
        method_default=128,
        check=lambda v: v >= 1,
        why="must be at least 1 (e.g. 128)",
    )
    seq_len: int | None = opt(
        None,
        "gptq/autoround: tokens per sample at most",
        methods=DATA_AWARE,
        method_default=2048,
        check=lambda v: v >= 2,
        why="must be at least 2 tokens (e.g. 2048)",
    )
    damp: float | None = opt(
        None,
        "gptq: Hessian dampening, a fraction of its mean diagonal",
        methods=("gptq",),
        method_default=0.01,
        check=lambda v: 0 < v <= 1,
        modifier_key="dampening_frac",
        why="the Hessian dampening fraction must be in (0, 1] (e.g. 0.01)",
    )
    block: int | None = opt(
        None,
        "gptq: columns per lazy-update block",
        methods=("gptq",),
        method_default=128,
        check=lambda v: v >= 1,
        modifier_key="block_size",
        why="the GPTQ column block must be at least 1 (e.g. 128)",
    )
    actorder: str | None = opt(
        None,
        "gptq: static (default, llm-compressor's: columns by decreasing Hessian diagonal, groups "
        "fixed, format unchanged) or off",
        methods=("gptq",),
        method_default="static",
        choices=ACTORDERS,
        modifier_key="actorder",
        why="use static (columns by decreasing Hessian diagonal, groups fixed: the format is "
        "unchanged) or off; a dynamic group order would need g_idx, which is not written",
    )
    scale_search: str | None = opt(
        None,
        "gptq: the group scales fixed before the update: hessian (default: each group's clipping, 1 down to 0.8 of "
        "its range, searched for the least error weighted by the input Hessian's diagonal, imatrix-style) or rtn "
        "(the observer's own scale, as llm-compressor's GPTQModifier)",
        methods=("gptq",),
        method_default="hessian",
        choices=SCALE_SEARCHES,
        why="use hessian (activation-weighted clip search) or rtn (the observer's scale)",
    )
    asym: float | None = opt(
        None,
        "gptq: asymmetric calibration, GPTAQ-style: each weight that reads the residual stream (q/k/v, MLA's "
        "q_a/kv_a, gate/up, routed experts' gate/up) targets the source layer's output on the source model's own "
        "inputs, moved this fraction of the way to that least-squares target before the update (0: off, "
        "llm-compressor's target, the source layer on the quantized-path inputs; 0.5 measured best)",
        methods=("gptq",),
        method_default=0.0,
        check=lambda v: 0 <= v <= 1,
        why="must be a fraction from 0 (off) to 1 (e.g. 0.5)",
    )
    iters: int | None = opt(
        None,
        "autoround: signed-gradient steps per layer (0 = RTN on the grid)",
        methods=("autoround",),
        method_default=200,
        check=lambda v: v >= 0,
        modifier_key="iters",
        why="must be 0 (RTN on the full-range grid) or more (e.g. 200)",
    )
    lr: float | None = opt(
        None,
        "autoround: learning rate, decayed linearly to 0 (default 1/iters)",
        methods=("autoround",),
        check=_positive,
        modifier_key="lr",
        why="the learning rate must be a positive number (default 1/iters)",
    )
    batch_size: int | None = opt(
        None,
        "autoround: samples per step",
        methods=("autoround",),
        method_default=8,
        check=lambda v: v >= 1,
        modifier_key="batch_size",
        why="must be at least 1 sample (e.g. 8)",
    )
    init: str | None = opt(
        None,
        "autoround: where the rounding starts: rtn (default: round-to-nearest on the grid, as auto-round) or gptq "
        "(the same layer's GPTQ result at --method gptq's defaults, routed experts included: its codes and "
        "Hessian-searched clipping)",
        methods=("autoround",),
        method_default="rtn",
        choices=INITS,
        why="use rtn (round-to-nearest) or gptq (GPTQ's result)",
    )
    all_experts: bool = opt(
        False,
        "gptq/autoround: every routed expert's statistics from every token (the layer output still follows the router)",
        methods=DATA_AWARE,
    )
    min_expert_tokens: int | None = opt(
        None,
        "gptq/autoround: an expert routed fewer tokens falls back to RTN, named",
        methods=DATA_AWARE,
        method_default=16,
        check=lambda v: v >= 0,
        why="must be 0 or more tokens (e.g. 16)",
    )
    skip_rtn_loss: bool = opt(
        False,
        "gptq: do not measure each layer's loss with RTN weights (the report's RTN column): a streamed MoE layer "
        "then runs two attention captures and expert-output passes instead of three, and one replay instead of two; "
        "the same bytes",
        methods=("gptq",),
        key=False,  # the same bytes: not in the resume key or a pipeline's stage hash (a resume may add it)
    )
    requantize: bool = opt(
        False,
        "an INT4 source (e.g. Kimi K2.6): dequantize its INT4 tensors exactly and quantize them again with the "
        "requested scheme (group size, grid, method); without it they pass through bit for bit and a different "
        "scheme is refused",
    )
    # how the run goes, not what it makes: not recorded (same bytes for any value)
    resume: bool = opt(False, "continue an interrupted run in OUT (same options)", record=False, recipe=False)
    overwrite: bool = opt(False, "replace an existing quantize output in OUT", record=False, recipe=False)
    workers: int | None = opt(
        None, "compute threads (default: the CPUs this process may use, its affinity and cgroup quota, over "
        "the ranks on the node)", record=False, check=lambda v: v >= 1, why="must be at least 1"
    )
    device: str = opt(
        "cpu", "cpu (default) or cuda: where a data-aware method's layer pass runs (RTN runs on the CPU: refused "
        "on cuda)", record=False
    )
    memory_budget_gib: float = opt(
        4.0,
        "gptq/autoround: calibration hidden states kept in memory (beyond it they go to OUT/.quantize/hidden); "
        "gptq on the CPU: also the routed experts read at once (with their Hessians), a MoE layer's experts a group "
        "at a time (on --device cuda a group is bounded by 0.4 of the GPU's memory instead)",
        record=False,
        check=_budget,
        why=BUDGET_WHY + " (0: every hidden state on disk)",
    )
    # what the output is of, not how it is made: recorded in the manifest (the card's base_model),
    # not in the resume key (the same bytes for any value; a resume may add or correct it)
    base_model: str | None = opt(
        None,
        "the Hub repo (namespace/name) the source was downloaded from, recorded for the card's base_model "
        "(needed when the source is a plain folder, e.g. from `hf download REPO --local-dir DIR`)",
        metavar="REPO",
        check=_hub_repo,
        why=BASE_MODEL_WHY,
        key=False,
        recipe=False,  # a recipe sets it once for the whole run: pipeline.base_model
    )
    # several processes (docs/distributed.md): how the run goes, not what it makes (not recorded)
    nproc: int = opt(
        1,
        "start N ranks with torchrun on this machine (CPU: gloo; GPUs: NCCL, one per rank); or launch the command "
        "under torchrun yourself",
        metavar="N",
        record=False,
        recipe=False,  # the command line's launcher: a library call starts no ranks
        check=lambda v: 1 <= v <= MAX_NPROC,
        why=NPROC_WHY,
    )
    dist_timeout_s: float = opt(
        DIST_TIMEOUT_S,
        "seconds a rank waits for the others before the run fails",
        record=False,
        recipe=False,
        check=lambda v: _positive(v) and v <= MAX_DIST_TIMEOUT_S,
        why=DIST_TIMEOUT_WHY,
    )

    @property
    def method_name(self) -> str:
        return self.method or DEFAULT_METHOD

    def to_dict(self) -> dict:
        """What the manifest, the plan summary and the resume key record: the data-aware fields only
        where a data-aware method runs, base_model only where given."""
        d = super().to_dict()
        if self.method_name == DEFAULT_METHOD:
            for k in ["method", *method_options()]:
                d.pop(k, None)
        if not self.requantize:  # only an INT4 source reads it: records of other runs stay as they were
            d.pop("requantize", None)
        if self.scheme in (None, DEFAULT_SCHEME):
            d.pop("scheme", None)
        elif self.scheme == "fp8-block":  # one grid (absmax / 448 per block): no INT4 group size or observer
            d.pop("group_size", None)
            d.pop("observer", None)
        if self.scheme != "w4afp8":
            d.pop("engine", None)
        if self.base_model is None:
            d.pop("base_model")  # only where given: a manifest without it is what it was before the option
        return d

    def check_method_options(self, also: tuple[str, ...] = ()) -> None:
        """After ``resolve``: an option of a method that does not run is refused, not ignored (0 is
        a value: ``--iters 0`` beside RTN is refused too); ``also``: options used whatever the method."""
        for name, methods in method_options().items():
            if given(self, name) and self.method_name not in methods and name not in also:
                need = " or ".join(f"--method {m}" for m in methods)
                raise QuantizeError(
                    f"{flag(name)} is an option of {need}, but the method is {self.method_name}; "
                    f"add {need} or drop {flag(name)}"
                )

    def _method_defaults(self) -> "ConvertOptions":
        m = self.method
        if m not in DATA_AWARE:
            return self
        fill = {
            f.name: spec(f).method_default
            for f in fields(self)
            if spec(f).method_default is not None and getattr(self, f.name) is None and m in spec(f).methods
        }
        out = replace(self, **fill)
        if m == "autoround" and out.lr is None and out.iters:
            out = replace(out, lr=1.0 / out.iters)  # Cheng et al.: lr 1/iters, decayed linearly to 0
        return out

    def resolve(self, recipe) -> "ConvertOptions":
        """The options the plan runs with: explicit values, else the recipe's, else the defaults. A
        flag that contradicts the recipe is refused rather than silently replaced."""
        rscheme = recipe.scheme if recipe is not None else None
        if self.scheme is not None and rscheme is not None and self.scheme != rscheme:
            raise QuantizeError(f"--scheme {self.scheme} conflicts with scheme {rscheme} in {recipe.path}; "
                                "drop the flag or edit the recipe")
        scheme = self.scheme or rscheme or DEFAULT_SCHEME
        if self.engine is not None and scheme != "w4afp8":
            raise QuantizeError(f"--engine {self.engine} picks a W4AFP8 layout, but the scheme is {scheme}; add "
                                "--scheme w4afp8 or drop --engine")
        if scheme == "w4afp8":
            return self._resolve_w4afp8(recipe)
        if scheme != DEFAULT_SCHEME:
            self._check_fp8_block(recipe)
        return replace(self._resolve(recipe), scheme=scheme)

    def _resolve_w4afp8(self, recipe) -> "ConvertOptions":
        """W4AFP8: routed experts INT4 by group 128 (the engines' CUTLASS W4A8 kernels take no other),
        FP8 activations at serving time; the source's block-FP8 weights stay FP8 (the engines' W4AFP8
        methods serve the rest as block FP8). ``--engine sglang`` (SGLang's native layout) reads static
        per-expert input scales: calibrated from routed tokens (``ACT_CALIBRATION``) whatever the
        method; vLLM quantizes activations dynamically, so there a calibration option is refused. One
        line for what the engines cannot serve."""
        engine = self.engine or "vllm"
        if recipe is not None:
            raise QuantizeError(f"{recipe.path}: a recipe with --scheme w4afp8 is not supported (the scheme fixes the "
                                "targets: routed experts INT4 by group 128); drop one of them")
        if self.group_size not in (None, W4AFP8_GROUP):
            raise QuantizeError(f"--group-size {self.group_size}: the W4A8 MoE kernels of vLLM 0.33 and SGLang 0.5.23 "
                                f"take group {W4AFP8_GROUP} only; drop --group-size for --scheme w4afp8")
        if self.profile not in (None, DEFAULT_PROFILE):
            raise QuantizeError(f"--profile {self.profile}: --scheme w4afp8 quantizes the routed experts only (the "
                                "engines' W4AFP8 methods serve the rest as block FP8); drop --profile")
        if self.observer is not None and self.observer not in W4AFP8_OBSERVERS:
            raise QuantizeError(f"--observer {self.observer}: its negative scales are not proven through the W4A8 "
                                f"kernels' scale conversion; use one of {', '.join(W4AFP8_OBSERVERS)} with "
                                "--scheme w4afp8")
        calibrates = engine == "sglang"
        if not calibrates and self.method_name not in DATA_AWARE:
            asked = [n for n in ACT_CALIBRATION if given(self, n)]
            if asked:
                raise QuantizeError(f"{flag(asked[0])}: --engine vllm quantizes the experts' activations dynamically "
                                    "(per token, at serving time), so no activation scale is calibrated; drop "
                                    f"{flag(asked[0])}, or use --engine sglang (static per-expert scales)")
        out = replace(self, group_size=W4AFP8_GROUP, profile=DEFAULT_PROFILE, keep_fp8=True, engine=engine,
                      observer=self.observer or DEFAULT_OBSERVER)
        out = out._resolve(None, also=ACT_CALIBRATION if calibrates else ())
        if calibrates:  # the activation scales' calibration, under any method: its defaults where not given
            # (--samples left None: up to ACT_SAMPLES, as many as the data holds; a maximum needs fewer texts)
            out = replace(out, **{n: method_default(n) for n in ACT_CALIBRATION
                                  if n != "samples" and getattr(out, n) is None and method_default(n) is not None})
        return replace(out, scheme="w4afp8")

    def _check_fp8_block(self, recipe) -> None:
        """FP8 block is round-to-nearest on its own grid (absmax / 448 per 128x128 block, as
        llm-compressor's model_free_ptq): the INT4 knobs are refused, not ignored."""
        for name, bad in (("group_size", self.group_size is not None), ("observer", self.observer is not None),
                          ("method", self.method not in (None, DEFAULT_METHOD)),
                          ("keep_fp8", self.keep_fp8)):
            if bad:
                raise QuantizeError(f"{flag(name)} is an INT4 option, but the scheme is fp8-block (one scale per "
                                    f"128x128 block, round to nearest); drop {flag(name)} or use --scheme w4a16")
        if recipe is not None and recipe.method != DEFAULT_METHOD:
            raise QuantizeError(f"{recipe.path}: a {recipe.method} modifier with scheme fp8-block; FP8 block is "
                                "round to nearest, use a QuantizationModifier")

    def _resolve(self, recipe, also: tuple[str, ...] = ()) -> "ConvertOptions":
        if recipe is None:
            method = self.method or DEFAULT_METHOD
            out = replace(
                self,
                group_size=self.group_size if self.group_size is not None else DEFAULT_GROUP_SIZE,
                profile=self.profile or DEFAULT_PROFILE,
                observer=self.observer or default_observer(method),
                method=None if method == DEFAULT_METHOD else method,
            )
            out.check_method_options(also)
            return out._method_defaults()
        if self.group_size is not None and self.group_size != recipe.group_size:
            raise QuantizeError(
                f"--group-size {self.group_size} conflicts with group_size {recipe.group_size} in "
                f"{recipe.path}; drop the flag or edit the recipe"
            )
        if self.observer is not None and recipe.observer is not None and self.observer != recipe.observer:
            raise QuantizeError(
                f"--observer {self.observer} conflicts with observer {recipe.observer} in {recipe.path}; "
                "drop the flag or edit the recipe"
            )
        if self.profile is not None and self.profile != DEFAULT_PROFILE:
            raise QuantizeError(
                f"--profile {self.profile} conflicts with {recipe.path}, whose targets and ignore list decide "
                "what is INT4; drop the flag or edit the recipe"
            )
        rmethod = recipe.method or DEFAULT_METHOD
        if self.method is not None and self.method != rmethod:
            raise QuantizeError(
                f"--method {self.method} conflicts with {recipe.path}, whose modifier means method {rmethod}; "
                "drop the flag or edit the recipe"
            )
        keys = {f.name: spec(f).modifier_key for f in fields(self) if spec(f).modifier_key}
        for name, key in keys.items():
            mine, theirs = getattr(self, name), getattr(recipe, name)
            if mine is not None and theirs is not None and mine != theirs:
                raise QuantizeError(
                    f"{flag(name)} {mine} conflicts with {key} {theirs} in {recipe.path}; "
                    "drop the flag or edit the recipe"
                )
        out = replace(
            self,
            group_size=recipe.group_size,
            profile=DEFAULT_PROFILE,
            observer=self.observer or recipe.observer or default_observer(rmethod),
            method=None if rmethod == DEFAULT_METHOD else rmethod,
            **{
                name: getattr(self, name) if getattr(self, name) is not None else getattr(recipe, name) for name in keys
            },
        )
        out.check_method_options()
        return out._method_defaults()


DEFAULT_GROUP_SIZE = 32
DEFAULT_PROFILE = "experts"
DEFAULT_OBSERVER = "minmax"


# each method's grid when --observer is not given (the resolved one is what the resume key, the
# manifest and the card record). The data-aware methods run on the full-range grid (all 16 codes,
# negative scales, which the H200 W4A16 kernels' source multiplies as written; read, not run on a
# GPU: docs/engines.md#negative-scales); RTN keeps compressed-tensors' absmax / 7.5, bit-identical
# to llm-compressor's model_free_ptq.
DEFAULT_GRID = {"rtn": DEFAULT_OBSERVER, "gptq": "fullrange", "autoround": "fullrange"}


def default_observer(method: str) -> str:
    return DEFAULT_GRID[method]


def method_default(name: str):
    """The default a data-aware option takes under a method that uses it."""
    return next(spec(f).method_default for f in fields(ConvertOptions) if f.name == name)


def method_options() -> dict[str, tuple[str, ...]]:
    """option -> the data-aware methods that use it."""
    return {f.name: spec(f).methods for f in fields(ConvertOptions) if spec(f).methods}


MAX_GPU_MEM_GIB = 1 << 20  # a PiB: past any one GPU, and its bytes stay exact in a float


@dataclass
class PlanOptions(Options):
    """``quantize plan``: what convert would do, from headers; KV-cache capacity per GPU."""

    source: Path | None = opt(None, "checkpoint folder, or a folder / config.json with no weights", argument=True)
    tp: int = opt(1, "tensor parallelism for per-rank bytes", check=lambda v: 1 <= v <= MAX_TP, why=TP_WHY)
    group_size: int | None = same(
        ConvertOptions, "group_size", help="INT4 group size: 32, 64 or 128 (default 32, or the recipe's)"
    )
    profile: str | None = same(
        ConvertOptions, "profile", help="experts (default) or all-linear; with --recipe the recipe decides"
    )
    keep_fp8: bool = same(ConvertOptions, "keep_fp8")
    recipe: str | None = same(ConvertOptions, "recipe")
    scheme: str | None = same(ConvertOptions, "scheme")
    engine: str | None = same(ConvertOptions, "engine")
    requantize: bool = same(ConvertOptions, "requantize")
    gpu_mem_gib: float = opt(
        H200_GIB,
        "GPU memory (default: an H200's)",
        check=lambda v: _positive(v) and v <= MAX_GPU_MEM_GIB,
        why=f"GPU memory must be a positive number of GiB up to {MAX_GPU_MEM_GIB:,} (e.g. 140.4 for an H200)",
    )
    mem_fraction: float = opt(
        DEFAULT_MEM_FRACTION,
        "share for weights + KV cache",
        check=lambda v: 0 < v <= 1,
        why="the share of GPU memory for weights and KV cache must be in (0, 1] (e.g. 0.85)",
    )
    reserve_gib: float = opt(
        DEFAULT_RESERVE_GIB,
        "GiB kept free inside that share",
        check=lambda v: _nonneg(v) and v <= MAX_GPU_MEM_GIB,
        why=f"the memory kept free must be 0 to {MAX_GPU_MEM_GIB:,} GiB (e.g. 4)",
    )


@dataclass
class ShardOptions(Options):
    """``quantize shard``."""

    model: Path | None = opt(None, "converted checkpoint (or, with --merge, a sharded folder)", argument=True)
    out: Path | None = opt(None, "output folder", argument=True)
    tp: int = opt(8, "tensor-parallel size", check=lambda v: 1 <= v <= MAX_TP, why=TP_WHY)
    max_part_gib: float = opt(
        5.0, "largest per-rank part file", check=_positive, why="must be a positive number of GiB", recipe=False
    )
    overwrite: bool = opt(False, "replace an earlier shard output in OUT", recipe=False)


@dataclass
class CheckOptions(Options):
    """``quantize check`` (static checks)."""

    model: Path | None = opt(None, "converted checkpoint, or a sharded folder", argument=True)
    tp: int | None = opt(
        None, "also check the serving kernels' shape rules at this TP", check=lambda v: 1 <= v <= MAX_TP, why=TP_WHY
    )
    source: Path | None = opt(
        None, "source checkpoint (FP8/BF16) for error/SNR, or the unsharded checkpoint of a sharded folder"
    )
    tokens: int = opt(
        8, "random activation rows per kernel check", check=lambda v: 1 <= v <= MAX_CHECK_TOKENS,
        why=f"must be from 1 to {MAX_CHECK_TOKENS} rows"
    )
    seed: int = opt(0, "seed of the random activations", cli=False, check=lambda v: 0 <= v < 2**63, why=SEED_WHY)
    max_source_rel_err: float = opt(
        0.25,
        "largest relative weight error against the source",
        cli=False,
        check=_positive,
        why="must be a positive number",
    )


ENGINE_TOLERANCE = 0.05  # nats: vLLM (fp16) against transformers (fp32) on the same token


@dataclass
class EngineCheckOptions(Options):
    """``quantize check --engine vllm``: the checkpoint served by vLLM against transformers."""

    engine_python: Path | None = opt(
        None,
        "python of a venv with vLLM (default: $QUANTIZE_VLLM_PYTHON, else "
        ".venv-vllm/bin/python next to this repository)",
    )
    engine_tolerance: float = opt(
        ENGINE_TOLERANCE,
        "largest |log-prob difference| (nats) allowed between vLLM (fp16) and transformers (fp32) on the same token",
        check=_positive,
        why="must be a positive number of nats (default 0.05)",
    )


@dataclass
class CalibrateKVOptions(Options):
    """``quantize calibrate-kv``."""

    model: Path | None = opt(
        None, "checkpoint folder (BF16, block FP8 or a quantize convert output) with its tokenizer", argument=True
    )
    out: Path | None = opt(
        None,
        "new checkpoint: the scales (compressed-tensors target, GQA) or, with --fold, the folded "
        "MLA model; without it, the report only",
        recipe=False,
    )
    data: str | None = opt(
        None, "jsonl/txt/parquet file or folder, or hf:NAME; default: the shipped corpus", recipe=False
    )
    samples: int = opt(512, "calibration samples", check=lambda v: v >= 1, why="must be at least 1 (e.g. 512)")
    seq_len: int = opt(
        2048, "tokens per sample at most", check=lambda v: v >= 2, why="must be at least 2 tokens (e.g. 2048)"
    )
    target: str = opt(
        "sglang",
        "sglang | vllm | compressed-tensors: the engine the artifact is for (MLA on sglang/vllm: "
        "unit scale, no scales written)",
        choices=KV_TARGETS,
        why="unknown; use one of {choices}",
    )
    clip: float | None = opt(
        None,
        "percentile clip (e.g. 0.9999) instead of absmax",
        check=lambda v: 0.9 <= v < 1,
        why="a percentile between 0.9 and 1 (e.g. 0.9999), or leave it off for absmax",
    )
    stats_out: Path | None = opt(None, "write per-layer statistics JSON (reusable with --stats)", recipe=False)
    stats: Path | None = opt(None, "reuse a --stats-out file instead of recomputing", recipe=False)
    chat_template: bool = opt(False, "wrap each sample in the tokenizer's chat template")
    error_samples: int = opt(8, "samples the attention error is measured on", cli=False, recipe=False,
                             check=lambda v: v >= 1, why="must be at least 1")
    fold: bool = opt(
        False,
        "MLA: fold the cache range into the weights (exact, powers of two) so the engines' unit-scale "
        "FP8 cache is in range",
    )
    fold_headroom: float = opt(
        2.0,
        "--fold keeps the cache's amax at or below 448 / headroom",
        check=lambda v: v >= 1,
        why="must be at least 1 (the cache's amax is kept at or below 448 / headroom)",
    )
    overwrite: bool = opt(False, "replace an earlier calibrate-kv output in OUT", recipe=False)
    memory_budget_gib: float = opt(
        1.0,
        "routed experts' weights held in memory at once: a MoE layer's experts are read a group at a time "
        "(0: one expert at a time); the report is the same for any value",
        record=False,
        check=_budget,
        why=BUDGET_WHY + " (0: one routed expert at a time)",
    )
    device: str = opt(
        "cpu", "cpu (default) or cuda: where the layer pass runs (several ranks under NCCL: each its own GPU)",
        record=False,
    )
    base_model: str | None = same(ConvertOptions, "base_model")
    nproc: int = same(ConvertOptions, "nproc")
    dist_timeout_s: float = same(ConvertOptions, "dist_timeout_s")


EVAL_TASKS = "gsm8k,arc_easy,arc_challenge,mmlu,mmlu_pro"


@dataclass
class EvalOptions(Options):
    """``quantize eval``: lm-eval tasks, baseline against candidate, paired, gated."""

    baseline: Path | None = opt(None, "the reference model (FP8/BF16)", recipe=False)
    candidate: Path | None = opt(None, "the converted model", recipe=False)
    tasks: str = opt(
        EVAL_TASKS, "comma-separated lm-eval tasks", check=lambda v: any(t.strip() for t in v.split(",")),
        why=f"names no task; pass comma-separated lm-eval tasks, e.g. {EVAL_TASKS}",
    )
    limit: int | None = opt(
        None, "documents per task (the same for both models)", check=lambda v: v >= 1, why="must be at least 1 document"
    )
    data_dir: Path | None = opt(
        None, "local copies of the task data, one folder per task (default: the Hub; `shipped`: the small subset "
        "in the repository's eval/data)"
    )
    max_drop: float = opt(
        1.0,
        "gate: fail a task whose drop exceeds this many points beyond noise",
        check=_nonneg,
        why="must be 0 or more points",
    )
    out: Path | None = opt(None, "write the report JSON here", recipe=False)
    markdown: Path | None = opt(None, "write the Markdown table (for the model card) here", recipe=False)
    max_gen_toks: int | None = opt(
        None,
        "cap generated tokens (GSM8K, MMLU-Pro) for quick runs",
        check=lambda v: v >= 1,
        why="must be at least 1 token",
    )
    chat: bool = opt(
        False,
        "generation tasks (GSM8K, MMLU-Pro) through the model's chat template (served: the chat-completions "
        "endpoint); log-likelihood tasks (ARC, MMLU) keep the task's own prompts, which a chat server cannot score",
    )
    thinking: str | None = opt(
        None,
        "--chat with a reasoning model (its chat template has a thinking switch, GLM-5.x, Kimi K2.x): off (the "
        "default there) or on (needs --max-gen-toks 1024 or more; the engine gets its reasoning parser)",
        choices=("off", "on"),
    )
    device: str = opt("cpu", "where local models run: cpu or cuda")
    batch_size: int = opt(1, "lm-eval batch size", cli=False, check=lambda v: v >= 1, why="must be at least 1")
    resamples: int = opt(
        10000, "bootstrap resamples of the paired difference", cli=False, check=lambda v: v >= 100,
        why="must be at least 100 (a 95% interval from fewer is noise)",
    )
    base_url: str | None = opt(
        None, "evaluate the candidate as served by an OpenAI-compatible server (SGLang/vLLM)", recipe=False
    )
    baseline_url: str | None = opt(None, "likewise for the baseline", recipe=False)
    concurrency: int = opt(
        1, "through a server (--serve, --base-url): requests in flight at once (lm-eval's num_concurrent), which the "
        "engine batches; a GPU node serves 32 or more far faster than one at a time", check=lambda v: 1 <= v <= 1024,
        why="must be from 1 to 1024 requests",
    )
    serve: str | None = opt(
        None,
        "launch this engine (vllm or sglang) on each model folder and evaluate through its server: the baseline, "
        "then the candidate, one at a time on this node",
        choices=SERVE_ENGINES,
    )
    engine_python: Path | None = opt(
        None,
        "--serve: python of a venv with the engine (default: $QUANTIZE_VLLM_PYTHON or .venv-vllm/bin/python for "
        "vllm, $QUANTIZE_SGLANG_PYTHON for sglang)",
        recipe=False,
    )
    tp: int = opt(1, "--serve: tensor-parallel size the engine runs with", check=lambda v: 1 <= v <= MAX_TP,
                  why=TP_WHY)
    kv_cache_dtype: str | None = opt(
        None, "--serve: the engine's KV-cache dtype (default: the engine's own; fp8_e4m3 as the card's launch line)",
        choices=SERVE_KV_DTYPES,
    )
    baseline_kv_cache_dtype: str | None = opt(
        None, "--serve: the baseline's own KV-cache dtype (default: --kv-cache-dtype's), e.g. auto, as its vendor "
        "serves it, beside a candidate served with fp8_e4m3: the comparison then covers the cache as well",
        choices=SERVE_KV_DTYPES,
    )
    serve_args: str = opt("", "--serve: more arguments for the engine's launch line, as one quoted string")
    serve_port: int | None = opt(
        None, "--serve: loopback port (default: a free one)", check=lambda v: 1 <= v <= 65535,
        why="must be a TCP port from 1 to 65535",
    )
    serve_timeout_s: float = opt(
        900.0, "--serve: seconds to wait for the engine's health endpoint", check=_positive,
        why="must be a positive number of seconds",
    )
    serve_log: Path | None = opt(None, "--serve: folder for the engines' logs (default: a new temporary folder)",
                                 recipe=False)
    serve_pd_prefill: Path | None = opt(
        None,
        "--serve sglang: serve the candidate as SGLang's prefill/decode pair on this node: this model folder (the "
        "source release) in the prefill pool on GPUs 0..tp-1, the candidate in the decode pool on the next tp GPUs, "
        "behind sglang_router; generation tasks only (the prefill pool computes every prompt's log-probs)",
        recipe=False,
    )
    verbose: bool = opt(
        False, "show lm-eval's and transformers' own output (default: written to a log file named at the end)",
        record=False,
    )
    save_baseline: Path | None = opt(
        None, "write the baseline's per-document results here, for --baseline-results (its engine stopped, the "
        "next candidate compared without serving it again); with --kld-out its log-probs too, beside it in "
        "NAME.kld.safetensors", recipe=False,
    )
    baseline_results: Path | None = opt(
        None, "reuse a --save-baseline file instead of running the baseline (the same tasks, limit, data and "
        "baseline model, or it is refused); with --kld-out, its KL side too (the same text, tokens, chunk, top-k)",
        recipe=False,
    )
    kld_out: Path | None = opt(
        None, "also KL divergence and top-1 agreement of the candidate against the baseline (eval-kld's report, "
        "written here) from the same runs: with --serve in the same launch of each model", recipe=False,
    )
    kld_tokens: int = opt(
        8192, "tokens of text to score", check=lambda v: 2 <= v <= 1 << 24, why="must be from 2 to 16777216 tokens"
    )
    kld_chunk: int = opt(
        512, "context length per chunk", check=lambda v: 2 <= v <= 1 << 20, why="must be from 2 to 1048576 tokens"
    )
    max_kld: float | None = opt(
        None, "gate (with --kld-out): fail when the mean next-token KL(baseline || candidate) exceeds this",
        check=_nonneg, why="must be 0 or more (nats per token)",
    )
    max_flip_rate: float | None = opt(
        None, "gate (with --kld-out): fail when the share of positions whose top-1 token differs from the "
        "baseline's exceeds this (0 to 1)", check=lambda v: 0 <= v <= 1, why="must be from 0 to 1",
    )
    kld_top_k: int = opt(
        100, "log-probabilities per position the served KL estimator reads (--serve: what the engine returns; vLLM "
        "is launched with --max-logprobs to match); a local run reports that estimate beside the full KL",
        check=lambda v: 1 <= v <= 1000, why="must be from 1 to 1000",
    )


@dataclass
class KLDOptions(Options):
    """``quantize eval-kld``: next-token KL divergence of candidates against a baseline."""

    baseline: Path | None = opt(
        None, "the reference model (FP8/BF16); may be omitted with --baseline-logits", recipe=False
    )
    candidates: list[Path] | None = opt(
        None, "a converted model; repeat to compare several in one table", flag="--candidate", recipe=False
    )
    text: Path | None = opt(None, "plain text to score (default: shipped text)")
    tokens: int = same(EvalOptions, "kld_tokens")
    chunk: int = same(EvalOptions, "kld_chunk")
    save_baseline: Path | None = opt(
        None, "save the baseline's log-probs for reuse (fp16 safetensors; with --serve its served top-k, so the next "
        "candidate is compared without serving the baseline again)"
    )
    baseline_logits: Path | None = opt(
        None, "reuse a --save-baseline file instead of running (or serving) the baseline; it must be of this run's "
        "text, tokens, chunk and tokenizer (and --top-k, when served)"
    )
    dtype: str = opt("float32", "dtype the models run in", cli=False, choices=("float32", "bfloat16"))
    out: Path | None = opt(None, "write the report JSON here")
    device: str = opt("cpu", "where the models run: cpu or cuda")
    serve: str | None = same(EvalOptions, "serve")
    engine_python: Path | None = same(EvalOptions, "engine_python")
    tp: int = same(EvalOptions, "tp")
    kv_cache_dtype: str | None = same(EvalOptions, "kv_cache_dtype")
    baseline_kv_cache_dtype: str | None = same(EvalOptions, "baseline_kv_cache_dtype")
    serve_args: str = same(EvalOptions, "serve_args")
    serve_port: int | None = same(EvalOptions, "serve_port")
    serve_timeout_s: float = same(EvalOptions, "serve_timeout_s")
    serve_log: Path | None = same(EvalOptions, "serve_log")
    verbose: bool = same(EvalOptions, "verbose")
    top_k: int = same(EvalOptions, "kld_top_k")
    max_kld: float | None = same(EvalOptions, "max_kld", help="gate: fail when the mean next-token "
                                 "KL(baseline || candidate) exceeds this")
    max_flip_rate: float | None = same(EvalOptions, "max_flip_rate", help="gate: fail when the share of positions "
                                       "whose top-1 token differs from the baseline's exceeds this (0 to 1)")


@dataclass
class PDOptions(Options):
    """``quantize eval-pd``: the prompt's KV cache from a prefill model, stored as the decode pool
    stores it, decoded by the decode model; KLD/top-1 against the source alone."""

    prefill_model: Path | None = opt(None, "the prefill pool's model (its KV cache is handed over)", recipe=False)
    decode_model: Path | None = opt(None, "the decode pool's model (the converted model)", recipe=False)
    source: Path | None = opt(None, "the source model the pair is compared with", recipe=False)
    text: Path | None = opt(None, "plain text the prompts come from (default: shipped text)")
    prompt_tokens: int = opt(
        256, "prompt tokens the prefill model caches", check=lambda v: v >= 1, why="must be at least 1"
    )
    decode_tokens: int = opt(
        64, "tokens the decode model scores from that cache", check=lambda v: v >= 1, why="must be at least 1"
    )
    kv_cache_dtype: str = opt(
        "fp8_e4m3",
        "how the decode pool stores the cache: fp8_e4m3 or bf16",
        choices=KV_CACHE_DTYPES,
        why="use fp8_e4m3 (the decode pool's FP8 cache; SGLang requires the same on the prefill pool) or bf16",
    )
    device: str = opt("cpu", "where the models run: cpu or cuda")
    out: Path | None = opt(None, "write the report JSON here", recipe=False)


_REF_BAD = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|//|@\{")


def _git_ref(v: str) -> bool:
    """``v`` is a branch name git accepts (``git check-ref-format --branch``'s rules) and the Hub
    serves: no spaces or control characters, no ``..``, no leading or trailing ``/``, no part
    starting with ``.`` or ending in ``.lock``."""
    return (
        bool(v)
        and v != "@"
        and not _REF_BAD.search(v)
        and not v.startswith(("/", "-"))
        and not v.endswith(("/", "."))
        and not any(not part or part.startswith(".") or part.endswith(".lock") for part in v.split("/"))
    )


LICENSE_RE = re.compile(r"[a-z0-9][a-z0-9._+-]{0,63}")  # a Hub licence id: mit, apache-2.0, llama3.1, other


def _licence(v) -> bool:
    return isinstance(v, str) and LICENSE_RE.fullmatch(v) is not None


@dataclass
class PushOptions(Options):
    """``quantize push``."""

    model: Path | None = opt(
        None, "a quantize output (convert, or calibrate-kv --out)", argument=True, metavar="DIR", recipe=False
    )
    repo_id: str | None = opt(
        None,
        "namespace/name on the Hub (HF_ENDPOINT selects another Hub)",
        argument=True,
        metavar="REPO_ID",
        recipe=False,
    )
    private: bool = opt(False, "create the repo private (an existing repo keeps its visibility)")
    revision: str | None = opt(
        None,
        "branch to commit to (created from main if missing; default main)",
        check=_git_ref,
        why="not a branch name: a git ref such as w4a16-g32 (no spaces, control characters, '..', "
        "leading or trailing '/', '//', '@{{', a part starting with '.' or ending in '.lock', nor any of ~^:?*[\\)",
    )
    create_pr: bool = opt(False, "open a pull request instead of committing to the branch")
    dry_run: bool = opt(False, "check the folder and list the files and bytes that would go up; needs no token")
    message: str | None = opt(None, "commit message (default: Upload <folder> (quantize <version>))", recipe=False)
    batch_gib: float = opt(
        32.0,
        "commit after about this many GiB of weights: what is committed survives an interruption",
        check=_positive,
        why="must be a positive number of GiB per commit (default 32)",
        recipe=False,
    )
    base_model: str | None = same(
        ConvertOptions, "base_model", help="the Hub repo (namespace/name) of the base model, for the card "
        "push writes (default: the one the last card, the manifest or the source names)"
    )
    license: str | None = opt(
        None,
        "the Hub licence id for the card's metadata (mit, apache-2.0, other, ...), where the source's card states "
        "none or another applies (default: the one the last card was given, else the source card's)",
        check=_licence,
        why="must be a Hub licence id: lowercase letters, digits, '.', '-', '+' (e.g. mit, apache-2.0, other)",
        metavar="ID",
        recipe=False,  # a recipe sets it once for the card and push stages: pipeline.license
    )


# SGLang's --disaggregation-transfer-backend choices (sglang/srt/arg_groups/choices.py, 0.5.23)
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")


def _port(v) -> bool:
    return 1 <= v <= 65535


@dataclass
class PrefillOptions(Options):
    """The prefill artifact of a prefill/decode pair (``quantize run``'s prefill stage): SGLang
    launch lines for both pools and the router."""

    prefill_tp: int = opt(8, "prefill pool's tensor parallelism", check=lambda v: v >= 1, why="must be at least 1")
    decode_tp: int = opt(8, "decode pool's tensor parallelism", check=lambda v: v >= 1, why="must be at least 1")
    transfer_backend: str = opt("mooncake", "SGLang's KV transfer backend", choices=TRANSFER_BACKENDS)
    bootstrap_port: int = opt(
        8998, "the prefill server's bootstrap port", check=_port, why="must be a port, 1 to 65535"
    )
    prefill_host: str = opt("PREFILL_HOST", "the prefill server's host")
    decode_host: str = opt("DECODE_HOST", "the decode server's host")
    prefill_port: int = opt(30000, "the prefill server's port", check=_port, why="must be a port, 1 to 65535")
    decode_port: int = opt(30001, "the decode server's port", check=_port, why="must be a port, 1 to 65535")
    router_port: int = opt(8000, "the router's port", check=_port, why="must be a port, 1 to 65535")
    revision: str | None = opt(None, "the source's Hub revision the prefill pool serves")
    source_repo: str | None = opt(None, "the source's Hub repo the prefill pool serves")


@dataclass
class PipelineOptions(Options):
    """The run's own keys in a recipe's ``pipeline:`` section (the stages' keys are their commands')."""

    source: str | None = opt(None, "the source checkpoint folder, or tiny:ARCH (made on the fly)")
    out: str | None = opt(None, "the run's folder")
    stages: list[str] | None = opt(
        None, "the stages to run, in order (default: convert, calibrate-kv, shard, check, eval, card, push)"
    )
    data: str | None = opt(None, "calibration text for calibrate-kv and a data-aware convert method")
    repo: str | None = opt(None, "the Hub repo (namespace/name) the card and push name")
    base_model: str | None = same(
        ConvertOptions, "base_model", recipe=True, help="the Hub repo (namespace/name) the source was "
        "downloaded from: recorded by convert and calibrate-kv, the card's base_model"
    )
    license: str | None = same(
        PushOptions, "license", recipe=True, help="the Hub licence id the card states (card and push)"
    )


@dataclass
class EvalStageOptions(Options):
    """The run's eval stage's own keys."""

    kld: bool = opt(False, "also KL divergence of the model against the source from the same runs (with serve: the "
                    "same launch of each model): reports/kld.json, shown in the card")

    if_no_data: str = opt(
        "fail",
        "when lm-eval or the data is absent: fail, or skip the stage (no gate)",
        choices=("fail", "skip"),
        why="use fail or skip",
    )


@dataclass
class CardOptions(Options):
    """``quantize card``."""

    model: Path | None = opt(None, "a quantize output (convert, or calibrate-kv --out)", argument=True, metavar="DIR")
    eval: list[Path] | None = opt(
        None,
        "a `quantize eval --out`, `eval-kld --out`, `calibrate-kv --stats-out` or `check --json` report "
        "(repeatable; default: those of the last card)",
    )
    repo_id: str | None = opt(
        None, "the Hub repo (namespace/name) the card is for: its title and launch lines (default: the folder's "
        "name and path)", flag="--repo",
    )
    base_model: str | None = same(
        ConvertOptions, "base_model", help="the Hub repo (namespace/name) of the base model, for the card's "
        "base_model (default: the one the last card, the manifest or the source names)"
    )
    license: str | None = same(PushOptions, "license")


@dataclass
class MakeTinyOptions(Options):
    """``quantize make-tiny``."""

    arch: str | None = opt(None, "glm_moe_dsa | kimi_k25 | deepseek_v3 | llama", argument=True)
    out: Path | None = opt(None, "output folder", argument=True)
    layout: str = opt(
        "vendor",
        "how the weights are stored: vendor (as the release ships: block FP8 for GLM-5 / DeepSeek-V3, native INT4 "
        "pack-quantized routed experts for Kimi K2.x), fp8 (DeepSeek-style 128x128 block FP8, e.g. Kimi K2 Instruct), "
        "int4 (Moonshot's INT4 layout) or bf16",
        choices=("vendor", "fp8", "int4", "bf16"),
    )
    seed: int = opt(0, "seed of the random weights", check=lambda v: 0 <= v < 2**63, why=SEED_WHY)
    num_shards: int = opt(
        3, "safetensors files to spread the tensors over", check=lambda v: v >= 1, why="must be at least 1"
    )
    overrides: dict | None = opt(None, "config keys to change (KEY -> value)", cli=False)
    mtp: bool = opt(True, "include the MTP layer", cli=False)
    overwrite: bool = opt(False, "replace an earlier make-tiny output in OUT")


@dataclass
class DemoOptions(Options):
    """``quantize demo``."""

    out: Path = opt(Path("demo-out"), "working folder")


@dataclass
class RunOptions(Options):
    """``quantize run``."""

    recipe: Path | None = opt(
        None,
        "recipe YAML: the llm-compressor part plus a pipeline: section (default: the embedded "
        "tiny GLM 5.2 recipe, quantize/recipes_default/tiny-glm.yaml)",
        argument=True,
        required=False,
    )
    out: Path | None = opt(None, "the run's folder (default: the recipe's pipeline.out)")
    source: str | None = opt(
        None, "the source checkpoint folder (or tiny:ARCH) instead of the recipe's pipeline.source"
    )
    data: str | None = opt(None, "calibration text instead of the recipe's pipeline.data (a file, or hf:NAME)")
    data_dir: str | None = opt(
        None, "eval data instead of the recipe's pipeline.data_dir (a folder; `shipped`: the subset in eval/data)"
    )
    sets: list[str] | None = opt(
        None,
        "KEY=VALUE: any pipeline key, a stage's with its section (convert.group_size=64, eval.serve=sglang, "
        "limit=200); the value is read as YAML; repeatable",
        flag="--set",
    )
    plan: bool = opt(False, "print each stage, what it would do and whether it is done, stale or pending; run nothing")
    overwrite: bool = opt(
        False,
        "start the run over (the default continues it: finished stages whose options and inputs "
        "are unchanged are kept)",
    )
