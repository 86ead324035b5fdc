"""bench/gpu_check.py, kept from rotting between the rare GPU runs: its quick mode runs every part's
code on tiny models on the CPU. Asserts on the JSON's structure and the correctness results, never
on times."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
PARTS = ("environment", "correctness", "step", "mfu", "event_timing", "collectives", "generation", "memory",
         "step_time")


def gpu_check(*args, timeout=600, cache=None):
    """The check in a subprocess; the measured-peak cache in `cache` (else the tests' own), never the user's."""
    env = {**ENV, "STRATA_CACHE_DIR": str(cache or os.environ["STRATA_CACHE_DIR"])}
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    result = gpu_check("--device", "cpu", "--quick", "--out", out, cache=out / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.txt").read_text()


def test_quick_mode_runs_every_part_and_the_device_equals_the_cpu(quick):
    results, report = quick
    assert results["quick"] and results["device"] == "cpu" and results["skipped"] == []
    for name in PARTS:
        assert results[name]["status"] == "done", (name, results[name].get("error"))
    correctness = results["correctness"]
    assert correctness["passed"]
    for dtype, tolerance in (("fp64", 1e-9), ("fp32", 1e-4)):
        run = correctness["training"][dtype]
        assert run["passed"] and run["tolerance"] == tolerance and len(run["losses_device"]) == 6
        assert run["max_loss_diff"] <= tolerance and run["max_param_diff"] <= tolerance
    for greedy in correctness["generation"].values():
        assert greedy["passed"] and len(greedy["tokens_device"]) == 3 and len(greedy["tokens_device"][0]) == 12
    assert report.startswith("strata GPU check (quick)") and "correctness: PASS" in report


def test_quick_mode_reports_mfu_memory_step_time_and_generation(quick):
    results, _ = quick
    mfu = results["mfu"]
    assert mfu["peak_flops_table"] == 989e12 and mfu["peak_flops_measured_matmul"] > 0
    assert [m["model"] for m in mfu["models"]] == ["tiny", "tiny-gpt2"]
    for m in mfu["models"]:
        assert m["eager"]["status"] == "measured" and 0 < m["eager"]["mfu_table_peak"] < 1
        assert m["eager"]["compile_s"] is None
        assert m["compile"]["status"] == "measured" and m["compile"]["compile_s"] > 0
    layouts = results["memory"]["layouts"]
    assert [(r["micro_batch"], r["checkpointing"]) for r in layouts] == \
        [(b, c) for b in (1, 4) for c in ("none", "selective", "full")]
    for row in layouts:
        assert row["error"] is None and row["predicted_bytes"] > 0 and row["measured_bytes"] > 0
        assert set(row["predicted_breakdown"]) >= {"weights", "gradients", "optimizer_states", "activations"}
    runs = results["step_time"]["runs"]
    assert len(runs) == 7  # the six memory layouts and gpt2 (the MFU run of tiny is one of the six)
    assert all(r["measured_step_s"] > 0 and r["predicted_step_s"] > 0 for r in runs)
    generation = results["generation"]
    assert [b["batch"] for b in generation["batches"]] == [1, 8]
    for b in generation["batches"]:
        assert b["ttft_s"] > 0 and b["tpot_s"] > 0 and b["predicted_ttft_s"] is None
        assert b["predicted_tpot_s"] > 0 and b["predicted_tpot_calibrated_s"] > 0
    assert generation["calibration"]["per_layer_s"] >= 0


def test_quick_mode_on_a_cpu_reports_a_measured_mfu_denominator_and_no_allocator(quick):
    results, report = quick
    assert results["environment"]["table_entry"] is None  # a CPU: the planner's H200 stands in
    denominator = results["mfu"]["denominator"]
    assert set(denominator) == {"bf16", "fp32"}
    for d in denominator.values():
        assert d["trainer_source"] == "measured" and d["note"] is None and d["trainer_peak_flops"] > 0
        assert d["table_device"] is None and d["table_peak_flops"] is None and d["measured_over_table"] is None
        assert d["measured_matmul_flops"] > 0
    record = results["mfu"]["trainer_record"]
    assert record["agrees"] and record["peak_flops_source"] == "measured"
    assert record["peak_flops"] == denominator["bf16"]["trainer_peak_flops"]
    assert record["memory_reserved_bytes"] is None and record["alloc_retries"] is None
    assert record["largest_alloc_bytes"] is None
    assert "trainer's bf16 denominator:" in report and "(measured, as above)" in report


def test_quick_mode_times_the_workloads_by_the_clock_and_the_wall(quick):
    results, report = quick
    timing = results["event_timing"]
    assert timing["clock"] == "the host clock"  # DeviceClock on a CPU
    assert [w["workload"] for w in timing["workloads"]] == [
        "matmuls 4x256 bf16", "tiny train step (bf16, mb 4, seq 64)", "tiny-gpt2 train step (bf16, mb 4, seq 64)"]
    for w in timing["workloads"]:
        assert w["repeats"] == 3
        assert set(w) >= {"events_s", "launch_s", "stream_s", "wall_s", "events_over_wall", "launch_over_wall"}
        assert all(isinstance(w[key], float) for key in ("events_s", "wall_s", "events_over_wall"))
    assert "event timing (the host clock)" in report


def test_quick_mode_measures_issue_53_s_step(quick):
    """Host syncs within their budget, initial values equal on the device and the CPU, the
    weights made, the chunked loss's peak under half the unchunked one."""
    results, report = quick
    part = results["step"]
    assert part["syncs"]["tiny"]["strata_total"] <= 1 and part["syncs"]["tiny"]["passed"]
    assert part["syncs"]["tiny-moe"]["strata_total"] == 2  # fp32 on a CPU: torch's grouped product
    assert part["initial_values"]["passed"] and part["initial_values"]["tensors"] >= 10
    assert part["startup"]["elements"] == 106816  # tiny's parameters
    loss = part["chunked_loss"]
    assert loss["passed"] and loss["chunked"] < loss["unchunked"] / 2
    assert "step: host syncs a step: tiny fp32 1" in report and "initial values on the device vs the CPU" in report


def test_quick_mode_starts_a_world_1_group_with_the_flight_recorders_variables(quick):
    """On a GPU: NCCL; here the same program on gloo, under NCCL's rules."""
    results, report = quick
    part = results["collectives"]
    assert part["ok"] and part["backend"] == "gloo", part
    assert {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"} <= set(part["variables"])
    assert part["all_reduces_recorded"] >= 2 and "a tensor made on the host" in part["refused"]
    assert part["diagnosis"] is None  # nothing hung
    assert "collectives: world-1 gloo group with the flight recorder's variables" in report


def test_a_spent_budget_skips_the_parts_and_says_so(tmp_path):
    result = gpu_check("--device", "cpu", "--quick", "--out", tmp_path, "--budget-s", 0.001, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["environment"]["status"] == "done"  # always: it costs nothing
    assert all(results[name]["status"] == "skipped" for name in PARTS[1:])
    assert [s["part"] for s in results["skipped"]] == list(PARTS[1:])
    assert "skipped: correctness all (budget of 0 s spent)" in (tmp_path / "gpu_check.txt").read_text()
    assert "event_timing all (budget of 0 s spent)" in (tmp_path / "gpu_check.txt").read_text()


def test_without_tqdm_and_safetensors_the_check_runs_on_stand_ins(tmp_path):
    """The GPU machine's torch comes without strata's other dependencies, and nothing can be
    installed there: what the check imports but never calls is stood in for."""
    argv = ["gpu_check.py", "--device", "cpu", "--quick", "--parts", "correctness", "--out", str(tmp_path)]
    code = ("import runpy, sys; sys.modules['tqdm'] = sys.modules['safetensors'] = None; "
            f"sys.argv = {argv!r}; runpy.run_path({SCRIPT!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["environment"]["stubbed_modules"] == ["tqdm", "safetensors"]
    assert results["correctness"]["passed"]


@pytest.mark.parametrize("args,needle", [
    (["--device", "tpu"], "--device tpu: valid: cuda, cpu"),
    (["--budget-s", "0"], "--budget-s 0.0: must be > 0 seconds"),
    (["--parts", "mfu,speed"], "--parts speed: valid: environment, correctness"),
    (["--budget-s", "soon"], "argument --budget-s: invalid float value: 'soon'"),
])
def test_bad_flags_are_one_line_and_exit_code_2(tmp_path, args, needle):
    result = gpu_check("--out", tmp_path, *args, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("gpu_check: error:"), result.stderr
    assert needle in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu_is_one_line_and_exit_code_2(tmp_path):
    result = gpu_check("--device", "cuda", "--out", tmp_path, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--device cuda: no CUDA device here" in result.stderr
