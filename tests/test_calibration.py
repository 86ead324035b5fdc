"""`strata calibrate`'s fits and how the planner reads a calibrated profile (`--device cpu-local`).
Nothing here times this machine: the measurements are replaced by known numbers, so each test
checks that the fit or the pricing recovers them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from strata.plan.cost import Cluster, estimate
from strata.plan.hardware import Device, Kernels
from strata.plan.inputs import CPU_LOCAL, cpu_local_cluster, workload
from strata.plan.links import collective_seconds
from strata.rules.layout import Layout
from strata.tools import calibrate, calibrate_kernels


def _profile(**collectives) -> dict:
    return {"cores": 2, "memory_bytes": 24 * 2**30, "memory_bandwidth": 5e9,
            "step_seconds_per_process": {"1": 0.1, "2": 0.1, "4": 0.25},
            "kernels": {"gemm_fraction": 0.8, "gemm_overhead_s": 2e-5, "attention_fraction": 0.3,
                        "bandwidth_fraction": 0.5, "kernel_overhead_s": 1e-5},
            "matmul_flops": {"1": 4e10, "2": 4e10, "4": 1.6e10},
            "collectives": {"all_reduce": {key: {"points": points} for key, points in collectives.items()}}}


RATE, BANDWIDTH = 5e10, 1e13  # the rate and bandwidth the kernels' fits are handed below


def _steps_made_with_known_kernels(monkeypatch):
    """Calibration's kernels timed alone replaced by known numbers (GEMMs at 90% of RATE, attention
    40%, ...); returns the step time of `tiny` the planner predicts with its GEMMs at 75% of RATE
    inside a step and 37 us a kernel, as the timed training steps the fit is handed."""
    monkeypatch.setattr(calibrate_kernels, "gemm_curve", lambda *a: (0.9, 3e-6))
    monkeypatch.setattr(calibrate_kernels, "attention_fraction", lambda *a: 0.4)
    monkeypatch.setattr(calibrate_kernels, "elementwise_fraction", lambda *a: 2.5)
    monkeypatch.setattr(calibrate_kernels, "exponential_seconds", lambda *a: 1.2e-9)
    cfg = calibrate_kernels.get_preset("tiny")
    device = Device(CPU_LOCAL, 2**40, {"fp32": RATE}, BANDWIDTH, None, Kernels(0.75, 3e-6, 0.4, 2.5, 37e-6, 1.2e-9))

    def true_step(b, m, seq_len):
        return estimate(workload(cfg, b * m, seq_len, "fp32"), Cluster(device, 1, 1, overlap=False),
                        Layout(micro_batch=b)).step_time_s

    return true_step


def test_kernel_costs_recover_the_gemm_rate_and_the_cost_per_kernel_the_steps_were_made_with(monkeypatch):
    """Steps that take what the planner predicts with GEMMs at 75% of the rate (timed alone: 90%)
    and 37 us a kernel are fitted back to 75% and 37 us, and every step of the grid is then
    reproduced."""
    true_step = _steps_made_with_known_kernels(monkeypatch)
    monkeypatch.setattr(calibrate_kernels, "step_time", lambda model, b, m, seq_len: true_step(b, m, seq_len))
    fitted = calibrate_kernels.kernel_costs("tiny", RATE, BANDWIDTH)
    assert fitted["kernels"]["gemm_fraction"] == pytest.approx(0.75, rel=1e-4)
    assert fitted["kernels"]["kernel_overhead_s"] == pytest.approx(37e-6, rel=1e-3)
    assert fitted["gemm_fraction_alone"] == 0.9 and fitted["kernels"]["exp_s"] == 1.2e-9
    assert set(fitted["measured_steps"]) == {f"{b}x{m}" for b, m in calibrate_kernels.STEP_GRID}
    for step in fitted["measured_steps"].values():
        assert step["predicted_s"] == pytest.approx(step["measured_s"], rel=1e-4)


def test_the_kernels_are_fitted_at_the_median_level_of_the_calibrations_reference_steps(monkeypatch):
    """The grid is timed once, at the end; the reference step timed in every one-process round
    sets the level: grid steps made 20% slow against rounds that saw the true speed are scaled
    back by the median (the rounds' 1.0, 1.0 and the grid's 1.2) and fitted to the true numbers.
    Without rounds the grid's own level stands."""
    true_step = _steps_made_with_known_kernels(monkeypatch)
    cfg = calibrate_kernels.get_preset("tiny")
    monkeypatch.setattr(calibrate_kernels, "step_time", lambda model, b, m, seq_len: 1.2 * true_step(b, m, seq_len))
    reference = true_step(*calibrate_kernels.REFERENCE_STEP, cfg.max_seq_len)  # the grid caps 128 at it
    fitted = calibrate_kernels.kernel_costs("tiny", RATE, BANDWIDTH, references=(reference, reference))
    assert fitted["kernels"]["gemm_fraction"] == pytest.approx(0.75, rel=1e-4)
    assert fitted["kernels"]["kernel_overhead_s"] == pytest.approx(37e-6, rel=1e-3)
    assert fitted["reference_step"]["level_s"] == pytest.approx(reference)
    for step in fitted["measured_steps"].values():
        assert step["measured_s"] == pytest.approx(step["timed_s"] / 1.2, rel=1e-4)
    alone = calibrate_kernels.kernel_costs("tiny", RATE, BANDWIDTH)
    assert alone["kernels"]["gemm_fraction"] < 0.7 and alone["reference_step"]["level_s"] == pytest.approx(1.2 * reference)


