"""The ``quantize`` command line: each command parses, calls one library function with the same
parameter names, and renders its result (rich for people, ``--json`` NDJSON for machines)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import QuantizeError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline FP8/BF16 -> INT4 (compressed-tensors pack-quantized) for GLM 5.x and Kimi K2.x on SGLang/vLLM.")


def _emitter(json_out: bool):
    from .events import JsonEmitter, RichEmitter

    return JsonEmitter() if json_out else RichEmitter()


def _run(fn, *args, **kwargs):
    """Call a library function; a user error becomes one line on stderr and a non-zero exit."""
    try:
        return fn(*args, **kwargs)
    except QuantizeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted: nothing is presented as complete; rerun the same command with --resume to continue", err=True)
        raise typer.Exit(130)


def _bytes(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


@app.command()
def convert(
    source: Path = typer.Argument(..., help="source checkpoint folder (block FP8, compressed-tensors FP8, or BF16/FP16)"),
    out: Path = typer.Argument(..., help="output folder (must not exist unless --resume/--overwrite)"),
    group_size: Optional[int] = typer.Option(None, help="INT4 group size along K: 32 (default), 64 or 128"),
    profile: Optional[str] = typer.Option(None, help="experts (default: routed experts INT4, Kimi's layout) or all-linear"),
    observer: Optional[str] = typer.Option(None, help="minmax (default for rtn and gptq, bit-identical to compressed-tensors RTN), mse (clipping search), fullrange (all 16 codes: scale = signed extreme / -8; the default for autoround; negative scales, checked in vLLM CPU, unverified on GPU Marlin/Machete), fullrange-mse"),
    keep_fp8: bool = typer.Option(False, "--keep-fp8", help="leave non-INT4 FP8 weights FP8 (block) instead of BF16"),
    recipe: Optional[str] = typer.Option(None, help="llm-compressor recipe YAML (targets / ignore / group size; a GPTQModifier means --method gptq, an AutoRoundModifier --method autoround)"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run in OUT (same options)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing quantize output in OUT"),
    workers: Optional[int] = typer.Option(None, help="compute threads (default: all cores)"),
    device: str = typer.Option("cpu", help="cpu (default) or cuda: where the transforms (and a method's layer math) run"),
    method: Optional[str] = typer.Option(None, help="rtn (default: round-to-nearest, no data), gptq (llm-compressor's GPTQ update, "
                                         "layer by layer on calibration text) or autoround (signed-gradient rounding and clipping)"),
    data: Optional[str] = typer.Option(None, help="gptq/autoround: calibration text, jsonl/txt/parquet file or folder, or hf:NAME (default: the shipped corpus)"),
    samples: Optional[int] = typer.Option(None, help="gptq/autoround: calibration samples (default 128)"),
    seq_len: Optional[int] = typer.Option(None, help="gptq/autoround: tokens per sample at most (default 2048)"),
    damp: Optional[float] = typer.Option(None, help="gptq: Hessian dampening, a fraction of its mean diagonal (default 0.01)"),
    block: Optional[int] = typer.Option(None, help="gptq: columns per lazy-update block (default 128)"),
    actorder: Optional[str] = typer.Option(None, help="gptq: static (default, llm-compressor's: columns by decreasing Hessian "
                                           "diagonal, groups fixed, format unchanged) or off"),
    iters: Optional[int] = typer.Option(None, help="autoround: signed-gradient steps per layer (default 200; 0 = RTN on the grid)"),
    lr: Optional[float] = typer.Option(None, help="autoround: learning rate, decayed linearly to 0 (default 1/iters)"),
    batch_size: Optional[int] = typer.Option(None, help="autoround: samples per step (default 8)"),
    all_experts: bool = typer.Option(False, "--all-experts", help="gptq/autoround: every routed expert's statistics from every token "
                                     "(the layer output still follows the router)"),
    min_expert_tokens: Optional[int] = typer.Option(None, help="gptq/autoround: an expert routed fewer tokens falls back to RTN, named (default 16)"),
    memory_budget_gib: float = typer.Option(4.0, help="gptq/autoround: calibration hidden states kept in memory; beyond it they go to OUT/.quantize/hidden"),
    json_out: bool = typer.Option(False, "--json", help="NDJSON progress events on stdout instead of a progress bar"),
):
    """Convert a checkpoint to group-wise symmetric INT4, streaming tensor by tensor (a data-aware
    --method first runs layer by layer over calibration text)."""
    from .convert import convert as run_convert

    res = _run(run_convert, source, out, group_size=group_size, profile=profile, observer=observer, keep_fp8=keep_fp8,
               recipe=recipe, resume=resume, overwrite=overwrite, workers=workers, device=device, method=method, data=data,
               samples=samples, seq_len=seq_len, damp=damp, block=block, actorder=actorder, iters=iters, lr=lr, batch_size=batch_size,
               all_experts=all_experts, min_expert_tokens=min_expert_tokens, memory_budget_gib=memory_budget_gib,
               emit=_emitter(json_out))
    if json_out:
        return
    from rich.console import Console

    c = Console()
    c.print(f"[bold green]done[/] {res.out}: {_bytes(res.source_bytes)} -> {_bytes(res.output_bytes)} in {res.seconds:.1f} s "
            f"({res.gbps:.3f} GB/s); {res.tensors_int4} INT4 tensors" +
            (f", weight rel. error mean {res.mean_rel_err:.4f} max {res.max_rel_err:.4f}" if res.mean_rel_err is not None else "") +
            (f"; {res.resumed_shards} shards kept from the interrupted run" if res.resumed_shards else ""))
    if res.method:
        from rich.table import Table

        m = res.method
        t = Table(title=f"{m['method']} on the {m['grid']} grid, g{m['group_size']}: {m['samples']} samples ({m['tokens']} tokens) of {m['data']}")
        for col in ("layer", "INT4 weights", "tokens per expert min / median / max", "RTN fallbacks", "loss RTN -> method", "seconds"):
            t.add_column(col)
        for r in m["layers"]:
            tpe = r.get("tokens_per_expert")
            t.add_row(str(r["layer"]), str(r["units"]), f"{tpe['min']} / {tpe['median']:g} / {tpe['max']}" if tpe else "-",
                      str(len(r.get("fallbacks", []))), f"{r['loss_rtn']:.4g} -> {r['loss']:.4g}" if r.get("units") else "-", f"{r['seconds']:.1f}")
        c.print(t)
        if m["rtn"]:
            c.print(f"[yellow]{len(m['rtn'])} INT4 weights quantized RTN[/], e.g. {m['rtn'][0]['name']} ({m['rtn'][0]['reason']}); "
                    "all named in quantize_manifest.json (method.rtn)")


@app.command()
def plan(
    source: Path = typer.Argument(..., help="checkpoint folder, or a folder / config.json with no weights"),
    tp: int = typer.Option(1, help="tensor parallelism for per-rank bytes"),
    group_size: Optional[int] = typer.Option(None, help="INT4 group size: 32, 64 or 128 (default 32, or the recipe's)"),
    profile: Optional[str] = typer.Option(None, help="experts (default) or all-linear; with --recipe the recipe decides"),
    keep_fp8: bool = typer.Option(False, "--keep-fp8"),
    recipe: Optional[str] = typer.Option(None),
    gpu_mem_gib: Optional[float] = typer.Option(None, help="GPU memory (default: H200, 140.4 GiB)"),
    mem_fraction: Optional[float] = typer.Option(None, help="share for weights + KV cache (default 0.85)"),
    reserve_gib: Optional[float] = typer.Option(None, help="kept free inside that share (default 4 GiB)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
):
    """Show what convert would do, from headers (or config.json alone); reads no tensor data.
    Includes KV-cache bytes per token and tokens per GPU for BF16 and FP8 caches."""
    from .plan import plan as run_plan

    p = _run(run_plan, source, tp=tp, group_size=group_size, profile=profile, keep_fp8=keep_fp8, recipe=recipe,
             gpu_mem_gib=gpu_mem_gib, mem_fraction=mem_fraction, reserve_gib=reserve_gib)
    s = p.summary()
    if json_out:
        typer.echo(json.dumps(s, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    c = Console()
    t = Table(title=f"{s['architecture']} ({s['source_format']}) -> INT4 g{s['options']['group_size']}, profile {s['options']['profile']}")
    t.add_column("role")
    t.add_column("jobs")
    for role, kinds in s["roles"].items():
        t.add_row(role, ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    c.print(t)
    c.print(f"source {_bytes(s['source_bytes'])} -> output {_bytes(s['output_bytes'])}")
    c.print(f"per GPU at TP{tp}: largest rank {_bytes(s['per_rank_source_bytes'])} -> {_bytes(s['per_rank_output_bytes'])} "
            f"(replicated tensors counted on every rank); even split {_bytes(s['even_split_source_bytes'])} -> {_bytes(s['even_split_output_bytes'])}")
    c.print(f"ignore: {s['ignore']}")
    kv, kin = s["kv_bytes_per_token"], s["kv_capacity_inputs"]
    c.print(f"KV cache ({kin['layout']}, {kin['layers']} layers, per GPU at TP{tp}): BF16 {kv['bf16']:,} B/token -> "
            f"{s['kv_tokens_per_gpu']['bf16']:,} tokens; FP8 {kv['fp8']:,} B/token -> {s['kv_tokens_per_gpu']['fp8']:,} tokens "
            f"(GPU {kin['gpu_mem_gib']} GiB x {kin['mem_fraction']} - weights {kin['weights_per_rank_gib']} GiB - reserve {kin['reserve_gib']} GiB)")


@app.command("shard")
def shard_cmd(
    model: Path = typer.Argument(..., help="converted checkpoint (or, with --merge, a sharded folder)"),
    out: Path = typer.Argument(..., help="output folder"),
    tp: int = typer.Option(8, help="tensor-parallel size"),
    merge: bool = typer.Option(False, "--merge", help="reassemble MODEL (a sharded folder) into OUT"),
    max_part_gib: float = typer.Option(5.0, help="largest per-rank part file"),
    overwrite: bool = typer.Option(False, "--overwrite"),
    json_out: bool = typer.Option(False, "--json"),
):
    """Per-rank weights (model-rank-{r}-part-{p}.safetensors), group-aligned, checked against the
    serving kernels' shape rules before anything is written; --merge reverses it."""
    from . import shard as sh

    if merge:
        res = _run(sh.merge, model, out, overwrite=overwrite, emit=_emitter(json_out))
        typer.echo(json.dumps(res) if json_out else f"merged {res['tensors']} tensors into {res['out']}")
        return
    m = _run(sh.shard, model, out, tp=tp, max_part_bytes=int(max_part_gib * 2**30), overwrite=overwrite, emit=_emitter(json_out))
    if json_out:
        typer.echo(json.dumps({"tp": m["tp"], "rank_bytes": m["rank_bytes"]}))
    else:
        typer.echo(f"TP {tp}: {len(m['tensors'])} tensors; bytes per rank: " + ", ".join(_bytes(b) for b in m["rank_bytes"]))


