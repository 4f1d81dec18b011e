"""`eval --serve` / `eval-kld --serve`: the tool launches the engine, waits for it, evaluates
through it and stops its whole process group, also on failure. These use a stand-in launcher
(tests/fake_engine.py, behind a fake interpreter) for what a real engine cannot be made to show
on demand: a failed start, a hang, a death mid-run, an old version. The real engine (vLLM's CPU
build) is tests/test_serve_vllm.py."""

import json
import os
import re
import shutil
import socket
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'quantize[eval]')")

from quantize.engines import serve as sv  # noqa: E402
from quantize.errors import QuantizeError  # noqa: E402
from quantize.evaluate.kld import _chunks, kld_table  # noqa: E402
from quantize.evaluate.run import evaluate  # noqa: E402
from quantize.evaluate.served import position_kl, sparse  # noqa: E402

from .test_eval import _data, models  # noqa: E402,F401 - the fixture

FAKE = Path(__file__).with_name("fake_engine.py")


def _fake_python(tmp_path: Path, version: str = "0.32.0", router: bool = True) -> Path:
    """An executable standing in for a venv's python: answers the version probe (``-c``; with
    ``router`` False, as a venv without sglang-router), and runs tests/fake_engine.py for ``-m
    vllm.entrypoints.openai.api_server --model ...`` (or SGLang's server, or its router)."""
    p = tmp_path / ("fakebin" if router else "fakebin-norouter") / "python"
    p.parent.mkdir(parents=True, exist_ok=True)
    probe = "" if router else 'case "$2" in *sglang-router*) exit 3;; esac; '
    p.write_text(f'#!/bin/sh\ncase "$1" in -c) {probe}echo "{version}"; exit 0;; esac\nshift 2\n'
                 f'exec {sys.executable} {FAKE} "$@"\n')
    p.chmod(0o755)
    return p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _children(log_dir: Path) -> list[int]:
    return [int(m) for f in log_dir.glob("*.log") for m in re.findall(r"fake engine: child (\d+)", f.read_text())]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_eval_through_launched_servers_equals_local_and_stops_them(models, tmp_path, monkeypatch):
    """Each model launched once for its tasks and its KL log-probs (--kld-out; vLLM with
    --max-logprobs to match), 4 requests in flight (--concurrency, lm-eval's num_concurrent): the
    local run's item scores, and the served KL is the local run's top-k estimate (the stand-in serves
    transformers' own log-probs); both servers stopped after."""
    import lm_eval

    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    data, logs = _data(tmp_path), tmp_path / "logs"
    kw = dict(tasks="arc_easy", limit=3, data_dir=data, resamples=200, kld_tokens=40, kld_chunk=20, kld_top_k=5)
    local = evaluate(base, cand, kld_out=tmp_path / "kld-local.json", **kw)
    seen, real = [], lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: seen.append(kw["model_args"]) or real(**kw))
    saved = tmp_path / "base.json"
    rep = evaluate(base, cand, serve="vllm", engine_python=_fake_python(tmp_path), serve_log=logs,
                   out=tmp_path / "r.json", concurrency=4, kld_out=tmp_path / "kld.json", save_baseline=saved, **kw)
    assert [a["num_concurrent"] for a in seen] == [4, 4]
    assert rep.tasks[0].n == 3 and rep.tasks[0].docs == local.tasks[0].docs
    assert (rep.tasks[0].baseline_items, rep.tasks[0].candidate_items) == (local.tasks[0].baseline_items,
                                                                          local.tasks[0].candidate_items)
    assert (rep.tasks[0].baseline, rep.tasks[0].candidate) == (local.tasks[0].baseline, local.tasks[0].candidate)
    k = json.loads((tmp_path / "kld.json").read_text())
    assert k["written_by"]["kind"] == "kld" and k["estimator"] == "top-5 lower bound (served)" and k["tokens"] == 40
    # the local estimate in fp32 (topk_kl), the served one from float log-probs in float64: equal to 1e-4
    assert k["kld_mean"] == pytest.approx(local.kld.kld_topk_mean, rel=1e-4) and local.kld.estimator == "full vocabulary"
    assert k["top1_agreement"] == local.kld.top1_agreement
    assert k["ppl_candidate"] == pytest.approx(local.kld.ppl_candidate, rel=1e-4)
    m = json.loads((tmp_path / "r.json").read_text())["measured"]
    assert m["baseline"]["engine"] == m["candidate"]["engine"] == "vllm" and m["candidate"]["version"] == "0.32.0"
    assert "-m vllm.entrypoints.openai.api_server --model" in m["candidate"]["launch"]
    assert "--max-logprobs 5" in m["candidate"]["launch"] == k["measured"]["candidate"]["launch"]
    assert str(Path(cand).resolve()) in m["candidate"]["launch"]
    assert m["baseline"]["model"] == str(Path(base).resolve())
    assert len(list(logs.glob("vllm-*.log"))) == 2  # one log per server, tasks and KL in each, named in the record
    for role in ("baseline", "candidate"):
        port = int(m[role]["launch"].split("--port ")[1].split()[0])
        assert not _listening(port)  # stopped
    assert local.measured["candidate"] == {"engine": "transformers", "device": "cpu"}
    # the next candidate against the saved baseline (its tasks and its KL side, base.kld.safetensors): the
    # candidate alone served, the same items and the same KL
    py, logs2 = _fake_python(tmp_path), tmp_path / "logs2"
    again = evaluate(base, cand, serve="vllm", engine_python=py, serve_log=logs2, baseline_results=saved,
                     kld_out=tmp_path / "kld2.json", **kw)
    assert [p.name.split("-")[1] for p in logs2.glob("vllm-*.log")] == ["candidate"]
    assert again.tasks[0].baseline_items == rep.tasks[0].baseline_items and again.kld.tokens == 40
    k2 = json.loads((tmp_path / "kld2.json").read_text())
    for key in ("kld_mean", "kld_max", "top1_agreement", "ppl_baseline", "ppl_candidate"):
        assert k2[key] == k[key], key
    assert k2["measured"]["baseline"]["reused"] is True and k2["measured"]["baseline"]["engine"] == "vllm"
    # a saved baseline reused for another KL run, locally, or without its KL side: one line before any launch
    never = tmp_path / "never"
    tasks_only = tmp_path / "tasks-only.json"
    evaluate(base, cand, save_baseline=tasks_only, **kw)  # local, no --kld-out: the tasks' side alone
    assert not (tmp_path / "tasks-only.kld.safetensors").exists()
    for res, bad, match in ((saved, dict(kld_top_k=6), r"--baseline-results \S+base.json: its KL side: .*saved for "
                                                       r"--top-k 5 \(this run: 6\)"),
                            (saved, dict(kld_tokens=30), r"its KL side: .*saved for --tokens 40 \(this run: 30\)"),
                            (saved, dict(serve=None), r"its KL side: .*saved by a served run"),
                            (tasks_only, {}, r"tasks-only.json: saved without --kld-out, so it holds no KL baseline")):
        with pytest.raises(QuantizeError, match=match):
            evaluate(base, cand, **{**kw, "serve": "vllm", "engine_python": py, "serve_log": never,
                                    "baseline_results": res, "kld_out": tmp_path / "k3.json", **bad})
    (tmp_path / "base.kld.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(QuantizeError, match=r"its KL side \S+base.kld.safetensors is missing; keep the two files"):
        evaluate(base, cand, **kw, serve="vllm", engine_python=py, serve_log=never, baseline_results=saved,
                 kld_out=tmp_path / "k3.json")
    assert not never.exists() and not (tmp_path / "k3.json").exists()
    # --kld-out refused before any launch: a user's server, the --out file, the saved baseline's KL side
    for bad, match in ((dict(base_url="http://127.0.0.1:9"), r"--kld-out with --base-url/--baseline-url: .*use "
                                                              r"--serve ENGINE"),
                       (dict(out=tmp_path / "k2.json"), r"--kld-out \S+k2.json: the same file as --out"),
                       (dict(save_baseline=tmp_path / "k2.json"), r"--save-baseline \S+k2.json: its KL side \S+"
                                                                  r"k2.kld.safetensors is the file --kld-out names")):
        kld_to = tmp_path / ("k2.kld.safetensors" if "save_baseline" in bad else "k2.json")
        with pytest.raises(QuantizeError, match=match):
            evaluate(base, cand, serve=None if "base_url" in bad else "vllm", engine_python=py,
                     kld_out=kld_to, **kw, **bad)


def test_a_server_that_fails_to_start_is_one_line_with_its_log(models, tmp_path, monkeypatch):
    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "fail")
    with pytest.raises(QuantizeError) as e:
        evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=_data(tmp_path), serve="vllm",
                 engine_python=_fake_python(tmp_path), serve_log=tmp_path / "logs")
    msg = str(e.value)
    assert "\n" not in msg and "exited with status 1 before it answered" in msg
    assert "ValueError: fake engine refuses this model" in msg and str(tmp_path / "logs") in msg


