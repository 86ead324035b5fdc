"""Re-planning when the cluster changes: `strata train --parallel auto --resume auto` after a node
was lost or added asks the planner again for the new world size, keeps the global batch (the
accumulation changes) and resumes from the layout-free checkpoint."""

from __future__ import annotations

import json

from cli_runner import run_strata

# A calibration profile of this machine as `strata calibrate --nproc 4` writes it, with round
# numbers: the test is about re-planning, not about which layout the numbers favour.
COLLECTIVE = {"points": [[16384, 2e-4], [1048576, 2e-3], [16777216, 3e-2]], "latency_s": 2e-4, "bandwidth": 5e8}
PROFILE = {
    "cores": 2, "memory_bytes": 24 * 2**30, "memory_bandwidth": 5e9,
    "memory_bandwidth_per_process": {"1": 5e9, "2": 5e9, "4": 2.5e9},
    "step_seconds_per_process": {"1": 0.1, "2": 0.1, "4": 0.2},
    "kernels": {"gemm_fraction": 0.8, "gemm_overhead_s": 2e-5, "attention_fraction": 0.3, "bandwidth_fraction": 0.5,
                "kernel_overhead_s": 1e-5},
    "matmul_flops": {"1": 4e10, "2": 2e10, "4": 1e10},
    "collectives": {op: {f"{size}/{world}": COLLECTIVE for world in (2, 4) for size in (2, 4) if size <= world}
                    for op in ("all_reduce", "all_gather", "reduce_scatter", "send")},
}
# A constant learning rate after warm-up, so a run stopped at step 6 and resumed to 12 follows the
# schedule of one run of 18 steps.
RUN = ("train", "--model", "tiny", "--data", "synthetic", "--seq-len", "32", "--dtype", "fp32", "--lr", "3e-3",
       "--min-lr", "3e-3", "--warmup-steps", "2", "--no-progress")


def _train(tmp_path, name, *flags, env=None):
    result = run_strata(*RUN, "--metrics", tmp_path / f"{name}.jsonl", *flags, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, {r["step"]: r["loss"] for r in map(json.loads, open(tmp_path / f"{name}.jsonl"))
                    if r.get("kind") == "train"}


def test_a_run_that_loses_and_gains_ranks_is_planned_again_and_keeps_its_losses(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "calibration.json").write_text(json.dumps(PROFILE))
    env = {"STRATA_CACHE_DIR": str(cache)}
    ck = tmp_path / "ck"
    _, reference = _train(tmp_path, "one", "--global-batch", "12", "--micro-batch", "4", "--steps", "18")
    assert sorted(reference) == list(range(1, 19))

    losses, chosen = {}, []
    # 4 ranks to step 6; a node lost: 2 ranks to step 12; one back: 3 ranks to step 18. Only the
    # first run names the global batch: the others take the checkpoint's.
    for nproc, until, extra in ((4, 6, ("--global-batch", "12")), (2, 12, ()), (3, 18, ())):
        result, part = _train(tmp_path, f"n{nproc}", "--parallel", "auto", "--nproc", nproc, "--save", ck,
                              "--steps", until, "--resume", "auto", *extra, env=env)
        lines = result.stderr.splitlines()
        chosen.append(next(line for line in lines if line.startswith("--parallel auto chose")))
        assert f"for {nproc} x cpu-local" in chosen[-1], chosen[-1]
        said = [line for line in lines if "the checkpoint was written by" in line]
        if nproc == 4:
            assert not said
        else:
            assert said and "the global batch of 12 sequences kept" in said[0], lines
        losses.update(part)
    assert sorted(losses) == list(range(1, 19))
    for step in range(1, 19):
        assert abs(losses[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, losses[step], reference[step])
