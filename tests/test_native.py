"""The C kernels equal the torch reference (itself tested against compressed-tensors) bit for bit,
directly and through the whole convert pipeline; every way the build can fail falls back to the
torch path with one warning and the same output."""

import os
import shlex
import shutil
import tempfile
import time
import warnings

import pytest
import torch

from quantize.convert import convert
from quantize.formats import fp8, int4, native

from .conftest import dir_bytes, load_dir

needs_native = pytest.mark.skipif(native.lib() is None, reason=f"native kernels unavailable: {native.why_unavailable()}")
HAS_CC = bool(shutil.which("cc") or shutil.which("gcc"))
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler")


@needs_native
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", [(256, 384), (576, 256), (130, 512)])
def test_fp8_block_minmax_bit_identical(shape, group):
    g = torch.Generator().manual_seed(shape[0] + group)
    w = torch.randn(shape, generator=g) * 0.03
    w[5, :group] = 0  # an all-zero group
    q, s = fp8.quant_block(w)
    ref = int4.quantize_pack(fp8.dequant_block(q, s), group)
    packed, scale, (se, sr, me), bad = native.quant_rows(q, s, "block", group, "minmax")
    assert not bad
    assert torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)
    assert se == pytest.approx(ref.sq_err, rel=1e-6) and sr == pytest.approx(ref.sq_ref, rel=1e-6)
    assert me == ref.max_abs_err


@needs_native
def test_ue8m0_exponent_scales_decoded_as_powers_of_two():
    """Block FP8 with UE8M0 scales stored as uint8 exponent bytes (2**(b-127)): the native kernels
    decode them as the torch path does (they read the byte as a number before: a byte of 125 gave
    weights 125 / 0.25 = 500 times too large)."""
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(256, 256, generator=g) * 0.3).to(torch.float8_e4m3fn)
    s = torch.tensor([[125, 127], [126, 130]], dtype=torch.uint8)  # 0.25, 1, 0.5, 8
    want = fp8.dequant_block(q, s)
    assert float(fp8.scale_as_float(s)[0, 0]) == 0.25
    out, bad = native.dequant_rows(q, s, "block", (128, 128))
    assert not bad and torch.equal(out, want)
    ref = int4.quantize_pack(want, 32)
    packed, scale, _, bad = native.quant_rows(q, s, "block", 32, "minmax")
    assert not bad and torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float_sources_bit_identical(dtype):
    w = (torch.randn(64, 512, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype)
    ref = int4.quantize_pack(w, 32)
    packed, scale, _, _ = native.quant_rows(w, None, None, 32, "minmax")
    assert torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)


@needs_native
def test_channel_fp8_and_dequant_bit_identical():
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    s = (w.abs().amax(1, keepdim=True) / 448).float()
    q = (w / s).to(torch.float8_e4m3fn)
    ref = int4.quantize_pack(fp8.dequant_channel(q, s), 64)
    packed, scale, _, _ = native.quant_rows(q, s, "channel", 64, "minmax")
    assert torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)
    qb, sb = fp8.quant_block(w)
    out, bad = native.dequant_rows(qb, sb, "block")
    assert torch.equal(out, fp8.dequant_block(qb, sb)) and not bad
    out, _ = native.dequant_rows(q, s, "channel")
    assert torch.equal(out, fp8.dequant_channel(q, s))


