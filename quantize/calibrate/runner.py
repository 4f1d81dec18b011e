"""Run text through a model one decoder layer at a time, with transformers' own layer classes.

The whole model is never instantiated: for each layer, its class (``DeepseekV3DecoderLayer``,
``GlmMoeDsaDecoderLayer``, ``LlamaDecoderLayer``, ...) is built on the meta device, filled with
that layer's tensors read from safetensors (BF16 as is, block/channel FP8 and our INT4 output
dequantized on the fly, per-expert 2-D tensors stacked into transformers' fused expert
parameters), run over the cached hidden states of every sample, and freed. A MoE layer's routed
experts are not built with it: they are read a group at a time (``expert_budget`` bytes) and run on
the tokens routed to them (``calibrate/experts.py``), bit for bit the whole layer's output. Peak
memory: the layer's attention, router and shared experts, one group of routed experts, and the
hidden states.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Callable, Iterator

import torch

from .. import archs
from ..checkpoint.index import CheckpointIndex
from ..checkpoint.reader import WeightReader
from ..errors import QuantizeError
from . import experts as routed


# transformers' fused routed experts parameters of a decoder layer (the rest map to one tensor each)
_FUSED = re.compile(r"(.*mlp\.experts)\.(gate_up_proj|down_proj)")


class LayerStreamer:
    def __init__(self, model: str | Path, dtype: torch.dtype = torch.float32, expert_budget: int = 4 << 30):
        self.folder = Path(model)
        self.index = CheckpointIndex.open(self.folder)
        self.arch = archs.resolve(self.index.config, str(self.folder / "config.json"))
        if not self.arch.hf:
            raise QuantizeError(
                f"{self.folder / 'config.json'}: {self.arch.name} has no layer classes registered for calibration"
            )
        self.text = dict(self.arch.text_config(self.index.config))
        mod, prefix = self.arch.hf_classes(self.text)
        self.modeling = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        conf_mod = importlib.import_module(f"transformers.models.{mod}.configuration_{mod}")
        self.prefix = prefix
        cfg = {k: v for k, v in self.text.items() if k not in ("quantization_config", "architectures", "auto_map")}
        self.config = getattr(conf_mod, prefix + "Config")(**cfg)
        self.config._attn_implementation = "eager"
        self.dtype = dtype
        self.num_layers = int(self.config.num_hidden_layers)
        if not any(n.startswith(self._layer_prefix(0) + "self_attn.") for n in self.index.tensors):
            raise QuantizeError(
                f"{self.folder}: no attention tensors under {self._layer_prefix(0)}self_attn.*; nothing to calibrate"
            )
        self.reader = WeightReader(self.index)
        self.expert_budget = int(expert_budget)  # bytes of routed expert weights held at once
        self.device = "cpu"  # where ``stream`` runs the layers (calibrate-kv's --device); weights are read on the CPU
        self.experts_path = self.arch.hf.get("experts")
        self.expert_tap = None  # ``expert_tap(layer, expert, x, inner)``: each routed expert's GEMM inputs

    def _layer_prefix(self, i: int) -> str:
        return f"{self.arch.prefix}model.layers.{i}."

    # -- weights -------------------------------------------------------------------------------
    def tensor(self, name: str, device=None) -> torch.Tensor:
        """One parameter by on-disk name, dequantized to ``self.dtype`` (FP8 as bf16(fp8 * scale),
        as a BF16 checkpoint of the model and convert hold it; INT4 unpacked), on ``device``
        (default the CPU), dequantized there."""
        return self.reader.weight(name, self.dtype, device)

    def _param(self, prefix: str, key: str, device=None) -> torch.Tensor:
        """In-memory parameter ``key`` of the layer at ``prefix``, other than the fused experts."""
        name = prefix + key
        t = self.tensor(name, device)
        return t.float() if name.endswith("e_score_correction_bias") else t

    def layer(self, i: int, stream_experts: bool = False, device=None) -> torch.nn.Module:
        """Decoder layer ``i`` with its weights; ``stream_experts``: its routed experts module
        replaced by a ``StandIn`` (``stand_in``), their weights left on disk for ``expert_weights``.
        Whole, the on-disk per-expert tensors are stacked into transformers' fused
        ``experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] (``expert_weights``, once for both).
        ``device``: the weights read onto it and dequantized there (default the CPU)."""
        cls = getattr(self.modeling, self.prefix + "DecoderLayer")
        with torch.device("meta"):
            layer = cls(self.config, layer_idx=i)
        if stream_experts:
            routed.stand_in(layer, self.experts_path)
        state = layer.state_dict()
        n_experts = int(getattr(self.config, "n_routed_experts", 0) or 0)
        fused: dict[str, torch.Tensor] = {}

        def param(key: str) -> torch.Tensor:
            m = _FUSED.fullmatch(key)
            if not m:
                return self._param(self._layer_prefix(i), key, device)
            if not fused:
                fused["gate_up_proj"], fused["down_proj"] = self.expert_weights(i, range(n_experts), device)
            return fused.pop(m.group(2))

        loaded = {k: param(k).to(v.dtype if v.dtype == torch.float32 else self.dtype) for k, v in state.items()}
        layer.load_state_dict(loaded, strict=True, assign=True)
        return layer.eval()

    def expert_dims(self) -> tuple[int, int]:
        """(hidden, moe_intermediate): a routed expert is gate|up [2I, H] and down [H, I]."""
        return int(self.config.hidden_size), int(getattr(self.config, "moe_intermediate_size", 0) or 0)

    def stand_in(self, layer: torch.nn.Module) -> "routed.StandIn | None":
        """The layer's routed experts stand-in (``layer(i, stream_experts=True)``), or None."""
        if not self.experts_path:
            return None
        try:
            m = layer.get_submodule(self.experts_path)
        except AttributeError:
            return None
        return m if isinstance(m, routed.StandIn) else None

    def expert_weights(self, i: int, experts: range, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed experts ``experts`` of layer ``i`` as transformers' fused parameters hold them
        ([g, 2I, H] gate|up and [g, H, I] down, in ``self.dtype``), from the on-disk per-expert
        tensors, dequantized as ``layer`` would; on ``device`` (default the CPU), dequantized there."""
        base = self._layer_prefix(i) + self.experts_path
        gate_up = down = None
        for j, e in enumerate(experts):  # filled in place: one copy of the group in memory, not two
            g, u, d = (self.tensor(f"{base}.{e}.{p}.weight", device).to(self.dtype)
                       for p in ("gate_proj", "up_proj", "down_proj"))
            if gate_up is None:
                gate_up = torch.empty((len(experts), g.shape[0] + u.shape[0], g.shape[1]), dtype=self.dtype,
                                      device=g.device)
                down = torch.empty((len(experts), *d.shape), dtype=self.dtype, device=g.device)
            gate_up[j, : g.shape[0]], gate_up[j, g.shape[0]:], down[j] = g, u, d
            del g, u, d
        return gate_up, down

    def expert_groups(self, per_expert: int, within: range) -> list[range]:
        """The routed experts ``within`` (all of a layer's, or this rank's) in groups of at most
        ``expert_budget`` bytes (``per_expert``: the bytes one expert costs the caller)."""
        size = routed.group_size(self.expert_budget, per_expert, max(1, len(within)))
        return [range(g.start + within.start, g.stop + within.start) for g in routed.groups(len(within), size)]

    def routed_outputs(self, i: int, stand: "routed.StandIn", captured: list) -> list[torch.Tensor]:
        """Per sample, the routed experts' output for what ``captured`` recorded (``Routed``),
        every expert, read a group at a time: a sample's output depends on that sample alone, so
        ranks that split the samples (calibrate-kv) each run every expert on their own."""
        outs = [torch.zeros_like(r.hidden) for r in captured]
        per = routed.expert_bytes(*self.expert_dims(), self.dtype)
        for g in self.expert_groups(per, range(stand.num_experts)):
            gate_up, down = self.expert_weights(i, g, self.device)
            tap = None if self.expert_tap is None else (lambda e, x, inner: self.expert_tap(i, e, x, inner))
            with torch.no_grad():
                for out, r in zip(outs, captured):
                    routed.accumulate(out, r, g, gate_up, down, stand.act_fn, tap)
            del gate_up, down
        return outs

    # -- checked before a weight is read ----------------------------------------------------------
    def sources(self, i: int, key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The on-disk tensors ``layer(i)`` reads for its parameter ``key`` of ``shape``, each with
        the shape it must have (``_param``'s names: transformers' fused ``experts.gate_up_proj``
        [E, 2I, H] is every expert's ``gate_proj`` and ``up_proj`` [I, H], ``down_proj`` [E, H, I]
        every expert's ``down_proj`` [H, I])."""
        prefix = self._layer_prefix(i)
        m = _FUSED.fullmatch(key)
        if not m or len(shape) != 3:
            return [(prefix + key, tuple(shape))]
        base, n = prefix + m.group(1), int(getattr(self.config, "n_routed_experts", 0) or 0)
        if n != shape[0]:  # _param stacks n_routed_experts experts
            raise QuantizeError(f"{self.folder / 'config.json'}: layer {i}'s {key} holds {shape[0]} experts, but "
                                f"n_routed_experts is {n}; fix config.json")
        if m.group(2) == "down_proj":
            return [(f"{base}.{e}.down_proj.weight", tuple(shape[1:])) for e in range(n)]
        half = (shape[1] // 2, shape[2])
        return [(f"{base}.{e}.{p}_proj.weight", half) for e in range(n) for p in ("gate", "up")]

    def check_layers(self, build_fix: str = "fix config.json (compare it with the release's)") -> list[list[int]]:
        """Every decoder layer ``stream`` runs, checked before any tensor data is read: transformers'
        layer class built on the meta device for each, and each of its parameters found on disk
        (BF16, FP8 with a fitting scale, or INT4) with the shape it needs, from the safetensors
        headers (``WeightReader.mismatch``); the embedding too. The first failure is one line naming
        the tensor (or the layer and ``build_fix``). Returns the layers grouped by kind (the same
        parameter names and shapes: e.g. the dense layers, then the MoE layers)."""
        cls = getattr(self.modeling, self.prefix + "DecoderLayer")
        cls_name = f"transformers' {cls.__name__}"
        embed, hidden = self._embed_name(), int(self.config.hidden_size)
        ref = self.index.tensors.get(embed)
        if ref is None or len(ref.shape) != 2 or ref.shape[1] != hidden:  # rows: checked against the token ids
            need = (int(getattr(self.config, "vocab_size", 0) or 0), hidden)
            raise self._mismatch(embed, "is missing" if ref is None else f"has shape {list(ref.shape)}", need,
                                 "calibration's embedding")
        kinds: dict[tuple, list[int]] = {}
        for i in range(self.num_layers):
            try:
                with torch.device("meta"):
                    layer = cls(self.config, layer_idx=i)
            except Exception as e:  # noqa: BLE001 - transformers' own failure, as one line
                raise QuantizeError(f"{self.folder}: transformers cannot build decoder layer {i} ({type(e).__name__}: "
                                    f"{(str(e).splitlines() or [''])[0][:160]}); {build_fix}") from e
            params = tuple((k, tuple(v.shape)) for k, v in layer.state_dict().items())
            for key, shape in params:
                for name, need in self.sources(i, key, shape):
                    why = self.reader.mismatch(name, need)
                    if why:
                        raise self._mismatch(name, why, need, f"{cls_name} (layer {i})")
            kinds.setdefault(params, []).append(i)
            del layer
        return list(kinds.values())

    def _mismatch(self, name: str, why: str, need: tuple, who: str) -> QuantizeError:
        ref = self.index.tensors.get(name) or self.index.tensors.get(name.removesuffix(".weight") + ".weight_packed")
        where = self.folder / ref.file if ref is not None else self.folder
        fix = ("the tensors disagree with config.json: fix config.json or re-download the shard" if ref is not None
               else "the checkpoint is incomplete: re-download it (or the shard that should hold it)")
        return QuantizeError(f"{where}: {name} {why}, but {who} needs {list(need)}; {fix}")

    def check_ids(self, ids: list[torch.Tensor]) -> None:
        """Every token id of the samples is a row of the embedding (a tokenizer of another model
        would index past it mid-run)."""
        ref = self.index.tensors.get(self._embed_name())
        if ref is None or len(ref.shape) != 2:
            return  # check_layers names it
        top = max((int(x.max()) for x in ids if x.numel()), default=-1)
        if top >= ref.shape[0]:
            raise QuantizeError(f"{self.folder}: the tokenizer gives token id {top}, but {ref.name} has "
                                f"{ref.shape[0]} rows; the tokenizer is another model's: copy this model's own "
                                "tokenizer into the folder")

    def _embed_name(self) -> str:
        return f"{self.arch.prefix}model.embed_tokens.weight"

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.tensor(f"{self.arch.prefix}model.embed_tokens.weight")
        return torch.nn.functional.embedding(ids, w)

    # -- forward ---------------------------------------------------------------------------------
    def _context(self, hidden: torch.Tensor):
        pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = getattr(self.modeling, self.prefix + "RotaryEmbedding")(self.config).to(hidden.device)
        pe = rotary(hidden, position_ids=pos)
        mask = self.modeling.create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=None,
            position_ids=pos,
            **self.arch.hf.get("mask_kwargs", {}),
        )
        return pos, pe, mask

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, cache=None, topk=None):
        pos, pe, mask = self._context(hidden)
        kw = {"prev_topk_indices": topk} if self.arch.hf.get("topk") else {}
        with torch.no_grad():
            out = layer(
                hidden,
                attention_mask=mask,
                position_embeddings=pe,
                position_ids=pos,
                past_key_values=cache,
                use_cache=False,
                **kw,
            )
        if isinstance(out, tuple):
            return out[0], out[1] if len(out) > 1 else None
        return out, None

    def stream(
        self,
        samples: list[torch.Tensor],
        cache_for: Callable | None = None,
        before: Callable | None = None,
        after: Callable | None = None,
    ) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Yield (layer index, hidden states after that layer) for every layer. Per layer:
        ``before(i, layer)`` (hooks; it returns the hook handles it registered, or None), then
        every sample through the layer with ``past_key_values=cache_for(i)``, then
        ``after(i, layer, inputs)`` with the layer's input hidden states (e.g. to re-run attention
        under FP8). DSA top-k indices flow to the next layer.

        A MoE layer runs in three steps (``calibrate/experts.py``): every sample through the layer
        with the routed experts captured (the hooks and ``cache_for`` observe this pass, once), the
        routed experts a group at a time, and every sample again with their output replayed (the
        hooks removed, no cache): the outputs are the whole layer's, bit for bit."""
        hidden = [self.embed(ids.unsqueeze(0)).to(self.dtype).to(self.device) for ids in samples]
        topk: list = [None] * len(hidden)
        for i in range(self.num_layers):
            layer = self.layer(i, stream_experts=True, device=self.device).to(self.device)
            stand = self.stand_in(layer)
            handles = before(i, layer) if before is not None else None
            if stand is None:
                outs = [
                    self.run_layer(layer, h, cache=cache_for(i) if cache_for else None, topk=t)
                    for h, t in zip(hidden, topk)
                ]
            else:
                captured = []
                for h, t in zip(hidden, topk):
                    stand.capture()
                    self.run_layer(layer, h, cache=cache_for(i) if cache_for else None, topk=t)
                    captured.append(stand.take())
                for handle in handles or ():
                    handle.remove()
                experts_out = self.routed_outputs(i, stand, captured)
                del captured
                outs = []
                for h, t, e in zip(hidden, topk, experts_out):
                    stand.replay(e)
                    outs.append(self.run_layer(layer, h, topk=t))
                stand.capture()
                del experts_out
            if after is not None:
                after(i, layer, hidden)
            hidden, topk = [o for o, _ in outs], [t for _, t in outs]
            del layer
            yield i, hidden

    def close(self) -> None:
        self.reader.close()
