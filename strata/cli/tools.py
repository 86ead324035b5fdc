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
    config = doctor_config(args)
    if config.bandwidth and "LOCAL_RANK" not in os.environ:
        raise ConfigError("--bandwidth: run it on every node through `strata launch --hostfile H -- doctor --bandwidth`")
    return run(config)


def bench_command(args, argv: list[str]) -> int:
    if args.bench_command == "generate":
        from strata.tools.bench_generate import run_bench
        return run_bench(generate_bench_config(args))
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


def doctor_config(args):
    """`strata doctor`'s flags, checked as `strata plan` checks the planned job's, typed: the planned
    job's flags go with --bandwidth; --flight-recorder names a directory holding at least one dump."""
    from strata.plan.hardware import DEVICES
    from strata.tools.commbench import parse_size
    from strata.tools.doctor import DoctorConfig
    try:
        bandwidth_bytes = parse_size(args.bandwidth_bytes)
    except ValueError as e:
        raise ConfigError(f"--bandwidth-bytes: {e}") from None
    config = DoctorConfig(args.hostfile, args.flight_recorder, args.bandwidth, bandwidth_bytes, args.model, args.layout,
                          args.device, args.global_batch, args.seq_len, args.precision)
    default = DoctorConfig()
    planned = {"model": config.model, "layout": config.layout, "device": config.device != default.device,
               "global_batch": config.global_batch != default.global_batch, "seq_len": config.seq_len,
               "precision": config.precision != default.precision}
    given = [name for name, value in planned.items() if value]
    if given and not config.bandwidth:
        raise ConfigError(f"--{given[0].replace('_', '-')}: only with --bandwidth (the planned layout is checked "
                          f"against the measured link)")
    if config.device not in DEVICES:
        raise ConfigError(f"--device {config.device}: valid: {', '.join(DEVICES)}")
    if config.global_batch < 1:
        raise ConfigError(f"--global-batch {config.global_batch}: must be >= 1")
    if config.flight_recorder is not None:
        _check_flight_recorder_dir(config.flight_recorder)
    return config


def _check_flight_recorder_dir(directory: str) -> None:
    from strata.distributed.flight_recorder import read_dumps
    if not os.path.isdir(directory):
        what = "is a file" if os.path.exists(directory) else "no such directory"
        raise ConfigError(f"--flight-recorder {directory}: {what}; want the directory of the ranks' dumps")
    if not read_dumps(directory):
        raise ConfigError(f"--flight-recorder {directory}: no flight-recorder dump in it (a dump is a file named "
                          f"<prefix><rank>, e.g. rank_0, written on a timeout with TORCH_FR_BUFFER_SIZE set)")


def _bench_comm(args, argv) -> int:
    from strata.tools.commbench import CommBenchConfig, parse_size, run
    try:
        min_bytes, max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
    except ValueError as e:
        raise ConfigError(f"--min-bytes/--max-bytes: {e}") from None
    ops = tuple(op.strip() for op in args.ops.split(",") if op.strip())
    config = CommBenchConfig(ops, min_bytes, max_bytes, args.factor, args.iters, args.dim, args.tp, args.pp,
                             args.device, args.timeout, args.json)
    check_comm_bench(config, args.nproc)
    if "LOCAL_RANK" not in os.environ:
        from strata.distributed.launch import launch_local
        return launch_local(args.nproc, argv)
    return run(config)


def generate_bench_config(args):
    """`strata bench generate`'s flags, checked (each in one line naming its flag) and typed."""
    from strata.tools.bench_generate import GenerateBenchConfig
    if args.runs < 1:
        raise ConfigError(f"--runs {args.runs}: must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads}: must be >= 1")
    check_device(args.device, ("cpu", "cuda"))
    if (args.checkpoint is None) == (args.model is None):
        raise ConfigError("give --checkpoint CKPT or --model PRESET (random weights), one of them")
    return GenerateBenchConfig(args.checkpoint, args.model, tuple(args.prompt) if args.prompt else None,
                               tuple(args.prompt_ids) if args.prompt_ids else None, _int_list(args.lengths, "--lengths"),
                               _int_list(args.batch, "--batch"), args.runs, args.compare, args.plot, args.json,
                               args.dtype, args.device, args.threads)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} {text}: want comma-separated integers, e.g. 16,32,64") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text}: want one or more integers >= 1")
    return values


def check_comm_bench(config, nproc: int) -> None:
    """`strata bench comm`'s settings, each refused in one line naming its flag."""
    from strata.tools.commbench import OPS
    bad = [op for op in config.ops if op not in OPS]
    tp, pp = config.tp, config.pp
    checks = [(config.ops, f"--ops {','.join(config.ops)!r}: give at least one of {', '.join(OPS)}"),
              (not bad, f"--ops {','.join(bad)}: valid: {', '.join(OPS)}"),
              (tp >= 1 and pp >= 1, f"--tp {tp}, --pp {pp}: must be >= 1"),
              (0 < config.timeout < float("inf"), f"--timeout {config.timeout}: must be > 0 seconds"),
              (config.min_bytes <= config.max_bytes,
               f"--min-bytes {config.min_bytes} is above --max-bytes {config.max_bytes}"),
              (config.factor >= 2, f"--factor {config.factor}: must be >= 2"),
              (config.iters >= 1, f"--iters {config.iters}: must be >= 1"),
              (nproc >= 2, f"--nproc {nproc}: a collective needs 2 or more ranks"),
              (config.dim in (None, "dp", "tp", "pp"), f"--dim {config.dim}: valid: dp, tp, pp"),
              (min(tp, pp) < 1 or nproc % (tp * pp) == 0, f"--tp {tp} x --pp {pp} does not divide --nproc {nproc}")]
    if config.dim and not bad and tp >= 1 and pp >= 1 and nproc % (tp * pp) == 0:
        degrees = {"tp": tp, "pp": pp, "dp": data_parallel_degree(nproc, tp=tp, pp=pp)}
        size = degrees.get(config.dim, 2)
        checks.append((size >= 2, f"--dim {config.dim}: its groups have {size} rank; set --{config.dim} 2 or more"
                                  if config.dim != "dp" else f"--dim dp: dp is 1 with --tp {tp} --pp {pp}"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    check_device(config.device)


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