def test_a_server_that_never_answers_is_stopped_at_the_timeout_with_its_children(models, tmp_path, monkeypatch):
    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "never")
    logs = tmp_path / "logs"
    t0 = time.time()
    with pytest.raises(QuantizeError, match=r"did not answer http://127\.0\.0\.1:\d+/health within 3 s "
                                            r"\(--serve-timeout-s\)"):
        evaluate(base, cand, tasks="arc_easy", limit=1, data_dir=_data(tmp_path), serve="vllm",
                 engine_python=_fake_python(tmp_path), serve_log=logs, serve_timeout_s=3)
    assert time.time() - t0 < 3 + sv.GRACE_S + 10
    kids = _children(logs)
    assert kids and not any(_alive(k) for k in kids)  # the whole process group, not only the launcher


def test_a_server_killed_mid_run_is_one_line_and_leaves_no_process(models, tmp_path, monkeypatch):
    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "die")
    logs = tmp_path / "logs"
    with pytest.raises(QuantizeError) as e:
        evaluate(base, cand, tasks="arc_easy", limit=2, data_dir=_data(tmp_path), serve="vllm",
                 engine_python=_fake_python(tmp_path), serve_log=logs)
    msg = str(e.value)
    assert "\n" not in msg and "was killed by signal 9 during the evaluation" in msg and "fake engine: dying" in msg
    kids = _children(logs)
    assert kids and not any(_alive(k) for k in kids)


