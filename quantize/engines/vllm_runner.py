"""vLLM side of ``quantize check --engine vllm``: load a checkpoint in vLLM, generate greedy tokens
with log-probs, write JSON. Run BY PATH with the interpreter of a venv that has vLLM (its CPU build
pins compressed-tensors 0.17 and ours is 0.19, so it cannot share our venv); it imports nothing
from ``quantize``.

    python vllm_runner.py REQUEST.json RESULT.json

REQUEST: {"model", "prompts": [str], "max_tokens", "dtype", "max_model_len", "kv_cache_dtype",
"attention_backend", "prompt_logprobs": bool, "read_kv_scales": bool, "rope_native": bool}.
RESULT: {"ok": true, "vllm_version", "platform", "results": [{"prompt", "prompt_token_ids",
"token_ids", "logprobs", "prompt_logprobs"}], "modules": {...}, "kv_scales": {...}, "notes"} or
{"ok": false, "blockers": [{"error": "Type: message", "where": "vllm/file.py:line", "detected"}]}
when vLLM cannot serve the checkpoint here (its load failed, or a rule or self-test of its own code
says the result would be wrong), or {"ok": false, "error", "where"} for any other failure.

The engine core runs in this process (the caller sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so an
engine failure arrives here as vLLM's own exception, with the file that raised it, and
``LLM.apply_model`` reads the loaded model without serializing a callable to another process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# Run by path, this file's folder is sys.path[0], and it holds quantize/engines/vllm.py: drop it so
# that `import vllm` is the engine.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _where(tb) -> str:
    """The innermost frame inside the vllm package: the file and line that raised."""
    where = ""
    for fr in traceback.extract_tb(tb):
        f = fr.filename.replace(os.sep, "/")
        if "/vllm/" in f:
            where = f"vllm/{f.rsplit('/vllm/', 1)[1]}:{fr.lineno}"
    return where


def _root(e: BaseException) -> BaseException:
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        nxt = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if nxt is None:
            break
        e = nxt
    return e


def _modules(model) -> dict:
    """What vLLM built: per linear layer the compressed-tensors scheme and the kernel it chose
    (vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py
    keeps it in ``scheme.kernel``), per attention layer the backend, per MoE layer its method."""
    out: dict = {"linear": {}, "attention": {}, "moe": {}}

    def add(kind, key):
        out[kind][key] = out[kind].get(key, 0) + 1

    for _, m in model.named_modules():
        scheme = getattr(m, "scheme", None)
        qm = getattr(m, "quant_method", None)
        if hasattr(m, "impl") and hasattr(m, "attn_backend"):
            be = m.attn_backend
            add("attention", f"{be.get_name() if hasattr(be, 'get_name') else be.__name__} ({type(m.impl).__name__})")
        elif type(m).__name__ in ("FusedMoE", "SharedFusedMoE") or "MoE" in type(qm).__name__:
            add("moe", type(qm).__name__)
        elif scheme is not None:
            k = getattr(scheme, "kernel", None)
            add("linear", f"{type(k).__name__} for {type(scheme).__name__}" if k is not None else type(scheme).__name__)
        elif qm is not None and type(qm).__name__.endswith("LinearMethod"):
            add("linear", type(qm).__name__)
    return out


def _kv_scales(model) -> dict:
    """k/v scale of every attention layer as the engine holds them after loading: the
    ``_k_scale_float``/``_v_scale_float`` the CPU attention kernels read
    (vllm/v1/attention/backends/cpu_attn.py), set from the checkpoint's k_scale/v_scale in
    vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "_k_scale_float") and hasattr(m, "_v_scale_float") and hasattr(m, "kv_cache_dtype"):
            out[name] = {"k_scale": float(m._k_scale_float), "v_scale": float(m._v_scale_float),
                         "kv_cache_dtype": str(m.kv_cache_dtype)}
    return out


def _configs(model_dir: str) -> tuple[dict, dict]:
    """(config.json, its text_config or itself); empty when unreadable (vLLM's load then says why)."""
    try:
        cfg = json.load(open(os.path.join(model_dir, "config.json")))
    except (OSError, ValueError):
        return {}, {}
    return cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg


