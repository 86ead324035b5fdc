"""The planner's predictions for this machine against measured runs: after `strata calibrate`, every
layout below trains the `small` preset for a few steps on 2 and 4 local ranks; the table puts the
predicted step time and memory per rank next to the measured ones, and checks the planner's top
choice against the fastest measured layout.

Memory is compared as tensors: predicted weights + gradients + optimizer states + activations +
buffers against the bytes strata counts on rank 0 (model states from its tensors, activations
from the saved-tensor hooks, ZeRO-3's gathered units and staged gradients at their peak), which is
what max_memory_allocated measures on a GPU; the process's
resident set adds the interpreter and the allocator's caches, shown for reference.

The measured step time is the median of every step after the first, pooled over --passes sweeps
of all the layouts, every other sweep in reverse order: the same layout measured in two sweeps ten
minutes apart differed by up to 70% on this shared machine (the "sweeps apart" column: slowest
sweep's median over the fastest's), and with three sweeps one slow spell in one of them does not
make a layout's number.

The machine's own speed moves too: calibration's reference step (one process, one micro-batch of 4
sequences, `strata calibrate`'s "4x1") measured 0.343 s at calibration and 0.393 s forty minutes
later, on an otherwise idle machine. So the script times that same step before each block of
layouts and after the last, prints how far it moved from the profile's, and adds a second error
column with the prediction scaled by that drift (the mean of the two references around the
layout's block): the model's own error, apart from the machine's. The first error column is the
plain prediction against the measurement.

  python bench/planner.py [--steps 6] [--passes 3] [--rounds 3] [--profile FILE] [--save FILE]
  python bench/planner.py --replay FILE [FILE ...]   # a changed cost model on saved measurements

Where the planner's choice is not the fastest layout of the sweeps, the two are then trained by
turns (--rounds runs each, interleaved) and compared on their pooled steps: layouts a few per
cent apart swap places between sweeps here.

--save writes the measurements (with the profile they were predicted from) as JSON, and --replay
prints the table again from such files without training anything: a change to the cost model is
judged on every saved run at once, not on the one run it was made after.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from strata.model.presets import get_preset
from strata.plan.cost import estimate
from strata.plan.inputs import cpu_local_cluster, load_profile, workload
from strata.rules.layout import Layout
from strata.tools.calibrate_kernels import REFERENCE_KEY, reference_step_seconds

SEQ, GLOBAL = 128, 16
FULL = "full"  # activation checkpointing on
# nproc: layouts, with micro-batches of 1, 2 and 4 and checkpointing off and on (zero-bubble and
# interleaved are left to the pipeline benchmark)
LAYOUTS = {
    2: [Layout(dp=2), Layout(dp=2, micro_batch=2), Layout(dp=2, micro_batch=4), Layout(dp=2, micro_batch=4,
                                                                                    checkpointing=FULL),
        Layout(dp=2, zero=1), Layout(dp=2, zero=3, micro_batch=2), Layout(dp=2, zero=3, micro_batch=2,
                                                                          checkpointing=FULL),
        Layout(tp=2), Layout(tp=2, micro_batch=4), Layout(tp=2, micro_batch=4, checkpointing=FULL),
        Layout(pp=2), Layout(pp=2, micro_batch=2), Layout(pp=2, micro_batch=2, checkpointing=FULL)],
    4: [Layout(dp=4), Layout(dp=4, micro_batch=2), Layout(dp=4, micro_batch=4), Layout(dp=4, micro_batch=4,
                                                                                    checkpointing=FULL),
        Layout(dp=4, zero=2, micro_batch=2), Layout(dp=2, tp=2), Layout(dp=2, tp=2, micro_batch=4),
        Layout(dp=2, tp=2, micro_batch=4, checkpointing=FULL), Layout(dp=2, pp=2), Layout(tp=2, pp=2),
        Layout(pp=4), Layout(pp=4, micro_batch=2), Layout(pp=4, micro_batch=2, checkpointing=FULL)],
}


def flags(layout: Layout) -> list[str]:
    return ["--dp", layout.dp, "--tp", layout.tp, "--pp", layout.pp, "--zero", layout.zero,
            "--micro-batch", layout.micro_batch, "--schedule", layout.schedule, "--checkpointing", layout.checkpointing]


def measure(layout: Layout, nproc: int, steps: int, out_dir: str) -> dict:
    metrics = os.path.join(out_dir, f"{layout.describe()}.jsonl")
    cmd = [sys.executable, "-m", "strata", "train", "--model", "small", "--seq-len", SEQ, "--global-batch", GLOBAL,
           "--steps", steps, "--nproc", nproc, "--no-progress", "--eval-batches", 1, "--peak-flops", "1e11",
           "--metrics", metrics, *flags(layout)]
    subprocess.run(list(map(str, cmd)), check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    records = [json.loads(line) for line in open(metrics) if '"train"' in line]
    last = records[-1]
    comm = {}  # seconds a step in each operation and group, as strata's counter timed them on rank 0
    for record in records[1:]:
        for key, seconds in record.get("comm_seconds_by_op", {}).items():
            comm.setdefault(key, []).append(seconds)
    return {"step_times": [r["step_time_s"] for r in records[1:]],
            "comm_seconds": {key: statistics.median(values) for key, values in comm.items()},
            "memory": last["model_state_bytes"] + last["peak_activation_bytes"] + last.get("buffer_bytes", 0),
            "rss": last["peak_mem_bytes"]}


def reference_seconds() -> float:
    """Calibration's reference step timed now, as calibration times it (its log lines swallowed)."""
    torch.set_num_threads(1)
    with contextlib.redirect_stdout(io.StringIO()):
        return reference_step_seconds("small", SEQ)


