"""Calibration text: jsonl / txt / parquet files or folders, a Hugging Face dataset (``hf:NAME``)
when reachable or cached, or the small corpus shipped with the package; tokenized with the
model's own tokenizer (chat template optional); samples shorter than 2 tokens dropped and counted."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import QuantizeError
from ..parse import json_text

DEFAULT_CORPUS = Path(__file__).with_name("default_corpus.txt")
TEXT_FIELDS = ("text", "content", "question", "query", "prompt")


@dataclass
class Samples:
    ids: list[torch.Tensor]
    texts_read: int
    dropped_short: int
    source: str


def validate_sample_options(samples: int, seq_len: int) -> None:
    """``--samples`` / ``--seq-len``, checked before the model or the data is touched."""
    if samples < 1:
        raise QuantizeError(f"--samples {samples}: must be at least 1 (e.g. 512)")
    if seq_len < 2:  # a sample needs a token and the next one; shorter samples are dropped
        raise QuantizeError(f"--seq-len {seq_len}: must be at least 2 tokens (e.g. 2048)")


def _read_text(path: Path) -> str:
    """A calibration file's text: UTF-8 (a BOM is dropped); binary or other encodings named in one line."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise QuantizeError(f"{path}: cannot read ({e.strerror}); pass another --data") from e
    nul = raw.find(b"\0")
    if nul >= 0:
        raise QuantizeError(
            f"{path}: binary data (NUL byte at offset {nul}), not text; pass UTF-8 .jsonl/.txt or a "
            ".parquet file as --data"
        )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise QuantizeError(
            f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); re-encode it as "
            "UTF-8 or pass another --data"
        ) from e


def _texts_from_jsonl(path: Path) -> list[str]:
    out = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        rec = json_text(line, f"{path}:{n}", "calibration record (one JSON object or string per line)")
        if isinstance(rec, str):
            out.append(rec)
            continue
        if not isinstance(rec, dict):
            raise QuantizeError(
                f"{path}:{n}: a JSON {type(rec).__name__}, not an object or a string; fix the line or pass "
                "another --data"
            )
        if "question" in rec and "answer" in rec:  # GSM8K-style
            out.append(f"{rec['question']}\n{rec['answer']}")
            continue
        field = next((f for f in TEXT_FIELDS if isinstance(rec.get(f), str)), None)
        field = field or next((k for k, v in rec.items() if isinstance(v, str)), None)
        if field is not None:
            out.append(rec[field])
    return out