def test_a_grid_step_caught_slow_in_one_sweep_does_not_move_the_fit(monkeypatch):
    """Three sweeps of the grid: the second with one step 30% slow (as 1x2 was in a calibration
    here, which more than doubled the fitted cost per kernel), the third with the whole machine
    30% slow (4x1 at 0.731, 0.720 and 0.621 s in another). Each step's median against its sweep's
    4x1 is fitted, and the true numbers come back; a median of the raw times would take 1x2 from
    the two slow sweeps. The sweeps are kept in the profile. Fitted on the second sweep alone, the
    cost per kernel moves."""
    true_step = _steps_made_with_known_kernels(monkeypatch)
    timed = []

    def step_time(model, b, m, seq_len):
        true = true_step(b, m, seq_len)
        sweep = sum(1 for point in timed if point == (b, m))  # 0, 1, 2
        timed.append((b, m))
        return true * (1.3 if sweep == 1 and (b, m) == (1, 2) else 1.0) * (1.3 if sweep == 2 else 1.0)

    monkeypatch.setattr(calibrate_kernels, "step_time", step_time)
    fitted = calibrate_kernels.kernel_costs("tiny", RATE, BANDWIDTH, sweeps=3)
    assert len(timed) == 3 * len(calibrate_kernels.STEP_GRID)
    assert fitted["kernels"]["gemm_fraction"] == pytest.approx(0.75, rel=1e-4)
    assert fitted["kernels"]["kernel_overhead_s"] == pytest.approx(37e-6, rel=1e-3)
    one_by_two = fitted["measured_steps"]["1x2"]
    first, second, third = one_by_two["sweeps_s"]
    assert second == pytest.approx(1.3 * first, rel=1e-4) and third == pytest.approx(1.3 * first, rel=1e-4)
    assert one_by_two["timed_s"] == pytest.approx(first, rel=1e-4)
    timed[:] = [(b, m) for b, m in calibrate_kernels.STEP_GRID]  # the next sweep is the second
    once = calibrate_kernels.kernel_costs("tiny", RATE, BANDWIDTH)
    assert once["measured_steps"]["1x2"]["sweeps_s"] == [pytest.approx(second, rel=1e-4)]
    assert once["kernels"]["kernel_overhead_s"] > 1.05 * 37e-6  # the tiny model: 8% more


