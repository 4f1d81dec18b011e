"""Plan: one job per source tensor (quantize-int4 | dequant | keep-fp8 | copy), grouped into output
shards whose headers are known before any data is read; bytes, per-rank bytes and validation.

``build_plan`` reads headers only (or, with no safetensors present, the tensor table the
architecture derives from config.json), so ``quantize plan`` touches no tensor data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import archs
from .archs.base import IGNORE_PATTERN, ROLE_GROUP, ROLES, Architecture, profile_quantizes
from .checkpoint.index import CheckpointIndex, TensorRef, check_config, load_config
from .checkpoint.reader import fp8_scale_format
from .checkpoint.writer import Entry, file_size
from .errors import QuantizeError
from .formats import layout
from .recipe import Recipe, load_recipe

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "weight_zero_point", "weight_global_scale")
CT_VERSION = "0.19.0"


DEFAULT_GROUP_SIZE = 32
DEFAULT_PROFILE = "experts"
DEFAULT_OBSERVER = "minmax"

METHODS = ("rtn", "gptq", "autoround")
DEFAULT_METHOD = "rtn"
# data-aware defaults (llm-compressor's GPTQModifier; Cheng et al.'s SignRound: 200 steps, lr 1/iters, batch 8)
METHOD_DEFAULTS = {"samples": 128, "seq_len": 2048, "damp": 0.01, "block": 128, "actorder": "static", "iters": 200,
                   "batch_size": 8, "min_expert_tokens": 16}
# GPTQ column order: "static" visits columns by decreasing Hessian diagonal with the groups fixed
# beforehand (llm-compressor's default, its "static"/"weight"; the file format is unchanged, no
# g_idx); "off": left to right. The old dynamic "group" order needs g_idx: not written.
ACTORDERS = ("static", "off")
# option -> the methods that use it ("data" etc.: both data-aware methods)
METHOD_OPTIONS = {"data": ("gptq", "autoround"), "samples": ("gptq", "autoround"), "seq_len": ("gptq", "autoround"),
                  "all_experts": ("gptq", "autoround"), "min_expert_tokens": ("gptq", "autoround"),
                  "damp": ("gptq",), "block": ("gptq",), "actorder": ("gptq",),
                  "iters": ("autoround",), "lr": ("autoround",), "batch_size": ("autoround",)}


def default_observer(method: str) -> str:
    """AutoRound tunes on the full-range grid (all 16 codes) unless --observer says otherwise; RTN
    and GPTQ default to compressed-tensors' absmax / 7.5."""
    return "fullrange" if method == "autoround" else DEFAULT_OBSERVER


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ConvertOptions:
    """None: not given by the user. ``resolve`` fills it from the recipe or the defaults (group 32,
    profile experts, observer minmax); a built plan's options are never None where they apply.
    ``method`` None is round-to-nearest (``--method rtn`` resolves to None too, so an RTN run's
    options, resume key and manifest are what they were before data-aware methods existed); a
    data-aware option stays None under a method that does not use it."""

    group_size: int | None = None
    profile: str | None = None
    observer: str | None = None
    keep_fp8: bool = False
    recipe: str | None = None
    # data-aware methods (quantize/methods/): gptq | autoround, and their options
    method: str | None = None
    data: str | None = None
    samples: int | None = None
    seq_len: int | None = None
    damp: float | None = None
    block: int | None = None
    actorder: str | None = None  # gptq: "static" (default) or "off"; static groups and no g_idx either way
    iters: int | None = None
    lr: float | None = None
    batch_size: int | None = None
    all_experts: bool = False
    min_expert_tokens: int | None = None

    def validate(self) -> None:
        if self.group_size is not None and self.group_size not in layout.SUPPORTED_GROUP_SIZES:
            raise QuantizeError(f"--group-size {self.group_size}: not served by the engines' INT4 kernels; use one of {', '.join(map(str, layout.SUPPORTED_GROUP_SIZES))}")
        if self.profile is not None and self.profile not in archs.base.PROFILES:
            raise QuantizeError(f"--profile {self.profile}: unknown; use one of {', '.join(archs.base.PROFILES)}")
        if self.observer is not None and self.observer not in layout.OBSERVERS:
            raise QuantizeError(f"--observer {self.observer}: unknown; use one of {', '.join(layout.OBSERVERS)}")
        if self.method is not None and self.method not in METHODS:
            raise QuantizeError(f"--method {self.method}: unknown; use one of {', '.join(METHODS)}")
        checks = {
            "samples": (lambda v: v >= 1, "must be at least 1 (e.g. 128)"),
            "seq_len": (lambda v: v >= 2, "must be at least 2 tokens (e.g. 2048)"),
            "damp": (lambda v: 0 < v <= 1, "the Hessian dampening fraction must be in (0, 1] (e.g. 0.01)"),
            "block": (lambda v: v >= 1, "the GPTQ column block must be at least 1 (e.g. 128)"),
            "iters": (lambda v: v >= 0, "must be 0 (RTN on the full-range grid) or more (e.g. 200)"),
            "lr": (lambda v: v > 0 and math.isfinite(v), "the learning rate must be a positive number (default 1/iters)"),
            "batch_size": (lambda v: v >= 1, "must be at least 1 sample (e.g. 8)"),
            "min_expert_tokens": (lambda v: v >= 0, "must be 0 or more tokens (e.g. 16)"),
        }
        for name, (ok, why) in checks.items():
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not ok(v)):
                raise QuantizeError(f"{_flag(name)} {v}: {why}")
        if self.actorder is not None and self.actorder not in ACTORDERS:
            raise QuantizeError(f"--actorder {self.actorder}: use static (columns by decreasing Hessian diagonal, groups fixed: "
                                "the format is unchanged) or off; a dynamic group order would need g_idx, which is not written")
        if self.data is not None and not str(self.data).strip():
            raise QuantizeError("--data '': empty; pass a .jsonl/.txt/.parquet file or folder, or hf:NAME")

    @property
    def method_name(self) -> str:
        return self.method or DEFAULT_METHOD

    def to_dict(self) -> dict:
        """What the manifest, the plan summary and the resume key record: the data-aware fields only
        where a data-aware method runs."""
        d = asdict(self)
        if self.method_name == DEFAULT_METHOD:
            for k in ["method", *METHOD_OPTIONS]:
                d.pop(k, None)
        return d

    def check_method_options(self) -> None:
        """After ``resolve``: an option of a method that does not run is refused, not ignored."""
        for name, methods in METHOD_OPTIONS.items():
            v = getattr(self, name)
            if v not in (None, False) and self.method_name not in methods:
                need = " or ".join(f"--method {m}" for m in methods)
                raise QuantizeError(f"{_flag(name)} is an option of {need}, but the method is {self.method_name}; add {need} or drop {_flag(name)}")

    def _method_defaults(self) -> "ConvertOptions":
        m = self.method
        if m not in ("gptq", "autoround"):
            return self
        fill = {k: v for k, v in METHOD_DEFAULTS.items() if getattr(self, k) is None and m in METHOD_OPTIONS[k]}
        out = replace(self, **fill)
        if m == "autoround" and out.lr is None and out.iters:
            out = replace(out, lr=1.0 / out.iters)  # Cheng et al.: lr 1/iters, decayed linearly to 0
        return out

    def resolve(self, recipe: Recipe | None) -> "ConvertOptions":
        """The options the plan runs with: explicit values, else the recipe's, else the defaults. A
        flag that contradicts the recipe is refused rather than silently replaced."""
        if recipe is None:
            method = self.method or DEFAULT_METHOD
            out = replace(self, group_size=self.group_size if self.group_size is not None else DEFAULT_GROUP_SIZE,
                          profile=self.profile or DEFAULT_PROFILE, observer=self.observer or default_observer(method),
                          method=None if method == DEFAULT_METHOD else method)
            out.check_method_options()
            return out._method_defaults()
        if self.group_size is not None and self.group_size != recipe.group_size:
            raise QuantizeError(f"--group-size {self.group_size} conflicts with group_size {recipe.group_size} in {recipe.path}; drop the flag or edit the recipe")
        if self.observer is not None and recipe.observer is not None and self.observer != recipe.observer:
            raise QuantizeError(f"--observer {self.observer} conflicts with observer {recipe.observer} in {recipe.path}; drop the flag or edit the recipe")
        if self.profile is not None and self.profile != DEFAULT_PROFILE:
            raise QuantizeError(f"--profile {self.profile} conflicts with {recipe.path}, whose targets and ignore list decide what is INT4; drop the flag or edit the recipe")
        rmethod = recipe.method or DEFAULT_METHOD
        if self.method is not None and self.method != rmethod:
            raise QuantizeError(f"--method {self.method} conflicts with {recipe.path}, whose modifier means method {rmethod}; drop the flag or edit the recipe")
        keys = {"damp": "dampening_frac", "block": "block_size", "actorder": "actorder", "iters": "iters", "batch_size": "batch_size", "lr": "lr"}
        for name, key in keys.items():
            mine, theirs = getattr(self, name), getattr(recipe, name)
            if mine is not None and theirs is not None and mine != theirs:
                raise QuantizeError(f"{_flag(name)} {mine} conflicts with {key} {theirs} in {recipe.path}; drop the flag or edit the recipe")
        out = replace(self, group_size=recipe.group_size, profile=DEFAULT_PROFILE,
                      observer=self.observer or recipe.observer or default_observer(rmethod),
                      method=None if rmethod == DEFAULT_METHOD else rmethod,
                      **{name: getattr(self, name) if getattr(self, name) is not None else getattr(recipe, name) for name in keys})
        out.check_method_options()
        return out._method_defaults()


