"""KL divergence through a serving engine (``quantize eval-kld --serve vllm|sglang``): for models
only an engine runs (a 744B GLM-5.2 on 8 H200s), the log-probabilities come from the server.

An engine returns, per prompt position, the log-probabilities of its top-k tokens and of the
prompt's own next token, not the whole vocabulary (vLLM: ``prompt_logprobs`` on
``/v1/completions``; SGLang: ``return_logprob`` with ``logprob_start_len`` 0 and
``top_logprobs_num`` on ``/generate``). The estimator (``position_kl``): the tokens both answers
name at a position (the next token always, and the two top-k lists' overlap) each keep their
probability, everything else is one bucket holding the remaining mass, and KL(P_base || P_cand)
is taken over those buckets. Merging tokens into buckets can only lower a KL divergence (the
data-processing inequality), so this is a lower bound of the full-vocabulary KL; how much lower
is measured on SmolLM2, where both are available (docs/served-eval.md: ``sparse`` applies the
same estimator to full local log-probabilities). Top-1 agreement (the first token of each top-k)
and perplexity (the next token's log-probability) are exact.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from ..errors import QuantizeError



@dataclass(frozen=True)
class LogprobAPI:
    """How one engine is asked for prompt log-probabilities, and how its answer is read: ``parse``
    gives one ``{token id: log-prob}`` per predicted position (positions 1.. of the prompt)."""

    path: str
    request: Callable[[str, list[int], int], dict]
    parse: Callable[[dict, int], list[dict[int, float]]]


def _vllm_request(name: str, ids: list[int], k: int) -> dict:
    # vllm/entrypoints/openai/completion/protocol.py: CompletionRequest.prompt_logprobs (a vLLM extension)
    return {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k}


def _vllm_parse(resp: dict, n: int) -> list[dict[int, float]]:
    rows = resp["choices"][0]["prompt_logprobs"]  # [None, {id: {"logprob", "rank", "decoded_token"}}, ...]
    out = [{int(t): float(v["logprob"]) for t, v in row.items()} for row in rows[1:n]]
    if len(out) != n - 1:
        raise ValueError(f"{len(out)} positions for a prompt of {n} tokens")
    return out


def _sglang_request(name: str, ids: list[int], k: int) -> dict:
    # sglang/srt/managers/io_struct.py GenerateReqInput; meta_info's input_token_logprobs /
    # input_top_logprobs: (logprob, token id, text) per prompt position, the first without one
    # (sglang/srt/managers/tokenizer_manager.py, detokenize_logprob_tokens)
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": k}


def _sglang_parse(resp: dict, n: int) -> list[dict[int, float]]:
    meta = (resp[0] if isinstance(resp, list) else resp)["meta_info"]
    tops, toks = meta["input_top_logprobs"], meta["input_token_logprobs"]
    out = []
    for j in range(1, n):
        row = {int(t): float(lp) for lp, t, *_ in (tops[j] or []) if lp is not None}
        lp, t, *_ = toks[j]
        row[int(t)] = float(lp)
        out.append(row)
    return out


APIS: dict[str, LogprobAPI] = {"vllm": LogprobAPI("/v1/completions", _vllm_request, _vllm_parse),
                               "sglang": LogprobAPI("/generate", _sglang_request, _sglang_parse)}


def prompt_logprobs(served, ids: list[int], k: int, timeout: float = 600.0) -> list[dict[int, float]]:
    """One prompt's per-position top-``k`` log-probabilities (and the next token's) from ``served``."""
    api = APIS[served.engine.name]
    body = json.dumps(api.request(served.served_name, ids, k)).encode()
    req = urllib.request.Request(served.url + api.path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            resp = json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        if e.code >= 500:  # the engine failed (vLLM: EngineDeadError), not a limit: its log names the cause
            raise QuantizeError(f"--serve {served.engine.name}: the engine failed on a prompt of {len(ids)} tokens "
                                f"({e.code} from {served.url}{api.path}): {served.cause()} (log: {served.log})"
                                ) from None
        raise QuantizeError(f"--serve {served.engine.name}: {served.url}{api.path} refused a prompt of {len(ids)} "
                            f"tokens with top-{k} log-probs ({e.code}: {' '.join(detail.split())}); lower --top-k "
                            f"or --chunk, or raise the engine's limit with --serve-args") from None
    try:
        rows = api.parse(resp, len(ids))
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise QuantizeError(f"--serve {served.engine.name}: {served.url}{api.path} answered without per-position "
                            f"log-probabilities ({type(e).__name__}: {e})") from None
    for j, row in enumerate(rows):
        if ids[j + 1] not in row:
            raise QuantizeError(f"--serve {served.engine.name}: position {j + 1}'s answer lacks the prompt's own "
                                f"token {ids[j + 1]}; the engine did not score the prompt as sent")
    return rows


def sparse(row, k: int, target: int) -> dict[int, float]:
    """What an engine returns for one position, from a full log-probability row (a tensor): its
    top-``k`` and the next token (the same estimator, applied where the full row is known)."""
    vals, idx = row.topk(k)
    out = {int(i): float(v) for v, i in zip(vals.tolist(), idx.tolist())}
    out[int(target)] = float(row[target])
    return out


def position_kl(b: dict[int, float], c: dict[int, float]) -> float:
    """KL(base || cand) over the tokens both name, plus one bucket for the rest (module docstring):
    a lower bound of the full-vocabulary KL at this position."""
    shared = b.keys() & c.keys()
    kl, pb_sum, qc_sum = 0.0, 0.0, 0.0
    for t in shared:
        lp, lq = b[t], c[t]
        p = math.exp(lp)
        kl += p * (lp - lq)
        pb_sum += p
        qc_sum += math.exp(lq)
    p_rest, q_rest = max(0.0, 1.0 - pb_sum), max(0.0, 1.0 - qc_sum)
    if p_rest > 1e-12:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-30)))
    return max(0.0, kl)


def topk_kl(lb, lc, target, k: int):
    """``position_kl(sparse(lb[j], k, t), sparse(lc[j], k, t))`` for every row at once (fp32, on the
    rows' device): what the served estimator would give on full local log-probabilities
    ``lb``/``lc`` [n, vocab] with next tokens ``target`` [n]. The local report's ``kld_topk_mean``."""
    import torch

    rows = torch.arange(lb.shape[0], device=lb.device)
    shared = []
    for lp in (lb, lc):
        m = torch.zeros_like(lp, dtype=torch.bool).scatter_(1, lp.topk(min(k, lp.shape[-1]), dim=-1).indices, True)
        m[rows, target] = True
        shared.append(m)
    both = shared[0] & shared[1]
    pb, qc = lb.exp(), lc.exp()
    kl = torch.where(both, pb * (lb - lc), 0).sum(-1)
    p_rest = (1 - torch.where(both, pb, 0).sum(-1)).clamp_min(0)
    q_rest = (1 - torch.where(both, qc, 0).sum(-1)).clamp_min(1e-30)
    rest = torch.where(p_rest > 1e-12, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()), 0)
    return (kl + rest).clamp_min(0)


def top1(row: dict[int, float]) -> int:
    return max(row.items(), key=lambda kv: (kv[1], -kv[0]))[0]
