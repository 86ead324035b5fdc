"""The random-weight Hugging Face models of every family with awkward shapes, shared by
tests/test_families.py and tests/test_family_parallel.py."""

import torch
import transformers  # the dev extra's (pip install -e '.[dev]'): a missing one fails, not skips

VOCAB = 251  # odd: no tensor-parallel degree divides it
SMALL = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}


def hf_configs():
    t = transformers
    return {
        "llama2": t.LlamaConfig(**SMALL, num_attention_heads=6, num_key_value_heads=1, max_position_embeddings=64,
                                rms_norm_eps=1e-5),
        # head_dim 16 with theta 500,000 puts wavelengths in all three of llama3's bands (< 16, 16-64, > 64)
        "llama3.1": t.LlamaConfig(**{**SMALL, "hidden_size": 64}, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, tie_word_embeddings=True, rope_parameters=LLAMA31_ROPE),
        "qwen2": t.Qwen2Config(**SMALL, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64),
        "qwen3": t.Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                               max_position_embeddings=64),
        "mistral": t.MistralConfig(**SMALL, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                   sliding_window=16),
        "gemma": t.GemmaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                               max_position_embeddings=64),
        # Phi-3: fused qkv_proj and gate_up_proj, GQA with one KV head, a window shorter than the prompts
        "phi3": t.Phi3Config(**SMALL, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                             sliding_window=16, pad_token_id=0),
        "gpt2": t.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, n_positions=64, bos_token_id=1,
                             eos_token_id=2),
        "bloom": t.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6),  # 6 heads: ALiBi's odd rule
        # GPT-NeoX (Pythia): the parallel residual, a fused per-head query_key_value, rotary on 4 of
        # each head's 16 features (the other 12 pass), the exact GELU, an untied embed_out
        "gpt_neox": t.GPTNeoXConfig(**{**SMALL, "hidden_size": 64}, num_attention_heads=4, max_position_embeddings=64,
                                    rotary_pct=0.25, bos_token_id=1, eos_token_id=2),
        # ... without the parallel residual, and int(16 x 0.3125) = 5 rotary features: transformers
        # rotates 6 (three frequencies of theta^(-2i/5))
        "gpt_neox-sequential": t.GPTNeoXConfig(**{**SMALL, "hidden_size": 64}, num_attention_heads=4,
                                               max_position_embeddings=64, rotary_pct=0.3125,
                                               use_parallel_residual=False, bos_token_id=1, eos_token_id=2),
        # GPT-J: one LayerNorm for both branches, rotary on 8 of each head's 12 features in
        # interleaved pairs, no attention biases, a head with a bias
        "gptj": t.GPTJConfig(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=64, rotary_dim=8,
                             n_inner=80, bos_token_id=1, eos_token_id=2),
        # Gemma 2: four norms a block, a local layer (window 8) then a global one, scores scaled by
        # 1/sqrt(24) (heads of 16) and both soft caps small enough to bend (1 and 2), one KV head
        "gemma2": t.Gemma2Config(**SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                 max_position_embeddings=64, sliding_window=8, query_pre_attn_scalar=24,
                                 attn_logit_softcapping=1.0, final_logit_softcapping=2.0),
        # OLMo 2: norms after the sub-blocks only, q/k norms over the whole projections, one KV head
        "olmo2": t.Olmo2Config(**SMALL, num_attention_heads=6, num_key_value_heads=1, max_position_embeddings=64,
                               pad_token_id=1, bos_token_id=None, eos_token_id=2),
        # Gemma 3: Gemma 2's block with per-head q/k norms, a local layer with its own RoPE base, a
        # global one with linear RoPE scaling (factor 8), no soft caps
        "gemma3": t.Gemma3TextConfig(**SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                     max_position_embeddings=64, sliding_window=8, query_pre_attn_scalar=24,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                         "rope_theta": 1e6},
                                                      "sliding_attention": {"rope_type": "default",
                                                                            "rope_theta": 1e4}}),
        # Falcon-40B's new decoder architecture: ln_attn and ln_mlp in parallel, one KV group (fewer
        # than ranks) in a fused per-group query_key_value, rotary over 12-wide heads, no biases
        "falcon": t.FalconConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                 num_kv_heads=1, new_decoder_architecture=True, ffn_hidden_size=80,
                                 max_position_embeddings=64, bos_token_id=1, eos_token_id=2),
        # StarCoder: GPT-2's block with multi-query attention (one K/V head for 6), nn.Linear weights
        "gpt_bigcode": t.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, n_positions=64,
                                          n_inner=80, bos_token_id=1, eos_token_id=2),
        # Qwen3-MoE: Qwen3's per-head q/k norms (head_dim 16 != 48 / 4, one KV head) and 6 experts of
        # 24 (not intermediate_size's 80) in every block, 2 per token renormalised, no shared expert
        "qwen3_moe": t.Qwen3MoeConfig(**SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=64, num_experts=6, num_experts_per_tok=2,
                                      moe_intermediate_size=24, norm_topk_prob=True),
        # ... with the mixture in some layers only (4 layers, every 2nd, but not layer 3): layer 1 routes,
        # layers 0, 2 and 3 have a dense MLP of intermediate_size
        "qwen3_moe-sparse": t.Qwen3MoeConfig(**{**SMALL, "num_hidden_layers": 4}, num_attention_heads=4,
                                             num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                                             num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                                             norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3]),
        # DeepSeek-V3's multi-head latent attention, every layer dense: a query latent of 24 and a
        # key/value latent of 16 for 4 heads, q/k heads 8 + 4 rotary (interleaved) wide, v heads 6
        "deepseek_v3": t.DeepseekV3Config(**SMALL, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                          first_k_dense_replace=2, max_position_embeddings=64, bos_token_id=1,
                                          eos_token_id=2),
        # DeepSeek-V3's mixture: the first layer dense, then 8 experts of 16 in 4 groups (2 kept), 2 per
        # token by sigmoid scores plus the experts' (random) bias, renormalised, times 2.5; 2 shared experts
        "deepseek_v3-moe": t.DeepseekV3Config(**SMALL, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                                              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                              first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2,
                                              num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=16,
                                              routed_scaling_factor=2.5, max_position_embeddings=64, bos_token_id=1,
                                              eos_token_id=2),
    }


