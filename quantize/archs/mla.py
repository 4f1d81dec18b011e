"""Shared facts of the MLA mixture-of-experts families (DeepSeek-V3 / Kimi K2.x / GLM-5.x):
on-disk names (per-expert 2-D tensors, MTP layer at index num_hidden_layers) and the tensor
table implied by a config, used by ``plan`` when only config.json is at hand."""

from __future__ import annotations

MLA_LAYER_RULES: tuple[tuple[str, str], ...] = (
    (r"mlp\.gate\.e_score_correction_bias", "router_bias"),
    (r"(input|post_attention)_layernorm|self_attn\.(q_a|kv_a)_layernorm|enorm|hnorm|shared_head\.norm", "norm"),
    (r"self_attn\.indexer\.k_norm", "norm"),
    (r"self_attn\.indexer\.weights_proj", "indexer_weights"),
    (r"self_attn\.indexer\.(wq_b|wk)", "indexer"),
    (r"self_attn\.q_a_proj", "attn_q_a"),
    (r"self_attn\.q_b_proj", "attn_q_b"),
    (r"self_attn\.q_proj", "attn_q"),
    (r"self_attn\.kv_a_proj_with_mqa", "attn_kv_a"),
    (r"self_attn\.kv_b_proj", "attn_kv_b"),
    (r"self_attn\.o_proj", "attn_o"),
    (r"mlp\.gate", "router"),
    (r"mlp\.experts\.\d+\.gate_proj", "expert_gate"),
    (r"mlp\.experts\.\d+\.up_proj", "expert_up"),
    (r"mlp\.experts\.\d+\.down_proj", "expert_down"),
    (r"mlp\.shared_experts\.gate_proj", "shared_gate"),
    (r"mlp\.shared_experts\.up_proj", "shared_up"),
    (r"mlp\.shared_experts\.down_proj", "shared_down"),
    (r"mlp\.gate_proj", "dense_gate"),
    (r"mlp\.up_proj", "dense_up"),
    (r"mlp\.down_proj", "dense_down"),
    (r"eh_proj", "mtp_proj"),
    (r"shared_head\.head", "mtp_head"),
    (r"embed_tokens", "embed"),
)

MLA_GLOBAL_RULES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens", "embed"),
    (r"model\.norm", "norm"),
    (r"lm_head", "lm_head"),
    (r"vision_tower\..*", "vision"),
    (r"mm_projector\..*", "projector"),
)

MLA_FUSIONS = {
    "self_attn.fused_qkv_a_proj_with_mqa": ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
    "mlp.shared_experts.gate_up_proj": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _is_dense(cfg: dict, layer: int) -> bool:
    types = cfg.get("mlp_layer_types")
    if types and layer < len(types):
        return types[layer] == "dense"
    if layer >= int(cfg["num_hidden_layers"]):
        return False  # MTP layers are MoE
    return layer < int(cfg.get("first_k_dense_replace", 0) or 0)


def mla_expected(cfg: dict, *, dsa: bool, mtp_embed: bool, prefix: str = "") -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, role) of every tensor a vendor checkpoint holds for this text config."""
    H, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    nh = int(cfg["num_attention_heads"])
    nope, rope, vd = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    kvl = int(cfg["kv_lora_rank"])
    ql = cfg.get("q_lora_rank")
    inter, minter = int(cfg["intermediate_size"]), int(cfg["moe_intermediate_size"])
    E, nshared = int(cfg["n_routed_experts"]), int(cfg.get("n_shared_experts", 0) or 0)
    L = int(cfg["num_hidden_layers"])
    mtp = int(cfg.get("num_nextn_predict_layers", 0) or 0)
    out: list[tuple[str, tuple[int, ...], str]] = []

    def add(name, shape, role):
        out.append((prefix + name, tuple(shape), role))

    add("model.embed_tokens.weight", (V, H), "embed")
    for layer in range(L + mtp):
        p = f"model.layers.{layer}."
        if layer >= L:
            if mtp_embed:
                add(p + "embed_tokens.weight", (V, H), "embed")
            add(p + "enorm.weight", (H,), "norm")
            add(p + "hnorm.weight", (H,), "norm")
            add(p + "eh_proj.weight", (H, 2 * H), "mtp_proj")
            add(p + "shared_head.norm.weight", (H,), "norm")
            add(p + "shared_head.head.weight", (V, H), "mtp_head")
        add(p + "input_layernorm.weight", (H,), "norm")
        add(p + "post_attention_layernorm.weight", (H,), "norm")
        a = p + "self_attn."
        if ql:
            add(a + "q_a_proj.weight", (ql, H), "attn_q_a")
            add(a + "q_a_layernorm.weight", (ql,), "norm")
            add(a + "q_b_proj.weight", (nh * (nope + rope), ql), "attn_q_b")
        else:
            add(a + "q_proj.weight", (nh * (nope + rope), H), "attn_q")
        add(a + "kv_a_proj_with_mqa.weight", (kvl + rope, H), "attn_kv_a")
        add(a + "kv_a_layernorm.weight", (kvl,), "norm")
        add(a + "kv_b_proj.weight", (nh * (nope + vd), kvl), "attn_kv_b")
        add(a + "o_proj.weight", (H, nh * vd), "attn_o")
        if dsa:
            ih, idim = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
            add(a + "indexer.wq_b.weight", (ih * idim, ql), "indexer")
            add(a + "indexer.wk.weight", (idim, H), "indexer")
            add(a + "indexer.k_norm.weight", (idim,), "norm")
            add(a + "indexer.k_norm.bias", (idim,), "norm")
            add(a + "indexer.weights_proj.weight", (ih, H), "indexer_weights")
        m = p + "mlp."
        if _is_dense(cfg, layer):
            add(m + "gate_proj.weight", (inter, H), "dense_gate")
            add(m + "up_proj.weight", (inter, H), "dense_up")
            add(m + "down_proj.weight", (H, inter), "dense_down")
            continue
        add(m + "gate.weight", (E, H), "router")
        add(m + "gate.e_score_correction_bias", (E,), "router_bias")
        for e in range(E):
            add(m + f"experts.{e}.gate_proj.weight", (minter, H), "expert_gate")
            add(m + f"experts.{e}.up_proj.weight", (minter, H), "expert_up")
            add(m + f"experts.{e}.down_proj.weight", (H, minter), "expert_down")
        if nshared:
            si = minter * nshared
            add(m + "shared_experts.gate_proj.weight", (si, H), "shared_gate")
            add(m + "shared_experts.up_proj.weight", (si, H), "shared_up")
            add(m + "shared_experts.down_proj.weight", (H, si), "shared_down")
    add("model.norm.weight", (H,), "norm")
    if not cfg.get("tie_word_embeddings", False):
        add("lm_head.weight", (V, H), "lm_head")
    return out
