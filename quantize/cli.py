"""The ``quantize`` command line: each command parses, calls one library function with the same
parameter names, and renders its result (rich for people, ``--json`` NDJSON for machines).

A command's options are declared once, in ``quantize.options`` (one dataclass per command); the
Typer parameters here are made from that declaration (``command``), so the command line, the
library function and the ``quantize run`` recipe cannot drift apart."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from . import options as O
from . import startup
from .errors import QuantizeError

_ARGV: list[str] = []  # this command line, as given: what --nproc runs again under torchrun


class _OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a value that does not parse as the option's type, an unknown option, a
    missing argument) are one line like every other refusal, naming the command and option, with
    the pointer to --help; not click's usage box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from typer._click import exceptions as click  # typer's own click (its exceptions are these)

        _ARGV[:] = sys.argv[1:] if args is None else list(args)
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            names = ["quantize"] + ([e.ctx.info_name] if e.ctx is not None and e.ctx.parent is not None else [])
            msg = " ".join(e.format_message().split())
            typer.echo(f"error: {' '.join(names)}: {msg} (see `{' '.join(names)} --help`)", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


class _Flags:
    """A flag takes no value: every flag (--help included) is shown without the "<bool>" typer puts
    after it (its metavar empty), unless it names one of its own."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


class _Group(_Flags, _OneLineErrors):
    pass


class _Command(_Flags, typer.core.TyperCommand):
    pass


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Offline FP8/BF16 -> INT4 (compressed-tensors pack-quantized) for GLM 5.x and Kimi K2.x on SGLang/vLLM.",
)


def command(
    model: type | None = None,
    name: str | None = None,
    *,
    json_help: str | None = None,
    extra: tuple = (),
    models: tuple = (),
):
    """Register the decorated renderer as a command whose parameters are the command-line fields
    of ``model`` (and of ``models``), then ``extra`` (``(name, annotation, typer.Option)``: switches
    of the command line itself) and ``--json`` when ``json_help`` is given. The renderer is called
    with every parameter as a keyword."""

    def deco(body):
        params = [p for m in ((model,) if model else ()) + tuple(models) for p in O.cli_parameters(m)]
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a) for n, a, d in extra]
        if json_help is not None:
            params.append(
                inspect.Parameter(
                    "json_out",
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=bool,
                    default=typer.Option(False, "--json", help=json_help),
                )
            )

        def cmd(**kw):
            if "nproc" in kw:  # a command that runs as several ranks (quantize.distributed)
                return _ranks(model, name or body.__name__, body, kw)
            return body(**kw)

        cmd.__signature__ = inspect.Signature(params)
        cmd.__doc__, cmd.__name__ = body.__doc__, body.__name__
        app.command(name, cls=_Command)(cmd)
        return body

    return deco


def _emitter(json_out: bool):
    from .distributed import current
    from .events import JsonEmitter, null_emit

    if current().quiet:  # rank 0 shows the run's progress
        return null_emit
    return JsonEmitter() if json_out else _progress()


def _progress():
    """Progress on stderr: rich's bar on a terminal; in a log (nohup, Slurm, a pipe: rich would
    hide its bar there) plain lines, a line per layer and one every 30 s of bytes, each flushed."""
    from .events import LogEmitter, RichEmitter

    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return RichEmitter(_console(stderr=True)) if tty else LogEmitter(sys.stderr)


INTERRUPTED = (
    "interrupted: nothing is presented as complete; rerun the same command (convert continues with "
    "--resume, `quantize run` keeps its finished stages, the others start over with --overwrite)"
)


def _run(fn, *args, settle: bool = True, **kwargs):
    """Call a library function; a user error becomes one line on stderr and a non-zero exit (a
    rank that --nproc started hands the line to its launcher, which prints the first rank's).
    ``settle``: the command's modules are imported by now, so the garbage collector that ``main``
    held off runs again from here (quantize.startup); False for a call before the command's own
    imports, or for a library function that settles itself later."""
    from .distributed import report, report_error

    if settle:
        startup.settle()
    try:
        return fn(*args, **kwargs)
    except QuantizeError as e:
        report_error(e)
        raise typer.Exit(e.exit_code)
    except KeyboardInterrupt:
        report(INTERRUPTED, 130)
        raise typer.Exit(130)