def measure_all(steps: int, passes: int, calibrated: float) -> tuple[dict, list[float]]:
    """Every layout trained `passes` times, their steps pooled, with the reference step timed
    before the first block and after each."""
    measured: dict[tuple[int, Layout], dict] = {}
    references = [reference_seconds()]
    print(f"reference step {references[0]:.3f} s, {references[0] / calibrated - 1:+.0%} from calibration's "
          f"{calibrated:.3f} s", flush=True)
    with tempfile.TemporaryDirectory() as out_dir:
        for sweep in range(passes):
            for nproc, layouts in LAYOUTS.items():
                # every other sweep runs the block backwards: a layout measured late in one sweep is
                # measured early in the next, so a slow spell does not fall on the same neighbours
                for layout in (layouts if sweep % 2 == 0 else layouts[::-1]):
                    run = measure(layout, nproc, steps, out_dir)
                    kept = measured.setdefault((nproc, layout), {**run, "step_times": [], "drifts": [], "comm": []})
                    kept["step_times"] += run["step_times"]
                    kept["comm"].append(run["comm_seconds"])
                    print(f"pass {sweep + 1}: {nproc} ranks {layout.describe()}: "
                          f"{statistics.median(run['step_times']):.3f} s", flush=True)
                references.append(reference_seconds())
                print(f"reference step {references[-1]:.3f} s, {references[-1] / calibrated - 1:+.0%} from "
                      f"calibration's", flush=True)
                for layout in layouts:  # the machine's speed around this block, against calibration's
                    measured[(nproc, layout)]["drifts"].append((references[-2] + references[-1]) / 2 / calibrated)
    return measured, references


def picks(profile: dict, measured: dict) -> dict[int, tuple[Layout, Layout]]:
    """Per process count, (the planner's choice among the measured layouts, the fastest measured)."""
    work, chosen = workload(get_preset("small"), GLOBAL, SEQ, "fp32"), {}
    for nproc in sorted({n for n, _ in measured}):
        layouts = [lay for n, lay in measured if n == nproc]
        cluster = cpu_local_cluster(nproc, profile)
        top = min(layouts, key=lambda lay: estimate(work, cluster, lay).step_time_s)
        fastest = min(layouts, key=lambda lay: statistics.median(measured[(nproc, lay)]["step_times"]))
        chosen[nproc] = (top, fastest)
    return chosen


def head_to_head(profile: dict, measured: dict, steps: int, rounds: int) -> dict[int, dict]:
    """The planner's choice and the fastest measured layout, where they differ, trained by turns
    `rounds` times each: two layouts a few per cent apart swap places between sweeps ten minutes
    apart on this machine (dp=2 at micro-batches 2 and 4: 3% one way, even, 10% the other way in
    three runs), so whether the choice is within 5% of the fastest is measured side by side."""
    duel = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for nproc, (top, fastest) in picks(profile, measured).items():
            if top == fastest:
                continue
            times = {"choice_steps": [], "fastest_steps": []}
            for _ in range(rounds):
                for name, layout in (("choice_steps", top), ("fastest_steps", fastest)):
                    times[name] += measure(layout, nproc, steps, out_dir)["step_times"]
            duel[nproc] = {"choice": dataclasses.asdict(top), "fastest": dataclasses.asdict(fastest), **times}
            print(f"{nproc} ranks, by turns: {top.describe()} {statistics.median(times['choice_steps']):.3f} s, "
                  f"{fastest.describe()} {statistics.median(times['fastest_steps']):.3f} s", flush=True)
    return duel


def save(path: str, profile: dict, measured: dict, references: list[float], duel: dict) -> None:
    runs = [{"nproc": nproc, "layout": dataclasses.asdict(layout), **run} for (nproc, layout), run in measured.items()]
    with open(path, "w") as f:
        json.dump({"profile": profile, "references": references, "runs": runs, "head_to_head": duel}, f)


