"""`strata train` and `strata launch`: the run resolved once (settings, layout, files checked), in
the process that starts the ranks, then the ranks started on it as a file (`--spec`), or training
run here (one process; a rank started by torchrun or srun without strata's launcher).

Handlers import the engine only when they run: parsing flags and `--help` never import torch."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import TYPE_CHECKING

from strata.config import check_given, setting_fields
from strata.config_file import given_settings, load_toml, make_config
from strata.errors import ConfigError

if TYPE_CHECKING:  # the engine is imported when a command runs, not to parse flags
    from strata.train.spec import RunSpec

LAUNCHED_COMMANDS = ("train", "doctor", "bench")  # what runs on the ranks of a multi-node job


def checked_train(args, world_size: int | None, in_a_rank: bool, announce: bool | None = None) -> RunSpec:
    """The run resolved once (strata/train/spec.py): the user's settings checked, then every setting
    against the others, the world size (the launched one, or --nproc's) and the model, the layout
    chosen under --parallel auto, and unless in_a_rank (whose setup checks them) the run's files,
    so that a problem is one line, before any rank starts. announce: print the choice and the notes
    (default: as rank 0)."""
    from strata.train.preflight import check_model_flag
    from strata.train.spec import check_files, resolve
    if args.spec is not None:  # through `strata launch` or srun: the launcher resolves the flags
        raise ConfigError("--spec: only for the ranks a launcher starts (it writes the file); give the run's flags "
                          "or --config")
    flag_values = {name: getattr(args, name) for name in setting_fields()}
    file_values = load_toml(args.config) if args.config else {}
    cfg = make_config(file_values, flag_values)
    given = given_settings(file_values, flag_values)
    check_given(cfg, given)
    if "model" in given and cfg.init_from is not None:
        check_model_flag(cfg)
    announce = int(os.environ.get("RANK", 0)) == 0 if announce is None else announce
    spec = resolve(cfg, world_size or cfg.nproc, announce)
    return spec if in_a_rank else check_files(spec, announce)


def with_spec_file(spec: RunSpec, start) -> int:
    """Start the ranks (`start(argv)`) on the spec, as a file in a directory of this launcher's own
    that lives while they run (restarted ranks read it again)."""
    from strata.train.spec import write
    with tempfile.TemporaryDirectory(prefix="strata-run-") as directory:
        return start(["train", "--spec", write(spec, directory)])


def _spec_of_launcher(args) -> RunSpec:
    """`strata train --spec FILE`: a rank its launcher started; the spec is the whole run."""
    from strata.train.spec import read
    given = [name for name in setting_fields() if getattr(args, name) is not None]
    if given or args.config:
        flag = "--config" if args.config else "--" + given[0].replace("_", "-")
        raise ConfigError(f"--spec: the file a launcher writes for its ranks holds the whole run; not with {flag}")
    return read(args.spec)


def train_command(args, argv: list[str]) -> int:
    if args.spec is not None:
        return run_training(_spec_of_launcher(args))
    from strata.cli import slurm
    if slurm.started_by_srun():  # a task of srun: its node's ranks run, or it becomes a rank
        joined = slurm.join_job(args, checked_train, with_spec_file)
        if isinstance(joined, int):  # this node's ranks ran
            return joined
        return run_training(joined)
    launched_by_torchrun = "LOCAL_RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if launched_by_torchrun else None
    spec = checked_train(args, world_size, launched_by_torchrun)
    cfg = spec.config
    if cfg.nproc > 1 and not launched_by_torchrun:
        from strata.distributed.launch import launch_local
        return with_spec_file(spec, lambda ranks_argv: launch_local(cfg.nproc, ranks_argv, cfg.max_restarts))
    return run_training(spec)


def run_training(spec: RunSpec) -> int:
    """Train as this process's rank; its last lines (rank 0), or one line for a run that diverged."""
    from strata.train.trainer import train
    try:
        summary = train(spec)
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
    from strata.cli.tools import doctor_config
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
    if launched.command == "doctor":
        doctor_config(launched)
    if launched.command != "train" or args.dry_run:  # a dry run prints the command as given
        if launched.command == "train":
            _hostfile_spec(launched, len(hosts) * hosts[0].slots)
        return launch_hostfile(args.hostfile, command, args.master_port, args.node_rank, args.dry_run)
    return with_spec_file(_hostfile_spec(launched, len(hosts) * hosts[0].slots), lambda ranks_argv: launch_hostfile(
        args.hostfile, ranks_argv, args.master_port, args.node_rank, args.dry_run))


def _hostfile_spec(launched, world_size: int) -> RunSpec:
    """The run this node's launcher resolves (each node's resolves the same, from the same command)."""
    spec = checked_train(launched, world_size, in_a_rank=False)
    if spec.config.max_restarts:  # the hostfile's torchrun runs without restarts
        raise ConfigError("not with `strata launch --hostfile`, whose nodes' ranks are not restarted; run the "
                          "launch again with --resume auto", "max_restarts", spec.config.max_restarts)
    return spec
