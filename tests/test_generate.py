"""Generation: the batched engine against full recomputation, sampling, stop strings, tensor- and
pipeline-parallel generation against one process, the latency benchmark, and the serving planner."""

import dataclasses
import json

import pytest
import torch
from architectures import ARCHITECTURES

from strata.infer.generate import FINISHED, Sampler, Sampling, generate, left_pad
from strata.infer.kv_cache import KVCache
from strata.infer.session import Printer, StopStrings
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.plan.hardware import DEVICES
from strata.plan.inference import Overheads, Serving, estimate_serving, kv_cache_bytes
from strata.tools.bench_generate import least_squares

from cli_runner import run_strata

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], [20, 21, 22, 23]]


def strata(*args):
    return run_strata(*args, timeout=300)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_padded_batch_decoding_equals_full_recomputation_of_each_row(arch):
    """Left-padded prompts of different lengths, prefilled together and decoded with the cache:
    each row's logits at every step equal a full forward of that row's own tokens alone."""
    cfg = ARCHITECTURES[arch]
    model = build_model(cfg, dtype=torch.float32, seed=1).eval()
    ids, pad = left_pad(PROMPTS)
    new = torch.randint(0, cfg.vocab_size, (len(PROMPTS), 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = KVCache(model, len(PROMPTS), ids.shape[1] + new.shape[1], pad)
        steps = [model(ids, cache=cache, last_only=True)[:, -1]]
        steps += [model(new[:, i:i + 1], cache=cache, last_only=True)[:, -1] for i in range(new.shape[1] - 1)]
        for row, prompt in enumerate(PROMPTS):
            sequence = torch.tensor([prompt + new[row].tolist()])
            full = model(sequence)[0, len(prompt) - 1:-1]  # the logits each step should have produced
            torch.testing.assert_close(torch.stack([s[row] for s in steps]), full, rtol=1e-5, atol=1e-5)


def test_a_request_answers_the_same_alone_or_in_a_batch():
    model = build_model(get_preset("tiny"), seed=2)
    batched = torch.stack(list(generate(model, PROMPTS, 10)), dim=1)
    for row, prompt in enumerate(PROMPTS):
        assert batched[row].tolist() == torch.cat(list(generate(model, [prompt], 10))).tolist()
    # sampling draws from each row's own generator (seed, row): batch-mates change nothing
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=4)
    alone = torch.cat(list(generate(model, [PROMPTS[0]], 12, sampling))).tolist()
    with_others = torch.stack(list(generate(model, PROMPTS, 12, sampling)), dim=1)[0].tolist()
    assert alone == with_others


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    sampler = Sampler([[0, 2]], vocab_size=4, max_new_tokens=5, sampling=Sampling(repetition_penalty=4.0))
    # token 0: 2.0 -> 0.5 (seen, positive); token 1: 1.0 (unseen); token 2: -1 -> -4; token 3: 0.9
    assert sampler.choose(torch.tensor([[2.0, 1.0, -1.0, 0.9]])).tolist() == [1]
    # token 1 is now seen too: 1.0 -> 0.25, so token 3 wins
    assert sampler.choose(torch.tensor([[2.0, 1.0, -1.0, 0.9]])).tolist() == [3]
    plain = Sampler([[0, 2]], vocab_size=4, max_new_tokens=5, sampling=Sampling())
    assert plain.choose(torch.tensor([[2.0, 1.0, -1.0, 0.9]])).tolist() == [0]


def test_rows_stop_on_their_own_and_report_finished():
    stop_after = {0: 2, 1: 4}
    sampler = Sampler([[1], [1]], vocab_size=3, max_new_tokens=10, sampling=Sampling(),
                      stop=lambda row, answer: len(answer) == stop_after[row])
    logits = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    produced = [sampler.choose(logits).tolist() for _ in range(4)]
    assert produced == [[1, 2], [1, 2], [FINISHED, 2], [FINISHED, 2]]
    assert sampler.done and sampler.answers == [[1, 1], [2, 2, 2, 2]]


@pytest.fixture(scope="module")
def tokenizer():
    from strata.data.tokenizer import train_bpe
    return train_bpe(["The cat sat. The dog ran.\n\nThe end. " * 50], 300)


def test_stop_strings_cut_the_answer_and_streaming_holds_back_a_possible_stop(tokenizer, capsys):
    import sys
    stops = StopStrings(tokenizer, ["\n\n"], end_of_text=None)
    answer = tokenizer.encode(" The cat sat.\n\nThe dog").ids
    assert not stops(0, answer[:3])
    assert any(stops(0, answer[:k]) for k in range(1, len(answer) + 1))
    assert stops.cut(answer) == " The cat sat."
    printer = Printer(["Q:"], tokenizer, stops, sys.stdout)
    for k, token in enumerate(answer):
        printer.add(range(1), torch.tensor([token]))
        shown = capsys.readouterr().out
        assert "\n" not in shown  # the first newline may start the stop string: held back
        if stops(0, answer[:k + 1]):
            break
    printer.finish()
    assert capsys.readouterr().out == "\n"  # the rest: nothing more than the answer up to the stop


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    result = strata("train", "--model", "tiny", "--steps", 3, "--global-batch", 2, "--micro-batch", 2, "--seq-len", 32,
                    "--vocab-size", 250, "--save", root / "ck", "--no-progress", "--peak-flops", 1e10)
    assert result.returncode == 0, result.stderr
    return root / "ck"


def _generate_result(checkpoint, *extra):
    prompts = [a for p in ("1,2,3", "4,5", "7", "9,8,7,6") for a in ("--prompt-ids", p)]
    result = strata("generate", "--checkpoint", checkpoint, *prompts, "--max-new-tokens", 14, *extra)
    assert result.returncode == 0, result.stderr
    return result


def _generate(checkpoint, *extra):
    return _generate_result(checkpoint, *extra).stdout.splitlines()


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_pipeline_and_tensor_parallel_generation_equal_one_process(checkpoint, temperature):
    """Greedy and sampled: --pp 2 (two micro-batches in flight), --pp 2 with one, and
    --tp 2 --pp 2, token for token against one process. The --pp 2 run also reports --timing (on
    stderr: the answers on stdout are the same with it)."""
    single = _generate(checkpoint, "--temperature", temperature)
    assert len(single) == 4 and all(len(line.split()) >= 14 for line in single)
    timed = _generate_result(checkpoint, "--temperature", temperature, "--pp", 2, "--timing")
    assert timed.stdout.splitlines() == single
    assert "4 request(s), 56 answer tokens in" in timed.stderr and "tokens/s" in timed.stderr, timed.stderr
    if temperature == "0":
        assert _generate(checkpoint, "--pp", 2, "--micro-batches", 1, "--temperature", 0) == single
        assert _generate(checkpoint, "--tp", 2, "--pp", 2, "--temperature", 0) == single


@pytest.mark.parametrize("args,needle", [
    (["--micro-batches", "2"], "--micro-batches: only with --pp"),
    (["--pp", "2", "--micro-batches", "3"], "--micro-batches 3: must be between 1 and the 1 prompts"),
    (["--nproc", "3", "--tp", "2"], "--nproc 3: generation runs on tp x pp = 2 x 1 = 2 processes"),
    (["--stop", "x"], "--stop 'x': the checkpoint has no tokenizer.json"),
    (["--max-new-tokens", "64"], "--max-new-tokens 64: must be between 1 and 63 (what the model's 64-position "
                                  "context leaves after a 1-token prompt)"),
    (["--repetition-penalty", "0"], "--repetition-penalty 0.0: must be > 0"),
    (["--pp", "5"], "--pp 5: with 1 virtual stage(s), 5 chunks, but the model has only 2 layers"),
    (["--pp", "2", "--max-new-tokens", "64"], "--max-new-tokens 64: must be between 1 and 63"),  # before launching
    (["--tp", "2", "--prompt-ids", "300"], "prompt ids [300]: want at least one id, each in [0, 250)"),
    (["--tp", "2", "--prompt", "hi"], "has no tokenizer.json (trained on synthetic data); use --prompt-ids"),
])
def test_bad_generation_flags_are_one_line(checkpoint, args, needle):
    prompt = [] if "--prompt" in args or "--prompt-ids" in args else ["--prompt-ids", "1"]
    result = strata("generate", "--checkpoint", checkpoint, *prompt, *args)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert needle in result.stderr


# --- the latency benchmark ------------------------------------------------------------------------
def test_least_squares_recovers_a_line_and_its_fit():
    slope, intercept, r2 = least_squares([1, 2, 3, 4], [2.5, 4.5, 6.5, 8.5])
    assert (slope, intercept, r2) == pytest.approx((2.0, 0.5, 1.0))
    assert least_squares([1, 2, 3, 4], [1, 3, 1, 3])[2] == pytest.approx(0.2)


def test_bench_generate_against_transformers(tmp_path):
    result = strata("bench", "generate", "--model", "small", "--prompt-ids", "1,2,3", "--prompt-ids", "9",
                    "--lengths", "4,16,48", "--runs", 2, "--batch", "1,3",
                    "--compare", "--json", "--plot", tmp_path / "latency.png", "--threads", 1)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["same_answers"]  # the same weights give the same greedy answers in both engines
    rows = report["rows"]
    assert {(r["engine"], r["batch"]) for r in rows} == {(e, b) for e in ("strata", "transformers") for b in (1, 3)}
    assert {r["tokens"] for r in rows} == {4, 16, 48} and all(r["runs"] == 2 for r in rows)
    for r in rows:
        assert 0 < r["ttft_s"] < r["latency_s"]
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] / (r["tpot_ms"] / 1000))
    for fit in report["fits"]:
        assert fit["per_token"] > 0
    assert (tmp_path / "latency.png").stat().st_size > 10_000