def _ipc_sockets(log_dir: Path) -> list[Path]:
    return [Path(m) for p in log_dir.glob("vllm-*.log") for m in re.findall(r"fake engine: ipc (\S+)", p.read_text())]


@pytest.mark.parametrize("mode", ["ok", "die"])
def test_a_launch_leaves_no_ipc_sockets_behind(models, tmp_path, monkeypatch, mode):
    """vLLM puts its ZMQ sockets in VLLM_RPC_BASE_PATH (default: the temp folder) and a server stopped
    by a signal leaves them there, three a launch: each launch gets a private folder, removed once its
    process group is gone, after a clean run or a server that died; a folder the caller named is theirs
    and is kept (the near miss)."""
    import tempfile

    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", mode)
    kw = dict(tasks="arc_easy", limit=2, data_dir=_data(tmp_path), serve="vllm", engine_python=_fake_python(tmp_path))
    logs = tmp_path / "logs"
    if mode == "ok":  # two launches, one after the other, as an evaluation's baseline and candidate
        for model in (base, cand):
            with sv.Served("vllm", model, python=kw["engine_python"], log_dir=logs):
                pass
    else:  # the evaluation's server dies on its first request
        with pytest.raises(QuantizeError, match="was killed by signal 9"):
            evaluate(base, cand, serve_log=logs, **kw)
    socks = _ipc_sockets(logs)
    assert len(socks) == (2 if mode == "ok" else 1)  # one per launch
    for p in socks:
        assert p.parent.parent == Path(tempfile.gettempdir()) and p.parent.name.startswith("qipc-")
        assert not p.parent.exists(), p
    assert len({p.parent for p in socks}) == len(socks)  # private to each launch
    if mode == "ok":  # one launch each, without an evaluation
        with tempfile.TemporaryDirectory(prefix="mine-") as d:  # short: pytest-xdist's tmp_path can be too deep
            mine = Path(d)
            monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(mine))
            with sv.Served("vllm", base, python=kw["engine_python"], log_dir=tmp_path / "logs2"):
                pass
            socks = _ipc_sockets(tmp_path / "logs2")
            assert len(socks) == 1 and all(p.parent == mine and p.is_socket() for p in socks)
        # a temp folder too deep for a socket's 107 bytes: the engine keeps its own default
        monkeypatch.delenv("VLLM_RPC_BASE_PATH")
        deep = tmp_path / ("d" * 60)
        deep.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(deep))
        with sv.Served("vllm", base, python=kw["engine_python"], log_dir=tmp_path / "logs3"):
            pass
        assert _ipc_sockets(tmp_path / "logs3") == [] and not list(deep.glob("qipc-*"))


def test_an_engine_that_answers_500_is_named_by_its_logged_cause_not_a_limit(models, tmp_path, monkeypatch):
    """vLLM's API server stays up after its engine core died and answers 500: the one line quotes the
    root cause from the log (seen with vLLM CPU 0.32.0: INT4 weights served in fp32), not the advice to
    lower --top-k that a refused request (4xx) gets, for eval-kld and for lm-eval's tasks alike."""
    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "broken")
    py, logs = _fake_python(tmp_path), tmp_path / "logs"
    with pytest.raises(QuantizeError) as e:
        kld_table(base, [cand], tokens=16, chunk=8, serve="vllm", engine_python=py, serve_log=logs)
    msg = str(e.value)
    assert "\n" not in msg and "the engine failed on a prompt of 9 tokens (500 from http://127.0.0.1:" in msg
    assert "NotImplementedError: \"cpu_gemm_wna16\" not implemented for 'Float'" in msg and "--top-k" not in msg
    log = next(logs.glob("vllm-*.log"))
    assert not _listening(int(log.stem.rsplit("-", 1)[1]))
    # lm-eval's own failure through such a server (after its retries): the same cause, from the same log
    s = sv.Served("vllm", base, python=py)
    s.log = log

    def client(s):
        raise RuntimeError("RetryError[<Future at 0x1 state=finished raised ClientResponseError>]")

    with pytest.raises(QuantizeError) as e:
        sv.run_served(s, client)
    msg = str(e.value)
    assert "\n" not in msg and "failed (RuntimeError: RetryError[" in msg
    assert "the server's log says: NotImplementedError: \"cpu_gemm_wna16\"" in msg and str(log) in msg