def _ranks(model: type, name: str, body, kw: dict):
    """A command that may run as several ranks (docs/distributed.md): ``--nproc N`` outside
    torchrun starts N ranks of this same command line under torchrun and exits with the first
    failed rank's code; under torchrun (ours or the user's) each rank joins the process group
    (``--dist-timeout-s`` on every wait), rank 0 alone prints, and the library function runs in
    every rank. One process: the body, as before."""
    import contextlib
    import os

    from . import distributed as D

    nproc, timeout = kw["nproc"], kw["dist_timeout_s"]
    _run(model(nproc=nproc, dist_timeout_s=timeout).validate, settle=False)  # before any rank starts
    if not D.under_torchrun() or _run(D.env_size, settle=False) == 1:
        if nproc > 1 and not D.under_torchrun():
            raise typer.Exit(D.launch("quantize.cli", _ARGV, nproc, interrupted=INTERRUPTED))
        return body(**kw)
    local = _run(D.env_local_size, settle=False)
    if nproc not in (1, local):
        _refuse(f"--nproc {nproc} under torchrun, which started {local} rank(s) on this node; drop --nproc "
                "(torchrun's --nproc-per-node decides)")
    if name not in D.RANK_AWARE:
        _refuse(f"{name} does not split its work across ranks yet: every rank would run the whole job (and write "
                "the same output); run it as one process (without --nproc or torchrun)")
    # NCCL (a GPU per rank) only for --device cuda: a CPU run on a GPU node meets on gloo, as anywhere else
    w = _run(D.join, timeout, "nccl" if str(kw.get("device") or "cpu").startswith("cuda") else "gloo", settle=False)
    try:
        if not w.quiet:
            return body(**kw)
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            return body(**kw)
    finally:
        D.leave()


def _refuse(msg: str, error: type = QuantizeError):
    """A refusal found here (not in a library call): one line and the error's exit code."""

    def fail():
        raise error(msg)

    _run(fail)


def _bytes(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def _table(title: str, columns, rows):
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*r)
    return t


def _console(stderr: bool = False):
    """rich's Console at the terminal's width, or 120 columns in a log (rich's own default there is
    80, which squeezes the bars and tables)."""
    import os

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(stderr=stderr, width=None if tty or os.environ.get("COLUMNS") else 120)


def _print(*things) -> None:
    c = _console()
    for t in things:
        c.print(t)


def _rate(gbps: float) -> str:
    """Convert's rate for its last line: GB/s, or MB/s below 0.0005 GB/s (a small model on a slow
    machine), so it never reads 0.000; nothing when no time was measured."""
    if gbps <= 0:
        return ""
    return f" ({gbps:.3f} GB/s)" if gbps >= 0.0005 else f" ({gbps * 1e3:.3f} MB/s)"


@command(O.ConvertOptions, json_help="NDJSON progress events on stdout instead of a progress bar")
def convert(json_out: bool, **options):
    """Convert a checkpoint to group-wise symmetric INT4, streaming tensor by tensor (a data-aware
    --method first runs layer by layer over calibration text)."""
    from .convert import convert as run_convert

    res = _run(run_convert, emit=_emitter(json_out), **options, settle=False)
    if json_out:
        return
    err = (
        f", weight rel. error mean {res.mean_rel_err:.4f} max {res.max_rel_err:.4f}"
        if res.mean_rel_err is not None
        else ""
    )
    kept = f"; {res.resumed_shards} shards kept from the interrupted run" if res.resumed_shards else ""
    _print(
        f"[bold green]done[/] {res.out}: {_bytes(res.source_bytes)} -> {_bytes(res.output_bytes)} in "
        f"{res.seconds:.1f} s"
        + _rate(res.gbps)
        + f"; {res.tensors_int4} {'FP8 block' if res.plan['options'].get('scheme') == 'fp8-block' else 'INT4'} "
        f"tensors quantized{err}"
        + (f"; {res.passed_through} INT4 tensors passed through bit for bit" if res.passed_through else "")
        + kept
    )
    m = res.method
    if not m:
        return
    rows = []
    for r in m["layers"]:
        tpe = r.get("tokens_per_expert")
        rows.append(
            (
                str(r["layer"]),
                str(r["units"]),
                f"{tpe['min']} / {tpe['median']:g} / {tpe['max']}" if tpe else "-",
                str(len(r.get("fallbacks", []))),
                ("-" if r.get("loss_rtn") is None else f"{r['loss_rtn']:.4g}") + f" -> {r['loss']:.4g}"
                if r.get("units") else "-",
                f"{r['seconds']:.1f}",
            )
        )
    _print(
        _table(
            f"{m['method']} on the {m['grid']} grid, g{m['group_size']}: {m['samples']} samples ({m['tokens']} tokens) "
            f"of {m['data']}",
            (
                "layer",
                "INT4 weights",
                "tokens per expert min / median / max",
                "RTN fallbacks",
                "loss RTN -> method",
                "seconds",
            ),
            rows,
        )
    )
    if m["rtn"]:
        _print(
            f"[yellow]{len(m['rtn'])} INT4 weights quantized RTN[/], e.g. {m['rtn'][0]['name']} "
            f"({m['rtn'][0]['reason']}); all named in quantize_manifest.json (method.rtn)"
        )


