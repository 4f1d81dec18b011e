"""The real engine, launched by the tool: vLLM's CPU build (`.venv-vllm`, as CI installs it) serves
SmolLM2-135M BF16 and its INT4 g32 on loopback for `eval --serve vllm` and `eval-kld --serve vllm`.
Served lm-eval items against the same items scored locally by transformers, served KLD (the top-k
estimator) against the local full-vocabulary KLD: the differences are the engine's numerics and
the estimator's bound, each measured here and printed.

vLLM's x86 CPU build serves INT4 weights only with AVX-512 or AMX; on a CPU without them the INT4
candidate's tests skip, saying so, and the same comparison runs on the INT4 checkpoint's weights
dequantized to plain floats (the same numbers the INT4 kernels multiply by), which any CPU serves."""

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'quantize[eval]')")

from quantize.engines.vllm import has_engine  # noqa: E402
from quantize.evaluate.kld import kld_table  # noqa: E402
from quantize.evaluate.run import evaluate  # noqa: E402

from .test_engine import SERVES_INT4, smol_w4a16  # noqa: E402,F401 - the fixture
from .test_eval import _linked_copy  # noqa: E402
from .test_serve import _listening  # noqa: E402

# under pytest-xdist the real engine's tests, here and in test_engine.py, run one after another on one worker,
# first (tests/conftest.py); beside other load vLLM's CPU engine slows badly (docs/testing.md)
pytestmark = pytest.mark.xdist_group("vllm")
needs_engine = pytest.mark.skipif(not has_engine(), reason="no vLLM interpreter (.venv-vllm / QUANTIZE_VLLM_PYTHON)")
# vLLM's CPU build in fp32, a small KV cache; the engine core and its worker in the server's own process
# (with VLLM_ENABLE_V1_MULTIPROCESSING=0 below): 35 s to healthy instead of 53 s on 2 cores
SERVE_ARGS = "--dtype float32 --max-model-len 1024 --max-num-seqs 4 --enforce-eager --distributed-executor-backend uni"


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ARC = [("What do plants need to make food?", ["sunlight", "sand", "plastic", "noise"], 0),
       ("Which of these is a liquid at room temperature?", ["iron", "water", "wood", "stone"], 1),
       ("What force pulls objects toward the Earth?", ["magnetism", "friction", "gravity", "wind"], 2),
       ("Which animal is a mammal?", ["shark", "frog", "eagle", "whale"], 3),
       ("What is the main source of heat for the Earth?", ["the Sun", "the Moon", "volcanoes", "lightning"], 0),
       ("Which tool measures temperature?", ["ruler", "thermometer", "scale", "compass"], 1),
       ("What gas do animals breathe out?", ["oxygen", "helium", "carbon dioxide", "hydrogen"], 2),
       ("Which of these is a renewable resource?", ["coal", "oil", "natural gas", "wind"], 3)]


def _arc_data(tmp_path):
    d = tmp_path / "data" / "arc"
    d.mkdir(parents=True)
    rows = [json.dumps({"query": f"Question: {q}\nAnswer:", "choices": c, "gold": g}) for q, c, g in ARC]
    for t in ("arc_easy", "arc_challenge"):
        (d / f"{t}.jsonl").write_text("\n".join(rows))
    return d.parent


@pytest.fixture(scope="module")
def smol_dequantized(smol_w4a16, tmp_path_factory):
    """The INT4 g32 checkpoint's weights as plain fp32 (config without quantization_config)."""
    from quantize.engines.vllm import _float_copy

    dst = tmp_path_factory.mktemp("dq") / "smollm2-g32-dequantized"
    dst.mkdir()
    _float_copy(Path(smol_w4a16), dst)
    for f in Path(smol_w4a16).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template",
                              "quantize_manifest")):
            shutil.copy(f, dst / f.name)
    return dst


# GSM8K-shaped items: 8 for the 5-shot prompt (sampled from the train split), 2 scored
GSM = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?",
        "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}"} for i in range(8)]


def _gsm_data(root):
    d = root / "gsm8k"
    d.mkdir(parents=True)
    (d / "train.jsonl").write_text("\n".join(json.dumps(x) for x in GSM))
    (d / "test.jsonl").write_text("\n".join(json.dumps(x) for x in GSM[:2]))


