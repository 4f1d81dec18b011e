"""quantize eval-kld: next-token KL divergence, bounded memory, reusable baseline logits."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.evaluate.kld import kld


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    base = tiny("llama", layout="bf16")
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
    with pytest.raises(QuantizeError, match=r"saved for --tokens 300 \(this run: 200\)"):
        kld(None, cand, tokens=200, chunk=64, baseline_logits=tmp_path / "b.st")
    assert doc["written_by"]["kind"] == "kld"  # a signed report: a rerun may replace it
    r3 = kld(base, cand, tokens=300, chunk=64, baseline_logits=tmp_path / "b.st", out=tmp_path / "r.json")
    assert r3.kld_mean == pytest.approx(r2.kld_mean)  # the same baseline named beside its file: its identity matches


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_device_without_gpu_refused_in_one_line(pair, tmp_path):
    """`quantize eval-kld --device cuda` reaches kld (it used to be dropped, the models ran on the
    CPU) and, with no GPU, is refused in one line before anything loads."""
    base, cand = pair
    with pytest.raises(QuantizeError, match=r"^--device cuda: no CUDA GPU is visible here; use --device cpu$"):
        kld(base, cand, tokens=50, device="cuda")
    with pytest.raises(QuantizeError, match=r"^--device cuda:1: no CUDA GPU"):
        kld(base, cand, tokens=50, device="cuda:1")
    with pytest.raises(QuantizeError, match=r"^--device tpu: unknown; use cpu, cuda or cuda:N$"):
        kld(base, cand, tokens=50, device="tpu")
    p = subprocess.run([sys.executable, "-m", "quantize.cli", "eval-kld", "--baseline", str(base), "--candidate", str(cand),
                        "--tokens", "50", "--chunk", "32", "--device", "cuda"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == "error: --device cuda: no CUDA GPU is visible here; use --device cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kld_on_gpu_equals_cpu(pair, tmp_path):
    base, cand = pair
    cpu = kld(base, cand, tokens=300, chunk=64)
    gpu = kld(base, cand, tokens=300, chunk=64, device="cuda", save_baseline=tmp_path / "b.st")
    assert gpu.tokens == cpu.tokens == 300
    assert gpu.kld_mean == pytest.approx(cpu.kld_mean, rel=1e-3) and gpu.top1_agreement == pytest.approx(cpu.top1_agreement, abs=0.01)
    assert gpu.ppl_candidate == pytest.approx(cpu.ppl_candidate, rel=1e-4)
    reused = kld(None, cand, tokens=300, chunk=64, device="cuda", baseline_logits=tmp_path / "b.st")
    assert reused.kld_mean == pytest.approx(cpu.kld_mean, rel=1e-2)
