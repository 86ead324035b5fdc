"""The other subcommands: data, convert, doctor, bench, calibrate, plot, schedule. Each checks its
flags and files, then hands the work to the module that does it.

Handlers import the engine only when they run: parsing flags and `--help` never import torch."""

from __future__ import annotations

import json
import os

from strata.errors import ConfigError
from strata.files import check_image_file, check_output_dir, check_output_file
from strata.rules.devices import check_device
from strata.rules.layout import Layout, check_schedule, data_parallel_degree
from strata.rules.schedules import MAX_SIMULATED_ACTIONS, SCHEDULES, build, profile, unit_costs

# What each command writes, by command: (flag's field, kind). "image": a picture (its suffix says
# the format); "file": in an existing directory; "file+dirs": the writer makes its directory;
# "dir": a directory, made as needed. Checked before any work (strata/files.py: on storage, where a
# file can be made), so a typo in a directory costs one line, not a finished computation. `strata
# train`'s paths come from its config too: strata/config.check_output_paths.
OUTPUTS = {"plan": (("chart", "image"),), "plot": (("out", "image"),), "schedule": (("out", "image"),),
           "bench": (("plot", "image"),), "calibrate": (("out", "file+dirs"), ("disk_dir", "dir")),
           "data": (("out", "dir"),), "convert": (("out", "dir"),), "launch": (("slurm_script", "file"),)}
# `strata calibrate` measures groups of up to --nproc processes sharing this machine's cores; past a
# few per core it only measures the scheduler.
CALIBRATE_PROCESSES_PER_CORE = 4


def check_outputs(args) -> None:
    for name, kind in OUTPUTS.get(args.command, ()):
        path = getattr(args, name, None)
        if path is None:
            continue
        if kind == "image":
            check_image_file(path, name)
        elif kind == "dir":
            check_output_dir(path, name)
        else:
            check_output_file(path, name, make_parents=kind == "file+dirs")


def data_command(args, argv: list[str]) -> int:
    from strata.data.prepare import prepare
    meta = prepare(args.source, args.out, args.tokenizer, args.val_fraction, args.text_field)
    print(f"wrote {args.out}: vocab {meta['vocab_size']}, train {meta['splits']['train']['tokens']:,} "
          f"tokens, val {meta['splits']['val']['tokens']:,} tokens")
    return 0


def convert_command(args, argv: list[str]) -> int:
    from strata.checkpoint.hf import convert_from_hf, convert_to_hf
    source = args.from_hf or args.to_hf
    if not os.path.isdir(source):
        raise ConfigError(f"--{'from-hf' if args.from_hf else 'to-hf'} {source}: no such directory")
    written = convert_from_hf(args.from_hf, args.out) if args.from_hf else convert_to_hf(args.to_hf, args.out)
    print(f"wrote {written}")
    return 0


def doctor_command(args, argv: list[str]) -> int:
    from strata.tools.doctor import run
    check_doctor_flags(args)
    if args.bandwidth and "LOCAL_RANK" not in os.environ:
        raise ConfigError("--bandwidth: run it on every node through `strata launch --hostfile H -- doctor --bandwidth`")
    return run(args)


def bench_command(args, argv: list[str]) -> int:
    if args.bench_command == "generate":
        from strata.tools.bench_generate import run_bench
        return run_bench(args)
    return _bench_comm(args, argv)


def calibrate_command(args, argv: list[str]) -> int:
    from strata.model.presets import PRESETS
    from strata.plan.inputs import default_profile_path
    from strata.tools import calibrate
    effort = calibrate.QUICK if args.quick else calibrate.FULL
    if args.worker:  # one rank of the parent's process group, timed as the parent was asked to
        if args.worker_effort:
            try:
                effort = calibrate.Effort(**json.loads(args.worker_effort))
            except (ValueError, TypeError):
                raise ConfigError(f"--worker-effort {args.worker_effort}: not the JSON of calibrate's Effort "
                                  f"(an object of {', '.join(calibrate.Effort.__dataclass_fields__)})") from None
        calibrate.worker(args.worker, args.model, effort)
        return 0
    if args.inference:
        check_device(args.device)
        from strata.tools.calibrate_inference import calibrate_inference
        calibrate_inference(args.device, args.out or default_profile_path())
        return 0
    most = CALIBRATE_PROCESSES_PER_CORE * len(os.sched_getaffinity(0))
    if not 1 <= args.nproc <= most:
        raise ConfigError(f"--nproc {args.nproc}: must be between 1 and {most} ({CALIBRATE_PROCESSES_PER_CORE} "
                          f"processes per core of this machine)")
    if args.model not in PRESETS:
        raise ConfigError(f"--model {args.model}: unknown preset; valid: {', '.join(PRESETS)}")
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 2
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: must be 1 or more")
    calibrate.calibrate(args.nproc, args.model, args.out or default_profile_path(), args.disk_dir, rounds, effort)
    return 0


def plot_command(args, argv: list[str]) -> int:
    if not os.path.isfile(args.metrics):
        raise ConfigError(f"{args.metrics}: {'is a directory' if os.path.isdir(args.metrics) else 'no such file'}; "
                          f"want a metrics file (--metrics) or a pipeline trace (--trace)")
    from strata.parallel.pipeline.timeline import is_trace, plot_schedule, read_trace
    from strata.train.plot import plot_losses
    if is_trace(args.metrics):
        plot_schedule(read_trace(args.metrics), args.out, os.path.basename(args.metrics))
    else:
        plot_losses(args.metrics, args.out)
    print(f"wrote {args.out}")
    return 0


