"""shard / merge / check on tiny GLM-5 and Kimi checkpoints made by quantize convert."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantize.check import check
from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.shard import merge, shard

from .conftest import TP8, dir_bytes, load_dir


@pytest.fixture(scope="module")
def int4(tiny, tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-int4") / "o"
            convert(tiny(arch, overrides=TP8), out)
            cache[arch] = out
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "kimi_k25"])
@pytest.mark.parametrize("tp", [2, 8])
def test_shard_merge_identity_and_check(arch, tp, int4, tmp_path):
    src = int4(arch)
    m = shard(src, tmp_path / "sh", tp=tp, max_part_gib=1 / 1024)
    assert len(m["rank_bytes"]) == tp
    assert len({p.name for p in (tmp_path / "sh").glob("rank-00/part-*.safetensors")}) > 1  # parts split
    # a verification layout, not an engine's: no sharded_state file names, no config.json an engine could load from
    assert not list((tmp_path / "sh").rglob("model-rank-*")) and not (tmp_path / "sh" / "config.json").exists()
    assert "not an engine load format" in m["layout"]
    t = m["tensors"]
    pre = "language_model." if arch == "kimi_k25" else ""
    assert t[f"{pre}model.layers.1.mlp.experts.0.down_proj.weight_packed"]["split"] == "row"
    assert t[f"{pre}model.layers.1.mlp.experts.0.gate_proj.weight_scale"]["split"] == "col"
    assert t[f"{pre}model.layers.0.self_attn.kv_b_proj.weight"]["split"] == "col"
    assert t[f"{pre}model.layers.0.self_attn.o_proj.weight"]["split"] == "row"
    assert t[f"{pre}model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]["split"] == "rep"
    assert t[f"{pre}model.layers.1.mlp.gate.weight"]["split"] == "rep"
    # per-rank INT4 slices: K split in whole words and groups, weight_shape rewritten
    rank1 = load_dir(tmp_path / "sh" / "rank-01")
    dn = f"{pre}model.layers.1.mlp.experts.0.down_proj"
    assert rank1[dn + ".weight_shape"].tolist() == [256, 1024 // tp]
    assert rank1[dn + ".weight_scale"].shape == (256, 1024 // tp // 32)
    merge(tmp_path / "sh", tmp_path / "merged")
    a, b = dir_bytes(src), dir_bytes(tmp_path / "merged")
    assert sorted(a) == sorted(b) and "config.json" in a and "quantize_manifest.json" in a
    for f in a:
        assert a[f] == b[f], f  # byte-identical files (weights, index, config, tokenizer, manifest)
    rep = check(tmp_path / "sh")
    assert rep.ok, rep.failures
    assert max(r.shard_max_err for r in rep.rows) < 1e-5


def test_check_converted_with_source(tiny, int4):
    rep = check(int4("glm_moe_dsa"), tp=8, source=tiny("glm_moe_dsa", overrides=TP8))
    assert rep.ok, rep.failures
    s = rep.summary()["expert_gate"]
    assert s["tensors"] == 24 and 0.05 < s["max_source_rel_err"] < 0.15 and s["min_snr_db"] > 15
    assert s["max_kernel_rel_err"] < 0.01


def _corrupt(folder, name, rank, fn):
    f = next(p for p in sorted(folder.glob(f"rank-{rank:02d}/part-*.safetensors")) if name in safe_open(p, "pt").keys())
    with safe_open(f, "pt") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = fh.metadata()
    fn(t)
    save_file(t, str(f), metadata=meta)


@pytest.mark.parametrize("what", ["nibble", "scale"])
def test_check_catches_flipped_nibble_or_swapped_scale_in_one_rank(what, int4, tmp_path):
    sh = tmp_path / "sh"
    shard(int4("glm_moe_dsa"), sh, tp=8)
    m = "model.layers.2.mlp.experts.3.up_proj"
    if what == "nibble":
        def fn(t):
            t[m + ".weight_packed"][5, 3] ^= 0x7 << 8  # flip three bits of one nibble
    else:
        def fn(t):
            s = t[m + ".weight_scale"]
            s[[0, 1]] = s[[1, 0]]  # swap two rows of scales
    _corrupt(sh, m + ".weight_packed", 5, fn)
    rep = check(sh)
    assert not rep.ok
    assert any("rank 5" in f and m in f and "checksum" in f for f in rep.failures)
    assert any(m in f and "recombined" in f and "rank 5" in f for f in rep.failures)
    with pytest.raises(QuantizeError, match="rank 5"):
        merge(sh, tmp_path / "merged")
    if what == "nibble":  # the command line's exit and message, once (the library's verdict is the same for both)
        p = subprocess.run([sys.executable, "-c", "from quantize.cli import app; app()", "check", str(sh)],
                           capture_output=True, text=True, cwd=tmp_path)
        assert p.returncode == 1 and m in p.stderr


def test_tp_breaking_marlin_rule_refused_before_writing(tiny, tmp_path):
    """8 heads but moe_intermediate 256 -> 32 per rank at TP 8, not a multiple of 64."""
    src = tmp_path / "int4"
    convert(tiny("glm_moe_dsa", overrides={"num_attention_heads": 8, "num_key_value_heads": 8}), src)
    out = tmp_path / "sh"
    with pytest.raises(QuantizeError, match=r"MoE Marlin needs intermediate per rank % max\(64, group\) == 0, got 32 with group 32; use --tp 1 or 2 or 4"):
        shard(src, out, tp=8)
    assert not out.exists()
    rep = check(src, tp=8)
    assert not rep.ok and any("Marlin" in f for f in rep.failures)


def test_heads_not_divisible_refused(converted, tmp_path):
    with pytest.raises(QuantizeError, match="attention heads do not split over TP 3"):
        shard(converted("glm_moe_dsa", group_size=32), tmp_path / "x", tp=3)


def test_cli_shard_and_check(int4, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-c", "from quantize.cli import app; app()", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, cwd=tmp_path)
    p = run("shard", int4("kimi_k25"), tmp_path / "sh", "--tp", "4", "--json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout.strip().splitlines()[-1])["rank_bytes"]) == 4
    p = run("check", tmp_path / "sh", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["ok"]
    p = run("shard", "--merge", tmp_path / "sh", tmp_path / "m")
    assert p.returncode == 0, p.stderr
    assert torch.equal(load_dir(tmp_path / "m")["language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed"],
                       load_dir(int4("kimi_k25"))["language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed"])