def test_mse_near_tie_converts_to_what_check_rederives(tiny, tmp_path):
    """--observer mse searches each group's clipping on the torch path, the one `check --source`
    re-derives RTN scales with. quant.c's own search (gone) summed the candidates' errors in another
    order and at a near-tie kept the neighbouring shrink (1 group in about 230,000), which check then
    refused as not what the source implies. Here one routed expert holds such a group: its best two
    shrinks (0.88, 0.89) are 2.9e-8 apart in a float64 count, under float32's resolution. Its scales
    are the reference's bit for bit and check proves every tensor."""
    from quantize.check import check

    from .test_check_verify import _edit

    src = tmp_path / "src"
    shutil.copytree(tiny("glm_moe_dsa"), src)
    g = torch.Generator().manual_seed(393)
    w = (torch.randn(256, 256, generator=g) * 0.05).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, generator=g) * 0.01 + 0.001
    name = "model.layers.1.mlp.experts.0.gate_proj"

    def put(t):
        assert t[name + ".weight"].shape == w.shape and t[name + ".weight_scale_inv"].shape == s.shape
        t[name + ".weight"], t[name + ".weight_scale_inv"] = w, s

    _edit(src, name + ".weight", put)

    rows = fp8.dequant_block(w, s)
    grp = rows[242, :32].double()  # the witness, counted apart from int4.py: every shrink's error in float64
    errs = []
    for i in range(21):
        sc = (torch.tensor(float(grp.abs().max()) * (1 - i / 100)).to(torch.bfloat16).float() / 7.5)
        sc = sc.to(torch.bfloat16).double()
        q = ((grp.float() / sc.float()).to(torch.bfloat16).float().clamp(-8, 7).round().double())
        errs.append(float(((q * sc - grp).abs() ** 2.4).sum()))
    best = sorted(range(21), key=errs.__getitem__)[:2]
    assert sorted(best) == [11, 12] and abs(errs[11] - errs[12]) / min(errs[11], errs[12]) < 1e-7

    out = tmp_path / "out"
    convert(src, out, observer="mse", group_size=32)
    want = int4.quantize_pack(rows, 32, "mse").scale
    assert torch.equal(load_dir(out)[name + ".weight_scale"], want)
    rep = check(out, source=src)
    assert rep.ok, rep.failures
    assert "mse" not in native.OBSERVERS and native.quant_rows(w, s, "block", 32, "fullrange")[0].shape == (256, 32)
    with pytest.raises(KeyError):  # quant.c has no mse search to fall into
        native.quant_rows(w, s, "block", 32, "mse")


@needs_native
@pytest.mark.parametrize("source", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("shape,group", [((256, 384), 32), ((130, 512), 64), ((64, 1024), 128)])
def test_fullrange_and_stored_tensor_errors_equal_the_reference(shape, group, source):
    """quant.c's fullrange grid (the signed extreme on code -8) gives int4.quantize_pack's codes and
    scales bit for bit, ties and all-zero groups included; its error_rows gives int4.error_sums of the
    decoded rows for a stored tensor (here GPTQ-like: fullrange codes with some nibbles moved): the
    same max exactly, the sums to 1e-12 (another order of addition), and a moved nibble is seen."""
    g = torch.Generator().manual_seed(shape[0] + group)
    w = torch.randn(shape, generator=g) * 0.03
    w[5, :group] = 0  # an all-zero group
    w[6, :group] = 0.25
    w[6, 7] = -0.25  # a tie of magnitudes: the first (positive) one is the extreme
    if source == "fp8":
        q, s = fp8.quant_block(w)
        rows, args = fp8.dequant_block(q, s), (q, s, "block")
    else:
        x = w.to(torch.bfloat16 if source == "bf16" else torch.float32)
        rows, args = x, (x, None, None)
    ref = int4.quantize_pack(rows, group, "fullrange")
    assert ref.scale[6, 0] < 0  # the positive extreme put on code -8
    packed, scale, _, bad = native.quant_rows(*args, group, "fullrange")
    assert not bad and torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)
    stored = ref.packed.clone()
    stored.view(torch.uint8)[::3, ::5] ^= 0x11
    want = int4.error_sums(rows, stored, ref.scale)
    (se, sr, me), bad = native.error_rows(*args, stored, ref.scale)
    assert not bad and me == want[2]
    assert se == pytest.approx(want[0], rel=1e-12) and sr == pytest.approx(want[1], rel=1e-12)
    (se0, _, _), _ = native.error_rows(*args, ref.packed, ref.scale)  # the near miss: the codes as made
    assert se0 == pytest.approx(int4.error_sums(rows, ref.packed, ref.scale)[0], rel=1e-12) and se0 < se


@needs_native
def test_nan_detected():
    q, s = fp8.quant_block(torch.randn(128, 128))
    q.view(torch.uint8)[3, 3] = 0x7F
    assert native.quant_rows(q, s, "block", 32, "minmax")[3]
    assert native.dequant_rows(q, s, "block")[1]
    r = int4.quantize_pack(torch.randn(128, 128), 32)
    assert native.error_rows(q, s, "block", r.packed, r.scale)[1]


