"""Hugging Face interop: random-weight transformers models (built offline from configs) converted
into strata give transformers' logits on one process, under --tp 2 (and 4, with the vocabulary
padded) and --pp 2; a model fine-tuned under --tp 2 converts back to the logits strata computes.
(Every family's round trip: tests/test_families.py; its fine-tuning under tp, pp and dp x tp:
tests/test_family_parallel.py.)"""

import json

import pytest
import torch
import torch.distributed as dist

from strata.checkpoint import shards, store
from strata.checkpoint.hf import convert_from_hf, convert_to_hf
from strata.cli import main as strata_main
from strata.config import train_config
from strata.infer.session import load_for_inference
from strata.model.config import ModelConfig
from strata.model.transformer import build_model
from strata.parallel.pipeline.stage import keep_stage
from strata.rules.pipeline_cut import make_layout
from strata.train.trainer import train

from distributed import run_on_ranks

transformers = pytest.importorskip("transformers", reason="the interop tests need transformers (pip install -e '.[dev]')")

VOCAB = 250  # not divisible by 4: --tp 4 pads it to 252


def _llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=32,
                                     bos_token_id=1, eos_token_id=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(config)


FAMILIES = {"llama": _llama, "gpt2": _gpt2}
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    """(family, HF directory, strata checkpoint, transformers' logits)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp(request.param)
    model = FAMILIES[request.param]().float().eval()
    model.save_pretrained(root / "hf")
    with torch.no_grad():
        logits = model(TOKENS).logits
    convert_from_hf(str(root / "hf"), str(root / "ck"))
    return request.param, root, logits


def test_logits_equal_transformers_on_one_process(converted):
    _, root, expected = converted
    model, _ = load_for_inference(str(root / "ck"))
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, rtol=1e-5, atol=1e-5)


def _tp_logits(ckpt):
    group = dist.new_group(list(range(dist.get_world_size())))
    model, _ = load_for_inference(ckpt, tp_group=group)
    with torch.no_grad():
        return model(TOKENS)


@pytest.mark.parametrize("tp", [2, 4])
def test_logits_equal_transformers_under_tensor_parallelism(converted, tp):
    _, root, expected = converted
    for logits in run_on_ranks(_tp_logits, tp, str(root / "ck"), timeout=300):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def _pp_logits(ckpt):
    """Two pipeline stages, each holding only its own layers, loaded from the checkpoint."""
    rank = dist.get_rank()
    path, manifest, reader = store.open_checkpoint(ckpt)
    cfg = ModelConfig.from_dict(manifest["model_config"])
    model = build_model(cfg, seed=None)
    keep_stage(model, make_layout(cfg, 2, 1, TOKENS.shape[1], None), rank)
    model = model.to_empty(device="cpu")
    with reader:
        full = shards.read_full(reader)
    model.load_state_dict({name: full[name] for name in model.state_dict()}, strict=True)
    model.reset_buffers()
    with torch.no_grad():
        if rank == 0:
            dist.send(model(TOKENS).contiguous(), 1)
            return None
        hidden = torch.empty(*TOKENS.shape, cfg.d_model)
        dist.recv(hidden, 0)
        return model(hidden)


def test_logits_equal_transformers_under_pipeline_parallelism(converted):
    _, root, expected = converted
    logits = run_on_ranks(_pp_logits, 2, str(root / "ck"), timeout=300)[1]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_fine_tuned_checkpoint_exports_to_transformers(converted, tmp_path):
    """Trained under --tp 2 from the converted weights, handed back: transformers computes the
    same logits as strata does with the fine-tuned weights."""
    _, root, _ = converted
    run_on_ranks(_save_fine_tuned, 2, str(root / "ck"), str(tmp_path / "tuned"), timeout=300)
    convert_to_hf(str(tmp_path / "tuned"), str(tmp_path / "hf"))
    ours, _ = load_for_inference(str(tmp_path / "tuned"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(TOKENS).logits, ours(TOKENS), rtol=1e-5, atol=1e-5)


FINE_TUNE = dict(steps=3, micro_batch=2, global_batch=4, seq_len=16, progress=False, eval_batches=1, peak_flops=1e10)


def _save_fine_tuned(ckpt, out):
    train(train_config(**FINE_TUNE, init_from=ckpt, tp=2, save=out))


def test_bad_sources_get_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert strata_main(["convert", "--from-hf", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "bert" / "model.safetensors").write_bytes(b"")
    assert strata_main(["convert", "--from-hf", str(tmp_path / "bert"), "--out", str(tmp_path / "x")]) == 2
    assert "model_type 'bert' is not supported" in capsys.readouterr().err
