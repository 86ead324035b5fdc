"""A tiny model of each architecture strata builds, for the model and generation tests."""

import dataclasses

from strata.model.presets import get_preset

ARCHITECTURES = {
    "llama-gqa": get_preset("tiny"),
    "gpt2": get_preset("tiny-gpt2"),
    "alibi": dataclasses.replace(get_preset("tiny-gpt2"), position="alibi", n_heads=4, embedding_norm=True),
    # the options of the newer families: a window shorter than the sequences, per-head q/k norms
    # with q/k/v biases and heads wider than d_model / n_heads, Gemma's norms, embeddings and GeGLU,
    # Llama 3.1's RoPE scaling
    "sliding-window": dataclasses.replace(get_preset("tiny"), sliding_window=5, family="mistral"),
    "qwen3": dataclasses.replace(get_preset("tiny"), qk_norm=True, qkv_bias=True, d_head=32, family="qwen3"),
    "gemma": dataclasses.replace(get_preset("tiny"), norm="gemma_rmsnorm", mlp="geglu", scale_embeddings=True,
                                 d_head=24, tie_embeddings=True, family="gemma"),
    "llama3-rope": dataclasses.replace(get_preset("tiny"), rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
                                       rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                                       rope_original_max_seq_len=16),
}