@needs_native
@pytest.mark.parametrize("shape,block", [((300, 333), (128, 128)), ((17, 1000), (64, 32)), ((5, 7), (128, 128))])
def test_dequant_rows_block_edges_and_one_scale(shape, block):
    """``dequant_rows`` takes one scale per run of a row's columns: ragged last blocks in both
    directions, blocks other than 128, a per-channel and a single scale, every FP8 code, each against
    the torch reference bit for bit."""
    R, K = shape
    g = torch.Generator().manual_seed(R * K)
    w = (torch.arange(R * K) % 256).to(torch.uint8)  # every code, NaN (0x7F, 0xFF) taken out below
    w[(w & 0x7F) == 0x7F] = 0x3A
    w = w[torch.randperm(R * K, generator=g)].view(R, K).view(torch.float8_e4m3fn)
    s = torch.rand(fp8.block_grid((R, K), block), generator=g) * 2 + 1e-3
    out, bad = native.dequant_rows(w, s, "block", block)
    assert not bad and torch.equal(out, fp8.dequant_block(w, s, block))
    shifted, _ = native.dequant_rows(w, s.roll(1, 1), "block", block)  # near miss: scales a block off
    assert K <= block[1] or not torch.equal(shifted, out)
    for sc in (torch.rand(R, 1, generator=g) + 0.1, torch.tensor([0.37])):
        out, bad = native.dequant_rows(w, sc, "channel")
        assert not bad and torch.equal(out, fp8.dequant_channel(w, sc))


@needs_native
def test_dequant_rows_flags_overflow_not_the_largest_finite():
    """A finite code times its scale that overflows fp32 is flagged like a NaN code (the job then
    refuses the tensor); the largest finite product is not."""
    w = torch.tensor([[448.0] * 8], dtype=torch.float8_e4m3fn)  # the largest e4m3 code
    top = torch.tensor([[3.4028234e38 / 448]])  # 448 x this stays finite in fp32
    out, bad = native.dequant_rows(w, top, "block")
    assert not bad and torch.equal(out, fp8.dequant_block(w, top))
    out, bad = native.dequant_rows(w, top * 1.01, "block")
    assert bad and torch.isinf(fp8.dequant_block(w, top * 1.01, dtype=torch.float32)).all()


@needs_native
def test_pipeline_identical_without_native(tiny, tmp_path, monkeypatch):
    src = tiny("glm_moe_dsa")
    convert(src, tmp_path / "native")
    monkeypatch.setenv("QUANTIZE_NATIVE", "0")
    assert native.lib() is None
    convert(src, tmp_path / "torch")
    a, b = dir_bytes(tmp_path / "native"), dir_bytes(tmp_path / "torch")
    a.pop("quantize_manifest.json"), b.pop("quantize_manifest.json")
    assert a == b


