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
from dataclasses import dataclass, field
from pathlib import Path

from . import archs
from .archs.base import (ENGINE_UNQUANTIZED, EXPERT_ROLES, IGNORE_PATTERN, PROFILES, ROLE_GROUP, ROLES, Architecture,
                         profile_quantizes)
from .checkpoint.config import ModelConfig
from .checkpoint.index import CheckpointIndex, TensorRef, load_config, read_tensor
from .checkpoint.reader import fp8_scale_format
from .checkpoint.writer import Entry, file_size
from .errors import QuantizeError
from .formats import layout
# ConvertOptions: also imported from here by callers
from .options import W4AFP8_GROUP, ConvertOptions, PlanOptions, takes
from .recipe import Recipe, load_recipe

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "weight_zero_point", "weight_global_scale")
CT_VERSION = "0.19.0"


@dataclass
class Job:
    kind: str  # "int4" | "pass_int4" (an INT4 source tensor, bit for bit) | "dequant" | "keep_fp8" | "copy"
    name: str  # source tensor name
    role: str
    src: TensorRef
    scale: TensorRef | None = None  # FP8 scale partner (may live in another shard)
    scale_format: str | None = None  # "block" | "channel"
    block: tuple[int, int] = (128, 128)  # FP8 weight_block_size of the source
    outputs: list[Entry] = field(default_factory=list)
    extra: list[TensorRef] = field(default_factory=list)  # an INT4 source's weight_shape
    shape: tuple[int, int] | None = None  # the weight's [out, in] when src is not the weight itself (INT4)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def inputs(self) -> list[TensorRef]:
        """The source tensors the job reads (a copy streams them to ``outputs`` one for one)."""
        return [self.src] + ([self.scale] if self.scale else []) + self.extra

    @property
    def in_bytes(self) -> int:
        return sum(r.nbytes for r in self.inputs)

    @property
    def wshape(self) -> tuple[int, ...]:
        """The weight's logical shape ([out, in]), whatever it is stored as."""
        return tuple(self.shape) if self.shape else tuple(self.src.shape)


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
        return sum(j.in_bytes for j in self.jobs)