@command(O.PlanOptions, json_help="print one JSON object")
def plan(json_out: bool, **options):
    """Show what convert would do, from headers (or config.json alone); reads no tensor data.
    Includes KV-cache bytes per token and tokens per GPU for BF16 and FP8 caches."""
    from .plan import plan as run_plan

    s = _run(run_plan, **options).summary()
    if json_out:
        typer.echo(json.dumps(s, indent=1))
        return
    tp = options["tp"]
    kv, kin = s["kv_bytes_per_token"], s["kv_capacity_inputs"]
    _print(
        _table(
            f"{s['architecture']} ({s['source_format']}) -> "
            + ("FP8 block 128x128" if s["options"].get("scheme") == "fp8-block"
               else f"W4AFP8 (INT4 g{s['options']['group_size']} experts, FP8 activations; "
               f"{s['options'].get('engine')})" if s["options"].get("scheme") == "w4afp8"
               else f"INT4 g{s['options']['group_size']}")
            + f", profile {s['options']['profile']}",
            ("role", "jobs"),
            [(role, ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))) for role, kinds in s["roles"].items()],
        ),
        f"source {_bytes(s['source_bytes'])} -> output {_bytes(s['output_bytes'])}",
        f"per GPU at TP{tp}: largest rank {_bytes(s['per_rank_source_bytes'])} -> {_bytes(s['per_rank_output_bytes'])} "
        f"(replicated tensors counted on every rank); even split {_bytes(s['even_split_source_bytes'])} -> "
        f"{_bytes(s['even_split_output_bytes'])}",
        f"ignore: {s['ignore']}",
        f"KV cache ({kin['layout']}, {kin['layers']} layers, per GPU at TP{tp}): BF16 {kv['bf16']:,} B/token -> "
        f"{s['kv_tokens_per_gpu']['bf16']:,} tokens; FP8 {kv['fp8']:,} B/token -> {s['kv_tokens_per_gpu']['fp8']:,} "
        "tokens "
        f"(GPU {kin['gpu_mem_gib']} GiB x {kin['mem_fraction']} - weights {kin['weights_per_rank_gib']} GiB - reserve "
        f"{kin['reserve_gib']} GiB)",
    )


@command(
    O.ShardOptions,
    "shard",
    json_help="print the result as JSON",
    extra=(("merge", bool, typer.Option(False, "--merge", help="reassemble MODEL (a sharded folder) into OUT")),),
)
def shard_cmd(json_out: bool, merge: bool, **options):
    """Split a converted checkpoint by the TP plan into a verification layout (rank-RR/part-PPP.safetensors
    and shard_manifest.json; not an engine load format), group-aligned, checked against the serving
    kernels' shape rules before anything is written; --merge restores the folder byte for byte."""
    from . import shard as sh

    if merge:
        res = _run(sh.merge, options["model"], options["out"], overwrite=options["overwrite"], emit=_emitter(json_out))
        typer.echo(json.dumps(res) if json_out else f"merged {res['tensors']} tensors into {res['out']}")
        return
    m = _run(sh.shard, **options, emit=_emitter(json_out))
    if json_out:
        typer.echo(json.dumps({"tp": m["tp"], "rank_bytes": m["rank_bytes"]}))
    else:
        typer.echo(
            f"TP {options['tp']}: {len(m['tensors'])} tensors; bytes per rank: "
            + ", ".join(_bytes(b) for b in m["rank_bytes"])
        )


ENGINE_HELP = (
    "vllm: instead of the static checks, load MODEL in vLLM itself, generate greedy tokens on fixed prompts "
    "and compare them and their log-probs with transformers on the same weights; exit 1 on a mismatch, 2 when "
    "vLLM cannot serve it here"
)