def test_thinking_on_launches_the_engine_with_the_familys_reasoning_parser(models, tiny, tmp_path, monkeypatch):
    """--chat --thinking on: the engine gets the registry's reasoning parser for the model's family
    (here a Qwen3 config), once, and not when --serve-args names one or thinking is off; the families
    this tool is for have theirs in both engines."""
    from quantize.evaluate.thinking import parser_of

    from .test_eval import _switched

    base, cand = models
    b, c = _switched(base, tmp_path / "b"), _switched(cand, tmp_path / "c")
    for f in (b, c):
        cfg = json.loads((f / "config.json").read_text())
        (f / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    monkeypatch.setenv("FAKE_ENGINE_MODE", "fail")  # stops at the baseline's launch, whose line heads its log
    kw = dict(tasks="gsm8k", limit=1, data_dir=_data(tmp_path), chat=True, max_gen_toks=1024, serve="vllm",
              engine_python=_fake_python(tmp_path))
    for n, (extra, want) in enumerate((({"thinking": "on"}, "--reasoning-parser qwen3"),
                                       ({"thinking": "on", "serve_args": "--reasoning-parser=deepseek_r1"},
                                        "--reasoning-parser=deepseek_r1"), ({}, None))):
        with pytest.raises(QuantizeError, match="exited with status 1 before it answered"):
            evaluate(b, c, **kw, **extra, serve_log=tmp_path / f"logs{n}")
        line = next((tmp_path / f"logs{n}").glob("vllm-baseline-*.log")).read_text().splitlines()[0]
        assert line.count("--reasoning-parser") == (1 if want else 0) and (want or "") in line, line
    s = sv.Served("vllm", b, python=_fake_python(tmp_path), reasoning_parser="qwen3", extra_args="--reasoning-parser x")
    assert s.reasoning_parser == "x" and s.launch_line().count("--reasoning-parser") == 1
    assert (parser_of(tiny("glm_moe_dsa"), "sglang"), parser_of(tiny("kimi_k25"), "sglang"),
            parser_of(tiny("kimi_k25"), "vllm"), parser_of(Path(base), "vllm")) == ("glm45", "kimi_k2", "kimi_k2", None)


def test_engine_missing_old_or_port_taken_is_refused_before_a_launch(models, tmp_path, monkeypatch):
    base, cand = models
    kw = dict(tasks="arc_easy", limit=1, data_dir=_data(tmp_path))
    with pytest.raises(QuantizeError, match=r"has no vllm installed"):
        evaluate(base, cand, serve="vllm", engine_python=sys.executable, **kw)  # this venv: no vLLM
    with pytest.raises(QuantizeError, match=r"has vllm 0\.31\.9, older than 0\.32"):
        evaluate(base, cand, serve="vllm", engine_python=_fake_python(tmp_path / "old", "0.31.9"), **kw)
    # the oldest accepted passes the version check (and then starts: mode fail here, to stop at once)
    monkeypatch.setenv("FAKE_ENGINE_MODE", "fail")
    with pytest.raises(QuantizeError, match=r"exited with status 1"):
        evaluate(base, cand, serve="vllm", engine_python=_fake_python(tmp_path / "new", "0.32.0"), **kw)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(QuantizeError, match=rf"--serve-port {port}: 127\.0\.0\.1:{port} is in use"):
            evaluate(base, cand, serve="vllm", engine_python=_fake_python(tmp_path), serve_port=port, **kw)
    with pytest.raises(QuantizeError, match=r"--serve vllm launches the servers itself; drop --base-url"):
        evaluate(base, cand, serve="vllm", base_url="http://127.0.0.1:9", **kw)
    monkeypatch.delenv("QUANTIZE_SGLANG_PYTHON", raising=False)
    with pytest.raises(QuantizeError, match=r"--serve sglang: no interpreter named; pass --engine-python"):
        evaluate(base, cand, serve="sglang", **kw)


def _flag(line: str, flag: str) -> str:
    return line.split(flag + " ")[1].split()[0]


def test_a_pd_pair_serves_the_candidate_behind_its_router_and_all_three_stop(models, tmp_path, monkeypatch):
    """--serve sglang --serve-pd-prefill SRC: the baseline served alone, then the candidate as SGLang's
    pair: the prefill pool (SRC) on GPUs 0..tp-1, the decode pool (the candidate) from GPU tp on, one
    bootstrap port and the same KV-cache dtype for both, an NCCL port each, and the router told the
    prefill pool's bootstrap port. The stand-in router passes requests to the decode pool, so the
    items are the local run's; all four servers are stopped after."""
    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the 2 x --tp 2 GPUs the pair needs, exactly
    data, logs = _data(tmp_path), tmp_path / "logs"
    kw = dict(tasks="gsm8k", limit=2, data_dir=data, max_gen_toks=4, resamples=200)
    local = evaluate(base, cand, **kw)
    rep = evaluate(base, cand, serve="sglang", engine_python=_fake_python(tmp_path, "0.5.23"), serve_log=logs,
                   serve_pd_prefill=base, tp=2, kv_cache_dtype="fp8_e4m3", out=tmp_path / "r.json", **kw)
    assert (rep.tasks[0].baseline_items, rep.tasks[0].candidate_items) == (local.tasks[0].baseline_items,
                                                                          local.tasks[0].candidate_items)
    m = json.loads((tmp_path / "r.json").read_text())["measured"]
    assert "pd_prefill" not in m["baseline"] and "--disaggregation-mode" not in m["baseline"]["launch"]
    c = m["candidate"]
    decode, prefill, router = c["launch"], c["pd_prefill"], c["pd_router"]
    assert (c["engine"], c["version"], c["prefill_model"]) == ("sglang", "0.5.23", str(Path(base).resolve()))
    assert "--disaggregation-mode decode" in decode and "--base-gpu-id 2" in decode
    assert "--disaggregation-mode prefill" in prefill and "--base-gpu-id" not in prefill
    assert f"--model-path {Path(cand).resolve()}" in decode and f"--model-path {Path(base).resolve()}" in prefill
    for line in (decode, prefill):
        assert "--tp 2" in line and "--kv-cache-dtype fp8_e4m3" in line
        assert "--disaggregation-transfer-backend mooncake" in line
    boot = _flag(prefill, "--disaggregation-bootstrap-port")
    assert _flag(decode, "--disaggregation-bootstrap-port") == boot
    assert _flag(decode, "--nccl-port") != _flag(prefill, "--nccl-port")
    ports = {r: _flag(x, "--port") for r, x in (("prefill", prefill), ("decode", decode), ("router", router))}
    assert (f"-m sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:{ports['prefill']} {boot} "
            f"--decode http://127.0.0.1:{ports['decode']} --host 127.0.0.1 --port {ports['router']}") in router
    assert sorted(p.name.rsplit("-", 1)[0] for p in logs.glob("*.log")) == [
        "sglang-baseline", "sglang-candidate-decode", "sglang-candidate-prefill", "sglang-router-candidate-router"]
    for port in (*ports.values(), _flag(m["baseline"]["launch"], "--port")):
        assert not _listening(int(port))
    # --serve-args naming a transfer backend: the pools get that one alone
    pair = sv.Pair(base, cand, python=_fake_python(tmp_path, "0.5.23"), extra_args="--disaggregation-transfer-backend "
                   "nixl", log_dir=tmp_path / "l2")
    for s in (pair.prefill, pair.decode):
        assert s.launch_line().count("--disaggregation-transfer-backend") == 1 and "backend nixl" in s.launch_line()


def test_a_pd_pair_is_refused_before_any_launch_where_it_cannot_measure_the_candidate(models, tmp_path, monkeypatch):
    """A pair is SGLang's; through it a log-likelihood task or KL would read the prefill pool's log-probs,
    not the candidate's; its prefill folder must be the candidate's model and tokenizer; its router
    must be installed: each one line, before any server starts."""
    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    data, logs = _data(tmp_path), tmp_path / "logs"
    py = _fake_python(tmp_path, "0.5.23")
    kw = dict(tasks="gsm8k", limit=1, data_dir=data, serve_log=logs, serve_pd_prefill=base)
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((Path(base) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    folded = tmp_path / "folded"  # the candidate as calibrate-kv --fold writes it (its manifest says so)
    shutil.copytree(cand, folded)
    (folded / "quantize_manifest.json").write_text(json.dumps({"kind": "calibrate-kv", "mode": "fold"}))
    from .lineage import made_from

    made_from(folded, cand)  # its source, as calibrate-kv records it (eval compares only what was made from base)
    scaled = tmp_path / "scaled"  # the candidate with KV-cache scales (calibrate-kv --target compressed-tensors)
    shutil.copytree(cand, scaled)
    ccfg = json.loads((scaled / "config.json").read_text())
    ccfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    (scaled / "config.json").write_text(json.dumps(ccfg))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a pair at --tp 1 fits, at --tp 2 it does not
    for extra, match in (
            (dict(serve="vllm", engine_python=_fake_python(tmp_path)), r"a prefill/decode pair is SGLang's \(its "
                                                                       r"router, sglang_router\); add --serve sglang, not --serve vllm"),
            ({}, r"add --serve sglang$"),
            (dict(serve="sglang", engine_python=py, kld_out=tmp_path / "k.json"),
             r"--serve-pd-prefill with --kld-out: through the pair every prompt's log-probs come from the prefill pool"),
            (dict(serve="sglang", engine_python=py, tasks="arc_easy,gsm8k"),
             r"--serve-pd-prefill: arc_easy score\(s\) prompt log-probs, which the prefill pool \(\S+\) computes, not the "
             r"candidate"),
            (dict(serve="sglang", engine_python=py, serve_pd_prefill=tmp_path / "nowhere"),
             r"--serve-pd-prefill \S+nowhere: no such folder"),
            (dict(serve="sglang", engine_python=py, serve_pd_prefill=other), r"--candidate \S+: a .* model, "
                                                                            r"--serve-pd-prefill \S+other a .*qwen3"),
            (dict(serve="sglang", engine_python=py, _candidate=folded),
             r"--serve-pd-prefill: \S+folded is calibrate-kv --fold's output, whose cached MLA latent is rescaled, but "
             r"the prefill pool \(\S+\) writes the unfolded cache it would read"),
            (dict(serve="sglang", engine_python=py, _candidate=scaled),
             r"--serve-pd-prefill: \S+scaled has KV-cache scales \(kv_cache_scheme, from calibrate-kv --target "
             r"compressed-tensors\) and the prefill pool's \S+ none: the decode pool would read"),
            (dict(serve="sglang", engine_python=py, tp=2),
             r"--serve-pd-prefill with --tp 2: the pair needs 4 GPUs on this node \(prefill 0\.\.1, decode 2\.\.3\) "
             r"and 2 are visible"),
            (dict(serve="sglang", engine_python=py, serve_args="--base-gpu-id 4"),
             r"--serve-pd-prefill with --serve-args --base-gpu-id: the pair places its pools itself"),
            (dict(serve="sglang", engine_python=_fake_python(tmp_path, "0.5.23", router=False)),
             r"--serve-pd-prefill: the PD pair needs SGLang's router beside SGLang: \S+ has no sglang-router 0\.3 or "
             r"later; install it there \(pip install sglang-router\)")):
        extra = dict(extra)
        with pytest.raises(QuantizeError, match=match) as e:
            evaluate(base, extra.pop("_candidate", cand), **{**kw, **extra})
        assert "\n" not in str(e.value)
        assert not logs.exists()  # nothing launched


def test_a_pd_pool_that_fails_or_dies_is_one_line_and_the_pair_is_stopped(models, tmp_path, monkeypatch):
    base, cand = models
    py = _fake_python(tmp_path, "0.5.23")
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    monkeypatch.setenv("FAKE_ENGINE_PREFILL_MODE", "fail")
    pair = sv.Pair(base, cand, python=py, log_dir=tmp_path / "l1")
    with pytest.raises(QuantizeError) as e:
        pair.start()
    msg = str(e.value)
    assert "\n" not in msg and f"the PD pair's prefill server for {Path(base).resolve()} exited with status 1" in msg
    assert "ValueError: fake engine refuses this model" in msg
    assert all(s.proc is None or s.proc.poll() is not None for s in pair.servers)  # the decode pool stopped too
    assert pair.router.proc is None  # never started
    # healthy, then the prefill pool killed mid-run: the evaluation ends in one line naming it, all stopped
    monkeypatch.setenv("FAKE_ENGINE_PREFILL_MODE", "ok")

    def work(p):
        os.killpg(p.prefill.proc.pid, 9)
        time.sleep(30)

    # as in a process started with SIGINT ignored (a shell's background job): the watchdog's interrupt
    # must still reach the main thread, well before the 30 s of work end
    was = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sv.Pair(base, cand, python=py, log_dir=tmp_path / "l2") as pair:
            t0 = time.monotonic()
            with pytest.raises(QuantizeError) as e:
                sv.run_served(pair, work)
            assert time.monotonic() - t0 < 20
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # the process's own setting back
    finally:
        signal.signal(signal.SIGINT, was)
    msg = str(e.value)
    assert "\n" not in msg and f"the PD pair's prefill server for {Path(base).resolve()} was killed by signal 9" in msg
    assert all(s.proc.poll() is not None for s in pair.servers)


def test_version_parsing():
    assert sv._parse_version("0.32.0") == (0, 32, 0) >= (0, 32)
    assert sv._parse_version("0.5.23.post1") == (0, 5, 23)
    assert sv._parse_version("0.33.0+cpu") == (0, 33, 0)
    assert sv._parse_version("0.31.99") < (0, 32)


def test_cli_failed_launch_is_one_line_exit_2(models, tmp_path):
    base, cand = models
    env = {**os.environ, "FAKE_ENGINE_MODE": "fail"}
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "eval", "--baseline", str(base), "--candidate",
                        str(cand), "--tasks", "arc_easy", "--limit", "1", "--data-dir", str(_data(tmp_path)),
                        "--serve", "vllm", "--engine-python", str(_fake_python(tmp_path))],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "exited with status 1 before it answered" in errors[0]
    assert "Traceback" not in p.stderr


# -- KL divergence through the server ---------------------------------------------------------------


def test_served_kld_is_the_estimator_on_the_local_log_probs(models, tmp_path, monkeypatch):
    """The stand-in serves transformers' own log-probs: the served report must be the top-k
    estimator applied to the local full log-probabilities, position by position."""
    import torch
    import transformers

    from quantize.evaluate.kld import _logprobs, read_text

    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    table = kld_table(base, [cand], text=text, tokens=120, chunk=50, serve="vllm", top_k=5,
                      engine_python=_fake_python(tmp_path), out=tmp_path / "k.json")
    rep = table.reports[0]
    assert rep.estimator == "top-5 lower bound (served)" and rep.top_k == 5
    assert rep.measured["baseline"]["engine"] == "vllm"
    tok = transformers.AutoTokenizer.from_pretrained(cand)
    ids = torch.tensor(tok(read_text(text)[1])["input_ids"][:121])
    mb = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    mc = transformers.AutoModelForCausalLM.from_pretrained(cand, dtype=torch.float32).eval()
    est, full = [], []
    for c in _chunks(ids, 50):
        lb, lc = _logprobs(mb, c[:-1]), _logprobs(mc, c[:-1])
        for j in range(c.numel() - 1):
            t = int(c[j + 1])
            est.append(position_kl(sparse(lb[j], 5, t), sparse(lc[j], 5, t)))
        full += (lb.exp() * (lb - lc)).sum(-1).clamp_min(0).tolist()
    assert rep.tokens == len(est) == 120
    assert rep.kld_mean == pytest.approx(sum(est) / len(est), rel=1e-6)
    assert rep.kld_mean <= sum(full) / len(full) * (1 + 1e-6)  # a lower bound of the full-vocabulary KL
    assert json.loads((tmp_path / "k.json").read_text())["estimator"] == "top-5 lower bound (served)"


def test_a_saved_served_baseline_is_reused_for_the_next_candidate_and_refused_for_another_run(models, tmp_path,
                                                                                               monkeypatch):
    """`eval-kld --serve --save-baseline F` keeps the served baseline's top-k rows; the next run with
    `--baseline-logits F` serves only the candidate and gives the same report; a file of another
    --top-k, --tokens or model, a local baseline file with --serve, and a served one without, are
    each one line before any engine starts."""
    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    kw = dict(text=text, tokens=80, chunk=40, serve="vllm", top_k=5, engine_python=_fake_python(tmp_path))
    saved = tmp_path / "base-served.safetensors"
    first = kld_table(base, [cand], save_baseline=saved, serve_log=tmp_path / "l1", **kw).reports[0]
    logs = tmp_path / "l2"
    again = kld_table(None, [cand], baseline_logits=saved, serve_log=logs, **kw).reports[0]
    assert [p.name.split("-")[1] for p in logs.glob("vllm-*.log")] == ["candidate"]  # the baseline is not served
    for k in ("kld_mean", "kld_max", "top1_agreement", "ppl_baseline", "ppl_candidate", "tokens"):
        assert getattr(again, k) == getattr(first, k), k
    assert again.measured["baseline"]["reused"] == str(saved) and again.measured["baseline"]["engine"] == "vllm"
    # --baseline given too: it must be the saved one's model (checked before any engine starts, as below)
    import torch
    import transformers

    from quantize.evaluate.kld import _open_served, _run_identity, read_text

    tok = transformers.AutoTokenizer.from_pretrained(cand)
    raw = read_text(text)[1]
    ids = torch.tensor(tok(raw)["input_ids"][:81])
    rows, _ = _open_served(saved, _run_identity(raw, 80, 40, ids, tok), 5, _chunks(ids, 40), cand, base)
    assert sum(len(r) for r in rows) == first.tokens
    never = tmp_path / "never"
    for change, msg in ((dict(top_k=6), r"saved for --top-k 5 \(this run: 6\)"),
                        (dict(tokens=60), r"saved for --tokens 80 \(this run: 60\)")):
        with pytest.raises(QuantizeError, match=msg):
            kld_table(None, [cand], baseline_logits=saved, serve_log=never, **{**kw, **change})
    with pytest.raises(QuantizeError, match=r"saved from another model than --baseline .*; .*or drop --baseline"):
        kld_table(cand, [cand], baseline_logits=saved, serve_log=never, **kw)
    local = tmp_path / "base-local.safetensors"
    kld_table(base, [cand], text=text, tokens=80, chunk=40, save_baseline=local)
    with pytest.raises(QuantizeError, match=r"saved by a local run \(full log-probabilities\)"):
        kld_table(None, [cand], baseline_logits=local, serve_log=never, **kw)
    with pytest.raises(QuantizeError, match=r"saved by a served run \(the baseline's top-k only\)"):
        kld_table(None, [cand], text=text, tokens=80, chunk=40, baseline_logits=saved)
    assert not never.exists()  # no engine was started for a refused run


def test_the_baseline_is_served_with_its_own_kv_cache_and_a_saved_one_must_match(models, tmp_path, monkeypatch):
    """`--baseline-kv-cache-dtype auto` beside `--kv-cache-dtype fp8_e4m3`: the vendor's model served
    with the engine's own cache, the candidate with FP8 (the launch lines and records say so), in
    eval and in eval-kld; a saved baseline reused by a served run must have been served with the
    cache this run gives the baseline (the default: --kv-cache-dtype), else one line before any
    launch; the option without --serve, or on a baseline transformers ran, is one line too."""
    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    py, data = _fake_python(tmp_path), _data(tmp_path)
    kw = dict(tasks="arc_easy", limit=2, data_dir=data, resamples=200, serve="vllm", engine_python=py,
              kv_cache_dtype="fp8_e4m3")
    saved = tmp_path / "base.json"
    rep = evaluate(base, cand, baseline_kv_cache_dtype="auto", serve_log=tmp_path / "l1", save_baseline=saved, **kw)
    m = rep.measured
    assert "--kv-cache-dtype auto" in m["baseline"]["launch"] and m["baseline"]["kv_cache_dtype"] == "auto"
    assert "--kv-cache-dtype fp8_e4m3" in m["candidate"]["launch"] and m["candidate"]["kv_cache_dtype"] == "fp8_e4m3"
    never = tmp_path / "never"
    for bad, match in ((dict(), r"base.json: its baseline was served with KV cache auto, this run gives the "
                                r"baseline fp8_e4m3 .*; pass --baseline-kv-cache-dtype auto"),
                       (dict(baseline_kv_cache_dtype="fp8_e4m3"), r"served with KV cache auto, this run gives the "
                                                                  r"baseline fp8_e4m3")):
        with pytest.raises(QuantizeError, match=match):
            evaluate(base, cand, baseline_results=saved, serve_log=never, **kw, **bad)
    assert not never.exists()
    logs = tmp_path / "l2"
    again = evaluate(base, cand, baseline_results=saved, baseline_kv_cache_dtype="auto", serve_log=logs, **kw)
    assert [p.name.split("-")[1] for p in logs.glob("vllm-*.log")] == ["candidate"]
    assert again.tasks[0].baseline_items == rep.tasks[0].baseline_items
    # the engine's own cache, unnamed (None) and named (auto), is one cache
    plain = tmp_path / "plain.json"
    evaluate(base, cand, serve_log=tmp_path / "l3", save_baseline=plain, **{**kw, "kv_cache_dtype": None})
    evaluate(base, cand, baseline_results=plain, baseline_kv_cache_dtype="auto", serve_log=tmp_path / "l4", **kw)
    with pytest.raises(QuantizeError, match=r"--baseline-kv-cache-dtype auto: the baseline's engine launch; it needs "
                                            r"--serve ENGINE"):
        evaluate(base, cand, baseline_kv_cache_dtype="auto", **{**kw, "serve": None, "engine_python": None})
    local = tmp_path / "local.json"
    evaluate(base, cand, save_baseline=local, **{**kw, "serve": None, "engine_python": None, "kv_cache_dtype": None})
    evaluate(base, cand, baseline_results=local, serve_log=tmp_path / "l5", **kw)  # measured elsewhere: not asked
    with pytest.raises(QuantizeError, match=r"local.json: its baseline was not launched by quantize \(transformers\)"):
        evaluate(base, cand, baseline_results=local, baseline_kv_cache_dtype="auto", serve_log=never, **kw)
    assert not never.exists()
    # eval-kld: the same, for the served baseline's log-probs
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    kk = dict(text=text, tokens=40, chunk=20, serve="vllm", top_k=5, engine_python=py, kv_cache_dtype="fp8_e4m3")
    rows = tmp_path / "base-served.safetensors"
    first = kld_table(base, [cand], save_baseline=rows, baseline_kv_cache_dtype="auto", serve_log=tmp_path / "k1",
                      **kk).reports[0]
    assert "--kv-cache-dtype auto" in first.measured["baseline"]["launch"]
    assert "--kv-cache-dtype fp8_e4m3" in first.measured["candidate"]["launch"]
    with pytest.raises(QuantizeError, match=r"--baseline-logits \S+base-served.safetensors: its baseline was served "
                                            r"with KV cache auto, this run gives the baseline fp8_e4m3"):
        kld_table(None, [cand], baseline_logits=rows, serve_log=never, **kk)
    again = kld_table(None, [cand], baseline_logits=rows, baseline_kv_cache_dtype="auto", serve_log=tmp_path / "k2",
                      **kk).reports[0]
    assert again.kld_mean == first.kld_mean
    with pytest.raises(QuantizeError, match=r"--baseline-kv-cache-dtype auto: the baseline's engine launch"):
        kld_table(base, [cand], text=text, tokens=40, chunk=20, baseline_kv_cache_dtype="auto")
    assert not never.exists()


def test_serve_args_cannot_set_again_what_the_launch_line_sets_and_records(models, tmp_path, monkeypatch):
    """--serve-args naming the KV-cache dtype, tp, port or model (any spelling the engine takes) is
    one line before any launch: the engine takes the last flag, so the record would name a cache or
    tp that did not run; the engine's other flags go through (the near miss)."""
    base, cand = models
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    py, data, logs = _fake_python(tmp_path), _data(tmp_path), tmp_path / "logs"
    kw = dict(tasks="arc_easy", limit=1, data_dir=data, resamples=100, engine_python=py, serve_log=logs)
    for serve, args, flag in (("vllm", "--kv-cache-dtype fp8_e4m3", "--kv-cache-dtype"),
                              ("vllm", "--max-model-len 64 -tp 2", "-tp"),
                              ("vllm", "--tensor-parallel-size=2", "--tensor-parallel-size"),
                              ("sglang", "--tp-size 8", "--tp-size"), ("sglang", "--model /x", "--model"),
                              ("sglang", "--port 1234", "--port")):
        with pytest.raises(QuantizeError, match=rf"^--serve-args names {flag}, which quantize sets itself"):
            evaluate(base, cand, serve=serve, serve_args=args, **kw)
        with pytest.raises(QuantizeError, match=rf"^--serve-args names {flag}"):
            kld_table(base, [cand], tokens=16, chunk=8, serve=serve, serve_args=args, engine_python=py,
                      serve_log=logs)
    assert not logs.exists()
    rep = evaluate(base, cand, serve="vllm", serve_args="--max-model-len 64 --kv-cache-memory 1", **kw)
    assert "--max-model-len 64 --kv-cache-memory 1" in rep.measured["candidate"]["launch"]


def test_position_kl_is_a_lower_bound_and_exact_when_everything_is_named():
    import torch

    torch.manual_seed(0)
    for _ in range(50):
        a = torch.log_softmax(torch.randn(40, dtype=torch.float64) * 3, -1)
        b = torch.log_softmax(torch.randn(40, dtype=torch.float64) * 3, -1)
        full = float((a.exp() * (a - b)).sum())
        for k in (1, 3, 10):
            assert position_kl(sparse(a, k, 7), sparse(b, k, 7)) <= full + 1e-9
        assert position_kl(sparse(a, 40, 7), sparse(b, 40, 7)) == pytest.approx(full, abs=1e-9)
    from quantize.evaluate.served import topk_kl

    a2, b2 = torch.log_softmax(torch.randn(6, 40) * 3, -1), torch.log_softmax(torch.randn(6, 40) * 3, -1)
    t = torch.tensor([0, 5, 9, 39, 2, 7])
    for k in (1, 4):
        want = [position_kl(sparse(a2[j], k, int(t[j])), sparse(b2[j], k, int(t[j]))) for j in range(6)]
        assert topk_kl(a2, b2, t, k).tolist() == pytest.approx(want, rel=1e-4, abs=1e-6)
    same = sparse(a, 5, 3)
    assert position_kl(same, same) == 0.0
    # a near miss: a candidate that moves mass within the bucket it cannot see scores 0 (the bound's blind spot)
    assert position_kl({0: -0.1, 1: -3.0}, {0: -0.1, 1: -3.0}) == 0.0