def test_a_cost_per_kernel_is_never_fitted_below_zero(monkeypatch):
    """Steps faster than the GEMMs alone predict leave no time to kernels: 0, not a negative cost."""
    monkeypatch.setattr(calibrate_kernels, "gemm_curve", lambda *a: (0.9, 0.0))
    monkeypatch.setattr(calibrate_kernels, "attention_fraction", lambda *a: 0.4)
    monkeypatch.setattr(calibrate_kernels, "elementwise_fraction", lambda *a: 2.5)
    monkeypatch.setattr(calibrate_kernels, "exponential_seconds", lambda *a: 0.0)
    monkeypatch.setattr(calibrate_kernels, "step_time", lambda model, b, m, seq_len: 1e-6 * b * m)
    assert calibrate_kernels.kernel_costs("tiny", 5e10, 2e10)["kernels"]["kernel_overhead_s"] == 0.0


def test_elementwise_rate_is_the_slope_of_time_against_bytes(monkeypatch):
    """A fixed cost per kernel does not lower the rate: adds timed as 5 us + bytes / 60 GB/s give
    60 GB/s, 3x a 20 GB/s copy bandwidth."""
    cfg, seq_len = replace(calibrate_kernels.get_preset("tiny"), d_model=64, d_ff=128), 16
    sizes = [b * seq_len * width for b in calibrate_kernels.MICRO_BATCHES for width in (cfg.d_model, cfg.d_ff)]
    times = iter(5e-6 + 3 * 4 * n / 60e9 for n in sizes)  # an add reads two and writes one, fp32
    monkeypatch.setattr(calibrate_kernels, "_median_seconds", lambda fn, repeats=7: next(times))
    assert calibrate_kernels.elementwise_fraction(cfg, 20e9, seq_len) == pytest.approx(3.0, rel=1e-6)


def test_an_exponential_costs_the_slope_of_its_time_beyond_its_bytes(monkeypatch):
    """torch.exp timed as 3 us + 8 bytes at 60 GB/s + 1.4 ns an element gives 1.4 ns: neither the
    fixed cost nor the bytes it moves count."""
    cfg, seq_len = replace(calibrate_kernels.get_preset("tiny"), vocab_size=512), 16
    times = iter(3e-6 + b * seq_len * 512 * (8 / 60e9 + 1.4e-9) for b in calibrate_kernels.MICRO_BATCHES)
    monkeypatch.setattr(calibrate_kernels, "_median_seconds", lambda fn, repeats=7: next(times))
    assert calibrate_kernels.exponential_seconds(cfg, 60e9, seq_len) == pytest.approx(1.4e-9, rel=1e-6)


def test_collectives_cost_their_time_with_a_core_each_and_twice_it_with_half_a_core():
    """2 processes on 2 cores: a collective costs its time from call to return. 4 on 2: a pair
    holds two cores for its time with a core each, and the cores come round half as often: twice
    the 2/2 time. A group of 4 is larger than the cores: its own time with everyone running. No
    2/2 measured: the 2/4 time itself."""
    small, large = 16384, 2**20
    profile = _profile(**{"2/2": [[small, 1e-3, 4e-4], [large, 3e-3, 1e-3]],
                          "2/4": [[small, 9e-3, 1e-3], [large, 1.2e-2, 2e-3]],
                          "4/4": [[small, 1.1e-2, 1e-3], [large, 1.5e-2, 2e-3]]})
    two, four = cpu_local_cluster(2, profile), cpu_local_cluster(4, profile)
    assert collective_seconds(two, "all_reduce", small, 2, 1) == pytest.approx(1e-3)
    assert collective_seconds(two, "all_reduce", large, 2, 1) == pytest.approx(3e-3)
    assert collective_seconds(four, "all_reduce", small, 2, 1) == pytest.approx(2e-3)
    assert collective_seconds(four, "all_reduce", large, 2, 1) == pytest.approx(6e-3)
    assert collective_seconds(four, "all_reduce", large, 4, 1) == pytest.approx(1.5e-2)
    old = cpu_local_cluster(4, _profile(**{"2/4": [[small, 9e-3], [large, 1.2e-2]]}))
    assert collective_seconds(old, "all_reduce", small, 2, 1) == pytest.approx(9e-3)