@command(
    O.CheckOptions,
    "check",
    models=(O.EngineCheckOptions,),
    json_help="print the report as JSON",
    extra=(("engine", Optional[str], typer.Option(None, "--engine", help=ENGINE_HELP)),),
)
def check_cmd(json_out: bool, engine: str | None, engine_python, engine_tolerance, **options):
    """Run the packed INT4 kernels on what was written against references; exit 1 on any failure.
    With --engine vllm: the checkpoint served by vLLM against transformers (docs/vllm-cpu.md)."""
    _run(O.validate, O.EngineCheckOptions(engine_python=engine_python, engine_tolerance=engine_tolerance), settle=False)
    if engine is None and (engine_python is not None or engine_tolerance != O.ENGINE_TOLERANCE):
        _refuse("--engine-python/--engine-tolerance are options of --engine vllm; add --engine vllm or drop them")
    if engine is not None:  # the engine check replaces the static checks
        if engine != "vllm":
            _refuse(f"--engine {engine}: unknown engine; the one supported is vllm")
        if options["tp"] is not None or options["source"] is not None:
            _refuse(
                "--engine with --tp/--source: the engine check replaces the static checks; run `quantize check` "
                "without --engine for those"
            )
        return _engine_check(options["model"], engine_python, engine_tolerance, json_out)
    from .check import check as run_check
    from .check import proven_parts
    from .events import null_emit

    rep = _run(run_check, **options, emit=null_emit if json_out else _emitter(False))
    if json_out:  # signed as every report is: `quantize card --eval` takes it only as written
        from .check import REPORT_KIND
        from .checkpoint.output import signed_json

        typer.echo(signed_json(rep.to_dict(), REPORT_KIND))
    else:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        rows = [
            (
                role,
                str(d["tensors"]),
                str(d["failed"]),
                fmt(d["max_kernel_rel_err"], ".2e"),
                fmt(d["max_source_rel_err"], ".4f"),
                fmt(d["min_snr_db"], ".1f"),
                fmt(d["max_shard_err"], ".1e"),
            )
            for role, d in rep.summary().items()
        ]
        _print(
            _table(
                f"check {options['model']}" + (f" (sharded, TP {rep.tp})" if rep.sharded else ""),
                ("role", "tensors", "failed", "kernel rel. err", "source rel. err", "min SNR dB", "shard err"),
                rows,
            )
        )
        v = rep.verified
        if v:
            files = (f"{v['files_unrecorded']} weight files as the vendor shipped them (no quantize manifest to "
                     "prove them against)" if "files_unrecorded" in v
                     else f"{v.get('files_sha256', 0)} files by SHA-256 against the manifest")
            _print("proven: " + "; ".join([files, *proven_parts(v)]))
        for f in rep.failures[:20]:
            typer.echo(f"FAIL {f}", err=True)
        n = sum(d["tensors"] for d in rep.summary().values())
        what = f"{options['model']}" + (f" (TP {rep.tp} shards)" if rep.sharded else "")
        typer.echo(f"check passed: {what}, {n} tensors" if rep.ok else
                   f"check FAILED: {what}, {len(rep.failures)} failure(s) of {n} tensors (listed above)")
    if not rep.ok:
        raise typer.Exit(1)


def _engine_check(model: Path, engine_python, tolerance: float, json_out: bool) -> None:
    from .engines.vllm import engine_check
    from .errors import CheckFailed

    erep = _run(engine_check, model, engine_python=engine_python, tolerance=tolerance)
    if json_out:
        typer.echo(json.dumps(erep.to_dict(), indent=1))
    else:
        mods = erep.modules or {}
        parts = [f"{k} ({n} linear)" for k, n in (mods.get("linear") or {}).items()]
        parts += [f"attention {k} ({n})" for k, n in (mods.get("attention") or {}).items()]
        parts += [f"MoE {k} ({n})" for k, n in (mods.get("moe") or {}).items()]
        typer.echo(
            f"vLLM {erep.vllm_version} ({erep.platform}, {erep.dtype}, KV cache {erep.kv_cache_dtype}) on {model}: "
            + "; ".join(parts)
        )
        typer.echo(f"vLLM's log: {', '.join(erep.kernels) or 'no kernel line'}")
        for i, r in enumerate(erep.prompts):
            same = sum(a == b for a, b in zip(r.token_ids, r.reference_argmax))
            typer.echo(
                f"prompt {i} {r.prompt[:40]!r}: {len(r.token_ids)} tokens, {same} equal to transformers' greedy "
                f"token, max |diff log-prob| {r.max_abs_diff:.4f}"
            )
        for t in erep.ties:
            typer.echo(f"tie {t}")
        for n in erep.notes:
            typer.echo(f"note: {n}")
        mx = "-" if erep.max_abs_diff is None else f"{erep.max_abs_diff:.4f} (mean {erep.mean_abs_diff:.4f})"
        typer.echo(
            f"vLLM vs transformers (fp32, same weights): max |diff log-prob| {mx}, tolerance {erep.tolerance}: "
            + ("pass" if erep.ok else "FAIL")
        )
    if not erep.ok:
        _refuse(
            f"{model}: vLLM disagrees with transformers on the same weights: {erep.failures[0]} "
            f"({len(erep.failures)} failures; max |diff log-prob| {erep.max_abs_diff:.4f}, tolerance {erep.tolerance})",
            CheckFailed,
        )


@command(O.CalibrateKVOptions, "calibrate-kv", json_help="print the report as JSON")
def calibrate_kv_cmd(json_out: bool, **options):
    """What FP8 (e4m3) does to the KV cache, layer by layer, and what each engine can use of it;
    writes scales or a folded model where that is what the engine needs."""
    from .calibrate.kv import calibrate_kv

    res = _run(calibrate_kv, **options, emit=_emitter(False) if not json_out else (lambda e: None))
    if json_out:
        typer.echo(json.dumps(res.to_dict(), indent=1))
        return
    from .archs import attention_layout

    layout = attention_layout(res.layout)  # its report's columns and cells: no branch on the layout here
    cols = layout.report_columns(bool(res.fold))
    rows = [layout.report_cells(r, res.fold[i] if res.fold else None) for i, r in enumerate(res.layers)]
    _print(
        _table(
            f"KV cache ({res.layout}) of {options['model']}: {res.samples} samples, {res.tokens} tokens"
            + (f", {res.dropped_short} too short" if res.dropped_short else ""),
            cols,
            rows,
        ),
        res.verdict,
    )
    for f in res.fold:
        for note in f["notes"]:
            _print(f"[yellow] !! layer {f['layer']}: {note}")
    if res.out:
        what = "tensors folded" if options["fold"] else f"scale tensors ({res.target} names)"
        _print(f"wrote {len(res.written)} {what} into {res.out}")
    if res.stats_path:
        _print(f"statistics: {res.stats_path}")