@app.command("check")
def check_cmd(
    model: Path = typer.Argument(..., help="converted checkpoint, or a sharded folder"),
    tp: Optional[int] = typer.Option(None, help="also check the serving kernels' shape rules at this TP"),
    source: Optional[Path] = typer.Option(None, help="source checkpoint (FP8/BF16) for error/SNR, or the unsharded checkpoint of a sharded folder"),
    tokens: int = typer.Option(8, help="random activation rows per kernel check"),
    json_out: bool = typer.Option(False, "--json"),
    engine: Optional[str] = typer.Option(None, "--engine", help="vllm: instead of the static checks, load MODEL in vLLM itself, "
                                         "generate greedy tokens on fixed prompts and compare them and their log-probs with "
                                         "transformers on the same weights; exit 1 on a mismatch, 2 when vLLM cannot serve it here"),
    engine_python: Optional[Path] = typer.Option(None, "--engine-python", help="python of a venv with vLLM (default: "
                                                 "$QUANTIZE_VLLM_PYTHON, else .venv-vllm/bin/python next to this repository)"),
    engine_tolerance: float = typer.Option(0.05, "--engine-tolerance", help="largest |log-prob difference| (nats) allowed between "
                                           "vLLM (fp16) and transformers (fp32) on the same token"),
):
    """Run the packed INT4 kernels on what was written against references; exit 1 on any failure.
    With --engine vllm: the checkpoint served by vLLM against transformers (README: 'A real engine')."""
    if engine is not None:  # the engine check replaces the static checks
        from .engines.vllm import engine_check
        from .errors import CheckFailed

        def refuse(msg):
            raise QuantizeError(msg)

        if engine != "vllm":
            _run(refuse, f"--engine {engine}: unknown engine; the one supported is vllm")
        if tp is not None or source is not None:
            _run(refuse, "--engine with --tp/--source: the engine check replaces the static checks; run `quantize check` without --engine for those")
        erep = _run(engine_check, model, engine_python=engine_python, tolerance=engine_tolerance)
        if json_out:
            typer.echo(json.dumps(erep.to_dict(), indent=1))
        else:
            mods = erep.modules or {}
            parts = [f"{k} ({n} linear)" for k, n in (mods.get("linear") or {}).items()]
            parts += [f"attention {k} ({n})" for k, n in (mods.get("attention") or {}).items()]
            parts += [f"MoE {k} ({n})" for k, n in (mods.get("moe") or {}).items()]
            typer.echo(f"vLLM {erep.vllm_version} ({erep.platform}, {erep.dtype}, KV cache {erep.kv_cache_dtype}) on {model}: " + "; ".join(parts))
            typer.echo(f"vLLM's log: {', '.join(erep.kernels) or 'no kernel line'}")
            for i, r in enumerate(erep.prompts):
                same = sum(a == b for a, b in zip(r.token_ids, r.reference_argmax))
                typer.echo(f"prompt {i} {r.prompt[:40]!r}: {len(r.token_ids)} tokens, {same} equal to transformers' greedy token, "
                           f"max |diff log-prob| {r.max_abs_diff:.4f}")
            for t in erep.ties:
                typer.echo(f"tie {t}")
            for n in erep.notes:
                typer.echo(f"note: {n}")
            mx = "-" if erep.max_abs_diff is None else f"{erep.max_abs_diff:.4f} (mean {erep.mean_abs_diff:.4f})"
            typer.echo(f"vLLM vs transformers (fp32, same weights): max |diff log-prob| {mx}, tolerance {erep.tolerance}: "
                       + ("pass" if erep.ok else "FAIL"))
        if not erep.ok:
            def fail():
                raise CheckFailed(f"{model}: vLLM disagrees with transformers on the same weights: {erep.failures[0]} "
                                  f"({len(erep.failures)} failures; max |diff log-prob| {erep.max_abs_diff:.4f}, tolerance {erep.tolerance})")
            _run(fail)
        return
    from .check import check as run_check
    from .check import proven_parts

    rep = _run(run_check, model, tp=tp, source=source, tokens=tokens)
    if json_out:
        typer.echo(json.dumps(rep.to_dict(), indent=1))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"check {model}" + (f" (sharded, TP {rep.tp})" if rep.sharded else ""))
        for c in ("role", "tensors", "failed", "kernel rel. err", "source rel. err", "min SNR dB", "shard err"):
            t.add_column(c)
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        for role, d in rep.summary().items():
            t.add_row(role, str(d["tensors"]), str(d["failed"]), fmt(d["max_kernel_rel_err"], ".2e"), fmt(d["max_source_rel_err"], ".4f"),
                      fmt(d["min_snr_db"], ".1f"), fmt(d["max_shard_err"], ".1e"))
        c = Console()
        c.print(t)
        v = rep.verified
        if v:
            c.print("proven: " + "; ".join([f"{v.get('files_sha256', 0)} files by SHA-256 against the manifest", *proven_parts(v)]))
        for f in rep.failures[:20]:
            typer.echo(f"FAIL {f}", err=True)
    if not rep.ok:
        raise typer.Exit(1)


