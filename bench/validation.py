"""The planner against published training runs (strata/plan/published.py): the validation table of
docs/cost-model.md, and the fit of the defaults set from published runs, on the first half only.

    python bench/validation.py            # the table, with each half's worst error
    python bench/validation.py --fit      # the first half's best defaults, searched on a grid
    python bench/validation.py --unseen   # the runs the defaults were never fitted to, with their errors
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

from strata.plan import hardware
from strata.plan.published import RUNS, halves
from strata.plan.published_unseen import UNSEEN_RUNS


def table(runs=RUNS) -> str:
    first, _ = halves()
    lines = ["| run | source | layout | published | tokens/s per GPU: published | predicted | error | half |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        e = run.predict()
        half = 1 if run in first else 2 if run in RUNS else "unseen"
        lines.append(f"| {run.name} | {run.source} ({run.framework}) | {run.layout.describe()} | {run.published} | "
                     f"{run.tokens_per_s:,.1f} | {e.tokens_per_s / run.gpus:,.1f} | {run.error():+.0%} | {half} |")
    return "\n".join(lines)


def unseen_summary() -> str:
    errors = sorted(abs(r.error()) for r in UNSEEN_RUNS)
    middle = len(errors) // 2
    median = errors[middle] if len(errors) % 2 else (errors[middle - 1] + errors[middle]) / 2
    return f"unseen runs: {len(errors)}, median error {median:.1%}, worst {errors[-1]:.1%}"


def worst(runs) -> float:
    return max(abs(r.error()) for r in runs)


def with_defaults(share: float, bandwidth: float, overhead: float) -> None:
    """Every device's kernels with these defaults (the measured fractions kept)."""
    for name, device in hardware.DEVICES.items():
        k = device.kernels
        mamf = k.gemm_fraction / hardware.TRAINING_GEMM_SHARE
        hardware.DEVICES[name] = dataclasses.replace(device, kernels=dataclasses.replace(
            k, gemm_fraction=mamf * share, bandwidth_fraction=bandwidth, gemm_overhead_s=overhead))
    hardware.TRAINING_GEMM_SHARE = share


def fit() -> tuple[float, float, float]:
    """The defaults with the smallest worst error on the first half."""
    first, _ = halves()
    grid = itertools.product([0.75 + 0.025 * i for i in range(9)], [0.5, 0.6, 0.7, 0.8, 0.9, 1.0], [4e-6, 8e-6, 16e-6])
    best = None
    for share, bandwidth, overhead in grid:
        with_defaults(share, bandwidth, overhead)
        score = worst(first)
        if best is None or score < best[0]:
            best = (score, share, bandwidth, overhead)
    return best[1:]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--unseen", action="store_true")
    args = parser.parse_args()
    if args.unseen:
        print(table(UNSEEN_RUNS))
        print(f"\n{unseen_summary()}")
        raise SystemExit(0)
    if args.fit:
        share, bandwidth, overhead = fit()
        print(f"first half's best: TRAINING_GEMM_SHARE = {share:.3f}, BANDWIDTH_FRACTION = {bandwidth}, "
              f"GEMM_OVERHEAD_S = {overhead:g}")
        with_defaults(share, bandwidth, overhead)
    print(table())
    first, second = halves()
    print(f"\nworst error: first half {worst(first):.1%}, second half {worst(second):.1%} "
          f"({len(first)} + {len(second)} runs)")