def _required(name: str, value) -> None:
    if value is None:
        typer.echo(f"error: --{name.replace('_', '-')} is required", err=True)
        raise typer.Exit(2)


@command(O.EvalOptions, "eval", json_help="print the report as JSON")
def eval_cmd(json_out: bool, **options):
    """Baseline against candidate: lm-eval tasks on the same items with paired 95% CIs and a gate:
    exit 1 when a task fails it; --kld-out adds KL divergence from the same runs (several candidates:
    `quantize eval-kld`; the prefill/decode pair: `quantize eval-pd`.)"""
    from .evaluate.run import evaluate
    from .evaluate.smoke import is_smoke, smoke_note

    _required("baseline", options["baseline"])
    _required("candidate", options["candidate"])
    rep = _run(evaluate, **options)
    if json_out:
        typer.echo(json.dumps(rep.to_dict(), indent=1))
    else:
        rows = [
            (
                r.task,
                str(r.n),
                f"{r.baseline:.2f} ± {r.baseline_stderr:.2f}",
                f"{r.candidate:.2f} ± {r.candidate_stderr:.2f}",
                f"{r.delta:+.2f}",
                f"({r.ci_low:+.2f}, {r.ci_high:+.2f})",
                "[red]FAIL[/]" if not r.passed else "[yellow]pass, smoke[/]" if is_smoke(r.n) else (
                    "pass" if r.conclusive else "[yellow]pass, inconclusive[/]"),
            )
            for r in rep.tasks
        ]
        limit = options["limit"]
        _print(
            _table(
                f"{options['candidate']} vs {options['baseline']}" + (f" (limit {limit})" if limit else ""),
                ("task", "n", "baseline", "candidate", "delta", "95% CI", "gate"),
                rows,
            )
        )
        if rep.kld is not None:
            k = rep.kld
            typer.echo(f"KL divergence {k.kld_mean:.5f} ({k.estimator}, {k.tokens:,} tokens), top-1 agreement "
                       f"{k.top1_agreement:.4f}, perplexity {k.ppl_baseline:.3f} -> {k.ppl_candidate:.3f}"
                       + (f"; KL gate {k.gate['verdict']}" if k.gate is not None else ""))
        wrote = [str(options[k]) for k in ("out", "markdown", "kld_out", "save_baseline") if options[k] is not None]
        if options["save_baseline"] is not None and options["kld_out"] is not None:
            from .evaluate.run import kld_baseline_file

            wrote.append(f"{kld_baseline_file(options['save_baseline'])} (the saved baseline's KL side)")
        smoke = smoke_note([r.n for r in rep.tasks])  # a smoke test never concludes (evaluate/smoke.py)
        kl_failed = rep.kld is not None and rep.kld.gate is not None and not rep.kld.gate["passed"]
        typer.echo(f"{'FAIL' if not rep.passed else f'pass ({smoke})' if smoke else 'pass'}"
                   f"{' (the KL / flip gate)' if kl_failed else ''}: {len(rep.tasks)} "
                   f"task(s), gate max drop "
                   f"{options['max_drop']:g} points; " + (f"wrote {', '.join(wrote)}" if wrote else "no report written "
                                                           "(--out FILE keeps one)"))
    if rep.log:
        typer.echo(f"lm-eval's and transformers' output: {rep.log} (--verbose shows it)", err=True)
    if not rep.passed:  # the gate's exit code: decided here, once, after the report is out
        raise typer.Exit(1)


@command(O.KLDOptions, "eval-kld", json_help="print the report as JSON")
def eval_kld_cmd(json_out: bool, **options):
    """Next-token KL divergence, top-1 agreement and perplexity of each candidate against the
    baseline on the same text (repeat --candidate for one table)."""
    from .evaluate.kld import kld_table

    from .evaluate.kld import gate_failures

    table = _run(kld_table, **options)
    if table.log:
        typer.echo(f"transformers' own output: {table.log} (--verbose shows it)", err=True)
    try:
        _kld_output(json_out, options, table)
    finally:  # the gate's exit code, after the figures are out: one line per candidate over a bound
        failed = gate_failures(table.reports)
        for line in failed:
            typer.echo(f"gate FAILED: {line}", err=True)
        if not failed and table.reports[0].gate is not None:  # stderr beside --json: stdout is the JSON alone
            typer.echo("gate passed: " + "; ".join(f"{r.candidate}: {r.gate['verdict'][len('pass: '):]}"
                                                    for r in table.reports), err=json_out)
    if failed:
        raise typer.Exit(1)