@dataclass
class Plan:
    source: str
    arch: Architecture
    options: ConvertOptions
    source_format: str  # "fp8-block" | "ct-fp8" | "ct-int4" | "float"
    shards: list[ShardPlan]
    dropped: list[str]  # source tensors consumed as scales or dropped (input_scale)
    config_view: dict  # ignore + each config group's targets: what the engines match (no compressed-tensors import)
    config: dict
    source_total_bytes: int
    tp: int = 1
    kv: object | None = None  # kvcache.KvCapacity, filled by ``quantize plan``
    recipe: Recipe | None = None
    source_int4: "Int4Scheme | None" = None  # an INT4 source's scheme (its tensors pass through unless re-quantized)
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
            src += j.in_bytes * f
            out += sum(e.nbytes for e in j.outputs) * f
        return int(math.ceil(src)), int(math.ceil(out))

    def fingerprint(self) -> str:
        """Hash of everything that determines the output bytes."""
        h = hashlib.sha256()
        h.update(json.dumps(self.options.key_dict(), sort_keys=True).encode())
        h.update(
            json.dumps(self.config_view, sort_keys=True).encode()
        )  # the config is a function of it and the options
        for s in self.shards:
            h.update(s.file.encode())
            for j in s.jobs:
                h.update(
                    f"{j.kind}|{j.name}|{j.src.file}|{j.src.dtype}|{j.src.shape}|{j.src.start}|{j.src.end}".encode()
                )
                for e in j.outputs:
                    h.update(f"{e.name}|{e.dtype}|{e.shape}".encode())
        return h.hexdigest()

    def summary(self) -> dict:
        kinds = Counter(j.kind for j in self.jobs)
        roles: dict[str, Counter] = defaultdict(Counter)
        for j in self.jobs:
            roles[j.role][j.kind] += 1
        src_rank, out_rank = self.per_rank_bytes(self.tp)
        out_bytes = self.output_bytes  # every output header serialised: once (seconds at full size)
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
            "output_bytes": out_bytes,
            "tp": self.tp,
            "per_rank_source_bytes": src_rank,
            "per_rank_output_bytes": out_rank,
            # total / tp: the usual back-of-envelope figure; per_rank_* above is the largest rank
            # under the TP plan (q_a/kv_a, the DSA indexer, router and norms are replicated)
            "even_split_source_bytes": -(-self.source_total_bytes // self.tp),
            "even_split_output_bytes": -(-out_bytes // self.tp),
            "ignore": self.config_view["ignore"],
            **(
                {
                    "kv_bytes_per_token": self.kv.kv_bytes_per_token,
                    "kv_tokens_per_gpu": self.kv.kv_tokens_per_gpu,
                    "kv_capacity_inputs": {
                        k: v
                        for k, v in self.kv.to_dict().items()
                        if k not in ("kv_bytes_per_token", "kv_tokens_per_gpu")
                    },
                }
                if self.kv is not None
                else {}
            ),
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
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
            raise QuantizeError(f"{where}: quantization_config.config_groups is missing or not a mapping of groups; "
                                "the config is corrupt, re-download config.json")
        int4_groups = {}
        for gname, g in groups.items():
            fmt = g.get("format") or qc.get("format")
            w = g.get("weights")
            key = f"quantization_config.config_groups.{gname}"
            if fmt == "pack-quantized":
                int4_groups[gname] = _int4_group(w, g, key, where)
            elif fmt in ("float-quantized", "naive-quantized"):
                if not isinstance(w, dict):
                    got = "missing" if "weights" not in g else "null" if w is None else f"a {type(w).__name__}"
                    raise QuantizeError(f"{where}: {key}.weights is {got}; a {fmt} group needs its weights scheme "
                                        "(type float, num_bits 8); the config is corrupt, re-download config.json")
                if w.get("type") != "float" or w.get("num_bits") != 8:
                    raise QuantizeError(
                        f"{where}: {key}.weights is type {w.get('type')!r}, num_bits {w.get('num_bits')!r} "
                        f"{fmt}; only FP8 (type float, num_bits 8, an integer) float-quantized and INT4 "
                        "pack-quantized sources are read"
                    )
            else:
                raise QuantizeError(
                    f"{where}: {key} has format {fmt!r}, which is not read; sources are BF16/FP16, block FP8, "
                    "compressed-tensors FP8 (float-quantized) or INT4 (pack-quantized)"
                )
        if int4_groups:
            sizes = sorted({g for g in int4_groups.values()})
            if len(sizes) > 1:
                raise QuantizeError(f"{where}: INT4 config groups with different group sizes {sizes} are not read; "
                                    "one group size per checkpoint")
            return "ct-int4", qc
        return "ct-fp8", qc
    raise QuantizeError(
        f"{where}: quant_method {method!r} is not read; sources must be BF16/FP16, block FP8 (quant_method fp8) or "
        "compressed-tensors FP8"
    )


@dataclass(frozen=True)
class Int4Scheme:
    """An INT4 source's weights as its quantization_config declares them (validated)."""

    group_size: int
    observer: str  # "minmax" when the config names none (compressed-tensors' default for weights)

    def describe(self) -> str:
        return f"symmetric INT4, group {self.group_size}, observer {self.observer}"


def _int4_group(w, g: dict, key: str, where: str) -> int:
    """One pack-quantized config group's group size, or a one-line error naming the key."""
    if not isinstance(w, dict):
        got = "missing" if "weights" not in g else "null" if w is None else f"a {type(w).__name__}"
        raise QuantizeError(f"{where}: {key}.weights is {got}; a pack-quantized group needs its weights scheme "
                            "(type int, num_bits 4, symmetric true, strategy group, group_size); the config is "
                            "corrupt, re-download config.json")
    if "num_bits" in w and type(w["num_bits"]) is not int:
        raise QuantizeError(f"{where}: {key}.weights.num_bits is {w['num_bits']!r}, a {type(w['num_bits']).__name__}; "
                            "it must be an integer (4 for INT4); the config is corrupt, fix or re-download config.json")
    if w.get("type") != "int" or w.get("num_bits") != 4:
        raise QuantizeError(f"{where}: {key}.weights is type {w.get('type')!r}, num_bits {w.get('num_bits')!r} "
                            "pack-quantized; only INT4 (type int, num_bits 4) is read")
    if w.get("symmetric") is not True:
        raise QuantizeError(f"{where}: {key}.weights.symmetric is {w.get('symmetric')!r}: asymmetric INT4 (zero "
                            "points) is not read; the engines' W4A16 MoE kernels take symmetric codes only")
    if w.get("strategy") != "group":
        raise QuantizeError(f"{where}: {key}.weights.strategy is {w.get('strategy')!r}; only group-wise INT4 "
                            "(strategy group) is read")
    gs = w.get("group_size")
    if type(gs) is not int or gs < 1 or gs > 1 << 20:
        raise QuantizeError(f"{where}: {key}.weights.group_size is {gs!r}; a group-wise INT4 config needs a "
                            "positive integer group size")
    if w.get("actorder") not in (None, "static", "weight"):
        raise QuantizeError(f"{where}: {key}.weights.actorder is {w.get('actorder')!r}: act-order with a g_idx "
                            "permutation is not read; only static group order is")
    if w.get("dynamic") not in (None, False):
        raise QuantizeError(f"{where}: {key}.weights.dynamic is {w.get('dynamic')!r}; INT4 weights must be "
                            "static (dynamic false)")
    for act in ("input_activations", "output_activations"):
        if g.get(act) not in (None, {}):
            raise QuantizeError(f"{where}: {key}.{act} is set: activation quantization is not read; only "
                                "weight-only INT4 (W4A16) is")
    return gs


def int4_scheme(qc: dict) -> Int4Scheme:
    """The (already validated) INT4 scheme of a ``ct-int4`` source's quantization_config."""
    for g in qc["config_groups"].values():
        if (g.get("format") or qc.get("format")) == "pack-quantized":
            w = g["weights"]
            return Int4Scheme(int(w["group_size"]), str(w.get("observer") or "minmax"))
    raise AssertionError("not an INT4 quantization_config")


def _int4_targets(qc: dict) -> dict[str, list[str]]:
    return {n: list(g.get("targets") or []) for n, g in qc["config_groups"].items()
            if (g.get("format") or qc.get("format")) == "pack-quantized"}


def _ct_name_match(name: str, pat: str) -> bool:
    """compressed-tensors' ``match_name`` rule (re: is ``re.match``, else the exact name), written
    here so the header-only plan needs no compressed-tensors import (tests hold it to theirs)."""
    import re

    return re.match(pat[3:], name) is not None if pat.startswith("re:") else pat == name


class _Patterns:
    """A list of compressed-tensors patterns compiled once: ``match(name)`` is ``_ct_name_match``
    against any of them (Kimi K2.6's config is matched against ~70,000 modules)."""

    def __init__(self, pats):
        import re

        self.exact = {p for p in pats if not p.startswith("re:")}
        self.regex = [re.compile(p[3:]) for p in pats if p.startswith("re:")]
        self.linear = "Linear" in self.exact

    def match(self, name: str) -> bool:
        return name in self.exact or any(r.match(name) for r in self.regex)


def _source_patterns(qc: dict) -> tuple[_Patterns, _Patterns]:
    """(ignore, INT4 targets) of ``qc``, compiled once per config object (the last one is kept)."""
    held = _PATTERNS.get("qc")
    if held is None or held[0] is not qc:
        held = _PATTERNS["qc"] = (qc, _Patterns(qc.get("ignore") or []),
                                  _Patterns([t for ts in _int4_targets(qc).values() for t in ts]))
    return held[1], held[2]


_PATTERNS: dict[str, tuple] = {}


def source_int4_module(names: list[str], qc: dict) -> bool:
    """Whether an INT4 source's config makes a Linear INT4 (targeted, and ignored under none of
    ``names``: the checkpoint's and the engine's, e.g. Moonshot's plain ``lm_head`` is
    ``language_model.lm_head`` on disk)."""
    ignore, targets = _source_patterns(qc)
    if any(ignore.match(n) for n in names):
        return False
    return targets.linear or any(targets.match(n) for n in names)


def _names(arch: Architecture, module: str, config: dict) -> list[str]:
    return [module] + [n for n in arch.engine_module_names(module, config)[:1] if n != module]


def virtual_index(folder: Path, config: dict, arch: Architecture, source_format: str, qc: dict) -> CheckpointIndex:
    """The tensors a vendor checkpoint holds, from config.json alone (for ``plan`` with no shards)."""
    if arch.expected is None:
        raise QuantizeError(f"{folder}: no safetensors here, and {arch.name} cannot be planned from config.json alone")
    tensors: dict[str, TensorRef] = {}
    block = tuple(qc.get("weight_block_size") or layout.DEFAULT_BLOCK)
    dtype = {"float16": "F16", "float32": "F32"}.get(
        str(arch.text_config(config).get("torch_dtype") or config.get("torch_dtype") or config.get("dtype")), "BF16"
    )
    pos = 0
    g4 = int4_scheme(qc).group_size if source_format == "ct-int4" else None
    for name, shape, role in arch.expected(arch.text_config(config)):
        lin, _, keep = ROLES[role]
        if (g4 and lin and len(shape) == 2 and name.endswith(".weight") and role not in ENGINE_UNQUANTIZED
                and source_int4_module(_names(arch, name[:-7], config), qc)):
            m, (o, k) = name[: -len(".weight")], shape
            for part, dt, shp, size in (("weight_packed", "I32", (o, -(-k // 8)), 4), ("weight_scale", dtype,
                                        (o, k // g4), 2 if dtype != "F32" else 4), ("weight_shape", "I64", (2,), 8)):
                n = math.prod(shp) * size
                tensors[f"{m}.{part}"] = TensorRef(f"{m}.{part}", "(config)", dt, shp, pos, pos + n)
                pos += n
            continue
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


def build_plan(
    source: str | Path, options: ConvertOptions, tp: int = 1, allow_config_only: bool = False, ct_check: bool = True,
    header_only: bool = False,
) -> Plan:
    """``ct_check``: also match the config with compressed-tensors' own matcher (convert does; the
    header-only ``quantize plan`` keeps to the engines' matching, without importing it).
    ``header_only``: read no tensor data (``quantize plan``): an INT4 source's ``weight_shape`` is
    then taken from its packed shape rather than read (convert reads and checks it)."""
    options.validate()
    folder = Path(source)
    recipe = load_recipe(options.recipe) if options.recipe else None
    asked = options  # what the user asked for (None: not given), before the recipe and defaults fill it
    options = options.resolve(recipe)  # never None from here on: plan.options is what the record and manifest hold
    has_tensors = folder.is_dir() and (
        any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").exists()
    )
    if has_tensors or not allow_config_only:
        index = CheckpointIndex.open(folder)
        config = index.config
    else:
        config = load_config(folder) if folder.is_dir() else _load_config_file(folder)
        index = None
    where = str(folder / "config.json") if folder.is_dir() else str(folder)
    # the same rule as ``quantize shard``: attention heads split evenly over the ranks; refused
    # before the plan is built (seconds at full size)
    heads = ModelConfig.from_dict(config, where).num_attention_heads
    if heads % tp:
        raise _tp_refused(tp, heads, Path(where))
    arch = archs.resolve(config, where)
    source_format, src_qc = detect_source_format(config, arch, where)
    if index is None:
        index = virtual_index(folder, config, arch, source_format, src_qc)
    block = tuple(src_qc.get("weight_block_size") or layout.DEFAULT_BLOCK)
    scheme4 = int4_scheme(src_qc) if source_format == "ct-int4" else None
    if scheme4 is not None:
        options = _int4_request(asked, options, recipe, scheme4, where)
    int4_mods = _int4_parts(index, folder, scheme4, src_qc, where, arch, header_only)

    jobs_by_file: dict[str, list[Job]] = defaultdict(list)
    dropped: list[str] = []
    consumed: set[str] = set()
    tensors = index.tensors
    for name, ref in tensors.items():
        base, _, param = name.rpartition(".")
        if base in int4_mods:
            if param == "weight_packed":  # its weight_scale / weight_shape belong to this job
                role, _ = arch.role_of(base + ".weight")
                quant = _decide_by_recipe(recipe, base) if recipe else profile_quantizes(options.profile, role)
                jobs_by_file[ref.file].append(_int4_job(base, int4_mods[base], role, quant, options, recipe, folder))
            continue
        if param in SCALE_SUFFIXES:
            weight = f"{base}.weight"
            if weight not in tensors:
                raise QuantizeError(
                    f"{folder / ref.file}: scale tensor {name} has no weight {weight}; the checkpoint is incomplete"
                )
            continue  # consumed by its weight's job (or dropped) below
        role, layer = arch.role_of(name)
        job = Job("copy", name, role, ref, outputs=[Entry(name, ref.dtype, ref.shape)])
        is_fp8 = ref.dtype in ("F8_E4M3",)
        if is_fp8:
            sname = f"{base}.weight_scale_inv" if source_format == "fp8-block" else f"{base}.weight_scale"
            if param != "weight" or sname not in tensors:
                raise QuantizeError(
                    f"{folder / ref.file}: FP8 tensor {name} has no {sname}; the checkpoint is incomplete or not "
                    f"{source_format} (re-download the shard that should hold it)"
                )
            job.scale = tensors[sname]
            job.block = block
            consumed.add(sname)
            why = layout.fp8_weight_error(ref.shape)
            if why:
                raise QuantizeError(f"{folder / ref.file}: tensor {name} {why}; the checkpoint is corrupt, re-export")
            job.scale_format = fp8_scale_format(ref, job.scale, block, folder)  # one decision, shared with the reader
            why = layout.fp8_scale_error(job.scale.dtype, job.scale_format)
            if why:
                raise QuantizeError(f"{folder / job.scale.file}: {sname} {why}; the checkpoint is corrupt, re-export")
        elif ref.dtype.startswith("F8"):
            raise QuantizeError(
                f"{folder / ref.file}: tensor {name} has dtype {ref.dtype}; only e4m3 FP8 weights are read"
            )
        is_weight2d = param == "weight" and len(ref.shape) == 2 and ROLES[role][0]
        if is_weight2d and ref.dtype not in layout.FLOAT_WEIGHT_DTYPES:
            raise QuantizeError(
                f"{folder / ref.file}: Linear weight {name} has dtype {ref.dtype}; a weight must be "
                f"{', '.join(layout.FLOAT_WEIGHT_DTYPES)}, re-export the checkpoint"
            )
        if is_weight2d:
            module = base
            quant = _decide_by_recipe(recipe, module) if recipe else profile_quantizes(options.profile, role)
            if sglang_native(options):
                _sglang_job(job, module, role, quant, is_fp8, block)
            elif quant and options.scheme == "fp8-block":
                job.kind = "fp8"
                sdt = "BF16" if is_fp8 or ref.dtype == "BF16" else ref.dtype  # the weight's dtype, as llm-compressor
                job.outputs = [Entry(name, "F8_E4M3", ref.shape),
                               Entry(f"{module}.weight_scale", sdt, layout.block_grid(ref.shape, layout.DEFAULT_BLOCK))]
            elif quant:
                out, k = ref.shape
                job.kind = "int4"
                sdt = "BF16" if is_fp8 or ref.dtype == "BF16" else ref.dtype
                job.outputs = [
                    Entry(f"{module}.weight_packed", "I32", layout.packed_shape((out, k))),
                    Entry(
                        f"{module}.weight_scale",
                        sdt,
                        layout.scale_shape((out, k), options.group_size)
                        if k % options.group_size == 0
                        else (out, k // options.group_size),
                    ),
                    Entry(f"{module}.weight_shape", "I64", (2,)),
                ]
            elif is_fp8 and options.keep_fp8:
                job.kind = "keep_fp8"
                job.outputs = [
                    Entry(name, ref.dtype, ref.shape),
                    Entry(f"{module}.weight_scale", job.scale.dtype, job.scale.shape),
                ]
            elif is_fp8:
                job.kind = "dequant"
                job.outputs = [Entry(name, "BF16", ref.shape)]
        elif is_fp8:
            job.kind = "dequant"
            job.outputs = [Entry(name, "BF16", ref.shape)]
        jobs_by_file[ref.file].append(job)
    for name in tensors:
        base, _, param = name.rpartition(".")
        if param in SCALE_SUFFIXES and name not in consumed and base not in int4_mods:
            if param in ("input_scale",):
                dropped.append(name)
                continue
            if param == "weight_scale" and source_format == "float":
                continue
            ref = tensors[name]
            raise QuantizeError(
                f"{folder / ref.file}: {name} is a scale for a weight that is not FP8 "
                f"({tensors[base + '.weight'].dtype}); the checkpoint mixes formats, re-export it"
            )
    dropped += sorted(consumed)

    meta = {"format": "pt"}
    shards = [ShardPlan(f, jobs_by_file[f], meta) for f in index.files if jobs_by_file.get(f)]
    view = config_view(arch, config, options, recipe, shards)
    plan = Plan(
        str(folder), arch, options, source_format, shards, dropped, view, config, index.total_bytes, tp, recipe=recipe,
        source_int4=scheme4,
    )
    validate_plan(plan, recipe, ct_check=ct_check)
    return plan


# -- SGLang's native w4afp8 (docs/engines.md#w4afp8, route A) ----------------------------------------
# every LinearBase is served through Fp8LinearMethod (block FP8, ``weight_scale_inv``; there is no ignore
# list, so a BF16 Linear would be cast into e4m3 and compute garbage: sglang/srt/layers/quantization/
# w4afp8.py L93-105); what is not a LinearBase there (embeddings, lm_head, the router, DSA weights_proj,
# MTP eh_proj / shared_head, Kimi K2.5's vision tower and projector, built without quant_config in
# sglang/srt/models/kimi_k25.py L680-700) stays BF16: exactly the roles a vendor FP8 release keeps high
# precision (``ROLES``' third field).
SGLANG_FP8_ROLES = frozenset(r for r, (linear, _, high) in ROLES.items() if linear and not high) - EXPERT_ROLES


def sglang_native(options) -> bool:
    """The output is SGLang's native w4afp8 layout (``--scheme w4afp8 --engine sglang``)."""
    return options.scheme == "w4afp8" and options.engine == "sglang"


def sglang_int4_outputs(module: str, shape: tuple[int, int]) -> list[Entry]:
    """A routed expert projection in SGLang's native layout (``formats/w4afp8.py``)."""
    o, k = shape
    return [Entry(f"{module}.weight", "I8", (o, k // 2)),
            Entry(f"{module}.weight_scale_inv", "F32", (o, k // W4AFP8_GROUP)),
            Entry(f"{module}.input_scale", "F32", (1,))]


def sglang_fp8_outputs(module: str, shape: tuple[int, int]) -> list[Entry]:
    """A Linear as SGLang's Fp8LinearMethod reads it: e4m3 ``weight``, fp32 ``weight_scale_inv`` per 128x128."""
    return [Entry(f"{module}.weight", "F8_E4M3", tuple(shape)),
            Entry(f"{module}.weight_scale_inv", "F32", layout.block_grid(tuple(shape), layout.DEFAULT_BLOCK))]


def _sglang_job(job: Job, module: str, role: str, quant: bool, is_fp8: bool, block: tuple) -> None:
    """A float or FP8 Linear weight's job for SGLang's native w4afp8: a routed expert INT4 (with its
    calibrated input scale), another SGLang Linear block FP8 (a 128x128 block-FP8 source kept bit for
    bit under SGLang's scale name), the rest BF16 (an FP8 one dequantized)."""
    shape = tuple(job.src.shape)
    if quant and role in EXPERT_ROLES:
        job.kind, job.outputs = "int4", sglang_int4_outputs(module, shape)
    elif role in SGLANG_FP8_ROLES:
        if is_fp8 and job.scale_format == "block" and tuple(block) == layout.DEFAULT_BLOCK:
            job.kind = "keep_fp8"
            job.outputs = [Entry(job.name, job.src.dtype, shape),
                           Entry(f"{module}.weight_scale_inv", job.scale.dtype, tuple(job.scale.shape))]
        else:
            job.kind, job.outputs = "fp8", sglang_fp8_outputs(module, shape)
    elif is_fp8:
        job.kind, job.outputs = "dequant", [Entry(job.name, "BF16", shape)]


INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")
INT4_REFUSED = {"weight_zero_point": "asymmetric INT4 (zero points) is not read; the engines' W4A16 MoE kernels take "
                                     "symmetric codes only",
                "weight_g_idx": "act-order INT4 (a g_idx permutation) is not read; only static group order is"}


def _int4_request(asked, options, recipe: Recipe | None, src: Int4Scheme, where: str):
    """The options an INT4 source runs with: its own group size unless another is asked for. A
    request that would change its INT4 tensors (another group size, grid or method) needs
    ``--requantize``; without it they pass through bit for bit."""
    from dataclasses import replace

    if options.scheme == "fp8-block":  # another format asked for by name: the INT4 codes are dequantized
        return options
    g = asked.group_size if asked.group_size is not None else (recipe.group_size if recipe else None)
    if options.scheme == "w4afp8" and src.group_size != options.group_size:  # the W4A8 kernels' one group size
        if not options.requantize:
            raise QuantizeError(
                f"{where}: the source's tensors are INT4 by group {src.group_size} ({src.describe()}); W4AFP8 needs "
                f"group {options.group_size} (the engines' CUTLASS W4A8 kernels take no other), so its codes cannot "
                "pass through: add --requantize (dequantized exactly, then quantized again by group "
                f"{options.group_size}; scripts/bench_w4afp8.py measures what re-grouping costs)"
            )
        return options
    obs = asked.observer or (recipe.observer if recipe else None)
    changes = []
    if g is not None and g != src.group_size:
        changes.append(f"group size {g}")
    if obs is not None and obs != src.observer:
        changes.append(f"observer {obs}")
    if options.method_name != "rtn":
        changes.append(f"method {options.method_name}")
    if changes and not options.requantize:
        raise QuantizeError(
            f"{where}: the source's tensors are already INT4 ({src.describe()}); {' and '.join(changes)} would "
            "re-quantize them: add --requantize (dequantized exactly, then quantized again; the source's codes are "
            "not kept) or drop the request to pass them through bit for bit"
        )
    return replace(options, group_size=g if g is not None else src.group_size)


def _int4_parts(index: CheckpointIndex, folder: Path, scheme: Int4Scheme | None, qc: dict, where: str,
                arch: Architecture, header_only: bool = False) -> dict[str, tuple]:
    """module -> (weight_packed, weight_scale, weight_shape, (out, in)) of an INT4 source, each
    checked against the others and the config; one line naming the tensor otherwise."""
    tensors = index.tensors
    mods = sorted({n.rsplit(".", 1)[0] for n in tensors
                   if n.rsplit(".", 1)[-1] in ("weight_packed", "weight_shape", *INT4_REFUSED)})
    if scheme is None:
        if mods:
            ref = next(tensors[f"{mods[0]}.{p}"] for p in (*INT4_PARTS, *INT4_REFUSED) if f"{mods[0]}.{p}" in tensors)
            raise QuantizeError(f"{folder / ref.file}: {mods[0]} is stored INT4 (pack-quantized), but {where} "
                                "declares no compressed-tensors INT4 quantization_config; the config and the tensors "
                                "disagree")
        return {}
    out: dict[str, tuple] = {}
    fds: dict = {}  # one descriptor per shard for the weight_shape reads (Kimi K2.6: 70k of them)
    try:
        for m in mods:
            _int4_module(m, tensors, folder, index, scheme, qc, where, arch, None if header_only else fds, out)
    finally:
        for fd in fds.values():
            os.close(fd)
    for gname, targets in _int4_targets(qc).items():
        if not any(t == "Linear" or _ct_name_match(m, t) for t in targets for m in out):
            raise QuantizeError(f"{where}: quantization_config.config_groups.{gname} targets {targets}, which match no "
                                "INT4 tensor in the checkpoint; the config and the tensors disagree")
    return out


def _int4_module(m: str, tensors: dict, folder: Path, index: CheckpointIndex, scheme: Int4Scheme, qc: dict,
                 where: str, arch: Architecture, fds: dict, out: dict) -> None:
    """One INT4 module's parts, checked (``_int4_parts``), into ``out``; ``fds`` None: its
    weight_shape not read (header only)."""
    some = next(tensors[f"{m}.{p}"] for p in (*INT4_PARTS, *INT4_REFUSED) if f"{m}.{p}" in tensors)
    at = folder / some.file
    for part, why in INT4_REFUSED.items():
        if f"{m}.{part}" in tensors:
            raise QuantizeError(f"{at}: {m}.{part}: {why}")
    for part in INT4_PARTS:
        if f"{m}.{part}" not in tensors:
            raise QuantizeError(f"{at}: {m} has no {part} (an INT4 tensor needs weight_packed, weight_scale and "
                                "weight_shape); the checkpoint is incomplete, re-download the shard that holds it")
    if f"{m}.weight" in tensors:
        raise QuantizeError(f"{at}: {m} is stored both as weight and as weight_packed; the checkpoint mixes "
                            "formats, re-export it")
    packed, scale, shp = (tensors[f"{m}.{p}"] for p in INT4_PARTS)
    if packed.dtype != "I32" or len(packed.shape) != 2:
        raise QuantizeError(f"{folder / packed.file}: {packed.name} is {packed.dtype} {list(packed.shape)}; "
                            "packed INT4 codes are a 2-D int32 tensor, the checkpoint is corrupt")
    if scale.dtype not in ("BF16", "F16", "F32") or len(scale.shape) != 2:
        raise QuantizeError(f"{folder / scale.file}: {scale.name} is {scale.dtype} {list(scale.shape)}; an INT4 "
                            "group scale is a 2-D BF16/F16/F32 tensor, the checkpoint is corrupt")
    if shp.dtype not in ("I64", "I32") or tuple(shp.shape) != (2,):
        raise QuantizeError(f"{folder / shp.file}: {shp.name} is {shp.dtype} {list(shp.shape)}; weight_shape is "
                            "[out, in] as int64, the checkpoint is corrupt")
    if shp.file == "(config)" or fds is None:  # config.json alone (consistent by construction), or headers only
        o, k = packed.shape[0], packed.shape[1] * 8
    else:
        o, k = (int(v) for v in read_tensor(index.folder, shp, fds).tolist())
    if o != packed.shape[0] or -(-k // 8) != packed.shape[1] or k < 1:
        raise QuantizeError(f"{folder / shp.file}: {shp.name} says [{o}, {k}], but {packed.name} is "
                            f"{list(packed.shape)} (needs [{o}, {-(-k // 8)}]); the checkpoint is corrupt")
    g = scheme.group_size
    if k % g:
        raise QuantizeError(f"{folder / shp.file}: {m} has K={k}, not a multiple of the group size {g} in "
                            f"{where}; the config and the tensors disagree")
    if tuple(scale.shape) != (o, k // g):
        raise QuantizeError(f"{folder / scale.file}: {scale.name} is {list(scale.shape)}, but a [{o}, {k}] weight "
                            f"in groups of {g} ({where}) needs [{o}, {k // g}]; the config and the tensors disagree")
    if not source_int4_module(_names(arch, m, index.config), qc):
        raise QuantizeError(f"{folder / packed.file}: {m} is stored INT4, but the quantization_config in {where} "
                            "does not target it (or ignores it); the engines would build it high precision and "
                            "fail to load it, fix the config")
    out[m] = (packed, scale, shp, (o, k))


def _keeps_int4_fix(role: str, options, recipe: Recipe | None) -> str:
    """Why an INT4 source tensor would be widened, and the fix the command in use has."""
    if recipe is not None:
        return (f"the recipe {recipe.path} keeps it high precision; INT4 weights are not widened back, target it "
                "in the recipe (and drop it from ignore)")
    other = [p for p in PROFILES if p != options.profile and profile_quantizes(p, role)]
    fix = (f"use --profile {other[0]}" if other else
           f"no profile makes {role} tensors INT4: pass a --recipe that targets it and does not ignore it")
    return f"--profile {options.profile} keeps it high precision; INT4 weights are not widened back, {fix}"


def _int4_job(module: str, parts: tuple, role: str, quant: bool, options, recipe: Recipe | None,
              folder: Path) -> Job:
    """An INT4 source tensor's job: passed through bit for bit (``pass_int4``), or, with
    ``--requantize``, dequantized exactly and quantized again (``int4``)."""
    packed, scale, shp, (o, k) = parts
    if not quant:
        raise QuantizeError(f"{folder / packed.file}: {module} is INT4 in the source, but "
                            f"{_keeps_int4_fix(role, options, recipe)}")
    job = Job("pass_int4", module + ".weight", role, packed, scale=scale, scale_format="int4", extra=[shp],
              shape=(o, k))
    if sglang_native(options):
        if role not in EXPERT_ROLES:  # SGLang's w4afp8 serves every other Linear as block FP8
            job.kind, job.outputs = "fp8", sglang_fp8_outputs(module, (o, k))
        else:  # g128 codes kept bit for bit (transcoded); another group re-quantized (--requantize)
            job.kind = "int4" if options.requantize else "transcode"
            job.outputs = sglang_int4_outputs(module, (o, k))
    elif options.scheme == "fp8-block":  # dequantized as compressed-tensors does (BF16), then FP8 block
        job.kind = "fp8"
        job.outputs = [Entry(module + ".weight", "F8_E4M3", (o, k)),
                       Entry(module + ".weight_scale", "BF16", layout.block_grid((o, k), layout.DEFAULT_BLOCK))]
    elif options.requantize:
        g = options.group_size
        job.kind = "int4"
        job.outputs = [Entry(f"{module}.weight_packed", "I32", layout.packed_shape((o, k))),
                       Entry(f"{module}.weight_scale", scale.dtype,
                             layout.scale_shape((o, k), g) if k % g == 0 else (o, k // g)),
                       Entry(f"{module}.weight_shape", "I64", (2,))]
    else:
        job.outputs = [Entry(r.name, r.dtype, r.shape) for r in (packed, scale, shp)]
    return job


def _load_config_file(path: Path) -> dict:
    from .parse import load_json

    # the same typed view and field checks as a checkpoint's config.json
    return ModelConfig.from_dict(load_json(path, "config.json", kind="config"), path).raw


# ---------------------------------------------------------------------------------------------
def ignore_list(
    arch: Architecture,
    config: dict,
    options: ConvertOptions,
    roles_present: set[str],
    fp8_roles: frozenset[str] = frozenset(),
) -> list[str]:
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


def config_view(
    arch: Architecture, config: dict, options: ConvertOptions, recipe: Recipe | None, shards: list[ShardPlan]
) -> dict:
    """What the engines match against their module names: the ignore list and each config group's
    targets (config_group_0: INT4; config_group_1: the FP8 weights --keep-fp8 keeps)."""
    if sglang_native(options):  # no compressed-tensors groups: SGLang's w4afp8 decides by module class
        return {"quant_method": "w4afp8", "ignore": [], "config_groups": {}}
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


def quantization_config(
    arch: Architecture, config: dict, options: ConvertOptions, recipe: Recipe | None, shards: list[ShardPlan]
) -> dict:
    if sglang_native(options):
        return sglang_quantization_config()
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    from .formats import int4

    view = config_view(arch, config, options, recipe, shards)
    if options.scheme == "fp8-block":  # llm-compressor's FP8_BLOCK preset, as model_free_ptq writes it
        from compressed_tensors.quantization import preset_name_to_scheme

        sc = preset_name_to_scheme("FP8_BLOCK", view["config_groups"]["config_group_0"]["targets"])
        sc.format = "float-quantized"
        qc = QuantizationConfig(config_groups={"config_group_0": sc}, format="float-quantized", ignore=view["ignore"],
                                quantization_status="compressed", kv_cache_scheme=None, global_compression_ratio=None)
        return {"version": CT_VERSION, "quant_method": "compressed-tensors", "transform_config": {},
                **qc.model_dump(mode="json")}
    # compressed-tensors' own models, dumped as its 0.19 writes them (llmcompressor's update_config)
    groups = {
        "config_group_0": QuantizationScheme(
            targets=view["config_groups"]["config_group_0"]["targets"],
            format="pack-quantized",  # also for W4AFP8, where compressed-tensors would infer int-quantized
            weights=QuantizationArgs.model_validate(int4.weights_args(options.group_size)),
            input_activations=QuantizationArgs.model_validate(W4AFP8_INPUT) if options.scheme == "w4afp8" else None,
        )
    }
    kept = "config_group_1" in view["config_groups"]
    if kept:  # the vendor's 128x128 block FP8 weights, dynamic per-128-group FP8 activations
        groups["config_group_1"] = QuantizationScheme(
            targets=view["config_groups"]["config_group_1"]["targets"],
            format="float-quantized",
            weights=QuantizationArgs(
                num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128], dynamic=False
            ),
            input_activations=QuantizationArgs(
                num_bits=8, type="float", symmetric=True, strategy="group", group_size=128, dynamic=True
            ),
        )
    qc = QuantizationConfig(
        config_groups=groups,
        format="mixed-precision" if kept else "pack-quantized",
        ignore=view["ignore"],
        quantization_status="compressed",
        kv_cache_scheme=None,
        global_compression_ratio=None,
    )
    return {
        "version": CT_VERSION,
        "quant_method": "compressed-tensors",
        "transform_config": {},
        **qc.model_dump(mode="json"),
    }


def sglang_quantization_config() -> dict:
    """SGLang's native w4afp8 ``quantization_config``: SGLang 0.5.23 reads only ``quant_method``
    (sglang/srt/model_loader/weight_utils.py L281-312; ``W4AFp8Config.from_config``, w4afp8.py L78-91,
    forces 128x128 FP8 blocks, group 128 and no ignored layers). The other keys say what the
    checkpoint holds, for a reader; an engine ignores them."""
    return {"quant_method": "w4afp8", "activation_scheme": "static", "weight_block_size": [128, 128],
            "group_size": W4AFP8_GROUP, "moe_activation_scheme": "static", "linear_activation_scheme": "dynamic"}


# --scheme w4afp8 (vLLM 0.33 compressed-tensors W4A8-FP8, docs/engines.md#w4afp8): the INT4 group's input
# activations are FP8 e4m3, dynamic, one scale per token (`_is_fp8_w4a8`, compressed_tensors.py), as the
# compressed-tensors W4AFP8 preset writes them. Dynamic: no activation scale is written.
W4AFP8_INPUT = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
# the W4A8 MoE kernel's shape rule (compressed_tensors_moe_w4a8_fp8.py): hidden and intermediate per rank % 256
W4AFP8_MOE_ALIGN = 256
SGLANG_W4A8_ALIGN = 128  # SGLang's native W4A8 MoE: K % 128 per rank in both GEMMs


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


class _SglangMatcher:
    """``_sglang_match`` against a list of patterns at once, compiled once: what ``validate_plan``
    asks of every engine module name (60,000 of them at GLM-5's size). The re: patterns are one
    alternation, which ``re.match`` tries at the start as it tries each of them (patterns with a
    back-reference, whose group numbers an alternation would shift, are kept apart)."""

    def __init__(self, patterns):
        import re

        regs = [p[3:] for p in patterns if p.startswith("re:")]
        alone = [r for r in regs if re.search(r"\\[1-9]|\(\?P=", r)]
        joined = [r for r in regs if r not in alone]
        one = [re.compile("|".join(f"(?:{r})" for r in joined))] if joined else []
        self.regs = [re.compile(r) for r in alone] + one
        self.subs = [p.lower() for p in patterns if not p.startswith("re:")]

    def __call__(self, name: str) -> bool:
        if any(r.match(name) for r in self.regs):
            return True
        low = name.lower()
        return any(s in low for s in self.subs)


def _ct_match(name: str, pat: str) -> bool:
    from compressed_tensors.utils.match import match_name

    return match_name(name, pat)


def _scheme_for(name: str, qc: dict, match) -> str:
    """The config group an engine applies to a Linear called ``name`` ("bf16" if ignored): ignore
    first, then name/regex targets, then the class target "Linear" (compressed-tensors and SGLang
    both rank a name match above a class match). ``_SglangSchemes(qc)`` gives the same answer for
    ``_sglang_match`` with the patterns compiled once."""
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


class _SglangSchemes:
    """``_scheme_for(name, qc, _sglang_match)`` with every pattern list of ``qc`` compiled once."""

    def __init__(self, qc: dict):
        self.ignore = _SglangMatcher(qc["ignore"])
        groups = qc["config_groups"]
        self.named = [(g, _SglangMatcher([t for t in grp["targets"] if t != "Linear"])) for g, grp in groups.items()]
        self.linear = next((g for g, grp in groups.items() if "Linear" in grp["targets"]), "bf16")

    def __call__(self, name: str) -> str:
        if self.ignore(name):
            return "bf16"
        return next((g for g, m in self.named if m(name)), self.linear)


EXPECT = {"int4": "config_group_0", "pass_int4": "config_group_0", "fp8": "config_group_0",
          "keep_fp8": "config_group_1"}
INT4_KINDS = ("int4", "pass_int4", "transcode")  # transcode: an INT4 source's codes into SGLang's native bytes
QUANT_KINDS = (*INT4_KINDS, "fp8")  # what config_group_0 holds


def is_linear_weight(j: Job) -> bool:
    """The job is a Linear layer's 2-D weight (the engines build a quantizable layer for it)."""
    return j.name.endswith(".weight") and len(j.wshape) == 2 and ROLES[j.role][0]


def check_with_compressed_tensors(plan: Plan) -> None:
    """compressed-tensors' own matcher on checkpoint names reproduces every decision of the plan
    (an internal consistency check: the ignore list is ours, the matcher theirs). Imports
    compressed-tensors (seconds), so convert runs it beside the first tensors."""
    if plan.recipe is not None or sglang_native(plan.options):  # no compressed-tensors config to match
        return
    for j in plan.jobs:
        if is_linear_weight(j):
            want = EXPECT.get(j.kind, "bf16")
            got = _scheme_for(j.module, plan.config_view, _ct_match)
            if got != want:
                raise QuantizeError(
                    f"internal: quantization_config puts {j.module} in {got}, the plan in {want}; please report this"
                )


def w4afp8_violation(hidden: int, inter: int, tp: int, align: int = W4AFP8_MOE_ALIGN) -> str | None:
    """The W4A8 MoE kernels' shape rule at ``tp`` ranks: hidden and intermediate per rank multiples of
    ``align`` (vLLM 0.33 ``CompressedTensorsW4A8Fp8MoEMethod``: 256; SGLang's is 128,
    ``sglang_w4a8_violation``), or None."""
    if hidden % align:
        return f"hidden_size {hidden} is not a multiple of {align}"
    if inter % tp or (inter // tp) % align:
        return f"moe_intermediate_size {inter} / TP {tp} is not a multiple of {align}"
    return None


def sglang_w4a8_violation(hidden: int, inter: int, tp: int) -> str | None:
    """SGLang 0.5.23's native W4A8 MoE at ``tp`` ranks: K % 128 in both GEMMs per rank, i.e. hidden and
    intermediate / tp (``W4AFp8MoEMethod.create_weights``, w4afp8.py L178, L190), or None."""
    return w4afp8_violation(hidden, inter, tp, SGLANG_W4A8_ALIGN)


def w4afp8_fits(hidden: int, inter: int, tps: tuple[int, ...]) -> list[int]:
    """The TPs of ``tps`` at which the W4A8 MoE kernel's shape rule holds (what a refusal offers)."""
    return [t for t in tps if w4afp8_violation(hidden, inter, t) is None]


def w4afp8_shape_rule(plan: Plan) -> None:
    """Every INT4 routed expert fits the W4A8 MoE kernel at the plan's TP, or one line."""
    experts = [j for j in plan.jobs if j.kind in INT4_KINDS and ".experts." in j.name]
    if not experts:
        raise QuantizeError(f"{plan.source}: no routed experts to make INT4; --scheme w4afp8 is for mixture-of-experts "
                            "models (use --scheme w4a16)")
    hidden = next(j.wshape[1] for j in experts if ".down_proj." not in j.name)
    inter = next(j.wshape[1] for j in experts if ".down_proj." in j.name)
    why = w4afp8_violation(hidden, inter, plan.tp)
    if why:
        ok = w4afp8_fits(hidden, inter, (1, 2, 4, 8))
        fix = f"use --tp {ok[-1]}" if ok else "this model's experts cannot run through the W4A8 MoE kernels"
        raise QuantizeError(f"{plan.source}: --scheme w4afp8 at TP {plan.tp}: {why} (the W4A8 MoE kernel's rule, "
                            f"docs/engines.md#w4afp8); {fix}")


def refuse_copy(plan: Plan) -> None:
    """A conversion that would quantize nothing (a dense model under --profile experts, a recipe that
    ignores every Linear) is refused in one line: its output would be the source copied under a
    quantization_config, which check then refuses as no quantize output. ``plan`` still sizes it."""
    if any(j.kind in QUANT_KINDS for j in plan.jobs):
        return
    if plan.recipe is not None:
        by, fix = "the recipe's targets and ignore list leave", "target some Linear weights in the recipe"
    else:
        by = f"--profile {plan.options.profile} selects"
        fix = ("pass --profile all-linear (a dense model has no routed experts)" if plan.options.profile != "all-linear"
               else "this model has no Linear weight to quantize")
    raise QuantizeError(f"{plan.source}: {by} no weight to quantize, so the output would be a copy of the source; "
                        f"{fix}")


def validate_plan(plan: Plan, recipe: Recipe | None, ct_check: bool = True) -> None:
    """Everything that can fail, before any byte is written: group divisibility, uniform schemes
    across engine-fused modules and experts, and an ignore list that holds in the engines."""
    arch, cfg, g = plan.arch, plan.config, plan.options.group_size
    decision: dict[str, bool] = {}
    for j in plan.jobs:
        if is_linear_weight(j):
            decision[j.module] = j.kind in QUANT_KINDS
        if j.kind == "int4" and j.wshape[1] % g:
            k = j.wshape[1]
            fits = [x for x in layout.SUPPORTED_GROUP_SIZES if k % x == 0]
            fix = (
                f"use --group-size {fits[-1]}"
                if fits
                else "keep it high precision (--profile experts or a recipe ignore)"
            )
            raise QuantizeError(f"{j.src.file}: tensor {j.name} has K={k}, not a multiple of group size {g}; {fix}")
    if plan.options.scheme == "w4afp8":
        w4afp8_shape_rule(plan)
    # fused sets and experts share one scheme
    by_layer: dict[str, set[bool]] = defaultdict(set)
    for module, q in decision.items():
        for member in arch.fused_members(module):
            if member in decision and decision[member] != q:
                raise QuantizeError(
                    f"{module} is {'INT4' if q else 'high precision'} but {member}, which the engines fuse with it, "
                    "is not; quantize both or neither (adjust the recipe's ignore list)"
                )
        role, layer = arch.role_of(module + ".weight")
        if role in archs.base.EXPERT_ROLES:
            by_layer[module.split(".experts.")[0]].add(q)
    for layer, qs in by_layer.items():
        if len(qs) > 1:
            raise QuantizeError(
                f"{layer}: some routed experts are INT4 and others are not; fused MoE kernels need one scheme for all "
                "experts of a layer (fix the recipe's ignore list)"
            )
    if sglang_native(plan.options):  # SGLang's w4afp8 decides by module class, not by a config to match
        _sglang_native_rule(plan)
        return
    # the written config must reproduce the plan's decisions, for compressed-tensors (checkpoint
    # names, exact/regex) and for SGLang (its module names, fused ones included)
    qc = plan.config_view
    sglang = _SglangSchemes(qc)
    if ct_check:
        check_with_compressed_tensors(plan)
    for j in plan.jobs:
        if j.module not in decision:
            continue
        want = EXPECT.get(j.kind, "bf16")
        for ename in arch.engine_module_names(j.module, cfg):
            got = sglang(ename)
            if got != want:
                raise QuantizeError(
                    f"quantization_config puts engine module {ename} (checkpoint {j.module}) in {got}, but the "
                    f"checkpoint holds it as {want}: SGLang would build the wrong layer and fail to load; fix the "
                    f"ignore list with re:.* patterns that {'match' if want == 'bf16' else 'exclude'} it"
                )


def _sglang_native_rule(plan: Plan) -> None:
    """SGLang's native w4afp8: every Linear it builds through Fp8LinearMethod is block FP8 in the
    output and every routed expert INT4 (a BF16 Linear would be cast into e4m3 with no error)."""
    for j in plan.jobs:
        if not is_linear_weight(j):
            continue
        want = "int4" if j.role in EXPERT_ROLES else "fp8" if j.role in SGLANG_FP8_ROLES else "bf16"
        got = ("int4" if j.kind in INT4_KINDS else "fp8" if j.kind in ("fp8", "keep_fp8")
               else "bf16")
        if got != want:
            raise QuantizeError(f"{plan.source}: {j.name} would be written {got}, but SGLang's w4afp8 serves it as "
                                f"{want}; use --engine vllm")


def _tp_refused(tp: int, heads: int, where: Path) -> QuantizeError:
    fits = [t for t in range(1, heads + 1) if heads % t == 0 and t <= 64]
    return QuantizeError(
        f"--tp {tp}: {heads} attention heads in {where} do not split over TP {tp}; use a TP that divides {heads} "
        f"({', '.join(map(str, fits))})"
    )


# ---------------------------------------------------------------------------------------------
@takes(PlanOptions)
def plan(source, tp, group_size, profile, keep_fp8, recipe, scheme, engine, requantize, gpu_mem_gib, mem_fraction,
         reserve_gib) -> Plan:
    """``quantize plan``: the conversion plan from headers (or config.json alone), no tensor data,
    with KV-cache capacity per GPU (``Plan.kv``) for the given GPU memory inputs. ``group_size`` /
    ``profile`` None: not given (the recipe's, else 32 / experts)."""
    from . import kvcache

    p = build_plan(
        Path(source),
        ConvertOptions(group_size=group_size, profile=profile, keep_fp8=keep_fp8, recipe=recipe, scheme=scheme,
                       engine=engine, requantize=requantize),
        tp=tp,
        allow_config_only=True,
        ct_check=False,
        header_only=True,
    )
    p.kv = kvcache.capacity(p.arch, p.config, p.per_rank_bytes(tp)[1], tp, gpu_mem_gib, mem_fraction, reserve_gib)
    return p