# --- the serving planner --------------------------------------------------------------------------
def test_decode_latency_is_weight_bytes_over_bandwidth_plus_overheads():
    cfg = get_preset("gpt-j-6b")
    work, overheads = Serving(cfg, batch=1, context=1, precision="fp16"), Overheads(50e-6, 100e-6)
    kv_per_token = kv_cache_bytes(cfg, 1, 1, "fp16")
    assert kv_per_token == 2 * 28 * 4096 * 2  # keys and values, 28 layers, d 4096, 2 bytes
    embedding = cfg.vocab_size * cfg.d_model
    read = (cfg.num_params() - embedding) * 2 + kv_per_token  # every weight but the embedding table
    for name in ("A800-80G", "V100-32G"):
        device = DEVICES[name]
        e = estimate_serving(work, device, 1, 1, 1e12, 5e-6, overheads)
        assert e.memory_s == pytest.approx(read / device.memory_bandwidth)
        # the launches (28 x 50 us) hide behind the reads (5.8 and 13.2 ms); the step's own cost adds
        assert e.token_latency_s == pytest.approx(read / device.memory_bandwidth + 100e-6)
        added = estimate_serving(work, device, 1, 1, 1e12, 5e-6, dataclasses.replace(overheads, per_layer_on_host=False))
        assert added.token_latency_s == pytest.approx(read / device.memory_bandwidth + 28 * 50e-6 + 100e-6)
        assert e.weight_bytes == cfg.num_params() * 2 and e.fits
    result = strata("plan", "--inference", "--model", "gpt-j-6b", "--device", "A800-80G,V100-32G",
                    "--gpus-per-node", 1, "--precision", "fp16", "--context", 1, "--per-layer-us", 50,
                    "--per-token-us", 100)
    assert result.returncode == 0, result.stderr
    a800 = estimate_serving(work, DEVICES["A800-80G"], 1, 1, 1e12, 5e-6, overheads).token_latency_s
    v100 = estimate_serving(work, DEVICES["V100-32G"], 1, 1, 1e12, 5e-6, overheads).token_latency_s
    assert f"A800-80G: tp=1,pp=1 serves it fastest: {a800 * 1e3:.2f} ms per output token" in result.stdout
    assert f"V100-32G takes {v100 / a800:.2f}x the time per token of A800-80G" in result.stdout