def _kld_output(json_out: bool, options: dict, table) -> None:
    if json_out:
        typer.echo(json.dumps(table.to_dict() if len(table.reports) > 1 else table.reports[0].to_dict(), indent=1))
        return
    first = table.reports[0]
    if first.tokens < options["tokens"]:
        typer.echo(f"note: the text holds {first.tokens:,} tokens to score, fewer than --tokens {options['tokens']:,}; "
                   "pass a longer --text for more", err=True)
    tail = f"wrote {options['out']}" if options["out"] is not None else "no report written (--out FILE keeps one)"
    if len(table.reports) == 1:
        rep = table.reports[0]
        est = (f" ({rep.estimator}; a lower bound of the full KL)" if rep.estimator != "full vocabulary"
               else f" (full vocabulary; the served top-{rep.top_k} estimate would be {rep.kld_topk_mean:.5f})")
        typer.echo(
            f"{rep.tokens} tokens: KLD mean {rep.kld_mean:.5f}{est}, median {rep.kld_median:.5f}, p99 "
            f"{rep.kld_p99:.4f}, p99.9 {rep.kld_p999:.4f}, max {rep.kld_max:.4f}; same top-1 {rep.top1_agreement:.2%}; "
            f"PPL {rep.ppl_baseline:.3f} -> {rep.ppl_candidate:.3f} (x{rep.ppl_ratio:.4f}); {tail}"
        )
        return
    first = table.reports[0]
    rows = [
        (
            r.candidate,
            f"{r.kld_mean:.5f}",
            f"{r.kld_median:.5f}",
            f"{r.kld_p99:.4f}",
            f"{r.kld_p999:.4f}",
            f"{r.kld_max:.4f}",
            f"{r.top1_agreement:.2%}",
            f"{r.ppl_baseline:.3f} -> {r.ppl_candidate:.3f}",
            f"{r.kld_mean / first.kld_mean:.3f}" if first.kld_mean else "-",
        )
        for r in table.reports
    ]
    _print(
        _table(
            f"KL divergence against {table.baseline}: {first.tokens} tokens of {first.text}, chunks of {first.chunk}",
            ("candidate", "KLD mean", "median", "p99", "p99.9", "max", "same top-1", "PPL", "KLD / first"),
            rows,
        )
    )
    typer.echo(f"{len(table.reports)} candidates, KL {first.estimator}; {tail}")


@command(O.PDOptions, "eval-pd", json_help="print the report as JSON")
def eval_pd_cmd(json_out: bool, **options):
    """Prefill/decode fidelity as deployed: the prompt's KV cache from --prefill-model, stored as the
    decode pool stores it, decoded by --decode-model; KLD/top-1 against --source alone, beside the
    decode model alone."""
    from .evaluate.pd import pd_fidelity

    for name in ("prefill_model", "decode_model", "source"):
        _required(name, options[name])
    prep = _run(pd_fidelity, **options)
    if json_out:
        typer.echo(json.dumps(prep.to_dict(), indent=1))
        return
    rows = [
        (r.name, f"{r.kld_mean:.5f}", f"{r.kld_p99:.4f}", f"{r.kld_max:.4f}", f"{r.top1_agreement:.2%}")
        for r in prep.rows
    ]
    _print(
        _table(
            f"prefill {options['prefill_model']} -> decode {options['decode_model']}, against {options['source']} "
            f"alone: {options['prompt_tokens']} prompt + {options['decode_tokens']} decoded tokens, cache "
            f"{options['kv_cache_dtype']} ({prep.layout})",
            ("", "KLD mean", "KLD p99", "KLD max", "same top-1"),
            rows,
        )
    )
    typer.echo(f"stored: {prep.stored}")


@app.command("list-archs", cls=_Command)
def list_archs():
    """Architectures the registry knows."""
    from .archs import REGISTRY

    for a in REGISTRY.values():
        typer.echo(f"{a.name:12s} {', '.join(a.architectures)}  -- {a.notes}")


OVERRIDE_HELP = (
    "config KEY=VALUE (VALUE parsed as JSON, else a string); repeatable, e.g. --override kv_lora_rank=512 "
    "(Kimi: applies to text_config)"
)


@command(
    O.MakeTinyOptions,
    "make-tiny",
    extra=(("override", Optional[list[str]], typer.Option(None, "--override", help=OVERRIDE_HELP)),),
)
def make_tiny(override: list[str] | None, **options):
    """Write a tiny checkpoint of a real architecture (transformers classes, vendor FP8 layout)."""
    from .testing.tiny import make_tiny as run
    from .testing.tiny import parse_overrides

    overrides = _run(parse_overrides, override or [], settle=False)
    out = _run(run, **options, overrides=overrides or None)
    typer.echo(f"wrote a tiny {options['arch']} checkpoint ({options['layout']} layout) to {out}")


