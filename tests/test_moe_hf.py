"""Mixture-of-experts families against transformers: random-weight MixtralForCausalLM and
Qwen2MoeForCausalLM models (4 experts, 2 per token; Mixtral with a window of 16 shorter than the
prompts; Qwen2-MoE with a shared expert, experts narrower than intermediate_size, without and with
norm_topk_prob, without q/k/v biases, and with a window on every layer) saved by save_pretrained, whose file keeps each expert's matrices apart, convert
with `strata convert --from-hf` into strata's stacked experts, give transformers' logits and
greedy tokens, go back bit for bit under the file's names and load into transformers with no
missing or unexpected key, fine-tune in fp64 and export again with the logits strata computes."""

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_families import max_relative_difference
from test_families import test_preset_counts_equal_transformers_on_the_meta_device as preset_counts_equal_transformers

from strata.checkpoint.hf import model_config_from_hf
from strata.checkpoint.models import resolve_model
from strata.cli import main as strata_main
from strata.config import train_config
from strata.infer.generate import generate
from strata.infer.session import load_for_inference
from strata.model.presets import PRESETS
from strata.train.trainer import train

from cli_runner import generated_lines

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128,
             eos_token_id=None)  # no end of text: transformers' min_new_tokens would mask Mixtral's 2
QWEN2_MOE = dict(**SHAPE, num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=48)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=4, sliding_window=16),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**QWEN2_MOE),
    "qwen2_moe-norm_topk": lambda: transformers.Qwen2MoeConfig(**QWEN2_MOE, norm_topk_prob=True, qkv_bias=False),
    "qwen2_moe-window": lambda: transformers.Qwen2MoeConfig(**QWEN2_MOE, use_sliding_window=True, sliding_window=16,
                                                             layer_types=["sliding_attention"] * 2),
    # the mixture in layer 1 only of 4 (every 2nd, not layer 3); the others a dense MLP of 40
    "qwen2_moe-sparse": lambda: transformers.Qwen2MoeConfig(**{**QWEN2_MOE, "num_hidden_layers": 4},
                                                             decoder_sparse_step=2, mlp_only_layers=[3]),
}
PROMPT_LENGTHS = (3, 11, 40)  # 40 passes the windows of 16


def hf_model(case: str):
    """Every parameter moved off its initial value (the norms too) and scaled up: routers far from
    uniform and greedy choices far from ties."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[case]()).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1).mul_(2.0)
    return model


def prompt(length: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))


def load_into_transformers(directory) -> transformers.PreTrainedModel:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.float().eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def converted(request, tmp_path_factory):
    """(case, directory with hf/ and ck/, the model transformers reads from hf/: the file is what
    both sides load; the model save_pretrained wrote differs from it in the last bit of Qwen2-MoE's
    logits, with equal parameters)."""
    root = convert(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, root, load_into_transformers(root / "hf")


def convert(case: str, root):
    """The case's model saved by transformers under root/hf, converted by strata into root/ck."""
    hf_model(case).save_pretrained(root / "hf")
    assert strata_main(["convert", "--from-hf", str(root / "hf"), "--out", str(root / "ck")]) == 0
    return root


def test_the_file_keeps_each_experts_matrices_and_strata_stacks_them(converted):
    case, root, _ = converted
    experts = "block_sparse_moe.experts" if case == "mixtral" else "mlp.experts"
    keys = set(load_file(str(root / "hf" / "model.safetensors")))
    assert {f"model.layers.1.{experts}.3.{p}.weight" for p in ("w1", "w2", "w3")} <= keys if case == "mixtral" else \
        {f"model.layers.1.{experts}.3.{p}_proj.weight" for p in ("gate", "up", "down")} <= keys
    ours, _ = load_for_inference(str(root / "ck"))
    assert ours.blocks["1"].mlp.experts.w_down.shape == (4, 32, 40 if case == "mixtral" else 24)


def test_logits_equal_transformers(converted, record_property):
    _, root, theirs = converted
    ours, _ = load_for_inference(str(root / "ck"))
    worst = 0.0
    with torch.no_grad():
        for length in PROMPT_LENGTHS:
            worst = max(worst, max_relative_difference(ours(prompt(length, 2)), theirs(prompt(length, 2)).logits))
    record_property("max_relative_difference", worst)
    print(f"max relative logit difference: {worst:.3g}")
    assert worst < 1e-4


def test_greedy_tokens_equal_transformers(converted):
    """30 greedy tokens after 24-token prompts (the windows of 16 sliding over the KV cache)."""
    _, root, theirs = converted
    ours, _ = load_for_inference(str(root / "ck"))
    prompts = prompt(24, 2)
    with torch.no_grad():
        expected = theirs.generate(prompts, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                                   pad_token_id=0)[:, 24:]
    produced = torch.stack(list(generate(ours, prompts.tolist(), max_new_tokens=30)), dim=1)
    assert torch.equal(produced, expected)


