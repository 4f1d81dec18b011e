"""A real OpenAI-compatible completions server on loopback, answering from a transformers model:
what lm-eval's completions backend sends to SGLang or vLLM (echoed prompt log-probs with top-1
alternatives for log-likelihoods; greedy text with stop strings for generation)."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def _handler(model, tok, name: str, on_request=None):
    lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, doc: dict):
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path.rstrip("/") == "/health":
                return self._send(200, {})
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/completions":
                return self._send(404, {"error": "not found"})
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if on_request is not None:
                answer = on_request(req)
                if answer is not None:  # (status, body): the stand-in answers that instead
                    return self._send(*answer)
            prompts = req["prompt"]
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
                prompts = [prompts]
            prompts = [tok(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
            choices = []
            with lock, torch.no_grad():
                for i, ids in enumerate(prompts):
                    if req.get("prompt_logprobs"):  # vLLM's extension: per prompt position, top-k and the token
                        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
                        rows = [None]
                        for j in range(1, len(ids)):
                            vals, idx = lp[j - 1].topk(int(req["prompt_logprobs"]))
                            row = {str(int(t)): {"logprob": float(v), "rank": r + 1}
                                   for r, (v, t) in enumerate(zip(vals, idx))}
                            row.setdefault(str(ids[j]), {"logprob": float(lp[j - 1, ids[j]]), "rank": None})
                            rows.append(row)
                        choices.append({"index": i, "text": "", "prompt_logprobs": rows})
                    elif req.get("echo"):
                        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
                        nxt = int(lp[-1].argmax())
                        token_lps = [None] + [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))] + [float(lp[-1, nxt])]
                        tops = [None] + [{str(int(lp[j - 1].argmax())): float(lp[j - 1].max())} for j in range(1, len(ids))]
                        tops.append({str(nxt): float(lp[-1, nxt])})
                        choices.append({"index": i, "text": "", "logprobs": {"token_logprobs": token_lps, "top_logprobs": tops}})
                    else:
                        out = model.generate(torch.tensor([ids]), max_new_tokens=int(req.get("max_tokens", 16)), do_sample=False)
                        text = tok.decode(out[0][len(ids):], skip_special_tokens=True)
                        for stop in req.get("stop") or []:
                            if stop and stop in text:
                                text = text[: text.index(stop)]
                        choices.append({"index": i, "text": text, "finish_reason": "stop"})
            self._send(200, {"object": "text_completion", "model": name, "choices": choices})

    return H


def serve_forever(path, host: str, port: int, on_request=None) -> None:
    """The same server as a process of its own (``tests/fake_engine.py``): until killed."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ThreadingHTTPServer((host, port), _handler(model, tok, "served-model", on_request)).serve_forever()


@contextmanager
def serve(path):
    """Serve the model at ``path`` on 127.0.0.1 (a free port); yields the base URL; stops after."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(model, tok, "served-model"))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=10)
