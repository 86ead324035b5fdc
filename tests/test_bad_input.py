"""Every bad input a user (or a hostile file) can give ends in exactly one line on stderr, naming
the bad value, with exit code 2 and no traceback anywhere in the output, before any process starts.

The files the cases point at (tests/bad_input_files.py) are built once: a prepared data directory
and a checkpoint, and copies of them broken in the ways a disk, a truncated copy or an attacker
breaks them."""

from __future__ import annotations

import pytest

import bad_input_checkpoints
import bad_input_flags
import bad_input_hosts
from bad_input_files import bad_input_files
from cli_runner import run_strata


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return bad_input_files(tmp_path_factory.mktemp("bad_input"))


def _fill(arg: str, fx: dict) -> str:
    """'{ck.good}' -> the fixture's path."""
    if arg.startswith("{") and arg.endswith("}"):
        group, _, name = arg[1:-1].partition(".")
        return fx[group][name] if name else fx[group]
    return arg


TRAIN = ["train", "--model", "tiny", "--steps", "2", "--no-progress"]
GEN = ["generate", "--checkpoint"]

CASES = [
    # --- train: flags ------------------------------------------------------------------------------
    (["train", "--model", "gpt5"], "--model gpt5: unknown preset; valid: tiny"),
    (["train", "--dtype", "fp8"], "--dtype fp8: valid: fp32, fp64, bf16"),
    (["train", "--nproc", "4", "--dp", "3"], "the product must equal it"),
    (["train", "--nproc", "2", "--tp", "3"], "--tp 3: tp x pp = 3 does not divide the world size 2"),
    (["train", "--global-batch", "6", "--micro-batch", "4"], "--global-batch 6: must be a multiple of micro_batch 4"),
    (["train", "--global-batch", "0"], "--global-batch 0: must be >= 1"),
    (["train", "--seq-len", "100000"], "--seq-len 100000: must be between 1 and the model's max_seq_len 64"),
    (["train", "--seq-len", "0"], "--seq-len 0: must be between 1"),
    (["train", "--data", "/nonexistent"], "--data /nonexistent: no meta.json"),
    (["train", "--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--model", "small", "--nproc", "4", "--tp", "4"], "--tp 4: must divide the model's 6 attention heads"),
    (["train", "--sequence-parallel"], "--sequence-parallel: needs tp 2 or more"),
    (["train", "--nproc", "6", "--tp", "6", "--tp-mode", "2d"], "--tp 6: tp_mode 2d needs q² (4, 9, 16, ...) ranks"),
    (["train", "--nproc", "4", "--tp", "4", "--tp-mode", "3d"], "--tp 4: tp_mode 3d needs q³ (8, 27, 64, ...) ranks"),
    (["train", "--tp-mode", "4d"], "--tp-mode 4d: valid: 1d, 2d, 2.5d, 3d"),
    (["train", "--tp-depth", "2"], "--tp-depth 2: is the depth of 2.5-D tensor parallelism; tp_mode is 1d"),
    (["train", "--nproc", "4", "--tp", "4", "--tp-mode", "2d", "--micro-batch", "3"],
     "--micro-batch 3: must be a multiple of 2 with tp_mode 2d on 4 ranks"),
    (["train", "--nproc", "16", "--tp", "16", "--tp-mode", "2d"], "--tp 16: tp_mode 2d: the model's 2 KV heads must "
                                                                  "be a multiple of q = 4"),
    (["train", "--nproc", "4", "--tp", "4", "--tp-mode", "2d", "--sequence-parallel"],
     "--sequence-parallel: not with tp_mode 2d"),
    (["train", "--nproc", "8", "--tp", "4", "--tp-mode", "2d", "--zero", "3"], "--zero 3: not with tp_mode 2d"),
    (["train", "--nproc", "4", "--tp", "4", "--tp-mode", "2d", "--offload-params", "cpu"],
     "--offload-params cpu: not with tp_mode 2d"),
    (["train", "--nproc", "4", "--tp", "4", "--tp-mode", "2.5d"], "--tp-depth 1: tp_mode 2.5d needs tp_depth >= 2"),
    (["train", "--n-heads", "7"], "--n-heads 7: must divide the model's d_model 64"),
    # --- context parallelism ------------------------------------------------------------------------
    (["train", "--nproc", "2", "--cp", "2", "--seq-len", "30"], "--seq-len 30: must be a multiple of 2 x cp = 4"),
    (["train", "--nproc", "8", "--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "36"],
     "--seq-len 36: must be a multiple of cp x tp = 8 with sequence parallelism"),
    (["train", "--nproc", "4", "--cp", "4", "--cp-mode", "ulysses", "--seq-len", "32", "--n-heads", "2"],
     "--cp-mode ulysses: cp 4 must divide the 2 attention heads each tensor-parallel rank holds"),
    (["train", "--cp-mode", "ulysses"], "--cp-mode ulysses: chooses how context parallelism attends, and cp is 1"),
    (["train", "--nproc", "2", "--cp", "2", "--cp-mode", "zigzag"], "--cp-mode zigzag: valid: ring, ulysses"),
    (["train", "--nproc", "2", "--cp", "3"], "--cp 3: cp x tp x pp = 3 does not divide the world size 2"),
    (["train", "--cp", "0"], "--cp 0: must be >= 1"),
    (["train", "--nproc", "8", "--cp", "2", "--tp", "4", "--tp-mode", "2d", "--seq-len", "32"],
     "--tp-mode 2d: not with cp 2: context parallelism runs with tp_mode 1d"),
    (["train", "--model", "tiny-moe", "--nproc", "2", "--cp", "2", "--seq-len", "32"],
     "--cp 2: not with a mixture of experts"),
    (["train", "--nproc", "4", "--cp", "2", "--dp", "3"], "dp x cp x tp x pp = 3 x 2 x 1 x 1 = 6, but the world size is 4"),
    (["train", "--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "33"],
     "--seq-len 33: must be a multiple of tp 2"),
    (["train", "--model", "bloom-176b", "--nproc", "3", "--tp", "3"], "--tp 3: must divide the model's 112 attention"),
    (["train", "--zero", "2"], "--zero 2: ZeRO shards states across data-parallel ranks, and dp is 1"),
    (["train", "--zero", "4"], "--zero 4: valid: 0, 1, 2, 3"),
    (["train", "--bucket-mb", "0"], "--bucket-mb 0.0: must be at least 0.001"),
    (["train", "--nproc", "4", "--pp", "2", "--zero", "3", "--schedule", "zb"], "--schedule zb: not with zero 3"),
    (["train", "--nproc", "2", "--pp", "2", "--schedule", "zigzag"], "--schedule zigzag: valid: gpipe, 1f1b"),
    (["train", "--nproc", "2", "--pp", "2", "--pp-split", "a,b"], "--pp-split a,b: give blocks per chunk"),
    (["train", "--nproc", "4", "--pp", "4", "--schedule", "interleaved", "--virtual-stages", "2"],
     "--pp 4: with 2 virtual stage(s), 8 chunks"),
    (["train", "--checkpointing", "half"], "--checkpointing half: valid: none, full, selective, every:K"),
    (["train", "--offload", "nvme"], "--offload nvme: valid: none, disk, cpu"),
    (["train", "--reduce-dtype", "bf16"], "--reduce-dtype bf16: sets the dtype of data-parallel reductions"),
    (["train", "--reduce-dtype", "fp8"], "--reduce-dtype fp8: valid: fp32, bf16"),
    (["train", "--gather-dtype", "bf16"], "--gather-dtype bf16: only with dtype bf16"),
    (["train", "--dtype", "bf16", "--nproc", "2", "--gather-dtype", "bf16"],
     "--gather-dtype bf16: sets the dtype ZeRO-1/2/3 gather parameters in"),
    (["train", "--dtype", "fp64", "--nproc", "2", "--reduce-dtype", "bf16"], "--reduce-dtype bf16: not with dtype fp64"),
    (["train", "--nproc", "2", "--pp", "2", "--schedule", "zb", "--compile"], "--schedule zb: not with --compile"),
    (["train", "--schedule", "2bw"], "--grad-clip 1.0: not with --schedule 2bw: clipping by the global norm"),
    (["train", "--schedule", "2bw", "--grad-clip", "0", "--dtype", "fp16"], "--dtype fp16: not with --schedule 2bw"),
    (["train", "--nproc", "2", "--pp", "2", "--schedule", "pipedream", "--grad-clip", "0", "--global-batch", "16"],
     "--global-batch 16: --schedule pipedream updates the weights after every micro-batch"),
    (["train", "--nproc", "2", "--pp", "2", "--schedule", "pipedream", "--grad-clip", "0", "--model", "tiny-gpt2"],
     "--schedule pipedream: not with a tied embedding"),
    (["train", "--nproc", "2", "--schedule", "2bw", "--grad-clip", "0", "--zero", "2"],
     "--zero 2: not with --schedule 2bw"),
    (["train", "--emulate-stages", "2"], "--emulate-stages 2: only with --pp 1 --schedule pipedream or pipedream-vs"),
    (["train", "--schedule", "pipedream", "--grad-clip", "0", "--emulate-stages", "9"],
     "--emulate-stages 9: with 1 virtual stage(s), 9 chunks"),
    (["train", "--parallel", "auto", "--allow-async"], "--allow-async: the asynchronous schedules run without clipping"),
    (["train", "--dtype", "fp16", "--loss-scale", "0"], "--loss-scale 0.0: must be > 0"),
    (["train", "--beta1", "2"], "--beta1 2.0: must be in [0, 1)"),
    (["train", "--beta2", "-1"], "--beta2 -1.0: must be in [0, 1)"),
    (["train", "--seed", "-1"], "--seed -1: must be at least 0"),
    (["train", "--lr", "nan"], "--lr nan: must be a number"),
    (["train", "--lr", "inf"], "--lr inf: must be > 0"),
    (["train", "--weight-decay", "-1"], "--weight-decay -1.0: must be >= 0"),
    (["train", "--grad-clip", "nan"], "--grad-clip nan: must be a number"),
    (["train", "--timeout", "nan"], "--timeout nan: must be a number"),
    (["train", "--eval-batches", "0"], "--eval-batches 0: must be >= 1"),
    (["train", "--micro-batch", "0"], "--micro-batch 0: must be >= 1"),
    (["train", "--keep", "-1", "--save", "{root}"], "--keep -1: must be >= 0"),
    (["train", "--virtual-stages", "2"], "--virtual-stages 2: only with pp 2 or more"),
    (["train", "--config", "{file.binary.toml}"], "not valid TOML"),
    (["train", "--config", "{file.a_dir}"], "is a directory"),
    (["train", "--config", "/nonexistent.toml"], "no such file"),
    # --- train: files --------------------------------------------------------------------------------
    ([*TRAIN, "--nproc", "2", "--resume", "/nonexistent"], "--resume /nonexistent: no such directory"),
    ([*TRAIN, "--nproc", "2", "--resume", "{file.a_dir}"], "not a complete checkpoint"),
    ([*TRAIN, "--resume", "{ck.manifest_not_json}"], "manifest.json: not valid JSON"),
    ([*TRAIN, "--resume", "{ck.manifest_array}"], "manifest.json: holds a JSON list, not an object"),
    ([*TRAIN, "--resume", "{ck.manifest_escape}"], "'../../outside/x' is not a plain file name"),
    ([*TRAIN, "--resume", "{ck.shard_escape}"], "'shard_../../x.json' is not a plain file name"),
    ([*TRAIN, "--resume", "{ck.latest_escape}"], "names '../other/step_000005', not a step directory"),
    ([*TRAIN, "--data", "{data.good}", "--seq-len", "16", "--resume", "{ck.weights_only}"], "holds no optimizer state"),
    ([*TRAIN, "--save", "{file.a_file}"], "--save {file.a_file}: is a file; want a directory"),
    ([*TRAIN, "--metrics", "{file.a_dir}"], "--metrics {file.a_dir}: is a directory; want a file"),
    ([*TRAIN, "--data", "{data.truncated}", "--seq-len", "16"], "shard train_000.bin has"),
    ([*TRAIN, "--data", "{data.odd}", "--seq-len", "16"], "(truncated or replaced)"),
    ([*TRAIN, "--data", "{data.empty_shard}", "--seq-len", "16"], "shard train_000.bin has 0 bytes"),
    ([*TRAIN, "--data", "{data.missing_shard}", "--seq-len", "16"], "shard train_000.bin is missing"),
    ([*TRAIN, "--data", "{data.big_ids}", "--seq-len", "16"], "holds token id 65000, outside the vocabulary"),
    ([*TRAIN, "--data", "{data.meta_not_json}", "--seq-len", "16"], "meta.json: not valid JSON"),
    ([*TRAIN, "--data", "{data.meta_array}", "--seq-len", "16"], "holds a JSON list, not an object"),
    ([*TRAIN, "--data", "{data.meta_escape}", "--seq-len", "16"], "'../../etc/passwd' is not a plain file name"),
    ([*TRAIN, "--data", "{data.meta_no_vocab}", "--seq-len", "16"], "has no 'vocab_size'"),
    ([*TRAIN, "--nproc", "2", "--data", "{data.short_val}", "--seq-len", "16"],
     "--seq-len 16: the val split is shorter than one window"),
    # --- data prepare ------------------------------------------------------------------------------
    (["data", "prepare", "--source", "/nonexistent", "--out", "o1"], "not a file, a directory or 'shakespeare'"),
    (["data", "prepare", "--source", "{file.binary.txt}", "--out", "o2"], "not UTF-8 text"),
    (["data", "prepare", "--source", "{file.empty.txt}", "--out", "o3"], "the corpus is empty"),
    (["data", "prepare", "--source", "{data.corpus}", "--tokenizer", "{file.bad_tokenizer.json}",
      "--out", "o4"], "not a tokenizer.json that `tokenizers` reads"),
    (["data", "prepare", "--source", "{data.corpus}", "--out", "{file.a_file}"],
     "exists and is not a directory"),
    (["data", "prepare", "--source", "{data.corpus}", "--val-fraction", "1", "--out", "o5"],
     "--val-fraction 1.0: must be in (0, 1)"),
    (["data", "prepare", "--source", "{data.corpus}", "--val-fraction", "0", "--out", "o7"],
     "--val-fraction 0.0: must be in (0, 1): training validates on this split"),
    (["data", "prepare", "--source", "{data.corpus}", "--out", ""], "--out '': give a directory"),
    (["data", "prepare", "--source", "{data.corpus}", "--out", "a_file/sub"], "a_file is a file"),
    (["data", "prepare", "--source", "{data.corpus}", "--tokenizer", "bpe:12", "--out", "o6"],
     "want bpe:N with N from 257"),
    # --- generate ------------------------------------------------------------------------------------
    ([*GEN, "/nonexistent", "--prompt-ids", "1"], "no such directory"),
    ([*GEN, "{ck.manifest_not_json}", "--prompt-ids", "1"], "manifest.json: not valid JSON"),
    ([*GEN, "{ck.manifest_no_model}", "--prompt-ids", "1"], "'model_config' is missing"),
    ([*GEN, "{ck.latest_escape}", "--prompt-ids", "1"], "not a step directory"),
    ([*GEN, "{ck.tokenizer_tampered}", "--prompt", "It was"], "tokenizer.json fails its checksum"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--max-new-tokens", "1000"], "--max-new-tokens 1000: must be between 1 and"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--temperature", "-1"], "--temperature -1.0"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--top-p", "2"], "--top-p 2.0"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--tp", "3"], "--tp 3: must divide the model's 4 attention heads"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1," * 70 + "1"], "fills the model's 64-position context"),
    # --- convert ---------------------------------------------------------------------------------------
    (["convert", "--from-hf", "{hf.index_not_json}", "--out", "c1"], "not valid JSON (an index of safetensors files)"),
    (["convert", "--from-hf", "{hf.index_no_map}", "--out", "c2"], "'weight_map' must map tensor names"),
    (["convert", "--from-hf", "{hf.index_list_map}", "--out", "c3"], "'weight_map' must map tensor names"),
    (["convert", "--from-hf", "{hf.index_escape}", "--out", "c4"], "'../../secret.safetensors' is not a plain"),
    (["convert", "--from-hf", "{hf.config_list}", "--out", "c5"], "config.json holds a JSON list"),
    (["convert", "--from-hf", "{hf.config_missing_heads}", "--out", "c6"], "has no 'num_attention_heads'"),
    (["convert", "--from-hf", "{hf.config_zero_heads}", "--out", "c7"], "num_attention_heads=0 must be a whole number >= 1"),
    (["convert", "--from-hf", "{hf.config_string_layers}", "--out", "c8"], "num_hidden_layers='1' must be a whole number"),
    (["convert", "--from-hf", "{hf.config_unknown_type}", "--out", "c9"], "model_type 'mamba' is not supported"),
    (["convert", "--from-hf", "{hf.config_partial_rope}", "--out", "c12"], "partial_rotary_factor=0.5 is not supported"),
    (["convert", "--to-hf", "{file.a_dir}", "--out", "c10"], "not a complete checkpoint"),
    (["convert", "--to-hf", "{ck.manifest_array}", "--out", "c11"], "holds a JSON list, not an object"),
    # --- plan --------------------------------------------------------------------------------------------
    (["plan", "--model", "{plan.array}"], "config.json holds a JSON list"),
    (["plan", "--model", "{plan.no_heads}"], "has no 'n_head'"),
    (["plan", "--model", "{plan.no_ffn}"], "has no 'intermediate_size'"),
    (["plan", "--model", "{plan.zero_heads}"], "n_head=0 must be a whole number >= 1"),
    (["plan", "--model", "{plan.string_layers}"], "n_layer='96' must be a whole number"),
    (["plan", "--model", "{plan.zero_layers}", "--inference"], "n_layer=0 must be a whole number"),
    (["plan", "--model", "{ck.manifest_not_json}"], "manifest.json: not valid JSON"),
    (["plan", "--model", "tiny", "--layout", "tp=0"], "--layout tp=0: tp=0: must be >= 1"),
    (["plan", "--model", "tiny", "--layout", "dp=abc"], "dp=abc is not a number"),
    (["plan", "--model", "small", "--layout", "tp=4,dp=2"], "tp=4: must divide the model's 6 attention heads"),
    (["plan", "--model", "tiny", "--layout", "dp=4,pp=2,zero=3,zb"], "schedule=zb: not with zero 3"),
    (["plan", "--model", "tiny", "--layout", "dp=8,zero=3,reshard=false"], "reshard=False: only with zero 3 and pp 2"),
    (["plan", "--model", "tiny", "--layout", "dp=8,sp"], "sp=True: needs tp 2 or more"),
    (["plan", "--model", "tiny", "--layout", "dp=8,gather=bf16"], "gather=bf16: sets the dtype ZeRO-1/2/3 gather"),
    (["plan", "--model", "tiny", "--precision", "fp32", "--layout", "dp=8,zero=3,gather=bf16"],
     "gather=bf16: only with dtype bf16"),
    (["plan", "--model", "tiny", "--layout", "dp=8,reduce=fp16"], "reduce=fp16: valid: fp32, bf16"),
    (["plan", "--model", "tiny", "--layout", "pp=8"], "pp=8: with 1 virtual stage(s), 8 chunks"),
    (["plan", "--model", "tiny", "--global-batch", "4", "--layout", "dp=8"],
     "--global-batch 4: must be a multiple of micro_batch 1 x dp 8"),
    (["plan", "--model", "tiny", "--chart", "/nonexistent/dir/c.png"],
     "--chart /nonexistent/dir/c.png: the directory /nonexistent/dir does not exist"),
    (["plot", "{file.empty.txt}", "--out", "/nonexistent/p.png"], "the directory /nonexistent does not exist"),
    (["plan", "--model", "tiny", "--network", "nan"], "--network nan"),
    (["plan", "--model", "tiny", "--network", "inf"], "--network inf"),
    (["plan", "--model", "tiny", "--seq-len", "0"], "--seq-len 0: must be between 1"),
    (["plan", "--model", "tiny", "--inference", "--context", "0"], "--context 0: must be between 1"),
    (["plan", "--model", "tiny", "--efficiency", "nan"], "--efficiency nan: must be a number"),
    (["plan", "--model", "tiny", "--inference", "--efficiency", "0"], "--efficiency 0.0: must be in (0, 1]"),
    (["plan", "--model", "tiny", "--tokens", "lots"], "--tokens lots: give a positive number"),
    (["plan", "--model", "tiny", "--tokens", "0T"], "--tokens 0T: give a positive number"),
    (["plan", "--model", "tiny", "--days", "3"], "--days 3.0: needs --tokens"),
    (["plan", "--model", "tiny", "--price-per-device-hour", "2"], "--price-per-device-hour 2.0: needs --tokens"),
    (["plan", "--model", "tiny", "--tokens", "1B", "--price-per-device-hour", "-2"],
     "--price-per-device-hour -2.0: must be a price >= 0"),
    (["plan", "--model", "tiny", "--tokens", "1B", "--days", "0"], "--days 0.0: must be > 0"),
    (["plan", "--model", "tiny", "--tokens", "1B", "--days", "3", "--nodes", "2"], "--nodes 2: --days finds"),
    (["plan", "--model", "tiny", "--tokens", "1B", "--days", "3", "--layout", "dp=8"], "--layout dp=8: a layout fixes"),
    (["plan", "--model", "tiny", "--inference", "--efficiency", "1.5"], "--efficiency 1.5: must be in (0, 1]"),
    (["plan", "--model", "tiny", "--top", "0"], "--top 0: must be >= 1"),
    (["plan", "--model", "tiny", "--gpus-per-node", "0"], "--gpus-per-node 0: must be >= 1"),
    (["plan", "--model", "tiny", "--inference", "--batch", "0"], "--batch 0: must be >= 1"),
    (["plan", "--model", "tiny", "--device", "Z80"], "--device Z80: valid"),
    (["plan", "--model", "tiny", "--fp8"], "--fp8: the A100-80G has no FP8 matrix units; valid devices: H100-80G, H800"),
    (["plan", "--model", "tiny", "--device", "H100-80G", "--precision", "fp32", "--fp8"],
     "--fp8: FP8 matmuls in a bf16 or fp16 run (Transformer Engine's recipe); --precision is fp32"),
    (["plan", "--model", "tiny", "--inference", "--fp8"], "--fp8: only without --inference"),
    (["plan", "--model", "tiny", "--framework", "megatron"],
     "--framework megatron: valid: strata, megatron-lm, megatron-core, megatron-deepspeed, deepspeed, torchtitan"),
    (["plan", "--model", "tiny", "--inference", "--framework", "megatron-core"],
     "--framework megatron-core: only without --inference (training plans read it)"),
    (["plan", "--model", "tiny", "--inference", "--serving-stack", "tgi"],
     "--serving-stack tgi: valid: strata, hf-transformers, vllm"),
    (["plan", "--model", "tiny", "--serving-stack", "vllm"], "--serving-stack vllm: only with --inference (serving plans read it)"),
    (["plan", "--model", "tiny", "--device", "H100-80G", "--power-cap", "100"],
     "--power-cap 100: the H100-80G takes 200 to 700 W"),
    (["plan", "--model", "tiny", "--device", "B200", "--power-cap", "500"],
     "--power-cap 500: the table has no power range for the B200; valid with: A100-40G"),
    (["plan", "--model", "tiny", "--power-cap", "nan"], "--power-cap nan: must be a number"),
    (["plan", "--model", "tiny", "--power-cap", "watts"], "argument --power-cap: invalid float value: 'watts'"),
    (["plan", "--model", "tiny", "--inference", "--power-cap", "300"], "--power-cap 300.0: only without --inference"),
    (["plan", "--model", "tiny", "--optimizer", "adam"],
     "--optimizer adam: valid: adamw (two fp32 moments; the default), sgd (with momentum: one), lion"),
    # --- bench ---------------------------------------------------------------------------------------------
    (["bench", "comm", "--min-bytes", "1Q"], "is not a size"),
    (["bench", "comm", "--max-bytes", "inf"], "is not a size"),
    (["bench", "comm", "--factor", "1"], "--factor 1: must be >= 2"),
    (["bench", "comm", "--iters", "0"], "--iters 0: must be >= 1"),
    (["bench", "comm", "--nproc", "1"], "--nproc 1: a collective needs 2 or more ranks"),
    (["bench", "generate", "--model", "tiny", "--batch", "0"], "--batch"),
    (["bench", "generate", "--model", "tiny", "--lengths", "abc"], "--lengths"),
    (["bench", "generate", "--checkpoint", "{ck.manifest_array}"], "holds a JSON list, not an object"),
    # --- the rest ----------------------------------------------------------------------------------------
    (["schedule", "--pp", "0"], "--pp 0: must be >= 1"),
    (["schedule", "--micro-batches", "0"], "--micro-batches 0: must be >= 1"),
    (["plot", "/nonexistent.jsonl", "--out", "x.png"], "no such file"),
    (["plot", "{file.empty.txt}", "--out", "p.png"], "holds no train or eval records"),
    (["plot", "{file.binary.txt}", "--out", "p.png"], "not a metrics file"),
    # --- what a hostile probe found next ----------------------------------------------------------------
    (["train", "--seed", "99999999999999999999999"], "--seed 99999999999999999999999: must be at most 9,223,372,036,854,775,807"),
    (["train", "--warmup-steps", "5", "--steps", "2"], "--warmup-steps 5: must be at most steps 2"),
    (["train", "--device", "cuda"], "--device cuda: no CUDA device here"),
    (["train", "--device", "tpu"], "--device tpu: valid: auto, cpu, cuda"),
    ([*TRAIN, "--data", "{data.good}", "--seq-len", "16", "--resume", "{ck.good}"], "is at step 2 already"),
    (["data", "prepare", "--source", "{file.src_dirs}", "--out", "o8"], "directory holds no .txt files"),
    (["data", "prepare", "--source", "{file.src_broken}", "--out", "o9"], "broken.txt is a broken link"),
    (["convert", "--from-hf", "{hf.config_list}", "--out", "{file.a_file}"], "exists and is not a directory"),
    (["convert", "--from-hf", "{hf.config_list}", "--out", "{ck.save}"], "holds files already"),
    (["convert", "--from-hf", "{hf.bad_tokenizer}", "--out", "c12"], "not a tokenizer.json that `tokenizers` reads"),
    (["convert", "--to-hf", "{ck.good}", "--out", "{file.a_file}"], "exists and is not a directory"),
    (["convert", "--to-hf", "{ck.good}", "--out", "{hf.config_list}"], "holds a model already (config.json)"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--temperature", "inf"], "--temperature inf: must be finite"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--device", "tpu"], "--device tpu: valid: auto, cpu, cuda"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--device", "cuda"], "--device cuda: no CUDA device here"),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--timeout", "0"], "--timeout 0.0: must be > 0"),
    ([*GEN, "{ck.good}", "--prompt", "It", "--stop", ""], "an empty stop string"),
    (["bench", "comm", "--ops", ""], "--ops '': give at least one"),
    (["bench", "comm", "--tp", "0"], "--tp 0, --pp 1: must be >= 1"),
    (["bench", "comm", "--pp", "-1"], "--pp -1: must be >= 1"),
    (["bench", "comm", "--timeout", "nan"], "--timeout nan: must be a number"),
    (["bench", "comm", "--timeout", "-1"], "--timeout -1.0: must be > 0"),
    (["bench", "comm", "--device", "tpu"], "--device tpu: valid"),
    (["bench", "generate", "--model", "tiny", "--threads", "0"], "--threads 0: must be >= 1"),
    (["bench", "generate", "--model", "tiny", "--device", "tpu"], "--device tpu: valid: cpu, cuda"),
    (["plan", "--model", "tiny", "--chart", "chart"], "--chart chart: give a file name ending in .png"),
    (["plan", "--model", "tiny", "--device", "cpu-local", "--profile", "{file.not_json.json}"],
     "not valid JSON (a calibration profile"),
    (["plan", "--model", "tiny", "--inference", "--device", ""], "name one or more devices"),
    (["plan", "--model", "tiny", "--inference", "--per-layer-us", "nan"], "--per-layer-us nan: must be a number"),
    (["plan", "--model", "tiny", "--inference", "--per-token-us", "-1"], "--per-token-us -1.0: must be a number"),
    (["schedule", "--schedule", "interleaved"], "--schedule interleaved: needs virtual_stages 2"),
    (["schedule", "--schedule", "1f1b", "--virtual-stages", "2"], "--virtual-stages 2: only with pp 2 or more and"),
    (["schedule", "--pp", "100000", "--micro-batches", "100000"], "more than the 100,000 simulated"),
    (["schedule", "--out", "s"], "--out s: give a file name ending in .png"),
    (["plot", "{file.no_loss.jsonl}", "--out", "p.png"], "a train record without a number for each of step, loss"),
    (["plot", "{file.a_dir}", "--out", "p.png"], "is a directory"),
    (["plot", "{file.empty_trace.json}", "--out", "p.png"], "the trace holds no pipeline actions"),
    (["plot", "{file.no_loss.jsonl}", "--out", "p"], "--out p: give a file name ending in .png"),
    (["launch", "--hostfile", "{file.hosts_binary}", "--", "train"], "not UTF-8 text"),
    (["launch", "--hostfile", "{file.hosts_lo}", "--master-port", "0", "--", "train"], "--master-port 0: valid 1-65535"),
    (["launch", "--hostfile", "{file.hosts_lo}", "--master-port", "70000", "--", "train"], "valid 1-65535"),
    (["launch", "--hostfile", "{file.hosts_lo}", "--", "launch", "--hostfile", "x"], "runs train, doctor or bench comm"),
    (["launch", "--hostfile", "{file.hosts_lo}", "--", "bogus"], "invalid choice: 'bogus'"),
    (["launch", "--hostfile", "{file.hosts_lo}", "--dry-run", "--", "train", "--lr", "-1"], "--lr -1.0: must be > 0"),
    (["doctor", "--layout", "dp=2"], "--layout: only with --bandwidth"),
    (["doctor", "--device", "bogus"], "--device: only with --bandwidth"),
    (["doctor", "--global-batch", "0"], "--global-batch: only with --bandwidth"),
    (["doctor", "--hostfile", "{file.hosts_binary}"], "not UTF-8 text"),
    (["calibrate", "--nproc", "1000"], "--nproc 1000: the run needs at least"),
    (["calibrate", "--rounds", "0"], "--rounds 0: must be 1 or more"),
    (["calibrate", "--worker", "part.json", "--worker-effort", "{oops"], "--worker-effort {oops: not the JSON of"),
    (["calibrate", "--worker", "part.json", "--worker-effort", "[0.1]"], "--worker-effort [0.1]: not the JSON"),
    # --- run outputs, Slurm -------------------------------------------------------------------------------
    ([*TRAIN, "--tensorboard", "{file.a_file}"], "--tensorboard {file.a_file}: is a file; want a directory"),
    ([*TRAIN, "--run-dir", "{file.a_file}"], "--run-dir {file.a_file}: is a file; want a directory"),
    ([*TRAIN, "--run-dir", "a_file/run"], "a_file is a file, so nothing can be made under it"),
    ([*TRAIN, "--tensorboard", ""], "--tensorboard '': give a directory"),
    (["launch", "--slurm-script", "/nonexistent/dir/job.sh", "--nodes", "2", "--gpus-per-node", "8", "--", "train"],
     "--slurm-script /nonexistent/dir/job.sh: the directory /nonexistent/dir does not exist"),
    (["launch", "--slurm-script", "job.sh", "--nodes", "0", "--gpus-per-node", "8", "--", "train"],
     "--nodes 0: must be >= 1"),
    (["launch", "--slurm-script", "job.sh", "--nodes", "2", "--gpus-per-node", "-1", "--", "train"],
     "--gpus-per-node -1: must be >= 1"),
    (["launch", "--slurm-script", "job.sh", "--nodes", "2", "--", "train"], "give the job's size, --nodes N"),
    (["launch", "--slurm-script", "job.sh", "--nodes", "1", "--gpus-per-node", "2", "--socket-ifname", "eth0;reboot",
      "--", "train"], "--socket-ifname eth0;reboot: not a network interface name"),
    (["launch", "--slurm-script", "job.sh", "--nodes", "1", "--gpus-per-node", "2", "--", "doctor"],
     "writes a script for train only"),
    (["launch", "--slurm-script", "job.sh", "--nodes", "2", "--gpus-per-node", "2", "--", "train", "--tp", "3"],
     "--tp 3: tp x pp = 3 does not divide the world size 4"),
    (["launch", "--slurm-script", "job.sh", "--nodes", "1", "--gpus-per-node", "2", "--", "train", "--nproc", "2"],
     "--nproc 2: leave it out of the command"),
    (["launch", "--slurm-script", "job.sh", "--hostfile", "{file.hosts_lo}", "--nodes", "1", "--gpus-per-node", "2",
      "--", "train"], "--slurm-script: not with --hostfile"),
    (["launch", "--hostfile", "{file.hosts_lo}", "--nodes", "2", "--", "train"], "--nodes: only with --slurm-script"),
    (["launch", "--slurm-script", "job.sh", "--nodes", "1", "--gpus-per-node", "2", "--dry-run", "--", "train"],
     "--dry-run: only with --hostfile"),
    (["launch", "--", "train"], "give --hostfile FILE"),
]

