import dataclasses

import pytest
import torch
from architectures import ARCHITECTURES

from strata.infer.generate import Sampling, generate
from strata.infer.kv_cache import KVCache
from strata.model.config import ModelConfig
from strata.model.initial_values import initial_value
from strata.model.presets import PRESETS, get_preset
from strata.model.transformer import build_model

# Published sizes: GPT-2 small with tied embeddings, LLaMA-7B (Touvron et al. 2023), and the rest
# as their model cards count them.
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "gpt2-1.5b": 1_557_611_200,
    "llama-1b": 1_235_814_400,  # Llama 3.2 1B, tied embeddings
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-65b": 65_285_660_672,
    "llama-70b": 68_976_648_192,
    "bloom-176b": 176_247_271_424,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published(name):
    cfg = get_preset(name)
    model = build_model(cfg, seed=None)  # meta device: counts without allocating
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert cfg.num_params() == PUBLISHED[name]


def test_every_preset_builds_on_meta_and_counts_agree():
    for name, cfg in PRESETS.items():
        model = build_model(cfg, seed=None)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params(), name
    assert PRESETS["tiny"].num_params() < 1_000_000
    assert 10e6 <= PRESETS["small"].num_params() <= 30e6


def test_flops_per_token_is_6_per_multiplied_weight_plus_attention():
    cfg = get_preset("gpt2-124m")
    # 6 x the 12 blocks' matrices and the (tied) head; not the lookups (50257 x 768 tokens, 1024 x 768
    # positions), nor the norms and biases
    matmuls = 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 768 * 50257
    assert cfg.flops_per_token() == 6 * matmuls + 12 * 12 * 768 * 1024 == 854_438_400
    assert cfg.flops_per_token(seq_len=512) == 6 * matmuls + 12 * 12 * 768 * 512
    llama = 6_738_415_616 - 32000 * 4096 - (2 * 32 + 1) * 4096  # less the embedding and the 65 norms; head kept
    assert get_preset("llama-7b").flops_per_token() == 6 * llama + 12 * 32 * 4096 * 2048


def test_initial_weights_depend_on_seed_and_name_only():
    a = initial_value("blocks.0.attn.wq.weight", (8, 4), seed=3, n_layers=2)
    assert torch.equal(a, initial_value("blocks.0.attn.wq.weight", (8, 4), seed=3, n_layers=2))
    assert not torch.equal(a, initial_value("blocks.1.attn.wq.weight", (8, 4), seed=3, n_layers=2))
    assert not torch.equal(a, initial_value("blocks.0.attn.wq.weight", (8, 4), seed=4, n_layers=2))
    m1, m2 = build_model(get_preset("tiny"), seed=5), build_model(get_preset("tiny"), seed=5)
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), n


def test_invalid_shape_is_refused():
    with pytest.raises(ValueError, match="n_kv_heads"):
        dataclasses.replace(get_preset("tiny"), n_kv_heads=3).validate()




@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_kv_cache_decoding_equals_full_recomputation(arch):
    cfg: ModelConfig = ARCHITECTURES[arch]
    model = build_model(cfg, dtype=torch.float32, seed=1).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model, batch=2, max_len=20)
        pieces = [model(tokens[:, :7], cache=cache)]  # prefill 7, then one at a time
        pieces += [model(tokens[:, i:i + 1], cache=cache) for i in range(7, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_argmax_of_full_forward():
    cfg = get_preset("tiny")
    model = build_model(cfg, dtype=torch.float64, seed=2)
    prompt = torch.tensor([[1, 2, 3, 4]])
    produced = torch.cat(list(generate(model, prompt.tolist(), max_new_tokens=10)))
    sequence = prompt[0].tolist()
    with torch.no_grad():
        for _ in range(10):  # the slow way: recompute everything for each new token
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
    assert produced.tolist() == sequence[4:]


def test_sampling_is_seeded_and_respects_top_k():
    model = build_model(get_preset("tiny"), seed=2)
    prompt = torch.tensor([[5, 6]])
    run = lambda seed, **kw: torch.cat(list(generate(model, prompt.tolist(), 12,  # noqa: E731
                                                     Sampling(temperature=1.0, seed=seed, **kw)))).tolist()
    assert run(7) == run(7)
    assert run(7) != run(8)
    with torch.no_grad():
        logits = model(prompt)[0, -1]
    allowed = set(torch.topk(logits, 1).indices.tolist())
    assert run(7, top_k=1)[0] in allowed
