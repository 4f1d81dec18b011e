"""lm-eval tasks on local data: load lm-eval's own task YAML (prompts, few-shot, filters, metrics),
change only where the documents come from (docs/evaluation.md#lm-eval-on-local-files), and drop tag/group keys.

Local formats (docs/evaluation.md#local-data): GSM8K jsonl {question, answer}; ARC Mosaic jsonl
{query, choices, gold}; MMLU CSV question,choice0..3,answer (read all-as-string, NA parsing off);
MMLU-Pro parquet (TIGER-Lab columns). ``mmlu`` and ``mmlu_pro`` expand to their subject tasks;
their aggregate is the size-weighted mean, computed by the caller.
"""

from __future__ import annotations

import difflib
import functools
from pathlib import Path

from ..errors import QuantizeError

GROUPS = {"mmlu": "mmlu_", "mmlu_pro": "mmlu_pro_"}
# --data-dir shipped: the small subset in the repository's eval/data (installed as quantize/eval_data;
# made by scripts/make_eval_subset.py, sources and licences in eval/SOURCES.md)
SHIPPED = "shipped"
SUPPORTED = ("gsm8k", "arc_easy", "arc_challenge", "mmlu", "mmlu_pro")


# the folders of lm-eval's own task YAML that SUPPORTED reads (lm_eval/tasks/<folder>): indexing only
# these takes 0.5 s where every task lm-eval ships takes 12-15 s on 2 cores, and keeps look-alike
# tasks from other folders (mmlu_pro_plus_*, the Llama-3 mmlu_pro_llama_*) out of a group's subjects
TASK_DIRS = ("gsm8k", "arc", "mmlu", "mmlu_pro")


def data_folder(data_dir) -> Path | None:
    """``--data-dir`` as a folder: None (the Hub), the shipped subset, or the path given."""
    if data_dir is None:
        return None
    if str(data_dir) == SHIPPED:
        return Path(__file__).resolve().parents[1] / "eval_data" / "data"
    return Path(data_dir)


def _task_manager():
    """lm-eval's index of the task YAML files of ``TASK_DIRS``, built once per process (the one
    ``simple_evaluate`` is handed too)."""
    from lm_eval import tasks
    from lm_eval.tasks import TaskManager

    root = Path(tasks.__file__).parent
    return _built(TaskManager, tuple(str(root / d) for d in TASK_DIRS))


@functools.lru_cache(maxsize=2)
def _built(factory, dirs: tuple[str, ...]):
    # keyed by the class: a replaced TaskManager (a test's) gets its own
    return factory(include_defaults=False, include_path=list(dirs))


def _yaml(tm, name: str) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = dict(load_yaml(tm.task_index[name].yaml_path, resolve_func=True))
    inc = cfg.pop("include", None)
    if inc:  # subject files include a shared template: resolve it relative to the YAML
        base = dict(load_yaml(str(Path(tm.task_index[name].yaml_path).parent / inc), resolve_func=True))
        base.update(cfg)
        cfg = base
    for k in ("tag", "group", "group_alias"):
        cfg.pop(k, None)
    return cfg


def _mmlu_docs(dataset):
    """CSV question,choice0..3,answer -> the fields lm-eval's MMLU prompt reads."""

    def fix(doc):
        return {"question": doc["question"], "choices": [doc[f"choice{i}"] for i in range(4)],
                "answer": int(doc["answer"])}

    return dataset.map(fix)


def _need(path: Path, what: str) -> str:
    if not path.exists():
        raise QuantizeError(f"{path}: missing {what}; --data-dir must hold the files docs/evaluation.md#local-data "
                            "lists")
    return str(path)


