"""Gemma 2 and Gemma 3 (strata/model/families/gemma2.py, gemma3.py; their block:
strata/model/sandwich_block.py): the soft-capped core attention against transformers' eager one,
both caps bending what they cap (the final one in the chunked loss too, tied head or not), the
greedy tokens of the KV cache past every window equal transformers' generate, layer_types read as
a repeating pattern and written back, the released Gemma 3 config.json read as the preset, what
is refused (in one line), and the presets' counts. Logits, round trip, counts and layouts:
tests/test_families.py and test_family_parallel.py, through tests/hf_cases.py."""


import pytest
import torch
import torch.nn.functional as F
import transformers
from hf_cases import VOCAB, assert_refused_in_one_line, hf_configs, sharp_and_converted

import strata.model.loss as chunking
from strata.checkpoint.hf import hf_config_from_model, model_config_from_hf
from strata.model.attention_blocks import CausalMask
from strata.model.config import ModelConfig
from strata.model.families import FAMILIES
from strata.model.families.gemma2 import layer_pattern, layer_types_to_hf
from strata.model.presets import PRESETS
from strata.model.sandwich_block import capped_attention
from strata.model.transformer import build_model


def strata_config(case: str) -> ModelConfig:
    return model_config_from_hf(hf_configs()[case].to_dict(), case)


def without(cfg: ModelConfig, **options) -> ModelConfig:
    """cfg with these family options changed."""
    return ModelConfig(**{**cfg.to_dict(), "family_options": {**dict(cfg.family_options), **options}})


# --- the soft caps ----------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 4])
def test_capped_attention_is_transformers_eager_attention(window):
    """4 query heads reading 1 KV head, 9 queries after 3 cached keys (the causal diagonal shifted),
    with and without a window: transformers' eager Gemma 2 attention with its mask."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 16, generator=g)  # fp32: transformers' softmax computes in it
    k, v = (torch.randn(2, 1, 12, 16, generator=g) for _ in range(2))
    q_slot, k_slot = torch.arange(3, 12)[:, None], torch.arange(12)[None, :]
    hidden = (k_slot > q_slot) | ((k_slot <= q_slot - window) if window else False)
    mask = torch.zeros(9, 12).masked_fill(hidden, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 4, False
    theirs, _ = eager_attention_forward(module, q, k, v, mask[None, None], scaling=16 ** -0.5, softcap=1.5)
    ours = capped_attention(q, k, v, CausalMask(window), 1.5)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(capped_attention(q, k, v, mask, 1.5).transpose(1, 2), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_capped_attention_by_tiles_has_the_gradients_of_the_whole_scores(window):
    """Tiles of 3 queries (8 tiles, the keys repeated to 4 query heads, queries after 4 earlier
    keys): output and gradients equal autograd's through the whole capped scores, in fp64."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 22, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 26, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 4, 22, 8, generator=g, dtype=torch.float64)
    q_slot, k_slot = torch.arange(4, 26)[:, None], torch.arange(26)[None, :]
    hidden = (k_slot > q_slot) | ((k_slot <= q_slot - window) if window else False)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 8 ** 0.5
    expected = torch.softmax((2.0 * torch.tanh(scores / 2.0)).masked_fill(hidden, float("-inf")), dim=-1) @ \
        v.repeat_interleave(2, dim=1)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    ours = capped_attention(q, k, v, CausalMask(window), 2.0, tile_elements=2 * 4 * 26 * 3)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(torch.autograd.grad(ours, (q, k, v), grad), expected_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_both_soft_caps_bend_what_they_cap(tmp_path):
    """The converted case's logits stay within the final cap (2), and each cap changes them."""
    _, converted = sharp_and_converted("gemma2", tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))

    def logits(cfg):
        model = build_model(cfg, seed=None).to_empty(device="cpu")
        model.load_state_dict(converted.state_dict())
        model.reset_buffers()
        with torch.no_grad():
            return model(tokens)
    capped = logits(converted.cfg)
    assert capped.abs().max() < 2.0
    for option in ("attn_logit_softcapping", "final_logit_softcapping"):
        assert (logits(without(converted.cfg, **{option: 0.0})) - capped).abs().max() > 1e-2, option