@app.command("calibrate-kv")
def calibrate_kv_cmd(
    model: Path = typer.Argument(..., help="checkpoint folder (BF16, block FP8 or a quantize convert output) with its tokenizer"),
    out: Optional[Path] = typer.Option(None, help="new checkpoint: the scales (compressed-tensors target, GQA) or, with --fold, the folded MLA model; without it, the report only"),
    data: Optional[str] = typer.Option(None, help="jsonl/txt/parquet file or folder, or hf:NAME; default: the shipped corpus"),
    samples: int = typer.Option(512),
    seq_len: int = typer.Option(2048),
    target: str = typer.Option("sglang", help="sglang | vllm | compressed-tensors: the engine the artifact is for (MLA on sglang/vllm: unit scale, no scales written)"),
    clip: Optional[float] = typer.Option(None, help="percentile clip (e.g. 0.9999) instead of absmax"),
    fold: bool = typer.Option(False, "--fold", help="MLA: fold the cache range into the weights (exact, powers of two) so the engines' unit-scale FP8 cache is in range"),
    fold_headroom: float = typer.Option(2.0, help="--fold keeps the cache's amax at or below 448 / headroom"),
    stats_out: Optional[Path] = typer.Option(None, help="write per-layer statistics JSON (reusable with --stats)"),
    stats: Optional[Path] = typer.Option(None, help="reuse a --stats-out file instead of recomputing"),
    chat_template: bool = typer.Option(False, "--chat-template", help="wrap each sample in the tokenizer's chat template"),
    overwrite: bool = typer.Option(False, "--overwrite"),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON"),
):
    """What FP8 (e4m3) does to the KV cache, layer by layer, and what each engine can use of it;
    writes scales or a folded model where that is what the engine needs."""
    from .calibrate.kv import calibrate_kv

    res = _run(calibrate_kv, model, out, data=data, samples=samples, seq_len=seq_len, target=target, clip=clip,
               fold=fold, fold_headroom=fold_headroom, stats_out=stats_out, stats=stats, chat_template=chat_template,
               overwrite=overwrite, emit=_emitter(json_out) if not json_out else (lambda e: None))
    if json_out:
        typer.echo(json.dumps(res.to_dict(), indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"KV cache ({res.layout}) of {model}: {res.samples} samples, {res.tokens} tokens"
                    + (f", {res.dropped_short} too short" if res.dropped_short else ""))
    cols = ["layer", "amax", "p99.9", "scale", "overflow@1", "subnormal@1", "zero@1", "overflow@s", "subnormal@s"]
    cols += ["attn err per-128"] if res.layout == "dsa" else ["attn err @1", "attn err @s"]
    cols += ["fold latent", "fold rope", "|q_abs| after", "|q_pe| after"] if res.fold else []
    cols += ["risk"]
    for c in cols:
        t.add_column(c)
    for i, r in enumerate(res.layers):
        row = [str(r.layer), f"{r.amax:.4g}", f"{r.percentile:.4g}", f"{r.scale:.4g}", f"{r.overflow_unit:.1e}", f"{r.subnormal_unit:.2%}",
               f"{r.zero_unit:.2%}", f"{r.overflow_calibrated:.1e}", f"{r.subnormal_calibrated:.2%}"]
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        row += [fmt(r.attn_rel_err_tiles)] if res.layout == "dsa" else [fmt(r.attn_rel_err_unit), fmt(r.attn_rel_err_calibrated)]
        if res.fold:
            f = res.fold[i]
            g = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
            row += [f"x{f['latent']:g}", f"x{f['rope']:g}", g(f["q_absorbed_amax_after"]), g(f["q_pe_amax_after"])]
        row += ["[red]yes[/]" if r.at_risk else "no"]
        t.add_row(*row)
    c = Console()
    c.print(t)
    c.print(res.verdict)
    for f in res.fold:
        for note in f["notes"]:
            c.print(f"[yellow] !! layer {f['layer']}: {note}")
    if res.out:
        what = "tensors folded" if fold else f"scale tensors ({res.target} names)"
        c.print(f"wrote {len(res.written)} {what} into {res.out}")
    if res.stats_path:
        c.print(f"statistics: {res.stats_path}")


@app.command("eval")
def eval_cmd(
    candidate: list[Path] = typer.Option(..., help="the converted model (--kld: repeat to compare several candidates in one table)"),
    baseline: Optional[Path] = typer.Option(None, help="the reference model (FP8/BF16)"),
    tasks: str = typer.Option("gsm8k,arc_easy,arc_challenge,mmlu,mmlu_pro", help="comma-separated lm-eval tasks"),
    limit: Optional[int] = typer.Option(None, help="documents per task (the same for both models)"),
    data_dir: Optional[Path] = typer.Option(None, help="local copies in the layout of ../shared/data (default: the Hub)"),
    max_drop: float = typer.Option(1.0, help="gate: fail a task whose drop exceeds this many points beyond noise"),
    max_gen_toks: Optional[int] = typer.Option(None, help="cap generated tokens (GSM8K, MMLU-Pro) for quick runs"),
    markdown: Optional[Path] = typer.Option(None, help="write the Markdown table (for the model card) here"),
    base_url: Optional[str] = typer.Option(None, help="evaluate the candidate as served by an OpenAI-compatible server (SGLang/vLLM)"),
    baseline_url: Optional[str] = typer.Option(None, help="likewise for the baseline"),
    device: str = typer.Option("cpu", help="where local models run (lm-eval tasks and --kld): cpu or cuda"),
    kld: bool = typer.Option(False, "--kld", help="next-token KL divergence of candidate against baseline instead"),
    text: Optional[Path] = typer.Option(None, help="plain text for --kld (default: shipped text)"),
    tokens: int = typer.Option(8192, help="--kld: tokens of text to score"),
    chunk: int = typer.Option(512, help="--kld: context length per chunk"),
    save_baseline: Optional[Path] = typer.Option(None, help="--kld: save the baseline's log-probs (fp16 safetensors) for reuse"),
    baseline_logits: Optional[Path] = typer.Option(None, help="--kld: reuse a --save-baseline file instead of running the baseline"),
    out: Optional[Path] = typer.Option(None, help="write the report JSON here"),
    pd_prefill: Optional[Path] = typer.Option(None, "--pd-prefill", help="prefill/decode fidelity instead: the prompt's KV cache from this "
                                              "prefill model, stored as the decode pool stores it, decoded by --candidate; KLD/top-1 "
                                              "against --baseline (the source) alone, beside the candidate alone"),
    prompt_tokens: int = typer.Option(256, help="--pd-prefill: prompt tokens the prefill model caches"),
    decode_tokens: int = typer.Option(64, help="--pd-prefill: tokens the decode model scores from that cache"),
    kv_cache_dtype: str = typer.Option("fp8_e4m3", help="--pd-prefill: how the decode pool stores the cache (fp8_e4m3 or bf16)"),
    json_out: bool = typer.Option(False, "--json"),
):
    """Baseline against candidate: lm-eval tasks on the same items with paired CIs and a gate (exit 1
    on failure), or --kld: KL divergence, top-1 agreement, perplexity, or --pd-prefill: the
    prefill/decode pair as deployed."""
    if pd_prefill:
        from .evaluate.pd import pd_fidelity

        if baseline is None:
            typer.echo("error: --pd-prefill needs --baseline (the source model the pair is compared with)", err=True)
            raise typer.Exit(2)
        if len(candidate) != 1:
            typer.echo(f"error: --pd-prefill takes one --candidate (the decode model), got {len(candidate)}", err=True)
            raise typer.Exit(2)
        candidate = candidate[0]
        prep = _run(pd_fidelity, pd_prefill, candidate, baseline, text=text, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                    kv_cache_dtype=kv_cache_dtype, device=device, out=out)
        if json_out:
            typer.echo(json.dumps(prep.to_dict(), indent=1))
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"prefill {pd_prefill} -> decode {candidate}, against {baseline} alone: {prompt_tokens} prompt + "
                        f"{decode_tokens} decoded tokens, cache {kv_cache_dtype} ({prep.layout})")
        for c in ("", "KLD mean", "KLD p99", "KLD max", "same top-1"):
            t.add_column(c)
        for r in prep.rows:
            t.add_row(r.name, f"{r.kld_mean:.5f}", f"{r.kld_p99:.4f}", f"{r.kld_max:.4f}", f"{r.top1_agreement:.2%}")
        Console().print(t)
        typer.echo(f"stored: {prep.stored}")
        return
    if kld:
        from .evaluate.kld import kld_table

        table = _run(kld_table, baseline, candidate, text=text, tokens=tokens, chunk=chunk, save_baseline=save_baseline,
                     baseline_logits=baseline_logits, out=out, device=device)
        if json_out:
            typer.echo(json.dumps(table.to_dict() if len(table.reports) > 1 else table.reports[0].to_dict(), indent=1))
            return
        if len(table.reports) == 1:
            rep = table.reports[0]
            typer.echo(f"{rep.tokens} tokens: KLD mean {rep.kld_mean:.5f}, median {rep.kld_median:.5f}, p99 {rep.kld_p99:.4f}, "
                       f"p99.9 {rep.kld_p999:.4f}, max {rep.kld_max:.4f}; same top-1 {rep.top1_agreement:.2%}; "
                       f"PPL {rep.ppl_baseline:.3f} -> {rep.ppl_candidate:.3f} (x{rep.ppl_ratio:.4f})")
            return
        from rich.console import Console
        from rich.table import Table

        first = table.reports[0]
        t = Table(title=f"KL divergence against {table.baseline}: {first.tokens} tokens of {first.text}, chunks of {first.chunk}")
        for c in ("candidate", "KLD mean", "median", "p99", "p99.9", "max", "same top-1", "PPL", "KLD / first"):
            t.add_column(c)
        for r in table.reports:
            t.add_row(r.candidate, f"{r.kld_mean:.5f}", f"{r.kld_median:.5f}", f"{r.kld_p99:.4f}", f"{r.kld_p999:.4f}", f"{r.kld_max:.4f}",
                      f"{r.top1_agreement:.2%}", f"{r.ppl_baseline:.3f} -> {r.ppl_candidate:.3f}",
                      f"{r.kld_mean / first.kld_mean:.3f}" if first.kld_mean else "-")
        Console().print(t)
        return
    if len(candidate) != 1:
        typer.echo("error: --candidate is repeated; several candidates are compared with --kld only", err=True)
        raise typer.Exit(2)
    candidate = candidate[0]
    if baseline is None:
        typer.echo("error: --baseline is required", err=True)
        raise typer.Exit(2)
    from .evaluate.run import evaluate

    rep = _run(evaluate, baseline, candidate, tasks=tasks, limit=limit, data_dir=data_dir, max_drop=max_drop, out=out,
               markdown=markdown, max_gen_toks=max_gen_toks, base_url=base_url, baseline_url=baseline_url, device=device)
    if json_out:
        typer.echo(json.dumps(rep.to_dict(), indent=1))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"{candidate} vs {baseline}" + (f" (limit {limit})" if limit else ""))
        for c in ("task", "n", "baseline", "candidate", "delta", "95% CI", "gate"):
            t.add_column(c)
        for r in rep.tasks:
            t.add_row(r.task, str(r.n), f"{r.baseline:.2f} ± {r.baseline_stderr:.2f}", f"{r.candidate:.2f} ± {r.candidate_stderr:.2f}",
                      f"{r.delta:+.2f}", f"({r.ci_low:+.2f}, {r.ci_high:+.2f})",
                      "[red]FAIL[/]" if not r.passed else ("pass" if r.conclusive else "[yellow]pass, inconclusive[/]"))
        Console().print(t)
    if not rep.passed:
        raise typer.Exit(1)


