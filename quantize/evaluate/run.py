"""``quantize eval``: baseline against candidate on the same items through lm-eval, with paired
statistics and a gate.

Both models run lm-eval's own task configs (prompts, few-shot, filters, metrics) on the same
documents (same ``limit``, same seeds). From the per-sample results: each model's score +- stderr,
the paired delta with a 95% bootstrap confidence interval (resampling documents, seeded), and a
gate: a task fails when even the optimistic end of that interval is a drop larger than
``max_drop`` points. ``mmlu`` / ``mmlu_pro`` pool their subjects' documents, which is the
size-weighted mean of the subject scores.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import QuantizeError
from ..options import EVAL_TASKS, EvalOptions, takes
from .smoke import SMOKE_ITEMS, is_smoke, smoke_note
from .tasks import _task_manager, data_folder, output_type, task_configs

FILTER_PREFERENCE = ("flexible-extract", "custom-extract", "strict-match", "none")
REPORT_KIND, MARKDOWN_KIND, BASELINE_KIND = "eval", "eval-markdown", "eval-baseline"
CHAT_BACKEND = "quantize-chat-completions"  # lm-eval's local-chat-completions, None content read as "" (below)
SAMPLE_KEYS = ("doc_id", "filter", "acc", "acc_norm", "exact_match")  # what the pairing reads of a sample
# --chat, as the report and the card say it (by served or not): a chat-completions server returns text, not
# the log-likelihood of a given answer, so the log-likelihood tasks keep the task's own prompts everywhere
CHAT_PROMPTS = {
    False: "generation tasks through the model's chat template; log-likelihood tasks as the task writes them",
    True: "generation tasks through the model's chat template (chat-completions); log-likelihood tasks as the "
          "task writes them (completions)",
}


@dataclass
class TaskResult:
    task: str
    metric: str
    n: int
    baseline: float
    baseline_stderr: float
    candidate: float
    candidate_stderr: float
    delta: float
    ci_low: float
    ci_high: float
    passed: bool
    # False: the CI reaches below -max_drop too, or the task is a smoke test (under SMOKE_ITEMS documents)
    conclusive: bool = True
    # per document, paired: "subtask/doc id", and each model's score of it (0/1 for accuracy)
    docs: list = field(default_factory=list)
    baseline_items: list = field(default_factory=list)
    candidate_items: list = field(default_factory=list)

    def __post_init__(self):
        if self.smoke:  # a smoke test never concludes, whatever its CI (evaluate/smoke.py)
            self.conclusive = False

    @property
    def smoke(self) -> bool:
        return is_smoke(self.n)

    @property
    def verdict(self) -> str:
        if not self.passed:
            return "FAIL"
        if self.smoke:
            return f"pass ({smoke_note([self.n])})"
        return ("pass" if self.conclusive
                else "pass (inconclusive: the CI reaches below -max-drop; use a larger --limit)")


@dataclass
class EvalReport:
    baseline: str
    candidate: str
    limit: int | None
    max_drop: float
    tasks: list[TaskResult]
    # where each model was measured: {"baseline": where, "candidate": where}, each a local run
    # ({"engine": "transformers", ...}), a server given by URL, or one this command launched (its
    # engine, version, launch line and start-up time: quantize.engines.serve.Served.record)
    measured: dict = field(default_factory=dict)
    log: str | None = None  # where lm-eval's and transformers' own output went (not in the report)
    kld: object = None  # --kld-out: the candidate's KldReport (its own report file, not in this one)

    @property
    def passed(self) -> bool:
        """Every task within its max drop, and the KL / flip gate (--max-kld / --max-flip-rate) where set."""
        kg = getattr(self.kld, "gate", None)
        return all(t.passed for t in self.tasks) and (kg is None or bool(kg["passed"]))

    @property
    def smoke(self) -> bool:
        """Some task is a smoke test (evaluate/smoke.py): the report does not conclude."""
        return any(t.smoke for t in self.tasks)

    def to_dict(self) -> dict:
        return {"baseline": self.baseline, "candidate": self.candidate, "limit": self.limit, "max_drop": self.max_drop,
                "passed": self.passed, "smoke": self.smoke,
                "tasks": {t.task: {**asdict(t), "smoke": t.smoke, "verdict": t.verdict} for t in self.tasks},
                "measured": self.measured,
                **({"kld_gate": self.kld.gate} if getattr(self.kld, "gate", None) is not None else {})}

    def markdown(self) -> str:
        rows = ["| task | metric | n | baseline | candidate | delta (95% CI) | gate |",
                "|---|---|---:|---:|---:|---|---|"]
        for t in self.tasks:
            rows.append(f"| {t.task} | {t.metric} | {t.n} | {t.baseline:.2f} ± {t.baseline_stderr:.2f} "
                        f"| {t.candidate:.2f} ± {t.candidate_stderr:.2f} "
                        f"| {t.delta:+.2f} ({t.ci_low:+.2f}, {t.ci_high:+.2f}) | {t.verdict} |")
        smoke = [f"{t.task} ({t.n})" for t in self.tasks if t.smoke]
        return "\n".join(rows) + (f"\n\nGate: a task fails when the 95% CI of (candidate - baseline) lies entirely "
                                   f"below -{self.max_drop} points; a pass is a measurement when the whole CI lies "
                                   f"above -{self.max_drop} on {SMOKE_ITEMS} documents or more.\n") + (
            f"\nSmoke test: {', '.join(smoke)} scored on fewer than {SMOKE_ITEMS} documents; its pass shows the gate "
            "runs, it measures nothing.\n" if smoke else "")


def served_model(url: str, timeout: float = 10.0) -> str:
    """The model an OpenAI-compatible server (SGLang, vLLM) serves; one line naming the URL if it
    cannot be reached."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout) as r:
            data = json.loads(r.read())
        return data["data"][0]["id"]
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise QuantizeError(f"--base-url {url}: server not reachable ({getattr(e, 'reason', e)}); "
                            f"start it or fix the URL") from e
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        raise QuantizeError(f"--base-url {url}: /v1/models did not answer like an OpenAI-compatible server") from e


