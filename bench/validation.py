"""The planner against published training runs: the one validation table of docs/cost-model.md
(strata/plan/validation_table.py), split into a fit half and a held-out half by a hash of each
row's name, and the fit of the planner's defaults on the fit half only.

    python bench/validation.py            # the table, with each half's median and worst error
    python bench/validation.py --fit      # the fit half's best defaults, searched on a grid, then the table
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics

from strata.plan import hardware
from strata.plan.validation_table import TABLE, halves, in_fit_half


def _network(run) -> str:
    priced = f"{run.nics_per_node} x {run.network}" if run.gpus > 8 else "NVLink"
    return f"{run.fabric} (priced {priced})" if run.fabric else priced


def _figures(run) -> tuple[str, str]:
    """(published, predicted) as the row compares them: tokens/s per device, or device-hours."""
    if run.device_hours is None:
        return f"{run.tokens_per_s:,.1f}", f"{run.predicted_tokens_per_s():,.1f}"
    return f"{run.device_hours:,.0f} h", f"{run.predicted_hours():,.0f} h"


def table(runs=TABLE) -> str:
    lines = ["| run | source (framework) | network | layout | published | figure: published | predicted | error | half |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        published, predicted = _figures(run)
        lines.append(f"| {run.name} | {run.source} ({run.framework}) | {_network(run)} | {run.layout.describe()} | "
                     f"{run.published} | {published} | {predicted} | {run.error():+.1%} | "
                     f"{'fit' if in_fit_half(run.name) else 'held out'} |")
    return "\n".join(lines)


def summary(name: str, runs) -> str:
    errors = [abs(r.error()) for r in runs]
    return f"{name}: {len(errors)} runs, median error {statistics.median(errors):.1%}, worst {max(errors):.1%}"


def objective(runs) -> tuple[float, float]:
    """The fit's objective: the half's median plus its worst absolute error, the two figures the
    table is judged by (issue 54: at most 10% and 20%), ties broken by the sum of the squared
    errors. Least squares alone trades the worst row for many small gains: at its best the
    Megatron-DeepSpeed MT-NLG rows, which no profile switch explains (docs/cost-model.md,
    "Remaining misses"), reach 22-25%."""
    errors = sorted(abs(r.error()) for r in runs)
    return statistics.median(errors) + errors[-1], sum(e * e for e in errors)


def with_defaults(share: float, bandwidth: float, overhead: float) -> None:
    """Every device's kernels with these defaults (the measured fractions kept)."""
    for name, device in hardware.DEVICES.items():
        k = device.kernels
        mamf = k.gemm_fraction / hardware.TRAINING_GEMM_SHARE
        hardware.DEVICES[name] = dataclasses.replace(device, kernels=dataclasses.replace(
            k, gemm_fraction=mamf * share, bandwidth_fraction=bandwidth, gemm_overhead_s=overhead))
    hardware.TRAINING_GEMM_SHARE = share


GRID = (tuple(0.75 + 0.025 * i for i in range(9)), (0.5, 0.6, 0.7, 0.8, 0.9, 1.0), (4e-6, 8e-6, 16e-6))


def fit() -> tuple[float, float, float]:
    """The defaults with the least `objective` on the fit half (ties: the first on the grid)."""
    fit_half, _ = halves()
    best = None
    for share, bandwidth, overhead in itertools.product(*GRID):
        with_defaults(share, bandwidth, overhead)
        score = objective(fit_half)
        if best is None or score < best[0]:
            best = (score, share, bandwidth, overhead)
    return best[1:]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    if args.fit:
        share, bandwidth, overhead = fit()
        print(f"fit half's best: TRAINING_GEMM_SHARE = {share:.3f}, BANDWIDTH_FRACTION = {bandwidth}, "
              f"GEMM_OVERHEAD_S = {overhead:g}")
        with_defaults(share, bandwidth, overhead)
    print(table())
    fit_half, held_out = halves()
    print()
    print(summary("fit half", fit_half))
    print(summary("held-out half", held_out))
