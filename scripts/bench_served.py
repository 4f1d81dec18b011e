"""Served against local evaluation, side by side in one run (docs/served-eval.md): SmolLM2-135M BF16
and its INT4 g32 (served by vLLM's CPU build as the INT4 checkpoint where the CPU has AVX-512 or AMX,
else as its weights dequantized to floats), the same lm-eval items and the same KL text, locally in
transformers and through `--serve vllm`. Prints the figures, the engine's start-up time and the
wall-time ratio of a served evaluation to a local one.

    QUANTIZE_VLLM_PYTHON=.venv-vllm/bin/python python scripts/bench_served.py SMOLLM2_DIR [--limit 20]
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

SERVE_ARGS = "--dtype float32 --max-model-len 2048 --max-num-seqs 4 --enforce-eager --distributed-executor-backend uni"


def _cpu_serves_int4() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f" in flags or " amx_tile" in flags


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("smollm2", type=Path)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--tasks", default="arc_easy,gsm8k")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the server's process: faster start

    from quantize.convert import convert
    from quantize.engines.vllm import _float_copy
    from quantize.evaluate.kld import kld_table
    from quantize.evaluate.run import evaluate

    tmp = Path(tempfile.mkdtemp(prefix="bench-served-"))
    int4 = tmp / "g32"
    convert(a.smollm2, int4, profile="all-linear", group_size=32)
    cand, serve_args = int4, SERVE_ARGS.replace("float32", "float16")  # vLLM CPU's INT4 kernel: 16-bit activations
    if not _cpu_serves_int4():
        serve_args = SERVE_ARGS
        cand = tmp / "g32-dequantized"
        cand.mkdir()
        _float_copy(int4, cand)
        for f in int4.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template",
                                  "quantize_manifest")):
                shutil.copy(f, cand / f.name)
        print("this CPU lacks AVX-512/AMX: vLLM serves the INT4 weights dequantized to floats")
    import quantize.evaluate.run as run

    answers: dict = {}  # (served?, model) -> {task: [each document's filtered response]}: generated text compared
    real_run = run._run_model

    def recording(path, configs, limit, device, batch_size, base_url=None, *rest):
        res = real_run(path, configs, limit, device, batch_size, base_url, *rest)
        answers[(base_url is not None, str(path))] = {  # generation tasks: their text (log-likelihoods: scores)
            t: [repr(x["resps"]) for x in sorted(v, key=lambda x: x["doc_id"])]
            for t, v in res["samples"].items() if v and isinstance(v[0]["resps"][0][0], str)}
        return res

    run._run_model = recording
    kw = dict(tasks=a.tasks, limit=a.limit, data_dir="shipped", max_gen_toks=128, resamples=1000)
    t = time.time()
    local = evaluate(a.smollm2, cand, **kw)
    t_local = time.time() - t
    t = time.time()
    served = evaluate(a.smollm2, cand, serve="vllm", serve_args=serve_args, serve_log=tmp / "logs", **kw)
    t_served = time.time() - t
    for model in (a.smollm2, cand):
        lo, sv = answers.get((False, str(model)), {}), answers.get((True, str(model)), {})
        for task in sorted(set(lo) & set(sv)):
            same = sum(x == y for x, y in zip(lo[task], sv[task]))
            print(f"{task} {Path(model).name}: {same} of {len(lo[task])} generated responses "
                  "identical served and local")
    start = [served.measured[r]["startup_s"] for r in ("baseline", "candidate")]
    for lt, st in zip(local.tasks, served.tasks):
        differ = sum(x != y for x, y in zip(lt.baseline_items + lt.candidate_items,
                                            st.baseline_items + st.candidate_items))
        print(f"{lt.task} ({lt.n} items): baseline local {lt.baseline:.1f} / served {st.baseline:.1f}; candidate "
              f"local {lt.candidate:.1f} / served {st.candidate:.1f}; {differ} of {2 * lt.n} item scores differ")
    print(f"eval wall: local {t_local:.1f} s, served {t_served:.1f} s (x{t_served / t_local:.2f}; start-up "
          f"{start[0]:.1f} s + {start[1]:.1f} s of it)")
    t = time.time()
    lk = kld_table(a.smollm2, [cand], tokens=a.tokens, chunk=512).reports[0]
    t_lk = time.time() - t
    t = time.time()
    sk = kld_table(a.smollm2, [cand], tokens=a.tokens, chunk=512, serve="vllm", serve_args=serve_args,
                   serve_log=tmp / "logs").reports[0]
    t_sk = time.time() - t
    t = time.time()
    both = evaluate(a.smollm2, cand, serve="vllm", serve_args=serve_args, serve_log=tmp / "logs",
                    kld_out=tmp / "kld.json", kld_tokens=a.tokens, kld_chunk=512, **kw)
    t_both = time.time() - t
    print(f"KLD ({lk.tokens} tokens): local full {lk.kld_mean:.5f}, local top-{lk.top_k} estimate "
          f"{lk.kld_topk_mean:.5f}, served top-{sk.top_k} {sk.kld_mean:.5f} (served - local full "
          f"{sk.kld_mean - lk.kld_mean:+.5f}); top-1 {lk.top1_agreement:.4f} / {sk.top1_agreement:.4f}")
    print(f"eval-kld wall: local {t_lk:.1f} s, served {t_sk:.1f} s (x{t_sk / t_lk:.2f})")
    print(f"served eval --kld-out (one launch per model for both): {t_both:.1f} s against eval then eval-kld "
          f"{t_served + t_sk:.1f} s (x{t_both / (t_served + t_sk):.2f}); its KL {both.kld.kld_mean:.5f} against "
          f"eval-kld's {sk.kld_mean:.5f}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
