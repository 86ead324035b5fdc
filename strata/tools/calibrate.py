"""`strata calibrate`: measure this machine so the planner can predict it (`--device cpu-local`).

For 1, 2, 4, ... up to --nproc processes running at once (through torchrun, as training runs):
- the matmul rate, the memory bandwidth and the time of a forward and backward of --model each
  process gets while all of them compute (they share the cores and the memory);
- for every collective the planner uses (all-reduce, all-gather, reduce-scatter, send/recv) on a
  group of that size, the time and the CPU time of messages from 16 KiB to 16 MiB (bytes of the
  whole tensor, so the points hold the ring's factors);
then, on one process, the memory bandwidth (a large copy) and how this CPU runs a training step's
kernels (strata/plan/compute.py): --model's GEMMs, attention, an elementwise add and an
exponential timed alone, and the GEMMs' rate inside a step and a cost per kernel fitted to its
real training steps over a grid of micro-batch sizes and counts; with 2 processes or more, what
a tensor-parallel collective costs inside a real tp=2 step beyond its time in the loop above; and
the disk under --disk-dir (where offloaded files go): its write rate (data synced), its read rate
with the file out of the page cache, and with it in. The profile is JSON, by default in
~/.cache/strata/calibration.json. --quick shortens every timing (`Effort`): a rough profile in
about a minute.

`--inference` measures instead what `strata plan --inference` needs: strata/tools/calibrate_inference.py."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from strata.distributed.launch import launch_local
from strata.distributed.mesh import consecutive_groups, init_distributed, pick_device
from strata.errors import ConfigError
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.plan.cost import Estimate, estimate
from strata.plan.inputs import cpu_local_cluster, workload
from strata.rules.layout import Layout, check_tensor_parallel
from strata.tools.bench_generate import least_squares
from strata.tools.calibrate_kernels import REFERENCE_KEY, kernel_costs, reference_step_seconds

MESSAGE_BYTES = [2**k for k in range(14, 25, 2)]  # 16 KiB .. 16 MiB
# windows of steps of --model each process count runs: the first warms up and is left out, the
# median of the rest kept. The bench compares the planner with the median of a run's steps, so the
# share is taken the same way: the fastest of three windows was about 15% under the median with
# four processes on two cores (1.18-1.30 s against 1.40 s, the first window 2.0 s), 5% under with
# one, and predicted 4 ranks 15-23% fast in a run whose 2 ranks held within 11%.
STEP_WINDOWS = 6
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")


@dataclass(frozen=True)
class Effort:
    """How long each measurement runs. The default is what the planner's bench was checked with;
    --quick is a rough profile in about a minute (smoke tests, a first look at a machine)."""
    rate_s: float = 1.0  # the matmul rate's and the memory bandwidth's timing, each
    step_window_s: float = 2.0  # each of the step_windows windows of --model's steps
    # repeats of each collective and size, their median kept: with 16, a 16-256 KiB all-reduce
    # between two processes came out anywhere from 0.7 to 4.6 ms within one calibration
    collective_repeats: int = 32
    disk_bytes: int = 2 << 30  # written, synced and read back
    grid_sweeps: int = 3  # times the kernels' grid of training steps is timed (calibrate_kernels.kernel_costs)
    step_windows: int = STEP_WINDOWS  # windows of --model's steps a process count runs, the first a warm-up
    # one process measured after every round of the larger counts too, not only before them: its
    # numbers (the reference every share is taken against) the median of runs that bracket them
    one_process_after_rounds: bool = True


# --quick: shorter timings, three windows of steps kept (a median still), and one process measured
# once, before the others: about two thirds of the time of quick's first version, for a rough profile
FULL, QUICK = Effort(), Effort(rate_s=0.25, step_window_s=0.5, collective_repeats=8, disk_bytes=256 << 20,
                               grid_sweeps=1, step_windows=4, one_process_after_rounds=False)


def matmul_rate(seconds: float = 1.0, n: int = 512) -> float:
    """fp32 FLOP/s of this process on square matmuls of transformer-like size."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b)
        done += 1
    return done * 2 * n**3 / (time.perf_counter() - started)