@needs_native
def test_every_fp8_code_decodes_exactly():
    """All 256 e4m3 codes (subnormals, zeros, NaN) through both kernels."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    w = finite.repeat(1, 2)[:, :256].contiguous().view(torch.float8_e4m3fn)  # [1, 256]
    w = w.repeat(128, 1).contiguous()
    s = torch.full((1, 2), 0.5)
    out, bad = native.dequant_rows(w, s, "block")
    assert not bad and torch.equal(out, fp8.dequant_block(w, s))
    for group in (32, 128):
        ref = int4.quantize_pack(fp8.dequant_block(w, s), group)
        packed, scale, _, bad = native.quant_rows(w, s, "block", group, "minmax")
        assert not bad and torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)
    nan = torch.full((128, 128), 0xFF, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert native.dequant_rows(nan, torch.ones(1, 1), "block")[1]


# ---- the build never crashes: each failure falls back to the torch path, once, visibly ----


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """tiny("glm_moe_dsa") converted with the default build (the native path where a compiler exists)."""
    native._reset()
    out = tmp_path_factory.mktemp("ref") / "out"
    convert(tiny("glm_moe_dsa"), out)
    return out


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A clean build attempt: no CC override, an empty cache, the module's memo forgotten."""
    for var in ("CC", "QUANTIZE_NATIVE", "QUANTIZE_CC_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("QUANTIZE_CACHE", str(tmp_path / "cache"))
    native._reset()
    yield monkeypatch
    native._reset()  # later tests build again under the restored environment


def _script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _same_output(tiny, reference, out):
    convert(tiny("glm_moe_dsa"), out)
    a, b = dir_bytes(reference), dir_bytes(out)
    a.pop("quantize_manifest.json"), b.pop("quantize_manifest.json")
    assert a == b


def _falls_back(tiny, reference, out, reason: str) -> dict:
    """status() says torch with `reason`, exactly one RuntimeWarning is raised however often the kernels
    are asked for, and a conversion is still bit-identical to the reference."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        st = native.status()
        assert native.lib() is None and native.status() == st
        _same_output(tiny, reference, out)
    assert st["path"] == "torch" and st["library"] is None
    assert reason in st["reason"], st["reason"]
    assert native.why_unavailable() == st["reason"]
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert msgs == [f"quantize: native kernels unavailable ({st['reason']}); using the torch path (same output, slower)"]
    return st


def test_cc_not_found_falls_back(fresh, tiny, reference, tmp_path):
    fresh.setenv("CC", "ccache-that-does-not-exist gcc")
    _falls_back(tiny, reference, tmp_path / "out", "'ccache-that-does-not-exist' from CC='ccache-that-does-not-exist gcc' not found")


def test_cc_timeout_falls_back(fresh, tiny, reference, tmp_path):
    """A hanging compiler (and its children) is killed after QUANTIZE_CC_TIMEOUT s; no second attempt."""
    fresh.setenv("CC", _script(tmp_path / "hang", "echo started >> \"$0.log\"\nsleep 60\n"))
    fresh.setenv("QUANTIZE_CC_TIMEOUT", "1")
    t0 = time.monotonic()
    _falls_back(tiny, reference, tmp_path / "out", "timed out after 1 s")
    assert time.monotonic() - t0 < 15  # the sleeping child was killed too (it holds the pipes)
    assert (tmp_path / "hang.log").read_text() == "started\n"


def test_cc_failure_falls_back_with_stderr(fresh, tiny, reference, tmp_path):
    fresh.setenv("CC", _script(tmp_path / "bad", "echo 'noise' >&2\necho 'cc1: fatal error: simulated failure' >&2\nexit 1\n"))
    _falls_back(tiny, reference, tmp_path / "out", "C compile failed: cc1: fatal error: simulated failure")
    assert not list((tmp_path / "cache").glob("*.so*"))  # no half-written files left


def test_unloadable_library_falls_back(fresh, tiny, reference, tmp_path):
    """A "compiler" that exits 0 but writes garbage: the .so does not load."""
    body = 'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo garbage > "$2"; shift; done\nexit 0\n'
    fresh.setenv("CC", _script(tmp_path / "junk", body))
    _falls_back(tiny, reference, tmp_path / "out", "cannot load")


def test_no_cache_and_no_temp_folder_falls_back(fresh, tiny, reference, tmp_path):
    """The cache cannot be created (its parent is a regular file: true even for root) nor a temp folder."""
    (tmp_path / "afile").write_text("")
    fresh.setenv("QUANTIZE_CACHE", str(tmp_path / "afile" / "cache"))
    fresh.setattr(tempfile, "tempdir", str(tmp_path / "afile" / "tmp"))
    fresh.setenv("CC", _script(tmp_path / "cc", "exit 1\n"))  # found, never reached
    _falls_back(tiny, reference, tmp_path / "out", f"cache folder {tmp_path / 'afile' / 'cache'} is not writable")


@needs_cc
def test_unwritable_cache_builds_in_temp_folder(fresh, tiny, reference, tmp_path):
    (tmp_path / "afile").write_text("")
    fresh.setenv("QUANTIZE_CACHE", str(tmp_path / "afile" / "cache"))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        st = native.status()
    assert st["path"] == "native" and st["reason"] is None, st
    assert os.path.isfile(st["library"]) and not st["library"].startswith(str(tmp_path / "afile"))
    assert not [w for w in rec if issubclass(w.category, RuntimeWarning)]
    _same_output(tiny, reference, tmp_path / "out")


@needs_cc
def test_cc_with_arguments(fresh, tiny, reference, tmp_path):
    """CC is a word list (CC="ccache gcc"): with ccache if installed, else a wrapper taking the compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if shutil.which("ccache"):
        fresh.setenv("CCACHE_DIR", str(tmp_path / "ccache"))
        argv = ["ccache", cc]
    else:
        argv = [_script(tmp_path / "wrap", 'echo "$@" > "$0.log"\nexec "$@"\n'), cc]
    fresh.setenv("CC", shlex.join(argv))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        st = native.status()
    assert st == {"path": "native", "reason": None, "compiler": argv, "library": st["library"]}
    assert st["library"].startswith(str(tmp_path / "cache"))
    assert not [w for w in rec if issubclass(w.category, RuntimeWarning)]
    if argv[0].endswith("wrap"):
        assert (tmp_path / "wrap.log").read_text().startswith(cc + " ")
    w = (torch.randn(64, 512, generator=torch.Generator().manual_seed(4)) * 0.05).to(torch.bfloat16)
    ref = int4.quantize_pack(w, 32)
    packed, scale, _, _ = native.quant_rows(w, None, None, 32, "minmax")
    assert torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale)
    _same_output(tiny, reference, tmp_path / "out")


