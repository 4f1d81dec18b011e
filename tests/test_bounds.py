"""Bounds, thresholds and rules tested at their edges: a near miss on the wrong side fails, one on
the right side passes, against an oracle computed here (hand values, the normal distribution,
torch's own UE8M0 decoding, round-to-nearest on the grid) rather than the result of the code under test.
Each test names, in a comment, the bug it was proven against (planted, seen failing, reverted)."""

import json
import math
import re
import statistics

import numpy as np
import pytest
import torch

from quantize.check import check
from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.formats import int4
from quantize.shard import shard

from .conftest import load_dir

CAL = dict(samples=4, seq_len=64)
KV4 = {"num_key_value_heads": 4}  # k/v_proj N = 256: at TP 4 only o_proj's K per rank (64) breaks a rule


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama", layout="bf16", overrides=KV4)


@pytest.fixture(scope="module")
def rtn(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("bounds") / "rtn"
    convert(llama, out, profile="all-linear")
    return out


@pytest.fixture(scope="module")
def autoround(llama, tmp_path_factory):
    """20 steps at lr 0.1: the offsets and clip factors travel far enough (sum of lr_t ~ 1) to
    press on their bounds, and every layer keeps a trained (not step-0) state."""
    out = tmp_path_factory.mktemp("bounds") / "ar"
    convert(llama, out, profile="all-linear", method="autoround", iters=20, lr=0.1, workers=2, **CAL)
    return out


def _ar_tensors(llama, out):
    src, got = load_dir(llama), load_dir(out)
    mods = [k[: -len(".weight_packed")] for k in got if k.endswith(".weight_packed")]
    assert len(mods) == 14  # 2 layers x 7 Linear
    man = json.loads((out / "quantize_manifest.json").read_text())["method"]
    assert len(man["layers"]) == 2 and all(r["train"]["best_step"] > 0 for r in man["layers"]), man["layers"]
    return [(m, src[m + ".weight"], got[m + ".weight_packed"], got[m + ".weight_scale"]) for m in mods]


# catches: CLIP_RANGE in quantize/methods/autoround.py allowing a clip factor above 1 (e.g. (0.5, 1.5))
def test_autoround_scales_stay_within_half_to_one_of_rtn(llama, autoround):
    ratios = []
    for _, w, _, s in _ar_tensors(llama, autoround):
        _, s_rtn = int4.quantize_groups(w, 32, "fullrange")  # RTN on AutoRound's grid: clip factors 1
        assert s.shape == s_rtn.shape
        ratios.append((s.float().abs() / s_rtn.float().abs()).reshape(-1))
    r = torch.cat(ratios)
    # bf16 rounding is monotone and exact on halving: the ends of [0.5, 1] hold exactly
    assert float(r.min()) >= 0.5 and float(r.max()) <= 1.0, (float(r.min()), float(r.max()))
    assert float(r.min()) < 0.9  # clipping trained, so the bound was pressed on, not idle
    rep = check(autoround, source=llama)  # the user's proof of AutoRound's grid
    assert rep.ok, rep.failures


# catches: V_RANGE in quantize/methods/autoround.py allowing rounding offsets in [-1, 1]
def test_autoround_codes_within_one_step_of_the_exact_quotient(llama, autoround):
    """|V| <= 0.5 means each unclamped code is round(x + V) for x = bf16(w / scale): |q - x| <= 1."""
    worst, moved = 0.0, 0.0
    for _, w, packed, s in _ar_tensors(llama, autoround):
        out, k = w.shape
        q = int4.unpack_int4(packed, k).float()
        x = (w.to(torch.bfloat16).float().view(out, k // 32, 32) / s.float().unsqueeze(-1)).to(torch.bfloat16)
        x = x.float().view(out, k)
        inner = (q > int4.QMIN) & (q < int4.QMAX)
        d = (q - x).abs()[inner]
        assert d.numel() > 0.5 * q.numel()  # most codes are not clamped
        worst, moved = max(worst, float(d.max())), max(moved, float((d > 0.5).float().mean()))
    assert worst <= 1.0 + 1e-6, worst
    assert moved > 0  # some offsets changed a rounding: the bound was reached, not idle


# catches: quantize/calibrate/fold.py rounding the exponent up (math.ceil) instead of down
def test_fold_factor_is_the_largest_power_of_two_that_fits(tiny, tmp_path):
    from quantize.calibrate.kv import calibrate_kv

    res = calibrate_kv(tiny("deepseek_v3", layout="bf16"), tmp_path / "f", fold=True, samples=4, seq_len=48)
    limit = 448 / 2.0  # the default --fold-headroom 2
    wanted = []
    for f in res.fold:
        for part in ("latent", "rope"):
            f_part, amax = f[part], f[f"{part}_amax_before"]
            assert amax > 0 and math.log2(f_part).is_integer()
            assert amax * f_part <= limit  # never overflows the cache's e4m3 budget
            for n in f["notes"]:  # a capped factor reports what the cache alone wanted: 2^k, k = floor
                m = re.match(rf"{part}: factor (?:capped|raised) at 2\^-?\d+ \(cache alone wanted 2\^(-?\d+)\)", n)
                if m:
                    k = int(m.group(1))
                    wanted.append(k)
                    assert amax * 2.0**k <= limit < amax * 2.0 ** (k + 1), (part, amax, k)
    assert len(wanted) >= 3
    # the same rule with no query to cap it, on hand values: 448/100 = 4.48 -> 4; 448/112 = 4 exactly -> 4;
    # 448/113 < 4 -> 2; 448/0.3 -> 1024 (2^10.5)
    from quantize.calibrate.fold import choose_factor

    for amax, want in ((100.0, 4.0), (112.0, 4.0), (113.0, 2.0), (0.3, 1024.0)):
        assert choose_factor(amax, None, 1.0, "latent") == (want, None), amax


# catches: the dense Marlin rule `K per rank % 128` in quantize/shard.py loosened to `% 64`
def test_dense_marlin_k_per_rank_must_be_a_multiple_of_128(rtn, tmp_path):
    # o_proj K = 256: 128 per rank at TP 2 is fine, 64 per rank at TP 4 is not (64 would satisfy % 64)
    assert check(rtn, tp=2).ok
    rule = r"o_proj at TP 4: Marlin needs K per rank % 128 == 0, got 64; use --tp 1 or 2"
    with pytest.raises(QuantizeError, match=rule):
        shard(rtn, tmp_path / "sh", tp=4)
    assert not (tmp_path / "sh").exists()
    rep = check(rtn, tp=4)
    assert not rep.ok and any("K per rank % 128 == 0, got 64" in f for f in rep.failures), rep.failures


# catches: KERNEL_RTOL in quantize/check.py loosened tenfold (2e-2 -> 2e-1)
@pytest.mark.parametrize("sharded", [False, True])
def test_check_fails_a_kernel_3pct_off_and_passes_one_1pct_off(rtn, tmp_path, monkeypatch, sharded):
    from quantize.kernels.cpu import CpuW4A16

    target = rtn
    if sharded:
        shard(rtn, tmp_path / "sh", tp=2)
        target = tmp_path / "sh"
    real = CpuW4A16.__call__
    for gain, ok in ((1.01, True), (1.03, False)):  # bf16 output alone is ~0.3% off the fp32 reference
        monkeypatch.setattr(CpuW4A16, "__call__", lambda self, x, g=gain: real(self, x).float() * g)
        rep = check(target)
        assert len(rep.rows) == 14
        errs = [r.kernel_rel_err for r in rep.rows]
        assert all(abs(e - (gain - 1)) < 0.006 for e in errs), errs
        assert rep.ok is ok, rep.failures
        if not ok:
            assert sum("W4A16 kernel differs from the reference" in f for f in rep.failures) == 14


# catches: the eval gate's bootstrap interval at 90 % (percentiles 5 / 95) instead of 95 % (2.5 / 97.5)
def test_eval_gate_uses_the_95pct_interval(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from quantize.evaluate.run import evaluate

    # 2000 paired items: the candidate loses 200 the baseline got and wins 100 it missed (-5 points)
    n, lose, win = 2000, 200, 100
    a = np.array([1.0] * lose + [0.0] * win + [1.0] * 1000 + [0.0] * (n - lose - win - 1000))
    b = np.array([0.0] * lose + [1.0] * win + list(a[lose + win:]))
    assert len(a) == len(b) == n
    d = (b - a) * 100
    se = d.std() / math.sqrt(n)  # the normal limit of the paired bootstrap of the mean
    z = statistics.NormalDist().inv_cdf(0.975)
    lo95, hi95 = d.mean() - z * se, d.mean() + z * se
    scores = {"base": a, "cand": b}

    def fake(path, *a, **kw):  # lm-eval's per-sample results for the two models, same documents
        acc = scores[str(path).rsplit("/", 1)[-1]]
        return {"samples": {"arc_easy": [{"doc_id": i, "filter": "none", "acc": float(v)} for i, v in enumerate(acc)]}}

    import quantize.evaluate.run as run

    monkeypatch.setattr(run, "_run_model", fake)  # each model's lm-eval run
    monkeypatch.setattr(run, "_read_tasks", lambda configs: None)  # and the data it would read: none here
    # lm-eval's own arc_easy YAML without indexing every task it ships (tens of seconds per TaskManager)
    import lm_eval.tasks
    from pathlib import Path
    from types import SimpleNamespace

    yaml = SimpleNamespace(yaml_path=str(Path(lm_eval.__file__).parent / "tasks/arc/arc_easy.yaml"), kind="TASK")
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: SimpleNamespace(task_index={"arc_easy": yaml}))
    from safetensors.torch import save_file

    for m in ("base", "cand"):
        (tmp_path / m).mkdir()
        (tmp_path / m / "config.json").write_text("{}")
        (tmp_path / m / "tokenizer_config.json").write_text("{}")  # one tokenizer for both (eval refuses two)
        # the same weights in both (eval compares a candidate made from the baseline, or the baseline itself)
        save_file({"w": torch.zeros(4)}, str(tmp_path / m / "model.safetensors"))
    (tmp_path / "data" / "arc").mkdir(parents=True)
    (tmp_path / "data" / "arc" / "arc_easy.jsonl").write_text(
        json.dumps({"query": "Question: 1 + 1?", "choices": ["1", "2"], "gold": 1}) + "\n")
    for margin, passed in ((0.15, True), (-0.15, False)):  # -max_drop just below / just above the 95 % upper end
        max_drop = -(hi95 - margin * se)
        rep = evaluate(tmp_path / "base", tmp_path / "cand", tasks="arc_easy", data_dir=tmp_path / "data",
                       max_drop=max_drop)
        assert len(rep.tasks) == 1
        t = rep.tasks[0]
        assert t.n == n and t.delta == pytest.approx(-5.0)
        assert abs(t.ci_low - lo95) < 0.08 * se and abs(t.ci_high - hi95) < 0.08 * se, (t.ci_low, t.ci_high, lo95, hi95)
        assert bool(t.passed) is passed and rep.passed is passed and not t.conclusive


# catches (own plant): quantize/formats/fp8.py decoding a uint8 UE8M0 block scale as 2^(b-128) instead of 2^(b-127)
@pytest.mark.parametrize("rows", [256, 200])  # whole blocks, and a ceil grid with a partial last block
def test_fp8_block_dequant_of_ue8m0_exponent_scales(rows):
    from quantize.formats.fp8 import dequant_block

    w = torch.randn(rows, 256, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
    exps = torch.tensor([[120, 127], [128, 133]], dtype=torch.uint8)  # 2^-7, 1, 2, 2^6
    per_block = torch.tensor([[2.0**-7, 1.0], [2.0, 64.0]])
    want = w.float() * per_block.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)
    got = dequant_block(w, exps, dtype=torch.float32)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(got, dequant_block(w, exps.view(torch.float8_e8m0fnu), dtype=torch.float32))  # torch's decoding


# catches (own plant): quantize/check.py comparing a file's size but not its SHA-256 with the manifest
def test_check_fails_a_same_size_change_by_its_sha256(rtn, tmp_path):
    import shutil

    out = tmp_path / "o"
    shutil.copytree(rtn, out)
    assert check(out).ok
    f = sorted(out.glob("*.safetensors"))[-1]
    with open(f, "r+b") as fh:  # one bit of the last tensor's data, in place: same size, same header
        fh.seek(-1, 2)
        b = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([b[0] ^ 0x01]))
    rep = check(out)
    assert not rep.ok and any(f.name in x and "SHA-256 differs" in x for x in rep.failures), rep.failures
