"""Fused conversion kernels in C (quant.c), compiled on first use with the machine's C compiler
and loaded with ctypes (which releases the GIL during the call, so worker threads run in
parallel). Bit-identical to the torch reference in ``formats/int4.py``/``fp8.py`` (tested).

The build never crashes the caller: a missing or failing compiler (``CC``, parsed like a shell
word list, so ``CC="ccache gcc"`` works), a compiler that runs past ``QUANTIZE_CC_TIMEOUT``
seconds (default 120), an unwritable cache folder (``QUANTIZE_CACHE``, default
``~/.cache/quantize``; a private temp folder is used instead) or a library that does not load
all fall back to the torch reference, with one ``RuntimeWarning`` per process. ``QUANTIZE_NATIVE=0``
selects the torch path silently. ``status()`` says which path runs and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from ..fp8 import scale_as_float

SRC = Path(__file__).with_name("quant.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
CC_TIMEOUT = 120.0  # seconds; QUANTIZE_CC_TIMEOUT overrides
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why: str | None = None  # why the build attempt failed (None: it worked, or was not tried yet)
_compiler: list[str] | None = None
_library: str | None = None
_warned = False
_LUT: torch.Tensor | None = None

P = ctypes.c_void_p
I64 = ctypes.c_int64


def _cpu_key() -> str:
    try:
        txt = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in txt.splitlines() if ln.startswith("flags")), "")
        model = next((ln for ln in txt.splitlines() if ln.startswith("model name")), "")
        return hashlib.sha256((flags + model).encode()).hexdigest()[:12]
    except OSError:
        return platform.machine()


def _cache_dir() -> Path:
    base = os.environ.get("QUANTIZE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "quantize")
    return Path(base)


def _disabled() -> bool:
    return os.environ.get("QUANTIZE_NATIVE", "1") == "0"


class _Unavailable(Exception):
    """The build attempt failed; the message is the reason."""


def _compiler_argv() -> list[str]:
    env = os.environ.get("CC", "").strip()
    if env:
        try:
            argv = shlex.split(env)
        except ValueError as e:
            raise _Unavailable(f"cannot parse CC={env!r}: {e}") from None
        if not argv:
            raise _Unavailable(f"cannot parse CC={env!r}")
        if shutil.which(argv[0]) is None:
            raise _Unavailable(f"compiler {argv[0]!r} from CC={env!r} not found")
        return argv
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise _Unavailable("no C compiler found: install gcc or set CC")
    return [cc]


def _timeout() -> float:
    try:
        t = float(os.environ.get("QUANTIZE_CC_TIMEOUT") or CC_TIMEOUT)
    except ValueError:
        return CC_TIMEOUT
    return t if t > 0 else CC_TIMEOUT


def _writable_dir(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d, suffix=".probe")
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError:
        return False


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:
        return False


_private: list[tempfile.TemporaryDirectory] = []


def _private_dir() -> Path:
    """A private temp folder for this process's build (the TemporaryDirectory removes it at exit)."""
    if not _private:
        _private.append(tempfile.TemporaryDirectory(prefix="quantize-native-"))
    return Path(_private[0].name)


def _run_compiler(cmd: list[str], timeout: float) -> tuple[int, str]:
    """-> (returncode, stderr); raises _Unavailable on a hang or a compiler that does not start."""
    try:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    except OSError as e:
        raise _Unavailable(f"cannot run {shlex.join(cmd[:1])} ({e.strerror or e})") from None
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:  # the whole group: ccache/gcc wrappers start children of their own
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            p.kill()
        p.communicate()
        raise _Unavailable(f"C compiler timed out after {timeout:g} s (QUANTIZE_CC_TIMEOUT)") from None
    return p.returncode, err or ""


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.quant_rows.restype = ctypes.c_int
    lib.quant_rows.argtypes = [P, ctypes.c_int, P, P, I64, I64, I64, I64, I64, I64, ctypes.c_int, P, P, P]
    lib.dequant_rows.restype = ctypes.c_int
    lib.dequant_rows.argtypes = [P, P, P, I64, I64, I64, I64, I64, ctypes.c_int, P]
    lib.error_rows.restype = ctypes.c_int
    lib.error_rows.argtypes = [P, ctypes.c_int, P, I64, I64, I64, I64, I64, I64, P, P, P]
    lib.minmax_lanes.restype = ctypes.c_int
    lib.minmax_lanes.argtypes = []
    return lib