@command(O.DemoOptions, json_help="NDJSON progress events on stdout")
def demo(json_out: bool, out: Path):
    """The tiny GLM-5 (block FP8) and Kimi K2.6 (Moonshot's INT4) releases -> the decode artifact
    (W4A16 g32), and Kimi's prefill artifact (FP8 block), one after the other (the main job, with
    every stage, is `quantize run`)."""
    from .convert import convert as run_convert
    from .testing.tiny import make_tiny as mk

    for arch, name, kw in (("glm_moe_dsa", "w4a16-g32", {}), ("kimi_k25", "w4a16-g32", {}),
                           ("kimi_k25", "fp8-block", {"scheme": "fp8-block", "profile": "all-linear"})):
        src = out / f"{arch}-vendor"
        if not (src / "quantize_manifest.json").exists():  # a finished make-tiny output
            _run(mk, arch, src, overwrite=True)
        typer.echo(f"== {arch}: {src} -> {out / (arch + '-' + name)}", err=True)
        res = _run(run_convert, src, out / f"{arch}-{name}", overwrite=True, emit=_emitter(json_out), **kw)
        err = f", mean rel. error {res.mean_rel_err:.4f}" if res.mean_rel_err is not None else ""
        typer.echo(
            f"   {res.tensors_int4} {'FP8 block' if kw else 'INT4'} tensors quantized"
            + (f", {res.passed_through} INT4 tensors passed through bit for bit" if res.passed_through else "")
            + f", {_bytes(res.source_bytes)} -> {_bytes(res.output_bytes)}{err}",
            err=True,
        )
    typer.echo(f"demo: wrote {out / 'glm_moe_dsa-w4a16-g32'}, {out / 'kimi_k25-w4a16-g32'} and "
               f"{out / 'kimi_k25-fp8-block'} (the main job, with every stage: `quantize run`)")


def _run_publish(fn, interrupted: str, **kwargs):
    """``_run`` for card and push, whose interruption needs no --resume (neither has one)."""
    try:
        return fn(**kwargs)
    except QuantizeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo(f"interrupted: {interrupted}", err=True)
        raise typer.Exit(130)


@command(O.CardOptions, "card")
def card_cmd(**options):
    """Write DIR/README.md, the model card, from the folder's own records: metadata for the Hub
    (base_model, licence carried from the source's card, model-index from the eval reports), how it
    was made, the quantization, KV-cache, check and eval results, and launch lines."""
    from .publish.card import card

    res = _run_publish(
        card, "README.md is the earlier card or the new one, never half of one; rerun the same command", **options
    )
    for n in res.notes:
        typer.echo(f"note: {n}", err=True)
    typer.echo(f"wrote {res.path}" + (f" ({', '.join(r['kind'] for r in res.reports)} reports)" if res.reports else ""))


@command(O.PushOptions, "push")
def push_cmd(**options):
    """Check DIR (every index entry, config.json, every file's SHA-256 against the manifest) and
    upload it to the Hub, with its card; an interrupted push resumes without resending finished
    files. The token (HF_TOKEN or `hf auth login`) is never printed."""
    from .publish.push import push

    def emit(e: dict) -> None:
        if e.get("event") == "start":
            typer.echo(
                f"{e['files']} files ({_bytes(e['bytes'])}) to upload in {e['commits']} commit(s); {e['skipped']} "
                "already on the Hub",
                err=True,
            )
        elif e.get("event") == "commit":
            typer.echo(
                f"commit {e['index']}/{e['of']}: {e['files']} files, {_bytes(e['bytes'])} ({e['oid'][:12]})", err=True
            )
        elif e.get("event") == "error":
            typer.echo("", err=True)  # the upload's progress bar may have left its line open

    res = _run_publish(
        push,
        "what was committed stays on the Hub; rerun the same command to continue (finished files are not sent again)",
        **options,
        emit=emit,
    )
    repo_id, create_pr = options["repo_id"], options["create_pr"]
    w = max([len(f.path) for f in res.files] + [4])
    if res.dry_run:
        for f in res.files:
            typer.echo(f"{f.path:<{w}}  {f.bytes:>14,} B")
    typer.echo(res.card)
    if res.not_uploaded:
        typer.echo(f"not uploaded (the manifest does not prove them): {', '.join(res.not_uploaded)}", err=True)
    for warning in res.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if res.dry_run:  # the verdict, last
        typer.echo(
            f"{len(res.files)} files, {res.total_bytes:,} bytes ({_bytes(res.total_bytes)}) would go to "
            f"{repo_id}@{res.revision}"
            + (" as a pull request" if create_pr else "")
            + "; nothing was sent"
        )
    else:
        where = res.pr_url or f"{res.url or repo_id}" + (f" (branch {res.revision})" if res.revision != "main" else "")
        typer.echo(
            f"pushed {sum(f.status == 'uploaded' for f in res.files)} files ({_bytes(res.sent_bytes)}) in "
            f"{len(res.commits)} commit(s); "
            f"{sum(f.status == 'on the Hub already' for f in res.files)} already on the Hub: {where}"
        )


