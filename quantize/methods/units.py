"""What a data-aware method quantizes inside one decoder layer, as transformers' layer holds it.

A ``Unit`` is one INT4 weight matrix: an ``nn.Linear``'s weight, or expert ``e`` of a fused experts
parameter (``mlp.experts.gate_up_proj [E, 2I, H]`` holds the checkpoint's ``experts.e.gate_proj``
in rows ``[0, I)`` and ``up_proj`` in ``[I, 2I)``; ``down_proj [E, H, I]``). Units map back to the
checkpoint's module names row range by row range, so the results land in the plan's own output
tensors. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..formats import int4

SCALE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)")


@dataclass
class Unit:
    path: str  # parameter in the layer: "self_attn.q_proj.weight" or "mlp.experts.gate_up_proj"
    expert: int | None  # index into a fused [E, out, in] parameter; None for an nn.Linear
    names: list[tuple[str, int, int]]  # (checkpoint module, first row, end row)
    scale_dtype: torch.dtype
    roles: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.path if self.expert is None else f"{self.path}[{self.expert}]"

    @property
    def module(self) -> str:
        """The module whose input feeds this unit (the experts module for a fused parameter)."""
        return self.path.rsplit(".", 1)[0]


def cross_key(key: str) -> str:
    """Where a unit's GPTQ --asym cross term is summed beside its Hessian (``gptq.Hessians``)."""
    return key + "|cross"


def unit_key(key: str) -> str:
    """The unit a statistics key belongs to (its Hessian's or its cross term's)."""
    return key[:-len("|cross")] if key.endswith("|cross") else key


@dataclass
class Result:
    codes: torch.Tensor  # int8 [out, in] in [-8, 7]
    scale: torch.Tensor  # scale_dtype [out, in / group]
    how: str  # "gptq" | "autoround" | "rtn"


def by_expert(units: list[Unit]) -> dict[int, list[Unit]]:
    """The routed experts' units by expert index (the Linear units left out)."""
    out: dict[int, list[Unit]] = {}
    for u in units:
        if u.expert is not None:
            out.setdefault(u.expert, []).append(u)
    return out


def param(layer: torch.nn.Module, unit: Unit) -> torch.Tensor:
    p = layer.get_parameter(unit.path)
    return p if unit.expert is None else p[unit.expert]


def layer_units(layer: torch.nn.Module, prefix: str, jobs, streamed: dict[str, tuple] | None = None
                ) -> tuple[list[Unit], list[tuple[str, str]]]:
    """The plan's INT4 jobs of one layer (names under ``prefix``) as units of ``layer``, and the
    jobs that are not a weight of transformers' layer (quantized RTN, named with the reason).
    ``streamed``: the shapes of fused expert parameters the layer does not hold (its routed experts
    are streamed: ``calibrate/experts.py``), by parameter path."""
    params: dict = {n: p.shape for n, p in layer.named_parameters()}
    params.update(streamed or {})
    units: dict[str, Unit] = {}
    rtn: list[tuple[str, str]] = []
    for job in jobs:
        rel = job.module[len(prefix):]
        sdt = SCALE_DTYPES[job.outputs[1].dtype]
        m = _EXPERT.fullmatch(rel)
        if m:
            base, e, proj = m.group(1), int(m.group(2)), m.group(3)
            path = f"{base}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
            p = params.get(path)
            out = job.wshape[0]
            if p is None or len(p) != 3 or e >= p[0]:
                rtn.append((job.module, f"transformers' layer has no fused {path} for expert {e}"))
                continue
            u = units.setdefault(f"{path}[{e}]", Unit(path, e, [], sdt))
            r0 = out if proj == "up_proj" else 0
            u.names.append((job.module, r0, r0 + out))
            u.roles.append(job.role)
            continue
        p = params.get(rel + ".weight")
        if p is None or len(p) != 2 or tuple(p) != tuple(job.wshape):
            rtn.append((job.module, "not a Linear weight of transformers' layer class"))
            continue
        units[rel + ".weight"] = Unit(rel + ".weight", None, [(job.module, 0, job.wshape[0])], sdt, [job.role])
    out = []
    for u in units.values():
        u.names.sort(key=lambda n: n[1])
        rows = params[u.path][-2]
        if u.expert is not None and (u.names[0][1] != 0 or u.names[-1][2] != rows
                                     or any(a[2] != b[1] for a, b in zip(u.names, u.names[1:]))):
            for name, _, _ in u.names:  # gate without up (or the reverse): cannot be fused
                rtn.append((name, f"only part of {u.key} is INT4"))
            continue
        out.append(u)
    return out, rtn


def rtn(w: torch.Tensor, group_size: int, observer: str, scale_dtype: torch.dtype) -> Result:
    """Round-to-nearest on the method's grid: what ``convert`` writes without a method."""
    q, s = int4.quantize_groups(w, group_size, observer, scale_dtype)
    return Result(q, s, "rtn")


def dequant(res: Result, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the engines compute with: ``q * scale`` in the scale dtype (compressed-tensors'
    decompression, and ``checkpoint.reader``'s), then ``dtype``."""
    out, k = res.codes.shape
    g = k // res.scale.shape[1]
    deq = res.codes.to(res.scale.dtype).view(out, res.scale.shape[1], g) * res.scale.unsqueeze(-1)
    return deq.view(out, k).to(dtype)


def install(layer: torch.nn.Module, unit: Unit, w: torch.Tensor) -> None:
    with torch.no_grad():
        param(layer, unit).copy_(w)


def split(unit: Unit, res: Result) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (``X.weight_packed``, ``X.weight_scale``) of a unit's result."""
    out = {}
    for name, r0, r1 in unit.names:
        out[f"{name}.weight_packed"] = int4.pack_int4(res.codes[r0:r1].contiguous())
        out[f"{name}.weight_scale"] = res.scale[r0:r1].contiguous()
    return out


def join(unit: Unit, tensors: dict[str, torch.Tensor], k: int) -> Result:
    """The reverse of ``split``, from tensors read back."""
    codes = torch.cat([int4.unpack_int4(tensors[f"{n}.weight_packed"], k) for n, _, _ in unit.names])
    scale = torch.cat([tensors[f"{n}.weight_scale"] for n, _, _ in unit.names])
    return Result(codes, scale, "cached")