def _run_model(path: str, configs: list, limit: int | None, device: str, batch_size: int,
               base_url: str | None = None, chat: bool = False, think=None, concurrency: int = 1,
               keep: dict | None = None) -> dict:
    """One model's lm-eval results (``samples`` per task). ``chat``: the generation tasks through
    the model's chat template, the log-likelihood ones as the task writes them (``CHAT_PROMPTS``):
    two lm-eval runs on the same model or server, their samples together. A local model is loaded
    once (``kld.load_model``, the loader eval-kld uses) for all its runs; ``keep``: it is kept there
    afterwards (by ``kld.model_key``) for ``--kld-out``, else freed."""
    if not (Path(path) / "config.json").exists() and not (Path(path) / "tokenizer.json").exists():
        raise QuantizeError(f"{path}: no config.json; pass a model folder")
    model = None
    if not base_url:
        import torch

        from .kld import check_device, load_model, model_key

        dev = check_device(device)
        model = load_model(Path(path), torch.float32, dev)
        if keep is not None:
            keep[model_key(Path(path), torch.float32, dev)] = model
    if not chat:
        return _lm_eval(path, configs, limit, device, batch_size, base_url, False, None, concurrency, model=model)
    gen = [c for c in configs if output_type(c) == "generate_until"]
    rest = [c for c in configs if output_type(c) != "generate_until"]
    runs = [_lm_eval(path, cs, limit, device, batch_size, base_url, templ, think if templ else None, concurrency,
                     model=model) for cs, templ in ((gen, True), (rest, False)) if cs]
    return {"samples": {t: s for r in runs for t, s in r["samples"].items()}}