def _time_op(op: str, nbytes: int, repeats: int, group) -> tuple[float, float]:
    """(seconds, CPU seconds) of one collective between bursts of compute, as in training: each
    rank computes for about as long as a layer's work between two collectives, then communicates.
    The seconds run from the call to its return; the CPU seconds are what the process (its
    communication threads included) spent in that time. Timed after a barrier instead, a
    collective looks several times cheaper than it is, since in a real step the ranks arrive a
    little apart. The rest of the seconds is waiting: on a machine with more processes than
    cores, waiting for a peer that is off its core while others use it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peer = dist.get_global_rank(group, 1 - rank) if rank < 2 else None
    elements = nbytes // 4
    cpu = torch.device("cpu")  # calibration measures this machine: its ranks' device is the CPU, over gloo
    full = torch.ones(elements - elements % world, device=cpu)
    shard = torch.ones(full.numel() // world, device=cpu)
    a = torch.randn(256, 256)

    def burst():  # about 10 ms on one core of this machine
        for _ in range(32):
            torch.mm(a, a)

    def run():
        if op == "all_reduce":
            dist.all_reduce(full, group=group)
        elif op == "all_gather":
            dist.all_gather_single(full, shard, group=group)
        elif op == "reduce_scatter":
            dist.reduce_scatter_single(shard, full, group=group)
        elif rank == 0:  # send: the group's first rank to its second, the others idle
            dist.send(full, peer)
        elif rank == 1:
            dist.recv(full, peer)

    run()
    dist.barrier()
    seconds, cpu_seconds = [], []
    for _ in range(repeats):
        burst()
        started, cpu_started = time.perf_counter(), time.process_time()
        run()
        seconds.append(time.perf_counter() - started)
        cpu_seconds.append(time.process_time() - cpu_started)
    # medians (one slow repeat, the machine busy elsewhere, does not move them), averaged over the
    # processes that took part (a send's pair in each group)
    takes_part = op != "send" or rank < 2
    spent = torch.tensor([statistics.median(seconds), statistics.median(cpu_seconds), 1.0] if takes_part else [0.0] * 3,
                         dtype=torch.float64, device=cpu)
    dist.all_reduce(spent)
    return (spent[0] / spent[2]).item(), (spent[1] / spent[2]).item()


def fit(points: list[tuple[float, float]]) -> dict:
    """Least squares time = latency + bytes / bandwidth over all sizes (what the summary prints;
    the planner reads the points themselves, alpha-beta between neighbouring sizes)."""
    slope, intercept, _ = least_squares([x for x, _ in points], [y for _, y in points])
    return {"latency_s": max(0.0, intercept), "bandwidth": 1 / max(slope, 1e-15)}


def model_step_seconds(model: str, micro_batch: int = 4, seq_len: int = 128, seconds: float = 2.0) -> float:
    """Mean seconds of a forward and backward of `model` (fp32, no optimizer, no communication),
    over `seconds` of them: with other processes doing the same, the share of the machine one
    process gets for a training step's mix of kernels."""
    cfg = get_preset(model)
    seq_len = min(seq_len, cfg.max_seq_len)
    net = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
    net(tokens, tokens).backward()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        net(tokens, tokens).backward()
        done += 1
    return (time.perf_counter() - started) / done


