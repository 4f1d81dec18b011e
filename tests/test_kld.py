"""quantize eval-kld: next-token KL divergence, bounded memory, reusable baseline logits."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.evaluate.kld import DEFAULT_TEXT, kld


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


def _sharpened(base, folder, k: float):
    """``base`` with its final norm's weight x ``k``: every logit x ``k`` exactly (a power of two), so the
    candidate's next-token distribution is the baseline's at temperature 1 / k, top-1 unchanged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(base, folder)
    hits = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            t, meta = {n: fh.get_tensor(n) for n in fh.keys()}, fh.metadata()
        if "model.norm.weight" in t:
            t["model.norm.weight"] = t["model.norm.weight"] * k
            save_file(t, str(f), metadata=meta)
            hits += 1
    assert hits == 1
    from .lineage import made_from

    return made_from(folder, base)  # made here from the baseline (eval-kld compares only such a candidate)


def test_kl_is_baseline_to_candidate_over_the_full_vocabulary(pair, tmp_path):
    """The oracle: both models' full log-softmax from transformers, the chunks cut here, and per token
    KL(base || cand) = sum p_base (log p_base - log p_cand) and the reverse, both computed here. For the
    INT4 candidate the two directions agree to 3e-4 (a small perturbation is symmetric to second order),
    for a sharpened candidate (logits x 8) they differ by a quarter: the report is the forward one."""
    import transformers

    base, int4 = pair
    sharp = _sharpened(base, tmp_path / "sharp", 8.0)
    tokens, chunk = 120, 64  # two chunks: ids[0:65] and ids[64:121], each predicting all but its first token
    ids = transformers.AutoTokenizer.from_pretrained(base)(DEFAULT_TEXT.read_text(encoding="utf-8"))["input_ids"]
    ids = ids[: tokens + 1]
    mb = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for cand in (int4, sharp):
        mc = transformers.AutoModelForCausalLM.from_pretrained(cand, dtype=torch.float32).eval()
        fwd, rev, nll_b, nll_c, agree = [], [], 0.0, 0.0, 0
        for start in range(0, tokens, chunk):
            seg = torch.tensor(ids[start: start + chunk + 1])
            with torch.no_grad():
                lb = mb(input_ids=seg[None, :-1]).logits[0].float().log_softmax(-1).double()
                lc = mc(input_ids=seg[None, :-1]).logits[0].float().log_softmax(-1).double()
            assert lb.shape == (seg.numel() - 1, mb.config.vocab_size)
            fwd.append((lb.exp() * (lb - lc)).sum(-1))
            rev.append((lc.exp() * (lc - lb)).sum(-1))
            nxt = seg[1:, None]
            nll_b -= float(lb.gather(-1, nxt).sum())
            nll_c -= float(lc.gather(-1, nxt).sum())
            agree += int((lb.argmax(-1) == lc.argmax(-1)).sum())
        fwd, rev = torch.cat(fwd), torch.cat(rev)
        assert fwd.numel() == rev.numel() == tokens
        s = fwd.sort().values
        r = kld(base, cand, tokens=tokens, chunk=chunk)
        assert r.tokens == tokens
        assert r.kld_mean == pytest.approx(float(fwd.mean()), rel=1e-6)
        assert r.kld_max == pytest.approx(float(s[-1]), rel=1e-6)
        assert r.kld_median == pytest.approx(float(s[59] + s[60]) / 2, rel=1e-6)  # 120 values: the middle two
        assert r.kld_p99 == pytest.approx(float(torch.quantile(fwd, 0.99)), rel=1e-6)
        assert r.top1_agreement == agree / tokens
        assert r.ppl_baseline == pytest.approx(math.exp(nll_b / tokens), rel=1e-6)
        assert r.ppl_candidate == pytest.approx(math.exp(nll_c / tokens), rel=1e-6)
        # and not the reverse direction: at a tolerance tighter than the gap between the two
        assert abs(r.kld_mean - float(rev.mean())) > 100 * abs(r.kld_mean - float(fwd.mean()))
        assert r.kld_max != pytest.approx(float(rev.max()), rel=1e-6)
    # the sharpened candidate: the directions differ materially, its top-1 is the baseline's
    assert float(fwd.mean()) > 1.2 * float(rev.mean()) > 0.5
    assert r.top1_agreement == 1.0


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