def _lm_eval(path: str, configs: list, limit: int | None, device: str, batch_size: int, base_url: str | None,
             chat: bool, think=None, concurrency: int = 1, model=None) -> dict:
    """``think`` (``evaluate/thinking.py``, chat only): the template's thinking switch, set for a local
    model through lm-eval's ``chat_template_args``, for a server as each request's
    ``chat_template_kwargs``; on, lm-eval keeps the text after the trace's end. ``model``: the
    local model, loaded (lm-eval's ``hf`` backend around it, the folder's tokenizer); None: loaded here."""
    import lm_eval

    if base_url and chat:  # the server applies the model's chat template (lm-eval's chat backend: messages)
        name = served_model(base_url)
        _chat_backend()
        model, args = CHAT_BACKEND, {"base_url": base_url.rstrip("/") + "/v1/chat/completions",
                                                  "model": name, "num_concurrent": concurrency, "max_retries": 2}
    elif base_url:  # the deployment as served: lm-eval's completions backend, the local folder's tokenizer
        name = served_model(base_url)
        model, args = "local-completions", {"base_url": base_url.rstrip("/") + "/v1/completions", "model": name,
                                             "tokenizer": str(path), "tokenizer_backend": "huggingface",
                                             "tokenized_requests": True, "num_concurrent": concurrency,
                                             "max_retries": 2}
    else:
        loaded, model, args = model, "hf", {"tokenizer": str(path), "batch_size": batch_size}
    gen_kwargs = None
    if think is not None:
        from .thinking import THINK_END

        if base_url:
            gen_kwargs = {"chat_template_kwargs": think.template_kwargs()}
        else:
            args["chat_template_args"] = think.template_kwargs()
        if think.on:
            args["think_end_token"] = THINK_END
    with _data_errors(configs, hub=False):  # the data was read before (_read_tasks): not the Hub's now
        if not base_url:  # lm-eval's hf backend around the model loaded once (its own loader would load it again)
            from lm_eval.models.huggingface import HFLM

            if loaded is None:  # called alone: loaded here, by the same loader
                import torch

                from .kld import check_device, load_model

                loaded = load_model(Path(path), torch.float32, check_device(device))
            model, args = HFLM(pretrained=loaded, **args), None
        # our TaskManager (built once per process): lm-eval's own would walk every task YAML again, each call
        return lm_eval.simple_evaluate(model=model, model_args=args, tasks=configs, task_manager=_task_manager(),
                                       limit=limit, log_samples=True, batch_size=batch_size, device=device,
                                       apply_chat_template=chat, gen_kwargs=gen_kwargs,
                                       random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def _files(configs: list) -> list[str]:
    """The local data files the task configs read (--data-dir); none: lm-eval fetches from the Hub."""
    return [str(f) for c in configs if isinstance(c, dict)
            for f in (c.get("dataset_kwargs") or {}).get("data_files", {}).values()]


def _data_error(e: BaseException, configs: list, hub: bool = True) -> BaseException:
    """What a failure while lm-eval reads the tasks' data becomes: one line naming the data and the
    fix (``hub``: the Hub out of reach, while the tasks are built; a missing or malformed file), or
    the exception itself when it is none of those."""
    if isinstance(e, QuantizeError):
        return e
    cause = e
    while cause.__cause__ is not None:
        cause = cause.__cause__
    first = str(cause).splitlines()[0][:160] if str(cause) else type(cause).__name__
    files = _files(configs)
    offline = type(e).__name__ in ("LocalEntryNotFoundError", "OfflineModeIsEnabled") or isinstance(e, ConnectionError)
    if hub and offline and not files:
        return QuantizeError(f"evaluation data: lm-eval could not fetch the tasks' datasets from the Hub ({first}); "
                             "pass --data-dir shipped (the small subset quantize ships) or --data-dir DIR with the "
                             "tasks' files (docs/evaluation.md#local-data)")
    if isinstance(e, FileNotFoundError):
        return QuantizeError(f"evaluation data missing: {e}")
    if (type(e).__module__.startswith(("datasets", "pyarrow"))
            or type(cause).__module__.startswith(("datasets", "pyarrow", "json"))):
        return QuantizeError(f"evaluation data could not be read ({type(cause).__name__}: {first}); "
                             f"check {', '.join(files[:3]) or 'the data files'}")
    return e


def _read_tasks(configs: list) -> None:
    """Before any model loads or engine starts: lm-eval builds the tasks, reading (or fetching)
    their datasets, so the Hub out of reach or a bad data file is one line now, not after a
    launch (datasets caches what it fetched for the runs)."""
    with _data_errors(configs):
        _task_manager().load(configs)


@contextlib.contextmanager
def _data_errors(configs: list, hub: bool = True):
    """A failure while lm-eval reads the tasks' data, as ``_data_error`` words it; any other raised as
    it is (not made its own cause)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - datasets' and pyarrow's failures, in one line
        err = _data_error(e, configs, hub)
        if err is e:
            raise
        raise err from e


class KLPlan(NamedTuple):
    """``--kld-out`` through launched engines: the text, its chunks of token ids, the top-k asked for,
    the run's identity (``kld.served_text``) and, from a --baseline-results file, the baseline's rows."""

    text: Path
    chunks: list
    top_k: int
    identity: dict
    baseline_rows: list | None = None


@functools.cache
def _chat_backend() -> type:
    """lm-eval's ``local-chat-completions``, registered under our name with one change: a message
    without content is an empty answer, not None. A reasoning model whose trace reaches the cap before
    ``</think>`` answers so (the engine's reasoning parser puts all of it in ``reasoning_content``), and
    lm-eval's answer filters cannot read None; empty, the item scores 0 on that model, as it should.
    Registered once per process (``functools.cache``); -> the class."""
    from lm_eval.api.registry import register_model
    from lm_eval.models.openai_completions import LocalChatCompletion

    @register_model(CHAT_BACKEND)
    class _Chat(LocalChatCompletion):
        def parse_generations(self, outputs, **kwargs) -> list[str]:
            return ["" if r is None else r for r in super().parse_generations(outputs, **kwargs)]

    return _Chat


def _per_doc(samples: list[dict], metric: str) -> dict:
    by_filter: dict[str, dict] = {}
    for s in samples:
        by_filter.setdefault(s.get("filter", "none"), {})[s["doc_id"]] = float(s[metric])
    for f in FILTER_PREFERENCE:
        if f in by_filter:
            return by_filter[f]
    return next(iter(by_filter.values()))


def _metric(samples: list[dict]) -> str:
    for m in ("acc", "exact_match", "acc_norm"):
        if samples and m in samples[0]:
            return m
    raise QuantizeError(f"no accuracy metric in lm-eval's samples ({sorted(samples[0]) if samples else 'none'})")


def paired_stats(a: np.ndarray, b: np.ndarray, resamples: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """(delta, ci_low, ci_high) in points (x100) of mean(b) - mean(a), paired bootstrap over documents."""
    n = len(a)
    rng = np.random.default_rng(seed)
    deltas = []
    for start in range(0, resamples, 1000):
        idx = rng.integers(0, n, (min(1000, resamples - start), n))
        deltas.append((b[idx].mean(1) - a[idx].mean(1)) * 100)
    d = np.concatenate(deltas)
    return float((b.mean() - a.mean()) * 100), float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))


@takes(EvalOptions)
def evaluate(baseline, candidate, tasks, limit, data_dir, max_drop, out, markdown, max_gen_toks, chat, thinking,
             device, batch_size, resamples, base_url, baseline_url, concurrency, serve, engine_python, tp,
             kv_cache_dtype, baseline_kv_cache_dtype, serve_args, serve_port, serve_timeout_s, serve_log,
             serve_pd_prefill, verbose, save_baseline, baseline_results, kld_out, kld_tokens, kld_chunk,
             kld_top_k, max_kld=None, max_flip_rate=None) -> EvalReport:
    """``base_url``: evaluate the candidate as served (SGLang/vLLM OpenAI-compatible server; the
    candidate folder supplies the tokenizer); ``baseline_url`` likewise for the baseline.
    ``serve``: launch that engine on each folder in turn (baseline, then candidate; one model on
    the node at a time) and evaluate through it (``quantize.engines.serve``); ``serve_pd_prefill``:
    the candidate as SGLang's prefill/decode pair instead (``serve.Pair``: that folder in the prefill
    pool), for generation tasks alone. ``baseline_kv_cache_dtype``: the baseline's launch with its
    own cache (default ``kv_cache_dtype``); a reused baseline must have been served with it. ``kld_out``: also the
    candidate's KL divergence against the baseline (``eval-kld``'s report) from the same runs; served,
    from the same launch of each model (``_runs``)."""
    from ..checkpoint.output import report_target, write_report
    from .kld import REPORT_KIND as KLD_KIND
    from .kld import check_device, same_model, same_tokenizer

    # every folder and file this command reads, the PD pair's prefill model included
    inputs = [baseline, candidate, serve_pd_prefill, data_folder(data_dir), baseline_results]
    if out is not None:  # before anything is read or loaded
        report_target(out, REPORT_KIND, inputs, "--out")
    if save_baseline is not None:
        if baseline_results is not None:
            raise QuantizeError("--save-baseline with --baseline-results: the baseline is read, not run, so there is "
                                "nothing to save; drop one of them")
        report_target(save_baseline, BASELINE_KIND, inputs, "--save-baseline")
    if markdown is not None:
        if Path(markdown).is_dir():
            raise QuantizeError(f"--markdown {markdown}: is a folder; name a file inside it, e.g. "
                                f"{Path(markdown) / 'eval.md'}")
        report_target(markdown, MARKDOWN_KIND, inputs, "--markdown")
        if out is not None and Path(out).resolve() == Path(markdown).resolve():
            raise QuantizeError(f"--markdown {markdown}: the same file as --out; name two files")
    if kld_out is None and (max_kld is not None or max_flip_rate is not None):
        given = "--max-kld" if max_kld is not None else "--max-flip-rate"
        raise QuantizeError(f"{given} gates the KL divergence report: add --kld-out FILE (the KL from the same "
                            "runs), or use quantize eval-kld")
    if kld_out is not None:
        if base_url or baseline_url:
            raise QuantizeError("--kld-out with --base-url/--baseline-url: a server's log-probabilities are asked "
                                "for in its engine's own way; use --serve ENGINE (or quantize eval-kld)")
        report_target(kld_out, KLD_KIND, inputs, "--kld-out")
        for other, flag in ((out, "--out"), (markdown, "--markdown")):
            if other is not None and Path(other).resolve() == Path(kld_out).resolve():
                raise QuantizeError(f"--kld-out {kld_out}: the same file as {flag}; name two files")
    kld_base = None  # a saved baseline's KL side: the file beside its --save-baseline JSON (kld_baseline_file)
    if kld_out is not None and save_baseline is not None:
        from .kld import BASELINE_KIND as KLD_BASELINE_KIND

        kld_base = kld_baseline_file(save_baseline)
        report_target(kld_base, KLD_BASELINE_KIND, inputs, "--save-baseline (its KL side)")
        for other, flag in ((out, "--out"), (markdown, "--markdown"), (kld_out, "--kld-out")):
            if other is not None and Path(other).resolve() == kld_base.resolve():
                raise QuantizeError(f"--save-baseline {save_baseline}: its KL side {kld_base} is the file {flag} "
                                    "names; name another file")
    if serve is not None and (base_url or baseline_url):
        raise QuantizeError(f"--serve {serve} launches the servers itself; drop --base-url / --baseline-url (or "
                            "--serve, to evaluate servers you started)")
    from ..engines.serve import check_baseline_kv, log_folder

    log_folder(serve_log, inputs)  # the engines' logs: an output like the others

    check_baseline_kv(baseline_kv_cache_dtype, serve)
    if serve_pd_prefill is not None:
        _pd_options(serve_pd_prefill, serve, kld_out)
    if serve is not None:
        from ..engines.serve import check_extra, check_pair, engine_of, python_of

        python_of(engine_of(serve), engine_python)  # the engine's interpreter, before any work
        check_extra(serve, serve_args)
        if serve_pd_prefill is not None:
            check_pair(engine_python, tp, serve_args)  # SGLang, its router, the GPUs: before the baseline's launch
        base_url = baseline_url = None
    elif not (base_url and baseline_url):  # a model runs here: refuse a GPU that is not there before anything loads
        check_device(device)
    _model_folder(baseline, served=bool(baseline_url))
    _model_folder(candidate, served=bool(base_url))
    if all((Path(p) / "config.json").is_file() for p in (baseline, candidate)):  # a served one may be tokenizer only
        same_model(Path(baseline), Path(candidate))  # the compared models belong together, before any work
    same_tokenizer(Path(baseline), Path(candidate))
    if not (base_url or baseline_url):  # a server's folder is its tokenizer: what it serves is not here to prove
        from .provenance import converted_from

        converted_from(Path(baseline), Path(candidate))  # the candidate was made from the baseline
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise QuantizeError(f"--tasks {tasks!r}: names no task; pass comma-separated lm-eval tasks, e.g. {EVAL_TASKS}")
    configs, groups = task_configs(names, data_dir, max_gen_toks)
    if serve_pd_prefill is not None:
        _pd_tasks(serve_pd_prefill, candidate, configs)
    from .thinking import resolve as thinking_of

    toks = _check_chat(configs, [baseline, candidate]) if chat else {}
    # a reasoning model's thinking switch, set alike on both sides (evaluate/thinking.py)
    think = thinking_of(thinking, chat, toks, max_gen_toks)
    # a saved baseline's identity (every data file hashed): only where one is written or read
    ident = (_baseline_identity(baseline, names, limit, max_gen_toks, configs, chat, think)
             if save_baseline is not None or baseline_results is not None else None)
    saved = (_saved_baseline(baseline_results, ident, kld_out is not None) if baseline_results is not None
             else None)
    if saved is not None:
        kld_base = saved["kld"]
        if serve is not None:
            from ..engines.serve import same_cache

            same_cache(baseline_results, saved["measured"], baseline_kv_cache_dtype or kv_cache_dtype,
                       baseline_kv_cache_dtype is not None, "--baseline-results")
    kld_plan = None
    if kld_out is not None and (serve is not None or saved is not None):  # the text's chunks, before anything runs
        from .kld import served_text

        text_path, chunks, run_ident = served_text(Path(candidate), None, kld_tokens, kld_chunk, serve is not None)
        # a saved KL side proven to be this run's (text, chunks, tokenizer, top-k, baseline model) before any work
        base_rows = (_saved_kl(kld_base, run_ident, kld_top_k, chunks, candidate, baseline, baseline_results,
                               serve is not None) if saved is not None else None)
        if serve is not None:
            kld_plan = KLPlan(text_path, chunks, kld_top_k, run_ident, base_rows)
    for url in (base_url, baseline_url if saved is None else None):
        if url:
            served_model(url)  # fail fast, before the baseline run
    from ..quiet import captured, kept, new_log

    log = None if verbose else new_log("eval")
    local_kl = kld_out is not None and kld_plan is None
    # local --kld-out: each model loaded once (kept here for the KL); the baseline's log-probs written right
    # after its tasks (exact, fp32, in a temporary file), so it is freed before the candidate loads; its
    # --save-baseline KL side is written there too and moved beside the JSON once the run has succeeded
    loaded: dict | None = {} if local_kl else None
    kl_tmp = tempfile.TemporaryDirectory(prefix="quantize-eval-kl-") if local_kl and saved is None else None
    kept_kl = Path(kl_tmp.name) / "baseline-fp32.safetensors" if kl_tmp else None
    side_tmp = Path(kl_tmp.name) / "baseline-kl-side.safetensors" if kl_tmp and kld_base is not None else None

    kl_text = None  # the KL text as kld scores it (kld._text_of), checked before anything loads

    def after_baseline():
        from .kld import baseline_pass

        baseline_pass(baseline, kl_text, kept_kl, save_baseline=side_tmp, device=device, loaded=loaded)
        loaded.clear()

    try:
        try:
            with captured(log):
                _read_tasks(configs)  # the data, before any model loads or engine starts
                if local_kl:  # the KL text and both tokenizers, likewise
                    from .kld import _text_of

                    kl_text = _text_of(baseline, Path(candidate), None, kld_tokens, kld_chunk)
                rb, rc, measured, rows = _runs(baseline, candidate, configs, limit, device, batch_size, base_url,
                                               baseline_url, serve, dict(python=engine_python, tp=tp,
                                                                         kv_cache_dtype=kv_cache_dtype,
                                                                         extra_args=serve_args, port=serve_port,
                                                                         timeout_s=serve_timeout_s, log_dir=serve_log),
                                               saved, chat, think, kld_plan, concurrency, serve_pd_prefill, loaded,
                                               baseline_kv_cache_dtype, after_baseline if kl_tmp else None)
                kld_rep = None
                if kld_out is not None:
                    kld_rep = _kld(baseline, candidate, kld_plan, rows, measured, kld_tokens, kld_chunk, kld_top_k,
                                   device, kld_base, saved is not None, baseline_results, loaded, kept_kl)
        except QuantizeError as e:
            log = kept(log)
            raise type(e)(f"{e} (lm-eval's and transformers' output: {log})" if log else str(e)) from e.__cause__
        finally:
            if loaded:
                loaded.clear()  # the models' last references, also on an error (its traceback keeps this frame)
        if save_baseline is not None:
            if kld_plan is not None and kld_base is not None:  # served: the baseline's rows
                from .kld import model_identity, served_baseline_file

                kl_ident = {**kld_plan.identity, "top_k": kld_plan.top_k, "model": model_identity(Path(baseline))}
                served_baseline_file(kld_base, rows["baseline"], kld_plan.chunks, kl_ident,
                                     _kl_where(measured["baseline"]))
            if side_tmp is not None:  # local: the fp16 side baseline_pass wrote, beside the JSON written next
                shutil.move(side_tmp, kld_base)
            doc = {"identity": ident, "measured": measured["baseline"], "samples": _kept_samples(rb)}
            if kld_base is not None:  # the KL side's file, by name: the two are kept (and moved) together
                doc["kld"] = {"file": kld_base.name, "served": kld_plan is not None}
            write_report(save_baseline, doc, BASELINE_KIND, inputs, "--save-baseline")
    finally:
        if kl_tmp is not None:
            kl_tmp.cleanup()
    results = _paired(rb, rc, groups, max_drop, resamples)
    log = kept(log)
    rep = EvalReport(str(baseline), str(candidate), limit, max_drop, results, measured, str(log) if log else None,
                     kld_rep)
    if kld_rep is not None:
        from .kld import KlGate

        KlGate(max_kld, max_flip_rate).apply([kld_rep])
        write_report(kld_out, kld_rep.to_dict(), KLD_KIND, inputs, "--kld-out")
    if out is not None:
        write_report(out, rep.to_dict(), REPORT_KIND, inputs)
    if markdown is not None:
        write_report(markdown, rep.markdown(), MARKDOWN_KIND, inputs, "--markdown")
    return rep


def _kept_samples(res: dict) -> dict:
    """What the pairing reads of lm-eval's samples (``SAMPLE_KEYS``), per task: a saved baseline."""
    return {t: [{k: s[k] for k in SAMPLE_KEYS if k in s} for s in samples] for t, samples in res["samples"].items()}


