"""Next-token KL divergence between a baseline and a candidate model (``quantize eval-kld``).

The same text goes through both models in fixed-size chunks; per token, KL(P_base || P_cand) over
the whole vocabulary, top-1 agreement and each model's negative log-likelihood. Memory stays
bounded by one chunk's logits per model; only per-token scalars are kept. The baseline's
log-probabilities can be saved once (``save_baseline``, fp16 safetensors written chunk by chunk)
and reused (``baseline_logits``) so the reference model need not be loaded again.

``kld_table`` compares several candidates of one source in one table: the baseline runs once, its
log-probabilities kept exactly (fp32, in a temporary file) for every candidate, which are loaded
one at a time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..checkpoint.index import read_tensor
from ..checkpoint.writer import Entry, StreamWriter
from ..errors import QuantizeError
from ..events import Emit, null_emit
from ..options import KLDOptions, takes

DEFAULT_TEXT = Path(__file__).with_name("kld_default.txt")


@dataclass
class KldReport:
    baseline: str
    candidate: str
    tokens: int
    chunk: int
    kld_mean: float
    kld_median: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    top1_agreement: float
    ppl_baseline: float
    ppl_candidate: float
    ppl_ratio: float
    text: str

    def to_dict(self) -> dict:
        return asdict(self)


def check_device(device: str) -> torch.device:
    """``--device`` for local models: cpu, or cuda / cuda:N when that GPU is visible; one line otherwise."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise QuantizeError(f"--device {device}: unknown; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise QuantizeError(f"--device {device}: no CUDA GPU is visible here; use --device cpu")
    dev = torch.device(device)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise QuantizeError(f"--device {device}: only {torch.cuda.device_count()} CUDA GPU(s) are visible; "
                            f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return dev


def _load(path: Path, dtype: torch.dtype, device: torch.device = torch.device("cpu")):
    import transformers

    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else None
    if cfg is None:
        raise QuantizeError(f"{path}: no config.json; pass a model folder")
    arch = (cfg.get("architectures") or [""])[0]
    cls = getattr(transformers, {"KimiK25ForConditionalGeneration": "Kimi_K25ForConditionalGeneration"}.get(arch, arch),
                  None) \
        or transformers.AutoModelForCausalLM
    try:
        m = cls.from_pretrained(str(path), dtype=dtype)
    except Exception as e:  # noqa: BLE001 - surface one line naming the model
        raise QuantizeError(f"{path}: transformers cannot load this model "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from e
    return m.to(device=device, dtype=dtype).eval()


def _tokenizer(path: Path):
    from ..calibrate.data import load_tokenizer

    return load_tokenizer(path)


def _same_tokenizer(a, b, text: str, pa: Path, pb: Path) -> None:
    if a.get_vocab() != b.get_vocab() or a(text[:2000])["input_ids"] != b(text[:2000])["input_ids"]:
        raise QuantizeError(f"{pb}: its tokenizer differs from {pa}'s; KL divergence needs both models over the same "
                            f"token ids")


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] in fp32, on the model's device."""
    with torch.no_grad():
        out = model(input_ids=ids.unsqueeze(0).to(model.device))
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def kld(
    baseline: str | os.PathLike | None,
    candidate: str | os.PathLike,
    text: str | os.PathLike | None = None,
    tokens: int = 8192,
    chunk: int = 512,
    save_baseline: str | os.PathLike | None = None,
    baseline_logits: str | os.PathLike | None = None,
    dtype: str = "float32",
    out: str | os.PathLike | None = None,
    device: str = "cpu",
    emit: Emit = null_emit,
    keep_baseline: str | os.PathLike | None = None,
) -> KldReport:
    """``device``: where both models run (cpu, cuda, cuda:N); the statistics are the same.
    ``keep_baseline``: also write the baseline's log-probs there in fp32 (exact; ``kld_table``)."""
    dev = check_device(device)  # before anything is read or loaded
    cand_path = Path(candidate)
    text_path = Path(text) if text else DEFAULT_TEXT
    try:
        raw = text_path.read_text()
    except OSError as e:
        raise QuantizeError(f"--text {text_path}: cannot read ({e.strerror})") from e
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tok_c = _tokenizer(cand_path)
    if baseline is not None:
        tok_b = _tokenizer(Path(baseline))
        _same_tokenizer(tok_b, tok_c, raw, Path(baseline), cand_path)
    elif baseline_logits is None:
        raise QuantizeError("--baseline or --baseline-logits is required")
    ids = torch.tensor(tok_c(raw)["input_ids"][: tokens + 1])
    if ids.numel() < 2:
        raise QuantizeError(f"--text {text_path}: fewer than 2 tokens; pass a longer text")
    n_chunks = max(1, math.ceil((ids.numel() - 1) / chunk))
    chunks = [ids[i * chunk: min((i + 1) * chunk + 1, ids.numel())] for i in range(n_chunks)]
    chunks = [c for c in chunks if c.numel() >= 2]

    saved = None
    if baseline_logits is not None:
        saved = _open_logits(Path(baseline_logits))
        meta = saved["meta"]
        if meta["token_ids_sha"] != _sha_ids(ids, chunk):
            raise QuantizeError(f"{baseline_logits}: saved for another text, token count or chunk size; "
                                f"recompute it with --save-baseline")
    base_model = _load(Path(baseline), tdtype, dev) if saved is None else None
    cand_model = _load(cand_path, tdtype, dev)
    if base_model is not None and base_model.config.vocab_size != cand_model.config.vocab_size:
        raise QuantizeError(f"{cand_path}: vocabulary {cand_model.config.vocab_size} differs from the baseline's "
                            f"{base_model.config.vocab_size}")

    writers: list[tuple[StreamWriter, torch.dtype]] = []
    for path, st, tdt in ((save_baseline, "F16", torch.float16), (keep_baseline, "F32", torch.float32)):
        if path is not None and base_model is not None:
            vocab = int(base_model.config.vocab_size)
            entries = [Entry(f"chunk.{i}", st, (c.numel() - 1, vocab)) for i, c in enumerate(chunks)]
            writers.append((StreamWriter(Path(path), entries, {"format": "quantize-kld",
                                                               "token_ids_sha": _sha_ids(ids, chunk),
                                                               "baseline": str(baseline), "chunk": str(chunk)}), tdt))
    kl_all, agree, nll_b, nll_c = [], 0, 0.0, 0.0
    n = 0
    emit({"event": "start", "stage": "kld", "total_bytes": len(chunks), "done_bytes": 0})
    try:
        for i, c in enumerate(chunks):
            target = c[1:].to(dev)
            if saved is not None:
                lb = read_tensor(saved["folder"], saved["refs"][f"chunk.{i}"]).float().to(dev)
            else:
                lb = _logprobs(base_model, c[:-1])
                for writer, tdt in writers:
                    writer.write_tensor(f"chunk.{i}", lb.to(tdt).cpu())
            lc = _logprobs(cand_model, c[:-1])
            if lb.shape != lc.shape:
                raise QuantizeError(f"{cand_path}: logits shape {tuple(lc.shape)} differs from the baseline's "
                                    f"{tuple(lb.shape)}")
            pb = lb.exp()
            kl = (pb * (lb - lc)).sum(-1).clamp_min(0)
            kl_all.append(kl.cpu())
            agree += int((lb.argmax(-1) == lc.argmax(-1)).sum())
            nll_b -= float(lb.gather(-1, target.unsqueeze(-1)).sum())
            nll_c -= float(lc.gather(-1, target.unsqueeze(-1)).sum())
            n += target.numel()
            emit({"event": "tensor", "name": f"chunk {i}", "done_bytes": i + 1})
        for writer, _ in writers:
            writer.finish()
    except BaseException:
        for writer, _ in writers:
            writer.abort()
        raise
    k = torch.cat(kl_all).double()
    q = lambda p: float(torch.quantile(k, p)) if k.numel() > 1 else float(k[0])  # noqa: E731
    rep = KldReport(str(baseline or baseline_logits), str(candidate), n, chunk, float(k.mean()), q(0.5), q(0.99),
                    q(0.999), float(k.max()), agree / n, math.exp(nll_b / n), math.exp(nll_c / n),
                    math.exp((nll_c - nll_b) / n), str(text_path))
    if out is not None:
        Path(out).write_text(json.dumps(rep.to_dict(), indent=1))
    emit({"event": "done"})
    return rep


@dataclass
class KldTable:
    baseline: str
    reports: list[KldReport]

    def to_dict(self) -> dict:
        return {"kind": "kld-table", "baseline": self.baseline, "candidates": [r.to_dict() for r in self.reports]}


@takes(KLDOptions)
def kld_table(baseline, candidates, text, tokens, chunk, save_baseline, baseline_logits, dtype, out, device,
              emit: Emit = null_emit) -> KldTable:
    """Several candidates of one source, one table: the same text and chunks for all, the baseline
    computed once (kept exactly, fp32, for the others) or read from ``baseline_logits``. One
    candidate gives the same report as ``kld``. ``out``: {"kind": "kld-table", "baseline",
    "candidates": [report, ...]}."""
    import tempfile

    if not candidates:
        raise QuantizeError("--candidate is required (repeat it to compare several candidates of one baseline)")
    dupes = sorted({str(c) for c in candidates if [str(x) for x in candidates].count(str(c)) > 1})
    if dupes:
        raise QuantizeError(f"--candidate {dupes[0]} is given twice; name each candidate once")
    reports = []
    with tempfile.TemporaryDirectory(prefix="quantize-kld-") as tmp:
        kept = Path(tmp) / "baseline-fp32.safetensors" if baseline_logits is None and len(candidates) > 1 else None
        for n, cand in enumerate(candidates):
            first = n == 0
            # the baseline's tokenizer is checked against every candidate; its model runs only once
            reports.append(kld(baseline, cand, text=text, tokens=tokens, chunk=chunk,
                               save_baseline=save_baseline if first else None,
                               baseline_logits=baseline_logits if (first or kept is None) else kept,
                               dtype=dtype, device=device, emit=emit, keep_baseline=kept if first else None))
    table = KldTable(str(baseline or baseline_logits), reports)
    if out is not None:
        Path(out).write_text(json.dumps(table.to_dict() if len(reports) > 1 else reports[0].to_dict(), indent=1))
    return table


def _sha_ids(ids: torch.Tensor, chunk: int) -> str:
    import hashlib

    return hashlib.sha256(ids.numpy().tobytes() + str(chunk).encode()).hexdigest()[:32]


def _open_logits(path: Path) -> dict:
    from ..checkpoint.index import _refs_from_header, read_header

    if not path.exists():
        raise QuantizeError(f"--baseline-logits {path}: no such file")
    header, _ = read_header(path)
    meta = header.get("__metadata__") or {}
    if meta.get("format") != "quantize-kld":
        raise QuantizeError(f"{path}: not a baseline-logits file written by --save-baseline")
    return {"folder": path.parent, "refs": _refs_from_header(path.parent, path.name), "meta": meta}