@dataclass
class Job:
    kind: str  # "int4" | "dequant" | "keep_fp8" | "copy"
    name: str  # source tensor name
    role: str
    src: TensorRef
    scale: TensorRef | None = None  # FP8 scale partner (may live in another shard)
    scale_format: str | None = None  # "block" | "channel"
    block: tuple[int, int] = (128, 128)  # FP8 weight_block_size of the source
    outputs: list[Entry] = field(default_factory=list)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


@dataclass
class ShardPlan:
    file: str
    jobs: list[Job]
    metadata: dict[str, str]

    @property
    def entries(self) -> list[Entry]:
        return [e for j in self.jobs for e in j.outputs]

    @property
    def size(self) -> int:
        return file_size(self.entries, self.metadata)

    @property
    def source_bytes(self) -> int:
        return sum(j.src.nbytes + (j.scale.nbytes if j.scale else 0) for j in self.jobs)


@dataclass
class Plan:
    source: str
    arch: Architecture
    options: ConvertOptions
    source_format: str  # "fp8-block" | "ct-fp8" | "float"
    shards: list[ShardPlan]
    dropped: list[str]  # source tensors consumed as scales or dropped (input_scale)
    config_view: dict  # ignore + each config group's targets: what the engines match (no compressed-tensors import)
    config: dict
    source_total_bytes: int
    tp: int = 1
    kv: object | None = None  # kvcache.KvCapacity, filled by ``quantize plan``
    recipe: Recipe | None = None
    _qc: dict | None = field(default=None, repr=False)

    @property
    def quantization_config(self) -> dict:
        """The ``quantization_config`` written to config.json, from compressed-tensors' own models
        (built on first use: ``quantize plan`` never needs it, nor the import)."""
        if self._qc is None:
            self._qc = quantization_config(self.arch, self.config, self.options, self.recipe, self.shards)
        return self._qc

    @property
    def jobs(self) -> list[Job]:
        return [j for s in self.shards for j in s.jobs]

    @property
    def output_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def per_rank_bytes(self, tp: int) -> tuple[int, int]:
        """(source, output) bytes on the largest rank at tensor parallelism ``tp``."""
        src = out = 0.0
        for j in self.jobs:
            split = ROLES[j.role][1]
            f = 1.0 / tp if split != "rep" and len(j.src.shape) >= 1 else 1.0  # norms, router bias: "rep" in ROLES
            src += (j.src.nbytes + (j.scale.nbytes if j.scale else 0)) * f
            out += sum(e.nbytes for e in j.outputs) * f
        return int(math.ceil(src)), int(math.ceil(out))

    def fingerprint(self) -> str:
        """Hash of everything that determines the output bytes."""
        h = hashlib.sha256()
        h.update(json.dumps(self.options.to_dict(), sort_keys=True).encode())
        h.update(json.dumps(self.config_view, sort_keys=True).encode())  # the config is a function of it and the options
        for s in self.shards:
            h.update(s.file.encode())
            for j in s.jobs:
                h.update(f"{j.kind}|{j.name}|{j.src.file}|{j.src.dtype}|{j.src.shape}|{j.src.start}|{j.src.end}".encode())
                for e in j.outputs:
                    h.update(f"{e.name}|{e.dtype}|{e.shape}".encode())
        return h.hexdigest()

    def summary(self) -> dict:
        kinds = Counter(j.kind for j in self.jobs)
        roles: dict[str, Counter] = defaultdict(Counter)
        for j in self.jobs:
            roles[j.role][j.kind] += 1
        src_rank, out_rank = self.per_rank_bytes(self.tp)
        return {
            "source": self.source,
            "architecture": self.arch.name,
            "source_format": self.source_format,
            "options": self.options.to_dict(),
            "tensors": len(self.jobs),
            "jobs": dict(kinds),
            "roles": {r: dict(c) for r, c in sorted(roles.items())},
            "shards": len(self.shards),
            "source_bytes": self.source_total_bytes,
            "output_bytes": self.output_bytes,
            "tp": self.tp,
            "per_rank_source_bytes": src_rank,
            "per_rank_output_bytes": out_rank,
            # total / tp: the usual back-of-envelope figure; per_rank_* above is the largest rank
            # under the TP plan (q_a/kv_a, the DSA indexer, router and norms are replicated)
            "even_split_source_bytes": -(-self.source_total_bytes // self.tp),
            "even_split_output_bytes": -(-self.output_bytes // self.tp),
            "ignore": self.config_view["ignore"],
            **({"kv_bytes_per_token": self.kv.kv_bytes_per_token, "kv_tokens_per_gpu": self.kv.kv_tokens_per_gpu,
                "kv_capacity_inputs": {k: v for k, v in self.kv.to_dict().items() if k not in ("kv_bytes_per_token", "kv_tokens_per_gpu")}}
               if self.kv is not None else {}),
        }


# ---------------------------------------------------------------------------------------------
def detect_source_format(config: dict, arch: Architecture, where: str) -> tuple[str, dict]:
    qc = config.get("quantization_config") or arch.text_config(config).get("quantization_config") or {}
    method = qc.get("quant_method")
    if not qc:
        return "float", qc
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise QuantizeError(f"{where}: FP8 format {qc.get('fmt')!r} is not read; only e4m3 block FP8 is")
        return "fp8-block", qc
    if method == "compressed-tensors":
        fmts = {g.get("format") or qc.get("format") for g in (qc.get("config_groups") or {}).values()} or {qc.get("format")}
        if fmts <= {"float-quantized", "naive-quantized"}:
            for g in (qc.get("config_groups") or {}).values():
                w = g.get("weights") or {}
                if w.get("type") != "float" or w.get("num_bits") != 8:
                    raise QuantizeError(f"{where}: compressed-tensors weights {w.get('type')}{w.get('num_bits')} are not read; only FP8 float-quantized sources are")
            return "ct-fp8", qc
        raise QuantizeError(f"{where}: checkpoint is already compressed-tensors {sorted(map(str, fmts))}; convert reads BF16/FP16 or FP8 sources, not a quantized output")
    raise QuantizeError(f"{where}: quant_method {method!r} is not read; sources must be BF16/FP16, block FP8 (quant_method fp8) or compressed-tensors FP8")


def virtual_index(folder: Path, config: dict, arch: Architecture, source_format: str, qc: dict) -> CheckpointIndex:
    """The tensors a vendor checkpoint holds, from config.json alone (for ``plan`` with no shards)."""
    if arch.expected is None:
        raise QuantizeError(f"{folder}: no safetensors here, and {arch.name} cannot be planned from config.json alone")
    tensors: dict[str, TensorRef] = {}
    block = tuple(qc.get("weight_block_size") or layout.DEFAULT_BLOCK)
    dtype = {"float16": "F16", "float32": "F32"}.get(str(arch.text_config(config).get("torch_dtype") or config.get("torch_dtype") or config.get("dtype")), "BF16")
    pos = 0
    for name, shape, role in arch.expected(arch.text_config(config)):
        lin, _, keep = ROLES[role]
        if role == "router_bias":
            dt = "F32"
        elif source_format == "fp8-block" and lin and not keep and len(shape) == 2:
            dt = "F8_E4M3"
        else:
            dt = dtype
        n = math.prod(shape) * (4 if dt == "F32" else 1 if dt == "F8_E4M3" else 2)
        tensors[name] = TensorRef(name, "(config)", dt, shape, pos, pos + n)
        pos += n
        if dt == "F8_E4M3":
            g = layout.block_grid(shape, block)
            sname = name[: -len("weight")] + "weight_scale_inv"
            tensors[sname] = TensorRef(sname, "(config)", "F32", g, pos, pos + 4 * math.prod(g))
            pos += 4 * math.prod(g)
    return CheckpointIndex(folder, tensors, ["(config)"], config, {})


# ---------------------------------------------------------------------------------------------
def _decide_by_recipe(recipe: Recipe, module: str) -> bool:
    from compressed_tensors.utils.match import match_name

    targeted = any(t == "Linear" or match_name(module, t) for t in recipe.targets)
    return targeted and not any(match_name(module, i) for i in recipe.ignore)


def build_plan(source: str | Path, options: ConvertOptions, tp: int = 1, allow_config_only: bool = False, ct_check: bool = True) -> Plan:
    """``ct_check``: also match the config with compressed-tensors' own matcher (convert does; the
    header-only ``quantize plan`` keeps to the engines' matching, without importing it)."""
    options.validate()
    folder = Path(source)
    recipe = load_recipe(options.recipe) if options.recipe else None
    options = options.resolve(recipe)  # never None from here on: plan.options is what the record and manifest hold
    has_tensors = folder.is_dir() and (any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").exists())
    if has_tensors or not allow_config_only:
        index = CheckpointIndex.open(folder)
        config = index.config
    else:
        config = load_config(folder) if folder.is_dir() else _load_config_file(folder)
        index = None
    where = str(folder / "config.json") if folder.is_dir() else str(folder)
    arch = archs.resolve(config, where)
    source_format, src_qc = detect_source_format(config, arch, where)
    if index is None:
        index = virtual_index(folder, config, arch, source_format, src_qc)
    block = tuple(src_qc.get("weight_block_size") or layout.DEFAULT_BLOCK)

    jobs_by_file: dict[str, list[Job]] = defaultdict(list)
    dropped: list[str] = []
    consumed: set[str] = set()
    tensors = index.tensors
    for name, ref in tensors.items():
        base, _, param = name.rpartition(".")
        if param in SCALE_SUFFIXES:
            weight = f"{base}.weight"
            if weight not in tensors:
                raise QuantizeError(f"{folder / ref.file}: scale tensor {name} has no weight {weight}; the checkpoint is incomplete")
            continue  # consumed by its weight's job (or dropped) below
        role, layer = arch.role_of(name)
        job = Job("copy", name, role, ref, outputs=[Entry(name, ref.dtype, ref.shape)])
        is_fp8 = ref.dtype in ("F8_E4M3",)
        if is_fp8:
            sname = f"{base}.weight_scale_inv" if source_format == "fp8-block" else f"{base}.weight_scale"
            if param != "weight" or sname not in tensors:
                raise QuantizeError(f"{folder / ref.file}: FP8 tensor {name} has no {sname}; the checkpoint is incomplete or not {source_format} (re-download the shard that should hold it)")
            job.scale = tensors[sname]
            job.block = block
            consumed.add(sname)
            job.scale_format = fp8_scale_format(ref, job.scale, block, folder)  # one decision, shared with the reader
        elif ref.dtype.startswith("F8"):
            raise QuantizeError(f"{folder / ref.file}: tensor {name} has dtype {ref.dtype}; only e4m3 FP8 weights are read")
        is_weight2d = param == "weight" and len(ref.shape) == 2 and ROLES[role][0]
        if is_weight2d:
            module = base
            quant = _decide_by_recipe(recipe, module) if recipe else profile_quantizes(options.profile, role)
            if quant:
                out, k = ref.shape
                job.kind = "int4"
                sdt = "BF16" if is_fp8 or ref.dtype == "BF16" else ref.dtype
                job.outputs = [
                    Entry(f"{module}.weight_packed", "I32", layout.packed_shape((out, k))),
                    Entry(f"{module}.weight_scale", sdt, layout.scale_shape((out, k), options.group_size) if k % options.group_size == 0 else (out, k // options.group_size)),
                    Entry(f"{module}.weight_shape", "I64", (2,)),
                ]
            elif is_fp8 and options.keep_fp8:
                job.kind = "keep_fp8"
                job.outputs = [Entry(name, ref.dtype, ref.shape), Entry(f"{module}.weight_scale", job.scale.dtype, job.scale.shape)]
            elif is_fp8:
                job.kind = "dequant"
                job.outputs = [Entry(name, "BF16", ref.shape)]
        elif is_fp8:
            job.kind = "dequant"
            job.outputs = [Entry(name, "BF16", ref.shape)]
        jobs_by_file[ref.file].append(job)
    for name in tensors:
        base, _, param = name.rpartition(".")
        if param in SCALE_SUFFIXES and name not in consumed:
            if param in ("input_scale",):
                dropped.append(name)
                continue
            if param == "weight_scale" and source_format == "float":
                continue
            ref = tensors[name]
            raise QuantizeError(f"{folder / ref.file}: {name} is a scale for a weight that is not FP8 ({tensors[base + '.weight'].dtype}); the checkpoint mixes formats, re-export it")
    dropped += sorted(consumed)

    meta = {"format": "pt"}
    shards = [ShardPlan(f, jobs_by_file[f], meta) for f in index.files if jobs_by_file.get(f)]
    view = config_view(arch, config, options, recipe, shards)
    plan = Plan(str(folder), arch, options, source_format, shards, dropped, view, config, index.total_bytes, tp, recipe=recipe)
    validate_plan(plan, recipe, ct_check=ct_check)
    return plan


def _load_config_file(path: Path) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise QuantizeError(f"{path}: cannot read a config.json ({e})") from e
    if not isinstance(cfg, dict):
        raise QuantizeError(f"{path}: not a JSON object; fix the file")
    check_config(cfg, path)  # the same field checks as a checkpoint's config.json
    return cfg


# ---------------------------------------------------------------------------------------------
def ignore_list(arch: Architecture, config: dict, options: ConvertOptions, roles_present: set[str],
                fp8_roles: frozenset[str] = frozenset()) -> list[str]:
    """Engine-safe ignore patterns for every high-precision (BF16) Linear role present; roles kept
    FP8 (``--keep-fp8``) are targeted by their own config group instead of ignored."""
    # lm_head is never INT4, and exists in every engine even when tied to the embeddings (then the
    # checkpoint has no lm_head tensor, but a "Linear" target would still build it as INT4)
    groups: list[str] = (["embed"] if "embed" in roles_present else []) + ["lm_head"]
    if fp8_roles:
        # attention and shared/dense MLP stay FP8: ignore only the roles the vendor left BF16
        for role in sorted(roles_present):
            if ROLES[role][0] and not profile_quantizes(options.profile, role) and role not in fp8_roles:
                g = KEEP_FP8_IGNORE.get(role, ROLE_GROUP.get(role))
                if g and g not in groups:
                    groups.append(g)
        return [IGNORE_PATTERN[g] for g in groups] + (["re:.*lm_head$"] if "lm_head" in groups else [])
    for role in sorted(roles_present):
        if not ROLES[role][0] or profile_quantizes(options.profile, role):
            continue
        g = ROLE_GROUP.get(role)
        if g and g not in groups:
            groups.append(g)
    # the attention group covers the indexer; dense covers nothing else
    if "attention" in groups and "indexer" in groups:
        groups.remove("indexer")
    order = list(IGNORE_PATTERN)
    pats = [IGNORE_PATTERN[g] for g in sorted(groups, key=order.index)]
    if "lm_head" in groups:
        # exact-name matchers see `language_model.lm_head` (Kimi on disk), and transformers' tying of
        # lm_head to the embeddings (SmolLM2) honours only the regex form: write both
        pats.insert(1, "re:.*lm_head$")
    return pats


def config_view(arch: Architecture, config: dict, options: ConvertOptions, recipe: Recipe | None, shards: list[ShardPlan]) -> dict:
    """What the engines match against their module names: the ignore list and each config group's
    targets (config_group_0: INT4; config_group_1: the FP8 weights --keep-fp8 keeps)."""
    roles = {j.role for s in shards for j in s.jobs}
    fp8_roles = frozenset(j.role for s in shards for j in s.jobs if j.kind == "keep_fp8")
    if recipe:
        if fp8_roles:
            raise QuantizeError(f"{recipe.path}: --keep-fp8 with a recipe is not supported; drop one of them")
        ignore, targets = list(recipe.ignore), list(recipe.targets)
    else:
        ignore, targets = ignore_list(arch, config, options, roles, fp8_roles), ["Linear"]
    groups = {"config_group_0": {"targets": targets}}
    if fp8_roles:
        groups["config_group_1"] = {"targets": keep_fp8_targets(arch, shards)}
    return {"ignore": ignore, "config_groups": groups}


def quantization_config(arch: Architecture, config: dict, options: ConvertOptions, recipe: Recipe | None, shards: list[ShardPlan]) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    from .formats import int4

    view = config_view(arch, config, options, recipe, shards)
    # compressed-tensors' own models, dumped as its 0.19 writes them (llmcompressor's update_config)
    groups = {"config_group_0": QuantizationScheme(targets=view["config_groups"]["config_group_0"]["targets"], format="pack-quantized",
                                                   weights=QuantizationArgs.model_validate(int4.weights_args(options.group_size)))}
    kept = "config_group_1" in view["config_groups"]
    if kept:  # the vendor's 128x128 block FP8 weights, dynamic per-128-group FP8 activations
        groups["config_group_1"] = QuantizationScheme(
            targets=view["config_groups"]["config_group_1"]["targets"], format="float-quantized",
            weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128], dynamic=False),
            input_activations=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group", group_size=128, dynamic=True))
    qc = QuantizationConfig(config_groups=groups, format="mixed-precision" if kept else "pack-quantized", ignore=view["ignore"],
                            quantization_status="compressed", kv_cache_scheme=None, global_compression_ratio=None)
    return {"version": CT_VERSION, "quant_method": "compressed-tensors", "transform_config": {}, **qc.model_dump(mode="json")}


# --keep-fp8: the BF16 indexer head is ignored on its own; everything else of attention is FP8
KEEP_FP8_IGNORE = {"indexer_weights": "indexer_weights"}
FP8_TARGET = {
    "attention": "re:.*self_attn\\.(?!indexer\\.weights_proj).*",
    "indexer": "re:.*self_attn\\.indexer\\.(wq_b|wk).*",
}


def keep_fp8_targets(arch: Architecture, shards: list[ShardPlan]) -> list[str]:
    groups = sorted({ROLE_GROUP.get(j.role, j.role) for s in shards for j in s.jobs if j.kind == "keep_fp8"})
    if "attention" in groups and "indexer" in groups:
        groups.remove("indexer")
    return [FP8_TARGET.get(g, IGNORE_PATTERN.get(g, g)) for g in groups]


# ---------------------------------------------------------------------------------------------
def _sglang_match(name: str, pat: str) -> bool:
    """SGLang semantics: re: -> re.match; plain -> case-insensitive substring."""
    import re

    return re.match(pat[3:], name) is not None if pat.startswith("re:") else pat.lower() in name.lower()


def _ct_match(name: str, pat: str) -> bool:
    from compressed_tensors.utils.match import match_name

    return match_name(name, pat)


def _scheme_for(name: str, qc: dict, match) -> str:
    """The config group an engine applies to a Linear called ``name`` ("bf16" if ignored): ignore
    first, then name/regex targets, then the class target "Linear" (compressed-tensors and SGLang
    both rank a name match above a class match)."""
    if any(match(name, p) for p in qc["ignore"]):
        return "bf16"
    groups = qc["config_groups"]
    for g, grp in groups.items():
        if any(t != "Linear" and match(name, t) for t in grp["targets"]):
            return g
    for g, grp in groups.items():
        if "Linear" in grp["targets"]:
            return g
    return "bf16"


EXPECT = {"int4": "config_group_0", "keep_fp8": "config_group_1"}


def check_with_compressed_tensors(plan: Plan) -> None:
    """compressed-tensors' own matcher on checkpoint names reproduces every decision of the plan
    (an internal consistency check: the ignore list is ours, the matcher theirs). Imports
    compressed-tensors (seconds), so convert runs it beside the first tensors."""
    if plan.recipe is not None:
        return
    for j in plan.jobs:
        if j.src.name.endswith(".weight") and len(j.src.shape) == 2 and ROLES[j.role][0]:
            want = EXPECT.get(j.kind, "bf16")
            got = _scheme_for(j.module, plan.config_view, _ct_match)
            if got != want:
                raise QuantizeError(f"internal: quantization_config puts {j.module} in {got}, the plan in {want}; please report this")


def validate_plan(plan: Plan, recipe: Recipe | None, ct_check: bool = True) -> None:
    """Everything that can fail, before any byte is written: group divisibility, uniform schemes
    across engine-fused modules and experts, and an ignore list that holds in the engines."""
    arch, cfg, g = plan.arch, plan.config, plan.options.group_size
    decision: dict[str, bool] = {}
    for j in plan.jobs:
        if j.src.name.endswith(".weight") and len(j.src.shape) == 2 and ROLES[j.role][0]:
            decision[j.module] = j.kind == "int4"
        if j.kind == "int4" and j.src.shape[1] % g:
            k = j.src.shape[1]
            fits = [x for x in layout.SUPPORTED_GROUP_SIZES if k % x == 0]
            fix = f"use --group-size {fits[-1]}" if fits else "keep it high precision (--profile experts or a recipe ignore)"
            raise QuantizeError(f"{j.src.file}: tensor {j.name} has K={k}, not a multiple of group size {g}; {fix}")
    # fused sets and experts share one scheme
    by_layer: dict[str, set[bool]] = defaultdict(set)
    for module, q in decision.items():
        for member in arch.fused_members(module):
            if member in decision and decision[member] != q:
                raise QuantizeError(f"{module} is {'INT4' if q else 'high precision'} but {member}, which the engines fuse with it, is not; quantize both or neither (adjust the recipe's ignore list)")
        role, layer = arch.role_of(module + ".weight")
        if role in archs.base.EXPERT_ROLES:
            by_layer[module.split(".experts.")[0]].add(q)
    for layer, qs in by_layer.items():
        if len(qs) > 1:
            raise QuantizeError(f"{layer}: some routed experts are INT4 and others are not; fused MoE kernels need one scheme for all experts of a layer (fix the recipe's ignore list)")
    # the written config must reproduce the plan's decisions, for compressed-tensors (checkpoint
    # names, exact/regex) and for SGLang (its module names, fused ones included)
    qc = plan.config_view
    if ct_check:
        check_with_compressed_tensors(plan)
    for j in plan.jobs:
        if j.module not in decision:
            continue
        want = EXPECT.get(j.kind, "bf16")
        for ename in arch.engine_module_names(j.module, cfg):
            got = _scheme_for(ename, qc, _sglang_match)
            if got != want:
                raise QuantizeError(f"quantization_config puts engine module {ename} (checkpoint {j.module}) in {got}, but the checkpoint holds it as {want}: SGLang would build the wrong layer and fail to load; fix the ignore list with re:.* patterns that {'match' if want == 'bf16' else 'exclude'} it")


# ---------------------------------------------------------------------------------------------
def plan(source: str | os.PathLike, tp: int = 1, group_size: int | None = None, profile: str | None = None,
         keep_fp8: bool = False, recipe: str | None = None, gpu_mem_gib: float | None = None,
         mem_fraction: float | None = None, reserve_gib: float | None = None) -> Plan:
    """``quantize plan``: the conversion plan from headers (or config.json alone), no tensor data,
    with KV-cache capacity per GPU (``Plan.kv``) for the given GPU memory inputs. ``group_size`` /
    ``profile`` None: not given (the recipe's, else 32 / experts)."""
    from . import kvcache

    if tp < 1:
        raise QuantizeError(f"--tp {tp}: must be at least 1")
    # kvcache.capacity's inputs, checked before any file is read
    gpu = gpu_mem_gib if gpu_mem_gib is not None else kvcache.H200_GIB
    frac = mem_fraction if mem_fraction is not None else kvcache.DEFAULT_MEM_FRACTION
    reserve = reserve_gib if reserve_gib is not None else kvcache.DEFAULT_RESERVE_GIB
    if not (gpu > 0 and math.isfinite(gpu)):
        raise QuantizeError(f"--gpu-mem-gib {gpu}: GPU memory must be a positive number of GiB (e.g. 140.4 for an H200)")
    if not 0 < frac <= 1:
        raise QuantizeError(f"--mem-fraction {frac}: the share of GPU memory for weights and KV cache must be in (0, 1] (e.g. 0.85)")
    if not (reserve >= 0 and math.isfinite(reserve)):
        raise QuantizeError(f"--reserve-gib {reserve}: the memory kept free must be 0 or more GiB (e.g. 4)")
    p = build_plan(Path(source), ConvertOptions(group_size=group_size, profile=profile, keep_fp8=keep_fp8, recipe=recipe), tp=tp,
                   allow_config_only=True, ct_check=False)
    # the same rule as ``quantize shard``: attention heads split evenly over the ranks
    heads = int(p.arch.text_config(p.config).get("num_attention_heads", tp))
    if heads % tp:
        where = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
        fits = [t for t in range(1, heads + 1) if heads % t == 0 and t <= 64]
        raise QuantizeError(f"--tp {tp}: {heads} attention heads in {where} do not split over TP {tp}; use a TP that divides {heads} ({', '.join(map(str, fits))})")
    p.kv = kvcache.capacity(p.arch, p.config, p.per_rank_bytes(tp)[1], tp, gpu, frac, reserve)
    return p
