#!/usr/bin/env python3
"""What a GPTQ layer's exchange between ranks costs, side by side in one run: a slice of captures
(per-sample fp32 hidden states with their top-k, as ``methods/streamed.py`` sends them) broadcast
from rank 0 and gathered to rank 0, the way this tool sends it (``World.broadcast`` /
``World.gather``: raw tensor bytes on the world's backend, ``quantize/wire.py``) and pickled whole
(``broadcast_object_list`` / ``gather_object``, how it went before). Gloo on this machine's CPUs;
under NCCL the raw bytes go over NVLink, which this machine cannot show. Not a test.

    python scripts/bench_exchange.py [--ranks 2] [--mib 256] [--tokens 512] [--hidden 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _slice(mib: int, tokens: int, hidden: int, k: int = 8):
    import torch

    n = max(1, (mib << 20) // (tokens * hidden * 4))
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(tokens, hidden, generator=g), torch.randint(0, 256, (tokens, k), generator=g),
             torch.rand(tokens, k, generator=g)) for _ in range(n)]


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from quantize import distributed as D

    with D.world(600) as w:
        msg = _slice(a.mib, a.tokens, a.hidden)
        nbytes = sum(t.numel() * t.element_size() for r in msg for t in r)
        times: dict[str, list[float]] = {}

        def timed(name, fn):
            for _ in range(a.repeat):
                dist.barrier()
                t = time.perf_counter()
                out = fn()
                dist.barrier()
                times.setdefault(name, []).append(time.perf_counter() - t)
                del out

        def pickled_broadcast():
            box = [msg if w.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        def pickled_gather():
            out = [None] * w.size if w.rank == 0 else None
            dist.gather_object(msg, out, dst=0)
            return out

        timed("broadcast, pickled", pickled_broadcast)
        timed("broadcast, raw", lambda: w.broadcast(msg if w.rank == 0 else None, "bench", src=0))
        timed("gather to 0, pickled", pickled_gather)
        timed("gather to 0, raw", lambda: w.gather(msg, "bench", to=0))
        got = w.broadcast(msg if w.rank == 0 else None, "check", src=0)
        same = all(torch.equal(x, y) for r, s in zip(got, msg) for x, y in zip(r, s))
        if w.is_writer:
            print(f"{w.size} ranks (gloo), one slice of {len(msg)} samples x {a.tokens} tokens x {a.hidden} "
                  f"(fp32 hidden, top-8 ids and weights): {nbytes / 2**20:.0f} MiB; best of {a.repeat}")
            print(f"{'collective':24} {'s':>8} {'GiB/s':>8}")
            for name, ts in times.items():
                print(f"{name:24} {min(ts):8.3f} {nbytes / 2**30 / min(ts):8.2f}")
            for what in ("broadcast", "gather to 0"):
                r = min(times[f"{what}, pickled"]) / min(times[f"{what}, raw"])
                print(f"{what}: pickled / raw = {r:.2f}")
            print(f"received bit for bit: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=int, default=256, help="the slice's size (the exchange's most per collective)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.ranks), "--standalone",
            __file__, "--worker", "--mib", str(a.mib), "--tokens", str(a.tokens), "--hidden", str(a.hidden),
            "--repeat", str(a.repeat)]
    sys.exit(subprocess.run(args, env=env).returncode)


if __name__ == "__main__":
    main()
