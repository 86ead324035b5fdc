"""Model families against transformers: for each family, a random-weight Hugging Face model with
awkward shapes (a vocabulary of 251, one KV head where the family allows it, Qwen3 and Gemma with
head_dim != hidden / heads, Llama 3.1's RoPE scaling, Mistral's sliding window shorter than the
prompts, GPT-NeoX's and GPT-J's parallel blocks with rotary on part of each head) converts with `strata convert --from-hf`, gives transformers' logits, goes back bit for
bit, fine-tunes in fp64, and plans with transformers' parameter count; the presets count what
transformers counts."""

import json

import pytest
import torch
import transformers
from hf_cases import CASES, VOCAB, assert_refused_in_one_line, hf_configs, hf_model, sharp_and_converted
from safetensors.torch import load_file

from strata.checkpoint.hf import hf_config_from_model
from strata.checkpoint.models import resolve_model
from strata.cli import main as strata_main
from strata.config import train_config
from strata.infer.generate import generate
from strata.infer.session import load_for_inference
from strata.model.config import ModelConfig
from strata.model.families import FAMILIES, PLACEMENTS
from strata.model.layers import rope_frequencies
from strata.model.presets import PRESETS
from strata.model.transformer import build_model
from strata.train.trainer import train

PROMPT_LENGTHS = (3, 11, 40)  # 40 passes Mistral's window of 16


def prompt(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))


@pytest.fixture(scope="module", params=CASES)
def converted(request, tmp_path_factory):
    """(case, directory with hf/ and ck/, the transformers model)."""
    root = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    model.save_pretrained(root / "hf")
    assert strata_main(["convert", "--from-hf", str(root / "hf"), "--out", str(root / "ck")]) == 0
    return request.param, root, model


def max_relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def test_logits_equal_transformers(converted):
    _, root, theirs = converted
    ours, _ = load_for_inference(str(root / "ck"))
    for length in PROMPT_LENGTHS:
        with torch.no_grad():
            assert max_relative_difference(ours(prompt(length)), theirs(prompt(length)).logits) < 1e-4, length


def test_the_round_trip_is_bit_identical_and_transformers_loads_it(converted):
    _, root, theirs = converted
    assert strata_main(["convert", "--to-hf", str(root / "ck"), "--out", str(root / "back")]) == 0
    original, back = load_file(str(root / "hf" / "model.safetensors")), load_file(str(root / "back" / "model.safetensors"))
    assert set(back) == set(original)
    for name, value in original.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(root / "back")).float().eval()
    with torch.no_grad():
        for length in PROMPT_LENGTHS:
            assert torch.equal(reloaded(prompt(length)).logits, theirs(prompt(length)).logits)


def test_six_fp64_steps_from_the_converted_weights_lower_the_loss(converted):
    _, root, _ = converted
    summary = train(train_config(init_from=str(root / "ck"), dtype="fp64", steps=6, micro_batch=4, global_batch=4,
                                seq_len=16, lr=3e-3, progress=False, eval_batches=2, peak_flops=1e10))
    assert len(summary["losses"]) == 6 and all(map(torch.isfinite, torch.tensor(summary["losses"])))
    (_, before), (_, after) = summary["val_losses"]  # the same validation batches, before and after
    assert after < before, summary["val_losses"]