def _switched(folder: Path, dst: Path) -> Path:
    """A copy of a SmolLM2 folder (weights linked) whose chat template has a reasoning model's thinking
    switch: ``enable_thinking`` False prefills an empty trace after the assistant's tag, as GLM's do."""
    _linked_copy(folder, dst)
    t = (dst / "chat_template.jinja").read_text()
    tag = "{{ '<|im_start|>assistant\n' }}"
    assert tag in t
    (dst / "chat_template.jinja").write_text(t.replace(tag, tag + "{% if enable_thinking is defined and not "
                                                                  "enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"))
    return dst


@needs_engine
def test_served_eval_and_kld_are_what_transformers_gives(smollm2, smol_dequantized, smol_w4a16, tmp_path,
                                                         monkeypatch):
    """One launch per model for everything (`eval --serve vllm --chat --kld-out`): ARC's
    log-likelihoods through completions scored as transformers scores them, GSM8K through the chat
    template behind chat-completions answered as transformers answers through the same template,
    item by item, greedy, and the served KL estimate (top-100, from the same launches) against the
    local one and the local full-vocabulary KL. The template has a thinking switch (a reasoning
    model's): off by default, it reaches vLLM as the request's chat_template_kwargs and renders there
    as transformers renders it here. Then, where this CPU lets vLLM serve INT4 (AVX-512 or AMX;
    otherwise said in the output), the INT4 checkpoint itself: vLLM CPU's INT4 kernel takes 16-bit
    activations only (fp32: ``NotImplementedError: "cpu_gemm_wna16" not implemented for 'Float'``,
    0.32.0), so it is served in float16, against the fp32 baseline's served log-probs, saved by the
    served eval (`--save-baseline`, its KL side) and not served again."""
    import quantize.evaluate.run as run
    from quantize.evaluate.tasks import task_configs
    from quantize.evaluate.thinking import Thinking

    import re
    import tempfile

    uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

    def sockets() -> set:  # vLLM's ZMQ sockets, where it puts them by default (uuid4 names)
        return {p.name for p in Path(tempfile.gettempdir()).iterdir() if uuid.fullmatch(p.name) and p.is_socket()}

    before = sockets()
    base = _switched(smollm2, tmp_path / "base")
    candidate = _switched(smol_dequantized, tmp_path / "cand")  # fp32 weights: vLLM's and transformers' numerics
    data = _arc_data(tmp_path)
    _gsm_data(data)
    calls = []
    real = run._lm_eval
    monkeypatch.setattr(run, "_lm_eval", lambda path, cs, *a, **kw: calls.append(
        (path, a[3] is not None, a[4], real(path, cs, *a, **kw))) or calls[-1][-1])
    common = dict(tasks="arc_easy,gsm8k", data_dir=data, resamples=200, max_gen_toks=48, chat=True, kld_tokens=512,
                  kld_chunk=256)
    local = evaluate(base, candidate, kld_out=tmp_path / "kld-local.json", **common)
    served = evaluate(base, candidate, serve="vllm", serve_args=SERVE_ARGS, serve_log=tmp_path / "logs",
                      out=tmp_path / "served.json", kld_out=tmp_path / "kld-served.json",
                      save_baseline=tmp_path / "base.json", **common)
    # the runs: per model, GSM8K through the template, then ARC without it; the last four through the servers
    assert [(p == str(candidate), url, chat) for p, url, chat, _ in calls] == [
        (m, url, chat) for url in (False, True) for m in (False, True) for chat in (True, False)]
    assert len(list((tmp_path / "logs").glob("vllm-*.log"))) == 2  # one launch per model, tasks and KL together
    lt, st = local.tasks[0], served.tasks[0]
    assert lt.task == st.task == "arc_easy" and st.docs == lt.docs and st.n == len(ARC)
    differ = [(d, a, b) for d, a, b in zip(lt.docs * 2, lt.candidate_items + lt.baseline_items,
                                           st.candidate_items + st.baseline_items) if a != b]
    answers = [{x["doc_id"]: x["resps"] for x in calls[k][-1]["samples"]["gsm8k"]} for k in (0, 2, 4, 6)]
    lk, sk = local.kld, served.kld
    print(f"\nserved vs local arc_easy ({len(ARC)} items, both models): candidate {st.candidate:.1f} vs "
          f"{lt.candidate:.1f}; {len(differ)} item scores differ; gsm8k through the chat template: "
          f"{sum(answers[0][k] == answers[2][k] for k in answers[0]) + sum(answers[1][k] == answers[3][k] for k in answers[1])}"
          f" of 4 answers identical; KLD vs BF16, {sk.tokens} tokens: local full {lk.kld_mean:.5f}, local top-100 "
          f"estimate {lk.kld_topk_mean:.5f}, served top-100 {sk.kld_mean:.5f} (served - local estimate "
          f"{sk.kld_mean - lk.kld_topk_mean:+.5f}); top-1 {lk.top1_agreement:.4f} vs {sk.top1_agreement:.4f}; "
          f"start-up {served.measured['baseline']['startup_s']} s and {served.measured['candidate']['startup_s']} s")
    assert len(differ) <= 1, differ  # fp32 weights on vLLM's CPU kernels vs transformers: at most a near tie flips
    assert answers[2:] == answers[:2] and all(len(a) == 2 for a in answers)  # served (chat-completions) = local
    assert all(r[0][0].strip() for r in answers[3].values())  # the chat model answered something
    gsm = task_configs(["gsm8k"], data, 48)[0]
    plain = real(str(candidate), gsm, None, "cpu", 1, None, False)
    assert {x["doc_id"]: x["resps"] for x in plain["samples"]["gsm8k"]} != answers[1]  # the template matters
    on = real(str(candidate), gsm, None, "cpu", 1, None, True, Thinking("on", "enable_thinking"))
    assert {x["doc_id"]: x["resps"] for x in on["samples"]["gsm8k"]} != answers[1]  # and so does its switch
    m = json.loads((tmp_path / "served.json").read_text())["measured"]
    assert m["candidate"]["engine"] == m["baseline"]["engine"] == "vllm" and m["candidate"]["version"]
    assert m["candidate"]["prompts"].startswith(run.CHAT_PROMPTS[True] + "; thinking off")
    assert m["candidate"]["thinking"]["mode"] == m["baseline"]["thinking"]["mode"] == "off"
    assert not any(_listening(int(m[r]["launch"].split("--port ")[1].split()[0])) for r in m)
    assert json.loads((tmp_path / "kld-served.json").read_text())["kld_mean"] == sk.kld_mean
    pairs = [(candidate, lk, sk)]
    if SERVES_INT4:
        # the baseline's served top-100 rows, kept by the served eval's --save-baseline (its KL side):
        # eval-kld reuses them and serves the INT4 candidate alone
        saved = run.kld_baseline_file(tmp_path / "base.json")
        kw = dict(tokens=512, chunk=256)
        lo4 = kld_table(smollm2, [smol_w4a16], **kw).reports[0]
        sv4 = kld_table(None, [smol_w4a16], baseline_logits=saved, serve="vllm", serve_log=tmp_path / "logs",
                        serve_args=SERVE_ARGS.replace("float32", "float16"), **kw).reports[0]
        assert sv4.measured["baseline"]["reused"] == str(saved)
        assert len(list((tmp_path / "logs").glob("vllm-*.log"))) == 3  # the candidate's launch only
        pairs.append((smol_w4a16, lo4, sv4))
    else:
        print("(vLLM's x86 CPU build serves INT4 only with AVX-512 or AMX, which this CPU lacks: the INT4 "
              "checkpoint itself is not served here)")
    for cand, lo, sv in pairs:
        print(f"KLD {Path(cand).name}: served {sv.kld_mean:.5f} vs local top-100 {lo.kld_topk_mean:.5f} "
              f"(full {lo.kld_mean:.5f}); top-1 {sv.top1_agreement:.4f} vs {lo.top1_agreement:.4f}; PPL "
              f"{sv.ppl_candidate:.4f} vs {lo.ppl_candidate:.4f}")
        assert sv.tokens == lo.tokens == 512
        assert sv.estimator == "top-100 lower bound (served)" and "--max-logprobs 100" in sv.measured["candidate"]["launch"]
        assert lo.kld_topk_mean <= lo.kld_mean  # the estimator's bias, measured: a lower bound
        # the engine's numerics (vLLM's CPU kernels vs transformers in fp32; the INT4 kernels in float16
        # activations): the same estimate within 5 % (measured: +0.0 % fp32, +0.1 % INT4 in float16)
        assert abs(sv.kld_mean - lo.kld_topk_mean) <= 0.05 * lo.kld_topk_mean + 1e-3
        assert abs(sv.top1_agreement - lo.top1_agreement) <= 0.01
        assert abs(sv.ppl_candidate / lo.ppl_candidate - 1) <= 0.005
        assert abs(sv.ppl_baseline / lo.ppl_baseline - 1) <= 0.005
    assert sockets() <= before  # each launch's sockets went with its private folder (three a launch before)
