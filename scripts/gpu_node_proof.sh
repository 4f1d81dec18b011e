#!/usr/bin/env bash
# The whole proof on one 8xH200 node with SGLang: the baseline as the vendor ships it, our candidate,
# KL divergence and the lm-eval tasks through the engine (launched and stopped by quantize), and a
# model card that says where each figure was measured.
#
#   scripts/gpu_node_proof.sh glm   # GLM-5.2: baseline zai-org/GLM-5.2-FP8 (block FP8), candidate W4A16 experts
#   scripts/gpu_node_proof.sh kimi  # Kimi K2.6: baseline Moonshot's INT4 release, candidate the same INT4 with
#                                   # its MLA cache range folded into the weights, for an FP8 KV cache
#
# NEVER RUN HERE: this project's machines have no GPU. Every command below is one the tool has and
# tests on CPU miniatures (tests/test_serve.py, tests/test_serve_vllm.py, tests/test_pipeline.py);
# the figures it prints on a node are the ones a user would ship.
#
# Environment: MODELS (default /models) holds the downloads; OUT (default ./proof) the results;
# SGLANG_PYTHON the python of a venv with sglang>=0.5.23 (default: python3); DATA an eval data folder
# in the layout of docs/evaluation.md#local-data (default: the Hub); LIMIT documents per task (default:
# all; under 100 the card marks a task as a smoke test and keeps it out of the model-index); THINKING off
# or on (below).
set -euo pipefail
which=${1:?usage: $0 glm|kimi}
MODELS=${MODELS:-/models}
OUT=${OUT:-./proof}
PY=${SGLANG_PYTHON:-python3}
TASKS=${TASKS:-gsm8k,arc_easy,arc_challenge,mmlu,mmlu_pro}
mkdir -p "$OUT"
data=()
[ -n "${DATA:-}" ] && data=(--data-dir "$DATA")
limit=()
[ -n "${LIMIT:-}" ] && limit=(--limit "$LIMIT")
# GLM-5.x and Kimi K2.x reason before answering: THINKING=off (default) sets their template's switch off on
# both models; THINKING=on keeps the trace (SGLang's reasoning parser splits it off) and needs a long cap
think=(--thinking "${THINKING:-off}")
[ "${THINKING:-off}" = on ] && think+=(--max-gen-toks "${MAX_GEN_TOKS:-8192}")
# the baseline as its vendor serves it (the engine's own KV cache), the candidate as the fleet will (FP8 cache): the
# comparison covers the weights and the cache together
kv=(--kv-cache-dtype fp8_e4m3 --baseline-kv-cache-dtype auto)
serve=(--serve sglang --engine-python "$PY" --tp 8 --serve-log "$OUT/logs" --concurrency 32)

case "$which" in
  glm)
    repo=zai-org/GLM-5.2-FP8
    base="$MODELS/GLM-5.2-FP8"
    cand="$OUT/GLM-5.2-W4A16"
    [ -d "$base" ] || hf download "$repo" --local-dir "$base"          # ~705 GiB
    quantize plan "$base" --tp 8
    # routed experts INT4 (GPTQ on 8 ranks, a GPU each; RTN: drop --method, --nproc and --device, it runs on the
    # CPU), the rest as shipped
    quantize convert "$base" "$cand" --recipe recipes/glm-5.2-w4a16-experts.yaml --method gptq --nproc 8 \
      --device cuda --base-model "$repo" --resume
    quantize calibrate-kv "$cand" --stats-out "$OUT/kv.json" --device cuda --nproc 8   # samples split, a GPU per rank
    ;;
  kimi)
    repo=moonshotai/Kimi-K2.6
    base="$MODELS/Kimi-K2.6"
    cand="$OUT/Kimi-K2.6-W4A16-fold"
    [ -d "$base" ] || hf download "$repo" --local-dir "$base"
    quantize plan "$base" --tp 8
    # Moonshot's release is already INT4 (QAT): convert passes its codes through bit for bit; what changes is the
    # KV cache, FP8 at unit scale on MLA, whose range calibrate-kv folds into the weights (exact in real arithmetic).
    # Not the FP8 prefill pool's weights: `quantize plan --scheme fp8-block --profile all-linear` puts 120.8 GiB on
    # each of 8 GPUs, which leaves an H200 no KV cache (that pool needs a node of its own: docs/served-eval.md)
    quantize convert "$base" "$OUT/Kimi-K2.6-W4A16" --base-model "$repo" --resume
    quantize calibrate-kv "$OUT/Kimi-K2.6-W4A16" --fold --out "$cand" --overwrite --stats-out "$OUT/kv.json" \
      --device cuda --nproc 8
    ;;
  *) echo "usage: $0 glm|kimi" >&2; exit 2 ;;
esac

quantize check "$cand" --tp 8 --json > "$OUT/check.json"
# the engine, launched by quantize on each folder in turn (baseline, then candidate), once per model for both
# the tasks and the KL divergence (--kld-out: top-100 served log-probs of 8192 tokens), stopped after.
# --chat: GSM8K and MMLU-Pro through the chat template (chat-completions), ARC and MMLU as written.
# The next candidate of the same baseline: --baseline-results "$OUT/eval-baseline.json" (the tasks, and the KL
# side saved beside it in eval-baseline.kld.safetensors) serves only that candidate.
quantize eval --baseline "$base" --candidate "$cand" "${serve[@]}" "${kv[@]}" --chat "${think[@]}" --tasks "$TASKS" "${data[@]}" "${limit[@]}" \
  --kld-out "$OUT/kld.json" --kld-top-k 100 --kld-tokens 8192 \
  --out "$OUT/eval.json" --markdown "$OUT/eval.md" --save-baseline "$OUT/eval-baseline.json"
quantize card "$cand" --eval "$OUT/eval.json" --eval "$OUT/kld.json" --eval "$OUT/check.json" --eval "$OUT/kv.json" \
  --base-model "$repo"
echo "proof: $OUT (eval.json, kld.json, check.json, kv.json, logs/); card: $cand/README.md"
