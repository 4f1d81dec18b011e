"""``quantize check`` of SGLang's native w4afp8 layout (``convert --scheme w4afp8 --engine sglang``).

The layout, field by field against what SGLang 0.5.23 reads (docs/engines.md#w4afp8, route A): the
config's ``quant_method``; each routed expert projection as int8 nibble pairs ``[out, in/2]``, fp32
``weight_scale_inv`` ``[out, in/128]`` and a positive fp32 ``input_scale`` ``[1]`` (gate's = up's);
every Linear SGLang builds through Fp8LinearMethod as e4m3 with an fp32 128x128 ``weight_scale_inv``;
nothing else quantized. Per expert: its nibbles decoded here against compressed-tensors'
``unpack_from_int32`` of the same codes (an independent decoder), and the reference W4A8 product
(the input through e4m3 at the layer's static scale, the one SGLang computes with) against the
W4A16 one. With ``--source``: every tensor re-derived from the source (round-to-nearest codes and
scales, FP8 blocks, copies) and compared bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from . import archs
from .archs.base import EXPERT_ROLES, ROLES
from .checkpoint.config import ModelConfig
from .checkpoint.index import CheckpointIndex
from .checkpoint.reader import WeightReader
from .errors import CheckFailed
from .events import Emit, null_emit
from .formats import fp8, int4 as int4_fmt, w4afp8 as W
from .formats.layout import DEFAULT_BLOCK, block_grid
from .kernels.reference import w4a16_reference

# W4AFP8: FP8 e4m3 activations cost a relative L2 error of about 2.5 % on Gaussian inputs (3 mantissa bits: a
# uniform rounding error of at most 2^-4 relative, about 2^-4 / sqrt(3) r.m.s.); 5 % is twice that
W4A8_RTOL = 5e-2


def w4a8_row(row, y8: torch.Tensor, ref: torch.Tensor, how: str) -> None:
    """The W4A8 product ``y8`` against the W4A16 one ``ref`` (relative L2) into ``row`` (``check.Row``),
    a failure past W4A8_RTOL naming ``how`` the activations were quantized."""
    row.w4a8_rel_err = float((y8 - ref).norm() / ref.norm().clamp_min(1e-30))
    if not row.w4a8_rel_err <= W4A8_RTOL:
        row.failures.append(f"{row.tensor}: the W4A8 product ({how}) differs from the W4A16 one by "
                            f"{row.w4a8_rel_err:.3g} > {W4A8_RTOL}")


def is_native(index: CheckpointIndex) -> bool:
    qc = ModelConfig.from_dict(index.config, "config.json").quantization_config or {}
    return qc.get("quant_method") == "w4afp8"


def _roles(index: CheckpointIndex, where: Path) -> tuple[object, dict[str, str]]:
    arch = archs.resolve(index.config, str(where / "config.json"))
    return arch, {n: arch.role_of(n)[0] for n in index.tensors}


def verify_layout(model: Path, index: CheckpointIndex) -> list[str]:
    """The layout against SGLang's loader facts; CheckFailed naming the first tensor that breaks one.
    -> the routed expert modules."""
    from .plan import SGLANG_FP8_ROLES

    t, (_, roles) = index.tensors, _roles(index, model)
    experts = sorted({n[: -len(".weight")] for n in t if n.endswith(".weight") and roles[n] in EXPERT_ROLES})
    if not experts:
        raise CheckFailed(f"{model}: quant_method w4afp8 but no routed expert weights; convert again")
    for n in t:
        if n.endswith((".weight_packed", ".weight_shape", ".weight_scale")):
            raise CheckFailed(f"{model}: {n} is a compressed-tensors tensor, which SGLang's w4afp8 does not read; "
                              "convert again with one --engine")
    for e in experts:
        w, s, a = t[e + ".weight"], t.get(e + ".weight_scale_inv"), t.get(e + ".input_scale")
        if w.dtype != "I8" or len(w.shape) != 2:
            raise CheckFailed(f"{model}: {e}.weight is {w.dtype} {list(w.shape)}; SGLang's CUTLASS W4A8 MoE takes int8 "
                              "nibble pairs [out, in/2]; convert again")
        o, k = w.shape[0], 2 * w.shape[1]
        if s is None or s.dtype != "F32" or tuple(s.shape) != (o, k // W.GROUP) or k % W.GROUP:
            got = "missing" if s is None else f"{s.dtype} {list(s.shape)}"
            raise CheckFailed(f"{model}: {e}.weight_scale_inv is {got}; SGLang reads fp32 [{o}, {k // W.GROUP}] "
                              f"(group {W.GROUP}, not transposed); convert again")
        if a is None or a.dtype != "F32" or tuple(a.shape) not in ((1,), ()):
            got = "missing" if a is None else f"{a.dtype} {list(a.shape)}"
            raise CheckFailed(f"{model}: {e}.input_scale is {got}; SGLang reads a static fp32 [1] per expert and "
                              "silently uses 1.0 where it is missing; convert again")
    for n, ref in t.items():
        base, _, part = n.rpartition(".")
        if part != "weight" or len(ref.shape) != 2 or not ROLES[roles[n]][0] or roles[n] in EXPERT_ROLES:
            continue
        sc = t.get(base + ".weight_scale_inv")
        if roles[n] in SGLANG_FP8_ROLES:
            if ref.dtype != "F8_E4M3" or sc is None or sc.dtype not in ("F32", "BF16") or \
                    tuple(sc.shape) != block_grid(tuple(ref.shape), DEFAULT_BLOCK):
                raise CheckFailed(f"{model}: {n} is {ref.dtype} (scale {None if sc is None else list(sc.shape)}); "
                                  "SGLang's w4afp8 serves it through Fp8LinearMethod, which needs e4m3 with a 128x128 "
                                  "weight_scale_inv (a BF16 weight would be cast to e4m3 with no error); convert again")
        elif ref.dtype in ("F8_E4M3", "I8"):
            raise CheckFailed(f"{model}: {n} is {ref.dtype}, but SGLang builds {roles[n]} unquantized; convert again")
    return experts


def _layer_scales(model: Path, index: CheckpointIndex, experts: list[str]) -> dict[str, tuple[float, float]]:
    """Per expert module: (its input scale, the largest of its layer and GEMM: what SGLang uses), and
    gate's = up's checked."""
    from .checkpoint.index import read_tensor

    own = {e: float(read_tensor(model, index.tensors[e + ".input_scale"]).float().reshape(-1)[0]) for e in experts}
    for e, v in own.items():
        if not (math.isfinite(v) and v > 0):
            raise CheckFailed(f"{model}: {e}.input_scale is {v}; a static FP8 scale must be positive and finite; "
                              "convert again")
        if e.endswith(".gate_proj") and own.get(e[: -len("gate_proj")] + "up_proj") != v:
            raise CheckFailed(f"{model}: {e}.input_scale {v} differs from its up_proj's "
                              f"{own.get(e[: -len('gate_proj')] + 'up_proj')}; SGLang refuses unequal w1 / w3 "
                              "input scales (ValueError at load); convert again")
    top: dict[tuple[str, bool], float] = {}
    for e, v in own.items():
        key = (e.split(".experts.")[0], e.endswith("down_proj"))
        top[key] = max(top.get(key, 0.0), v)
    return {e: (v, top[(e.split(".experts.")[0], e.endswith("down_proj"))]) for e, v in own.items()}


def check_experts(model: Path, index: CheckpointIndex, experts: list[str], tokens: int, seed: int,
                  make_row, emit: Emit = null_emit) -> list:
    """Per expert module: a Row (``check.Row``) with the decode against compressed-tensors' and the
    static-scale W4A8 product against the W4A16 one."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from .checkpoint.index import read_tensor

    scales = _layer_scales(model, index, experts)
    _, roles = _roles(index, model)
    g = torch.Generator().manual_seed(seed)
    rows = []
    emit({"event": "start", "stage": "check", "total_bytes": len(experts), "done_bytes": 0, "unit": "modules"})
    for i, e in enumerate(experts):
        w = read_tensor(model, index.tensors[e + ".weight"])
        s = read_tensor(model, index.tensors[e + ".weight_scale_inv"])
        row = make_row(e, roles[e + ".weight"])
        shape = (w.shape[0], 2 * w.shape[1])
        codes = W.unpack(w)
        row.unpack_ok = bool(torch.equal(codes, unpack_from_int32(W.to_packed(w), 4, torch.Size(shape)).to(torch.int8)))
        if not row.unpack_ok:
            row.failures.append(f"{e}: the nibble decode differs from compressed-tensors' unpack_from_int32")
        packed = W.to_packed(w)
        a = scales[e][1]  # the static scale SGLang computes with: the layer's largest
        x = torch.randn(tokens, shape[1], generator=g)
        x = (x * (0.9 * W.FP8_MAX * a / x.abs().max())).to(torch.bfloat16)  # within the calibrated range
        ref = w4a16_reference(x, packed, s, shape)
        w4a8_row(row, w4a16_reference(W.fake_fp8_static(x.float(), a), packed, s, shape), ref,
                 f"FP8 at the static input scale {a:g}")
        rows.append(row)
        emit({"event": "tensor", "name": e, "done_bytes": i + 1})
    return rows