def test_no_message_is_priced_above_a_larger_one():
    """A slow spell in one size's repeats (4.6 ms at 256 KiB, 3.3 ms at 1 MiB) is not a property
    of the size: each point is at most what any larger message measured."""
    from strata.plan.inputs import monotone
    measured = [[2**14, 1.6e-3], [2**16, 0.7e-3], [2**18, 4.6e-3], [2**20, 3.3e-3], [2**22, 4.6e-3]]
    assert monotone(measured) == [(2**14, 0.7e-3), (2**16, 0.7e-3), (2**18, 3.3e-3), (2**20, 3.3e-3),
                                  (2**22, 4.6e-3)]
    two = cpu_local_cluster(2, _profile(**{"2/2": [[n, t, 0.0] for n, t in measured]}))
    assert collective_seconds(two, "all_reduce", 2**18, 2, 1) == pytest.approx(3.3e-3)


def test_a_processs_fixed_costs_grow_with_its_share_of_a_core():
    """With 4 processes on 2 cores each gets 0.4 of one process's speed: its GEMMs, its bandwidth
    and its cost per kernel and per GEMM alike."""
    profile = _profile(**{"2/4": [[16384, 9e-3, 1e-3], [2**20, 1.2e-2, 2e-3]]})
    alone, shared = cpu_local_cluster(1, profile).device, cpu_local_cluster(4, profile).device
    assert shared.peak_flops["fp32"] == pytest.approx(0.4 * alone.peak_flops["fp32"])
    assert shared.memory_bandwidth == pytest.approx(0.4 * alone.memory_bandwidth)
    assert shared.kernels.kernel_overhead_s == pytest.approx(alone.kernels.kernel_overhead_s / 0.4)
    assert shared.kernels.gemm_overhead_s == pytest.approx(alone.kernels.gemm_overhead_s / 0.4)
    assert shared.kernels.gemm_fraction == alone.kernels.gemm_fraction


def test_each_count_keeps_the_median_of_its_runs():
    """Calibration measures each process count in rounds: a slow spell in one run (52 GFLOP/s
    once, against 96) or a fast one does not become the number; every collective's time and CPU
    time are taken point by point, and the summary's fit is redone from them."""
    def run(flops, step, seconds):
        points = [[16384, seconds, seconds / 4], [2**20, 2 * seconds, seconds / 2]]
        return {"matmul_flops": flops, "memory_bandwidth": flops / 4, "step_seconds": step,
                "collectives": {"all_reduce": {"2": {"points": points}}}}
    slow, quick, usual = run(52e9, 0.77, 9e-3), run(99e9, 0.53, 2e-3), run(90e9, 0.60, 3e-3)
    for runs in ((slow, quick, usual), (usual, slow, quick)):
        kept = calibrate.combined(list(runs))
        assert (kept["matmul_flops"], kept["memory_bandwidth"], kept["step_seconds"]) == (90e9, 22.5e9, 0.60)
        assert kept["collectives"]["all_reduce"]["2"]["points"] == [[16384, 3e-3, 3e-3 / 4], [2**20, 6e-3, 1.5e-3]]
        assert kept["collectives"]["all_reduce"]["2"]["latency_s"] == pytest.approx(3e-3 - 3e-3 * 16384 / (2**20 - 16384))
    two = calibrate.combined([slow, quick])  # two rounds: their mean
    assert two["step_seconds"] == pytest.approx(0.65)