CASES = list(hf_configs())


def grid_configs():
    """Families whose main case has one KV head, with two (2-D tensor parallelism needs a multiple
    of q = 2): Qwen3's per-head norms and Gemma's (1 + w) norm and scaled embedding on a grid."""
    t = transformers
    return {"qwen3-kv2": t.Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64),
            "gemma-kv2": t.GemmaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64)}


def hf_model(case: str):
    """The case's random-weight transformers model (`random_model`)."""
    return random_model({**hf_configs(), **grid_configs()}[case])


def random_model(config):
    """A random-weight transformers model of `config`; every parameter moved off its initial value
    (norm weights included, so a name swapped between two norms would show)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # DeepSeek-V3's expert bias: state that steers its routing
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return model


def sharp_and_converted(case: str, root):
    """The case's random model with its weights x 3 (sharper logits: greedy choices far from ties),
    saved under root/hf and converted by `strata convert` to root/ck: (transformers', strata's)."""
    from strata.cli import main as strata_main
    from strata.infer.session import load_for_inference
    model = hf_model(case)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(root / "hf")
    assert strata_main(["convert", "--from-hf", str(root / "hf"), "--out", str(root / "ck")]) == 0
    return model, load_for_inference(str(root / "ck"))[0]


def assert_refused_in_one_line(case: str, change: dict, needle: str, tmp_path, capsys) -> None:
    """The case's config.json with `change`, read by `strata plan`: exit 2, one line naming it."""
    import json

    from strata.cli import main as strata_main
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf_configs()[case].to_dict(), **change}))
    assert strata_main(["plan", "--model", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1, err


def assert_greedy_tokens_equal_transformers(case: str, root, new_tokens: int = 40) -> None:
    """Two prompts of 7 and 20 tokens, left-padded to one batch through strata's KV cache: each
    row's greedy tokens (its positions read per row, past the padding; every window passed) are
    transformers' `generate` for that prompt alone. Neither side stops at an end token."""
    from strata.infer.generate import generate
    model, ours = sharp_and_converted(case, root)
    model.generation_config.eos_token_id = None
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (1, length), generator=generator) for length in (7, 20)]
    produced = torch.stack(list(generate(ours, [p[0].tolist() for p in prompts], max_new_tokens=new_tokens)), dim=1)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0)[0, prompt.shape[1]:]
        assert torch.equal(produced[row], expected), row
