"""Compile the Triton kernels for a GPU that is not here (ahead of time), and read what was built.

A GPU lease is short; a kernel that does not build for sm90, or spills registers there, should be
found before one. Triton compiles for any target without a device: the launch is specialized by the
JIT's own binder (``create_function_from_signature``: the same constexprs, ``== 1`` and divisibility
attributes a real launch gets), here on meta tensors, then lowered to a cubin by the ptxas bundled with
Triton. ``cuobjdump`` (bundled too) reads the registers, spills and SASS back.

What each built kernel reports:

* ``regs``, ``stack`` and ``spill_bytes`` from ptxas's own ``-v`` report (spilled registers go to local
  memory: a memory-bound kernel that spills reads its own stack from memory), ``shared_bytes`` (Triton's
  shared memory: the staged loads, the layout conversions; over an SM's 227 KiB it cannot launch);
* ``async_copies``: whether the SASS holds ``LDGSTS`` (cp.async), that is whether Triton's software
  pipeliner staged the loop's loads (``num_stages``); without it each K step waits for its own loads;
* ``loop_ops``: SASS instructions in the main loop (the longest backward branch) and ``ops_per_word``,
  that per packed int32 word a thread handles per step;
* ``programs_per_sm``: how many programs fit one SM at once by registers, shared memory, threads and
  the block limit (compute capability 9.0: 64K registers, 2048 threads, 32 blocks, 227 KiB shared per
  SM; registers allocated per warp in units of 256: the CUDA C++ Programming Guide's "Technical
  Specifications per Compute Capability" table and its occupancy calculator).

Static facts, not timings: they say where a kernel cannot be fast (spills, no staging, too few
programs per SM to hide memory latency), never how fast it is. ``scripts/bench_kernels.py`` times.

    python -m quantize.kernels.aot [--json] [--config KIND N K M CONFIG ...]

Without ``--config``: every config the kernels ship (``TUNED``, ``MOE_TUNED`` and the heuristics' tiles,
with one K split and with several), each distinct compile once, for sm90 (H100/H200); exit 1 if any fails to build,
spills or needs more shared memory than an SM has.
Must run without ``TRITON_INTERPRET=1`` (the interpreter replaces the JIT functions it compiles).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

# compute capability 9.0 limits per SM (CUDA C++ Programming Guide, technical specifications table)
SM90 = {"regs": 65536, "threads": 2048, "blocks": 32, "shared": 227 * 1024, "reg_unit": 256,
        "shared_reserved": 1024}  # shared memory the system reserves per block (cc 8.0 and later)
GROUP = 32  # the group the shipped tables were measured at (scripts/bench_kernels.py's default)
M_BUCKETS = (1, 16, 64, 256)
HEURISTIC_SHAPE = (4096, 4096)  # (N, K) the heuristics' tiles are built for: no table holds it
MOE_EXPERTS = 8  # the bench's fused-MoE case: 8 experts, every token routed to all of them


@dataclass
class Built:
    kind: str  # "splitk" or "moe"
    config: str
    shape: str  # the first (N, K, M) it was compiled for
    regs: int | None = None
    stack: int | None = None  # the stack frame, bytes (local memory)
    spill_bytes: int | None = None  # ptxas's spill stores + spill loads
    shared_bytes: int | None = None
    async_copies: bool | None = None
    loop_ops: int | None = None
    ops_per_word: float | None = None
    programs_per_sm: int | None = None
    error: str | None = None


def _meta(*shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def splitk_launch_for(n: int, k: int, m: int, cfg, group: int = GROUP):
    """The split-K kernel's launch as ``w4a16_triton`` builds it on a GPU, on meta tensors."""
    from quantize.kernels.triton_w4a16 import splitk_launch

    x, w, s = _meta(m, k, dtype=torch.bfloat16), _meta(n, k // 8, dtype=torch.int32), \
        _meta(n, k // group, dtype=torch.bfloat16)
    return splitk_launch(x, w, s, n, k, cfg, gpu=True)[0]


def moe_launch_for(n: int, k: int, m: int, cfg, experts: int = MOE_EXPERTS, group: int = GROUP):
    """The fused MoE kernel's first GEMM (x row = pair // top-k) as ``moe_w4a16`` launches it on a GPU for
    ``m`` tokens each routed to all ``experts``, on meta tensors (``moe_align``'s shapes, not its values)."""
    from quantize.kernels.moe import align_blocks
    from quantize.kernels.triton_moe import moe_launch

    pairs = m * experts
    blocks = align_blocks(pairs, cfg.block_m, experts)
    align = (_meta(blocks * cfg.block_m, dtype=torch.int32), _meta(blocks, dtype=torch.int32),
             _meta(1, dtype=torch.int32))
    x = _meta(m, k, dtype=torch.bfloat16)
    w, s = _meta(experts, n, k // 8, dtype=torch.int32), _meta(experts, n, k // group, dtype=torch.bfloat16)
    return moe_launch(x, w, s, align, pairs, experts, cfg, k, gpu=True)[0]


def compile_launch(launch, capability: int = 90):
    """The launch compiled for ``sm<capability>`` by the JIT's own specialization; -> (Triton's compiled
    kernel: ``.asm['cubin']``, ``.metadata``; ptxas's ``-v`` report). Raises where it cannot be built."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError("the kernels were loaded for Triton's interpreter (TRITON_INTERPRET=1): "
                           "run this without it")
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, spec, opts)
    src = ASTSource(kernel, signature, constexprs, attrs)
    log = io.StringIO()
    # Triton prints ptxas's -v report (registers, stack frame, spill bytes) when asked to, on a real compile
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True  # a cached kernel runs no ptxas and reports nothing
        knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(src, target=target, options=options.__dict__)
    return compiled, log.getvalue()


def missing() -> str | None:
    """Why this machine cannot compile for a GPU target (None: it can): Triton or its NVIDIA tools absent."""
    try:
        for name in ("ptxas", "cuobjdump"):
            _tool(name)
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"cannot compile for a GPU here: {e}"
    return None


def _tool(name: str) -> str:
    from triton import knobs

    path = getattr(knobs.nvidia, name).path
    if not path or not os.path.exists(path):
        raise RuntimeError(f"Triton's {name} is not here: its NVIDIA backend is needed to read a cubin")
    return path


def _cubin_text(cubin: bytes, flag: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(cubin)
        return subprocess.run([_tool("cuobjdump"), flag, p], capture_output=True, text=True, check=True).stdout


_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def main_loop(sass: str) -> list[str]:
    """The opcodes of the longest loop in the SASS (a branch back to an earlier address)."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _INS.finditer(sass)]
    best: list[str] = []
    for addr, op, rest in ins:
        if op.startswith("BRA"):
            to = re.search(r"0x([0-9a-f]+)", rest)
            if to and int(to.group(1), 16) < addr:
                body = [o for a, o, _ in ins if int(to.group(1), 16) <= a <= addr]
                best = max(best, body, key=len)
    return best


def ptxas_report(log: str) -> tuple[int, int, int] | None:
    """ptxas -v's lines for the kernel -> (registers, stack frame bytes, spill stores + loads bytes)."""
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or frame is None:
        return None
    return int(regs.group(1)), int(frame.group(1)), int(frame.group(2)) + int(frame.group(3))


def programs_per_sm(regs: int, threads: int, shared: int, limits: dict = SM90) -> int:
    unit = limits["reg_unit"]
    per_warp = -(-regs * 32 // unit) * unit
    by_regs = limits["regs"] // (per_warp * (threads // 32)) if regs else limits["blocks"]
    by_shared = (limits["shared"] + limits["shared_reserved"]) // (shared + limits["shared_reserved"])
    return min(by_regs, by_shared, limits["threads"] // threads, limits["blocks"])


def inspect(kind: str, n: int, k: int, m: int, cfg, capability: int = 90) -> Built:
    """Compile one config and read back what was built (``error`` set where it did not build)."""
    rec = Built(kind, str(cfg), f"N={n} K={k} M={m}")
    try:
        launch = (splitk_launch_for if kind == "splitk" else moe_launch_for)(n, k, m, cfg)
        compiled, ptxas = compile_launch(launch, capability)
        sass = _cubin_text(compiled.asm["cubin"], "-sass")
    except Exception as e:  # noqa: BLE001 - reported per config, the caller decides
        rec.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return rec
    report = ptxas_report(ptxas)
    if report is None:
        rec.error = f"ptxas's -v report has no registers / stack frame / spill lines: {ptxas[-300:]!r}"
        return rec
    rec.regs, rec.stack, rec.spill_bytes = report
    rec.shared_bytes = int(getattr(compiled.metadata, "shared", 0) or 0)
    rec.async_copies = "LDGSTS" in sass
    loop = main_loop(sass)
    rec.loop_ops = len(loop)
    threads = cfg.num_warps * 32
    words_per_thread = cfg.block_n * cfg.block_k / 8 / threads
    rec.ops_per_word = round(len(loop) / words_per_thread, 2) if loop else None
    rec.programs_per_sm = programs_per_sm(rec.regs, threads, rec.shared_bytes)
    return rec


def compile_key(kind: str, cfg) -> tuple:
    """What tells two launches' compiles apart: the tiles, warps and stages, and whether K is split (a
    split writes an fp32 workspace, one split the bf16 output); not the number of splits."""
    return kind, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.split_k > 1


def shipped() -> list[tuple[str, int, int, int, object]]:
    """(kind, N, K, M, config) for every distinct compile the kernels ship: the measured tables, then the
    heuristics' tiles (any shape no sweep measured) with one split and with several; the first shape of
    each compile key."""
    from quantize.kernels.triton_moe import MOE_TUNED
    from quantize.kernels.triton_w4a16 import TUNED, Config, heuristic_tiles

    out, seen = [], set()

    def add(kind, n, k, m, cfg):
        if compile_key(kind, cfg) not in seen:
            seen.add(compile_key(kind, cfg))
            out.append((kind, n, k, m, cfg))

    for (n, k, b), cfg in TUNED.items():
        add("splitk", n, k, b, cfg)
    for (n, k, b), cfg in MOE_TUNED.items():
        add("moe", n, k, b, cfg)
    n, k = HEURISTIC_SHAPE
    for m in M_BUCKETS:
        bm, bn, bk, warps, stages = heuristic_tiles(m, k)
        for split in (1, 2):
            for kind in ("splitk", "moe"):
                add(kind, n, k, m, Config(bm, bn, bk, split, warps, stages))
    return out


def _config(text: str):
    """``m1n16k512s1w4p3`` (``Config.__str__``) -> Config."""
    from quantize.kernels.triton_w4a16 import Config

    got = re.fullmatch(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)p(\d+)", text)
    if got is None:
        raise SystemExit(f"aot: config {text!r} is not in the form m1n16k512s1w4p3 (block m, n, k, split, "
                         f"warps, stages)")
    return Config(*map(int, got.groups()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quantize.kernels.aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    ap.add_argument("--config", nargs=5, action="append", metavar=("KIND", "N", "K", "M", "CONFIG"),
                    help="a config instead of the shipped ones (repeatable): splitk|moe N K M m1n16k512s1w4p3")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("aot: TRITON_INTERPRET=1 replaces the kernels with the interpreter's; unset it", file=sys.stderr)
        return 2
    if a.config:
        todo = []
        for kind, n, k, m, cfg in a.config:
            if kind not in ("splitk", "moe"):
                print(f"aot: kind {kind!r} is not splitk or moe", file=sys.stderr)
                return 2
            todo.append((kind, int(n), int(k), int(m), _config(cfg)))
    else:
        todo = shipped()
    recs = [inspect(kind, n, k, m, cfg) for kind, n, k, m, cfg in todo]
    if a.json:
        print(json.dumps([asdict(r) for r in recs], indent=1))
    else:
        print(f"{'kernel':6s} {'config':20s} {'first shape':22s} {'regs':>4s} {'spill B':>7s} {'shared':>6s} "
              f"{'async':>5s} {'loop':>5s} {'op/word':>7s} {'prog/SM':>7s}")
        for r in recs:
            if r.error:
                print(f"{r.kind:6s} {r.config:20s} {r.shape:22s} FAILED: {r.error}")
                continue
            print(f"{r.kind:6s} {r.config:20s} {r.shape:22s} {r.regs:4d} {r.spill_bytes:7d} {r.shared_bytes:6d} "
                  f"{'yes' if r.async_copies else 'no':>5s} {r.loop_ops:5d} {r.ops_per_word or 0:7.2f} "
                  f"{r.programs_per_sm:7d}")
    bad = [(r, problem(r)) for r in recs if problem(r)]
    for r, why in bad:
        print(f"aot: {r.kind} {r.config} ({r.shape}): {why}", file=sys.stderr)
    return 1 if bad else 0


def problem(r: Built, limits: dict = SM90) -> str | None:
    """Why a built config cannot ship (None: it can)."""
    if r.error:
        return r.error
    if r.spill_bytes:
        return f"spills registers: {r.spill_bytes} bytes of spill stores and loads (a smaller tile or more warps)"
    if r.shared_bytes > limits["shared"]:
        return (f"needs {r.shared_bytes} bytes of shared memory, a block may have {limits['shared']} on sm90 "
                f"(fewer stages or a smaller tile)")
    return None


if __name__ == "__main__":
    sys.exit(main())