def test_a_process_count_not_calibrated_gets_the_even_split_at_the_nearest_counts_efficiency():
    """Calibrated at 1, 2 and 4 processes on 2 cores: 2 kept all of one process's speed, 4 kept
    0.4 (80% of an even split, 0.5). Three processes get 2/3 of a core at 2's 100%, not 2's
    whole share; eight get 1/4 at 4's 80%."""
    profile = _profile()
    alone = cpu_local_cluster(1, profile).device.peak_flops["fp32"]
    for processes, share in ((1, 1.0), (2, 1.0), (3, 2 / 3), (4, 0.4), (8, 0.2)):
        assert cpu_local_cluster(processes, profile).device.peak_flops["fp32"] == pytest.approx(share * alone)


def test_data_parallel_sums_cost_their_time_with_everyone_running():
    """4 processes on 2 cores. Every rank reaches the step's gradient sums at the same point, so
    they cost their time measured with all processes in one at once (2/4 for dp2 x tp2's pairs,
    not twice 2/2 as a tensor-parallel pair's collectives while the other pair computes)."""
    profile = _profile(**{"2/2": [[16384, 1e-3, 0.0], [2**26, 0.05, 0.0]],
                          "2/4": [[16384, 9e-3, 0.0], [2**26, 0.3, 0.0]],
                          "4/4": [[16384, 1.1e-2, 0.0], [2**26, 0.4, 0.0]]})
    four = cpu_local_cluster(4, profile)
    assert collective_seconds(four, "all_reduce", 2**26, 2, 1, together=True) == pytest.approx(0.3)
    assert collective_seconds(four, "all_reduce", 2**26, 2, 1) == pytest.approx(0.1)
    work = workload(calibrate.get_preset("tiny"), 8, 64, "fp32")
    wall_priced = replace(four, collectives=four.collectives_together)
    for layout in (Layout(dp=4, micro_batch=2), Layout(dp=2, tp=2, micro_batch=2)):
        dp = estimate(work, four, layout).comm_seconds["dp"]
        assert dp == pytest.approx(estimate(work, wall_priced, layout).comm_seconds["dp"])
    # a group of 4 is larger than the cores: its time with everyone running either way; dp2's
    # pairs are not priced as a tensor-parallel pair's (twice 2/2: 3-4.5x cheaper here)
    layout = Layout(dp=2, tp=2, micro_batch=2)
    as_tp_pairs = estimate(work, replace(four, collectives_together=four.collectives), layout).comm_seconds["dp"]
    assert estimate(work, four, layout).comm_seconds["dp"] > 1.4 * as_tp_pairs


def test_on_shared_cores_a_pipeline_stage_with_less_work_leaves_its_core_to_the_others():
    """pp=4 of `small`: the last stage holds only the head. The processes busy at once follow the
    stages' mean compute, not the slowest's, so the step is shorter than if every stage did the
    slowest's work."""
    from strata.plan.cost import _rank_time, _terms, stage_loads
    work = workload(calibrate.get_preset("small"), 4, 128, "fp32")  # one micro-batch: no gradient passes
    four, layout = cpu_local_cluster(4, _profile()), Layout(pp=4, micro_batch=4)
    e = estimate(work, four, layout)
    terms = _terms(work, four, layout, 1.0)
    computes = [_rank_time(four, layout, terms, load).compute for load in stage_loads(work.model, 4, 1, 128)]
    mean_over_slowest = sum(computes) / len(computes) / max(computes)
    assert mean_over_slowest < 0.95
    stage_compute = e.busy_s - e.optimizer_s - sum(e.comm_seconds.values())
    assert stage_compute == pytest.approx(e.compute_s * mean_over_slowest)


def test_the_worker_keeps_the_median_window_of_steps_after_the_first(tmp_path, monkeypatch):
    """The first window warms up and is left out; a slow spell (or a fast one) in one of the
    others does not become the share: their median does, as the bench takes the median step."""
    windows = iter([0.9, 0.31, 0.22, 0.27, 0.25, 0.24])
    monkeypatch.setattr(calibrate, "matmul_rate", lambda seconds: 5e10)
    monkeypatch.setattr(calibrate, "memory_bandwidth", lambda seconds: 2e10)
    monkeypatch.setattr(calibrate, "model_step_seconds", lambda model, seconds: next(windows))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "one.json"
    calibrate.worker(str(out), "tiny")
    assert calibrate.STEP_WINDOWS == 6
    assert json.loads(out.read_text())["step_seconds"] == 0.25