def test_disabled_is_silent(fresh):
    fresh.setenv("QUANTIZE_NATIVE", "0")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert native.status() == {"path": "torch", "reason": "disabled by QUANTIZE_NATIVE=0", "compiler": None, "library": None}
        assert native.lib() is None
    assert not rec


def test_native_active_where_compiler_exists(fresh):
    """The CI assertion: where a C compiler exists, conversions run the native kernels (a real build
    into an empty cache, honouring the environment's CC)."""
    if not HAS_CC or os.environ.get("QUANTIZE_NATIVE") == "0":
        pytest.skip("no C compiler, or QUANTIZE_NATIVE=0")
    if "CC" in os.environ:  # keep the CI's own compiler choice
        fresh.setenv("CC", os.environ["CC"])
    st = native.status()
    assert st["path"] == "native", st
    assert st["compiler"] and os.path.isfile(st["library"])


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


@needs_cc
@pytest.mark.parametrize("extra, lanes", [(["-mno-avx512f"], 1), (["-mavx512f", "-mavx512bw"], 16)])
def test_both_forms_of_the_native_passes_are_bit_identical(fresh, extra, lanes):
    """quant.c's minmax pass, fullrange codes and error_rows have a 16-lane AVX-512 form and a scalar
    one (the vector form was slower built for AVX2); each is built here on purpose (CC with the flag
    after it; the build's own -march=native does not undo an explicit -mno-...) and checked against
    the torch reference: FP8 blocks with an all-zero group and a tie of magnitudes, groups 32 and
    128, rows not a multiple of 16; the stored tensor's errors to 1e-12, the max exactly."""
    if lanes == 16 and not {"avx512f", "avx512bw"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX-512 (F and BW): the vector form cannot run here")
    cc = shutil.which("gcc") or shutil.which("cc")
    fresh.setenv("CC", shlex.join([cc, *extra]))
    assert native.status()["path"] == "native", native.status()
    assert native.lib().minmax_lanes() == lanes
    g = torch.Generator().manual_seed(11)
    w = torch.randn(200, 512, generator=g) * 0.03
    w[7, :128] = 0
    w[9, :32] = 0.25
    w[9, 7] = -0.25  # fullrange: a tie of magnitudes, the first (positive) one is the extreme
    q, s = fp8.quant_block(w)
    for group in (32, 128):
        for observer in ("minmax", "fullrange"):
            ref = int4.quantize_pack(fp8.dequant_block(q, s), group, observer)
            packed, scale, (se, sr, me), bad = native.quant_rows(q, s, "block", group, observer)
            assert not bad and torch.equal(packed, ref.packed) and torch.equal(scale, ref.scale), observer
            assert me == ref.max_abs_err and se == pytest.approx(ref.sq_err, rel=1e-6)
            assert sr == pytest.approx(ref.sq_ref, rel=1e-6)
        assert ref.scale[9, 0] < 0  # the positive extreme on code -8
        # error_rows (the same AVX-512 / scalar split) on a stored tensor with some nibbles moved
        stored = ref.packed.clone()
        stored.view(torch.uint8)[::3, ::5] ^= 0x11
        want = int4.error_sums(fp8.dequant_block(q, s), stored, ref.scale)
        (se, sr, me), bad = native.error_rows(q, s, "block", stored, ref.scale)
        assert not bad and me == want[2]
        assert se == pytest.approx(want[0], rel=1e-12) and sr == pytest.approx(want[1], rel=1e-12)