def test_the_round_trip_is_bit_identical_and_transformers_loads_it(converted):
    _, root, theirs = converted
    assert strata_main(["convert", "--to-hf", str(root / "ck"), "--out", str(root / "back")]) == 0
    original, back = (load_file(str(root / side / "model.safetensors")) for side in ("hf", "back"))
    assert set(back) == set(original)
    assert [name for name, value in original.items() if not (back[name].dtype == value.dtype and
                                                              torch.equal(back[name], value))] == []
    reloaded = load_into_transformers(root / "back")
    with torch.no_grad():
        for length in PROMPT_LENGTHS:
            assert torch.equal(reloaded(prompt(length)).logits, theirs(prompt(length)).logits)


def test_fp64_fine_tuning_lowers_the_loss_and_exports_what_strata_computes(converted, tmp_path):
    _, root, _ = converted
    summary = train(train_config(init_from=str(root / "ck"), dtype="fp64", steps=6, micro_batch=4, global_batch=4,
                                seq_len=16, lr=3e-3, progress=False, eval_batches=2, peak_flops=1e10,
                                save=str(tmp_path / "tuned")))
    (_, before), (_, after) = summary["val_losses"]  # the same validation batches, before and after
    assert after < before, summary["val_losses"]
    assert strata_main(["convert", "--to-hf", str(tmp_path / "tuned"), "--out", str(tmp_path / "hf")]) == 0
    ours, _ = load_for_inference(str(tmp_path / "tuned"), dtype=torch.float32)
    theirs = load_into_transformers(tmp_path / "hf")
    with torch.no_grad():
        assert max_relative_difference(ours(prompt(40)), theirs(prompt(40)).logits) < 1e-4


def test_plan_reads_the_directory_with_transformers_parameter_count(converted):
    _, root, theirs = converted
    assert resolve_model(str(root / "hf")).num_params() == theirs.num_parameters()


@pytest.mark.parametrize("name", ["tiny-moe", "mixtral-8x7b", "qwen2-moe-a2.7b"])
def test_preset_counts_equal_transformers_on_the_meta_device(name):
    preset_counts_equal_transformers(name)


# The released config.json files (their model cards' repositories, written by transformers 4.x).
RELEASED = {
    "mixtral-8x7b": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_act": "silu",
                     "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                     "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                     "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1e6,
                     "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                     "vocab_size": 32000},
    "qwen2-moe-a2.7b": {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_act": "silu",
                        "hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 8192,
                        "max_window_layers": 21, "num_attention_heads": 16, "num_hidden_layers": 24,
                        "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                        "sliding_window": 32768, "tie_word_embeddings": False, "use_sliding_window": False,
                        "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
                        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
                        "norm_topk_prob": False, "router_aux_loss_coef": 0.001},
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_a_released_config_json_reads_as_the_preset(name):
    cfg = model_config_from_hf(RELEASED[name], name)
    assert dataclasses.replace(cfg, n_kv_heads=None if cfg.kv_heads == cfg.n_heads else cfg.kv_heads) == PRESETS[name]


# --- what is refused, in one line naming the key or the tensor ------------------------------------
def refused_in_one_line(args: list[str], needle: str, capsys) -> None:
    assert strata_main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("case,change,needle", [
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a whole number >= 1"),
    ("qwen2_moe", {"mlp_only_layers": [1, 2]}, "mlp_only_layers=[1, 2] must list layers 0..1"),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "layer_types": None},
     "use_sliding_window with max_window_layers=28"),  # transformers windows layer 0 only
    ("qwen2_moe", {"num_experts": 0}, "num_experts=0 must be a whole number >= 1"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_unsupported_options_are_one_line_naming_the_key(case, change, needle, tmp_path, capsys):
    hf = {**CONFIGS[case]().to_dict(), **change}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    refused_in_one_line(["plan", "--model", str(tmp_path / "hf")], needle, capsys)


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"),
     "no tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight' (the config has 4 experts)"),
    (lambda t: t.update({"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(40, 32)}),
     "unexpected tensor 'model.layers.0.block_sparse_moe.experts.4.w1.weight': the config has 4 experts"),
    (lambda t: t.update({"model.layers.0.block_sparse_moe.experts.2.w3.weight": torch.zeros(41, 32)}),
     "model.layers.0.block_sparse_moe.experts.2.w3.weight has shape [41, 32], expert 0's [40, 32]"),
])
def test_a_missing_extra_or_misshapen_expert_is_one_line(edit, needle, tmp_path, capsys):
    hf_model("mixtral").save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    capsys.readouterr()  # save_pretrained's progress bar
    refused_in_one_line(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")], needle, capsys)


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen2_moe-sparse"])
def test_greedy_tokens_under_ep_2_and_ep_2_x_tp_2_equal_one_process(case, tmp_path):
    """The converted model's greedy answers through `strata generate`: experts split over 2
    processes (tokens travel to their experts and back), and over 2 x 2 with tensor parallelism,
    token for token as in one process (which equals transformers', above)."""
    root = convert(case, tmp_path)
    prompts = ("1,2,3", "4,5,6,7,8,9,10,11,12,13,14", "7")
    single = generated_lines(root / "ck", prompts, 12)
    assert generated_lines(root / "ck", prompts, 12, "--ep", 2) == single
    assert generated_lines(root / "ck", prompts, 12, "--ep", 2, "--tp", 2) == single