@app.command("list-archs")
def list_archs():
    """Architectures the registry knows."""
    from .archs import REGISTRY

    for a in REGISTRY.values():
        typer.echo(f"{a.name:12s} {', '.join(a.architectures)}  -- {a.notes}")


@app.command("make-tiny")
def make_tiny(
    arch: str = typer.Argument(..., help="glm_moe_dsa | kimi_k25 | deepseek_v3 | llama"),
    out: Path = typer.Argument(...),
    fp8_source: bool = typer.Option(True, "--fp8-source/--bf16-source"),
    seed: int = typer.Option(0),
    num_shards: int = typer.Option(3),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an earlier make-tiny output in OUT"),
    override: Optional[list[str]] = typer.Option(None, "--override", help="config KEY=VALUE (VALUE parsed as JSON, else a string); "
                                                 "repeatable, e.g. --override kv_lora_rank=512 (Kimi: applies to text_config)"),
):
    """Write a tiny checkpoint of a real architecture (transformers classes, vendor FP8 layout)."""
    from .testing.tiny import make_tiny as run
    from .testing.tiny import parse_overrides

    overrides = _run(parse_overrides, override or [])
    typer.echo(str(_run(run, arch, out, fp8_source=fp8_source, seed=seed, num_shards=num_shards, overwrite=overwrite,
                        overrides=overrides or None)))