@pytest.mark.parametrize("tied", [True, False])
def test_the_final_cap_holds_in_the_chunked_loss(tied, monkeypatch):
    """Chunks of 4 positions (a tied head, and an untied one run without its hooks): the loss and
    every gradient are the cross-entropy of the capped logits, unchunked."""
    cfg = strata_config("gemma2").with_overrides(tie_embeddings=tied)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))

    def loss_and_grads(budget: int | None):
        model = build_model(cfg, dtype=torch.float64, seed=1)
        if budget is None:  # the reference: the logits as generation reads them, then the loss
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        else:
            monkeypatch.setattr(chunking, "LOGITS_CHUNK_BYTES", budget)
            assert chunking.chunk_bounds(2, 16, VOCAB) is not None
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss, [p.grad for p in model.parameters()]
    (expected, expected_grads), (chunked, grads) = loss_and_grads(None), loss_and_grads(2 * 4 * 4 * VOCAB)
    torch.testing.assert_close(chunked, expected, rtol=1e-12, atol=0)
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-14)


# --- config.json ------------------------------------------------------------------------------------
def test_layer_types_read_as_their_repeating_pattern_and_written_back():
    def read(**hf):
        return layer_pattern(hf, "test", 6)
    assert read(num_hidden_layers=26) == "LLLLLG"  # sliding_window_pattern 6's default, 26 layers
    assert read(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"]) == "LGG"
    assert read(num_hidden_layers=4, layer_types=["full_attention"] * 4) == "G"
    assert layer_types_to_hf("LLLLLG", 26) == transformers.Gemma3TextConfig(num_hidden_layers=26).layer_types
    assert layer_types_to_hf("LG", 5) == transformers.Gemma2Config(num_hidden_layers=5).layer_types


# gemma-3-1b-pt's config.json as released (transformers 4.50's form: the two RoPE bases apart)
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
             "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": None, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
             "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
             "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144}


# gemma-2-9b's config.json as released (transformers 4.42's form: no layer_types)
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
             "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02,
             "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
             "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
             "sliding_window_size": 4096, "torch_dtype": "float32", "use_cache": True, "vocab_size": 256000}


def test_the_released_gemma2_config_reads_as_the_preset():
    assert model_config_from_hf(GEMMA2_9B, "gemma-2-9b") == PRESETS["gemma-2-9b"]


def test_the_released_gemma3_config_reads_as_the_preset_and_writes_back_in_its_form():
    cfg = model_config_from_hf(GEMMA3_1B, "gemma-3-1b")
    assert cfg == PRESETS["gemma-3-1b"]
    back = hf_config_from_model(cfg, GEMMA3_1B)
    assert (back["rope_theta"], back["rope_local_base_freq"], back["rope_scaling"]) == (1000000.0, 10000.0, None)
    assert "rope_parameters" not in back and back["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]


@pytest.mark.parametrize("case,change,needle", [
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types="),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}},
     "the sliding_attention layers' rope_type"),
])
def test_unsupported_options_are_one_line_naming_the_key(case, change, needle, tmp_path, capsys):
    assert_refused_in_one_line(case, change, needle, tmp_path, capsys)


def test_context_parallelism_is_refused_for_a_cap_or_a_window_on_some_layers():
    """What the family tells the layout rules (checked before processes start): the ring merges
    fused kernels' blocks, which neither cap scores nor take a window per layer."""
    gemma2, gemma3 = strata_config("gemma2"), strata_config("gemma3")
    refusal = FAMILIES["gemma2"].block.context_refusal
    assert "soft-capping" in refusal(gemma2)
    assert "sliding window on some layers" in refusal(without(gemma2, attn_logit_softcapping=0.0))
    assert refusal(without(gemma2, attn_logit_softcapping=0.0, sliding_window=0)) is None
    assert "sliding window on some layers" in FAMILIES["gemma3"].block.context_refusal(gemma3)


# --- presets ----------------------------------------------------------------------------------------
PUBLISHED = {"gemma-2-9b": 9_241_705_984, "gemma-2-27b": 27_227_128_320, "gemma-3-1b": 999_885_952}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_equal_transformers_on_the_meta_device(name):
    cfg = PRESETS[name]
    hf = hf_config_from_model(cfg, None)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert cfg.num_params() == model.num_parameters() == PUBLISHED[name]
    assert cfg.num_params() == sum(p.numel() for p in build_model(cfg, seed=None).parameters())


@pytest.mark.parametrize("case,needle", [("gemma2", "attention logit soft-capping"),
                                         ("gemma3", "a sliding window on some layers")])
def test_context_parallelism_is_refused_before_processes_start(case, needle):
    """The ring would drop the cap and apply one window to every layer (a Gemma 2 run under --cp 2
    gave losses 1.1e-2 off): rules/context.py asks the block (OwnBlock.context_refusal)."""
    from strata.errors import ConfigError
    from strata.rules.context import check_context
    with pytest.raises(ConfigError, match=needle):
        check_context(strata_config(case), 2, "ring", 1, "1d", False, 32)
    check_context(strata_config("olmo2"), 2, "ring", 1, "1d", False, 32)  # OLMo 2's attention is plain
