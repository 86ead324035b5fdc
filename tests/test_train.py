import json

import torch

from strata.config import train_config
from strata.train.trainer import train

FAST = dict(model="tiny", seq_len=32, progress=False, peak_flops=1e10, eval_batches=2, lr=3e-3)


def run(**overrides) -> dict:
    return train(train_config(**{**FAST, **overrides}))


def test_training_lowers_the_loss():
    summary = run(steps=30, global_batch=8, micro_batch=8, warmup_steps=3)
    first, last = summary["val_losses"][0][1], summary["val_losses"][-1][1]
    assert last < first - 0.5, (first, last)


def test_metrics_file_has_one_record_per_step(tmp_path):
    path = tmp_path / "m.jsonl"
    run(steps=3, global_batch=4, micro_batch=2, metrics=str(path))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "model_state_bytes", "peak_mem_bytes"):
        assert all(isinstance(r[key], (int, float)) for r in train_records), key
    # fp32 AdamW: 4 bytes of weights + 4 of gradients + 8 of moments per parameter (Rajbhandari et al.)
    n_params = 106_816
    assert train_records[-1]["model_state_bytes"] == 16 * n_params
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 3]


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    common = dict(steps=6, global_batch=4, micro_batch=2, warmup_steps=2, dtype="fp32", seed=11)
    straight = run(**common)
    run(**common, save=str(tmp_path / "ck"), save_every=3)
    resumed = run(**common, resume=str(tmp_path / "ck" / "step_000003"))
    assert resumed["losses"] == straight["losses"][3:]  # exact equality, not a tolerance
    for (name, p), q in zip(straight["model"].named_parameters(), resumed["model"].parameters()):
        assert torch.equal(p, q), name


def test_gradient_accumulation_equals_one_big_batch():
    whole = run(steps=3, global_batch=8, micro_batch=8, dtype="fp64")
    accumulated = run(steps=3, global_batch=8, micro_batch=2, dtype="fp64")
    torch.testing.assert_close(accumulated["losses"], whole["losses"], rtol=1e-10, atol=0)


def test_bf16_and_fp16_track_fp32_over_50_steps():
    fp32 = run(steps=50, global_batch=8, micro_batch=8)
    for dtype in ("bf16", "fp16"):
        low = run(steps=50, global_batch=8, micro_batch=8, dtype=dtype)
        for a, b in zip(fp32["losses"], low["losses"]):
            assert abs(a - b) / a < 0.01, dtype


def test_peak_flops_measurement_shrinks_for_a_dtype_without_fast_kernels():
    # fp16 matmuls on this CPU run ~30x slower than fp32: a full-size measurement took minutes
    # per rank (an fp16 run seemed to hang before its first step); the size now shrinks to fit
    # what one product does in 0.2 s at the rate the small probe measured.
    from strata.train.metrics import matmul_size_for
    assert matmul_size_for(rate=1e12) == 2048  # fast kernels: the full size
    assert matmul_size_for(rate=3e8) == 256  # fp16 on this CPU: 3e8 FLOP/s, (3e7) ** (1/3) = 310, down to 256
    assert matmul_size_for(rate=1e6) == 256  # slower still: never below the smallest size (the root is 46)
    assert matmul_size_for(rate=1e10) == 960  # (1e10 x 0.2 / 2) ** (1/3) = 1000, down to a multiple of 64