def test_serving_plan_splits_a_model_that_does_not_fit_one_card():
    result = strata("plan", "--inference", "--model", "llama-70b", "--device", "A100-80G", "--gpus-per-node", 8,
                    "--batch", 4, "--json")
    assert result.returncode == 0, result.stderr
    layouts = json.loads(result.stdout)["layouts"]
    assert not any(e["fits"] for e in layouts if e["devices"] == 1)  # 138 GB of weights
    best = layouts[0]
    assert best["fits"] and best["tp"] > 1
    assert best["memory_bytes"] <= 80e9


@pytest.mark.parametrize("args,needle", [
    (["--batch", "0"], "--batch 0: must be >= 1"),
    (["--context", "99999"], "--context 99999: must be between 1 and the model's 2048"),
    (["--precision", "fp8"], "--precision fp8: valid for --inference: fp32, bf16, fp16, int8"),
    (["--device", "TPU"], "--device TPU: valid: V100-32G"),
])
def test_bad_serving_plan_input_is_one_line(args, needle):
    result = strata("plan", "--inference", "--model", "gpt-j-6b", *args)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert needle in result.stderr


def test_kv_cache_is_sized_from_the_tensor_parallel_slice():
    cfg = dataclasses.replace(get_preset("tiny"), n_kv_heads=2)
    assert kv_cache_bytes(cfg, 2, 10, "fp32", tp=2) == kv_cache_bytes(cfg, 2, 10, "fp32") / 2
    assert kv_cache_bytes(cfg, 2, 10, "fp32", tp=4) == kv_cache_bytes(cfg, 2, 10, "fp32") / 2  # one head kept each