def check_doctor_flags(args) -> None:
    """The planned job's flags go with --bandwidth, and are checked as `strata plan` checks them;
    --flight-recorder names a directory holding at least one dump."""
    from strata.plan.hardware import DEVICES
    from strata.tools.commbench import parse_size
    try:
        args.bandwidth_bytes = parse_size(args.bandwidth_bytes)
    except ValueError as e:
        raise ConfigError(f"--bandwidth-bytes: {e}") from None
    planned = {"model": args.model, "layout": args.layout, "device": args.device != "A100-80G",
               "global_batch": args.global_batch != 8, "seq_len": args.seq_len, "precision": args.precision != "bf16"}
    given = [name for name, value in planned.items() if value]
    if given and not args.bandwidth:
        raise ConfigError(f"--{given[0].replace('_', '-')}: only with --bandwidth (the planned layout is checked "
                          f"against the measured link)")
    if args.device not in DEVICES:
        raise ConfigError(f"--device {args.device}: valid: {', '.join(DEVICES)}")
    if args.global_batch < 1:
        raise ConfigError(f"--global-batch {args.global_batch}: must be >= 1")
    if args.flight_recorder is not None:
        _check_flight_recorder_dir(args.flight_recorder)


def _check_flight_recorder_dir(directory: str) -> None:
    from strata.distributed.flight_recorder import read_dumps
    if not os.path.isdir(directory):
        what = "is a file" if os.path.exists(directory) else "no such directory"
        raise ConfigError(f"--flight-recorder {directory}: {what}; want the directory of the ranks' dumps")
    if not read_dumps(directory):
        raise ConfigError(f"--flight-recorder {directory}: no flight-recorder dump in it (a dump is a file named "
                          f"<prefix><rank>, e.g. rank_0, written on a timeout with TORCH_FR_BUFFER_SIZE set)")


def _bench_comm(args, argv) -> int:
    from strata.tools.commbench import OPS, parse_size, run
    try:
        args.min_bytes, args.max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
    except ValueError as e:
        raise ConfigError(f"--min-bytes/--max-bytes: {e}") from None
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    bad = [op for op in args.ops if op not in OPS]
    checks = [(args.ops, f"--ops {','.join(args.ops)!r}: give at least one of {', '.join(OPS)}"),
              (not bad, f"--ops {','.join(bad)}: valid: {', '.join(OPS)}"),
              (args.tp >= 1 and args.pp >= 1, f"--tp {args.tp}, --pp {args.pp}: must be >= 1"),
              (0 < args.timeout < float("inf"), f"--timeout {args.timeout}: must be > 0 seconds"),
              (args.min_bytes <= args.max_bytes, f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}"),
              (args.factor >= 2, f"--factor {args.factor}: must be >= 2"),
              (args.iters >= 1, f"--iters {args.iters}: must be >= 1"),
              (args.nproc >= 2, f"--nproc {args.nproc}: a collective needs 2 or more ranks"),
              (args.dim in (None, "dp", "tp", "pp"), f"--dim {args.dim}: valid: dp, tp, pp"),
              (min(args.tp, args.pp) < 1 or args.nproc % (args.tp * args.pp) == 0,
               f"--tp {args.tp} x --pp {args.pp} does not divide --nproc {args.nproc}")]
    if args.dim and not bad and args.tp >= 1 and args.pp >= 1 and args.nproc % (args.tp * args.pp) == 0:
        degrees = {"tp": args.tp, "pp": args.pp, "dp": data_parallel_degree(args.nproc, tp=args.tp, pp=args.pp)}
        size = degrees.get(args.dim, 2)
        checks.append((size >= 2, f"--dim {args.dim}: its groups have {size} rank; set --{args.dim} 2 or more"
                                  if args.dim != "dp" else f"--dim dp: dp is 1 with --tp {args.tp} --pp {args.pp}"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    check_device(args.device)
    if "LOCAL_RANK" not in os.environ:
        from strata.distributed.launch import launch_local
        return launch_local(args.nproc, argv)
    return run(args)


def schedule_command(args, argv: list[str]) -> int:
    from strata.parallel.pipeline.timeline import idle_fractions, plot_schedule, simulated
    for name in ("pp", "micro_batches", "virtual_stages"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    check_schedule(Layout(pp=args.pp, virtual_stages=args.virtual_stages, schedule=args.schedule))
    actions = 3 * args.pp * args.virtual_stages * args.micro_batches
    if actions > MAX_SIMULATED_ACTIONS:
        raise ConfigError(f"--pp {args.pp} x --virtual-stages {args.virtual_stages} x --micro-batches "
                          f"{args.micro_batches}: about {actions:,} actions, more than the {MAX_SIMULATED_ACTIONS:,} "
                          f"simulated here")
    v = args.virtual_stages
    ranks = simulated(build(args.schedule, args.pp, args.micro_batches, v), args.pp * v, unit_costs(args.schedule, v))
    idle = idle_fractions(ranks)
    print(f"{args.schedule}, pp {args.pp}, {args.micro_batches} micro-batches, virtual stages {v}: idle per rank "
          f"{', '.join(f'{x:.3f}' for x in idle)} (gpipe/1f1b theory {(args.pp - 1) / (args.micro_batches + args.pp - 1):.3f})")
    if SCHEDULES[args.schedule].asynchronous:  # one step, filled and drained, is 1F1B's; between pauses, none
        print(f"{args.schedule} does not flush between steps: in steady state one more step adds its work alone, idle "
              f"{profile(args.schedule, args.pp, args.micro_batches).bubble_slots:.3f} micro-batch slots per step; the "
              f"fill and drain above come at each pause (an evaluation, a checkpoint, the end)")
    if args.out:
        plot_schedule(ranks, args.out, f"simulated {args.schedule}")
        print(f"wrote {args.out}")
    return 0
