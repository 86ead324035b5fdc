"""The planner's one validation table (strata/plan/validation_table.py, docs/cost-model.md; issue 54,
item 7): what it must hold, the fixed rule that splits it, the defaults fitted on the fit half
alone, and both halves' errors, with the rows still beyond 20% named (the doc explains each)."""

from __future__ import annotations

import hashlib
import os
import statistics
import sys

import pytest

from strata.plan import hardware
from strata.plan.goodput import GoodputSettings
from strata.plan.run_cost import expected_cost
from strata.plan.validation_table import TABLE, TOTALS, halves, in_fit_half

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))



def _slow_network(run) -> bool:
    """Not InfiniBand: Ethernet, RoCE or Omni-Path, as the source names the fabric (one that may
    have been either does not count)."""
    named = any(word in run.fabric for word in ("RoCE", "Omni-Path", "GbE")) and "InfiniBand" not in run.fabric
    return not run.network.startswith("ib-") or named


def test_the_table_holds_what_issue_54_asks_for():
    assert len(TABLE) >= 40 and len({r.name for r in TABLE}) == len(TABLE)
    assert len({r.source.split(",")[0].split(" (")[0] for r in TABLE}) >= 6
    assert len({r.profile.name for r in TABLE}) >= 3
    assert sum(r.device.startswith(("H100", "H200", "B200")) for r in TABLE) >= 8
    assert sum(r.layout.replicas >= 128 for r in TABLE) >= 5
    assert len(TOTALS) >= 5 and all(r.device_hours and r.run_tokens for r in TOTALS)
    assert sum(_slow_network(r) for r in TABLE) >= 3


def test_the_halves_follow_the_hash_of_each_name_and_split_the_table():
    fit_half, held_out = halves()
    assert len(fit_half) + len(held_out) == len(TABLE) and not set(fit_half) & set(held_out)
    for run in TABLE:
        assert in_fit_half(run.name) == (hashlib.sha256(run.name.encode()).digest()[0] % 2 == 0)
        assert (run in fit_half) == in_fit_half(run.name)
    assert min(len(fit_half), len(held_out)) >= len(TABLE) // 3  # the rule does not leave one half empty


def test_both_halves_within_10_percent_median_and_20_percent_worst():
    errors = {r.name: r.error() for r in TABLE}
    for half in halves():
        assert statistics.median(abs(errors[r.name]) for r in half) <= 0.10
        beyond = {r.name: f"{errors[r.name]:+.1%}" for r in half if abs(errors[r.name]) > 0.20}
        assert not beyond, beyond


def test_the_fit_objective_is_the_median_plus_the_worst_error():
    import validation
    fit_half, _ = halves()
    errors = sorted(abs(r.error()) for r in fit_half)
    assert validation.objective(fit_half) == pytest.approx((statistics.median(errors) + errors[-1],
                                                            sum(e * e for e in errors)))


def test_the_fitted_defaults_are_the_fit_halfs_best(monkeypatch):
    import validation
    table = dict(hardware.DEVICES)  # the fit rewrites the device table in place: put it back after
    defaults = (hardware.TRAINING_GEMM_SHARE, hardware.BANDWIDTH_FRACTION, hardware.GEMM_OVERHEAD_S)
    monkeypatch.setattr(hardware, "TRAINING_GEMM_SHARE", hardware.TRAINING_GEMM_SHARE)
    try:
        assert validation.fit() == pytest.approx(defaults)
    finally:
        hardware.DEVICES.update(table)


def test_a_production_total_compares_the_expected_device_hours():
    """A total's prediction is the expected run's device-hours (steady state plus the named
    overheads), and its error reads as a throughput's: published over predicted hours, minus one."""
    bloom = next(r for r in TOTALS if r.name.startswith("BLOOM"))
    costs = expected_cost(bloom.work(), bloom.predict(), 366e9, 8, GoodputSettings())
    assert bloom.predicted_hours() == pytest.approx(costs.expected.device_hours)
    assert costs.expected.device_hours > costs.ideal.device_hours
    assert bloom.tokens_per_s == pytest.approx(366e9 / (1_082_990 * 3600))
    assert bloom.error() == pytest.approx(1_082_990 / costs.expected.device_hours - 1)


def test_the_published_figures_are_converted_with_each_sources_formula():
    by_name = {r.name: r for r in TABLE}
    # Narayanan et al., eq. (3): 1T at 163 TFLOP/s per GPU; 3072 GPUs x tokens/s x FLOPs per token
    one_t = by_name["GPT 1008B, 3072 A100"]
    L, h, V, s = 128, 25600, 51200, 2048
    assert one_t.tokens_per_s * 96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)) == pytest.approx(163e12)
    # Korthikanti et al.: 175B, 64 sequences of 2048 tokens in 13.75 s on 64 GPUs
    assert by_name["GPT 175B, 64 A100"].tokens_per_s == pytest.approx(64 * 2048 / 13.75 / 64)
