"""DeepSeek's mixture (strata/model/deepseek_moe.py, families/deepseek_v3.py): the routers choose
and weigh as transformers' DeepseekV2TopkRouter and DeepseekV3TopkRouter; V3's balancing bias
follows its rule, written here apart from the runtime (each step, +gamma where an expert took fewer
than the mean of the step's assignments, -gamma where more), and every layout keeps it as one
process does (the loads summed over data-parallel ranks; each stage its own layers); a checkpoint
keeps it; the first dense layers and the mixtures count and cost what they are. Logits, round trip,
greedy tokens and the tp/pp/dp layouts of the converted case: test_families.py,
test_family_parallel.py, test_own_blocks.py (case "deepseek_v3-moe")."""

import pytest
import torch
import transformers
from family_runs import deepseek_run
from hf_cases import hf_configs, hf_model
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from strata.checkpoint.hf import hf_config_from_model, model_config_from_hf
from strata.cli import main as strata_main
from strata.model.deepseek_moe import DeepSeekMoE, Routing
from strata.model.presets import PRESETS
from strata.model.transformer import build_model
from strata.rules.pipeline_cut import make_layout, unit_costs

from cli_runner import generated_lines, run_strata
from distributed import run_on_ranks

RATE = PRESETS["tiny-deepseek"].family_options  # (name, value) pairs
GAMMA = dict(RATE)["balance_rate"]


# --- the routers against transformers' -----------------------------------------------------------------
ROUTERS = {
    "v2-greedy": (transformers.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3,
                                                topk_method="greedy", routed_scaling_factor=1.5),
                  Routing("softmax", 1, 1, 1.5, 0.0), False),
    "v2-group-limited": (transformers.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3,
                                                       topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                       routed_scaling_factor=1.5),
                         Routing("softmax", 4, 2, 1.5, 0.0), False),
    "v3": (transformers.DeepseekV3Config(hidden_size=16, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                         topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
           Routing("sigmoid", 4, 2, 2.5, GAMMA), True),
}


