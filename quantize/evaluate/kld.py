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
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..checkpoint.index import read_tensor
from ..checkpoint.manifest import same_weights
from ..checkpoint.writer import Entry, StreamWriter
from ..errors import QuantizeError
from ..events import Emit, null_emit
from ..options import KLDOptions, takes
from .provenance import converted_from

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
    # "full vocabulary" (local models), or the served estimator ("top-20 lower bound": evaluate/served.py)
    estimator: str = "full vocabulary"
    top_k: int | None = None
    # local models: the served estimator (top_k) on the same log-probabilities, beside the full KL: its bias
    kld_topk_mean: float | None = None
    measured: dict = field(default_factory=dict)  # where each model ran (as EvalReport.measured)
    gate: dict | None = None  # --max-kld / --max-flip-rate: KlGate.judge's record (bounds, figures, verdict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, baseline: str, candidate: str, kl: torch.Tensor, agree: int, nll_b: float, nll_c: float, chunk: int,
           text: str, **extra) -> "KldReport":
        """The report of per-token KL values ``kl`` (float64), the same-top-1 count and both summed
        negative log-likelihoods, over ``kl.numel()`` tokens: what a local and a served run both give."""
        n = kl.numel()
        q = lambda p: float(torch.quantile(kl, p)) if n > 1 else float(kl[0])  # noqa: E731
        return cls(baseline, candidate, n, chunk, float(kl.mean()), q(0.5), q(0.99), q(0.999), float(kl.max()),
                   agree / n, _exp(nll_b / n), _exp(nll_c / n), _exp((nll_c - nll_b) / n), text, **extra)


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


def load_model(path: Path, dtype: torch.dtype, device: torch.device = torch.device("cpu")):
    """A model folder as transformers' class for it, in ``dtype`` on ``device``, in eval mode: the
    one loader of every local run (``eval``'s tasks, ``eval-kld``, the PD check). A compressed-tensors
    FP8 block checkpoint goes through a dequantized copy (transformers cannot decompress its fused
    experts); a folder transformers refuses is one line naming it."""
    import transformers

    cfg = _config(path)
    arch = (cfg.get("architectures") or [""])[0]
    arch = arch if isinstance(arch, str) else ""
    cls = getattr(transformers, {"KimiK25ForConditionalGeneration": "Kimi_K25ForConditionalGeneration"}.get(arch, arch),
                  None) \
        or transformers.AutoModelForCausalLM
    try:
        if _has_fp8_block(cfg) or _native_w4afp8(cfg):
            with tempfile.TemporaryDirectory(prefix="quantize-bf16-") as tmp:
                m = cls.from_pretrained(_dequantized_copy(path, cfg, Path(tmp)), dtype=dtype)
        else:
            m = cls.from_pretrained(str(path), dtype=dtype)
    except Exception as e:  # noqa: BLE001 - surface one line naming the model
        raise QuantizeError(f"{path}: transformers cannot load this model "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from e
    from . import w4a8

    w4a8.apply(m, cfg, path)  # a W4AFP8 candidate: its experts' activations through FP8, as the engines compute
    return m.to(device=device, dtype=dtype).eval()


def model_key(path: Path, dtype: torch.dtype, device: torch.device) -> tuple:
    """What a loaded model is kept under (``kld(loaded=...)``): its folder, dtype and device."""
    return str(Path(path).resolve()), dtype, str(device)


def _model_of(path: Path, dtype: torch.dtype, device: torch.device, loaded: dict | None):
    m = (loaded or {}).get(model_key(path, dtype, device))
    return m if m is not None else load_model(path, dtype, device)


def _vocab(model) -> int:
    """The vocabulary size of a loaded model (a multimodal one, Kimi K2.5/K2.6, keeps it in its text config)."""
    return int(model.config.get_text_config().vocab_size)


def _has_fp8_block(cfg: dict) -> bool:
    """An FP8 block (float-quantized, block strategy) checkpoint, e.g. ``convert --scheme fp8-block``:
    transformers 5.17 cannot decompress such fused MoE experts (its DecompressExperts fails)."""
    qc = cfg.get("quantization_config") or {}
    return any(((g or {}).get("weights") or {}).get("strategy") == "block"
               and ((g or {}).get("weights") or {}).get("type") == "float"
               for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict))


def _native_w4afp8(cfg: dict) -> bool:
    """SGLang's native w4afp8 (``convert --scheme w4afp8 --engine sglang``): transformers has no loader."""
    return ((cfg.get("quantization_config") or {}).get("quant_method")) == "w4afp8"


def _dequantized_copy(path: Path, cfg: dict, tmp: Path) -> str:
    """The checkpoint as BF16 in ``tmp`` (every FP8 / INT4 weight dequantized by the one reader,
    as compressed-tensors decompresses it: code x scale in the scale dtype, rounded to BF16; config
    without quantization_config, its generation_config.json) for transformers to load as a plain model."""
    from safetensors.torch import save_file

    from ..checkpoint.index import CheckpointIndex
    from ..checkpoint.reader import WeightReader

    r = WeightReader(CheckpointIndex.open(path))
    out: dict[str, torch.Tensor] = {}
    try:
        t = r.index.tensors
        for name in t:
            base, _, part = name.rpartition(".")
            if part in ("weight_scale", "weight_shape", "weight_scale_inv", "input_scale") and (
                    base + ".weight" in t or base + ".weight_packed" in t):
                continue
            if part == "weight_packed":
                out[base + ".weight"] = r.weight(base + ".weight", torch.bfloat16)
            elif part == "weight" and (t[name].dtype == "F8_E4M3" or r.native_int4(name)):
                out[name] = r.weight(name, torch.bfloat16)
            else:
                out[name] = r.raw(name).clone()
    finally:
        r.close()
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    (tmp / "config.json").write_text(json.dumps(plain))
    gen = path / "generation_config.json"  # its stop tokens and defaults: generate() reads them, not config.json's
    if gen.is_file():
        shutil.copyfile(gen, tmp / gen.name)
    return str(tmp)


