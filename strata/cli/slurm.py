"""The Slurm side of the `strata` command: `strata train` as a task of srun, and `strata launch
--slurm-script`. The job's layout, its checks and the script live in strata/distributed/slurm.py;
this module runs the same checks of the training run as strata/cli/train.py does (`checked_train`,
passed in), before any process group exists."""

from __future__ import annotations

import os
import sys

from strata.config_file import load_toml, make_config
from strata.distributed import slurm
from strata.distributed.slurm import started_by_srun  # noqa: F401 - the CLI asks here
from strata.errors import ConfigError
from strata.files import check_output_file


def join_job(args, checked_train, with_spec_file):
    """srun started this process. One task per node with --nproc G: resolve the run, start this
    node's G ranks on it as `strata launch` does, and return their exit code. One task per rank:
    resolve and check the run (in every task, before any process group), make this process the
    rank Slurm says it is (its environment as torchrun's ranks get it), and return the run's spec;
    the caller then trains as that rank."""
    job = slurm.read_job()
    nproc = make_config(load_toml(args.config) if args.config else {}, {"nproc": args.nproc}).nproc
    slurm.check_tasks(job, nproc)
    if nproc == 1 and job.world == 1:
        return checked_train(args, 1, in_a_rank=False)  # one process: nothing to join
    master_ip = slurm.master_address(job)
    socket_env = slurm.socket_environment(job, master_ip)
    if nproc > 1:  # each rank is one of nodes x nproc, and torchrun tells it which
        args.nproc = 1
        spec = checked_train(args, job.nnodes * nproc, in_a_rank=False, announce=job.node_rank == 0)
        print(slurm.describe(job, master_ip, socket_env, nproc), file=sys.stderr, flush=True)  # each node's own
        return with_spec_file(spec, lambda ranks_argv: slurm.launch_node(job, nproc, ranks_argv, master_ip, socket_env,
                                                                         spec.config.max_restarts))
    os.environ.update({**slurm.rank_environment(job, master_ip), **socket_env})
    spec = checked_train(args, job.world, in_a_rank=False)
    if spec.config.max_restarts:
        raise ConfigError("srun starts each rank itself, so nothing could restart them; run one task per node "
                          "with --nproc N instead", "max_restarts", spec.config.max_restarts)
    if job.rank == 0:
        print(slurm.describe(job, master_ip, socket_env, None), file=sys.stderr, flush=True)
    slurm.host_store(job, master_ip, spec.config.timeout)
    return spec


def check_hostfile_flags(args) -> None:
    """Without --slurm-script, `strata launch` runs from a hostfile, which gives the nodes."""
    if args.hostfile is None:
        raise ConfigError("strata launch: give --hostfile FILE (and run it on every node) or --slurm-script FILE "
                          "(an sbatch script)")
    given = [name for name in ("nodes", "gpus_per_node", "socket_ifname") if getattr(args, name) is not None]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')}: only with --slurm-script (a hostfile gives the nodes)")


def write_script(args, launched, command: list[str], checked_train) -> int:
    """The sbatch script for a training command, every setting checked against the job's world size."""
    if args.hostfile is not None:
        raise ConfigError("--slurm-script: not with --hostfile (Slurm gives the nodes)")
    if args.node_rank is not None or args.dry_run:
        raise ConfigError(f"--{'node-rank' if args.node_rank is not None else 'dry-run'}: only with --hostfile "
                          f"(Slurm gives each node its rank; the script is the dry run)")
    if launched.command != "train":
        raise ConfigError(f"--slurm-script -- {command[0]}: writes a script for train only")
    if args.nodes is None or args.gpus_per_node is None:
        raise ConfigError("--slurm-script: give the job's size, --nodes N --gpus-per-node G")
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError("must be >= 1", name, getattr(args, name))
    if args.socket_ifname is not None:
        slurm.check_interface_name(args.socket_ifname)
    check_output_file(args.slurm_script, "slurm_script")
    cfg = checked_train(launched, args.nodes * args.gpus_per_node, in_a_rank=False).config
    if cfg.nproc != 1:
        raise ConfigError(f"leave it out of the command: each srun task is one rank, and the script starts "
                          f"{args.nodes} x {args.gpus_per_node} of them", "nproc", cfg.nproc)
    with open(args.slurm_script, "w") as f:
        f.write(slurm.sbatch_script(command, args.nodes, args.gpus_per_node, args.socket_ifname))
    print(f"wrote {args.slurm_script}: {args.nodes} node(s) x {args.gpus_per_node} ranks, one srun task each; "
          f"submit it with `sbatch {args.slurm_script}`")
    return 0