def _baseline_identity(baseline, names: list[str], limit, max_gen_toks, configs: list, chat: bool = False,
                       think=None) -> dict:
    """What a saved baseline's results depend on: the baseline model (config, weights' headers,
    tokenizer: ``kld.model_identity``), the tasks, limit and generation cap, and the data files
    (each one's SHA-256; the Hub's dataset names when read from the Hub)."""
    import hashlib

    from .kld import model_identity

    data = {}
    for c in configs:
        if isinstance(c, dict):
            for split, f in (c.get("dataset_kwargs") or {}).get("data_files", {}).items():
                data[f"{c['task']}/{split}"] = hashlib.sha256(Path(f).read_bytes()).hexdigest()
        else:
            data[str(c)] = "hub"
    return {"model": model_identity(Path(baseline)), "tasks": names, "limit": limit, "max_gen_toks": max_gen_toks,
            "data": data, "chat": chat, "thinking": think.mode if think else None}


def kld_baseline_file(save_baseline) -> Path:
    """Where ``eval --save-baseline FILE --kld-out ...`` keeps the baseline's KL side, beside FILE:
    ``base.json`` -> ``base.kld.safetensors`` (eval-kld's --save-baseline format: local, the full
    log-probabilities in fp16; served, the engine's top-k rows)."""
    p = Path(save_baseline)
    return p.with_name((p.stem if p.suffix else p.name) + ".kld.safetensors")