@pytest.mark.parametrize("router", ROUTERS)
def test_the_router_chooses_and_weighs_as_transformers(router):
    config, routing, norm_topk = ROUTERS[router]
    theirs = (v2.DeepseekV2TopkRouter if routing.scoring == "softmax" else v3.DeepseekV3TopkRouter)(config)
    cfg = PRESETS["tiny-deepseek"].with_overrides(d_model=16, n_experts=8, experts_per_token=3, norm_topk=norm_topk)
    ours = DeepSeekMoE(cfg, None, routing)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(8, 16, generator=generator))
        if routing.scoring == "sigmoid":  # a bias large enough to move choices
            theirs.e_score_correction_bias.copy_(torch.randn(8, generator=generator) * 0.3)
            ours.router.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
        x = torch.randn(64, 16, generator=generator)
        _, their_weights, their_experts = theirs(x)
        weights, chosen, _ = ours.route(x @ theirs.weight.T)
    # transformers' top-k is unsorted: compare each token's (expert, weight) pairs as sets
    for token in range(64):
        mine = dict(zip(chosen[token].tolist(), weights[token].tolist()))
        theirs_ = dict(zip(their_experts[token].tolist(), their_weights[token].tolist()))
        assert mine.keys() == theirs_.keys(), token
        for expert, weight in mine.items():
            assert weight == pytest.approx(theirs_[expert], rel=1e-6, abs=0), (token, expert)
    if routing.groups > 1:  # every token's experts from at most groups_kept groups
        assert all(len({e // 2 for e in row}) <= 2 for row in chosen.tolist())


# --- V3's balancing bias ------------------------------------------------------------------------------
def _rule(loads: list[list[int]]) -> torch.Tensor:
    """The bias after these steps' loads (the one layer of experts): the rule, step by step."""
    bias = torch.zeros(len(loads[0]), dtype=torch.float64)
    for load in loads:
        load = torch.tensor(load, dtype=torch.float64)
        bias = bias + torch.sign(load.mean() - load) * GAMMA
    return bias


@pytest.fixture(scope="module")
def one_process():
    return deepseek_run({})


def test_one_process_moves_the_bias_by_the_rule(one_process):
    losses, biases, loads = one_process
    (bias,) = biases.values()  # tiny-deepseek: a dense layer, then one of experts
    assert list(biases) == ["blocks.1.mlp.router.e_score_correction_bias"]
    assert torch.equal(torch.tensor(bias, dtype=torch.float64), _rule(loads))
    assert len(set(bias)) > 1  # the steps moved experts both ways


LAYOUTS = {"dp2": (2, dict(dp=2)), "dp2-ep2": (2, dict(dp=2, ep=2)), "pp2": (2, dict(pp=2)),
           "tp2": (2, dict(tp=2)), "dp2-zero3": (2, dict(dp=2, zero=3)), "cp2": (2, dict(cp=2))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_keeps_the_bias_as_one_process_does(layout, one_process):
    """Each data-parallel rank routes half the tokens: its loads alone would move the bias
    otherwise (dp2); the experts split over two ranks (ep2); the layer on the second stage (pp2);
    its copies on both tensor-parallel ranks (tp2); ZeRO-3's units, which gather parameters, not
    buffers; half of each sequence per rank (cp2). Losses to 1e-10, the bias exactly."""
    losses, biases, loads = one_process
    world, settings = LAYOUTS[layout]
    for rank_losses, rank_biases, rank_loads in run_on_ranks(deepseek_run, world, settings, timeout=300):
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(losses), rtol=1e-10, atol=0)
        assert rank_biases == biases and rank_loads == loads


def test_a_resumed_run_continues_the_bias(tmp_path, one_process):
    """Saved at step 2 under dp 2 (the first rank writes the bias), resumed in one process to step 4:
    the bias and the losses of the run that never stopped."""
    losses, biases, _ = one_process
    run_on_ranks(deepseek_run, 2, dict(dp=2), save=str(tmp_path / "ck"), save_every=2, timeout=300)
    resumed_losses, resumed_biases, _ = deepseek_run({}, resume=str(tmp_path / "ck" / "step_000002"))
    torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(losses[2:]), rtol=1e-10, atol=0)
    assert resumed_biases == biases
    exported = run_strata("convert", "--to-hf", str(tmp_path / "ck" / "step_000002"), "--out", str(tmp_path / "hf"),
                          timeout=300)
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert saved.abs().sum() > 0


def test_greedy_tokens_under_ep_2_equal_one_process(tmp_path):
    """`strata generate` of the converted V3 case with its 8 experts split 4 and 4 over 2 processes."""
    hf_model("deepseek_v3-moe").save_pretrained(tmp_path / "hf")
    assert strata_main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    prompts, checkpoint = ("5,17,42", "1,2,3,4,5,6,7,8,9,10,11"), tmp_path / "ck"
    single = generated_lines(checkpoint, prompts, 40, "--dtype", "fp64")
    assert generated_lines(checkpoint, prompts, 40, "--dtype", "fp64", "--ep", 2) == single


# --- counts and costs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "tiny-deepseek"])
def test_the_presets_count_what_transformers_counts(name):
    cfg = PRESETS[name]
    hf = hf_config_from_model(cfg, None)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert cfg.num_params() == model.num_parameters() == sum(p.numel() for p in build_model(cfg, seed=None).parameters())
    assert model_config_from_hf({**hf, "model_type": config.model_type}, "test") == cfg


def test_the_dense_layers_and_the_mixtures_count_and_cut_apart():
    """The first layer dense (3 x 64 x 128 in its MLP), the second a mixture of which a token
    multiplies the router, 2 of the 8 experts and the shared ones; FLOPs and the pipeline's costs
    read each layer's own."""
    cfg = PRESETS["tiny-deepseek"]
    d, attention = 64, cfg.block_matmul_params(0) - 3 * 64 * 128
    assert cfg.block_matmul_params(1) == attention + d * 8 + 2 * 3 * d * 32 + 3 * d * 64
    assert cfg.flops_per_token(32) == 6 * (cfg.block_matmul_params(0) + cfg.block_matmul_params(1) + d * 256) + \
        6 * cfg.attention_products(32)
    assert cfg.active_params() == cfg.num_params() - 6 * 3 * d * 32
    costs = unit_costs(cfg, 32)
    assert costs[1] != costs[2] and costs[2] - costs[1] == 2 * (cfg.block_matmul_params(1) - cfg.block_matmul_params(0))
    assert make_layout(cfg, 2, 1, 32).blocks_per_chunk == (1, 1)
    with pytest.raises(ValueError, match="differ by layer"):
        cfg.block_matmul_params()
    v3 = PRESETS["deepseek-v3"]
    assert v3.moe_layer_count() == 58 and not v3.uniform_layers
    assert round(v3.active_params() / 1e9, 1) == 37.6  # the report's 37B activated (with embeddings)


def test_a_v3_file_reads_its_routing_and_a_dense_one_reads_none():
    cfg = model_config_from_hf(hf_configs()["deepseek_v3-moe"].to_dict(), "test")
    options = dict(cfg.family_options)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_d_ff, cfg.shared_d_ff, cfg.norm_topk) == (8, 2, 16, 32, True)
    assert (options["first_dense"], options["scoring"], options["groups"], options["groups_kept"],
            options["routed_scale"], options["balance_rate"]) == (1, "sigmoid", 4, 2, 2.5, 0.001)
    dense = model_config_from_hf(hf_configs()["deepseek_v3"].to_dict(), "test")
    assert not dense.moe and dense.uniform_layers and dict(dense.family_options)["scoring"] == "softmax"