def _tokenizer(path: Path):
    from ..calibrate.data import load_tokenizer

    return load_tokenizer(path)


# -- what the compared artifacts are ------------------------------------------------------------

MAX_TEXT_BYTES = 256 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json")


def _config(path: Path, what: str = "model") -> dict:
    from ..parse import load_json

    path = Path(path)
    if not (path / "config.json").is_file():
        raise QuantizeError(f"{path}: no config.json; pass the {what}'s folder")
    return load_json(path / "config.json", "config.json")


def read_text(path: str | os.PathLike | None, what: str = "--text") -> tuple[Path, str]:
    """(path, its text) of a plain UTF-8 text file (the shipped text when ``path`` is None); a
    folder, a binary file or a missing one is one line naming ``what``."""
    from ..parse import decode

    p = Path(path) if path else DEFAULT_TEXT
    if p.is_dir():
        raise QuantizeError(f"{what} {p}: is a folder; pass a plain UTF-8 text file")
    if p.exists() and not p.is_file():
        raise QuantizeError(f"{what} {p}: not a regular file; pass a plain UTF-8 text file")
    try:
        with open(p, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_TEXT_BYTES:
                raise QuantizeError(f"{what} {p}: more than {MAX_TEXT_BYTES >> 20} MiB; pass a shorter text "
                                    f"(only --tokens tokens of it are scored)")
            raw = f.read()
    except FileNotFoundError:
        raise QuantizeError(f"{what} {p}: no such file; pass an existing text file") from None
    except OSError as e:
        raise QuantizeError(f"{what} {p}: cannot read ({e.strerror})") from e
    if b"\x00" in raw:
        raise QuantizeError(f"{what} {p}: holds NUL bytes, a binary file; pass a plain UTF-8 text file")
    return p, decode(raw, f"{what} {p}", "plain UTF-8 text file")


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _file_sha(path: Path) -> str:
    from ..checkpoint.output import sha256_file

    try:
        return sha256_file(path)
    except OSError as e:
        raise QuantizeError(f"{path}: cannot read ({e.strerror})") from e


def tokenizer_files(path: Path) -> dict[str, str]:
    """name -> SHA-256 of each tokenizer file in the model folder ``path``."""
    names = [n for n in TOKENIZER_FILES if (path / n).is_file()] + sorted(p.name for p in path.glob("*.tiktoken"))
    return {n: _file_sha(path / n) for n in names}


def vocab_sha(tok) -> str:
    return _sha(json.dumps(sorted(tok.get_vocab().items())).encode())


def model_identity(path: Path) -> dict:
    """What a model folder is: config.json's model_type, architectures and vocab_size, the SHA-256
    of config.json and of its weights' safetensors headers (names, dtypes, shapes, offsets) and of
    the index, each tokenizer file's, and the weights themselves (``weights``: per file the SHA-256
    its records list, or of sampled bytes; ``provenance.converted_from`` compares a candidate's source)."""
    from ..checkpoint.index import MAX_HEADER
    from ..checkpoint.manifest import weights_identity

    path = Path(path)
    cfg = _config(path)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    h = []
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.safetensors.index.json")):
        try:
            with open(f, "rb") as fh:
                if f.suffix == ".json":
                    raw = fh.read(256 << 20)
                else:
                    head = fh.read(8)
                    n = int.from_bytes(head, "little") if len(head) == 8 else 0
                    raw = head + fh.read(min(n, MAX_HEADER))
        except OSError as e:
            raise QuantizeError(f"{f}: cannot read ({e.strerror})") from e
        h.append(f"{f.name}:{_sha(raw)}")
    return {"model_type": cfg.get("model_type"), "architectures": cfg.get("architectures"),
            "vocab_size": cfg.get("vocab_size") or text.get("vocab_size"),
            "config_sha256": _file_sha(path / "config.json"), "weights_sha256": _sha("\n".join(h).encode()),
            "tokenizer_files": tokenizer_files(path), "weights": weights_identity(path)}


def _kind(ident: dict) -> str:
    arch = ident.get("architectures")
    return f"{ident.get('model_type')} ({', '.join(map(str, arch)) if isinstance(arch, list) else arch})"


def same_model(pa: Path, pb: Path, what_a: str = "--baseline", what_b: str = "--candidate") -> None:
    """``pb`` must be a model of ``pa``'s kind (model_type and architectures): a quantization of it."""
    a, b = _config(pa), _config(pb)
    ka, kb = ({"model_type": c.get("model_type"), "architectures": c.get("architectures")} for c in (a, b))
    if ka != kb:
        raise QuantizeError(f"{what_b} {pb}: a {_kind(kb)} model, {what_a} {pa} a {_kind(ka)} one; "
                            f"compare a model with its own quantization")


def same_tokenizer(pa: Path, pb: Path, text: str = "", tok_a=None, tok_b=None, what_a: str = "--baseline",
                   what_b: str = "--candidate") -> None:
    """The same tokenizer in both folders: the same tokenizer files, or (when they differ in bytes)
    the same vocabulary and the same token ids for ``text``. One line before any model loads."""
    fa, fb = tokenizer_files(Path(pa)), tokenizer_files(Path(pb))
    if fa and fa == fb:
        return
    a = tok_a if tok_a is not None else _tokenizer(Path(pa))
    b = tok_b if tok_b is not None else _tokenizer(Path(pb))
    sample = text[:2000] or "The quick brown fox jumps over the lazy dog. 0123456789"
    if a.get_vocab() != b.get_vocab() or a(sample)["input_ids"] != b(sample)["input_ids"]:
        raise QuantizeError(f"{what_b} {pb}: its tokenizer differs from {what_a} {pa}'s; the comparison needs both "
                            f"models over the same token ids (compare a model with its own quantization)")


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] in fp32, on the model's device."""
    with torch.no_grad():
        out = model(input_ids=ids.unsqueeze(0).to(model.device))
    return torch.log_softmax(out.logits[0].float(), dim=-1)