def expand(tasks: list[str]) -> dict[str, list[str]]:
    """Requested task -> the lm-eval tasks it runs (a group expands to its subjects)."""
    tm = _task_manager()
    out: dict[str, list[str]] = {}
    for t in tasks:
        if t not in SUPPORTED:
            close = difflib.get_close_matches(t, list(SUPPORTED) + [n for n in tm.task_index
                                                                    if n.startswith(("mmlu", "arc", "gsm"))], n=3)
            raise QuantizeError(f"--tasks {t}: unknown task; supported: {', '.join(SUPPORTED)}"
                                + (f" (did you mean {', '.join(close)}?)" if close else ""))
        if t in GROUPS:
            prefix = GROUPS[t]
            home = "/mmlu/default/" if t == "mmlu" else f"/{t}/"  # the group's own folder, not a look-alike's
            subs = sorted(n for n, e in tm.task_index.items() if n.startswith(prefix) and str(e.kind).endswith("TASK")
                          and home in str(e.yaml_path))
            out[t] = subs
        else:
            out[t] = [t]
    return out


def output_type(cfg: dict | str) -> str:
    """What lm-eval scores for a task (``generate_until``, ``multiple_choice``, ...): the config's
    own, or (a Hub task by name) its YAML's."""
    if isinstance(cfg, dict):
        return str(cfg.get("output_type", "generate_until"))
    return str(_yaml(_task_manager(), cfg).get("output_type", "generate_until"))


def task_configs(tasks: list[str], data_dir: str | Path | None,
                 max_gen_toks: int | None = None) -> tuple[list[dict | str], dict[str, list[str]]]:
    """The task list to hand to ``simple_evaluate`` (dicts for local data, names for the Hub)."""
    groups = expand(tasks)
    d = data_folder(data_dir)
    if d is None:
        return [n for subs in groups.values() for n in subs], groups
    tm = _task_manager()
    out: list[dict | str] = []
    for t, subs in groups.items():
        for name in subs:
            cfg = _yaml(tm, name)
            cfg["task"] = name
            if t == "gsm8k":
                cfg.update(dataset_path="json", dataset_name=None,
                           dataset_kwargs={"data_files": {"train": _need(d / "gsm8k/train.jsonl", "GSM8K train"),
                                                          "test": _need(d / "gsm8k/test.jsonl", "GSM8K test")}})
            elif t.startswith("arc_"):
                cfg.update(dataset_path="json", dataset_name=None,
                           dataset_kwargs={"data_files": {"test": _need(d / f"arc/{t}.jsonl", "ARC")}},
                           training_split=None, validation_split=None, test_split="test",
                           doc_to_text="{{query}}\nAnswer:", doc_to_choice="{{choices}}", doc_to_target="{{gold}}",
                           doc_to_decontamination_query="{{query}}")
            elif t == "mmlu":
                subject = name[len("mmlu_"):]
                import datasets

                feats = datasets.Features({c: datasets.Value("string")
                                           for c in ("question", "choice0", "choice1", "choice2", "choice3", "answer")})
                cfg.update(dataset_path="csv", dataset_name=None,
                           dataset_kwargs={"data_files": {"test": _need(d / f"mmlu/test/{subject}_test.csv",
                                                                        f"MMLU {subject}"),
                                                          "dev": _need(d / f"mmlu/dev/{subject}_dev.csv",
                                                                       f"MMLU {subject} dev")},
                                           "keep_default_na": False, "na_filter": False, "features": feats},
                           process_docs=_mmlu_docs, test_split="test", fewshot_split="dev")
            elif t == "mmlu_pro":
                cfg.update(dataset_path="parquet", dataset_name=None,
                           dataset_kwargs={"data_files": {
                               "test": _need(d / "mmlu_pro/test-00000-of-00001.parquet", "MMLU-Pro test"),
                               "validation": _need(d / "mmlu_pro/validation-00000-of-00001.parquet",
                                                   "MMLU-Pro validation")}})
            if max_gen_toks is not None and isinstance(cfg.get("generation_kwargs"), dict):
                cfg["generation_kwargs"] = {**cfg["generation_kwargs"], "max_gen_toks": max_gen_toks}
            out.append(cfg)
    return out, groups