def _sparse_on_cpu(cfg: dict, text: dict, platform) -> str | None:
    """vLLM builds sparse MLA for any config with ``index_topk``
    (vllm/model_executor/models/deepseek_v2.py: ``is_v32 = hasattr(config, "index_topk")``), and the
    CPU platform refuses it (vllm/platforms/cpu.py, get_attn_backend_cls): say so before a load."""
    if platform.is_cpu() and ("index_topk" in cfg or "index_topk" in text):
        return "NotImplementedError: Sparse Attention is not supported on CPU."
    return None


def _cpu_mla_fp16(text: dict, dtype: str, platform) -> str | None:
    """On a CPU with AMX, vllm/platforms/cpu.py (get_attn_backend_cls) picks AMX_MLA for MLA whatever
    the dtype, while AMXMLABackend.supported_dtypes is [torch.bfloat16]
    (vllm/v1/attention/backends/mla/amx_mla.py); in float16 it returns NaN log-probs after a few
    tokens (measured). Ask for the reference CPU_MLA backend there, as the platform allows."""
    if not platform.is_cpu() or dtype not in ("float16", "half"):
        return None
    return "CPU_MLA" if text.get("kv_lora_rank") else None


def _mla_rope_selftest(model) -> dict | None:
    """MLA hands RoPE strided views (vllm/model_executor/layers/mla.py, forward: ``q[..., nope:]`` of
    a [tokens, heads, qk_head_dim] tensor, and ``k_pe`` split off the fused q_a/kv_a output and
    unsqueezed). Run the loaded model's own rotary module on exactly such views, through
    ``forward_cpu`` (what the CPU platform calls: for RotaryEmbedding, torch.ops._C.rotary_embedding,
    vllm/model_executor/layers/rotary_embedding/base.py) and through vLLM's own ``forward_native``,
    in the model's dtype, and report the largest difference."""
    import torch

    for _, m in model.named_modules():
        rot = getattr(m, "rotary_emb", None)
        if rot is None or not hasattr(m, "kv_lora_rank") or not hasattr(m, "qk_nope_head_dim"):
            continue
        heads, nope, rope = int(m.num_local_heads), int(m.qk_nope_head_dim), int(m.qk_rope_head_dim)
        width = (int(m.q_lora_rank) if m.q_lora_rank else 0) + int(m.kv_lora_rank) + rope
        dtype = next(model.parameters()).dtype
        dtype = dtype if dtype.is_floating_point else torch.float16
        g = torch.Generator().manual_seed(0)
        tokens = 7
        pos = torch.arange(tokens)
        fused = torch.randn(tokens, width, generator=g).to(dtype)
        q = torch.randn(tokens, heads * (nope + rope), generator=g).to(dtype).view(-1, heads, nope + rope)
        qn, kn = rot.forward_native(pos, q[..., nope:].clone(), fused[:, width - rope:].unsqueeze(1).clone())
        q2, fused2 = q.clone(), fused.clone()
        qc, kc = rot.forward_cpu(pos, q2[..., nope:], fused2[:, width - rope:].unsqueeze(1))
        dq = float((qn.float() - qc.float()).abs().max())
        dk = float((kn.float() - kc.float()).abs().max())
        return {"q_max_abs_diff": dq, "k_max_abs_diff": dk, "heads": heads, "tokens": tokens,
                "rope_class": type(rot).__name__, "dtype": str(dtype).replace("torch.", "")}
    return None


