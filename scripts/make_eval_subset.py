"""Make eval/data, the small local subset of the evaluation sets the repository ships: the first
items of each file of a full local copy (the layout of docs/evaluation.md#local-data), unchanged.

    python scripts/make_eval_subset.py FULL_DATA_DIR eval/data

What it takes (eval/SOURCES.md gives each set's origin, commit and licence): GSM8K test 100 and
train 20 (few-shot examples); ARC-Easy and ARC-Challenge test 100 each; MMLU dev whole (5 per
subject, the few-shot examples) and test 5 per subject; MMLU-Pro validation whole (70, the
few-shot examples) and test 10 per category."""

import csv
import json
import sys
from pathlib import Path

GSM8K = {"test.jsonl": 100, "train.jsonl": 20}
ARC = {"arc_easy.jsonl": 100, "arc_challenge.jsonl": 100}
MMLU_TEST = 5
MMLU_PRO_TEST = 10


def _lines(src: Path, dst: Path, n: int) -> None:
    rows = src.read_text().splitlines()[:n]
    for r in rows:
        json.loads(r)  # each a JSON object, as the loader reads them
    dst.write_text("\n".join(rows) + "\n")


def _csv(src: Path, dst: Path, n: int | None) -> None:
    with open(src, newline="") as f:
        rows = list(csv.reader(f))
    with open(dst, "w", newline="") as f:
        csv.writer(f).writerows(rows if n is None else rows[: n + 1])  # the header row and n items


def main(full: Path, out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for d in ("gsm8k", "arc", "mmlu/dev", "mmlu/test", "mmlu_pro"):
        (out / d).mkdir(parents=True, exist_ok=True)
    for name, n in GSM8K.items():
        _lines(full / "gsm8k" / name, out / "gsm8k" / name, n)
    for name, n in ARC.items():
        _lines(full / "arc" / name, out / "arc" / name, n)
    for f in sorted((full / "mmlu" / "dev").glob("*_dev.csv")):
        _csv(f, out / "mmlu" / "dev" / f.name, None)
    for f in sorted((full / "mmlu" / "test").glob("*_test.csv")):
        _csv(f, out / "mmlu" / "test" / f.name, MMLU_TEST)
    val = full / "mmlu_pro" / "validation-00000-of-00001.parquet"
    pq.write_table(pq.read_table(val), out / "mmlu_pro" / val.name)
    test = pq.read_table(full / "mmlu_pro" / "test-00000-of-00001.parquet")
    seen: dict[str, int] = {}
    keep = []
    for i, c in enumerate(test.column("category").to_pylist()):
        if seen.get(c, 0) < MMLU_PRO_TEST:
            seen[c] = seen.get(c, 0) + 1
            keep.append(i)
    pq.write_table(test.take(pa.array(keep)), out / "mmlu_pro" / "test-00000-of-00001.parquet")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