@app.command()
def demo(out: Path = typer.Option(Path("demo-out"), help="working folder"),
         json_out: bool = typer.Option(False, "--json")):
    """The main job on the embedded default: tiny GLM-5 and Kimi K2.5 FP8 checkpoints -> INT4."""
    from .convert import convert as run_convert
    from .testing.tiny import make_tiny as mk

    for arch in ("glm_moe_dsa", "kimi_k25"):
        src = out / f"{arch}-fp8"
        if not (src / "quantize_manifest.json").exists():  # a finished make-tiny output
            _run(mk, arch, src, overwrite=True)
        typer.echo(f"== {arch}: {src} -> {out / (arch + '-w4a16-g32')}", err=True)
        res = _run(run_convert, src, out / f"{arch}-w4a16-g32", overwrite=True, emit=_emitter(json_out))
        typer.echo(f"   {res.tensors_int4} INT4 tensors, {_bytes(res.source_bytes)} -> {_bytes(res.output_bytes)}, "
                   f"mean rel. error {res.mean_rel_err:.4f}", err=True)


@app.command("card")
def card_cmd(
    model: Path = typer.Argument(..., metavar="DIR", help="a quantize output (convert, or calibrate-kv --out)"),
    eval: Optional[list[Path]] = typer.Option(None, "--eval", help="a `quantize eval --out`, `eval --kld --out` or `check --json` report (repeatable; default: those of the last card)"),
):
    """Write DIR/README.md, the model card, from the folder's own records: metadata for the Hub
    (base_model, licence carried from the source's card, model-index from the eval reports), how it
    was made, the quantization, KV-cache, check and eval results, and launch lines."""
    from .publish.card import card

    res = _run(card, model, eval=eval)
    typer.echo(f"wrote {res.path}" + (f" ({', '.join(r['kind'] for r in res.reports)} reports)" if res.reports else ""))
    for n in res.notes:
        typer.echo(f"note: {n}", err=True)