def _saved_baseline(path, ident: dict, kld: bool = False) -> dict:
    """A ``--save-baseline`` file, refused in one line unless it was made for this comparison;
    ``kld`` (--kld-out): it must have its KL side too (-> its path as ``kld``)."""
    from ..parse import load_json

    doc = load_json(path, "saved baseline", kind="report")
    if (doc.get("written_by") or {}).get("kind") != BASELINE_KIND:
        raise QuantizeError(f"--baseline-results {path}: not a file `quantize eval --save-baseline` wrote; pass one")
    have = doc.get("identity") if isinstance(doc.get("identity"), dict) else {}
    for key, what in (("model", "another baseline model (config, weights or tokenizer)"), ("tasks", "other tasks"),
                      ("limit", "another --limit"), ("max_gen_toks", "another --max-gen-toks"),
                      ("data", "other evaluation data"), ("chat", "other prompts (--chat or not)"),
                      ("thinking", "another --thinking")):
        if have.get(key, False if key == "chat" else None) != ident[key]:
            raise QuantizeError(f"--baseline-results {path}: made for {what} than this run; rerun with the same "
                                f"options, or save the baseline again (--save-baseline)")
    samples = doc.get("samples")
    if not isinstance(samples, dict) or not all(isinstance(v, list) for v in samples.values()):
        raise QuantizeError(f"--baseline-results {path}: its samples are not per-task lists; save the baseline again")
    kl_file = None
    if kld:
        side = doc.get("kld")
        name = side.get("file") if isinstance(side, dict) else None
        if not isinstance(name, str) or Path(name).name != name:
            raise QuantizeError(f"--baseline-results {path}: saved without --kld-out, so it holds no KL baseline; "
                                "save the baseline again with --kld-out, or drop --kld-out")
        kl_file = Path(path).parent / name
        if not kl_file.is_file():
            raise QuantizeError(f"--baseline-results {path}: its KL side {kl_file} is missing; keep the two files "
                                "together, or save the baseline again")
    return {"samples": samples, "measured": doc.get("measured") or {}, "kld": kl_file}