# A task srun started: Slurm's variables, set here by hand (one node, two tasks).
SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost"}
SLURM_CASES = [  # (args, needle, environment)
    (TRAIN, "SLURM_JOB_NODELIST 'node[01-': a '[' is not closed", {**SRUN_TASK, "SLURM_JOB_NODELIST": "node[01-"}),
    (TRAIN, "SLURM_JOB_NODELIST 'a,,b': an empty name", {**SRUN_TASK, "SLURM_JOB_NODELIST": "a,,b"}),
    (TRAIN, "SLURM_NTASKS 'two': want a whole number >= 1", {**SRUN_TASK, "SLURM_NTASKS": "two"}),
    (TRAIN, "SLURM_PROCID 2: must be below SLURM_NTASKS 2", {**SRUN_TASK, "SLURM_PROCID": "2"}),
    (TRAIN, "MASTER_PORT '0': valid 1-65535", {**SRUN_TASK, "MASTER_PORT": "0"}),
    (TRAIN, "the master node localhost resolves to 127.0.0.1 (loopback)",
     {**SRUN_TASK, "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost,node2"}),
    ([*TRAIN, "--nproc", "2"], "--nproc 2: starts 2 ranks on each node, so srun must run one task per node", SRUN_TASK),
    ([*TRAIN, "--max-restarts", "1"], "--max-restarts 1: srun starts each rank itself", SRUN_TASK),
    ([*TRAIN, "--lr", "-1"], "--lr -1.0: must be > 0", SRUN_TASK),
]
# The communication semantics, as a flag and from the environment (checked before any process starts).
SEMANTICS_CASES = [
    ([*TRAIN, "--comm-semantics", "mpi"], "--comm-semantics mpi: valid: native, nccl", None),
    ([*TRAIN, "--nproc", "2"], "$STRATA_COMM_SEMANTICS gloo: valid: native, nccl", {"STRATA_COMM_SEMANTICS": "gloo"}),
    (["bench", "comm", "--nproc", "2"], "$STRATA_COMM_SEMANTICS gloo: valid: native, nccl",
     {"STRATA_COMM_SEMANTICS": "gloo"}),
]