def test_tensor_parallel_and_pipeline_messages_wait_on_the_share_the_fixed_point_finds():
    """With more processes than cores, a pair's collectives wait for the cores as its compute
    does: at twice the share (half the processes busy), half the seconds."""
    from strata.plan.cost import _terms
    points = [[16384, 1e-3, 0.0], [2**26, 0.05, 0.0]]
    four = cpu_local_cluster(4, _profile(**{"2/2": points, "2/4": points, "4/4": points}))
    work, layout = workload(calibrate.get_preset("tiny"), 8, 64, "fp32"), Layout(tp=2, pp=2, micro_batch=2)
    alone, shared = _terms(work, four, layout, 1.0), _terms(work, four, layout, 2.0)
    assert alone.tp_collective_s > 0 and alone.pp_send_s > 0
    assert shared.tp_collective_s == pytest.approx(alone.tp_collective_s / 2)
    assert shared.pp_send_s == pytest.approx(alone.pp_send_s / 2)


def test_a_collectives_cost_inside_a_step_is_added_to_the_tensor_parallel_points_only():
    """calibrate's in-step cost is time with a core each: +0.7 ms a collective on 2 processes,
    twice that for a pair among 4 on 2 cores (as the rest of its time); a pipeline's sends and the
    data-parallel sums (everyone running) are priced as the loop measured them."""
    points = [[16384, 1e-3, 0.0], [2**20, 3e-3, 0.0]]
    profile = {**_profile(**{"2/2": points, "2/4": points, "4/4": points}), "collective_in_step_points": [[1, 7e-4]]}
    profile["collectives"]["send"] = {"2/2": {"points": points}, "2/4": {"points": points}}
    before = {n: cpu_local_cluster(n, {**profile, "collective_in_step_points": [[1, 0.0]]}) for n in (2, 4)}
    after = {n: cpu_local_cluster(n, profile) for n in (2, 4)}
    for n, added in ((2, 7e-4), (4, 1.4e-3)):
        for nbytes in (16384, 2**19, 2**20):
            assert collective_seconds(after[n], "all_reduce", nbytes, 2, 1) == \
                pytest.approx(collective_seconds(before[n], "all_reduce", nbytes, 2, 1) + added)
            assert collective_seconds(after[n], "send", nbytes, 2, 1) == collective_seconds(before[n], "send", nbytes, 2, 1)
            assert collective_seconds(after[n], "all_reduce", nbytes, 2, 1, together=True) == \
                collective_seconds(before[n], "all_reduce", nbytes, 2, 1, together=True)
    old = {key: value for key, value in profile.items() if key != "collective_in_step_points"}  # profiles before it
    assert collective_seconds(cpu_local_cluster(2, old), "all_reduce", 2**19, 2, 1) == \
        collective_seconds(before[2], "all_reduce", 2**19, 2, 1)
    scalar = cpu_local_cluster(2, {**old, "collective_in_step_s": 7e-4})  # profiles of one number for every size
    assert collective_seconds(scalar, "all_reduce", 2**19, 2, 1) == collective_seconds(after[2], "all_reduce", 2**19, 2, 1)