@command(O.RunOptions, "run", json_help="NDJSON events on stdout (with --plan: one JSON object)")
def run_cmd(json_out: bool, recipe, out, source, data, data_dir, sets, plan: bool, overwrite: bool):
    """convert -> calibrate-kv -> shard/check -> eval -> card -> push from one recipe, resumable
    stage by stage; a failed check or eval gate stops before push with exit 1."""
    from .pipeline import run

    if plan:
        res = _run(run, recipe, out=out, source=source, data=data, data_dir=data_dir, sets=sets, plan=True,
                   overwrite=overwrite)
        if json_out:
            typer.echo(json.dumps(res.to_dict(), indent=1))
            return
        from rich.table import Table

        t = Table(title=f"quantize run --plan: {res.recipe} -> {res.out}")
        for c in ("stage", "state", "what it does", "why"):
            t.add_column(c)
        colour = {"done": "green", "skipped": "green", "stale": "yellow", "pending": "cyan", "failed": "red"}
        for s in res.stages:
            t.add_row(s.stage, f"[{colour.get(s.state, 'white')}]{s.state}[/]", s.does, s.why or s.summary)
        _console().print(t)
        return
    if json_out:
        from .events import JsonEmitter

        emit = JsonEmitter()
    else:
        console = _console(stderr=True)
        inner = _progress()

        def emit(e: dict) -> None:
            if e.get("event") != "stage":
                if "in_stage" in e:
                    inner(e)
                return
            st, name = e.get("state"), e.get("stage")
            if e.get("kept"):
                console.print(
                    f"[green]= {name}[/]: {st}, kept from the run's record"
                    + (f" ({e['summary']})" if e.get("summary") else "")
                )
            elif st == "start":
                console.rule(f"[bold]{name}[/]")
                console.print(f"{e.get('does', '')}" + (f"  [dim]({e['why']})[/]" if e.get("why") else ""))
            elif st in ("done", "skipped"):
                inner.stop()
                console.print(f"[green]{name} {st}[/] in {e.get('seconds', 0):.1f} s: {e.get('summary', '')}")
            elif st in ("failed", "error"):
                inner.stop()
                console.print(f"[red]{name} {st}[/]: {e.get('error', '')}")

    class Interrupted(QuantizeError):
        exit_code = 130

    def run_interruptible(*a, **kw):
        try:
            return run(*a, **kw)
        except KeyboardInterrupt:
            raise Interrupted(
                "interrupted: finished stages are kept in the run's record; rerun the same `quantize run` to continue "
                "(the interrupted stage continues, convert with --resume)"
            ) from None

    res = _run(run_interruptible, recipe, out=out, source=source, data=data, data_dir=data_dir, sets=sets, plan=False,
               overwrite=overwrite, emit=emit)
    if json_out:
        typer.echo(json.dumps({"event": "result", **res.to_dict()}))
        return
    from rich.table import Table

    t = Table(title=f"quantize run: {res.out} ({res.seconds:.1f} s)")
    for c in ("stage", "state", "seconds", "result"):
        t.add_column(c)
    for s in res.stages:
        t.add_row(s.stage, s.state, "-" if s.seconds is None else f"{s.seconds:.1f}", s.summary)
    _console().print(t)
    typer.echo(_run_verdict(res))


def _run_verdict(res) -> str:
    """The run's last line: what it did and where its products are."""
    out = Path(res.out)
    n = {st: sum(s.state == st for s in res.stages) for st in ("done", "ran", "skipped")}
    made = [f"{what}: {out / sub}" for what, sub in (("the model and its card", "model"), ("folded model", "model-kv"),
                                                      ("reports", "reports"), ("prefill artifact", "prefill"))
            if (out / sub).exists()]
    skipped = f", {n['skipped']} skipped" if n["skipped"] else ""
    # the eval stage's verdict said smoke (evaluate/smoke.py): the run passed a smoke test, not a measurement
    smoke = res.ok and any(s.stage == "eval" and "(smoke: " in (s.summary or "") for s in res.stages)
    return (f"quantize run {'passed' if res.ok else 'stopped'}{' (eval: a smoke test)' if smoke else ''} in "
            f"{res.seconds:.1f} s "
            f"({n['done'] + n['ran']} stages done{skipped}); " + "; ".join(made))


def main():  # pragma: no cover
    from .distributed import end_process

    startup.hold()  # no collections while the command imports torch and the rest (quantize/startup.py)
    try:
        app()
    except SystemExit as e:  # a rank of several ends here, without the interpreter's teardown
        if e.code is None or isinstance(e.code, int):
            end_process(e.code)
        raise
    end_process(0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