def _saved_kl(kl_file: Path, run: dict, top_k: int, chunks: list, candidate, baseline, results, served: bool):
    """A saved baseline's KL side, proven to be this run's (``kld._open_served``, ``kld._open_logits``):
    -> its rows (served), None (local: eval-kld reads the file itself)."""
    from .kld import _open_logits, _open_served

    try:
        if served:
            return _open_served(kl_file, run, top_k, chunks, Path(candidate), Path(baseline))[0]
        _open_logits(kl_file, run, chunks, Path(candidate), Path(baseline))
    except QuantizeError as e:
        raise QuantizeError(f"--baseline-results {results}: its KL side: {e}") from e
    return None


def _pd_options(prefill, serve, kld_out) -> None:
    """--serve-pd-prefill's options, before anything is read: SGLang's pair, and no KL through it."""
    if serve != "sglang":
        raise QuantizeError(f"--serve-pd-prefill {prefill}: a prefill/decode pair is SGLang's (its router, "
                            "sglang_router); add --serve sglang" + (f", not --serve {serve}" if serve else ""))
    if kld_out is not None:
        raise QuantizeError(f"--serve-pd-prefill with --kld-out: through the pair every prompt's log-probs come "
                            f"from the prefill pool ({prefill}), not the candidate; measure KL without "
                            "--serve-pd-prefill, and the pair's own fidelity with quantize eval-pd")


