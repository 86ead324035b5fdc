"""OLMo 2 (strata/model/families/olmo2.py; its block: strata/model/sandwich_block.py): the q/k norms
over the whole projections against transformers' attention, the greedy tokens of the KV cache equal
transformers' generate, context parallelism (its attention is plain: the ring computes it), what is
refused, and the preset's count. Logits, round trip, counts and the tp2 / pp2 / dp2 x tp2 layouts
(where each rank's q norm sums its squares over the group, and K, one head for two ranks, is
normed whole): tests/test_families.py and test_family_parallel.py, through tests/hf_cases.py."""

import json

import pytest
import torch
import transformers
from family_runs import on_each_rank
from hf_cases import hf_configs, hf_model
from test_family_parallel import converted_checkpoint, single_process

from strata.checkpoint.hf import hf_config_from_model
from strata.cli import main as strata_main
from strata.model.presets import PRESETS
from strata.model.transformer import build_model

from distributed import run_on_ranks


def test_the_qk_norms_run_over_the_whole_projections_as_transformers(tmp_path):
    """One attention layer of the converted case: its q and k, normed over all 6 heads' features
    (and the one KV head's), equal transformers' q_norm(q_proj(x)) and k_norm(k_proj(x)); a norm
    over each head alone would not."""
    theirs = hf_model("olmo2")
    hf_model("olmo2").save_pretrained(tmp_path / "hf")
    assert strata_main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    from strata.infer.session import load_for_inference
    ours = load_for_inference(str(tmp_path / "ck"))[0].blocks["0"].attn
    attention = theirs.model.layers[0].self_attn
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.q_norm(ours.wq(x)), attention.q_norm(attention.q_proj(x)))
        torch.testing.assert_close(ours.k_norm(ours.wk(x)), attention.k_norm(attention.k_proj(x)))
        per_head = torch.nn.functional.rms_norm(ours.wq(x).view(2, 5, 6, 8), (8,), eps=ours.q_norm.eps)
        assert (per_head.flatten(2) * ours.q_norm.weight - ours.q_norm(ours.wq(x))).abs().max() > 1e-2


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("olmo2"))


def test_context_parallelism_reproduces_one_process(root):
    """OLMo 2's attention is plain causal attention (its q/k norms act on each token alone): the
    ring computes it, and six fp64 steps under cp 2 equal one process."""
    losses, _ = single_process("olmo2", root)
    ranks = run_on_ranks(on_each_rank, 2, converted_checkpoint("olmo2", root), dict(cp=2), timeout=300)
    for rank_losses, _ in ranks:
        torch.testing.assert_close(torch.tensor(rank_losses, dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-10, atol=0)


def test_an_activation_strata_does_not_compute_is_one_line_naming_the_key(tmp_path, capsys):
    hf = {**hf_configs()["olmo2"].to_dict(), "hidden_act": "gelu"}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    assert strata_main(["plan", "--model", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "hidden_act='gelu' is not supported" in err and "Traceback" not in err and err.count("\n") == 1, err


def test_the_preset_counts_equal_transformers_on_the_meta_device():
    cfg = PRESETS["olmo-2-7b"]
    hf = hf_config_from_model(cfg, None)  # read back as the same model, or refused
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert cfg.num_params() == model.num_parameters() == 7_298_617_344  # OLMo-2-1124-7B
    assert cfg.num_params() == sum(p.numel() for p in build_model(cfg, seed=None).parameters())
