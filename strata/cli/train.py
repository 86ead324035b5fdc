"""`strata train` and `strata launch`: the run's settings and files checked once, in the process
that starts the ranks, then the ranks started (or training run here, for one process).

Handlers import the engine only when they run: parsing flags and `--help` never import torch."""

from __future__ import annotations

import os
import sys

from strata.config import (
    TrainConfig,
    check_given,
    check_output_paths,
    given_settings,
    load_toml,
    make_config,
    setting_fields,
)
from strata.errors import ConfigError

LAUNCHED_COMMANDS = ("train", "doctor", "bench")  # what runs on the ranks of a multi-node job


def checked_train(args, argv: list[str], world_size: int | None, in_a_rank: bool) -> tuple[TrainConfig, list[str]]:
    """The run's config, every setting and file checked (in the process that starts the ranks, so
    a problem is one line), and the argv the ranks get (with --parallel auto's choice). The world
    size is the launched one, or --nproc's."""
    from strata.train.preflight import DONE, check_model_flag, checked_model, model_shape, preflight
    flag_values = {name: getattr(args, name) for name in setting_fields()}
    file_values = load_toml(args.config) if args.config else {}
    cfg = make_config(file_values, flag_values)
    world_size = world_size or cfg.nproc
    checked_already = DONE in os.environ
    if not checked_already:  # the user's settings (the ranks' argv holds the launcher's choices too)
        given = given_settings(file_values, flag_values)
        check_given(cfg, given)
        check_output_paths(cfg)
        if "model" in given and cfg.init_from is not None:
            check_model_flag(cfg)
    if cfg.parallel == "auto":
        from strata.config import check_run_settings
        from strata.train.auto import as_flags, choose
        check_run_settings(cfg)
        cfg, reasons = choose(cfg, world_size, model_shape(cfg))
        if int(os.environ.get("RANK", 0)) == 0 and not checked_already:
            print("\n".join(reasons), file=sys.stderr, flush=True)
        argv = [*argv, *as_flags(cfg)]
    checked_model(cfg, world_size)
    if not in_a_rank:  # the files, once; the ranks are told so (ranks_checked() in their environment)
        for note in preflight(cfg):
            print(note, file=sys.stderr, flush=True)
    return cfg, argv


def ranks_checked() -> dict[str, str]:
    """What the launcher adds to the ranks' environment once it has checked the run's files."""
    from strata.train.preflight import DONE
    return {DONE: "1"}


def train_command(args, argv: list[str]) -> int:
    argv = ["train", *argv[1:]] if argv[:1] == ["train"] else argv
    from strata.cli import slurm
    if slurm.started_by_srun():  # a task of srun: its node's ranks run, or it becomes a rank
        exit_code = slurm.join_job(args, argv, checked_train)
        if exit_code is not None:
            return exit_code
    launched_by_torchrun = "LOCAL_RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if launched_by_torchrun else None
    cfg, argv = checked_train(args, argv, world_size, launched_by_torchrun)
    if cfg.nproc > 1 and not launched_by_torchrun:
        from strata.distributed.launch import launch_local
        return launch_local(cfg.nproc, argv, cfg.max_restarts, env=ranks_checked())
    from strata.train.trainer import train
    try:
        summary = train(cfg, checked=not launched_by_torchrun)
    except FloatingPointError as e:  # reported, not a traceback: the checkpoints written so far are intact
        if int(os.environ.get("RANK", 0)) == 0:  # every rank stops alike: one line says it
            print(f"strata: error: {e}", file=sys.stderr)
        return 1
    if summary["val_losses"] and int(os.environ.get("RANK", 0)) == 0:
        first, last = summary["val_losses"][0], summary["val_losses"][-1]
        print(f"validation loss: {first[1]:.4f} at step {first[0]} -> {last[1]:.4f} at step {last[0]}")
        if summary["checkpoint"]:
            print(f"checkpoint: {summary['checkpoint']}")
    return 0


def launch_command(args, argv: list[str]) -> int:
    """Every check of the command the nodes will run, made here, before torchrun starts them."""
    from strata.cli.parser import build_parser
    from strata.cli.tools import check_doctor_flags
    from strata.distributed.hostfile import parse_hostfile
    from strata.distributed.launch import launch_hostfile
    command = args.strata_args[1:] if args.strata_args[:1] == ["--"] else args.strata_args
    if not 1 <= args.master_port <= 65535:
        raise ConfigError(f"--master-port {args.master_port}: valid 1-65535")
    if not command:
        raise ConfigError("strata launch: give the strata command to run after the flags, e.g. "
                          "`strata launch --hostfile hosts -- train --model small`")
    launched = build_parser().parse_args(command)
    from strata.cli import slurm
    if args.slurm_script is not None:
        return slurm.write_script(args, launched, command, checked_train)
    slurm.check_hostfile_flags(args)
    if launched.command not in LAUNCHED_COMMANDS or (launched.command == "bench" and launched.bench_command != "comm"):
        raise ConfigError(f"strata launch -- {command[0]}: runs train, doctor or bench comm on every node")
    hosts = parse_hostfile(args.hostfile)
    if launched.command == "train":
        cfg, _ = checked_train(launched, command, len(hosts) * hosts[0].slots, in_a_rank=False)
        if cfg.max_restarts:  # the hostfile's torchrun runs without restarts
            raise ConfigError("not with `strata launch --hostfile`, whose nodes' ranks are not restarted; run the "
                              "launch again with --resume auto", "max_restarts", cfg.max_restarts)
    if launched.command == "doctor":
        check_doctor_flags(launched)
    return launch_hostfile(args.hostfile, command, args.master_port, args.node_rank, args.dry_run,
                           env=ranks_checked() if launched.command == "train" else None)