BASELINE_KIND = "kld-baseline"  # the saved baseline's ``quantize_kind``
REPORT_KIND = "kld"


def _targets(baseline, candidates, text, save_baseline, baseline_logits, out) -> list:
    """Before anything is read or loaded: what is written may be written there (not a folder, a
    link, an input or a file this tool did not write), and the options name one baseline. -> the
    inputs (every folder and file read)."""
    from ..checkpoint.output import report_target

    inputs = [baseline, *candidates, text, baseline_logits]
    if save_baseline is not None:
        if baseline_logits is not None:
            raise QuantizeError("--save-baseline with --baseline-logits: the baseline is read, not run, so there is "
                                "nothing to save; drop one of them")
        if baseline is None:
            raise QuantizeError("--save-baseline needs --baseline (the model whose log-probabilities are saved)")
        report_target(save_baseline, BASELINE_KIND, inputs, "--save-baseline")
    if out is not None:
        report_target(out, REPORT_KIND, inputs, "--out")
        if save_baseline is not None and Path(out).resolve() == Path(save_baseline).resolve():
            raise QuantizeError(f"--out {out}: the same file as --save-baseline; name two files")
    return inputs


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
    top_k: int = 100,
    loaded: dict | None = None,
) -> KldReport:
    """``device``: where both models run (cpu, cuda, cuda:N); the statistics are the same.
    ``keep_baseline``: also write the baseline's log-probs there in fp32 (exact; ``kld_table``).
    ``loaded``: models already loaded by ``load_model`` (``eval --kld-out``: the ones its tasks ran
    on), by ``model_key``; one of the same dtype and device is used instead of loading it again."""
    from ..checkpoint.output import write_report
    from ..errors import CheckFailed

    dev = check_device(device)  # before anything is read or loaded
    if dtype not in DTYPES:
        raise QuantizeError(f"dtype {dtype}: use one of {', '.join(DTYPES)}")
    for name, v in (("--tokens", tokens), ("--chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise QuantizeError(f"{name} {v}: must be at least 2 tokens")
    if baseline is None and baseline_logits is None:
        raise QuantizeError("--baseline or --baseline-logits is required")
    cand_path = Path(candidate)
    inputs = _targets(baseline, [candidate], text, save_baseline, baseline_logits, out)
    text_path, chunks, run = _text_of(baseline, cand_path, text, tokens, chunk)
    if baseline is not None:
        converted_from(Path(baseline), cand_path)  # the candidate was made from it (a saved one: _same_run)
    tdtype = DTYPES[dtype]

    saved = None
    if baseline_logits is not None:
        saved = _open_logits(Path(baseline_logits), run, chunks, cand_path, Path(baseline) if baseline else None)
    base_model = _model_of(Path(baseline), tdtype, dev, loaded) if saved is None else None
    cand_model = _model_of(cand_path, tdtype, dev, loaded)
    if base_model is not None and _vocab(base_model) != _vocab(cand_model):
        raise QuantizeError(f"{cand_path}: vocabulary {_vocab(cand_model)} differs from the baseline's "
                            f"{_vocab(base_model)}")

    writers = (_writers(Path(baseline), run, chunks, _vocab(base_model), save_baseline, keep_baseline)
               if base_model is not None else [])
    from .served import topk_kl

    kl_all, agree, nll_b, nll_c, topk_sum = [], 0, 0.0, 0.0, 0.0
    n = 0
    emit({"event": "start", "stage": "kld", "total_bytes": len(chunks), "done_bytes": 0, "unit": "chunks"})
    try:
        for i, c in enumerate(chunks):
            target = c[1:].to(dev)
            if saved is not None:
                lb = read_tensor(saved["folder"], saved["refs"][f"chunk.{i}"]).float().to(dev)
                if not torch.isfinite(lb).all():
                    raise QuantizeError(f"--baseline-logits {baseline_logits}: chunk {i} holds NaN or inf; the file "
                                        f"is corrupt, recompute it with --save-baseline")
            else:
                lb = _baseline_chunk(base_model, baseline, i, c, writers)
            lc = _logprobs(cand_model, c[:-1])
            if lb.shape != lc.shape:
                raise QuantizeError(f"{cand_path}: logits shape {tuple(lc.shape)} differs from the baseline's "
                                    f"{tuple(lb.shape)}")
            if not torch.isfinite(lc).all():
                raise CheckFailed(f"--candidate {cand_path}: its log-probabilities hold NaN or inf (chunk {i}); "
                                  f"the KL divergence is not finite: the candidate fails")
            pb = lb.exp()
            kl = (pb * (lb - lc)).sum(-1).clamp_min(0)
            kl_all.append(kl.cpu())
            for r in range(0, target.numel(), 128):  # in row blocks: a few [rows, vocab] temporaries at a time
                topk_sum += float(topk_kl(lb[r:r + 128], lc[r:r + 128], target[r:r + 128], top_k).double().sum())
            agree += int((lb.argmax(-1) == lc.argmax(-1)).sum())
            nll_b -= float(lb.gather(-1, target.unsqueeze(-1)).sum())
            nll_c -= float(lc.gather(-1, target.unsqueeze(-1)).sum())
            n += target.numel()
            emit({"event": "tensor", "name": f"chunk {i}", "done_bytes": i + 1})
        k = torch.cat(kl_all).double()
        rep = KldReport.of(str(baseline or baseline_logits), str(candidate), k, agree, nll_b, nll_c, chunk,
                           str(text_path), top_k=top_k, kld_topk_mean=topk_sum / n)
        bad = [f for f, v in rep.to_dict().items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise CheckFailed(f"--candidate {cand_path}: {', '.join(bad)} not finite; the candidate fails")
        for writer, _ in writers:
            writer.finish()
    except BaseException:
        for writer, _ in writers:
            writer.abort()
        raise
    if out is not None:
        write_report(out, rep.to_dict(), REPORT_KIND, inputs)
    emit({"event": "done"})
    return rep


def _text_of(baseline, cand_path: Path, text, tokens: int, chunk: int) -> tuple[Path, list, dict]:
    """What ``kld`` scores, checked before any model loads: the text, tokenized by the candidate's
    tokenizer (the baseline's must be the same), its chunks and the run's identity."""
    mpe = _config(cand_path, "candidate model").get("max_position_embeddings")
    if type(mpe) is int and mpe > 0 and chunk > mpe:
        raise QuantizeError(f"--chunk {chunk}: longer than the candidate's max_position_embeddings {mpe} "
                            f"({cand_path / 'config.json'}); use --chunk {mpe} or less")
    if baseline is not None:
        _config(Path(baseline), "baseline model")
        same_model(Path(baseline), cand_path)
    text_path, raw = read_text(text)
    tok_c = _tokenizer(cand_path)
    if baseline is not None:
        same_tokenizer(Path(baseline), cand_path, raw, tok_b=tok_c)
    ids = torch.tensor(tok_c(raw)["input_ids"][: tokens + 1])
    if ids.numel() < 2:
        raise QuantizeError(f"--text {text_path}: fewer than 2 tokens; pass a longer text")
    chunks = _chunks(ids, chunk)
    return text_path, chunks, {**_run_identity(raw, tokens, chunk, ids, tok_c), "chunks": len(chunks)}


def _writers(baseline: Path, run: dict, chunks: list, vocab: int, save_baseline, keep_baseline) -> list:
    """The files the baseline's log-probs go to as they are computed: ``save_baseline`` in fp16,
    ``keep_baseline`` in fp32 (exact), each as ``_open_logits`` reads it. -> [(writer, dtype)]."""
    writers: list[tuple[StreamWriter, torch.dtype]] = []
    ident = {**run, "model": model_identity(baseline), "vocab": vocab}
    meta = {"format": "quantize-kld", "quantize_kind": BASELINE_KIND, "identity": json.dumps(ident),
            "baseline": str(baseline)}
    for path, st, tdt in ((save_baseline, "F16", torch.float16), (keep_baseline, "F32", torch.float32)):
        if path is not None:
            entries = [Entry(f"chunk.{i}", st, (c.numel() - 1, vocab)) for i, c in enumerate(chunks)]
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                writers.append((StreamWriter(Path(path), entries, meta), tdt))
            except OSError as e:
                for w, _ in writers:
                    w.abort()
                raise QuantizeError(f"--save-baseline {path}: cannot write ({e.strerror}); choose a path you "
                                    f"can write") from e
    return writers


def _baseline_chunk(model, baseline, i: int, c: torch.Tensor, writers: list) -> torch.Tensor:
    """The baseline's log-probs of chunk ``i`` (``c``), checked finite and written to ``writers``."""
    lb = _logprobs(model, c[:-1])
    if not torch.isfinite(lb).all():
        raise QuantizeError(f"--baseline {baseline}: its log-probabilities hold NaN or inf (chunk {i}); "
                            f"the baseline model is broken, nothing was saved")
    for writer, tdt in writers:
        writer.write_tensor(f"chunk.{i}", lb.clamp_min(torch.finfo(tdt).min).to(tdt).cpu())
    return lb


def baseline_pass(baseline, text_of: tuple, keep_baseline, save_baseline=None, dtype: str = "float32",
                  device: str = "cpu", loaded: dict | None = None) -> None:
    """The baseline's half of ``kld`` alone: its log-probs of the text ``kld`` would score
    (``text_of``: ``_text_of``'s answer for the candidate), written to ``keep_baseline`` (fp32,
    exact) and ``save_baseline`` (fp16), the files ``kld(baseline_logits=...)`` reads. ``eval
    --kld-out`` runs it locally after the baseline's tasks, so the baseline is freed before the
    candidate loads: one model in memory at a time, the same report as ``kld`` on both
    (``tests/test_eval.py``)."""
    _, chunks, run = text_of
    model = _model_of(Path(baseline), DTYPES[dtype], check_device(device), loaded)
    writers = _writers(Path(baseline), run, chunks, _vocab(model), save_baseline, keep_baseline)
    try:
        for i, c in enumerate(chunks):
            _baseline_chunk(model, baseline, i, c, writers)
        for writer, _ in writers:
            writer.finish()
    except BaseException:
        for writer, _ in writers:
            writer.abort()
        raise


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else math.inf


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class KlGate:
    """The KL / flip gate (``--max-kld``, ``--max-flip-rate``): the mean next-token KL(baseline ||
    candidate) and the flip rate (the share of scored positions whose top-1 token differs from the
    baseline's, 1 - same top-1) each at most its bound; a bound not given is not checked."""

    max_kld: float | None = None
    max_flip_rate: float | None = None

    @property
    def active(self) -> bool:
        return self.max_kld is not None or self.max_flip_rate is not None

    def judge(self, rep: "KldReport") -> dict:
        flip = 1.0 - rep.top1_agreement
        over = []
        if self.max_kld is not None and not rep.kld_mean <= self.max_kld:
            over.append(f"KLD mean {rep.kld_mean:.6g} > --max-kld {self.max_kld:g}")
        if self.max_flip_rate is not None and not flip <= self.max_flip_rate:
            over.append(f"flip rate {flip:.6g} > --max-flip-rate {self.max_flip_rate:g}")
        within = ([f"KLD mean {rep.kld_mean:.6g} <= {self.max_kld:g}"] if self.max_kld is not None else []) + (
            [f"flip rate {flip:.6g} <= {self.max_flip_rate:g}"] if self.max_flip_rate is not None else [])
        lower = "" if rep.estimator == "full vocabulary" else f" ({rep.estimator}: the KL is a lower bound)"
        return {"max_kld": self.max_kld, "max_flip_rate": self.max_flip_rate, "kld_mean": rep.kld_mean,
                "flip_rate": flip, "passed": not over,
                "verdict": (f"FAIL: {'; '.join(over)}" if over else f"pass: {'; '.join(within)}") + lower}

    def apply(self, reports: list["KldReport"]) -> None:
        for r in reports:
            r.gate = self.judge(r) if self.active else None


def gate_failures(reports: list["KldReport"]) -> list[str]:
    """One line per candidate whose KL / flip gate failed."""
    return [f"{r.candidate}: {r.gate['verdict'].removeprefix('FAIL: ')}" for r in reports
            if r.gate and not r.gate["passed"]]


@dataclass
class KldTable:
    baseline: str
    reports: list[KldReport]
    log: str | None = None  # where transformers' and the engines' own output went (not in the report)

    def to_dict(self) -> dict:
        return {"kind": "kld-table", "baseline": self.baseline, "candidates": [r.to_dict() for r in self.reports]}


@takes(KLDOptions)
def kld_table(baseline, candidates, text, tokens, chunk, save_baseline, baseline_logits, dtype, out, device, serve,
              engine_python, tp, kv_cache_dtype, baseline_kv_cache_dtype, serve_args, serve_port, serve_timeout_s,
              serve_log, verbose, top_k, max_kld, max_flip_rate, emit: Emit = null_emit) -> KldTable:
    """The table of ``_table`` (below), with transformers' own output in a log file unless
    ``verbose`` (``quantize.quiet``)."""
    from ..quiet import captured, kept, new_log

    log = None if verbose else new_log("eval-kld")
    try:
        with captured(log):
            table = _table(baseline, candidates, text, tokens, chunk, save_baseline, baseline_logits, dtype, out,
                           device, serve, engine_python, tp, kv_cache_dtype, baseline_kv_cache_dtype, serve_args,
                           serve_port, serve_timeout_s, serve_log, top_k, emit, KlGate(max_kld, max_flip_rate))
    except QuantizeError as e:
        log = kept(log)
        raise type(e)(f"{e} (transformers' output: {log})" if log else str(e)) from e.__cause__
    log = kept(log)
    table.log = str(log) if log else None
    return table


def _table(baseline, candidates, text, tokens, chunk, save_baseline, baseline_logits, dtype, out, device, serve,
           engine_python, tp, kv_cache_dtype, baseline_kv_cache_dtype, serve_args, serve_port, serve_timeout_s,
           serve_log, top_k, emit: Emit = null_emit, gate: KlGate = KlGate()) -> KldTable:
    """Several candidates of one source, one table: the same text and chunks for all, the baseline
    computed once (kept exactly, fp32, for the others) or read from ``baseline_logits``. One
    candidate gives the same report as ``kld``. ``out``: {"kind": "kld-table", "baseline",
    "candidates": [report, ...]}. ``serve``: every model served by that engine in turn (the
    baseline once), the top-``top_k`` estimator of ``evaluate/served.py``; ``baseline_kv_cache_dtype``:
    the baseline's own cache (a saved one must have been served with it)."""
    import tempfile

    from ..checkpoint.output import write_report

    if not candidates:
        raise QuantizeError("--candidate is required (repeat it to compare several candidates of one baseline)")
    dupes = sorted({str(c) for c in candidates if [str(x) for x in candidates].count(str(c)) > 1})
    if dupes:
        raise QuantizeError(f"--candidate {dupes[0]} is given twice; name each candidate once")
    if baseline is None and baseline_logits is None:
        raise QuantizeError("--baseline or --baseline-logits is required")
    inputs = _targets(baseline, candidates, text, save_baseline, baseline_logits, out)  # before any work
    from ..engines.serve import check_baseline_kv, log_folder

    log_folder(serve_log, inputs)  # the engines' logs: an output like the others

    check_baseline_kv(baseline_kv_cache_dtype, serve)
    if serve is not None:
        srv = dict(serve=serve, python=engine_python, tp=tp, kv_cache_dtype=kv_cache_dtype, extra_args=serve_args,
                   port=serve_port, timeout_s=serve_timeout_s, log_dir=serve_log)
        table = _served_table(Path(baseline) if baseline is not None else None, [Path(c) for c in candidates], text,
                              tokens, chunk, top_k, srv, emit, save_baseline=save_baseline,
                              baseline_logits=baseline_logits, baseline_kv=baseline_kv_cache_dtype)
        gate.apply(table.reports)
        if out is not None:
            write_report(out, table.to_dict() if len(table.reports) > 1 else table.reports[0].to_dict(), REPORT_KIND,
                         inputs)
        return table
    check_device(device)
    for c in candidates:  # every candidate proven to belong before the first model loads
        _config(Path(c), "candidate model")
        if baseline is not None:
            same_model(Path(baseline), Path(c))
            same_tokenizer(Path(baseline), Path(c))
            converted_from(Path(baseline), Path(c))
    _saved_provenance(baseline_logits, candidates[1:])  # the first: kld's own check of the file, in full
    reports = []
    with tempfile.TemporaryDirectory(prefix="quantize-kld-") as tmp:
        kept = Path(tmp) / "baseline-fp32.safetensors" if baseline_logits is None and len(candidates) > 1 else None
        for n, cand in enumerate(candidates):
            first = n == 0
            # the baseline's tokenizer is checked against every candidate; its model runs only once
            reports.append(kld(baseline, cand, text=text, tokens=tokens, chunk=chunk,
                               save_baseline=save_baseline if first else None,
                               baseline_logits=baseline_logits if (first or kept is None) else kept,
                               dtype=dtype, device=device, emit=emit, keep_baseline=kept if first else None,
                               top_k=top_k))
    table = KldTable(str(baseline or baseline_logits), reports)
    gate.apply(reports)
    if out is not None:
        write_report(out, table.to_dict() if len(reports) > 1 else reports[0].to_dict(), REPORT_KIND, inputs)
    return table


def _saved_provenance(baseline_logits, candidates: list) -> None:
    """Each of ``candidates`` made from the model ``baseline_logits`` was saved from (the file's
    recorded weights; a file that does not record them is refused by ``_same_run``, for the first)."""
    from ..checkpoint.index import read_header
    from ..parse import json_text

    if baseline_logits is None or not candidates:
        return
    try:
        header, _ = read_header(Path(baseline_logits))
        ident = json_text((header.get("__metadata__") or {}).get("identity", "{}"), baseline_logits, "identity")
    except (QuantizeError, OSError):
        return
    model = ident.get("model") if isinstance(ident, dict) else None
    weights = model.get("weights") if isinstance(model, dict) else None
    if isinstance(weights, dict):
        for c in candidates:
            converted_from(None, Path(c), f"the model --baseline-logits {baseline_logits} was saved from",
                           saved=weights)


def _sha_ids(ids: torch.Tensor, chunk: int) -> str:
    import hashlib

    return hashlib.sha256(ids.numpy().tobytes() + str(chunk).encode()).hexdigest()[:32]


def _run_identity(raw: str, tokens: int, chunk: int, ids: torch.Tensor, tok) -> dict:
    """What a saved baseline must have been computed on to serve this run: the text, --tokens,
    --chunk, the token ids in their chunks and the tokenizer's vocabulary."""
    return {"text_sha256": _sha(raw.encode()), "tokens": tokens, "chunk": chunk,
            "token_ids_sha": _sha_ids(ids, chunk), "vocab_sha256": vocab_sha(tok)}


# the identity keys a saved baseline is checked on, in order (top_k: a served one's)
RUN_KEYS = ("text_sha256", "tokens", "chunk", "top_k", "vocab_sha256", "token_ids_sha")
SHOWN_KEYS = ("tokens", "chunk", "top_k")  # shown with their value when they differ


def _same_run(what: str, saved: dict, run: dict, candidate: Path, baseline: Path | None, fix: str) -> None:
    """A saved baseline's recorded identity against this run (``run``'s keys of ``RUN_KEYS``), the
    candidate's kind of model and the --baseline given (if any); one line naming what differs."""
    names = {"text_sha256": "another --text", "tokens": f"--tokens {saved.get('tokens')}",
             "chunk": f"--chunk {saved.get('chunk')}", "top_k": f"--top-k {saved.get('top_k')}",
             "vocab_sha256": "another tokenizer", "token_ids_sha": "another text, token count or chunk size"}
    for key in (k for k in RUN_KEYS if k in run):
        if saved.get(key) != run[key]:
            raise QuantizeError(f"{what}: saved for {names[key]} (this run: "
                                f"{run[key] if key in SHOWN_KEYS else 'differs'}); {fix}")
    model = saved["model"]
    cand = _config(candidate, "candidate model")
    if (model.get("model_type"), model.get("architectures")) != (cand.get("model_type"), cand.get("architectures")):
        raise QuantizeError(f"{what}: saved from a {_kind(model)} model; --candidate {candidate} is a "
                            f"{_kind(cand)} one; compare a model with its own quantization")
    if not isinstance(model.get("weights"), dict):
        raise QuantizeError(f"{what}: saved by an older quantize, without the baseline's weights' identity, which "
                            f"proves the candidate was made from it; {fix}")
    if baseline is not None:
        now = model_identity(baseline)
        diff = [k for k in ("model_type", "architectures", "vocab_size", "config_sha256", "weights_sha256",
                            "tokenizer_files") if model.get(k) != now[k]]
        if set(model["weights"]) != set(now["weights"]) or same_weights(model["weights"], now["weights"]):
            diff.append("weights")
        if diff:
            raise QuantizeError(f"{what}: saved from another model than --baseline {baseline} ({diff[0]} differs); "
                                f"{fix}, or drop --baseline")
    else:
        converted_from(None, candidate, f"the model {what} was saved from", saved=model["weights"])


def _open_logits(path: Path, run: dict, chunks: list, candidate: Path, baseline: Path | None) -> dict:
    """The saved baseline at ``path``, proven to be this run's: the same text, --tokens, --chunk
    and token ids, the candidate's tokenizer and kind of model, the --baseline given (if any), and
    every chunk this run needs, of the right shape."""
    from ..checkpoint.index import _refs_from_header, read_header
    from ..parse import json_text

    what = f"--baseline-logits {path}"
    if path.is_dir():
        raise QuantizeError(f"{what}: is a folder; pass the file --save-baseline wrote")
    if not path.exists():
        raise QuantizeError(f"{what}: no such file")
    if not path.is_file():
        raise QuantizeError(f"{what}: not a regular file; pass the file --save-baseline wrote")
    header, _ = read_header(path)
    meta = header.get("__metadata__") or {}
    if meta.get("format") == SERVED_FORMAT:
        raise QuantizeError(f"{what}: saved by a served run (the baseline's top-k only); reuse it with the same "
                            "--serve, or save a local baseline with --save-baseline and no --serve")
    if meta.get("format") != "quantize-kld":
        raise QuantizeError(f"{path}: not a baseline-logits file written by --save-baseline")
    if "identity" not in meta:
        raise QuantizeError(f"{what}: saved by an older quantize, without the baseline's identity; recompute it "
                            f"with --save-baseline")
    saved = json_text(meta["identity"], path, "baseline-logits identity")
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise QuantizeError(f"{what}: its recorded identity is malformed; recompute it with --save-baseline")
    fix = "recompute it with --save-baseline for this run"
    _same_run(what, saved, run, candidate, baseline, fix)
    refs = _refs_from_header(path.parent, path.name)
    vocab = saved.get("vocab")
    for i, c in enumerate(chunks):
        ref = refs.get(f"chunk.{i}")
        if ref is None:
            have = sum(1 for k in refs if k.startswith("chunk."))
            raise QuantizeError(f"{what}: holds {have} chunks, this run needs {len(chunks)}; {fix}")
        if ref.dtype not in ("F16", "F32") or tuple(ref.shape) != (c.numel() - 1, vocab):
            raise QuantizeError(f"{what}: chunk.{i} is {ref.dtype}{list(ref.shape)}, this run needs "
                                f"[{c.numel() - 1}, {vocab}]; {fix}")
    return {"folder": path.parent, "refs": refs, "meta": meta}


def _chunks(ids: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """``ids`` in chunks of ``chunk`` predicted tokens (each chunk one token longer: its last
    token is predicted, not fed), the last one shorter; none under 2 tokens."""
    n_chunks = max(1, math.ceil((ids.numel() - 1) / chunk))
    chunks = [ids[i * chunk: min((i + 1) * chunk + 1, ids.numel())] for i in range(n_chunks)]
    return [c for c in chunks if c.numel() >= 2]


SERVED_FORMAT = "quantize-kld-served"  # a served baseline's top-k log-probs (``save_baseline`` with ``serve``)


def served_baseline_file(path: Path, rows: list, chunks: list, ident: dict, where: dict) -> None:
    """The served baseline's rows (per position every token the engine named: its top-k and the
    next token), as safetensors: per chunk ``ids.i`` (int32, -1 where a row has fewer entries) and
    ``lp.i`` (the engine's log-probs, as float64 so a reused row is the served one exactly),
    [positions, the longest row], with the run's identity in the metadata; written through the same
    guards as every report (``report_target`` was checked before anything ran)."""
    width = max(len(r) for rs in rows for r in rs)
    entries, tensors = [], []
    for i, (c, rs) in enumerate(zip(chunks, rows)):
        n = c.numel() - 1
        ids = torch.full((n, width), -1, dtype=torch.int32)
        lps = torch.full((n, width), float("-inf"), dtype=torch.float64)
        for j, row in enumerate(rs):
            ids[j, : len(row)] = torch.tensor(list(row.keys()), dtype=torch.int32)
            lps[j, : len(row)] = torch.tensor(list(row.values()), dtype=torch.float64)
        entries += [Entry(f"ids.{i}", "I32", (n, width)), Entry(f"lp.{i}", "F64", (n, width))]
        tensors += [ids, lps]
    meta = {"format": SERVED_FORMAT, "quantize_kind": BASELINE_KIND, "identity": json.dumps(ident),
            "measured": json.dumps(where)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        w = StreamWriter(path, entries, meta)
    except OSError as e:
        raise QuantizeError(f"--save-baseline {path}: cannot write ({e.strerror}); choose a path you can write") from e
    try:
        for e, t in zip(entries, tensors):
            w.write_tensor(e.name, t)
        w.finish()
    except BaseException:
        w.abort()
        raise


def _open_served(path: Path, run: dict, top_k: int, chunks: list, candidate: Path, baseline: Path | None):
    """A served baseline saved by ``--serve ... --save-baseline``, proven to be this run's (the same
    text, tokens, chunk, token ids, tokenizer and --top-k, a model of the candidate's kind, the
    --baseline given if any) -> (rows, where it was measured)."""
    from ..checkpoint.index import _refs_from_header, read_header
    from ..parse import json_text

    what = f"--baseline-logits {path}"
    if not path.is_file():
        raise QuantizeError(f"{what}: {'no such file' if not path.exists() else 'not a regular file'}; pass the file "
                            "`eval-kld --serve ... --save-baseline` wrote")
    header, _ = read_header(path)
    meta = header.get("__metadata__") or {}
    if meta.get("format") == "quantize-kld":
        raise QuantizeError(f"{what}: saved by a local run (full log-probabilities); a served run needs the served "
                            "baseline's top-k: save it with --serve ... --save-baseline, or drop --serve")
    if meta.get("format") != SERVED_FORMAT or "identity" not in meta:
        raise QuantizeError(f"{path}: not a served baseline written by `eval-kld --serve ... --save-baseline`")
    saved = json_text(meta["identity"], path, "served baseline identity")
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise QuantizeError(f"{what}: its recorded identity is malformed; save it again with --save-baseline")
    fix = "save the served baseline again with --save-baseline for this run"
    _same_run(what, saved, {**run, "top_k": top_k}, candidate, baseline, fix)
    refs = _refs_from_header(path.parent, path.name)
    rows = []
    for i, c in enumerate(chunks):
        ri, rl = refs.get(f"ids.{i}"), refs.get(f"lp.{i}")
        shape = (c.numel() - 1, tuple(ri.shape)[1] if ri is not None and len(ri.shape) == 2 else 0)
        if ri is None or rl is None or not shape[1] or (ri.dtype, tuple(ri.shape), rl.dtype, tuple(rl.shape)) != (
                "I32", shape, "F64", shape):
            raise QuantizeError(f"{what}: chunk {i} is missing or not [{shape[0]}, width] int32/float64; {fix}")
        ids, lps = read_tensor(path.parent, ri), read_tensor(path.parent, rl)
        chunk_rows = []
        for j in range(shape[0]):
            keep = ids[j] >= 0
            row = dict(zip(ids[j][keep].tolist(), lps[j][keep].tolist()))
            if int(c[j + 1]) not in row or not all(math.isfinite(v) and v <= 1e-6 for v in row.values()):
                raise QuantizeError(f"{what}: chunk {i} position {j} lacks the next token or holds a log-probability "
                                    f"that is not one; the file is corrupt, {fix}")
            chunk_rows.append(row)
        rows.append(chunk_rows)
    where = json_text(meta.get("measured", "{}"), path, "served baseline record")
    return rows, {**(where if isinstance(where, dict) else {}), "reused": str(path)}


def served_text(candidate: Path, text, tokens: int, chunk: int, served: bool = True) -> tuple[Path, list, dict]:
    """What a served KL run scores, before any engine starts: (the text's path, its chunks of token
    ids by ``candidate``'s tokenizer, the run's identity); a chunk longer than the model's context is
    refused here (served, the whole chunk is the prompt; local, its last token is predicted, not fed)."""
    mpe = _config(candidate, "candidate model").get("max_position_embeddings")
    if type(mpe) is int and mpe > 0 and chunk + served > mpe:
        raise QuantizeError(f"--chunk {chunk}: longer than the candidate's max_position_embeddings {mpe} "
                            f"({candidate / 'config.json'}); use --chunk {mpe - served} or less")
    text_path, raw = read_text(text)
    tok = _tokenizer(candidate)
    ids = torch.tensor(tok(raw)["input_ids"][: tokens + 1])
    if ids.numel() < 2:
        raise QuantizeError(f"--text {text_path}: fewer than 2 tokens; pass a longer text")
    chunks = _chunks(ids, chunk)
    return text_path, chunks, _run_identity(raw, tokens, chunk, ids, tok)


def served_rows(s, chunks: list, top_k: int, role: str, emit: Emit = null_emit) -> list:
    """Per chunk, per predicted position, the top-``top_k`` (and next-token) log-probs the server
    ``s`` (a started ``Served``) returns."""
    from . import served as sv

    out = []
    emit({"event": "start", "stage": f"kld {role} (served)", "total_bytes": len(chunks), "done_bytes": 0,
          "unit": "chunks"})
    for i, c in enumerate(chunks):
        out.append(sv.prompt_logprobs(s, c.tolist(), top_k))
        emit({"event": "tensor", "name": f"chunk {i}", "done_bytes": i + 1})
    emit({"event": "done"})
    return out


def served_report(baseline: str, cand: Path, chunks: list, base_rows: list, cand_rows: list, chunk: int,
                  text_path: Path, top_k: int, measured: dict) -> KldReport:
    """The report of two models' served log-probs over the same chunks (the estimator of
    ``evaluate/served.py``: a lower bound of the full KL)."""
    from . import served as sv

    kl, agree, nll_b, nll_c = [], 0, 0.0, 0.0
    for c, rb, rc in zip(chunks, base_rows, cand_rows):
        for j, (b, q) in enumerate(zip(rb, rc)):
            t = int(c[j + 1])
            kl.append(sv.position_kl(b, q))
            agree += sv.top1(b) == sv.top1(q)
            nll_b -= b[t]
            nll_c -= q[t]
    k = torch.tensor(kl, dtype=torch.float64)
    return KldReport.of(baseline, str(cand), k, agree, nll_b, nll_c, chunk, str(text_path),
                        estimator=f"top-{top_k} lower bound (served)", top_k=top_k, measured=measured)


def _served_table(baseline: Path | None, candidates: list[Path], text, tokens: int, chunk: int, top_k: int,
                  srv: dict, emit: Emit, save_baseline=None, baseline_logits=None,
                  baseline_kv: str | None = None) -> KldTable:
    """``kld_table`` through a launched engine: the baseline served once (or its top-k read from
    ``baseline_logits``, saved by an earlier served run with ``save_baseline``), then each
    candidate; per position the estimator of ``evaluate/served.py`` (a lower bound of the full KL)."""
    from ..engines.serve import Served, check_extra, engine_of, python_of, run_served, same_cache

    python_of(engine_of(srv["serve"]), srv["python"])  # the interpreter, before anything is read
    check_extra(srv["serve"], srv["extra_args"])
    for c in candidates:
        _config(c, "candidate model")
        if baseline is not None:
            same_model(baseline, c)
            same_tokenizer(baseline, c)
            converted_from(baseline, c)
    text_path, chunks, run = served_text(candidates[0], text, tokens, chunk)
    if baseline_logits is not None:  # before any engine starts
        base_rows, base_where = _open_served(Path(baseline_logits), run, top_k, chunks, candidates[0], baseline)
        same_cache(baseline_logits, base_where, baseline_kv or srv["kv_cache_dtype"], baseline_kv is not None,
                   "--baseline-logits")
        _saved_provenance(baseline_logits, candidates[1:])

    def rows_of(path: Path, role: str):
        kw = {k: v for k, v in srv.items() if k != "serve"}
        if baseline_kv is not None and role == "baseline":
            kw["kv_cache_dtype"] = baseline_kv
        with Served(srv["serve"], path, role=role, logprobs=top_k, **kw) as s:
            return run_served(s, lambda s: served_rows(s, chunks, top_k, role, emit)), s.record()

    if baseline_logits is None:
        base_rows, base_where = rows_of(baseline, "baseline")
        if save_baseline is not None:
            ident = {**run, "top_k": top_k, "model": model_identity(baseline)}
            served_baseline_file(Path(save_baseline), base_rows, chunks, ident, base_where)
    reports = []
    for cand in candidates:
        cand_rows, where = rows_of(cand, "candidate")
        reports.append(served_report(str(baseline or baseline_logits), cand, chunks, base_rows, cand_rows, chunk,
                                     text_path, top_k, {"baseline": base_where, "candidate": where}))
    return KldTable(str(baseline or baseline_logits), reports)
