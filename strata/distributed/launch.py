"""Starting ranks through torch.distributed.run (torchrun), the same engine for `--nproc N` on one
machine and for `strata launch` on many.

Nothing of a job listens beyond the address it needs: torchrun's store is bound to one address
(strata/distributed/rendezvous.py) and gloo and NCCL bind the interface named by
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. A local run uses loopback for all of them, so it cannot be
reached from the network at all."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from contextlib import contextmanager

from strata.distributed.hostfile import local_addresses, plan
from strata.distributed.rendezvous import BACKEND, register
from strata.errors import CollectiveError

LOOPBACK = "127.0.0.1"
FAILURE_DIR = "STRATA_FAILURE_DIR"  # where a rank that stops on a failed collective reports it
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_interface() -> str:
    """The name of this machine's loopback interface ('lo' on Linux)."""
    return local_addresses().get(LOOPBACK, "lo")


def run_torchrun(strata_argv: list[str], nproc_per_node: int, *, nnodes: int = 1, node_rank: int = 0,
                 store_address: str = LOOPBACK, store_port: int = 0, max_restarts: int = 0,
                 run_id: str | None = None, env: dict[str, str] | None = None) -> int:
    """Run `strata <strata_argv>` on this node's ranks under torchrun's elastic agent (in this
    process); node 0 hosts the rendezvous store on store_address only. Every node of a job gives the
    same run_id (the store's keys are prefixed with it). When a rank fails, torchrun restarts all of
    them up to max_restarts times (each restart finds its checkpoint through --save). `env` is added
    to the ranks' environment (set here only while they run)."""
    run_id = run_id or uuid.uuid4().hex
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run


    register()
    args = get_args_parser().parse_args([
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
        f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={store_address}:{store_port}",
        f"--rdzv-conf=rank={node_rank}", f"--rdzv-id={run_id}", "--module", "strata"])
    # Set the workers' arguments directly: parsed by torchrun, a strata flag could be taken for an
    # abbreviation of one of torchrun's own.
    args.training_script_args = strata_argv
    with tempfile.TemporaryDirectory(prefix="strata-failures-") as reports, \
            _environment({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # ranks share the cores
                          **(env or {}), FAILURE_DIR: reports}):
        try:
            run(args)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            print(f"strata: error: {_what_failed(reports, rank, failure.exitcode)}", file=sys.stderr)
            return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def report_failure(error: CollectiveError) -> None:
    """In a rank: leave the launcher a note of a failed collective and who never arrived at it."""
    directory = os.environ.get(FAILURE_DIR)
    if directory and os.path.isdir(directory):
        with open(os.path.join(directory, f"rank_{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump({"rank": int(os.environ.get("RANK", 0)), "where": error.where, "missing": error.missing}, f)


def _what_failed(reports: str, first_rank: int, exitcode: int) -> str:
    """The launcher's last line: the rank a collective waited for in vain, when a rank said so
    (the rank that timed out is only the messenger); else the first rank that failed."""
    for name in sorted(os.listdir(reports)):
        with open(os.path.join(reports, name)) as f:
            report = json.load(f)
        if report["missing"]:
            missing = ", ".join(map(str, report["missing"]))
            return (f"rank {missing} did not arrive at {report['where']}; rank {report['rank']} waited for it "
                    f"until the timeout (--timeout); the ranks' output is above")
    return f"rank {first_rank} failed with exit code {exitcode}; its output is above"


def launch_local(nproc: int, strata_argv: list[str], max_restarts: int = 0, env: dict[str, str] | None = None) -> int:
    """N ranks on this machine, every socket of the job on loopback."""
    loopback = {variable: loopback_interface() for variable in SOCKET_IFNAME_VARIABLES}  # gloo's, NCCL's pairs
    return run_torchrun(strata_argv, nproc, max_restarts=max_restarts, env={**loopback, **(env or {})})


@contextmanager
def _environment(changes: dict[str, str]):
    """os.environ with `changes` while the block runs (the ranks inherit it), as it was after."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch_hostfile(path: str, strata_argv: list[str], master_port: int, forced_rank: int | None, dry_run: bool,
                    env: dict[str, str] | None = None) -> int:
    p = plan(path, master_port, forced_rank)
    print(f"strata launch: node {p.node_rank} of {p.nnodes}, master {p.master_addr}:{p.master_port} "
          f"(the rendezvous store listens there only; it is unauthenticated: keep the port on a private network), "
          + (", ".join(f"{k}={v}" for k, v in p.env.items()) or "socket interface as set"), file=sys.stderr, flush=True)
    if dry_run:
        print(" ".join(p.torchrun_argv(strata_argv)))
        return 0
    return run_torchrun(strata_argv, p.nproc_per_node, nnodes=p.nnodes, node_rank=p.node_rank,
                        store_address=p.master_addr, store_port=p.master_port,
                        run_id=f"strata-{p.master_addr}-{p.master_port}", env={**p.env, **(env or {})})
