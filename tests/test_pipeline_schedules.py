"""Pipeline schedules, checked as data: every micro-batch through every chunk exactly once, no
deadlock, the bounded in-flight memory of 1F1B, and the bubble of each against the theory
(Narayanan et al. 2021; Qi et al. 2024) from a simulated timeline with uniform stage costs."""

import pytest

from strata.rules.schedules import build, peak_in_flight, simulate


def _check_complete(schedule, p, m, v, kinds):
    for kind in kinds:
        done = sorted((a.microbatch, a.chunk) for actions in schedule for a in actions if a.kind == kind)
        assert done == sorted((i, c) for i in range(m) for c in range(p * v)), kind
    for r, actions in enumerate(schedule):
        assert all(a.chunk % p == r for a in actions)


@pytest.mark.parametrize("name,v,kinds", [("gpipe", 1, "FB"), ("1f1b", 1, "FB"), ("interleaved", 2, "FB"),
                                           ("interleaved", 3, "FB"), ("zb", 1, "FBW")])
@pytest.mark.parametrize("p", [2, 4])
def test_schedules_are_complete_and_deadlock_free(name, v, kinds, p):
    for m in [1, p, 2 * p + 1, 4 * p]:
        schedule = build(name, p, m, v)
        _check_complete(schedule, p, m, v, kinds)
        simulate(schedule, p * v, {"F": 1.0, "B": 1.0, "W": 1.0})  # raises on a deadlock


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_gpipe_keeps_all_micro_batches_in_flight_1f1b_at_most_p(p, m):
    assert peak_in_flight(build("gpipe", p, m)[0]) == m
    assert peak_in_flight(build("1f1b", p, m)[0]) == p
    assert max(peak_in_flight(actions) for actions in build("zb", p, m)) == p  # ZB-H1: 1F1B's peak


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 9), (4, 16)])
def test_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    sim = simulate(build(name, p, m), p, {"F": 1.0, "B": 2.0})
    for r in range(p):
        assert sim.idle_fraction(r) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4)])
def test_interleaving_divides_the_bubble_by_v(p, m, v):
    # each of the v chunks on a rank does 1/v of the stage's work
    sim = simulate(build("interleaved", p, m, v), p * v, {"F": 1.0 / v, "B": 2.0 / v})
    ideal = 3.0 * m  # per rank
    for r in range(p):
        bubble = sim.makespan - ideal
        assert bubble / ideal == pytest.approx((p - 1) / (v * m), abs=0.05)
        assert sim.idle_fraction(r) < (p - 1) / (m + p - 1)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 24)])
def test_zero_bubble_h1_has_a_third_of_the_1f1b_bubble(p, m):
    cost = {"F": 1.0, "B": 1.0, "W": 1.0}
    bubble_1f1b = simulate(build("1f1b", p, m), p, cost).makespan - 3 * m  # (p-1)(F+B+W)
    bubble_zb = simulate(build("zb", p, m), p, cost).makespan - 3 * m  # (p-1)(F+B-W)
    assert bubble_1f1b == pytest.approx(3 * (p - 1))
    assert bubble_zb == pytest.approx(p - 1)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 3)])
def test_the_planners_profile_of_a_long_step_equals_the_full_simulation(name, v):
    """The planner simulates a long step at two shorter sizes and extrapolates (rules/schedules.py):
    exact, because past a few rounds of p micro-batches every schedule repeats itself."""
    from strata.rules.schedules import EXACT_UP_TO_ROUNDS, _simulated_profile, profile
    for p in (2, 3, 5):
        for m in range(EXACT_UP_TO_ROUNDS * p + 1, 7 * p + 1):
            full, fast = _simulated_profile(name, p, m, v), profile(name, p, m, v)
            assert fast.bubble_slots == pytest.approx(full.bubble_slots, abs=1e-9), (p, m)
            assert fast.in_flight == pytest.approx(full.in_flight, abs=1e-9), (p, m)
