"""Fused conversion kernels in C (quant.c), compiled on first use with the machine's C compiler
and loaded with ctypes (which releases the GIL during the call, so worker threads run in
parallel). Bit-identical to the torch reference in ``formats/int4.py``/``fp8.py`` (tested); when
no compiler is available, or ``QUANTIZE_NATIVE=0``, callers fall back to that reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SRC = Path(__file__).with_name("quant.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why: str | None = None
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


def _compile() -> ctypes.CDLL | None:
    global _why
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        _why = "no C compiler found (install gcc); using the slower torch path"
        return None
    src = SRC.read_bytes()
    for extra in (["-march=native"], []):
        flags = FLAGS + extra
        key = hashlib.sha256(src + " ".join([cc] + flags).encode() + _cpu_key().encode()).hexdigest()[:16]
        out = _cache_dir() / f"quant-{platform.machine()}-{key}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
            os.close(fd)
            r = subprocess.run([cc, *flags, "-o", tmp, str(SRC), "-lm"], capture_output=True, text=True)
            if r.returncode != 0:
                os.unlink(tmp)
                _why = f"C compile failed ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}); using the torch path"
                continue
            os.replace(tmp, out)
        try:
            lib = ctypes.CDLL(str(out))
        except OSError as e:
            _why = f"cannot load {out} ({e}); using the torch path"
            continue
        lib.quant_rows.restype = ctypes.c_int
        lib.quant_rows.argtypes = [P, ctypes.c_int, P, P, I64, I64, I64, I64, I64, I64, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_float, P, P, P]
        lib.dequant_rows.restype = ctypes.c_int
        lib.dequant_rows.argtypes = [P, P, P, I64, I64, I64, I64, I64, ctypes.c_int, P]
        _why = None
        return lib
    return None


def lib() -> ctypes.CDLL | None:
    """The compiled kernels, or None (then ``why_unavailable()`` says why)."""
    global _lib, _tried, _why, _LUT
    if os.environ.get("QUANTIZE_NATIVE", "1") == "0":
        _why = "disabled by QUANTIZE_NATIVE=0"
        return None
    if not _tried:
        with _lock:
            if not _tried:
                _lib = _compile()
                _LUT = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().contiguous()
                _tried = True
    return _lib


def why_unavailable() -> str | None:
    return _why


MAX_K = 65536  # quant.c MAXK: one row lives on the C stack


def supports(k: int, group: int) -> bool:
    """Shapes quant.c takes (others use the torch reference)."""
    return k <= MAX_K and group % 16 == 0 and group <= 128 and k % group == 0


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _scale_args(w: torch.Tensor, scale: torch.Tensor | None, scale_format: str | None, block=(128, 128)):
    """-> (src_kind, sinv fp32 contiguous, br, bc, sinv_cols)"""
    if w.dtype == torch.float8_e4m3fn:
        s = scale.float().contiguous()
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


def quant_rows(w: torch.Tensor, scale: torch.Tensor | None, scale_format: str | None, group: int, observer: str,
               mse=(100, 20, 2.4), block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float, float], bool]:
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
    bad = L.quant_rows(_ptr(src), kind, _ptr(_LUT), _ptr(s), R, K, br, bc, cols, group, 0 if observer == "minmax" else 1,
                       mse[0], mse[1], mse[2], _ptr(packed), _ptr(sc), ctypes.addressof(stats))
    if bad not in (0, 1):
        raise ValueError(f"quant.c rejected K={K}, group {group}")
    return packed, sc, (stats[0], stats[1], stats[2]), bool(bad)


def dequant_rows(w: torch.Tensor, scale: torch.Tensor, scale_format: str, block=(128, 128)) -> tuple[torch.Tensor, bool]:
    """FP8 [R, K] + scale -> (bf16 [R, K], saw_nan_or_inf)."""
    L = lib()
    assert L is not None
    R, K = w.shape
    kind, s, br, bc, cols = _scale_args(w, scale, scale_format, block)
    out = torch.empty((R, K), dtype=torch.bfloat16)
    per_row = {0: 0, 3: 1, 4: 2}[kind]
    bad = L.dequant_rows(_ptr(w.contiguous().view(torch.uint8)), _ptr(_LUT), _ptr(s), R, K, br, bc, cols, per_row, _ptr(out))
    return out, bool(bad)