def _texts_from_parquet(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise QuantizeError(
            f"{path}: not a readable Parquet file ({str(e).splitlines()[0][:120]}); pass another --data"
        ) from e
    cols = [c for c in TEXT_FIELDS if c in table.column_names] or [
        f.name for f in table.schema if str(f.type) in ("string", "large_string")
    ]
    if not cols:
        raise QuantizeError(f"{path}: no text column (looked for {', '.join(TEXT_FIELDS)} or any string column)")
    return [str(x) for x in table.column(cols[0]).to_pylist() if x]


def _texts_from_txt(path: Path) -> list[str]:
    return [p.strip() for p in _read_text(path).split("\n\n") if p.strip()]


READERS = {
    ".jsonl": _texts_from_jsonl,
    ".json": _texts_from_jsonl,
    ".txt": _texts_from_txt,
    ".parquet": _texts_from_parquet,
}


def load_texts(data: str | None) -> tuple[list[str], str]:
    if data is None:
        return _texts_from_txt(DEFAULT_CORPUS), "default corpus"
    if data.startswith("hf:"):
        name = data[3:]
        try:
            import datasets

            ds = datasets.load_dataset(name, split="train")
        except Exception as e:  # noqa: BLE001 - any failure to reach or find it is the same to the user
            raise QuantizeError(
                f"--data {data}: dataset {name} is neither reachable nor cached ({type(e).__name__}); "
                "pass local files instead"
            ) from e
        col = next((c for c in TEXT_FIELDS if c in ds.column_names), None)
        if col is None:
            raise QuantizeError(f"--data {data}: no text column among {ds.column_names}")
        return [t for t in ds[col] if isinstance(t, str)], data
    path = Path(data)
    files = sorted(p for p in path.rglob("*") if p.suffix in READERS) if path.is_dir() else [path]
    if not path.exists():
        raise QuantizeError(f"--data {data}: no such file or folder")
    if not files:
        raise QuantizeError(f"--data {data}: no .jsonl, .txt or .parquet files in it")
    texts: list[str] = []
    for f in files:
        reader = READERS.get(f.suffix)
        if reader is None:
            raise QuantizeError(f"{f}: unsupported calibration file type {f.suffix!r}; use .jsonl, .txt or .parquet")
        texts += reader(f)
    return texts, str(path)


def load_tokenizer(model: Path):
    from transformers import AutoTokenizer

    if not any((model / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise QuantizeError(
            f"{model}: no tokenizer files (tokenizer.json / tokenizer_config.json); copy the model's tokenizer into it"
        )
    try:
        return AutoTokenizer.from_pretrained(str(model))
    except Exception as e:  # noqa: BLE001
        raise QuantizeError(
            f"{model}: the tokenizer does not load ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        ) from e


def _encode(tok, text: str) -> list[int]:
    """A whole text's token ids. ``verbose=False``: the tokenizer's warning that a text is longer than
    its ``model_max_length`` ("will result in indexing errors") does not hold here, where every sample
    is cut to ``--seq-len`` before the model sees it; in a log it read as a fault."""
    return tok(text, add_special_tokens=True, verbose=False)["input_ids"]


def pack_texts(encoded, eos: int | None, samples: int, seq_len: int) -> list[torch.Tensor]:
    """Token lists joined into one stream (each followed by ``eos`` when the tokenizer has one) and cut
    into ``samples`` samples of exactly ``seq_len`` tokens, in order; a last partial sample is dropped
    (auto-round's calibration likewise takes only full-length samples). ``encoded``: an iterable of
    token lists, read only as far as needed."""
    out: list[torch.Tensor] = []
    buf: list[int] = []
    for enc in encoded:
        buf += list(enc) + ([eos] if eos is not None else [])
        while len(buf) >= seq_len and len(out) < samples:
            out.append(torch.tensor(buf[:seq_len], dtype=torch.long))
            buf = buf[seq_len:]
        if len(out) >= samples:
            break
    return out


def build_samples(model: Path, data: str | None, samples: int, seq_len: int, chat_template: bool = False,
                  pack: bool = False) -> Samples:
    """Calibration samples: one text per sample (truncated to ``seq_len``), or with ``pack`` the texts
    joined and cut into samples of exactly ``seq_len`` tokens (``pack_texts``)."""
    texts, source = load_texts(data)
    tok = load_tokenizer(model)
    if pack:
        ids = pack_texts((_encode(tok, t) for t in texts), tok.eos_token_id, samples, seq_len)
        if len(ids) < samples:
            raise QuantizeError(f"--data {source}: {len(ids)} packed samples of {seq_len} tokens from {len(texts)} "
                                f"texts, fewer than --samples {samples}; pass more text, lower --samples to "
                                f"{len(ids)} or --seq-len")
        return Samples(ids, len(texts), 0, source)
    ids: list[torch.Tensor] = []
    dropped = 0
    for text in texts:
        if len(ids) >= samples:
            break
        if chat_template and getattr(tok, "chat_template", None):
            enc = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
            enc = enc["input_ids"] if isinstance(enc, dict) else enc
        else:
            enc = _encode(tok, text)
        enc = list(enc)[:seq_len]
        if len(enc) < 2:
            dropped += 1
            continue
        ids.append(torch.tensor(enc, dtype=torch.long))
    if not ids:
        raise QuantizeError(
            f"--data {source}: no usable samples ({len(texts)} texts read, {dropped} shorter than 2 "
            "tokens); pass more or longer text"
        )
    check_enough(source, ids, samples, seq_len, len(texts), dropped)
    return Samples(ids, len(texts), dropped, source)


def check_enough(source: str, ids: list, samples: int, seq_len: int, texts: int, dropped: int) -> None:
    """A calibration set too small to mean anything is refused: fewer tokens than one full sample
    (``seq_len``), unless it fills every sample asked for (``--samples 1`` on one short text is a
    choice; one word under calibrate-kv's 512 samples of up to 2048 tokens calibrated on 2 tokens)."""
    total = sum(len(i) for i in ids)
    if total < seq_len and len(ids) < samples:
        raise QuantizeError(
            f"--data {source}: {total} tokens in {len(ids)} usable samples ({texts} texts read, {dropped} shorter "
            f"than 2 tokens), fewer than one sample of --seq-len {seq_len} and fewer than --samples {samples}; pass "
            f"more text or lower --samples to {len(ids)} (enough text: at least {seq_len} tokens)"
        )
