"""quantize eval --kld: next-token KL divergence, bounded memory, reusable baseline logits."""

import json
import shutil

import pytest

from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.evaluate.kld import kld


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    base = tiny("llama", fp8_source=False)
    cand = tmp_path_factory.mktemp("kld") / "g32"
    convert(base, cand, profile="all-linear", group_size=32)
    return base, cand


def test_identical_models_have_zero_divergence(pair):
    base, _ = pair
    r = kld(base, base, tokens=300, chunk=64)
    assert r.kld_mean == pytest.approx(0, abs=1e-6) and r.kld_max == pytest.approx(0, abs=1e-5)
    assert r.top1_agreement == 1.0 and r.ppl_ratio == pytest.approx(1.0)


def test_int4_candidate_and_saved_baseline(pair, tmp_path):
    base, cand = pair
    r = kld(base, cand, tokens=300, chunk=64, save_baseline=tmp_path / "b.st", out=tmp_path / "r.json")
    assert 0 < r.kld_mean < 1 and r.kld_median <= r.kld_p99 <= r.kld_p999 <= r.kld_max
    assert 0 < r.top1_agreement < 1 and r.tokens == 300
    doc = json.loads((tmp_path / "r.json").read_text())
    for k in ("kld_mean", "kld_p99", "top1_agreement", "ppl_baseline", "ppl_candidate"):
        assert k in doc
    r2 = kld(None, cand, tokens=300, chunk=64, baseline_logits=tmp_path / "b.st")
    assert r2.kld_mean == pytest.approx(r.kld_mean, rel=1e-2)  # fp16-stored baseline log-probs (0.25% on a KLD of 0.002)
    assert r2.top1_agreement == pytest.approx(r.top1_agreement, abs=0.01)
    with pytest.raises(QuantizeError, match="another text"):
        kld(None, cand, tokens=200, chunk=64, baseline_logits=tmp_path / "b.st")


def test_different_tokenizers_refused(pair, tiny, tmp_path):
    base, cand = pair
    other = tmp_path / "other"
    shutil.copytree(cand, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "the", "of"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(QuantizeError, match="tokenizer differs"):
        kld(base, other, tokens=100)
