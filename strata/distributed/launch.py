"""Starting ranks through torch.distributed.run (torchrun), the same engine for `--nproc N` on one
machine and for `strata launch` on many.

Nothing of a job listens beyond the address it needs: torchrun's store is bound to one address
(strata/distributed/rendezvous.py) and gloo and NCCL bind the interface named by
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. A local run uses loopback for all of them, so it cannot be
reached from the network at all.

When a rank fails, the last line names why. On gloo a rank that timed out in a collective leaves a
note (`report_failure`) naming the rank that never arrived. On NCCL the watchdog ends the process
without one; the ranks run with PyTorch's flight recorder on (flight_recorder.py), which writes
every rank's last collectives to this job's dump directory on a timeout, and the line is read from
those dumps. The directory is a new temporary one per job (`strata-flight-recorder-...`), removed
after the run unless the run failed and left dumps there: then the line says where it is, and
`strata doctor --flight-recorder DIR` reads it again. A dump location the user set
(TORCH_FR_DUMP_TEMP_FILE) is theirs: nothing is read or removed there."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid
from contextlib import contextmanager

from strata.distributed.flight_recorder import diagnose, nccl_debug_environment, read_dumps
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
    to the ranks' environment (set here only while they run), after the flight recorder's variables
    (`nccl_debug_environment`, those the user has not set)."""
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
    dumps = tempfile.mkdtemp(prefix="strata-flight-recorder-")
    failed = False
    try:
        with tempfile.TemporaryDirectory(prefix="strata-failures-") as reports, \
                _environment({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # ranks share the cores
                              **nccl_debug_environment(dumps), **(env or {}), FAILURE_DIR: reports}):
            try:
                run(args)
            except ChildFailedError as e:
                failed = True
                rank, failure = e.get_first_failure()
                # one node's launcher holds its own ranks' dumps only: the others are not missing
                world_size = nproc_per_node if nnodes == 1 else None
                print(f"strata: error: {_what_failed(reports, rank, failure.exitcode, dumps, world_size)}",
                      file=sys.stderr)
                return failure.exitcode if failure.exitcode > 0 else 1
        return 0
    finally:
        if not (failed and os.listdir(dumps)):
            shutil.rmtree(dumps, ignore_errors=True)


def report_failure(error: CollectiveError) -> None:
    """In a rank: leave the launcher a note of a failed collective and who never arrived at it."""
    directory = os.environ.get(FAILURE_DIR)
    if directory and os.path.isdir(directory):
        with open(os.path.join(directory, f"rank_{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump({"rank": int(os.environ.get("RANK", 0)), "where": error.where, "missing": error.missing}, f)


def _what_failed(reports: str, first_rank: int, exitcode: int, dump_dir: str | None = None,
                 world_size: int | None = None) -> str:
    """The launcher's last line: the rank a collective waited for in vain, when a rank said so
    (the rank that timed out is only the messenger); else, when the ranks left flight-recorder
    dumps in dump_dir (NCCL's watchdog writes them), the collective they show the job hung in;
    else the first rank that failed."""
    for name in sorted(os.listdir(reports)):
        with open(os.path.join(reports, name)) as f:
            report = json.load(f)
        if report["missing"]:
            missing = ", ".join(map(str, report["missing"]))
            return (f"rank {missing} did not arrive at {report['where']}; rank {report['rank']} waited for it "
                    f"until the timeout (--timeout); the ranks' output is above")
    dumps = read_dumps(dump_dir) if dump_dir else {}
    kept = (f"the ranks' flight-recorder dumps are in {dump_dir} (`strata doctor --flight-recorder {dump_dir}` "
            f"reads them)")
    hung_in = diagnose(dumps, world_size) if dumps else None
    if hung_in:
        return f"{hung_in}; {kept}"
    return f"rank {first_rank} failed with exit code {exitcode}; its output is above" + (f"; {kept}" if dumps else "")


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