def _compile() -> ctypes.CDLL:
    """Build (or find in the cache) and load quant.c; raises _Unavailable with the reason."""
    global _compiler, _library
    argv = _compiler_argv()
    _compiler = argv
    src = SRC.read_bytes()
    timeout = _timeout()
    cache = _cache_dir()
    dirs = [cache]
    why = "C compile failed"
    for extra in (["-march=native"], []):
        flags = FLAGS + extra
        key = hashlib.sha256(src + " ".join(argv + flags).encode() + _cpu_key().encode()).hexdigest()[:16]
        name = f"quant-{platform.machine()}-{key}.so"
        out = next((d / name for d in dirs if _is_file(d / name)), None)
        if out is None:
            if not _writable_dir(dirs[-1]):
                try:
                    dirs.append(_private_dir())
                except OSError as e:
                    raise _Unavailable(f"cache folder {cache} is not writable and no temp folder "
                                       f"({e.strerror or e})") from None
            out = dirs[-1] / name
            try:
                fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
                os.close(fd)
            except OSError as e:
                raise _Unavailable(f"cannot write in {out.parent} ({e.strerror or e})") from None
            try:
                rc, err = _run_compiler([*argv, *flags, "-o", tmp, str(SRC), "-lm"], timeout)
                if rc != 0:
                    lines = err.strip().splitlines()
                    why = f"C compile failed: {lines[-1].strip() if lines else f'exit status {rc}'}"
                    continue
                os.replace(tmp, out)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        try:
            lib = _bind(ctypes.CDLL(str(out)))
        except (OSError, AttributeError) as e:
            why = f"cannot load {out} ({e})"
            continue
        _library = str(out)
        return lib
    raise _Unavailable(why)


def _warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        # stacklevel 4: the line that called lib() or status() (via _ensure)
        warnings.warn(f"quantize: native kernels unavailable ({reason}); using the torch path (same output, slower)",
                      RuntimeWarning, stacklevel=4)


def _ensure() -> None:
    """The one-time build attempt (thread-safe); warns once when it fails."""
    global _lib, _tried, _why, _LUT
    if _tried:
        return
    with _lock:
        if _tried:
            return
        if _LUT is None:
            _LUT = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().contiguous()
        try:
            _lib, _why = _compile(), None
        except _Unavailable as e:
            _lib, _why = None, str(e)
        except Exception as e:  # never crash the caller: the torch path always works
            _lib, _why = None, f"{type(e).__name__}: {e}"
        _tried = True
    if _why is not None:
        _warn_once(_why)


def lib() -> ctypes.CDLL | None:
    """The compiled kernels, or None (then ``why_unavailable()`` says why)."""
    if _disabled():
        return None
    _ensure()
    return _lib


def why_unavailable() -> str | None:
    if _disabled():
        return "disabled by QUANTIZE_NATIVE=0"
    return _why


def status() -> dict:
    """Which conversion path runs: {"path": "native" | "torch", "reason": str | None (why torch),
    "compiler": the compiler argv or None, "library": the loaded .so or None}. Builds on first call."""
    if _disabled():
        return {"path": "torch", "reason": "disabled by QUANTIZE_NATIVE=0", "compiler": None, "library": None}
    _ensure()
    if _lib is not None:
        return {"path": "native", "reason": None, "compiler": list(_compiler or []), "library": _library}
    return {"path": "torch", "reason": _why, "compiler": list(_compiler) if _compiler else None, "library": None}


def _reset() -> None:
    """Forget the build attempt and the warning (tests only); the next lib()/status() tries again."""
    global _lib, _tried, _why, _compiler, _library, _warned
    with _lock:
        _lib, _tried, _why, _compiler, _library, _warned = None, False, None, None, None, False
        _private.clear()  # a new private folder next time (an old one is still removed at exit)


MAX_K = 65536  # quant.c MAXK: one row lives on the C stack


def supports(k: int, group: int) -> bool:
    """Shapes quant.c takes (others use the torch reference)."""
    return k <= MAX_K and group % 16 == 0 and group <= 128 and k % group == 0


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _scale_args(w: torch.Tensor, scale: torch.Tensor | None, scale_format: str | None, block=(128, 128)):
    """-> (src_kind, sinv fp32 contiguous, br, bc, sinv_cols)"""
    if w.dtype == torch.float8_e4m3fn:
        s = scale_as_float(scale).contiguous()  # a uint8 UE8M0 exponent byte is 2**(b-127), not b
        if scale_format == "block":
            return 0, s, block[0], block[1], s.shape[1]
        if s.numel() == 1:
            return 4, s.reshape(1), 1, 1, 1
        return 3, s.reshape(-1), 1, 1, 1
    if w.dtype == torch.bfloat16:
        return 1, torch.zeros(1), 1, 1, 1
    if w.dtype == torch.float32:
        return 2, torch.zeros(1), 1, 1, 1
    raise TypeError(w.dtype)