def _pd_tasks(prefill, candidate, configs) -> None:
    """The pair's prefill model belongs with the candidate, and every task is a generation task: a
    log-likelihood task's score through the pair is the prefill pool's, not the candidate's."""
    from .kld import same_model, same_tokenizer

    try:
        _model_folder(prefill, served=False)
    except QuantizeError as e:
        raise QuantizeError(f"--serve-pd-prefill {e}") from None
    same_model(Path(prefill), Path(candidate), "--serve-pd-prefill")
    same_tokenizer(Path(prefill), Path(candidate), what_a="--serve-pd-prefill")
    from ..checkpoint.manifest import folded

    if folded(Path(candidate)):
        raise QuantizeError(f"--serve-pd-prefill: {candidate} is calibrate-kv --fold's output, whose cached MLA "
                            f"latent is rescaled, but the prefill pool ({prefill}) writes the unfolded cache it "
                            "would read; put the unfolded candidate in the decode pool")
    schemes = [_kv_scheme(Path(p)) for p in (candidate, prefill)]
    if schemes[0] is not None and schemes[0] != schemes[1]:
        raise QuantizeError(f"--serve-pd-prefill: {candidate} has KV-cache scales (kv_cache_scheme, from calibrate-kv "
                            f"--target compressed-tensors) and the prefill pool's {prefill} "
                            f"{'has other ones' if schemes[1] else 'none'}: the decode pool would read the prefill "
                            "pool's FP8 pages at its own scales; put the candidate without them in the decode pool")
    scored = [c["task"] if isinstance(c, dict) else str(c) for c in configs if output_type(c) != "generate_until"]
    if scored:
        raise QuantizeError(f"--serve-pd-prefill: {', '.join(scored[:4])}{' ...' if len(scored) > 4 else ''} "
                            f"score(s) prompt log-probs, which the prefill pool ({prefill}) computes, not the "
                            "candidate; run log-likelihood tasks without --serve-pd-prefill and generation tasks "
                            "(gsm8k, mmlu_pro) through the pair")


def _kv_scheme(folder: Path):
    """A checkpoint's ``quantization_config.kv_cache_scheme`` (its KV-cache scales), or None."""
    try:
        qc = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return qc.get("kv_cache_scheme") if isinstance(qc, dict) else None


def _runs(baseline, candidate, configs, limit, device, batch_size, base_url, baseline_url, serve, srv: dict,
          saved: dict | None = None, chat: bool = False, think=None, kld_plan=None, concurrency: int = 1,
          pd_prefill=None, keep: dict | None = None, baseline_kv: str | None = None, after_baseline=None):
    """Both models' lm-eval results, one after the other (served: each by its own launched engine;
    ``pd_prefill``: the candidate by SGLang's prefill/decode pair, ``serve.Pair``),
    where each was measured, and (``kld_plan``, served only) each model's served log-probs from the
    same launch, after its tasks; ``saved``: the
    baseline's results, read from a --save-baseline file; ``keep`` (local --kld-out): the local
    models stay loaded there for the KL; ``baseline_kv``: the baseline's KV-cache dtype, if not
    ``srv``'s; ``after_baseline`` (local): called once the baseline's tasks ran."""
    measured: dict = {}
    runs = []
    rows = {"baseline": kld_plan.baseline_rows} if kld_plan and kld_plan.baseline_rows is not None else {}
    for role, path, url in (("baseline", baseline, baseline_url), ("candidate", candidate, base_url)):
        if role == "baseline" and saved is not None:
            runs.append({"samples": saved["samples"]})
            measured[role] = {"engine": "unknown", **saved["measured"], "reused": True}
            continue
        how = {"prompts": CHAT_PROMPTS[bool(serve or url)]} if chat else {}
        if serve is None:
            runs.append(_run_model(str(path), configs, limit, device, batch_size, url, chat, think, concurrency,
                                   keep))
            if role == "baseline" and after_baseline is not None:
                after_baseline()
            measured[role] = {"engine": "server", "url": url} if url else {"engine": "transformers", "device": device}
            measured[role].update(how)
            if think:
                _thinking(measured[role], think.record(served=bool(url)))
            continue
        from ..engines.serve import Pair, Served, run_served
        from .thinking import parser_of

        parser = parser_of(Path(path), serve) if think and think.on else None
        top_k = kld_plan.top_k if kld_plan else None

        def work(s, path=path, role=role):
            res = _run_model(str(path), configs, limit, device, batch_size, s.url, chat, think, concurrency)
            if kld_plan:
                from .kld import served_rows

                rows[role] = served_rows(s, kld_plan.chunks, top_k, role)
            return res

        server = (Pair(pd_prefill, path, role=role, reasoning_parser=parser, logprobs=top_k, **srv)
                  if pd_prefill is not None and role == "candidate" else
                  Served(serve, path, role=role, reasoning_parser=parser, logprobs=top_k,
                         **{**srv, **({"kv_cache_dtype": baseline_kv} if baseline_kv and role == "baseline" else {})}))
        with server as s:
            runs.append(run_served(s, work))
            measured[role] = {**s.record(), **how}
            if think:
                _thinking(measured[role], think.record(s.reasoning_parser, served=True))
    return runs[0], runs[1], measured, rows


