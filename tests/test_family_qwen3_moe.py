"""Qwen3-MoE (strata/model/families/qwen3_moe.py) beyond what every family case gets from
test_families.py and test_family_parallel.py (hf_cases' "qwen3_moe": logits, round trip, planner
count, tp2 / pp2 / dp2 x tp2 ZeRO-1): the file keeps each expert's matrices and strata stacks them,
40 greedy tokens equal transformers' and equal themselves under --ep 2, the router's auxiliary loss
is transformers' load_balancing_loss_func per layer, a window on every layer, both keys the
number of experts is written under, the released Qwen3-30B-A3B config.json and its preset, and
the refusals (dense blocks, biases, context parallelism) in one line."""

import dataclasses

import pytest
import torch
import transformers
from hf_cases import VOCAB, assert_refused_in_one_line, hf_configs, hf_model, random_model, sharp_and_converted
from safetensors.torch import load_file
from test_families import max_relative_difference
from test_families import test_preset_counts_equal_transformers_on_the_meta_device as preset_counts_equal_transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from strata.checkpoint.hf import hf_config_from_model, model_config_from_hf
from strata.cli import main as strata_main
from strata.infer.generate import generate
from strata.infer.session import load_for_inference
from strata.model.presets import PRESETS
from strata.model.transformer import build_model

from cli_runner import generated_lines

CASE = "qwen3_moe"


def converted(root, config=None):
    """The case's model (or one of `config`), moved off its initial values, saved by transformers
    under root/hf and converted into root/ck: (the transformers model, the checkpoint's path)."""
    model = hf_model(CASE) if config is None else random_model(config)
    model.save_pretrained(root / "hf")
    assert strata_main(["convert", "--from-hf", str(root / "hf"), "--out", str(root / "ck")]) == 0
    return model, str(root / "ck")



def case_config(**changes):
    return transformers.Qwen3MoeConfig(**{**hf_configs()[CASE].to_dict(), **changes})


def test_the_file_keeps_each_experts_matrices_and_strata_stacks_them_without_a_shared_expert(tmp_path):
    _, checkpoint = converted(tmp_path)
    keys = set(load_file(str(tmp_path / "hf" / "model.safetensors")))
    assert {f"model.layers.1.mlp.experts.5.{p}_proj.weight" for p in ("gate", "up", "down")} <= keys
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.q_norm.weight"} <= keys
    ours, _ = load_for_inference(checkpoint)
    mlp = ours.blocks["1"].mlp
    assert mlp.experts.w_down.shape == (6, 48, 24) and mlp.router.weight.shape == (6, 48)
    assert (mlp.shared, mlp.shared_gate, mlp.norm_topk) == (None, None, True)
    assert ours.blocks["0"].attn.q_norm.weight.shape == (16,)


def test_40_greedy_tokens_equal_transformers(tmp_path):
    theirs, ours = sharp_and_converted(CASE, tmp_path)
    prompts = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs.generate(prompts, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                   pad_token_id=0)[:, 20:]
    produced = torch.stack(list(generate(ours, prompts.tolist(), max_new_tokens=40)), dim=1)
    assert torch.equal(produced, expected)


def test_greedy_tokens_under_ep_2_equal_one_process(tmp_path):
    """`strata generate` with the 6 experts split 3 and 3 over 2 processes (tokens travel to their
    experts and back), token for token as in one process."""
    _, checkpoint = converted(tmp_path)
    prompts = ("5,17,42", "1,2,3,4,5,6,7,8,9,10,11", "7")
    single = generated_lines(checkpoint, prompts, 40, "--dtype", "fp64")
    assert generated_lines(checkpoint, prompts, 40, "--dtype", "fp64", "--ep", 2) == single


