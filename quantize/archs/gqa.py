"""Dense GQA decoders (Llama, Qwen2/3, Mistral): K and V per head, q/k/v/o + gated MLP."""

from __future__ import annotations

GQA_LAYER_RULES: tuple[tuple[str, str], ...] = (
    (r"(input|post_attention)_layernorm|self_attn\.(q|k)_norm", "norm"),
    (r"self_attn\.q_proj", "attn_q"),
    (r"self_attn\.k_proj", "attn_k"),
    (r"self_attn\.v_proj", "attn_v"),
    (r"self_attn\.o_proj", "attn_o"),
    (r"mlp\.gate_proj", "dense_gate"),
    (r"mlp\.up_proj", "dense_up"),
    (r"mlp\.down_proj", "dense_down"),
)

GQA_GLOBAL_RULES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens", "embed"),
    (r"model\.norm", "norm"),
    (r"lm_head", "lm_head"),
)

GQA_FUSIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def gqa_expected(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    H, V, inter = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["intermediate_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or H // nh)
    out = [("model.embed_tokens.weight", (V, H), "embed")]
    for layer in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (H,), "norm"),
            (p + "post_attention_layernorm.weight", (H,), "norm"),
            (p + "self_attn.q_proj.weight", (nh * hd, H), "attn_q"),
            (p + "self_attn.k_proj.weight", (nkv * hd, H), "attn_k"),
            (p + "self_attn.v_proj.weight", (nkv * hd, H), "attn_v"),
            (p + "self_attn.o_proj.weight", (H, nh * hd), "attn_o"),
            (p + "mlp.gate_proj.weight", (inter, H), "dense_gate"),
            (p + "mlp.up_proj.weight", (inter, H), "dense_up"),
            (p + "mlp.down_proj.weight", (H, inter), "dense_down"),
        ]
    out.append(("model.norm.weight", (H,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (V, H), "lm_head"))
    return out