def _kld(baseline, candidate, kld_plan, rows: dict, measured: dict, tokens: int, chunk: int, top_k: int, device,
         kld_base: Path | None = None, reused: bool = False, results=None, loaded: dict | None = None,
         kept: Path | None = None):
    """``--kld-out``'s report: from the served rows of both launches, or (local) eval-kld's own
    comparison on the candidate the tasks ran on (``loaded``) against the baseline's
    log-probabilities, written after its tasks to ``kept`` (``kld.baseline_pass``; to ``kld_base``
    too with --save-baseline) or read from ``kld_base`` (``reused``: --baseline-results)."""
    from .kld import kld, served_report

    if kld_plan is None:
        try:
            return kld(baseline, candidate, tokens=tokens, chunk=chunk, top_k=top_k, device=device,
                       baseline_logits=kld_base if reused else kept, loaded=loaded)
        except QuantizeError as e:
            if not reused:
                raise
            raise type(e)(f"--baseline-results {results}: its KL side: {e}") from e
    where = {r: _kl_where(measured[r]) for r in measured}
    return served_report(str(baseline), Path(candidate), kld_plan.chunks, rows["baseline"], rows["candidate"],
                         chunk, kld_plan.text, top_k, where)


def _kl_where(where: dict) -> dict:
    """Where a model was measured, as a KL report says it: without the tasks' prompts and thinking."""
    return {k: v for k, v in where.items() if k not in ("prompts", "thinking")}


def _thinking(where: dict, rec: dict) -> None:
    """A model's thinking setting in its record, and said in its prompts (what the card shows)."""
    where["thinking"] = rec
    where["prompts"] = f"{where['prompts']}; {rec['said']}"


def _check_chat(configs: list, folders: list) -> dict:
    """``--chat`` with a generation task, before anything runs: every folder has a chat template.
    -> {folder: its tokenizer} (empty without a generation task), for ``thinking.resolve``."""
    if not any(output_type(c) == "generate_until" for c in configs):
        return {}
    toks = {str(f): chat_tokenizer(Path(f)) for f in folders}
    for f, tok in toks.items():
        if not getattr(tok, "chat_template", None):
            raise QuantizeError(f"--chat: {f} has no chat template (tokenizer_config.json `chat_template` or "
                                "chat_template.jinja); drop --chat, or add the model's template")
    return toks


def chat_tokenizer(folder: Path):
    """The folder's tokenizer as transformers loads it, with its chat template (chat_template.jinja,
    additional_chat_templates/, or tokenizer_config.json's ``chat_template``): what lm-eval and the
    engines render."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - transformers' own failure, as one line
        raise QuantizeError(f"--chat: {folder}: transformers cannot load its tokenizer ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:160] if str(e) else ''}); fix the tokenizer files") from e


def _paired(rb: dict, rc: dict, groups: dict, max_drop: float, resamples: int) -> list[TaskResult]:
    """Per task, the two models' scores of the same documents, paired, with the gate."""
    results = []
    for t, subs in groups.items():
        a_all, b_all, docs, metric = [], [], [], None
        for s in subs:
            sb, sc = rb["samples"].get(s, []), rc["samples"].get(s, [])
            if not sb:
                continue
            metric = metric or _metric(sb)
            da, dc = _per_doc(sb, metric), _per_doc(sc, metric)
            if set(da) != set(dc):
                raise QuantizeError(f"{t}/{s}: the two models were scored on different documents; "
                                    f"rerun both with the same --limit")
            keys = sorted(da)
            a_all += [da[k] for k in keys]
            b_all += [dc[k] for k in keys]
            docs += [f"{s}/{k}" for k in keys]
        if not a_all:
            raise QuantizeError(f"{t}: no documents were scored; check --data-dir and --limit")
        a, b = np.array(a_all), np.array(b_all)
        n = len(a)
        se = lambda x: float(x.std(ddof=1) / np.sqrt(n) * 100) if n > 1 else 0.0  # noqa: E731
        delta, lo, hi = paired_stats(a, b, resamples)
        results.append(TaskResult(t, metric, n, float(a.mean() * 100), se(a), float(b.mean() * 100), se(b), delta,
                                  lo, hi, hi >= -max_drop, lo >= -max_drop, docs, a_all, b_all))
    return results


def _model_folder(path, served: bool = False) -> None:
    """A model folder (served: at least its tokenizer, the server runs the model)."""
    p = Path(path)
    if not p.is_dir():
        raise QuantizeError(f"{p}: {'no such folder' if not p.exists() else 'not a folder'}; pass a model folder")
    if not (p / "config.json").is_file() and not (served and (p / "tokenizer.json").is_file()):
        raise QuantizeError(f"{p}: no config.json; pass a model folder")
