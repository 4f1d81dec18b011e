"""A stand-in for an engine's launcher, for the failures a real engine cannot be made to show on
demand (tests/test_serve.py): started as ``python -m vllm.entrypoints.openai.api_server --model MODEL
--host H --port P ...`` by ``tests/test_serve.py``'s fake interpreter. FAKE_ENGINE_MODE:

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


def main(argv: list[str]) -> int:
    mode = os.environ.get("FAKE_ENGINE_MODE", "ok")
    model = argv[argv.index("--model") + 1]
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    print(f"fake engine: serving {model} on {host}:{port} ({mode})", flush=True)
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