def test_the_in_step_cost_follows_the_message_size_with_either_sign_down_to_the_cpu_time():
    """Measured at two sizes, the in-step cost is interpolated between them and held beyond; a
    negative one lowers a point, though never below the CPU time the loop saw the call take."""
    loop = [[2**14, 4e-3, 5e-4], [2**16, 4e-3, 5e-4], [2**18, 4e-3, 5e-4], [2**20, 5e-3, 5e-4], [2**22, 8e-3, 6e-3]]
    profile = {**_profile(**{"2/2": loop}), "collective_in_step_points": [[2**18, -2e-3], [2**20, 1e-3]]}
    cluster = cpu_local_cluster(2, profile)
    for nbytes, expected in ((2**14, 2e-3), (2**16, 2e-3), (2**18, 2e-3), (2**20, 6e-3), (2**22, 9e-3)):
        assert collective_seconds(cluster, "all_reduce", nbytes, 2, 1) == pytest.approx(expected)
    deep = cpu_local_cluster(2, {**profile, "collective_in_step_points": [[2**18, -1.0], [2**20, -1.0]]})
    assert collective_seconds(deep, "all_reduce", 2**18, 2, 1) == pytest.approx(5e-4)  # the CPU time


def test_the_in_step_cost_is_fitted_from_tensor_parallel_steps_the_planner_prices(tmp_path, monkeypatch):
    """tp=2 steps whose collectives took what the planner prices with -0.5 ms added to each at
    micro-batches of one sequence and +0.6 ms at four are fitted back to those, at each step's
    message bytes: every op on the tp group counted, other groups' not, the first step (warm-up)
    and evaluation records left out. Each size is launched in 3 rounds, the sizes taking turns, and
    the median round kept: one slow round (a spell of the machine busy elsewhere) moves nothing."""
    profile = _profile(**{"2/2": [[16384, 4e-3, 0.0], [2**22, 9e-3, 0.0]]})
    cfg, seq = calibrate.get_preset("tiny"), 64
    true = {1: -5e-4, 4: 6e-4}
    in_step = {}
    for mb in calibrate.TP_STEP_MICRO_BATCH_SIZES:
        work = workload(cfg, mb * calibrate.TP_STEP_MICRO_BATCHES, seq, "fp32")
        cluster = cpu_local_cluster(2, {**profile, "collective_in_step_points": [[1, true[mb]]]})
        in_step[mb] = estimate(work, cluster, Layout(tp=2, micro_batch=mb)).comm_seconds["tp"]
    launched = []
    # what each round adds to the step's tp seconds: the first round is slow, the third a little fast
    by_round = [0.5, 0.0, -1e-3]

    def launch_local(nproc, argv):
        mb = int(argv[argv.index("--micro-batch") + 1])
        tp = in_step[mb] + by_round[sum(a[a.index("--micro-batch") + 1] == str(mb) for _, a in launched)]
        launched.append((nproc, argv))
        records = [{"kind": "train", "comm_seconds_by_op": {"all_reduce/tp": 9.0}}] + \
            [{"kind": "train", "comm_seconds_by_op": {"all_reduce/tp": tp - 0.01, "all_gather/tp": 0.01,
                                                      "all_reduce/dp": 5.0}}] * 3 + [{"kind": "eval", "val_loss": 1.0}]
        with open(argv[argv.index("--metrics") + 1], "w") as f:
            f.write("\n".join(json.dumps(r) for r in records))
        return 0

    monkeypatch.setattr(calibrate, "launch_local", launch_local)
    fitted = calibrate.collective_in_step("tiny", profile, rounds=3)
    # the mean message of the step: the activations' all-reduces (one sequence's: seq x d_model in
    # fp32) with the loss's smaller ones among them
    activation = seq * cfg.d_model * 4
    (one, _), (four, _) = fitted["collective_in_step_points"]
    assert 0.8 * activation < one < activation and four == pytest.approx(4 * one, rel=1e-3)
    assert [s for _, s in fitted["collective_in_step_points"]] == pytest.approx([true[1], true[4]], rel=1e-6)
    assert [nproc for nproc, _ in launched] == [2] * 6
    assert [argv[argv.index("--tp") + 1] for _, argv in launched] == ["2"] * 6
    assert [argv[argv.index("--micro-batch") + 1] for _, argv in launched] == ["1", "4"] * 3
    assert [d["measured_s"] for d in fitted["collective_in_step"]] == pytest.approx([in_step[1], in_step[4]])
    assert fitted["collective_in_step"][1]["measured_rounds_s"] == pytest.approx([in_step[4] + t for t in by_round])