@app.command("push")
def push_cmd(
    model: Path = typer.Argument(..., metavar="DIR", help="a quantize output (convert, or calibrate-kv --out)"),
    repo_id: str = typer.Argument(..., metavar="REPO_ID", help="namespace/name on the Hub (HF_ENDPOINT selects another Hub)"),
    private: bool = typer.Option(False, "--private", help="create the repo private (an existing repo keeps its visibility)"),
    revision: Optional[str] = typer.Option(None, help="branch to commit to (created from main if missing; default main)"),
    create_pr: bool = typer.Option(False, "--create-pr", help="open a pull request instead of committing to the branch"),
    dry_run: bool = typer.Option(False, "--dry-run", help="check the folder and list the files and bytes that would go up; needs no token"),
    message: Optional[str] = typer.Option(None, help="commit message (default: Upload <folder> (quantize <version>))"),
    batch_gib: float = typer.Option(32.0, help="commit after about this many GiB of weights: what is committed survives an interruption"),
):
    """Check DIR (every index entry, config.json, every file's SHA-256 against the manifest) and
    upload it to the Hub, with its card; an interrupted push resumes without resending finished
    files. The token (HF_TOKEN or `hf auth login`) is never printed."""
    from .publish.push import push

    def emit(e: dict) -> None:
        if e.get("event") == "start":
            typer.echo(f"{e['files']} files ({_bytes(e['bytes'])}) to upload in {e['commits']} commit(s); {e['skipped']} already on the Hub", err=True)
        elif e.get("event") == "commit":
            typer.echo(f"commit {e['index']}/{e['of']}: {e['files']} files, {_bytes(e['bytes'])} ({e['oid'][:12]})", err=True)
        elif e.get("event") == "error":
            typer.echo("", err=True)  # the upload's progress bar may have left its line open

    res = _run(push, model, repo_id, private=private, revision=revision, create_pr=create_pr, dry_run=dry_run, message=message,
               batch_gib=batch_gib, emit=emit)
    w = max([len(f.path) for f in res.files] + [4])
    if res.dry_run:
        for f in res.files:
            typer.echo(f"{f.path:<{w}}  {f.bytes:>14,} B")
        typer.echo(f"{len(res.files)} files, {res.total_bytes:,} bytes ({_bytes(res.total_bytes)}) would go to {repo_id}@{res.revision}"
                   + (" as a pull request" if create_pr else "") + "; nothing was sent")
    else:
        where = res.pr_url or f"{res.url or repo_id}" + (f" (branch {res.revision})" if res.revision != "main" else "")
        typer.echo(f"pushed {sum(f.status == 'uploaded' for f in res.files)} files ({_bytes(res.sent_bytes)}) in {len(res.commits)} commit(s); "
                   f"{sum(f.status == 'on the Hub already' for f in res.files)} already on the Hub: {where}")
    typer.echo(res.card)
    if res.not_uploaded:
        typer.echo(f"not uploaded (the manifest does not prove them): {', '.join(res.not_uploaded)}", err=True)


