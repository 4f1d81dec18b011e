"""A stand-in for an engine's launcher, for the failures a real engine cannot be made to show on
demand (tests/test_serve.py): started as ``python -m vllm.entrypoints.openai.api_server --model MODEL
--host H --port P ...`` (or SGLang's ``--model-path MODEL``) by ``tests/test_serve.py``'s fake
interpreter; with ``--pd-disaggregation`` (SGLang's router: ``--prefill URL BOOTSTRAP --decode URL``)
a router that answers /health once both pools do and passes every other request to the decode
pool. FAKE_ENGINE_MODE (FAKE_ENGINE_PREFILL_MODE for a ``--disaggregation-mode prefill`` server):

- ``ok``: serves MODEL as tests/completions_server.py does (with /health);
- ``fail``: prints a few log lines and exits with status 1 before answering;
- ``never``: alive but never healthy (a child ``sleep`` beside it, in its process group);
- ``broken``: healthy, then on each completion request logs an engine's fatal error (its
  traceback's last line) and answers 500, alive, as vLLM's API server does once its engine core died;
- ``die``: healthy, then kills itself (SIGKILL) on the first completion request, leaving a child
  ``sleep`` that only a kill of the whole process group stops.
"""

import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def router(argv: list[str], host: str, port: int) -> int:
    """SGLang's router in front of a pair, as far as the tool sees it."""
    import urllib.error
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    prefill, decode = _value(argv, "--prefill"), _value(argv, "--decode")
    print(f"fake router: prefill {prefill} (bootstrap {argv[argv.index('--prefill') + 2]}), decode {decode}",
          flush=True)

    def up(url: str) -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _pass(self, body=None):
            if self.path == "/health":
                ok = up(prefill) and up(decode)
                self.send_response(200 if ok else 503)
                self.end_headers()
                return
            req = urllib.request.Request(decode + self.path, data=body, method=self.command,
                                         headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    status, data = r.status, r.read()
            except urllib.error.HTTPError as e:
                status, data = e.code, e.read()
            except OSError as e:
                status, data = 502, str(e).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._pass()

        def do_POST(self):
            self._pass(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    ThreadingHTTPServer((host, port), Handler).serve_forever()
    return 0


def main(argv: list[str]) -> int:
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    if "--pd-disaggregation" in argv:
        return router(argv, host, port)
    mode = os.environ.get("FAKE_ENGINE_MODE", "ok")
    if _value(argv, "--disaggregation-mode") == "prefill":
        mode = os.environ.get("FAKE_ENGINE_PREFILL_MODE", mode)
    model = _value(argv, "--model") or _value(argv, "--model-path")
    print(f"fake engine: serving {model} on {host}:{port} ({mode})", flush=True)
    ipc = os.environ.get("VLLM_RPC_BASE_PATH")
    if ipc and "--model" in argv:  # as vLLM does (vllm/utils/network_utils.py): a ZMQ socket there, never unlinked
        import socket
        import uuid

        sock = socket.socket(socket.AF_UNIX)
        sock.bind(os.path.join(ipc, str(uuid.uuid4())))
        print(f"fake engine: ipc {sock.getsockname()}", flush=True)
    if mode == "fail":
        print("INFO loading weights", flush=True)
        print("ValueError: fake engine refuses this model", flush=True)
        return 1
    if mode in ("never", "die"):
        child = subprocess.Popen(["sleep", "600"])
        print(f"fake engine: child {child.pid}", flush=True)
    if mode == "never":
        time.sleep(600)
        return 0
    from completions_server import serve_forever

    def die(req):
        print("fake engine: dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def broken(req):
        print("(EngineCore pid=1) ERROR [core.py:1512] Traceback (most recent call last):", flush=True)
        print("(EngineCore pid=1) ERROR [core.py:1512] NotImplementedError: \"cpu_gemm_wna16\" not implemented "
              "for 'Float'", flush=True)
        print('INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error', flush=True)
        return 500, {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root "
                                          "cause.", "type": "InternalServerError", "code": 500}}

    serve_forever(model, host, port, on_request={"die": die, "broken": broken}.get(mode))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