MORE_CASES = bad_input_checkpoints.CASES + bad_input_flags.CASES + bad_input_hosts.CASES


def _stable(text: str) -> str:
    """A test id without the hostfiles' temporary directory: pytest-xdist's workers each import
    the table, and must collect the same ids."""
    return text.replace(bad_input_hosts.HOSTFILES, "{hosts}")


@pytest.mark.parametrize("args,needle,env", [(a, n, None) for a, n in CASES] + SLURM_CASES + SEMANTICS_CASES
                         + MORE_CASES,
                         ids=[" ".join(a)[:60] for a, _ in CASES] + [f"srun: {n[:50]}" for _, n, _ in SLURM_CASES]
                         + [f"semantics: {' '.join(a[-2:])} {e}" for a, _, e in SEMANTICS_CASES]
                         + [f"{_stable(' '.join(a))[:50]}: {_stable(n)[:30]}" for a, n, _ in MORE_CASES])
def test_bad_input_is_one_line_exit_code_2_and_no_traceback(fx, args, needle, env):
    result = run_strata(*(_fill(a, fx) for a in args), cwd=fx["root"], env=env)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("strata: error:"), result.stderr
    needle = needle.replace("{file.a_file}", fx["file"]["a_file"]).replace("{file.a_dir}", fx["file"]["a_dir"])
    assert needle in lines[0], lines[0]


def test_the_table_covers_every_command():
    commands = {a[0] if a[0] not in ("data", "bench") else " ".join(a[:2]) for a, _ in CASES}
    assert {"train", "plan", "generate", "convert", "data prepare", "bench comm", "bench generate"} <= commands
    assert len(CASES) >= 50