@pytest.mark.parametrize("layers", [1, 2])
def test_the_auxiliary_loss_is_transformers_load_balancing_loss_of_each_layer(layers, tmp_path):
    """strata's auxiliary loss is router_aux_loss_coef x the mean over layers of transformers'
    load_balancing_loss_func of each layer's router logits. With one layer that is exactly
    transformers' aux_loss (output_router_logits); with more, transformers pools every layer's
    assignments and probabilities before multiplying them, which a pipeline stage cannot do
    without its neighbours' routing (docs/architecture.md: per layer, averaged)."""
    theirs, checkpoint = converted(tmp_path, case_config(num_hidden_layers=layers, router_aux_loss_coef=0.3))
    ours, _ = load_for_inference(checkpoint, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    ours.train()
    ours(tokens)
    aux = ours.router_losses.take()["aux_loss"]
    with torch.no_grad():
        out = theirs(tokens, output_router_logits=True)
    per_layer = [load_balancing_loss_func((logits,), 6, 2) for logits in out.router_logits]
    assert len(per_layer) == layers
    expected = 0.3 * torch.stack(per_layer).double().mean()
    torch.testing.assert_close(aux, expected, rtol=1e-6, atol=0)  # transformers sums in fp32
    if layers == 1:
        torch.testing.assert_close(aux, 0.3 * out.aux_loss.double(), rtol=1e-6, atol=0)


def test_a_window_on_every_layer_gives_transformers_logits(tmp_path):
    """use_sliding_window: transformers 5 windows every layer (16 here, inside 40-token prompts)."""
    theirs, checkpoint = converted(tmp_path, case_config(use_sliding_window=True, sliding_window=16))
    ours, _ = load_for_inference(checkpoint)
    assert ours.cfg.sliding_window == 16
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    unwindowed = build_model(dataclasses.replace(ours.cfg, sliding_window=None), seed=0)
    unwindowed.load_state_dict(ours.state_dict())
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert max_relative_difference(ours(tokens), expected) < 1e-4
        assert max_relative_difference(unwindowed.eval()(tokens), expected) > 1e-3  # the window matters here
    assert hf_config_from_model(ours.cfg, None)["use_sliding_window"] is True


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
def test_the_number_of_experts_is_read_and_written_under_the_files_key(key):
    hf = {k: v for k, v in hf_configs()[CASE].to_dict().items() if k not in ("num_experts", "num_local_experts")}
    cfg = model_config_from_hf({**hf, key: 6}, "test")
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_width, cfg.norm_topk) == (6, 2, 24, True)
    written = hf_config_from_model(cfg, {**hf, key: 6})
    other, = {"num_experts", "num_local_experts"} - {key}
    assert written[key] == 6 and other not in written


# The released config.json (Qwen/Qwen3-30B-A3B's repository, written by transformers 4.51).
RELEASED = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
            "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
            "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
            "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
            "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
            "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_the_released_config_json_reads_as_the_preset_with_the_published_counts():
    cfg = model_config_from_hf(RELEASED, "qwen3-30b-a3b")
    assert cfg == PRESETS["qwen3-30b-a3b"]
    assert (cfg.num_params(), cfg.active_params()) == (30_532_122_624, 3_353_032_704)  # "30.5B, 3.3B activated"


def test_the_preset_counts_equal_transformers_on_the_meta_device():
    preset_counts_equal_transformers("qwen3-30b-a3b")


def test_flops_count_k_experts_and_the_query_width():
    cfg = PRESETS["qwen3-30b-a3b"]
    attention = 2 * 2048 * 4096 + 2 * 2048 * 512  # q and o over 32 x 128, k and v over 4 x 128
    block = attention + 2048 * 128 + 8 * 3 * 2048 * 768  # the router, 8 of the 128 experts
    assert cfg.block_matmul_params() == block
    assert cfg.flops_per_token(4096) == 6 * (48 * block + 2048 * 151936) + 12 * 48 * 4096 * 4096


# --- what is refused, in one line naming the key ----------------------------------------------------
@pytest.mark.parametrize("change,needle", [
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a whole number >= 1"),
    ({"mlp_only_layers": [2]}, "mlp_only_layers=[2] must list layers 0..1"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"num_local_experts": 0}, "num_local_experts=0 must be a whole number >= 1"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_unsupported_options_are_one_line_naming_the_key(change, needle, tmp_path, capsys):
    assert_refused_in_one_line(CASE, change, needle, tmp_path, capsys)


def test_context_parallelism_is_refused_before_processes_start(tmp_path, capsys):
    """The router's load-balancing loss is a product of averages over whole sequences."""
    _, checkpoint = converted(tmp_path)
    capsys.readouterr()
    assert strata_main(["train", "--init-from", checkpoint, "--nproc", "2", "--cp", "2", "--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert "--cp 2: not with a mixture of experts" in err and err.count("\n") == 1, err


def test_a_model_with_a_shared_expert_is_not_written_as_qwen3_moe():
    from strata.errors import ConfigError
    cfg = dataclasses.replace(PRESETS["qwen3-30b-a3b"], shared_d_ff=512)
    with pytest.raises(ConfigError, match="cannot hold this model's shared_d_ff=512"):
        hf_config_from_model(cfg, None)
