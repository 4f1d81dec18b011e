"""``calibrate-kv --fold``: put the MLA cache in a good e4m3 range by changing the WEIGHTS, since
SGLang and vLLM cache MLA rows at unit scale (docs/kv-cache.md#mla-unit-scale, #weight-fold).

The cached row is ``kv_a_layernorm(c) * gamma`` ‖ ``RoPE(k_pe)``. With powers of two ``fl`` (latent)
and ``fr`` (rope), each layer is reparametrised exactly:

- latent: ``kv_a_layernorm.weight * fl`` and ``kv_b_proj / fl`` (its only consumer): the cached
  latent is ``fl`` times larger, every product downstream is unchanged;
- rope: the rope rows of ``kv_a_proj_with_mqa`` ``* fr`` (RoPE is linear, so the cached ``k_pe`` is
  ``fr`` times larger) and each head's rope rows of ``q_b_proj`` (or ``q_proj``) ``/ fr``, so
  ``q_pe . k_pe`` is unchanged.

Powers of two make every product exact in BF16/FP32 (only the exponent moves). Where a weight is
stored quantized the scale moves instead of the codes: block-FP8 ``weight_scale_inv``, channel-FP8
or our INT4 ``weight_scale`` (per row), which is exact too — but a 128-row FP8 block that mixes rope
and non-rope rows cannot move one part alone: that part is not folded, and the report says why.

What the fold moves elsewhere: the absorbed query ``q_nope x W_UK`` shrinks by ``fl`` and ``q_pe`` by
``fr`` (SGLang's FlashMLA FP8 path casts q to e4m3 at the same scale), so each factor is capped so
the query neither overflows e4m3 nor sinks below its normal range; a capped factor is named.

Which tensors a layer's fold touches and where the rope rows lie in them is the MLA layout's
(``archs.attention.MLA.fold_tensors``, ``MlaNames``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..archs.attention import MlaNames

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
MAX_EXP = 20  # |log2 factor| bound: beyond this something is wrong with the statistics


@dataclass
class FoldFactors:
    layer: int
    latent: float = 1.0  # fl: multiplies the cached latent
    rope: float = 1.0  # fr: multiplies the cached k_pe
    latent_amax_before: float = 0.0
    rope_amax_before: float = 0.0
    q_absorbed_amax_before: float | None = None
    q_pe_amax_before: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def latent_amax_after(self) -> float:
        return self.latent_amax_before * self.latent

    @property
    def rope_amax_after(self) -> float:
        return self.rope_amax_before * self.rope

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            latent_amax_after=self.latent_amax_after,
            rope_amax_after=self.rope_amax_after,
            q_absorbed_amax_after=None
            if self.q_absorbed_amax_before is None
            else self.q_absorbed_amax_before / self.latent,
            q_pe_amax_after=None if self.q_pe_amax_before is None else self.q_pe_amax_before / self.rope,
        )
        return d


def choose_factor(cache_amax: float, query_amax: float | None, headroom: float, part: str) -> tuple[float, str | None]:
    """The largest power of two ``f`` with ``cache_amax * f <= 448 / headroom``, then capped so the
    query (divided by ``f``) keeps ``amax <= 448 / headroom`` and ``amax >= 2^-6`` (e4m3's normal
    range). -> (f, a note when the query capped or balanced it)."""
    limit = E4M3_MAX / headroom
    if cache_amax <= 0 or not math.isfinite(cache_amax):
        return 1.0, f"{part}: no nonzero values observed; not folded"
    k = math.floor(math.log2(limit / cache_amax))
    k = max(-MAX_EXP, min(MAX_EXP, k))
    if query_amax is None or query_amax <= 0:
        return 2.0**k, None
    # the query must stay inside [2^-6, 448/headroom] after dividing by 2^k
    k_lo = math.ceil(math.log2(query_amax / limit))  # smallest k keeping q <= limit
    k_hi = math.floor(math.log2(query_amax / E4M3_MIN_NORMAL))  # largest k keeping q >= 2^-6
    if k_lo <= k <= k_hi:
        return 2.0**k, None
    if k > k_hi and k_hi >= k_lo:
        return 2.0**k_hi, (
            f"{part}: factor capped at 2^{k_hi} (cache alone wanted 2^{k}) so the query amax "
            f"{query_amax:.3g} stays in e4m3's normal range after the fold"
        )
    if k < k_lo and k_lo <= k_hi:
        return 2.0**k_lo, (
            f"{part}: factor raised to 2^{k_lo} (cache alone wanted 2^{k}) so the query amax "
            f"{query_amax:.3g} does not overflow e4m3 after the fold; cache amax becomes {cache_amax * 2.0**k_lo:.3g}"
        )
    mid = round((k + (k_lo + k_hi) / 2) / 2)
    return 2.0**mid, (
        f"{part}: cache (wants 2^{k}) and query (needs 2^{k_lo}..2^{k_hi}) cannot both fit e4m3; balanced at 2^{mid}"
    )


def rows_foldable(scheme: str, rows: list[int], total_rows: int, block_rows: int) -> str | None:
    """None when rows can be scaled alone in this storage scheme, else why not."""
    if scheme != "fp8-block":
        return None
    rowset = set(rows)
    for b in range(math.ceil(total_rows / block_rows)):
        blk = set(range(b * block_rows, min(total_rows, (b + 1) * block_rows)))
        if blk & rowset and not blk <= rowset:
            return f"its {block_rows}-row FP8 blocks mix rope and non-rope rows"
    return None


def scale_rows(t: torch.Tensor, rows: list[int], f: float) -> torch.Tensor:
    """Rows of a weight (or of its per-row / per-block-row scale) times a power of two."""
    out = t.clone()
    idx = torch.tensor(rows, dtype=torch.long)
    out[idx] = (out[idx].float() * f).to(t.dtype)
    return out


def scale_all(t: torch.Tensor, f: float) -> torch.Tensor:
    return (t.float() * f).to(t.dtype)


def _stored(reader, weight: str) -> tuple[str, str]:
    """(scheme, name of the tensor whose rows carry the weight's per-row magnitude)."""
    scheme = reader.scheme(weight)
    base = weight[: -len(".weight")]
    if scheme == "float":
        return scheme, weight
    if scheme == "int4":
        return scheme, base + ".weight_scale"
    if scheme.startswith("fp8-"):
        return scheme, reader.fp8_scale(weight)[0].name
    return scheme, weight


def rope_fold_blocker(reader, n: MlaNames) -> str | None:
    """Why the rope part of this layer cannot be folded exactly in its storage, or None."""
    for weight, rows in ((n.kv_a, n.rope_rows_kv_a()), (n.q, n.rope_rows_q())):
        scheme, carrier = _stored(reader, weight)
        total = reader.index.tensors[weight].shape[0] if weight in reader.index.tensors else None
        if scheme == "fp8-block":
            why = rows_foldable(scheme, rows, total, reader.block[0])
            if why:
                return (
                    f"{weight.rsplit('.', 2)[-2]} is block FP8 and {why}; "
                    "convert first (INT4 or BF16 attention) to fold the rope part"
                )
        elif scheme == "fp8-channel" and math.prod(reader.index.tensors[carrier].shape) == 1:
            return f"{weight.rsplit('.', 2)[-2]} has one FP8 scale for the whole tensor"
        elif scheme not in ("float", "int4", "fp8-channel"):
            return f"{weight} is stored as {scheme}"
    return None


def _rows_in_carrier(reader, scheme: str, carrier: str, rows: list[int]) -> list[int]:
    if scheme == "fp8-block":
        return sorted({r // reader.block[0] for r in rows})
    return rows


def fold_changes(reader, n: MlaNames, fl: float, fr: float) -> dict[str, torch.Tensor]:
    """The tensors that change, under their stored names, dtypes and shapes."""
    changed: dict[str, torch.Tensor] = {}
    if fl != 1.0:
        changed[n.norm] = scale_all(reader.raw(n.norm), fl)
        _, carrier = _stored(reader, n.kv_b)
        changed[carrier] = scale_all(reader.raw(carrier), 1.0 / fl)
    if fr != 1.0:
        for weight, rows, f in ((n.kv_a, n.rope_rows_kv_a(), fr), (n.q, n.rope_rows_q(), 1.0 / fr)):
            scheme, carrier = _stored(reader, weight)
            t = changed.get(carrier, reader.raw(carrier))
            if t.dim() == 1:
                t = t.view(-1, 1)
                changed[carrier] = scale_rows(t, _rows_in_carrier(reader, scheme, carrier, rows), f).view(-1)
            else:
                changed[carrier] = scale_rows(t, _rows_in_carrier(reader, scheme, carrier, rows), f)
    for name, t in changed.items():
        if (
            not t.dtype.is_floating_point
            or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            or not torch.isfinite(t.float()).all()
        ):
            raise ValueError(f"{name}: cannot scale a {t.dtype} tensor exactly")
    return changed
