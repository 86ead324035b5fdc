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
    """A random-weight transformers model; every parameter moved off its initial value (norm
    weights included, so a name swapped between two norms would show)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config({**hf_configs(), **grid_configs()}[case]).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
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