def _native_rope(model) -> int:
    """Diagnosis only: make every rotary module whose CPU path is the C++ op use forward_native.
    CustomOp binds its forward at construction (vllm/model_executor/custom_op.py: _forward_method),
    so the instances are changed, not the class."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    n = 0
    for _, m in model.named_modules():
        if isinstance(m, RotaryEmbedding) and type(m).forward_cpu is RotaryEmbedding.forward_cpu:
            m._forward_method = m.forward_native
            n += 1
    return n


def _described(e: BaseException) -> tuple[str, str]:
    """(the root exception as "Type: message" on one line, the vllm file and line that raised it)."""
    root = _root(e)
    return (f"{type(root).__name__}: {' '.join(str(root).split())}",
            _where(root.__traceback__) or _where(e.__traceback__))


def _blocker(error: str, where: str, **kw) -> dict:
    return {"error": error, "where": where, **kw}


def main(req_path: str, res_path: str) -> int:
    with open(req_path) as f:
        req = json.load(f)
    res: dict = {"ok": False, "blockers": [], "notes": []}
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform

        res["vllm_version"] = vllm.__version__
        res["platform"] = type(current_platform).__name__
        cfg, text = _configs(req["model"])
        sparse = _sparse_on_cpu(cfg, text, current_platform)
        if sparse:  # refused before any weight is read: no load needed to know
            res["blockers"].append(_blocker(sparse, "vllm/platforms/cpu.py (get_attn_backend_cls)",
                                            detected="config index_topk"))
            raise SystemExit(3)
        kw = dict(model=req["model"], dtype=req.get("dtype", "float16"),
                  max_model_len=int(req.get("max_model_len", 512)), enforce_eager=True, seed=0,
                  enable_prefix_caching=False)
        if req.get("kv_cache_dtype"):
            kw["kv_cache_dtype"] = req["kv_cache_dtype"]
        backend = req.get("attention_backend") or _cpu_mla_fp16(text, kw["dtype"], current_platform)
        if backend:
            kw["attention_config"] = {"backend": backend}
            res["attention_backend_requested"] = backend
        try:
            llm = LLM(**kw)
        except BaseException as e:  # noqa: BLE001 - the engine's own refusal, reported in its words
            res["blockers"].insert(0, _blocker(*_described(e), detected="load"))
            traceback.print_exc()
            raise SystemExit(3)
        res["modules"] = llm.apply_model(_modules)[0]
        st = llm.apply_model(_mla_rope_selftest)[0] if current_platform.is_cpu() else None
        if st is not None:
            res["rope_selftest"] = st
            worst = max(st["q_max_abs_diff"], st["k_max_abs_diff"])
            if worst > 0.05:  # fp16 rounding is ~2e-3 here; the failure is ~5
                if req.get("rope_native"):
                    n = llm.apply_model(_native_rope)[0]
                    res["notes"].append(f"RoPE computed by vLLM's own forward_native in {n} rotary module(s) "
                                        f"(diagnosis): not what this vLLM serves with")
                else:
                    res["blockers"].append(_blocker(
                        f"{st['rope_class']}.forward_cpu (torch.ops._C.rotary_embedding) differs from vLLM's own "
                        f"forward_native by up to {worst:.3g} on the strided q_pe/k_pe views MLA passes "
                        f"(vllm/model_executor/layers/mla.py; this model's {st['heads']} heads, {st['dtype']}, "
                        f"{st['tokens']} tokens), so its MLA attention output is wrong",
                        "vllm/model_executor/layers/rotary_embedding/base.py (forward_cpu)", detected="self-test"))
        if res["blockers"]:  # loaded, but what it would generate is known to be wrong: do not present it
            raise SystemExit(3)
        sp = SamplingParams(temperature=0.0, max_tokens=int(req.get("max_tokens", 8)), logprobs=1, ignore_eos=True,
                            prompt_logprobs=1 if req.get("prompt_logprobs") else None)
        outs = llm.generate(list(req["prompts"]), sp, use_tqdm=False)
        results = []
        for o in outs:
            c = o.outputs[0]
            r = {"prompt": o.prompt, "prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(c.token_ids),
                 "logprobs": [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]}
            if req.get("prompt_logprobs"):
                r["prompt_logprobs"] = [None if step is None else float(step[t].logprob)
                                        for t, step in zip(o.prompt_token_ids, o.prompt_logprobs)]
            results.append(r)
        res["results"] = results
        if req.get("read_kv_scales"):
            res["kv_scales"] = llm.apply_model(_kv_scales)[0]
        res["ok"] = True
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001 - every failure is reported, in vLLM's words
        error, where = _described(e)
        res.update(error=error, where=where)
        traceback.print_exc()
    with open(res_path, "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if res["ok"] else 3


if __name__ == "__main__":  # vLLM may spawn workers: everything runs under this guard
    sys.exit(main(sys.argv[1], sys.argv[2]))