@app.command("run")
def run_cmd(
    recipe: Optional[Path] = typer.Argument(None, help="recipe YAML: the llm-compressor part plus a pipeline: section "
                                            "(default: the embedded tiny GLM 5.2 recipe, quantize/recipes_default/tiny-glm.yaml)"),
    out: Optional[Path] = typer.Option(None, help="the run's folder (default: the recipe's pipeline.out)"),
    plan: bool = typer.Option(False, "--plan", help="print each stage, what it would do and whether it is done, stale or pending; run nothing"),
    overwrite: bool = typer.Option(False, "--overwrite", help="start the run over (the default continues it: finished stages whose options and inputs are unchanged are kept)"),
    json_out: bool = typer.Option(False, "--json", help="NDJSON events on stdout (with --plan: one JSON object)"),
):
    """convert -> calibrate-kv -> shard/check -> eval -> card -> push from one recipe, resumable
    stage by stage; a failed check or eval gate stops before push with exit 1."""
    from .pipeline import run

    if plan:
        res = _run(run, recipe, out=out, plan=True, overwrite=overwrite)
        if json_out:
            typer.echo(json.dumps(res.to_dict(), indent=1))
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"quantize run --plan: {res.recipe} -> {res.out}")
        for c in ("stage", "state", "what it does", "why"):
            t.add_column(c)
        colour = {"done": "green", "skipped": "green", "stale": "yellow", "pending": "cyan", "failed": "red"}
        for s in res.stages:
            t.add_row(s.stage, f"[{colour.get(s.state, 'white')}]{s.state}[/]", s.does, s.why or s.summary)
        Console().print(t)
        return
    if json_out:
        from .events import JsonEmitter

        emit = JsonEmitter()
    else:
        from rich.console import Console

        from .events import RichEmitter

        console = Console(stderr=True)
        inner = RichEmitter(console)

        def emit(e: dict) -> None:
            if e.get("event") != "stage":
                if "in_stage" in e:
                    inner(e)
                return
            st, name = e.get("state"), e.get("stage")
            if e.get("kept"):
                console.print(f"[green]= {name}[/]: {st}, kept from the run's record" + (f" ({e['summary']})" if e.get("summary") else ""))
            elif st == "start":
                console.rule(f"[bold]{name}[/]")
                console.print(f"{e.get('does', '')}" + (f"  [dim]({e['why']})[/]" if e.get("why") else ""))
            elif st in ("done", "skipped"):
                if inner.progress is not None:
                    inner.progress.stop()
                    inner.progress = None
                console.print(f"[green]{name} {st}[/] in {e.get('seconds', 0):.1f} s: {e.get('summary', '')}")
            elif st in ("failed", "error"):
                if inner.progress is not None:
                    inner.progress.stop()
                    inner.progress = None
                console.print(f"[red]{name} {st}[/]: {e.get('error', '')}")

    class Interrupted(QuantizeError):
        exit_code = 130

    def run_interruptible(*a, **kw):
        try:
            return run(*a, **kw)
        except KeyboardInterrupt:
            raise Interrupted("interrupted: finished stages are kept in the run's record; rerun the same `quantize run` to continue "
                              "(the interrupted stage continues, convert with --resume)") from None

    res = _run(run_interruptible, recipe, out=out, plan=False, overwrite=overwrite, emit=emit)
    if json_out:
        typer.echo(json.dumps({"event": "result", **res.to_dict()}))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"quantize run: {res.out} ({res.seconds:.1f} s)")
    for c in ("stage", "state", "seconds", "result"):
        t.add_column(c)
    for s in res.stages:
        t.add_row(s.stage, s.state, "-" if s.seconds is None else f"{s.seconds:.1f}", s.summary)
    Console().print(t)


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
