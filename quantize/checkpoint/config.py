"""One typed view of a checkpoint's config.json: what plan, shard, check and convert (and
calibrate) read from it, checked once when it is read (present where required, typed, in range),
so a bad field is one line naming the file and the field, never a ``TypeError`` deep in a size
computation.

``ModelConfig.load(folder)`` reads ``folder/config.json`` through the bounded JSON parser;
``ModelConfig.from_dict(cfg, where)`` checks a dict already read. The architecture's text model
sits under ``text_config`` for a multimodal wrapper (Kimi K2.5), else at the top; ``text`` is
that dict and every size property reads it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import QuantizeError

# field -> (lowest, highest, required): every integer config.json field this tool reads from the
# text model's config. The highest values are far beyond any released model (Kimi K2: 61 layers,
# 7168 hidden, 163840 vocabulary, 384 experts), low enough that no size computation overflows.
INT_FIELDS: dict[str, tuple[int, int, bool]] = {
    "num_hidden_layers": (1, 4096, True),
    "hidden_size": (1, 1 << 20, True),
    "vocab_size": (1, 1 << 24, True),
    "num_attention_heads": (1, 1 << 16, True),
    "num_key_value_heads": (1, 1 << 16, False),
    "head_dim": (1, 1 << 16, False),
    "intermediate_size": (1, 1 << 22, False),
    "moe_intermediate_size": (1, 1 << 22, False),
    "n_routed_experts": (0, 1 << 16, False),
    "num_experts": (0, 1 << 16, False),
    "n_shared_experts": (0, 1 << 10, False),
    "first_k_dense_replace": (0, 4096, False),
    "num_nextn_predict_layers": (0, 64, False),
    "q_lora_rank": (1, 1 << 20, False),
    "kv_lora_rank": (1, 1 << 20, False),
    "qk_nope_head_dim": (0, 1 << 16, False),
    "qk_rope_head_dim": (0, 1 << 16, False),
    "v_head_dim": (1, 1 << 16, False),
    "index_n_heads": (1, 1 << 16, False),
    "index_head_dim": (1, 1 << 16, False),
    "num_experts_per_tok": (1, 1 << 16, False),
    "n_group": (1, 1 << 16, False),
    "topk_group": (1, 1 << 16, False),
}
TEXT_KEY = "text_config"


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_uint(x) -> bool:
    return type(x) is int and x >= 0  # not bool, not float


@dataclass(frozen=True)
class ModelConfig:
    raw: dict
    where: str  # the config.json path, for messages

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "ModelConfig":
        from ..parse import load_json

        path = Path(folder) / "config.json"
        if not path.exists():
            raise QuantizeError(f"{path}: missing; a checkpoint needs its config.json (architectures, sizes)")
        return cls.from_dict(load_json(path, "config.json", kind="config"), path)

    @classmethod
    def from_dict(cls, cfg, where: str | os.PathLike) -> "ModelConfig":
        if not isinstance(cfg, dict):
            raise QuantizeError(f"{where}: a config.json must be a JSON object, not {type(cfg).__name__}; fix it")
        self = cls(cfg, str(where))
        self._check()
        return self

    # -- the checks ----------------------------------------------------------------------------
    def _fail(self, field: str, why: str) -> QuantizeError:
        return QuantizeError(f"{self.where}: '{field}' {why}; fix the file")

    def _check(self) -> None:
        cfg = self.raw
        arch = cfg.get("architectures")
        if arch is not None and (type(arch) is not list or not all(isinstance(a, str) for a in arch)):
            raise self._fail("architectures", f"must be a list of class names, not {_short(arch)}")
        for key in ("model_type",):
            if cfg.get(key) is not None and not isinstance(cfg[key], str):
                raise self._fail(key, f"must be a string, not {_short(cfg[key])}")
        text = cfg.get(TEXT_KEY)
        if text is not None and not isinstance(text, dict):
            raise self._fail(TEXT_KEY, f"must be an object, not {type(text).__name__}")
        self._check_quant(cfg, "")
        if isinstance(text, dict):
            self._check_quant(text, TEXT_KEY + ".")
        prefix = TEXT_KEY + "." if isinstance(text, dict) else ""
        body = self.text
        for name, (lo, hi, required) in INT_FIELDS.items():
            v = body.get(name)
            if v is None:
                if required:
                    state = "null" if name in body else "missing"
                    raise self._fail(prefix + name, f"is {state}; it must be an integer")
                continue
            if type(v) is not int:
                raise self._fail(prefix + name, f"must be an integer, not {_short(v)}")
            if not lo <= v <= hi:
                raise self._fail(prefix + name, f"is {v}, outside [{lo}, {hi:,}]")
        self._check_routing(prefix)
        tie = body.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
        if tie is not None and not isinstance(tie, bool):
            raise self._fail("tie_word_embeddings", f"must be true or false, not {_short(tie)}")

    def _check_routing(self, prefix: str) -> None:
        """Can the router pick ``num_experts_per_tok`` experts? DeepSeek-V3-style group-limited
        routing (transformers' DeepseekV3TopkRouter, SGLang's and vLLM's grouped_topk) splits the
        experts into ``n_group`` groups, scores each group by its top-2 experts, keeps
        ``topk_group`` groups and picks the experts among those: a config where that cannot
        happen fails in the router, mid-run, with a torch index error; here it is one line."""
        b = self.text
        e, k, g, tg = (b.get(n) for n in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"))
        if not e:
            return
        if k is not None and k > e:
            raise self._fail(prefix + "num_experts_per_tok", f"is {k}, more than the {e} routed experts")
        if g is None:
            return
        if e % g:
            raise self._fail(prefix + "n_group", f"is {g}: {e} routed experts do not split into {g} equal groups")
        if tg is not None and tg > g:
            raise self._fail(prefix + "topk_group", f"is {tg}, more than the {g} expert groups (n_group)")
        if e // g < 2:
            raise self._fail(prefix + "n_group", f"is {g}: {e // g} expert per group, but a group is scored by its "
                             "top 2 experts; use fewer groups")
        if k is not None and tg is not None and tg * (e // g) < k:
            raise self._fail(prefix + "num_experts_per_tok", f"is {k}, but the router keeps {tg} groups (topk_group) "
                             f"of {e // g} experts, {tg * (e // g)} to choose from")

    def _check_quant(self, cfg: dict, prefix: str) -> None:
        qc = cfg.get("quantization_config")
        if qc is None:
            return
        if not isinstance(qc, dict):
            raise self._fail(prefix + "quantization_config", f"must be an object, not {type(qc).__name__}")
        block = qc.get("weight_block_size")
        if block is not None and (
            type(block) is not list or len(block) != 2 or not all(_is_uint(x) and x > 0 for x in block)
        ):
            raise self._fail(prefix + "quantization_config.weight_block_size",
                             f"must be two positive integers like [128, 128], not {_short(block)}")
        groups = qc.get("config_groups")
        if groups is not None and not (isinstance(groups, dict)
                                       and all(isinstance(g, dict) for g in groups.values())):
            raise self._fail(prefix + "quantization_config.config_groups", "must be an object of config groups")

    # -- the view ------------------------------------------------------------------------------
    @property
    def text(self) -> dict:
        """The text model's config: ``text_config`` where the model nests one, else the top."""
        t = self.raw.get(TEXT_KEY)
        return t if isinstance(t, dict) else self.raw

    def int(self, name: str, default: int | None = None) -> int | None:
        """An integer field of INT_FIELDS (checked), or ``default`` when absent or null."""
        v = self.text.get(name)
        return default if v is None else v

    @property
    def num_hidden_layers(self) -> int:
        return self.text["num_hidden_layers"]

    @property
    def hidden_size(self) -> int:
        return self.text["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.text["vocab_size"]

    @property
    def num_attention_heads(self) -> int:
        return self.text["num_attention_heads"]

    @property
    def num_key_value_heads(self) -> int:
        return self.int("num_key_value_heads", self.num_attention_heads)

    @property
    def experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        return self.int("n_routed_experts") or self.int("num_experts") or 0

    @property
    def quantization_config(self) -> dict | None:
        """The checkpoint's ``quantization_config`` (top level, else the text model's), or None."""
        return self.raw.get("quantization_config") or self.text.get("quantization_config") or None


_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_EMBED = re.compile(r"(?:^|\.)model\.embed_tokens\.weight$")


def check_against_tensors(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], folder) -> None:
    """config.json's sizes agree with the tensors it describes (headers only): the decoder layers
    are 0..num_hidden_layers-1 (plus at most num_nextn_predict_layers MTP layers after them), the
    embedding is [vocab_size, hidden_size], and a MoE layer's experts are 0..n_routed_experts-1. A
    config that disagrees would be copied into the output as it is, and no engine could load it."""
    layers, experts, embed = set(), {}, None
    for name, shape in shapes.items():
        if m := _EXPERT.search(name):
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        if m := _LAYER.search(name):
            layers.add(int(m.group(1)))
        elif embed is None and _EMBED.search(name):
            embed = (name, shape)
    where = cfg.where
    n, extra = cfg.num_hidden_layers, cfg.int("num_nextn_predict_layers", 0) or 0
    if layers:
        missing = sorted(set(range(n)) - layers)
        if missing:
            raise QuantizeError(
                f"{where}: num_hidden_layers is {n}, but {folder} holds no tensors of layer {missing[0]} "
                f"(it has layers {min(layers)}..{max(layers)}); the config is not this checkpoint's, fix it"
            )
        if max(layers) >= n + extra:
            raise QuantizeError(
                f"{where}: num_hidden_layers is {n} (and num_nextn_predict_layers {extra}), but {folder} holds layer "
                f"{max(layers)}; the config is not this checkpoint's, fix it"
            )
    if embed is not None and len(embed[1]) == 2:
        rows, width = embed[1]
        if width != cfg.hidden_size:
            raise QuantizeError(
                f"{where}: hidden_size is {cfg.hidden_size}, but {embed[0]} is {list(embed[1])}; fix the config"
            )
        if rows != cfg.vocab_size:
            raise QuantizeError(
                f"{where}: vocab_size is {cfg.vocab_size}, but {embed[0]} is {list(embed[1])}; fix the config"
            )
    n_exp = cfg.experts
    for layer, ids in sorted(experts.items()):
        if n_exp and max(ids) >= n_exp:
            raise QuantizeError(
                f"{where}: {n_exp} routed experts, but layer {layer} holds expert {max(ids)}; fix the config"
            )
        if n_exp and len(ids) != n_exp and layer < n:
            gone = min(set(range(n_exp)) - ids)
            raise QuantizeError(
                f"{where}: {n_exp} routed experts, but layer {layer} holds no tensors of expert {gone}; "
                "the checkpoint is incomplete or the config is not its, fix it"
            )