def worker(out: str, model: str, effort: Effort = FULL) -> None:
    """One rank of a calibration group (launched by torchrun)."""
    torch.set_num_threads(1)
    init_distributed(pick_device("cpu"), 120)
    world = dist.get_world_size() if dist.is_initialized() else 1
    measured = []
    for measure in (lambda: matmul_rate(effort.rate_s), lambda: memory_bandwidth(effort.rate_s),
                    *[lambda: model_step_seconds(model, seconds=effort.step_window_s)] * effort.step_windows):
        if world > 1:  # every process measures at once: they share the cores and the memory
            dist.barrier()
        measured.append(torch.tensor([measure()], dtype=torch.float64))
    collectives = {op: {} for op in OPS}
    if world > 1:
        for value in measured:
            dist.all_reduce(value)
            value /= world
        # every group size that divides the world, all groups of that size busy at once (as the
        # tp groups of a dp x tp layout are), while every process runs
        for size in [g for g in range(2, world + 1) if world % g == 0]:
            group = consecutive_groups(world, size, dist.get_rank())
            for op in OPS:
                points = [(nbytes, *_time_op(op, nbytes, effort.collective_repeats, group))
                          for nbytes in MESSAGE_BYTES]
                collectives[op][str(size)] = {**fit([p[:2] for p in points]), "points": points}
    rate, bandwidth, _warm_up, *windows = measured
    step = statistics.median(w.item() for w in windows)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"matmul_flops": rate.item(), "memory_bandwidth": bandwidth.item(), "step_seconds": step,
                       "collectives": collectives}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def memory_bandwidth(seconds: float = 1.0) -> float:
    """Bytes/s of a 256 MiB copy (read + write), averaged over `seconds` of copying: with more
    processes than cores, each gets its share of the time as well as of the memory."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        dst.copy_(src)
        done += 1
    return done * 2 * src.numel() * 4 / (time.perf_counter() - started)


def disk_rates(directory: str, nbytes: int = 2 << 30, chunk: int = 64 << 20) -> dict:
    """Bytes/s of a sequential write (until the data is on the disk), of a read with the file out
    of the page cache (the disk itself) and of one with it in (what offloaded files that fit in
    free memory are read at), through pwrite/pread as the offload tiers use them; and the free
    space there (what disk offload may fill)."""
    data = torch.randn(chunk // 4)
    buffer = (ctypes.c_char * chunk).from_address(data.data_ptr())
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=directory, prefix="strata-calibrate-")
    rates = {}
    try:
        started = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.pwritev(fd, [buffer], offset)
        os.fdatasync(fd)
        rates["write_bytes_per_s"] = nbytes / (time.perf_counter() - started)
        for kind in ("read_bytes_per_s", "cached_read_bytes_per_s"):
            if kind == "read_bytes_per_s":
                os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)  # synced above, so it can leave
            started = time.perf_counter()
            for offset in range(0, nbytes, chunk):
                os.preadv(fd, [buffer], offset)
            rates[kind] = nbytes / (time.perf_counter() - started)
    finally:
        os.close(fd)
        os.remove(path)
    return {"directory": os.path.abspath(directory), "free_bytes": shutil.disk_usage(directory).free, **rates}


# The tensor-parallel steps whose collectives are timed in place: tp=2 with micro-batches of 1 and
# of 4 sequences (two message sizes), 4 micro-batches a step, the steps after the first
TP_STEP_MICRO_BATCH_SIZES, TP_STEP_MICRO_BATCHES, TP_STEP_STEPS = (1, 4), 4, 6


def collective_in_step(model: str, profile: dict, seq_len: int = 128, rounds: int = 1) -> dict:
    """What a tensor-parallel collective costs inside a training step beyond (or short of) its
    time in the loop (`_time_op`), at two message sizes: for each, a tp=2 step of `model` on 2
    processes, its tp collectives' seconds as strata's communication counter times them (call to
    return, the wait for the peer included), against what the planner prices for that step from
    the loop's points; the difference, over the collectives the planner counts in it, at the bytes
    of each (`collective_in_step_points`: (bytes, seconds), either sign). Each size's step is timed
    in `rounds` launches, the sizes taking turns, and the median kept: one 6-step launch a size put
    the cost anywhere from -0.83 to +1.52 ms over four calibrations, and tp2 at micro-batch 1 runs
    448 collectives a step, so 1 ms each moved its prediction 17%.

    In the loop both ranks arrive after the same burst of matmuls; in a step they arrive after a
    block's mix of kernels. On a freshly booted machine a collective cost about 0.7 ms more in a
    step at 192 KiB, 384 KiB and 768 KiB alike (1.40 ms against 0.65 ms at 192 KiB); on the same
    machine after a restart, about twice as slow, 1.5 ms less at 178 KiB (2.2 ms against 3.7 ms)
    and 0.5 ms less at 713 KiB. One number measured at one size could not follow the second."""
    cfg = get_preset(model)
    seq_len = min(seq_len, cfg.max_seq_len)
    # the sizes take turns, so a spell of the machine being slow falls on both alike
    timed = [[_tp_seconds_in_step(model, micro_batch, micro_batch * TP_STEP_MICRO_BATCHES, seq_len)
              for micro_batch in TP_STEP_MICRO_BATCH_SIZES] for _ in range(rounds)]
    points, details = [], []
    for i, micro_batch in enumerate(TP_STEP_MICRO_BATCH_SIZES):
        layout = Layout(tp=2, micro_batch=micro_batch)
        work = workload(cfg, micro_batch * TP_STEP_MICRO_BATCHES, seq_len, "fp32")

        def priced(in_step: float) -> Estimate:
            cluster = cpu_local_cluster(2, {**profile, "collective_in_step_points": [[1.0, in_step]]})
            return estimate(work, cluster, layout)

        rounds_s = [seconds[i] for seconds in timed]
        measured = statistics.median(rounds_s)
        # the planner's tp seconds are linear in the cost added to each collective: its slope is
        # the number of collectives it counts in the step
        alone = priced(0.0)
        calls = (priced(1e-3).comm_seconds["tp"] - alone.comm_seconds["tp"]) / 1e-3
        # the mean message of the step (a pair's all-reduce moves the tensor's own bytes, 2 (t - 1) / t
        # of them): the activations' all-reduces with the loss's smaller ones among them
        nbytes = alone.comm_bytes["tp"] / calls
        points.append([nbytes, (measured - alone.comm_seconds["tp"]) / calls])
        details.append({"layout": layout.describe(), "global_batch": work.global_batch, "message_bytes": nbytes,
                        "measured_s": measured, "measured_rounds_s": rounds_s,
                        "priced_from_loop_s": alone.comm_seconds["tp"], "collectives": calls})
    return {"collective_in_step_points": points, "collective_in_step": details}


def _tp_seconds_in_step(model: str, micro_batch: int, global_batch: int, seq_len: int) -> float:
    """The median seconds a tp=2 step of `model` spent in collectives on the tp group (every op:
    the planner's tp seconds count all of them), over the steps after the first."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "tp.jsonl")
        code = launch_local(2, ["train", "--model", model, "--tp", "2", "--micro-batch", str(micro_batch),
                                "--global-batch", str(global_batch), "--seq-len", str(seq_len),
                                "--steps", str(TP_STEP_STEPS), "--eval-batches", "1", "--no-progress",
                                "--metrics", metrics])
        if code != 0:
            raise RuntimeError(f"calibration's tensor-parallel step failed (exit code {code})")
        with open(metrics) as f:
            steps = [r for r in map(json.loads, f) if r.get("kind") == "train"][1:]
    return statistics.median(sum(seconds for key, seconds in r["comm_seconds_by_op"].items() if key.endswith("/tp"))
                             for r in steps)


def combined(runs: list[dict]) -> dict:
    """One process count's measurements from its runs, each number the median over them (every
    collective's time and CPU time point by point, its fit redone): a spell of the machine being
    busy elsewhere in one run (seen here: 52 GFLOP/s for one process, then 96 each for two) is
    not the number, and neither is a fast one."""
    median, collectives = statistics.median, {}
    for op, by_size in runs[0]["collectives"].items():
        collectives[op] = {}
        for size, first in by_size.items():
            points = [[p[0], *(median(run["collectives"][op][size]["points"][k][c] for run in runs)
                               for c in range(1, len(p)))] for k, p in enumerate(first["points"])]
            collectives[op][size] = {**fit([p[:2] for p in points]), "points": points}
    return {"matmul_flops": median(r["matmul_flops"] for r in runs),
            "memory_bandwidth": median(r["memory_bandwidth"] for r in runs),
            "step_seconds": median(r["step_seconds"] for r in runs), "collectives": collectives}


def calibrate(max_procs: int, model: str, out: str, disk_dir: str | None = None, rounds: int = 2,
              effort: Effort = FULL) -> dict:
    profile = {"device": "cpu-local", "cores": len(os.sched_getaffinity(0)), "memory_bytes": total_memory(),
               "matmul_flops": {}, "memory_bandwidth_per_process": {}, "step_seconds_per_process": {},
               "collectives": {op: {} for op in OPS}}
    # Every count is measured in `rounds` rounds (--rounds) spread over the calibration, one process before,
    # between and after them, and each number is the median of its runs (`combined`): one
    # process is the reference every share is taken against, and the machine's speed moves over
    # minutes (two calibrations two hours apart put four processes at 0.93 and 0.78 of an even
    # split of the cores). --quick (one_process_after_rounds False) measures one process before them only.
    counts = [n for n in (2, 4, 8, 16) if n <= max_procs]
    after = (1,) if effort.one_process_after_rounds else ()
    sizes = [1] + [n for _ in range(rounds) for n in (*counts, *after)]
    runs: dict[int, list[dict]] = {}
    references = []  # REFERENCE_STEP, timed in each one-process round: the level the kernels are fitted at
    with tempfile.TemporaryDirectory() as tmp:
        for i, n in enumerate(sizes):
            part = os.path.join(tmp, f"{i}.json")
            if n == 1:
                worker(part, model, effort)
                references.append(reference_step_seconds(model))
            else:
                code = launch_local(n, ["calibrate", "--worker", part, "--model", model,
                                        "--worker-effort", json.dumps(asdict(effort))])
                if code != 0:
                    raise RuntimeError(f"calibration on {n} processes failed (exit code {code})")
            with open(part) as f:
                measured = json.load(f)
            runs.setdefault(n, []).append(measured)
            print(f"{n} process{'es' if n > 1 else ''}: {measured['matmul_flops'] / 1e9:.1f} GFLOP/s and "
                  f"{measured['memory_bandwidth'] / 1e9:.1f} GB/s each, a step {measured['step_seconds']:.3f} s"
                  + (f", a training step of {REFERENCE_KEY} {references[-1]:.3f} s" if n == 1 else "")
                  + "".join(f"; {op} in groups of {size}: {v['latency_s'] * 1e6:.0f} us + {v['bandwidth'] / 1e9:.2f} GB/s"
                            for op, by_size in measured["collectives"].items() for size, v in by_size.items()),
                  flush=True)
    for n, measured_runs in runs.items():
        measured = combined(measured_runs)
        profile["matmul_flops"][str(n)] = measured["matmul_flops"]
        profile["memory_bandwidth_per_process"][str(n)] = measured["memory_bandwidth"]
        profile["step_seconds_per_process"][str(n)] = measured["step_seconds"]
        for op, by_size in measured["collectives"].items():
            for size, values in by_size.items():
                profile["collectives"][op][f"{size}/{n}"] = values
    torch.set_num_threads(1)
    profile["memory_bandwidth"] = profile["memory_bandwidth_per_process"]["1"]
    profile.update(kernel_costs(model, profile["matmul_flops"]["1"], profile["memory_bandwidth"],
                                references=tuple(references), sweeps=effort.grid_sweeps))
    ref = profile["reference_step"]
    print(f"the kernels' grid timed {ref['steps']} at {ref['grid_s']:.3f} s, the rounds at "
          + ", ".join(f"{t:.3f}" for t in ref["rounds_s"]) + f" s: fitted at their median, {ref['level_s']:.3f} s",
          flush=True)
    if effort.grid_sweeps > 1:  # how far the machine moved under the grid, which the medians leave out
        key, step = max(profile["measured_steps"].items(), key=lambda kv: max(kv[1]["sweeps_s"]) / min(kv[1]["sweeps_s"]))
        print(f"the grid's {effort.grid_sweeps} sweeps: furthest apart on {key}, "
              + ", ".join(f"{t:.3f}" for t in step["sweeps_s"]) + f" s (kept {step['timed_s']:.3f} s)", flush=True)
    if "2" in profile["matmul_flops"]:
        try:
            check_tensor_parallel(get_preset(model), 2)
        except ConfigError as error:  # the planner then prices tp collectives at the loop's time
            print(f"the collectives' cost inside a step is not measured: {model} cannot run tp=2 ({error})", flush=True)
        else:
            profile.update(collective_in_step(model, profile, rounds=rounds))
            for (nbytes, seconds), fit in zip(profile["collective_in_step_points"], profile["collective_in_step"]):
                print(f"a tensor-parallel collective of {nbytes / 1024:.0f} KiB inside a step: {seconds * 1e3:+.2f} ms "
                      f"against the loop's time ({fit['collectives']:.0f} a step took {fit['measured_s']:.3f} s, the "
                      "median of " + ", ".join(f"{t:.3f}" for t in fit["measured_rounds_s"]) + " s; "
                      f"priced from the loop at {fit['priced_from_loop_s']:.3f} s)", flush=True)
    profile["disk"] = disk_rates(disk_dir or os.path.join(tempfile.gettempdir(), "strata-offload"), effort.disk_bytes)
    d = profile["disk"]
    print(f"disk under {d['directory']}: write {d['write_bytes_per_s'] / 1e9:.2f} GB/s, read "
          f"{d['read_bytes_per_s'] / 1e9:.2f} GB/s ({d['cached_read_bytes_per_s'] / 1e9:.2f} GB/s from the page cache)",
          flush=True)
    k = profile["kernels"]
    print(f"memory bandwidth {profile['memory_bandwidth'] / 1e9:.1f} GB/s; {model}'s GEMMs reach up to "
          f"{k['gemm_fraction']:.0%} of the matmul rate inside a step ({profile['gemm_fraction_alone']:.0%} alone), "
          f"+{k['gemm_overhead_s'] * 1e6:.0f} us each; attention "
          f"{k['attention_fraction']:.0%}; elementwise kernels {k['bandwidth_fraction']:.0%} of the bandwidth, "
          f"+{k['kernel_overhead_s'] * 1e6:.0f} us each; an exponential +{k['exp_s'] * 1e9:.2f} ns an element", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {out}")
    return profile


def total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 2**30


if __name__ == "__main__":  # python -m strata.tools.calibrate OUT [MODEL]: one process's measurements
    worker(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "small")
