"""``quantize run RECIPE.yaml``: the whole job from one file, resumable stage by stage.

The recipe is an llm-compressor recipe (``quant_stage`` / ``QuantizationModifier``, read by
``quantize.recipe.load_recipe``, which refuses an unknown key at any depth) plus a ``pipeline:`` section::

    pipeline:
      source: /models/GLM-5.2-FP8        # or tiny:glm_moe_dsa (a tiny checkpoint made on the fly)
      out: runs/glm-5.2                  # the run's own folder (relative paths: from the current directory)
      stages: [convert, calibrate-kv, shard, check, eval, card, push]   # optional subset
      data: /data/gsm8k/train.jsonl              # calibration text (calibrate-kv)
      data_dir: /data                            # local eval data (docs/evaluation.md#local-data)
      tasks: arc_easy,gsm8k
      limit: 200
      max_drop: 1.0
      repo: my-org/GLM-5.2-W4A16
      base_model: zai-org/GLM-5.2-FP8            # the Hub repo the source was downloaded from (card's base_model)
      convert: {group_size, profile, observer, keep_fp8, workers, device,
                method, samples, seq_len, iters, lr, batch_size, damp, block, actorder, all_experts,
                min_expert_tokens, memory_budget_gib}   # method gptq/autoround calibrates on `data`
      kv: {target: sglang, fold: false, samples: 512, seq_len: 2048}
      shard: {tp: 8}
      eval: {device: cpu, max_gen_toks: null, chat: false, thinking: null, kld: false, if_no_data: fail}
      push: {dry_run: true, private: false}
      pd: {prefill_tp: 8, decode_tp: 8, transfer_backend: mooncake, ...}   # the prefill/decode pair

Every stage calls the library function of its command (``convert``, ``calibrate_kv``, ``shard``,
``check``, ``evaluate``, ``card``, ``push``, ``pd_fidelity``); none is reimplemented here. The run's
folder is opened through ``Output.open(out, "run", ...)``; its job record holds, per stage, the
options it ran with, the identities of its inputs (a converted model's identity is the SHA-256 of
its weight files as its manifest records them; a source's, its safetensors headers, sizes and Hub
revision), a hash of both, the identities of what it wrote and the SHA-256 of every file it wrote.
A stage reruns when that hash changes or any file it wrote is missing, added or has another SHA-256
(a folder removed, a byte flipped, a config edited), and then every stage that consumes what it
wrote reruns too; nothing else does. A crash leaves the stage ``running``: the rerun continues it (convert with
``--resume``). A failed check or eval gate is recorded and stops the run (exit 1) before push.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from . import options as O
from .checkpoint.manifest import build_key
from .checkpoint.output import (
    Output,
    RECORD_DIR,
    confined,
    read_record,
    refuse_overlap,
    sha256_file,
    sha256_files,
    signed_json,
    write_text_atomic,
)
from .errors import CheckFailed, QuantizeError
from .events import Emit, null_emit
from .parse import load_json, load_yaml

# -- the recipe's pipeline section --------------------------------------------------------------

STAGES = ("make-source", "convert", "convert-prefill", "calibrate-kv", "shard", "check", "eval", "pd-eval", "card",
          "prefill", "push")
DEFAULT_STAGES = ("convert", "calibrate-kv", "shard", "check", "eval", "card", "push")
TINY_PREFIX = "tiny:"
# the eval stage's engine launch and its requests in flight
SERVE_KEYS = ("serve", "tp", "kv_cache_dtype", "baseline_kv_cache_dtype", "serve_args", "serve_timeout_s",
              "concurrency")

# pipeline.<section>: the options of the command the stage calls, as that command declares them
# (quantize/options.py); a recipe default differs from the command line's only where named here
SECTIONS = {
    "convert": O.recipe_section(O.ConvertOptions),
    "kv": O.recipe_section(O.CalibrateKVOptions),
    "shard": O.recipe_section(O.ShardOptions),
    # serve / tp / kv_cache_dtype (baseline_kv_cache_dtype: the source's own) / serve_args / serve_timeout_s: the
    # stage launches that engine on the source and on the model in turn (docs/served-eval.md), as `quantize eval
    # --serve` does
    "eval": O.recipe_section((O.EvalOptions, ("max_gen_toks", "device", "chat", "thinking", "max_kld",
                                              "max_flip_rate", *SERVE_KEYS)),
                             O.EvalStageOptions),
    "push": O.recipe_section(O.PushOptions, defaults={"dry_run": True}),
    "pd": O.recipe_section(O.PDOptions, O.PrefillOptions),
    # the prefill pool's own weights (the convert-prefill stage): FP8 block from the source, e.g. Kimi
    # K2.6's INT4 release, as llm-compressor's examples/model_free_ptq/kimi_k26_fp8_block.py makes it
    "prefill_model": O.recipe_section((O.ConvertOptions, ("scheme", "profile")),
                                      defaults={"scheme": "fp8-block", "profile": "all-linear"}),
}
TOP = O.recipe_section(
    O.PipelineOptions, (O.EvalOptions, ("tasks", "limit", "max_drop", "data_dir")), defaults={"tasks": "arc_easy"}
)


def default_recipe() -> Path:
    """The embedded default recipe shipped in the package: a tiny GLM 5.2-architecture FP8
    checkpoint made on the fly, converted, checked, evaluated briefly, carded, pushed in dry-run."""
    return Path(str(resources.files("quantize.recipes_default") / "tiny-glm.yaml"))


def _parse(path, doc) -> dict:
    """The pipeline section, each key checked where its command declares it."""
    if not isinstance(doc, dict):
        raise QuantizeError(f"{path}: pipeline must be a mapping, not {type(doc).__name__}; fix the recipe")
    known = list(TOP.model_fields) + list(SECTIONS)
    for k in doc:
        if k not in known:
            raise O.unknown_key(path, "pipeline.", k, known)
    opts = O.parse_section(path, "pipeline.", {k: v for k, v in doc.items() if k not in SECTIONS}, TOP)
    for name, section in SECTIONS.items():
        sub = doc.get(name)
        for k in sub if isinstance(sub, dict) else ():
            if k not in section.model_fields and k in TOP.model_fields:  # e.g. base_model: one for the whole run
                raise QuantizeError(
                    f"{path}: pipeline.{name}.{k}: not a key of the {name} section; the run sets it once for every "
                    f"stage: move it to pipeline.{k}"
                )
        opts[name] = O.parse_section(path, f"pipeline.{name}.", sub, section)
    return opts


@dataclass
class Pipeline:
    """The parsed ``pipeline:`` section, with paths resolved."""

    recipe: Path
    source: str  # a folder, or tiny:ARCH
    out: Path
    stages: tuple[str, ...]
    opts: dict
    overrides: dict = field(default_factory=dict)  # the command line's values over the recipe's

    @property
    def tiny(self) -> str | None:
        return self.source[len(TINY_PREFIX) :] if self.source.startswith(TINY_PREFIX) else None

    @property
    def source_path(self) -> Path:
        return self.out / "source" if self.tiny else Path(self.source)


def _override(path: Path, pl: dict, source, data, data_dir, sets) -> dict:
    """The command line's values over the recipe's (``quantize run --source/--data/--data-dir/--set``),
    written into the pipeline section before it is checked, so they are checked, recorded and
    fingerprinted as recipe values are. -> what was overridden."""
    import yaml

    done: dict = {}
    for key, value in (("source", source), ("data", data), ("data_dir", data_dir)):
        if value is not None:
            pl[key] = done[key] = str(value)
    for item in sets or ():
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts) or len(parts) > 2:
            raise QuantizeError(f"--set {item!r}: write KEY=VALUE or SECTION.KEY=VALUE (e.g. --set limit=200, --set "
                                "convert.group_size=64)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise QuantizeError(f"--set {item!r}: the value is not YAML ({str(e).splitlines()[0]})") from None
        target = pl
        if len(parts) == 2:
            if parts[0] not in SECTIONS:
                raise O.unknown_key(path, "--set ", parts[0], list(SECTIONS), "section")
            target = pl.get(parts[0]) if isinstance(pl.get(parts[0]), dict) else {}
            pl[parts[0]] = target
        target[parts[-1]] = value
        done[key.strip()] = value
    return done


def _from_command_line(e: QuantizeError, overrides: dict) -> QuantizeError:
    """A refused value that came from the command line names the option it came from, not the recipe."""
    msg = str(e)
    for key in overrides:
        if f"pipeline.{key} " in msg or f"pipeline.{key}:" in msg:
            flag = f"--{key.replace('_', '-')}" if key in ("source", "data", "data_dir") else f"--set {key}=..."
            return QuantizeError(msg.replace("; fix the recipe", f"; fix {flag} on the command line"))
    return e


def load_pipeline(recipe: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
                  source: str | None = None, data: str | None = None, data_dir: str | None = None,
                  sets: list[str] | None = None) -> Pipeline:
    """Read and validate RECIPE's ``pipeline:`` section (and its llm-compressor part) before any
    work, with the command line's overrides (``_override``); every mistake is one line naming the
    key and the fix."""
    from .recipe import load_recipe

    path = Path(recipe) if recipe is not None else default_recipe()
    doc = load_yaml(path, "recipe")
    if not isinstance(doc, dict) or "pipeline" not in doc:
        typo = [k for k in doc if difflib.get_close_matches(str(k), ["pipeline"], n=1)] if isinstance(doc, dict) else []
        raise QuantizeError(
            f"{path}: no `pipeline:` section{f' (did you mean pipeline for {typo[0]!r}?)' if typo else ''}; add one "
            "with at least source and out (see quantize/recipes_default/tiny-glm.yaml)"
        )
    if isinstance(doc["pipeline"], dict):
        overrides = _override(path, doc["pipeline"], source, data, data_dir, sets)
    else:
        overrides = {}
    modifier = load_recipe(path)  # the llm-compressor part, validated now (it ignores the pipeline section)
    try:
        opts = _parse(path, doc["pipeline"])
    except QuantizeError as e:
        raise _from_command_line(e, overrides) from None
    try:  # the convert section against the recipe's method, as convert will (e.g. iters 0 beside RTN)
        O.ConvertOptions(**opts["convert"]).resolve(modifier)
    except QuantizeError as e:
        raise QuantizeError(f"{path}: pipeline.convert: {e}; fix the recipe") from None
    if not opts["source"]:
        raise QuantizeError(
            f"{path}: pipeline.source is missing; pass --source DIR (the source checkpoint folder, or "
            "tiny:glm_moe_dsa) or set it in the recipe"
        )
    if out is None and not opts["out"]:
        raise QuantizeError(f"{path}: pipeline.out is missing; name the run's folder (or pass --out)")
    ev = opts.get("eval") or {}
    gated = [k for k in ("max_kld", "max_flip_rate") if ev.get(k) is not None]
    if gated and not ev.get("kld"):
        raise QuantizeError(f"{path}: pipeline.eval.{gated[0]} gates the KL divergence, which the eval stage measures "
                            "only with pipeline.eval.kld: true; set it (or drop the bound)")
    stages = opts["stages"]
    if stages is None:
        stages = list(DEFAULT_STAGES)
    if not stages:
        raise QuantizeError(
            f"{path}: pipeline.stages is empty, so the run would do nothing; list the stages to run or drop the key "
            f"(default: {', '.join(DEFAULT_STAGES)})"
        )
    for s in stages:
        if s not in STAGES:
            raise O.unknown_key(path, "pipeline.stages: ", s, [x for x in STAGES if x != "make-source"], "stage")
    if len(set(stages)) != len(stages):
        raise QuantizeError(f"{path}: pipeline.stages names a stage twice; list each once")
    order = [s for s in STAGES if s in stages]
    if list(stages) != order:
        raise QuantizeError(
            f"{path}: pipeline.stages {list(stages)} is out of order; each stage needs what the ones before it "
            f"made, write them as {order}"
        )
    src = opts["source"]
    if src.startswith(TINY_PREFIX):
        from .testing.tiny import TINY

        if src[len(TINY_PREFIX) :] not in TINY:
            raise O.unknown_key(
                path, "pipeline.source: tiny:", src[len(TINY_PREFIX) :], list(TINY), "tiny architecture"
            )
        stages = ["make-source"] + [s for s in stages if s != "make-source"]
    elif "make-source" in stages:
        raise QuantizeError(f"{path}: pipeline.stages: make-source applies only to source: tiny:ARCH; drop it")
    else:
        src = str(Path(src).expanduser())
    if opts["kv"]["fold"] and {"pd-eval", "prefill"} & set(stages):
        raise QuantizeError(
            f"{path}: pipeline.kv.fold with the {'/'.join(s for s in ('pd-eval', 'prefill') if s in stages)} stage: "
            "fold "
            "rescales the cached MLA latent, and the prefill pool (the unfolded source) writes that cache, so a folded "
            "decode model would read it at the wrong scale; drop fold (the report still says whether unit scale is "
            "safe)"
        )
    if "push" in stages and not opts["repo"]:
        raise QuantizeError(
            f"{path}: pipeline.repo is missing and the stages include push; name the Hub repo (namespace/name) or "
            "drop push"
        )
    return Pipeline(path, src, Path(out if out is not None else opts["out"]).expanduser(), tuple(stages), opts,
                    overrides)


# -- identities -------------------------------------------------------------------------------


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _model_identity(folder: Path) -> str | None:
    """A quantize output's weights: the SHA-256 of each weight file as its manifest records them
    (the card rewriting README.md does not change it)."""
    try:
        m = load_json(folder / "quantize_manifest.json", "manifest", kind="record")
    except QuantizeError:
        return None
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict):
        return None
    weights = {k: (v or {}).get("sha256") for k, v in files.items() if k != "README.md"}
    return _digest(weights) if any(k.endswith(".safetensors") for k in weights) else None


def _source_identity(folder: Path) -> str | None:
    """A source checkpoint: its safetensors headers, sizes and mtimes, config.json and Hub revision
    (reads headers only, never the 705 GiB)."""
    from .checkpoint.index import hub_revision
    from .checkpoint.manifest import source_identity

    if not (folder / "config.json").is_file():
        return None
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    return _digest(
        {
            "path": str(folder.resolve()),
            "revision": hub_revision(folder),
            "config": sha256_file(folder / "config.json"),
            "files": source_identity(folder, files),
        }
    )


def _file_identity(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


# -- stages ------------------------------------------------------------------------------------


@dataclass
class Ctx:
    p: Pipeline
    emit: Emit
    art: dict = field(default_factory=dict)  # artifact -> {"path": relative path, "id": identity}

    def path(self, artifact: str) -> Path:
        a = self.art.get(artifact)
        if a is None:
            raise KeyError(artifact)
        return self.p.out / a["path"] if a["path"] != "@source" else self.p.source_path


def _opts_make_source(p: Pipeline) -> dict:
    return {"arch": p.tiny, "seed": 0}


def _opts_convert(p: Pipeline) -> dict:
    from dataclasses import asdict

    from .recipe import load_recipe

    c = p.opts["convert"]
    opts = {
        "recipe": asdict(load_recipe(p.recipe)) | {"path": None},
        **{k: c[k] for k in ("group_size", "profile", "observer", "keep_fp8")},
    }
    if _recipe_method(p) != "rtn":
        # a data-aware method's result depends on its options and its calibration text (not on
        # workers or the memory budget: both give the same bytes)
        opts.update({k: c[k] for k in METHOD_KEYS}, data=p.opts["data"], data_id=_data_identity(p.opts["data"]))
    return opts


# the convert section's data-aware keys (the calibration text is the pipeline's own `data`; options
# declared key=False change no byte, e.g. --skip-rtn-loss)
METHOD_KEYS = ("method", *(f.name for f in dataclasses.fields(O.ConvertOptions)
                           if f.name in O.method_options() and f.name != "data" and O.spec(f).key))


def _opts_kv(p: Pipeline) -> dict:
    data = p.opts["data"]
    return {**p.opts["kv"], "data": data, "data_id": _data_identity(data)}


def _data_identity(data: str | None) -> str | None:
    if not data or data.startswith("hf:"):
        return data
    d = Path(data)
    if d.is_file():
        st = d.stat()
        return f"{st.st_size}:{st.st_mtime_ns}"
    if d.is_dir():
        return _digest(
            sorted((str(f.relative_to(d)), f.stat().st_size, f.stat().st_mtime_ns) for f in d.rglob("*") if f.is_file())
        )
    return None


def _eval_data(data_dir) -> str | None:
    from .evaluate.tasks import data_folder

    d = data_folder(data_dir)
    return None if d is None else str(d)


def _opts_eval(p: Pipeline) -> dict:
    o = p.opts
    return {
        "tasks": o["tasks"],
        "limit": o["limit"],
        "max_drop": o["max_drop"],
        "data_dir": o["data_dir"],
        "data_id": _data_identity(_eval_data(o["data_dir"])),
        **o["eval"],
    }


# the pd section's keys: eval-pd's options (the pd-eval stage) and the prefill artifact's launch
# options, which share the cache dtype (SGLang requires the same on both pools)
PD_EVAL_KEYS = tuple(f.name for f in dataclasses.fields(O.PDOptions) if O.spec(f).recipe)
PREFILL_KEYS = tuple(f.name for f in dataclasses.fields(O.PrefillOptions)) + ("kv_cache_dtype",)


def _opts_pd(p: Pipeline) -> dict:
    pd = p.opts["pd"]
    return {k: pd[k] for k in PD_EVAL_KEYS} | {"text_id": _data_identity(pd["text"])}


def _opts_prefill(p: Pipeline) -> dict:
    pd = p.opts["pd"]
    return {k: pd[k] for k in PREFILL_KEYS} | {"repo": p.opts["repo"]}


def _kv_writes(ctx: Ctx) -> str | None:
    """What calibrate-kv writes for this model and these options: "fold", "scales" or None (the
    report only), as calibrate_kv decides it (the attention layout's ``writes``: MLA on
    sglang/vllm: unit scale, nothing to write; GLM-5 DSA: per-128 dynamic scales, nothing to write)."""
    from . import archs

    kv = ctx.p.opts["kv"]
    if kv["fold"]:
        return "fold"
    folder = ctx.path("converted") if "converted" in ctx.art else ctx.p.source_path
    if not (folder / "config.json").is_file():  # planning a run whose source is not made yet
        return "scales" if kv["target"] == "compressed-tensors" else None
    arch = archs.resolve(load_json(folder / "config.json", "config.json"), str(folder / "config.json"))
    return arch.layout.writes(kv["target"], fold=False)


def _run_make_source(ctx: Ctx, resume: bool) -> dict:
    from .testing import tiny

    out = ctx.p.out / "source"
    tiny.make_tiny(ctx.p.tiny, out, overwrite=True)
    return {
        "outputs": {"source": {"path": "@source", "id": _source_identity(out)}},
        "summary": f"tiny {ctx.p.tiny} checkpoint, laid out as the vendor ships it, made from transformers' classes "
                   f"in {out}",
    }


def _run_convert(ctx: Ctx, resume: bool) -> dict:
    from . import convert as conv

    c = ctx.p.opts["convert"]
    out = ctx.p.out / "model"
    # the method options given (beside RTN convert refuses them, naming each; 0 is a value, e.g.
    # iters 0); the calibration text and memory budget only for a data-aware method
    method_opts = {k: c[k] for k in METHOD_KEYS if c[k] is not None and c[k] is not False}
    if _recipe_method(ctx.p) != "rtn":
        method_opts["data"] = ctx.p.opts["data"]
    res = conv.convert(
        ctx.path("source"),
        out,
        recipe=str(ctx.p.recipe),
        resume=resume,
        overwrite=not resume and out.exists(),
        emit=ctx.emit,
        base_model=ctx.p.opts["base_model"],  # recorded in the manifest; not in the stage's hash (same bytes)
        **{k: v for k, v in c.items() if k not in METHOD_KEYS},  # the section is convert's own options
        **method_opts,
    )
    ident = _model_identity(out)
    mean = f", INT4 weight rel. error mean {res.mean_rel_err:.4f}" if res.mean_rel_err is not None else ""
    return {
        "outputs": {"converted": {"path": "model", "id": ident}, "model": {"path": "model", "id": ident}},
        "summary": f"{res.tensors_int4} INT4 tensors, {res.source_bytes:,} -> {res.output_bytes:,} bytes{mean}",
        "result": {
            "tensors_int4": res.tensors_int4,
            "source_bytes": res.source_bytes,
            "output_bytes": res.output_bytes,
            "mean_rel_err": res.mean_rel_err,
            "resumed_shards": res.resumed_shards,
        },
    }


def _opts_convert_prefill(p: Pipeline) -> dict:
    return dict(p.opts["prefill_model"])


def _run_convert_prefill(ctx: Ctx, resume: bool) -> dict:
    from . import convert as conv

    out = ctx.p.out / "prefill-model"
    res = conv.convert(ctx.path("source"), out, resume=resume, overwrite=not resume and out.exists(), emit=ctx.emit,
                       base_model=ctx.p.opts["base_model"], **ctx.p.opts["prefill_model"])
    return {
        "outputs": {"prefill_model": {"path": "prefill-model", "id": _model_identity(out)}},
        "summary": f"prefill weights: {res.tensors_int4} {ctx.p.opts['prefill_model']['scheme']} tensors, "
                   f"{res.source_bytes:,} -> {res.output_bytes:,} bytes",
        "result": {"tensors": res.tensors_int4, "source_bytes": res.source_bytes, "output_bytes": res.output_bytes},
    }


def _run_kv(ctx: Ctx, resume: bool) -> dict:
    from .calibrate import kv as kvmod

    kv, p = ctx.p.opts["kv"], ctx.p
    writes = _kv_writes(ctx)
    (p.out / "reports").mkdir(exist_ok=True)
    stats = p.out / "reports" / "kv.json"
    out = p.out / "model-kv" if writes else None
    res = kvmod.calibrate_kv(
        ctx.path("converted"),
        out,
        data=p.opts["data"],
        stats_out=stats,
        overwrite=out is not None and out.exists(),
        emit=ctx.emit,
        base_model=p.opts["base_model"],
        **kv,  # the section is calibrate-kv's own options
    )
    outputs = {"kv_report": {"path": "reports/kv.json", "id": _file_identity(stats)}}
    if out is not None:
        outputs["model"] = {"path": "model-kv", "id": _model_identity(out)}
    write_text_atomic(p.out / "reports" / "kv-verdict.json", json.dumps(res.to_dict(), indent=1, default=str))
    what = {"fold": "folded model in model-kv/", "scales": "KV scales in model-kv/"}.get(writes, "report only")
    return {
        "outputs": outputs,
        "writes": ["reports/kv-verdict.json"],
        "summary": f"{res.layout}: {what}; {res.verdict}",
        "result": {"layout": res.layout, "unit_scale_safe": res.unit_scale_safe, "written": len(res.written)},
    }


def _run_shard(ctx: Ctx, resume: bool) -> dict:
    from . import shard as sh

    out = ctx.p.out / "shard"
    tp = ctx.p.opts["shard"]["tp"]
    m = sh.shard(ctx.path("model"), out, tp=tp, overwrite=out.exists(), emit=ctx.emit)
    return {
        "outputs": {"shard": {"path": "shard", "id": _file_identity(out / "shard_manifest.json")}},
        "summary": f"TP {tp}: {len(m['tensors'])} tensors; bytes per rank "
        f"{', '.join(f'{b:,}' for b in m['rank_bytes'])}",
        "result": {"tp": tp, "rank_bytes": m["rank_bytes"]},
    }


def _run_check(ctx: Ctx, resume: bool) -> dict:
    from . import check as chk

    p = ctx.p
    (p.out / "reports").mkdir(exist_ok=True)
    model = ctx.path("model")
    source = (
        ctx.path("source") if ctx.art["model"]["path"] == ctx.art["converted"]["path"] else None
    )  # a folded model differs from the source by design
    rep = chk.check(model, tp=p.opts["shard"]["tp"], source=source, emit=ctx.emit)
    write_text_atomic(p.out / "reports" / "check.json", signed_json(rep.to_dict(), chk.REPORT_KIND))
    outputs = {"check_report": {"path": "reports/check.json", "id": _file_identity(p.out / "reports" / "check.json")}}
    failures = list(rep.failures)
    proven = rep.verified
    if "shard" in ctx.art:
        srep = chk.check(ctx.path("shard"), emit=ctx.emit)
        write_text_atomic(p.out / "reports" / "check-shard.json", signed_json(srep.to_dict(), chk.REPORT_KIND))
        failures += [f"shard: {f}" for f in srep.failures]
    if failures:
        raise CheckFailed(f"check: {failures[0]} ({len(failures)} failures; {p.out / 'reports' / 'check.json'})")
    return {
        "outputs": outputs,
        "writes": ["reports/check-shard.json"] if "shard" in ctx.art else [],
        "summary": f"pass: {proven.get('files_sha256', 0)} files by SHA-256"
        + "".join(", " + part for part in chk.proven_parts(proven))
        + (", the TP split exact" if "shard" in ctx.art else ""),
    }


def _run_eval(ctx: Ctx, resume: bool) -> dict:
    from .evaluate import run as ev

    import importlib.util

    p, o = ctx.p, ctx.p.opts
    dd = _eval_data(o["data_dir"])  # `shipped`: the repository's eval/data subset
    skip = o["eval"]["if_no_data"] == "skip"
    if importlib.util.find_spec("lm_eval") is None:
        if skip:
            return {
                "outputs": {},
                "state": "skipped",
                "summary": "skipped: lm-eval is not installed (pip install 'quantize[eval]'; "
                "pipeline.eval.if_no_data: skip); no gate was applied",
            }
        raise QuantizeError(
            "eval: lm-eval is not installed; pip install 'quantize[eval]', or drop eval from pipeline.stages"
        )
    if dd is not None and not Path(dd).is_dir():
        if skip:
            return {
                "outputs": {},
                "state": "skipped",
                "summary": f"skipped: the eval data folder {dd} is not here (pipeline.eval.if_no_data: skip); "
                "no gate was applied",
            }
        raise QuantizeError(
            f"{p.recipe}: pipeline.data_dir {dd}: no such folder; point it at local eval data (the files "
            "docs/evaluation.md#local-data lists) or drop data_dir to read the Hub"
        )
    (p.out / "reports").mkdir(exist_ok=True)
    out, md = p.out / "reports" / "eval.json", p.out / "reports" / "eval.md"
    kld_out = p.out / "reports" / "kld.json" if o["eval"]["kld"] else None
    rep = ev.evaluate(
        ctx.path("source"),
        ctx.path("model"),
        tasks=o["tasks"],
        limit=o["limit"],
        data_dir=dd,
        max_drop=o["max_drop"],
        out=out,
        markdown=md,
        max_gen_toks=o["eval"]["max_gen_toks"],
        device=o["eval"]["device"],
        chat=o["eval"]["chat"],
        thinking=o["eval"]["thinking"],
        kld_out=kld_out,
        max_kld=o["eval"]["max_kld"],
        max_flip_rate=o["eval"]["max_flip_rate"],
        serve_log=p.out / "reports" / "engine-logs" if o["eval"]["serve"] else None,
        **{k: o["eval"][k] for k in SERVE_KEYS},
    )
    rows = "; ".join(
        f"{t.task} {t.baseline:.1f} -> {t.candidate:.1f} ({t.delta:+.1f}, CI {t.ci_low:+.1f}..{t.ci_high:+.1f}) "
        f"{t.verdict}"
        for t in rep.tasks
    )
    if rep.kld is not None:
        rows += (f"; KL divergence {rep.kld.kld_mean:.4g} ({rep.kld.estimator}), top-1 agreement "
                 f"{rep.kld.top1_agreement:.4f}" + (f", KL gate {rep.kld.gate['verdict']}" if rep.kld.gate else ""))
    res = {
        "outputs": {"eval_report": {"path": "reports/eval.json", "id": _file_identity(out)},
                    **({"kld_report": {"path": "reports/kld.json", "id": _file_identity(kld_out)}}
                       if kld_out is not None else {})},
        "summary": rows,
        "result": {"passed": rep.passed},
    }
    if not rep.passed:
        res["state"] = "failed"
        kg = rep.kld.gate if rep.kld is not None else None
        which = "the KL / flip gate" if kg is not None and not kg["passed"] else f"max drop {o['max_drop']} points"
        res["error"] = f"eval: the gate failed ({which}): {rows}; nothing was pushed ({out})"
    return res


def _run_pd_eval(ctx: Ctx, resume: bool) -> dict:
    from .evaluate import pd

    p, o = ctx.p, ctx.p.opts["pd"]
    (p.out / "reports").mkdir(exist_ok=True)
    out = p.out / "reports" / "pd.json"
    prefill = ctx.path("prefill_model") if "prefill_model" in ctx.art else ctx.path("source")
    rep = pd.pd_fidelity(prefill, ctx.path("model"), ctx.path("source"), out=out, **{k: o[k] for k in PD_EVAL_KEYS})
    return {
        "outputs": {"pd_report": {"path": "reports/pd.json", "id": _file_identity(out)}},
        "summary": rep.line(),
        "result": rep.to_dict(),
    }


def _run_card(ctx: Ctx, resume: bool) -> dict:
    from .publish import card as cd

    reports = [ctx.path(a) for a in ("kv_report", "check_report", "eval_report", "kld_report") if a in ctx.art]
    res = cd.card(  # push writes the same card
        ctx.path("model"), eval=reports or None, repo_id=ctx.p.opts["repo"], base_model=ctx.p.opts["base_model"],
        license=ctx.p.opts["license"],
    )
    model = ctx.path("model")
    return {
        "outputs": {
            "card": {
                "path": str(Path(ctx.art["model"]["path"]) / "README.md"),
                "id": _file_identity(model / "README.md"),
            }
        },
        "writes": [str(Path(ctx.art["model"]["path"]) / "quantize_manifest.json")],  # its entry for README.md
        "summary": f"wrote {res.path}"
        + (f" with {', '.join(r['kind'] for r in res.reports)} reports" if res.reports else ""),
    }


def _run_prefill(ctx: Ctx, resume: bool) -> dict:
    from .evaluate import pd

    p = ctx.p
    out = p.out / "prefill"
    pd_report = ctx.path("pd_report") if "pd_report" in ctx.art else None
    res = pd.write_prefill(
        ctx.path("source"),
        ctx.path("model"),
        out,
        repo=p.opts["repo"],
        pd_report=pd_report,
        prefill_model=ctx.path("prefill_model") if "prefill_model" in ctx.art else None,
        overwrite=out.exists(),
        **{k: p.opts["pd"][k] for k in PREFILL_KEYS},
    )
    return {
        "outputs": {"prefill": {"path": "prefill", "id": _file_identity(out / "README.md")}},
        "summary": f"prefill artifact (card and launch lines, no weights) in {out}; points at {res['source']}"
        + (f"@{res['revision']}" if res.get("revision") else ""),
    }


def _run_push(ctx: Ctx, resume: bool) -> dict:
    from .publish import push as ps

    p, o = ctx.p, ctx.p.opts["push"]
    res = ps.push(
        ctx.path("model"),
        p.opts["repo"],
        private=o["private"],
        revision=o["revision"],
        create_pr=o["create_pr"],
        dry_run=o["dry_run"],
        base_model=p.opts["base_model"],
        license=p.opts["license"],
        emit=ctx.emit,
    )
    (p.out / "reports").mkdir(exist_ok=True)
    write_text_atomic(p.out / "reports" / "push.json", json.dumps(res.to_dict(), indent=1, default=str))
    what = (
        f"dry run: {len(res.files)} files, {res.total_bytes:,} bytes would go to {p.opts['repo']}; nothing was sent"
        if res.dry_run
        else f"pushed {sum(f.status == 'uploaded' for f in res.files)} files to "
             f"{res.pr_url or res.url or p.opts['repo']}"
    )
    return {
        "outputs": {"push": {"path": "reports/push.json", "id": _file_identity(p.out / "reports" / "push.json")}},
        "summary": what,
        "result": {"dry_run": res.dry_run, "files": len(res.files), "bytes": res.total_bytes},
    }


@dataclass(frozen=True)
class Stage:
    name: str
    needs: tuple[str, ...]  # artifacts it must have
    uses: tuple[str, ...]  # artifacts it takes when the run has them
    options: object  # Pipeline -> the options this stage runs with (hashed)
    run: object  # (Ctx, resume) -> {"outputs", "summary", "result", "state", "error"}


def _recipe_method(p: Pipeline) -> str:
    """The conversion's method: the convert section's, else the recipe modifier's (a conflict is
    refused when convert runs)."""
    from .recipe import load_recipe

    return p.opts["convert"]["method"] or load_recipe(p.recipe).method


def _base_opts(p: Pipeline) -> dict:
    """pipeline.base_model and pipeline.license in the card and push stages' options (so a new one rewrites the card),
    only when set: a run without it keeps the hash its card stage had before the key existed.
    convert and calibrate-kv record it but do not hash it: it does not change what they write."""
    return {k: p.opts[k] for k in ("base_model", "license") if p.opts[k]}


def _does(p: Pipeline, name: str) -> str:
    o = p.opts
    c = o["convert"]
    return {
        "make-source": lambda: (
            f"make a tiny {p.tiny} FP8 checkpoint (transformers' classes, vendor layout) in {p.out / 'source'}"
        ),
        "convert": lambda: (
            f"convert {p.source_path} -> {p.out / 'model'} (recipe {p.recipe.name}"
            + "".join(
                f", {k} {c[k]}"
                for k in ("group_size", "profile", "observer", "method", "samples", "seq_len", "iters")
                if c[k] is not None
            )
            + (
                f", {_recipe_method(p)} calibrated on {o['data'] or 'the shipped corpus'}"
                if _recipe_method(p) != "rtn"
                else ""
            )
            + (", keep FP8" if c["keep_fp8"] else "")
            + ")"
        ),
        "calibrate-kv": lambda: (
            f"KV-cache report (target {o['kv']['target']}, {o['kv']['samples']} samples x {o['kv']['seq_len']} tokens"
            + (f", data {o['data']}" if o["data"] else ", the shipped corpus")
            + ")"
            + (
                ", fold the cache range into model-kv/"
                if o["kv"]["fold"]
                else "; writes a model only for GQA or --target compressed-tensors"
            )
        ),
        "shard": lambda: f"split the model for TP {o['shard']['tp']} into {p.out / 'shard'} (verification layout)",
        "check": lambda: (
            f"prove every file by SHA-256, the kernels, TP {o['shard']['tp']} rules"
            + " and every tensor against the source, and the TP split"
        ),
        "eval": lambda: (
            f"lm-eval {o['tasks']} (limit {o['limit']}, data {o['data_dir'] or 'the Hub'}), source vs model, gate max "
            f"drop {o['max_drop']}"
            + (" (skipped if the data is absent)" if o["eval"]["if_no_data"] == "skip" else "")
        ),
        "convert-prefill": lambda: (
            f"make the prefill pool's weights ({o['prefill_model']['scheme']}, "
            f"profile {o['prefill_model']['profile']}) "
            f"from the source in {p.out / 'prefill-model'}"
        ),
        "pd-eval": lambda: (
            f"prefill/decode fidelity: the prompt's KV from the "
            f"{'prefill weights' if 'convert-prefill' in p.stages else 'source'} (prefill), stored "
            f"{o['pd']['kv_cache_dtype']}, "
            f"decoded by the model; KLD/top-1 against the source, beside the model alone"
        ),
        "card": lambda: "write the model card (README.md) from the records and the KV, check and eval reports"
        + (f", base_model {o['base_model']}" if o["base_model"] else ""),
        "prefill": lambda: (
            f"write the prefill artifact (card + SGLang PD launch lines pointing at "
            f"{p.out / 'prefill-model' if 'convert-prefill' in p.stages else p.source}, no weights) in "
            f"{p.out / 'prefill'}"
        ),
        "push": lambda: (
            f"push the model to {o['repo']}" + (" (dry run: nothing is sent)" if o["push"]["dry_run"] else "")
        ),
    }[name]()


STAGE_TABLE = {
    "make-source": Stage("make-source", (), (), _opts_make_source, _run_make_source),
    "convert": Stage("convert", ("source",), (), _opts_convert, _run_convert),
    "convert-prefill": Stage("convert-prefill", ("source",), (), _opts_convert_prefill, _run_convert_prefill),
    "calibrate-kv": Stage("calibrate-kv", ("converted",), (), _opts_kv, _run_kv),
    "shard": Stage("shard", ("model",), (), lambda p: dict(p.opts["shard"]), _run_shard),
    "check": Stage(
        "check", ("model", "source", "converted"), ("shard",), lambda p: {"tp": p.opts["shard"]["tp"]}, _run_check
    ),
    "eval": Stage("eval", ("model", "source"), (), _opts_eval, _run_eval),
    "pd-eval": Stage("pd-eval", ("model", "source"), ("prefill_model",), _opts_pd, _run_pd_eval),
    "card": Stage(
        "card", ("model",), ("kv_report", "check_report", "eval_report", "kld_report"), lambda p: _base_opts(p),
        _run_card
    ),
    "prefill": Stage("prefill", ("source", "model"), ("pd_report", "prefill_model"), _opts_prefill, _run_prefill),
    "push": Stage(
        "push", ("model",), ("card",), lambda p: dict(p.opts["push"]) | {"repo": p.opts["repo"]} | _base_opts(p),
        _run_push,
    ),
}
PRODUCER = {
    "source": "make-source or an existing source folder",
    "converted": "convert",
    "model": "convert",
    "prefill_model": "convert-prefill",
    "shard": "shard",
    "check_report": "check",
    "eval_report": "eval",
    "kld_report": "eval (with eval.kld: true)",
    "pd_report": "pd-eval",
    "card": "card",
}


# -- the run --------------------------------------------------------------------------------------


@dataclass
class StagePlan:
    stage: str
    state: str  # done | skipped | stale | pending | failed
    does: str
    why: str = ""
    seconds: float | None = None
    summary: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RunResult:
    out: str
    recipe: str
    plan: bool
    stages: list[StagePlan]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(s.state in ("done", "skipped", "ran") for s in self.stages) if not self.plan else True

    def to_dict(self) -> dict:
        return {
            "out": self.out,
            "recipe": self.recipe,
            "plan": self.plan,
            "seconds": round(self.seconds, 3),
            "stages": [s.to_dict() for s in self.stages],
        }


def _stage_paths(p: Pipeline, rec: dict) -> list[str]:
    """The files and folders (relative to the run's folder) a stage wrote: its outputs' paths and
    what else it ``writes`` (a made tiny source is the run's own ``source/``)."""
    paths = []
    for a in (rec.get("outputs") or {}).values():
        path = a.get("path")
        if path == "@source":
            path = "source" if p.tiny else None
        if path:
            paths.append(path)
    return sorted(set(paths) | set(rec.get("writes") or []))


def _files_of(p: Pipeline, rels: list[str], workers: int = 4) -> dict[str, dict]:
    """SHA-256 and size of every file under ``rels`` in the run's folder (a job's own ``.quantize``
    record folders aside: they change as its outputs are read, and prove nothing a file's hash does
    not)."""
    files = []
    for rel in rels:
        root = confined(p.out, rel, f"{p.out}/{RECORD_DIR}/job.json")
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            files += [
                f for f in sorted(root.rglob("*"))
                if f.is_file() and RECORD_DIR not in f.relative_to(root).parts
            ]
    shas = sha256_files(files, workers)
    return {
        f.relative_to(p.out).as_posix(): {"sha256": h, "bytes": f.stat().st_size} for f, h in zip(files, shas)
    }


def _outputs_intact(p: Pipeline, rec: dict) -> bool:
    """What a finished stage wrote is still there, unchanged: every file under its outputs has the
    SHA-256 the stage recorded, none is missing and none was added (a record that kept no file list,
    written before records did, is not trusted)."""
    recorded = rec.get("files")
    if not isinstance(recorded, dict):
        return False
    try:
        if _files_of(p, _stage_paths(p, rec)) != recorded:
            return False
    except (QuantizeError, OSError):
        return False
    for name, a in (rec.get("outputs") or {}).items():
        if a.get("path") == "@source":
            path, fn = p.source_path, _source_identity
        else:
            try:
                path = confined(p.out, a["path"], f"{p.out}/{RECORD_DIR}/job.json")
            except QuantizeError:
                return False
            fn = {"converted": _model_identity, "model": _model_identity,
                  "prefill_model": _model_identity}.get(name, _file_identity)
            if name == "shard":
                path = path / "shard_manifest.json"
            elif name == "prefill":
                path = path / "README.md"
        if a.get("id") is None or fn(path) != a["id"]:
            return False
    return True


def _diff_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff_keys(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def _calibration_preflight(p: Pipeline) -> None:
    """The calibration inputs of the stages that tokenize text (a data-aware convert, calibrate-kv),
    checked on the source before the run's folder is opened or any stage runs, in the stages' own
    order (docs/hostile-input.md#fail-fast): config.json and the headers, the data and tokenizer (the
    samples tokenized as the stage will), the layer classes (``LayerStreamer.check_layers``).
    calibrate-kv reads the converted model, which carries the source's tokenizer and layer tensors,
    so a missing tokenizer is one line now, not after the whole conversion. A tiny source is made by
    the run, tokenizer included."""
    from .calibrate.data import build_samples
    from .calibrate.runner import LayerStreamer
    from .recipe import load_recipe

    if p.tiny is not None:
        return
    jobs = []
    if "convert" in p.stages and _recipe_method(p) != "rtn":
        c = O.ConvertOptions(**p.opts["convert"]).resolve(load_recipe(p.recipe))
        jobs.append((c.samples, c.seq_len, False))
    if "calibrate-kv" in p.stages:
        kv = p.opts["kv"]
        jobs.append((kv["samples"], kv["seq_len"], bool(kv["chat_template"])))
    if not jobs:
        return
    st = LayerStreamer(p.source_path)
    try:
        for samples, seq_len, chat in jobs:
            build_samples(p.source_path, p.opts["data"], samples, seq_len, chat)
        st.check_layers()
    finally:
        st.close()


def _walk(p: Pipeline, record: dict, execute, emit: Emit) -> list[StagePlan]:
    """Decide, stage by stage, whether its record still holds (same options, same input
    identities, outputs intact); ``execute`` runs those that do not (None: plan only)."""
    stages_rec = record.setdefault("stages", {})
    ctx = Ctx(p, emit)
    if p.tiny is None:
        ctx.art["source"] = {"path": "@source", "id": _source_identity(p.source_path)}
        if ctx.art["source"]["id"] is None:
            raise QuantizeError(
                f"{p.recipe}: pipeline.source {p.source}: not a checkpoint folder (no config.json); "
                f"point it at the vendor's release, or tiny:glm_moe_dsa"
            )
    rerun: set[str] = set()  # artifacts that were (or, planning, would be) rewritten in this run
    build = build_key()  # an interrupted stage continues only under the build that started it
    plans: list[StagePlan] = []
    # artifacts a stage not listed this time made in an earlier run (e.g. convert done, stages: [eval])
    for name in STAGES:
        rec = stages_rec.get(name)
        if (
            name not in p.stages
            and rec
            and rec.get("state") in ("done", "skipped")
            and _outputs_intact(p, rec)
        ):
            for a, v in rec.get("outputs", {}).items():
                ctx.art.setdefault(a, v)
    available = set(ctx.art)  # every stage's inputs are checked before any stage runs
    for name in p.stages:
        for a in STAGE_TABLE[name].needs:
            if a not in available:
                raise QuantizeError(
                    f"{p.recipe}: stage {name} needs the {a.replace('_', ' ')} that {PRODUCER.get(a, a)} makes, and "
                    "this run "
                    f"has none; add {PRODUCER.get(a, a).split(' or ')[0]} to pipeline.stages (before {name})"
                )
        available.update(STAGE_MAKES[name])
    for name in p.stages:
        st = STAGE_TABLE[name]
        opts = st.options(p)
        deps = st.needs + st.uses
        inputs = {a: ctx.art[a]["id"] if a in ctx.art else None for a in deps if a in ctx.art or a in st.needs}
        h = _digest({"options": opts, "inputs": inputs})
        rec = stages_rec.get(name)
        upstream = sorted(a for a in deps if a in rerun)
        does = _does(p, name)
        fresh = rec is not None and rec.get("hash") == h and not upstream
        if fresh and rec.get("state") in ("done", "skipped") and _outputs_intact(p, rec):
            for a, v in rec.get("outputs", {}).items():
                ctx.art[a] = v
            plans.append(
                StagePlan(name, rec["state"], does, seconds=rec.get("seconds"), summary=rec.get("summary", ""))
            )
            emit(
                {
                    "event": "stage",
                    "stage": name,
                    "state": rec["state"],
                    "kept": True,
                    "summary": rec.get("summary", ""),
                }
            )
            continue
        if fresh and rec.get("state") == "failed":
            plans.append(
                StagePlan(
                    name, "failed", does, why="failed with these options and inputs", summary=rec.get("summary", "")
                )
            )
            emit({"event": "stage", "stage": name, "state": "failed", "kept": True, "summary": rec.get("summary", "")})
            if execute is not None:
                raise CheckFailed(
                    rec.get("error") or f"{name}: failed (recorded); change the options or inputs, or --overwrite"
                )
            break
        if rec is None:
            state, why = "pending", ""  # the state says it; the run's header shows no reason
        elif rec.get("hash") == h and not upstream and rec.get("state") == "running" and rec.get("build") != build:
            state, why = "pending", "interrupted under another build of quantize or its libraries: starts over"
        elif rec.get("hash") == h and not upstream and rec.get("state") == "running":
            state, why = "pending", "interrupted: continues" + (" (convert --resume)" if name == "convert" else "")
        elif rec.get("hash") == h and not upstream:
            state, why = "stale", "its outputs are missing or changed"
        else:
            changed = _diff_keys(rec.get("options") or {}, opts)
            ins = sorted(set(a for a in inputs if (rec.get("inputs") or {}).get(a) != inputs[a]) | set(upstream))
            state = "stale"
            why = (
                "; ".join(
                    x
                    for x in (
                        f"options changed: {', '.join(changed)}" if changed else "",
                        f"input changed: {', '.join(ins)}" if ins else "",
                    )
                    if x
                )
                or "record differs"
            )
        plans.append(StagePlan(name, state, does, why=why))
        rerun.update(STAGE_MAKES[name])
        if name == "calibrate-kv" and _kv_writes(ctx) is None:
            rerun.discard("model")  # the report only: the model downstream stages take is unchanged
        if execute is None:
            continue
        resume = rec is not None and rec.get("hash") == h and rec.get("state") == "running"
        resume = resume and rec.get("build") == build
        res = execute(ctx, name, st, opts, inputs, h, resume, does, why)
        plans[-1].state = res.get("state", "done")
        plans[-1].seconds = res.get("seconds")
        plans[-1].summary = res.get("summary", "")
        for a, v in res.get("outputs", {}).items():
            ctx.art[a] = v
        if res.get("state") == "failed":
            raise CheckFailed(res["error"])
    return plans


STAGE_MAKES = {
    "make-source": ("source",),
    "convert": ("converted", "model"),
    "convert-prefill": ("prefill_model",),
    "calibrate-kv": ("kv_report", "model"),
    "shard": ("shard",),
    "check": ("check_report",),
    "eval": ("eval_report", "kld_report"),
    "pd-eval": ("pd_report",),
    "card": ("card",),
    "prefill": ("prefill",),
    "push": ("push",),
}


@O.takes(O.RunOptions)
def run(recipe, out, source, data, data_dir, sets, plan, overwrite, emit: Emit = null_emit) -> RunResult:
    """``quantize run``: run RECIPE's pipeline (None: the embedded default) into its ``out``
    (``out`` here overrides it), continuing from the run's job record: finished stages whose
    options and inputs are unchanged are kept. ``plan``: say what each stage would do and whether
    it is done, stale or pending, and run nothing. A failed check or eval gate raises
    ``CheckFailed`` (exit 1) before push."""
    t0 = time.time()
    p = load_pipeline(recipe, out, source, data, data_dir, sets)
    record = read_record(p.out) if p.out.is_dir() else None
    inputs = [p.recipe] + ([p.source_path] if p.tiny is None else [])
    if plan:
        if p.out.exists() and not p.out.is_dir():
            raise QuantizeError(f"{p.out}: exists and is a file, not a folder; choose another pipeline.out")
        refuse_overlap(p.out, inputs)  # what the run itself would refuse, said by the plan too
        if record is not None and record.get("kind") not in ("run", None):
            raise QuantizeError(
                f"{p.out}: holds a `quantize {record.get('kind')}` output, not a run; choose another pipeline.out"
            )
        rec = {} if overwrite or not record or record.get("kind") != "run" else json.loads(json.dumps(record))
        plans = _walk(p, rec, None, null_emit)
        return RunResult(str(p.out), str(p.recipe), True, plans, time.time() - t0)
    _calibration_preflight(p)  # before the run's folder: a missing tokenizer is not found after convert
    key = {"recipe": str(p.recipe.resolve()), "source": p.source}
    with Output.open(p.out, "run", inputs, resume=not overwrite, overwrite=overwrite, key=key) as o:
        o.record["key"] = key
        o.record["overrides"] = p.overrides  # recorded as the recipe's values are (in each stage's options)
        o.record["state"] = "running"
        o.save()

        def execute(ctx, name, st, opts, inputs, h, resume, does, why):
            recs = o.record.setdefault("stages", {})
            recs[name] = {
                "state": "running", "hash": h, "options": opts, "inputs": inputs, "started": time.time(),
                "build": build_key(),
            }
            o.save()
            emit({"event": "stage", "stage": name, "state": "start", "does": does, "why": why, "resume": resume})
            t = time.time()
            ctx.emit = lambda e: emit({"in_stage": name, **e})  # the stage's own progress events
            try:
                res = st.run(ctx, resume)
            except CheckFailed as e:
                recs[name].update(state="failed", error=str(e), summary=str(e))
                o.save()
                emit({"event": "stage", "stage": name, "state": "failed", "error": str(e)})
                raise
            except BaseException as e:
                recs[name].update(state="running", error=f"{type(e).__name__}: {e}")
                o.save()
                emit({"event": "stage", "stage": name, "state": "error", "error": f"{type(e).__name__}: {e}"})
                raise
            res["seconds"] = round(time.time() - t, 3)
            recs[name].update(
                state=res.get("state", "done"),
                outputs=res.get("outputs", {}),
                writes=sorted(res.get("writes", ())),
                summary=res.get("summary", ""),
                result=res.get("result"),
                seconds=res["seconds"],
                finished=time.time(),
                error=res.get("error"),
            )
            # what the stage wrote, file by file: the next run keeps it only while every hash holds
            files = recs[name]["files"] = _files_of(p, _stage_paths(p, recs[name]))
            for other, r in recs.items():  # a file this stage wrote in another's folder (card: README.md)
                if other != name and isinstance(r.get("files"), dict):
                    theirs = _stage_paths(p, r)
                    r["files"].update(
                        {k: v for k, v in files.items() if any(k == t or k.startswith(t + "/") for t in theirs)}
                    )
            o.save()
            emit(
                {
                    "event": "stage",
                    "stage": name,
                    "state": res.get("state", "done"),
                    "seconds": res["seconds"],
                    "summary": res.get("summary", ""),
                }
            )
            return res

        plans = _walk(p, o.record, execute, emit)
        o.record["state"] = "complete"
        o.save()
    res = RunResult(str(p.out), str(p.recipe), False, plans, time.time() - t0)
    emit({"event": "done", "seconds": round(res.seconds, 3), "stages": {s.stage: s.state for s in plans}})
    return res