def load(path: str) -> tuple[dict, dict, list[float], dict]:
    with open(path) as f:
        saved = json.load(f)
    measured = {(run["nproc"], Layout(**run["layout"])): run for run in saved["runs"]}
    duel = {int(n): d for n, d in saved.get("head_to_head", {}).items()}
    return saved["profile"], measured, saved["references"], duel


def pass_spread(run: dict) -> float:
    """How far apart the slowest and fastest sweep's medians of this layout are (one `comm` entry per sweep)."""
    passes = len(run["comm"])
    per_pass = len(run["step_times"]) // passes
    medians = [statistics.median(run["step_times"][i * per_pass:(i + 1) * per_pass]) for i in range(passes)]
    return max(medians) / min(medians) - 1


def report(profile: dict, measured: dict, references: list[float], duel: dict) -> None:
    """The table of predicted against measured, the worst errors, and the top choices."""
    work = workload(get_preset("small"), GLOBAL, SEQ, "fp32")
    calibrated = profile["measured_steps"][REFERENCE_KEY]["measured_s"]
    rows, worst_time, worst_memory, worst_drifted, within = [], 0.0, 0.0, 0.0, 0
    for nproc in sorted({n for n, _ in measured}):
        cluster = cpu_local_cluster(nproc, profile)
        results = []
        for layout in (lay for n, lay in measured if n == nproc):
            predicted, run = estimate(work, cluster, layout), measured[(nproc, layout)]
            step = statistics.median(run["step_times"])
            results.append((layout, predicted, step))
            time_err = predicted.step_time_s / step - 1
            within += abs(time_err) <= 0.15
            drift = statistics.mean(run["drifts"])
            drifted_err = predicted.step_time_s * drift / step - 1
            worst_drifted = max(worst_drifted, abs(drifted_err))
            mem_pred = predicted.memory_bytes_per_device
            mem_err = mem_pred / run["memory"] - 1
            worst_time, worst_memory = max(worst_time, abs(time_err)), max(worst_memory, abs(mem_err))
            rows.append(f"| {nproc} | {layout.describe()} | {predicted.step_time_s:.3f} | {step:.3f} "
                        f"| {time_err:+.0%} | {pass_spread(run):.0%} | {drift - 1:+.0%} | {drifted_err:+.0%} | {mem_pred / 2**20:.1f} | {run['memory'] / 2**20:.1f} "
                        f"| {mem_err:+.0%} | {run['rss'] / 2**20:.0f} |")
        top = min(results, key=lambda r: r[1].step_time_s)
        fastest = min(results, key=lambda r: r[2])
        by_turns = ""
        d = duel.get(nproc)
        if top[0] != fastest[0] and d and Layout(**d["choice"]) == top[0] and Layout(**d["fastest"]) == fastest[0]:
            ratio = statistics.median(d["choice_steps"]) / statistics.median(d["fastest_steps"]) - 1
            by_turns = f"; trained by turns, {len(d['choice_steps'])} steps each: {ratio:+.0%}"
        elif top[0] != fastest[0]:
            by_turns = "; not trained by turns (the choice differs from the saved run's)" if duel else ""
        rows.append(f"| {nproc} | planner's choice {top[0].describe()}: measured {top[2] / fastest[2] - 1:+.0%} against "
                    f"the fastest measured, {fastest[0].describe()}{by_turns} | | | | | | | | | | |")
    print("\n| ranks | layout | predicted step s | measured step s | error | sweeps apart | machine drift | error after drift "
          "| predicted MiB | measured MiB | error | measured RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{within} of {len(measured)} within 15%; worst step-time error {worst_time:.1%} ({worst_drifted:.1%} with the "
          f"prediction scaled by the machine's drift), worst memory error {worst_memory:.1%}; reference step "
          + ", ".join(f"{r:.3f}" for r in references) + f" s against calibration's {calibrated:.3f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--passes", type=int, default=3, help="sweeps of every layout, their steps pooled")
    p.add_argument("--profile", help="calibration profile (default: the one `strata calibrate` wrote)")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs each of the planner's choice and the fastest measured layout, by turns (0: none)")
    p.add_argument("--save", help="write the measurements and the profile to this JSON file")
    p.add_argument("--replay", nargs="+", metavar="FILE", help="report saved runs again; measure nothing")
    args = p.parse_args()
    if args.replay:
        for path in args.replay:
            print(f"\n## {path}")
            report(*load(path))
        return
    profile = load_profile(args.profile)
    calibrated = profile["measured_steps"][REFERENCE_KEY]["measured_s"]
    measured, references = measure_all(args.steps, args.passes, calibrated)
    duel = head_to_head(profile, measured, args.steps, args.rounds)
    if args.save:
        save(args.save, profile, measured, references, duel)
    report(profile, measured, references, duel)


if __name__ == "__main__":
    main()
