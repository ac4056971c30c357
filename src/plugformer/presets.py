"""The named configurations of `PlugformerConfig.from_preset`."""

from __future__ import annotations

from typing import Any


# Presets are diffs from the dataclass defaults (litgpt's habit): read the defaults, then the diff.
PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: every axis runs in milliseconds; GQA (4 query heads share 2 key/value heads).
    "tiny": dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        max_relative_distance=8,
    ),
    # CPU experiments: ≈ 14M parameters with an 8k vocabulary.
    "small": dict(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        max_position_embeddings=1024,
    ),
    # GPT-2 small's shape (124M): learned absolute positions, post-2019 pre-LayerNorm, GELU MLP, biases, tied head.
    "gpt2-small": dict(
        vocab_size=50257,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=1024,
        position_scheme="learned",
        norm_type="layernorm",
        ffn_type="mlp",
        hidden_act="gelu_new",
        attention_bias=True,
        mlp_bias=True,
        layer_norm_eps=1e-5,
    ),
    # A Llama-3.2-1B-like decoder for GPU: RoPE (theta 500k), GQA 32/8, SwiGLU, RMSNorm.
    "llama": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}