def verify_against_source(out: CheckpointIndex, src: CheckpointIndex, options: dict, rows: dict,
                          max_source_rel_err: float) -> tuple[list[str], int]:
    """Every output tensor re-derived from the source and compared bit for bit: round-to-nearest codes
    (their bytes) and scales, g128 INT4 codes passed through, FP8 blocks (kept, or made from BF16),
    copies. -> (failures, tensors proven)."""
    from .plan import SGLANG_FP8_ROLES

    o, s = WeightReader(out), WeightReader(src)
    _, roles = _roles(out, out.folder)
    observer = options.get("observer") or "minmax"
    failures: list[str] = []
    proven = 0
    accounted: set[str] = set()
    try:
        for name, ref in out.tensors.items():
            base, _, part = name.rpartition(".")
            if part != "weight" or name not in roles:
                continue  # scales go with their weight; copies (norms, biases...) are compared below
            where = f"{out.folder}: tensor {name}"
            role = roles[name]
            if role in EXPERT_ROLES and ref.dtype == "I8":
                accounted.update(base + p for p in (".weight", ".weight_scale_inv", ".input_scale"))
                got_w, got_s = o.raw(name), o.raw(base + ".weight_scale_inv")
                if base + ".weight_packed" in src.tensors and not options.get("requantize"):  # passed through
                    want_w = W.from_packed(s.raw(base + ".weight_packed"))
                    want_s = s.raw(base + ".weight_scale").float()
                else:
                    fp8src = s.scheme(name).startswith("fp8")
                    if s.scheme(name) == "int4":  # --requantize: code x scale, exact in fp32
                        w = s.weight(name, torch.float32)
                        sdt = src.tensors[base + ".weight_scale"].torch_dtype
                    else:
                        w = s.weight(name, torch.bfloat16 if fp8src else src.tensors[name].torch_dtype)
                        sdt = torch.bfloat16 if fp8src or w.dtype == torch.bfloat16 else w.dtype
                    exp = int4_fmt.quantize_pack_rows(w, W.GROUP, observer, sdt)
                    want_w, want_s = W.from_packed(exp.packed), exp.scale.float()
                    sq_err, sq_ref, _ = int4_fmt.error_sums_rows(w, W.to_packed(got_w), got_s)
                    row = rows.get(base)
                    if row is not None:
                        row.source_rel_err = (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0
                        row.snr_db = 10 * math.log10(sq_ref / sq_err) if sq_err > 0 else float("inf")
                        if row.source_rel_err > max_source_rel_err:
                            row.failures.append(f"{base}: relative error {row.source_rel_err:.3f} against the source "
                                                f"exceeds {max_source_rel_err:g}")
                d = int4_fmt.bitwise_diff(got_w, want_w) or int4_fmt.bitwise_diff(got_s, want_s)
                if d:
                    failures.append(f"{where}: INT4 codes/scales differ from the source's, re-derived (group "
                                    f"{W.GROUP}, observer {observer}: {d})")
                else:
                    proven += 1
            elif role in SGLANG_FP8_ROLES and ref.dtype == "F8_E4M3":
                accounted.update((name, base + ".weight_scale_inv"))
                got = (o.raw(name), o.raw(base + ".weight_scale_inv"))
                sc = s.fp8_scale(name) if name in src.tensors else None
                if sc is not None and sc[1] == "block" and s.block == DEFAULT_BLOCK:  # kept bit for bit
                    want = (s.raw(name), s.raw(sc[0].name))
                else:  # made here: the source weight (BF16, or exactly dequantized) at fp32 block scales
                    w = s.weight(name, torch.bfloat16 if s.scheme(name) != "float" else src.tensors[name].torch_dtype)
                    want = fp8.quant_block_ct(w.float())
                d = int4_fmt.bitwise_diff(got[0], want[0]) or int4_fmt.bitwise_diff(got[1], want[1])
                if d:
                    failures.append(f"{where}: block FP8 differs from the source's ({d})")
                else:
                    proven += 1
        for name in out.tensors:
            if name in accounted:
                continue
            if name not in src.tensors:
                failures.append(f"{out.folder}: tensor {name} is in the output but nothing in the source implies it")
                continue
            got, want = o.raw(name), s.raw(name)
            if want.dtype == torch.float8_e4m3fn and got.dtype != want.dtype:
                want = s.weight(name, torch.bfloat16)
            d = int4_fmt.bitwise_diff(got, want)
            if d:
                failures.append(f"{out.folder}: tensor {name} differs from the source ({d})")
            else:
                proven += 1
    finally:
        o.close()
        s.close()
    return failures, proven