OBSERVERS = {"minmax": 0, "fullrange": 2}  # quant.c's observer numbers (mse: the torch path, layout.NATIVE_OBSERVERS)


def quant_rows(w: torch.Tensor, scale: torch.Tensor | None, scale_format: str | None, group: int, observer: str,
               block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float, float], bool]:
    """w [R, K] fp8 (+ scale) / bf16 / fp32 -> (packed int32 [R, K/8], scale bf16 [R, K/g],
    (sq_err, sq_ref, max_abs_err), saw_nan_or_inf)."""
    L = lib()
    assert L is not None
    R, K = w.shape
    w = w.contiguous()
    if scale_format == "block" and block[1] % group:
        raise ValueError(f"group {group} straddles {block[1]}-column FP8 blocks")
    if not supports(K, group):
        raise ValueError(f"quant.c does not take K={K} with group {group}")
    kind, s, br, bc, cols = _scale_args(w, scale, scale_format, block)
    packed = torch.empty((R, K // 8), dtype=torch.int32)
    sc = torch.empty((R, K // group), dtype=torch.bfloat16)
    stats = (ctypes.c_double * 3)(0.0, 0.0, 0.0)
    src = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
    bad = L.quant_rows(_ptr(src), kind, _ptr(_LUT), _ptr(s), R, K, br, bc, cols, group,
                       OBSERVERS[observer], _ptr(packed), _ptr(sc), ctypes.addressof(stats))
    if bad not in (0, 1):
        raise ValueError(f"quant.c rejected K={K}, group {group}")
    return packed, sc, (stats[0], stats[1], stats[2]), bool(bad)


def error_rows(w: torch.Tensor, scale: torch.Tensor | None, scale_format: str | None, packed: torch.Tensor,
               qscale: torch.Tensor, block=(128, 128)) -> tuple[tuple[float, float, float], bool]:
    """The stored INT4 tensor (``packed`` int32 [R, K/8], ``qscale`` bf16 [R, K/g]) against the source
    rows ``w`` (fp8 + ``scale`` / bf16 / fp32), as ``int4.error_sums`` of the decoded rows measures it:
    ((sq_err, sq_ref, max_abs_err), saw_nan_or_inf)."""
    L = lib()
    assert L is not None
    R, K = w.shape
    g = K // qscale.shape[1]
    if qscale.dtype != torch.bfloat16 or tuple(packed.shape) != (R, K // 8) or not supports(K, g):
        raise ValueError(f"quant.c does not take {tuple(packed.shape)} / {qscale.dtype} {tuple(qscale.shape)}")
    w = w.contiguous()
    kind, s, br, bc, cols = _scale_args(w, scale, scale_format, block)
    src = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
    stats = (ctypes.c_double * 3)(0.0, 0.0, 0.0)
    pk, qs = packed.contiguous(), qscale.contiguous()
    bad = L.error_rows(_ptr(src), kind, _ptr(s), R, K, br, bc, cols, g, _ptr(pk.view(torch.uint8)),
                       _ptr(qs.view(torch.int16)), ctypes.addressof(stats))
    if bad not in (0, 1):
        raise ValueError(f"quant.c rejected K={K}, group {g}")
    return (stats[0], stats[1], stats[2]), bool(bad)


def dequant_rows(w: torch.Tensor, scale: torch.Tensor, scale_format: str,
                 block=(128, 128)) -> tuple[torch.Tensor, bool]:
    """FP8 [R, K] + scale -> (bf16 [R, K], saw_nan_or_inf)."""
    L = lib()
    assert L is not None
    R, K = w.shape
    kind, s, br, bc, cols = _scale_args(w, scale, scale_format, block)
    out = torch.empty((R, K), dtype=torch.bfloat16)
    per_row = {0: 0, 3: 1, 4: 2}[kind]
    bad = L.dequant_rows(_ptr(w.contiguous().view(torch.uint8)), _ptr(_LUT), _ptr(s), R, K, br, bc, cols, per_row,
                         _ptr(out))
    return out, bool(bad)
