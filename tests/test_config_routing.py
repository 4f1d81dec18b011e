"""Fail fast on a router that cannot route (issue 18's traceback: 8 experts in 8 groups, 4 kept,
8 per token): one line naming the key, before any weight is read; the releases' configs pass."""

from __future__ import annotations

import json

import pytest

from quantize.checkpoint.config import ModelConfig
from quantize.errors import QuantizeError

BASE = {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 128, "num_attention_heads": 4}


def _cfg(**kw):
    return ModelConfig.from_dict({**BASE, **kw}, "config.json")


@pytest.mark.parametrize("kw,fragment", [
    (dict(n_routed_experts=8, num_experts_per_tok=8, n_group=8, topk_group=4), "'n_group' is 8: 1 expert per group"),
    (dict(n_routed_experts=8, num_experts_per_tok=2, n_group=3, topk_group=1), "do not split into 3 equal groups"),
    (dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=3), "'topk_group' is 3, more than the 2"),
    (dict(n_routed_experts=16, num_experts_per_tok=9, n_group=4, topk_group=2), "8 to choose from"),
    (dict(n_routed_experts=8, num_experts_per_tok=9), "more than the 8 routed experts"),
])
def test_a_router_that_cannot_route_is_one_line(kw, fragment):
    with pytest.raises(QuantizeError, match="fix the file") as e:
        _cfg(**kw)
    assert fragment in str(e.value)


@pytest.mark.parametrize("kw", [
    dict(n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4),  # DeepSeek-V3
    dict(n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1),  # Kimi K2.x
    dict(n_routed_experts=16, num_experts_per_tok=8, n_group=4, topk_group=2),  # the near miss: exactly 8
    dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=4),  # 2 experts per group
    dict(n_routed_experts=0),  # dense
])
def test_the_releases_and_the_near_misses_pass(kw):
    _cfg(**kw)


def test_the_cli_refuses_it_before_reading_weights(tiny, tmp_path):
    import shutil

    from typer.testing import CliRunner

    from quantize.cli import app

    src = tmp_path / "s"
    shutil.copytree(tiny("deepseek_v3", layout="bf16"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(n_group=8, topk_group=4, num_experts_per_tok=8)
    (src / "config.json").write_text(json.dumps(cfg))
    for argv in (["calibrate-kv", str(src), "--samples", "2", "--seq-len", "16"],
                 ["convert", str(src), str(tmp_path / "o"), "--method", "gptq", "--samples", "2"]):
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 2 and "1 expert per group" in res.stderr and len(res.stderr.strip().splitlines()) == 1