def test_plan_reads_the_directory_with_transformers_parameter_count(converted, capsys):
    _, root, theirs = converted
    assert resolve_model(str(root / "hf")).num_params() == theirs.num_parameters()
    assert strata_main(["plan", "--model", str(root / "hf"), "--gpus-per-node", "1", "--global-batch", "8",
                        "--seq-len", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == theirs.num_parameters()


# --- Mistral's sliding window in generation --------------------------------------------------------
def test_sliding_window_logits_and_greedy_tokens_equal_transformers(tmp_path):
    """A window of 16 over 64-token prompts: the prefill masks it as transformers' training does, and
    40 greedy tokens (the KV cache holding 104 positions, the window sliding over them) are
    transformers' generate(do_sample=False)."""
    model, ours = sharp_and_converted("mistral", tmp_path)
    prompts = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_relative_difference(ours(prompts), model(prompts).logits) < 1e-4
        expected = model.generate(prompts, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                  pad_token_id=0)[:, 64:]
    produced = torch.stack(list(generate(ours, prompts.tolist(), max_new_tokens=40)), dim=1)
    assert torch.equal(produced, expected)


# --- the pieces, one at a time ---------------------------------------------------------------------
def test_llama3_rope_frequencies_are_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = hf_configs()["llama3.1"]
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=2, d_model=64, n_heads=4, d_ff=80, max_seq_len=128,
                      rope_theta=500000.0, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_seq_len=64)
    ours = rope_frequencies(cfg)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    plain = rope_frequencies(ModelConfig(**{**cfg.to_dict(), "rope_type": "default", **dict.fromkeys(
        ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"))}))
    assert (ours[0] == plain[0]) and (ours[-1] == plain[-1] / 8)  # the fastest kept, the slowest / factor


@pytest.mark.parametrize("name", ["llama3-8b", "llama3.1-8b", "llama3-70b", "llama3.1-405b", "qwen2.5-7b",
                                  "qwen2.5-72b", "mistral-7b", "gemma-7b", "llama-7b", "gpt2-124m", "gpt-j-6b",
                                  "pythia-1.4b"])
def test_preset_counts_equal_transformers_on_the_meta_device(name):
    cfg = PRESETS[name]
    hf = hf_config_from_model(cfg, None)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert cfg.num_params() == model.num_parameters()
    assert cfg.num_params() == sum(p.numel() for p in build_model(cfg, seed=None).parameters())


PUBLISHED = {"llama3-8b": 8_030_261_248, "llama3.1-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
             "llama3.1-405b": 405_853_388_800,
             "qwen2.5-7b": 7_615_616_512, "qwen2.5-72b": 72_706_203_648, "mistral-7b": 7_241_732_096,
             "gemma-7b": 8_537_680_896, "pythia-1.4b": 1_414_647_808}


def test_new_presets_have_the_published_counts_and_a_family():
    for name, count in PUBLISHED.items():
        assert PRESETS[name].num_params() == count, name
    assert all(cfg.family in FAMILIES for cfg in PRESETS.values())


def test_flops_count_the_query_width_and_the_window():
    gemma, mistral = PRESETS["gemma-7b"], PRESETS["mistral-7b"]
    assert gemma.flops_per_token(1024) == 6 * gemma.matmul_params() + 12 * 28 * 16 * 256 * 1024
    assert mistral.flops_per_token(8192) == 6 * mistral.matmul_params() + 12 * 32 * 4096 * 4096


def test_a_manifest_written_before_families_reads_the_same():
    for name in ("tiny", "tiny-gpt2", "llama-70b", "bloom-176b"):
        cfg = PRESETS[name]
        old = {k: v for k, v in cfg.to_dict().items() if k in OLD_FIELDS}
        assert ModelConfig.from_dict(old) == cfg, name


def test_a_gptj_manifest_written_before_its_own_block_is_refused_in_one_line():
    """Before issue 55 the gptj family computed strata's shared (sequential) block in GPT-J's shape:
    such a manifest reads as family gptj without GPT-J's options, and is refused, not read as GPT-J."""
    old = ModelConfig.from_dict({k: v for k, v in PRESETS["gpt-j-6b"].to_dict().items() if k in OLD_FIELDS})
    assert old.family == "gptj" and old.family_options == ()
    with pytest.raises(ValueError, match="family 'gptj' computes a block of its own and needs its family_options"):
        old.validate()


OLD_FIELDS = ("vocab_size", "n_layers", "d_model", "n_heads", "d_ff", "max_seq_len", "n_kv_heads", "norm",
              "position", "mlp", "tie_embeddings", "bias", "embedding_norm", "norm_eps", "rope_theta")


def test_new_parameters_start_as_identity_norms():
    gemma = build_model(ModelConfig(**{**PRESETS["tiny"].to_dict(), "norm": "gemma_rmsnorm", "mlp": "geglu",
                                       "family": "gemma"}), seed=0)
    assert torch.equal(gemma.blocks["0"].attn_norm.weight, torch.zeros(64))  # (1 + 0): scale 1
    qwen3 = build_model(ModelConfig(**{**PRESETS["tiny"].to_dict(), "qk_norm": True, "d_head": 32,
                                       "family": "qwen3"}), seed=0)
    assert torch.equal(qwen3.blocks["1"].attn.k_norm.weight, torch.ones(32))
    assert qwen3.blocks["0"].attn.wq.weight.shape == (4 * 32, 64)


@pytest.mark.parametrize("case,change,needle", [
    ("llama2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ("llama2", {"attention_bias": True}, "attention_bias=True is not supported"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
     "use_sliding_window with max_window_layers=1"),
    ("gemma", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("gemma", {"hidden_act": "relu"}, "hidden_act='relu' is not supported"),
    ("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
    ("mistral", {"sliding_window": 0}, "sliding_window=0 must be a whole number"),
    ("gptj", {"rotary_dim": None}, "rotary_dim=None is not supported"),
    ("gptj", {"tie_word_embeddings": True}, "tie_word_embeddings=True is not supported"),
    ("gpt_neox", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'linear'"),
    ("gpt_neox", {"hidden_act": "relu"}, "hidden_act='relu' is not supported"),
])
def test_unsupported_options_are_one_line_naming_the_key(case, change, needle, tmp_path, capsys):
    assert_refused_in_one_line(case, change, needle, tmp_path, capsys)


def test_a_model_its_family_cannot_write_is_refused_on_export():
    from strata.errors import ConfigError
    windowed_llama = ModelConfig(**{**PRESETS["tiny"].to_dict(), "sliding_window": 8})
    assert windowed_llama.family == "llama"
    with pytest.raises(ConfigError, match="cannot hold this model's sliding_window=8"):
        hf_config_from_model(windowed_llama, None)
    with pytest.raises(ConfigError, match="a gptj config.json cannot hold this model's rope_theta=500000.0"):
        hf_config_from_model(PRESETS["gpt-j-6b"].with_overrides(rope_theta=500000.0), None)  # GPT-J's is fixed
    narrow_heads = PRESETS["gpt-j-6b"].with_overrides(n_heads=128)  # 32-wide heads rotate whole in strata
    with pytest.raises(ConfigError, match="rotary_dim=64 is not supported"):
        hf_config_from_model(narrow_heads, None)


def test_every_family_places_every_parameter_under_tensor_parallelism():
    from strata.checkpoint.hf import model_config_from_hf
    shapes = [model_config_from_hf(config.to_dict(), case) for case, config in hf_configs().items()]
    shapes += [preset for preset in PRESETS.values()]
    assert {cfg.family for cfg in shapes} == set(FAMILIES)
    for cfg in shapes:
        for name, _ in build_model(cfg, seed=None).named_parameters():
            assert FAMILIES[cfg.family].placement(name.rsplit(".", 1)[0]) in PLACEMENTS, (cfg.family, name)


# --- fine-tuning a converted model on one's own data, with its own tokenizer -------------------------
def test_fine_tune_a_converted_model_on_jsonl_and_parquet_with_its_tokenizer_then_generate(tmp_path, capsys):
    from documents import model_tokenizer_dir, write_sources

    from strata.checkpoint import store
    from strata.data.tokenizer import load_tokenizer
    from strata.infer.session import end_of_text_ids
    hf_dir = model_tokenizer_dir(tmp_path / "hf")  # its tokenizer.json and a config.json, replaced below
    hf_model("llama2").save_pretrained(hf_dir)  # bos 1, eos 2: transformers' LlamaConfig defaults
    assert strata_main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ck")]) == 0
    sources = write_sources(tmp_path)
    assert strata_main(["data", "prepare", "--source", *sources, "--tokenizer", str(hf_dir),
                        "--out", str(tmp_path / "data")]) == 0
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["document_prefix"], meta["end_of_text"]) == (VOCAB, [1], 2)
    summary = train(train_config(init_from=str(tmp_path / "ck"), data=str(tmp_path / "data"), steps=2, micro_batch=2,
                                global_batch=2, seq_len=16, progress=False, eval_batches=1, peak_flops=1e10,
                                save=str(tmp_path / "tuned")))
    assert len(summary["losses"]) == 2
    for checkpoint in ("ck", "tuned"):  # the model's EOS ends answers, in the converted and the tuned one
        path = store.resolve(str(tmp_path / checkpoint))
        tokenizer = load_tokenizer(store.verified_file(path, "tokenizer.json"))
        assert end_of_text_ids(store.read_state(path), tokenizer) == {2}
    capsys.readouterr()
    assert strata_main(["generate", "--checkpoint", str(tmp_path / "tuned"), "--prompt", "the cat",
                        "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("the cat")


# The released config.json files (their model cards' repositories; written by transformers 4.x,
# so in the older rope_theta / rope_scaling form) read into the presets.
RELEASED = {
    "llama3.1-405b": {"model_type": "llama", "hidden_act": "silu", "hidden_size": 16384, "intermediate_size": 53248,
                      "max_position_embeddings": 131072, "mlp_bias": False, "attention_bias": False,
                      "num_attention_heads": 128, "num_hidden_layers": 126, "num_key_value_heads": 8,
                      "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                      "tie_word_embeddings": False, "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
                   "max_position_embeddings": 131072, "max_window_layers": 28, "num_attention_heads": 28,
                   "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                   "sliding_window": 131072, "tie_word_embeddings": False, "use_mrope": False,
                   "use_sliding_window": False, "vocab_size": 152064},
    "mistral-7b": {"model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                   "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
                   "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
                   "tie_word_embeddings": False, "vocab_size": 32000},
    "gemma-7b": {"model_type": "gemma", "attention_bias": False, "head_dim": 256, "hidden_act": "gelu",
                 "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3072, "intermediate_size": 24576,
                 "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 28,
                 "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
                 "vocab_size": 256000},
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_a_released_config_json_reads_as_the_preset(name):
    import dataclasses

    from strata.checkpoint.hf import model_config_from_hf

    def plain(cfg):  # n_kv_heads may be None or the head count: the same model
        return dataclasses.replace(cfg, n_kv_heads=cfg.kv_heads if cfg.kv_heads != cfg.n_heads else None)
    assert plain(model_config_from_hf(RELEASED[name], name)) == plain(PRESETS[name])