def test_calibrate_hands_its_timings_to_every_process_it_launches(tmp_path, monkeypatch):
    """The workers torchrun starts time as long as the parent was asked to, whatever the Effort
    (not only --quick's): the parent passes its fields, the worker's command line reads them back."""
    from dataclasses import asdict

    from strata.cli.parser import build_parser
    from strata.cli.tools import calibrate_command
    custom = calibrate.Effort(rate_s=0.1, step_window_s=0.2, collective_repeats=3, disk_bytes=1 << 20, grid_sweeps=2)
    timed_with = []

    def worker(out, model, effort=calibrate.FULL):
        timed_with.append(effort)
        with open(out, "w") as f:
            json.dump({"matmul_flops": 1e10, "memory_bandwidth": 1e10, "step_seconds": 0.1,
                       "collectives": {op: {} for op in calibrate.OPS}}, f)

    def launch_local(nproc, argv):  # the worker's command line, parsed and run as the CLI would
        calibrate_command(build_parser().parse_args(argv), argv)
        return 0

    monkeypatch.setattr(calibrate, "worker", worker)
    monkeypatch.setattr(calibrate, "launch_local", launch_local)
    monkeypatch.setattr(calibrate, "reference_step_seconds", lambda model: 0.5)
    monkeypatch.setattr(calibrate, "kernel_costs", lambda *a, references, sweeps: timed_with.append(sweeps) or {
        "kernels": asdict(Kernels(0.8, 0.0, 0.5, 2.0, 1e-5)), "gemm_fraction_alone": 0.9,
        "reference_step": {"steps": "4x1", "level_s": 0.5, "rounds_s": list(references), "grid_s": 0.5},
        "measured_steps": {"4x1": {"timed_s": 0.5, "sweeps_s": [0.5] * sweeps}}})
    monkeypatch.setattr(calibrate, "collective_in_step", lambda *a, rounds: {
        "collective_in_step_points": [[1.0, 0.0]], "collective_in_step": []})
    monkeypatch.setattr(calibrate, "disk_rates", lambda directory, nbytes: {
        "directory": directory, "free_bytes": 1 << 30, "write_bytes_per_s": 1e8, "read_bytes_per_s": 1e9,
        "cached_read_bytes_per_s": 1e10})
    profile = calibrate.calibrate(2, "tiny", str(tmp_path / "profile.json"), rounds=1, effort=custom)
    assert timed_with == [custom] * 3 + [custom.grid_sweeps]  # one process, two, one; then the grid
    assert profile["reference_step"]["rounds_s"] == [0.5, 0.5]  # the reference step, in each one-process round


def test_the_loss_prices_an_exponential_per_logit_forward_and_backward():
    """On a CPU an exponential costs about ten times an add's pass (1.4 ns an element here against
    0.12 for a multiply; F.cross_entropy's forward and backward at small's logits took 3.4 ms a
    micro-batch of one sequence where bytes alone priced 0.9): the head's forward and backward each
    add exp_s per logit, and nothing else moves."""
    from strata.model.presets import get_preset
    from strata.plan.compute import StepWork, unit_seconds
    cfg = get_preset("small")
    work = StepWork(cfg, 2 * 128, 2, 128, 2, False, True, 4)
    plain = Kernels(0.8, 2e-6, 0.5, 2.5, 7e-5)
    embedding, block, head = unit_seconds(work, plain, 1e11, 2e10)
    embedding2, block2, head2 = unit_seconds(work, replace(plain, exp_s=1.5e-9), 1e11, 2e10)
    logits = 2 * 128 * cfg.vocab_size / 2  # split over the tensor-parallel pair
    assert (embedding2, block2) == (embedding, block)
    assert head2.forward - head.forward == pytest.approx(logits * 1.5e-9, rel=1e-9)
    assert head2.backward - head.backward == pytest.approx(logits * 1.5e-9, rel=1e-9)
