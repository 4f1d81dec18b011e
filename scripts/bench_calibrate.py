#!/usr/bin/env python3
"""calibrate-kv memory and speed: the same wide model at 4 and 16 layers.

Layer streaming keeps one decoder layer's weights (plus the hidden states) in memory, so peak RSS
should barely move with depth (goal: ratio <= 1.25). Each run is its own process; prints peak RSS
(VmHWM), the ratio, and seconds per token per layer. Not a test.

    python scripts/bench_calibrate.py [--hidden 2048] [--intermediate 8192] [--samples 16] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = r"""
import json, sys, time
from quantize.calibrate.kv import calibrate_kv
t = time.time()
r = calibrate_kv(sys.argv[1], sys.argv[2], samples=int(sys.argv[3]), seq_len=int(sys.argv[4]), target="vllm",
                 error_samples=2)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"seconds": time.time() - t, "tokens": r.tokens, "layers": len(r.layers),
                  "peak_rss": int(hwm) * 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    a = ap.parse_args()
    from quantize.testing.tiny import make_tiny

    res = {}
    with tempfile.TemporaryDirectory() as d:
        for layers in (4, 16):
            src = Path(d) / f"l{layers}"
            make_tiny("llama", src, layout="bf16", num_shards=4, overrides={
                "hidden_size": a.hidden, "intermediate_size": a.intermediate, "num_hidden_layers": layers,
                "num_attention_heads": 16, "num_key_value_heads": 4})
            disk = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            p = subprocess.run([sys.executable, "-c", RUN, str(src), str(Path(d) / f"o{layers}"), str(a.samples),
                                str(a.seq_len)],
                               capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(p.stderr[-2000:])
            res[layers] = {**json.loads(p.stdout.strip().splitlines()[-1]), "disk": disk}
    print(f"{'layers':>6s} {'weights on disk':>16s} {'peak RSS':>10s} {'s/token/layer':>14s}")
    for layers, r in res.items():
        print(f"{layers:6d} {r['disk'] / 2**30:13.2f} GiB {r['peak_rss'] / 2**30:7.2f} GiB "
              f"{r['seconds'] / r['tokens'] / r['layers']:14.2e}")
    print(f"peak RSS ratio 16/4 layers: {res[16]['peak_rss'] / res[4]['peak_rss']:.3f} "
          f"(weights ratio {res[16]['disk'] / res[4]['disk']:.2f})")


if __name__ == "__main__":
    main()
