"""Named model shapes. `tiny` and `small` run here; the rest are real shapes for planning and
are built on the meta device (no memory) to count parameters and FLOPs."""

from __future__ import annotations

from strata.model.config import ModelConfig

_GPT = dict(norm="layernorm", position="learned", mlp="gelu", tie_embeddings=True, bias=True, family="gpt2")
_LLAMA = dict(norm="rmsnorm", position="rope", mlp="swiglu", tie_embeddings=False, bias=False, family="llama")
# Llama 3.1's RoPE scaling (its config.json's rope_scaling): 8x the 8,192-token pre-training context
# multi-head latent attention for tests (DeepSeek's: families/deepseek_v3.DeepSeekOptions), and a dense
# model's routing options (none of its layers routes)
_TINY_LATENT = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    rope_interleave=True)
_DENSE_ROUTING = dict(first_dense=0, scoring="softmax", groups=1, groups_kept=1, routed_scale=1.0, balance_rate=0.0)
_LLAMA31_ROPE = dict(rope_theta=500000.0, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0, rope_original_max_seq_len=8192)

PRESETS: dict[str, ModelConfig] = {
    # Tests: LLaMA-style with grouped-query attention, well under 1M parameters.
    "tiny": ModelConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                        max_seq_len=64, **_LLAMA),
    # Tests of mixtures of experts: tiny's shape with 4 SwiGLU experts, each token sent to 2.
    "tiny-moe": ModelConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                            max_seq_len=64, n_experts=4, experts_per_token=2, **{**_LLAMA, "family": "mixtral"}),
    # Tests of multi-head latent attention (DeepSeek-V2/V3's, every layer dense: no published model
    # is): tiny's width, 4 heads of 16 + 8 rotary query/key features and 16 value features, latents of 32.
    "tiny-mla": ModelConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, d_head=24, d_ff=128, max_seq_len=64,
                            norm_eps=1e-6, family_options={**_TINY_LATENT, **_DENSE_ROUTING},
                            **{**_LLAMA, "family": "deepseek_v3"}),
    # Tests of DeepSeek's mixture: tiny-mla's attention, its first layer dense, then 8 experts of 32
    # in 4 groups (2 kept), 2 per token by V3's sigmoid with the balancing bias, 2 shared experts.
    "tiny-deepseek": ModelConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, d_head=24, d_ff=128,
                                 max_seq_len=64, norm_eps=1e-6, n_experts=8, experts_per_token=2, expert_d_ff=32,
                                 shared_d_ff=64, norm_topk=True, router_aux_coef=0.0,
                                 family_options={**_TINY_LATENT, "first_dense": 1, "scoring": "sigmoid", "groups": 4,
                                                 "groups_kept": 2, "routed_scale": 2.5, "balance_rate": 0.001},
                                 **{**_LLAMA, "family": "deepseek_v3"}),
    "tiny-gpt2": ModelConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, d_ff=256,
                             max_seq_len=64, **_GPT),
    # The demo: about 17M parameters with an 8192-token vocabulary.
    "small": ModelConfig(vocab_size=8192, n_layers=6, d_model=384, n_heads=6, d_ff=1024,
                         max_seq_len=256, **_LLAMA),
    # Radford et al. 2019.
    "gpt2-124m": ModelConfig(vocab_size=50257, n_layers=12, d_model=768, n_heads=12, d_ff=3072,
                             max_seq_len=1024, **_GPT),
    "gpt2-1.5b": ModelConfig(vocab_size=50257, n_layers=48, d_model=1600, n_heads=25, d_ff=6400,
                             max_seq_len=1024, **_GPT),
    # Wang & Komatsuzaki 2021 (GPT-J-6B's config.json): attention and MLP from one LayerNorm, in
    # parallel; rotary positions on 64 of each head's 256 features; a head with a bias.
    "gpt-j-6b": ModelConfig(vocab_size=50400, n_layers=28, d_model=4096, n_heads=16, d_ff=16384,
                            max_seq_len=2048, norm="layernorm", position="rope", mlp="gelu",
                            tie_embeddings=False, bias=True, family="gptj", family_options={"rotary_dim": 64}),
    # Biderman et al. 2023 (Pythia-1.4B's config.json; GPT-NeoX's block): parallel attention and MLP,
    # rotary positions on a quarter of each head, the exact GELU; 1,414,647,808 parameters.
    "pythia-1.4b": ModelConfig(vocab_size=50304, n_layers=24, d_model=2048, n_heads=16, d_ff=8192,
                               max_seq_len=2048, norm="layernorm", position="rope", mlp="gelu",
                               family="gpt_neox", family_options={"rotary_pct": 0.25, "parallel_residual": True,
                                                                  "attention_bias": True, "hidden_act": "gelu"}),
    # Falcon-7B's and Falcon-40B's config.json (TII 2023; Almazrouei et al. 2023): GPT-NeoX's parallel
    # block with rotary over the whole head, no biases, the exact GELU, a 65,024-token vocabulary tied
    # to the head (the files set no tie_word_embeddings); 7B: 71 heads of 64 sharing one K/V head and
    # one LayerNorm, 6,921,720,704 parameters; 40B (new_decoder_architecture): 128 heads in 8 KV
    # groups, ln_attn and ln_mlp, 41,303,293,952 parameters (transformers' counts of those files).
    "falcon-7b": ModelConfig(vocab_size=65024, n_layers=32, d_model=4544, n_heads=71, n_kv_heads=1, d_ff=18176,
                             max_seq_len=2048, norm="layernorm", position="rope", mlp="gelu", tie_embeddings=True,
                             family="falcon", family_options={"parallel_attn": True, "norms": 1, "bias": False,
                                                              "activation": "gelu"}),
    "falcon-40b": ModelConfig(vocab_size=65024, n_layers=60, d_model=8192, n_heads=128, n_kv_heads=8, d_ff=32768,
                              max_seq_len=2048, norm="layernorm", position="rope", mlp="gelu", tie_embeddings=True,
                              family="falcon", family_options={"parallel_attn": True, "norms": 2, "bias": False,
                                                               "activation": "gelu"}),
    # StarCoder's config.json (BigCode: Li et al. 2023; model_type gpt_bigcode): GPT-2's block with
    # multi-query attention (48 heads of 128, one K/V head), 8,192 learned positions, a 49,152-token
    # vocabulary tied to the head; 15,517,456,384 parameters ("15.5B").
    "starcoder": ModelConfig(vocab_size=49152, n_layers=40, d_model=6144, n_heads=48, n_kv_heads=1, d_ff=24576,
                             max_seq_len=8192, **{**_GPT, "family": "gpt_bigcode"}),
    # Llama 3.2 1B (Meta 2024; the shape of its Hugging Face config.json): 16 layers, hidden 2048,
    # 32 heads with 8 KV heads, SwiGLU 8192, a 128,256-token vocabulary, tied embeddings, RoPE theta
    # 500,000; 1,235,814,400 parameters. The context here is Llama 3's pre-training length, 8192,
    # without the released model's llama3 RoPE scaling to 128K (see llama3.1-405b for that): the
    # shape the GPU check trains (bench/gpu_check.py).
    "llama-1b": ModelConfig(vocab_size=128256, n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192,
                            max_seq_len=8192, norm_eps=1e-5, rope_theta=500000.0,
                            **{**_LLAMA, "tie_embeddings": True}),
    # Touvron et al. 2023 (LLaMA) and LLaMA 2 (70B: grouped-query attention with 8 KV heads).
    "llama-7b": ModelConfig(vocab_size=32000, n_layers=32, d_model=4096, n_heads=32, d_ff=11008,
                            max_seq_len=2048, norm_eps=1e-6, **_LLAMA),
    "llama-13b": ModelConfig(vocab_size=32000, n_layers=40, d_model=5120, n_heads=40, d_ff=13824,
                             max_seq_len=2048, norm_eps=1e-6, **_LLAMA),
    "llama-65b": ModelConfig(vocab_size=32000, n_layers=80, d_model=8192, n_heads=64, d_ff=22016,
                             max_seq_len=2048, norm_eps=1e-6, **_LLAMA),
    "llama-70b": ModelConfig(vocab_size=32000, n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8,
                             d_ff=28672, max_seq_len=4096, norm_eps=1e-5, **_LLAMA),
    # Brown et al. 2020.
    "gpt3-175b": ModelConfig(vocab_size=50257, n_layers=96, d_model=12288, n_heads=96, d_ff=49152,
                             max_seq_len=2048, **_GPT),
    # BigScience 2022: ALiBi positions and a layernorm after the embedding.
    "bloom-176b": ModelConfig(vocab_size=250880, n_layers=70, d_model=14336, n_heads=112, d_ff=57344,
                              max_seq_len=2048, norm="layernorm", position="alibi", mlp="gelu",
                              tie_embeddings=True, bias=True, embedding_norm=True, family="bloom"),
    # Meta 2024, the Hugging Face config.json of Meta-Llama-3-8B / -70B: a 128,256-token vocabulary,
    # 8 KV heads, RoPE theta 500,000, an 8,192-token context; 8,030,261,248 and 70,553,706,496 parameters.
    "llama3-8b": ModelConfig(vocab_size=128256, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                             max_seq_len=8192, rope_theta=500000.0, **_LLAMA),
    "llama3-70b": ModelConfig(vocab_size=128256, n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                              max_seq_len=8192, rope_theta=500000.0, **_LLAMA),
    # Meta-Llama-3.1-8B's config.json: Llama 3 8B's shape, 131,072 positions through llama3 RoPE
    # scaling (the long-context planning examples, docs/cost-model.md); 8,030,261,248 parameters.
    "llama3.1-8b": ModelConfig(vocab_size=128256, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                               max_seq_len=131072, **_LLAMA31_ROPE, **_LLAMA),
    # Meta-Llama-3.1-405B's config.json: 126 layers, hidden 16384, 128 heads (8 KV), 131,072 positions
    # through llama3 RoPE scaling; 405,853,388,800 parameters.
    "llama3.1-405b": ModelConfig(vocab_size=128256, n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8,
                                 d_ff=53248, max_seq_len=131072, **_LLAMA31_ROPE, **_LLAMA),
    # Qwen2.5-7B / -72B's config.json (Qwen team 2024): biases on q, k, v; RoPE theta 1,000,000;
    # norm eps 1e-6; a 152,064-row vocabulary; 131,072 positions; 7,615,616,512 and 72,706,203,648 parameters.
    "qwen2.5-7b": ModelConfig(vocab_size=152064, n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4, d_ff=18944,
                              max_seq_len=131072, norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True,
                              **{**_LLAMA, "family": "qwen2"}),
    "qwen2.5-72b": ModelConfig(vocab_size=152064, n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=29568,
                               max_seq_len=131072, norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True,
                               **{**_LLAMA, "family": "qwen2"}),
    # Mistral-7B-v0.1's config.json (Jiang et al. 2023): a 4,096-token sliding window over a 32,768-position
    # context, 8 KV heads; 7,241,732,096 parameters.
    "mistral-7b": ModelConfig(vocab_size=32000, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                              max_seq_len=32768, sliding_window=4096, **{**_LLAMA, "family": "mistral"}),
    # gemma-7b's config.json (Gemma Team 2024): 16 heads of 256 over a 3,072 width, GeGLU 24,576,
    # a 256,000-token vocabulary tied to the head, (1 + w) RMSNorm, embeddings x sqrt(3072);
    # 8,537,680,896 parameters.
    "gemma-7b": ModelConfig(vocab_size=256000, n_layers=28, d_model=3072, n_heads=16, d_head=256, d_ff=24576,
                            max_seq_len=8192, norm="gemma_rmsnorm", mlp="geglu", tie_embeddings=True,
                            scale_embeddings=True, norm_eps=1e-6, family="gemma"),
    # gemma-2-9b's and gemma-2-27b's config.json (Gemma Team 2024b): Gemma's norms, GeGLU and tied
    # head in the sandwich block (four norms a layer), local layers (window 4,096) alternating with
    # global ones, soft caps of 50 (scores) and 30 (logits); 27B: heads of 128 with scores scaled by
    # 1/sqrt(144). 9,241,705,984 and 27,227,128,320 parameters.
    "gemma-2-9b": ModelConfig(vocab_size=256000, n_layers=42, d_model=3584, n_heads=16, n_kv_heads=8, d_head=256,
                              d_ff=14336, max_seq_len=8192, norm="gemma_rmsnorm", mlp="geglu", tie_embeddings=True,
                              scale_embeddings=True, norm_eps=1e-6, family="gemma2",
                              family_options={"attention_bias": False, "query_pre_attn_scalar": 256,
                                              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                                              "sliding_window": 4096, "layer_types": "LG"}),
    "gemma-2-27b": ModelConfig(vocab_size=256000, n_layers=46, d_model=4608, n_heads=32, n_kv_heads=16, d_head=128,
                               d_ff=36864, max_seq_len=8192, norm="gemma_rmsnorm", mlp="geglu", tie_embeddings=True,
                               scale_embeddings=True, norm_eps=1e-6, family="gemma2",
                               family_options={"attention_bias": False, "query_pre_attn_scalar": 144,
                                               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                                               "sliding_window": 4096, "layer_types": "LG"}),
    # gemma-3-1b-pt's config.json (Gemma Team 2025): Gemma 2's block with per-head q/k norms, five
    # local layers (window 512, RoPE base 10,000) for each global one (base 1,000,000), no soft caps,
    # a 262,144-token vocabulary; 999,885,952 parameters.
    "gemma-3-1b": ModelConfig(vocab_size=262144, n_layers=26, d_model=1152, n_heads=4, n_kv_heads=1, d_head=256,
                              d_ff=6912, max_seq_len=32768, norm="gemma_rmsnorm", mlp="geglu", tie_embeddings=True,
                              scale_embeddings=True, norm_eps=1e-6, rope_theta=1000000.0, family="gemma3",
                              family_options={"attention_bias": False, "query_pre_attn_scalar": 256,
                                              "attn_logit_softcapping": 0.0, "final_logit_softcapping": 0.0,
                                              "sliding_window": 512, "layer_types": "LLLLLG",
                                              "rope_local_base_freq": 10000.0, "rope_scaling_factor": 1.0}),
    # OLMo-2-1124-7B's config.json (OLMo et al. 2024): norms after the sub-blocks only, q/k norms over
    # the whole projections, RoPE theta 500,000, a 100,352-row vocabulary; 7,298,617,344 parameters.
    "olmo-2-7b": ModelConfig(vocab_size=100352, n_layers=32, d_model=4096, n_heads=32, d_ff=11008, max_seq_len=4096,
                             norm_eps=1e-6, rope_theta=500000.0, family_options={"attention_bias": False},
                             **{**_LLAMA, "family": "olmo2"}),
    # Mixtral-8x7B-v0.1's config.json (Jiang et al. 2024): Mistral 7B's attention (without its window),
    # 8 experts of 14,336 per block, 2 per token, RoPE theta 1,000,000, router_aux_loss_coef 0.02;
    # 46,702,792,704 parameters, 12,879,925,248 active per token.
    "mixtral-8x7b": ModelConfig(vocab_size=32000, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                                max_seq_len=32768, rope_theta=1000000.0, n_experts=8, experts_per_token=2,
                                router_aux_coef=0.02, **{**_LLAMA, "family": "mixtral"}),
    # Qwen1.5-MoE-A2.7B's config.json (model_type qwen2_moe, Qwen team 2024): 60 experts of 1,408,
    # 4 per token without renormalising, a shared expert of 5,632 behind a sigmoid gate, q/k/v
    # biases; 14,315,784,192 parameters, 2,689,173,504 active per token.
    "qwen2-moe-a2.7b": ModelConfig(vocab_size=151936, n_layers=24, d_model=2048, n_heads=16, d_ff=5632,
                                   max_seq_len=8192, norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True,
                                   n_experts=60, experts_per_token=4, expert_d_ff=1408, norm_topk=False,
                                   shared_d_ff=5632, gated_shared_expert=True, router_aux_coef=0.001,
                                   **{**_LLAMA, "family": "qwen2_moe"}),
    # Qwen3-30B-A3B's config.json (model_type qwen3_moe, Qwen team 2025): Qwen3's attention (32 heads
    # of 128 over a 2,048 width, 4 KV heads, q/k norms), 128 experts of 768 in every block, 8 per
    # token renormalised, no shared expert; 30,532,122,624 parameters, 3,353,032,704 active per token.
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, d_head=128,
                                 d_ff=6144, max_seq_len=40960, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
                                 n_experts=128, experts_per_token=8, expert_d_ff=768, norm_topk=True,
                                 router_aux_coef=0.001, **{**_LLAMA, "family": "qwen3_moe"}),
    # DeepSeek-V3's config.json (DeepSeek-AI 2024) before YaRN's extension (4K pretraining): MLA with a
    # query latent of 1,536 and a key/value latent of 512 over 128 heads, the first 3 of 61 layers
    # dense, then 256 experts of 2,048 in 8 groups (4 kept), 8 per token by sigmoid scores with the
    # balancing bias, times 2.5, one shared expert; the MTP module is not counted.
    "deepseek-v3": ModelConfig(vocab_size=129280, n_layers=61, d_model=7168, n_heads=128, d_head=192, d_ff=18432,
                               max_seq_len=4096, norm_eps=1e-6, n_experts=256, experts_per_token=8,
                               expert_d_ff=2048, shared_d_ff=2048, norm_topk=True, router_aux_coef=0.0,
                               family_options=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                                   qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
                                                   first_dense=3, scoring="sigmoid", groups=8, groups_kept=4,
                                                   routed_scale=2.5, balance_rate=0.001),
                               **{**_LLAMA, "family": "deepseek_v3"}),
    # DeepSeek-V2-Lite's config.json (model_type deepseek_v2) before YaRN: one q_proj, the first layer
    # dense, then 64 experts of 1,408, 6 per token by softmax (greedy), 2 shared experts.
    "deepseek-v2-lite": ModelConfig(vocab_size=102400, n_layers=27, d_model=2048, n_heads=16, d_head=192,
                                    d_ff=10944, max_seq_len=4096, norm_eps=1e-6, n_experts=64, experts_per_token=6,
                                    expert_d_ff=1408, shared_d_ff=2816, norm_topk=False, router_aux_coef=0.001,
                                    family_options=dict(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
                                                        qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
                                                        first_dense=1, scoring="softmax", groups=1, groups_kept=1,
                                                        routed_scale=1.0, balance_rate=0.0),
                                    **{**_LLAMA, "family": "deepseek_v3"}),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]
