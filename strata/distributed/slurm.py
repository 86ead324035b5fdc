"""`strata train` under Slurm: the job's layout read from the variables srun gives each task, and the
sbatch script `strata launch --slurm-script` writes.

srun starts a job step's tasks, and strata runs either way:
- one task per rank (`srun --ntasks-per-node=G strata train ...`): each task is one rank. strata
  sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from Slurm's variables and joins
  the job as a rank started by torchrun would (env://); rank 0 hosts the rendezvous store.
- one task per node running `--nproc G` ranks (`srun --ntasks-per-node=1 strata train --nproc G`):
  the task runs torchrun's agent for its node, as `strata launch` does (nnodes = SLURM_NNODES,
  node rank = SLURM_NODEID).

The master is the first node of the step's node list, the port MASTER_PORT or one derived from the
job id. Either way the store listens on the master's address only (it is unauthenticated), and a
one-node job keeps the store, gloo and NCCL on loopback, as a local run does. The checks are
`strata doctor`'s: the master must not resolve to loopback in a multi-node job, and socket
interfaces set by hand must be the one the route to the master leaves by."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import sys
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore

from strata.distributed import hostfile
from strata.distributed.launch import LOOPBACK, SOCKET_IFNAME_VARIABLES, loopback_interface, run_torchrun
from strata.distributed.rendezvous import listening_socket
from strata.errors import ConfigError

# srun sets SLURM_STEP_ID in the tasks of a job step. The batch script and an salloc shell carry the
# job's variables too, but no step: a strata started there is one process, not a rank.
STEP_VARIABLES = ("SLURM_STEP_ID", "SLURM_STEPID")
MAX_HOSTS = 100_000  # a node list that expands beyond this is a typo (node[1-1000000]), not a cluster
# The derived port stays below Linux's ephemeral range (32768-60999), where the kernel picks the
# ports of outgoing connections, and two jobs sharing a node get different ports.
DERIVED_PORT_BASE, DERIVED_PORT_SPAN = 15000, 10000
WHOLE_NUMBER = re.compile(r"[0-9]{1,18}")  # ASCII digits only, and no number too long to read
NODE_NAME = re.compile(r"[A-Za-z0-9._-]*")  # the characters of a host name (hostfile.HOST_LABEL); checked whole
INTERFACE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,15}")  # Linux: IFNAMSIZ 16, with the terminating zero


def started_by_srun(environ=os.environ) -> bool:
    """Is this process a task of a job step (and not a rank torchrun started)?"""
    return "LOCAL_RANK" not in environ and "SLURM_PROCID" in environ and any(v in environ for v in STEP_VARIABLES)


# --- node lists ------------------------------------------------------------------------------------
def expand_nodelist(text: str, source: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed host list in full, in order: 'node[01-03,07],gpu5' -> node01, node02,
    node03, node07, gpu5. A name may hold several bracketed groups (all their combinations, as
    Slurm expands them, 'r[1-2]n[1-2]' -> r1n1, r1n2, r2n1, r2n2); a number keeps the zero padding
    of its range's first number. `source` names the variable in errors."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{source} {text!r}: {why}; want Slurm's host list, e.g. node[01-04,07],gpu5")

    if not text:
        raise bad("empty")
    hosts: list[str] = []
    for item in _top_level_items(text, bad):
        hosts += _expand_name(item, bad, MAX_HOSTS - len(hosts))
    for host in hosts:
        hostfile.check_host_name(host, f"{source} {text!r}")
    return hosts


def _top_level_items(text: str, bad) -> list[str]:
    """The comma-separated names of a host list (commas inside brackets separate ranges)."""
    items, start, depth = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise bad("brackets inside brackets")
            depth = 1
        elif char == "]":
            if not depth:
                raise bad(f"']' without '[' at character {i + 1}")
            depth = 0
        elif char == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise bad("a '[' is not closed")
    items.append(text[start:])
    if any(not item for item in items):
        raise bad("an empty name (two commas in a row, or one at an end)")
    return items


def _expand_name(item: str, bad, room: int) -> list[str]:
    """One name with its bracketed groups: the combinations of its pieces, in order."""
    pieces: list[list[str]] = []
    for match in re.finditer(r"([^\[]*)(\[([^\]]*)\])?", item):
        literal, group = match.group(1), match.group(3)
        if not NODE_NAME.fullmatch(literal):
            raise bad(f"{literal!r} is not part of a host name (letters, digits, '.', '-')")
        pieces.append([literal])
        if group is not None:
            pieces.append(_expand_ranges(group, bad))
    count = 1
    for piece in pieces:
        count *= len(piece)
    if count > room:
        raise bad(f"expands to more than {MAX_HOSTS:,} hosts")
    return ["".join(parts) for parts in itertools.product(*pieces)]


def _expand_ranges(group: str, bad) -> list[str]:
    """'01-03,07' -> 01, 02, 03, 07."""
    numbers = []
    for part in group.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise bad(f"[{group}]: {part!r} is not a number or a range N-M")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise bad(f"[{group}]: the range {part} runs backwards")
        if int(last) - int(first) >= MAX_HOSTS:
            raise bad(f"expands to more than {MAX_HOSTS:,} hosts")
        numbers += [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    return numbers


# --- the job ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SlurmJob:
    """This task's place in a job step, as Slurm describes it."""
    job_id: int
    rank: int  # SLURM_PROCID: the task's rank in the step
    world: int  # SLURM_NTASKS
    local_rank: int  # SLURM_LOCALID: the task's rank on its node
    node_rank: int  # SLURM_NODEID
    hosts: tuple[str, ...]  # the step's nodes; the first is the master
    port: int  # MASTER_PORT, or derived from the job id

    @property
    def nnodes(self) -> int:
        return len(self.hosts)


# The step's own variables first: srun --export/-E keeps the job's SLURM_NTASKS, SLURM_NNODES and
# SLURM_TASKS_PER_NODE, while the SLURM_STEP_* ones are always the step's.
WORLD_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
NNODES_VARIABLES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
TASKS_PER_NODE_VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def _which(environ, names: tuple[str, ...]) -> str:
    """The first of `names` that is set (the first name when none is: the one errors mention)."""
    return next((n for n in names if n in environ), names[0])


def _integer(environ, names: tuple[str, ...], minimum: int = 0) -> int:
    """The first of `names` that is set, as a whole number >= minimum."""
    name = next((n for n in names if n in environ), None)
    if name is None:
        raise ConfigError(f"srun started this task ({STEP_VARIABLES[0]} is set), but {names[0]} is not set; "
                          f"run strata train as a task of srun, whose tasks get it")
    value = environ[name]
    if not WHOLE_NUMBER.fullmatch(value) or int(value) < minimum:
        raise ConfigError(f"{name} {value!r}: want a whole number >= {minimum}")
    return int(value)


def read_job(environ=os.environ) -> SlurmJob:
    """The job step this task belongs to, every variable checked alone and against the others (one
    line naming the first bad one): an impossible local rank would pick another task's GPU."""
    job_id = _integer(environ, ("SLURM_JOB_ID", "SLURM_JOBID"))
    rank, world = _integer(environ, ("SLURM_PROCID",)), _integer(environ, WORLD_VARIABLES, 1)
    local_rank, node_rank = _integer(environ, ("SLURM_LOCALID",)), _integer(environ, ("SLURM_NODEID",))
    # the step's nodes (srun may run a step on part of the allocation), else the job's
    source = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if v in environ), None)
    if source is None:
        raise ConfigError(f"srun started this task ({STEP_VARIABLES[0]} is set), but SLURM_JOB_NODELIST is not set; "
                          f"run strata train as a task of srun, whose tasks get it")
    hosts = expand_nodelist(environ[source], source)
    nnodes = _integer(environ, NNODES_VARIABLES, 1) if any(v in environ for v in NNODES_VARIABLES) else len(hosts)
    if nnodes > len(hosts):
        raise ConfigError(f"{source} {environ[source]!r}: names {len(hosts)} node(s), fewer than the step's {nnodes}")
    world_name = _which(environ, WORLD_VARIABLES)
    if rank >= world:
        raise ConfigError(f"SLURM_PROCID {rank}: must be below {world_name} {world}")
    if node_rank >= nnodes:
        raise ConfigError(f"SLURM_NODEID {node_rank}: must be below the step's {nnodes} node(s)")
    if world < nnodes:  # srun runs at least one task on every node of a step
        raise ConfigError(f"{world_name} {world}: fewer tasks than the step's {nnodes} node(s); "
                          f"srun runs one or more on each")
    tasks_here, why = _tasks_on_node(environ, node_rank, nnodes, world, world_name)
    if local_rank >= tasks_here:
        raise ConfigError(f"SLURM_LOCALID {local_rank}: this node (SLURM_NODEID {node_rank}) runs "
                          f"{why}, so a local rank is 0-{tasks_here - 1}; Slurm's variables disagree "
                          f"(set by hand?)")
    return SlurmJob(job_id, rank, world, local_rank, node_rank, tuple(hosts[:nnodes]), _port(environ, job_id))


def _tasks_on_node(environ, node_rank: int, nnodes: int, world: int, world_name: str) -> tuple[int, str]:
    """How many of the step's tasks run on node `node_rank`, and how that is known: Slurm's
    tasks-per-node list (checked against the step's nodes and tasks), else --ntasks-per-node's
    SLURM_NTASKS_PER_NODE, else the most a node can hold when every other node runs one task."""
    name = next((v for v in TASKS_PER_NODE_VARIABLES if v in environ), None)
    if name is not None:
        per_node = expand_tasks_per_node(environ[name], name, nnodes)
        if len(per_node) != nnodes:
            raise ConfigError(f"{name} {environ[name]!r}: gives {len(per_node)} node(s), but the step has {nnodes}")
        if sum(per_node) != world:
            raise ConfigError(f"{name} {environ[name]!r}: adds up to {sum(per_node)} tasks, but {world_name} "
                              f"is {world}")
        return per_node[node_rank], f"{per_node[node_rank]} task(s) ({name} {environ[name]!r})"
    if "SLURM_NTASKS_PER_NODE" in environ:
        most = _integer(environ, ("SLURM_NTASKS_PER_NODE",), 1)
        return most, f"at most {most} task(s) (SLURM_NTASKS_PER_NODE)"
    most = world - (nnodes - 1)
    return most, f"at most {most} task(s) ({world_name} {world} on {nnodes} node(s))"


def expand_tasks_per_node(text: str, source: str = "SLURM_TASKS_PER_NODE", most: int = MAX_HOSTS) -> list[int]:
    """Slurm's compressed tasks-per-node list in full, one count per node: '2(x3),1' -> 2, 2, 2, 1."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"([0-9]{1,9})(?:\(x([0-9]{1,9})\))?", part)
        if not match or int(match.group(1)) < 1 or (match.group(2) is not None and int(match.group(2)) < 1):
            raise ConfigError(f"{source} {text!r}: {part!r} is not a count N >= 1 or N(xM); want Slurm's "
                              f"tasks-per-node list, e.g. 2(x3),1")
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > most:
            raise ConfigError(f"{source} {text!r}: gives more than the step's {most} node(s)")
        counts += [int(match.group(1))] * repeat
    return counts


def _port(environ, job_id: int) -> int:
    if "MASTER_PORT" in environ:
        value = environ["MASTER_PORT"]
        if not WHOLE_NUMBER.fullmatch(value) or not 1 <= int(value) <= 65535:
            raise ConfigError(f"MASTER_PORT {value!r}: valid 1-65535")
        return int(value)
    return DERIVED_PORT_BASE + job_id % DERIVED_PORT_SPAN


def master_address(job: SlurmJob) -> str:
    """Where the rendezvous store listens: loopback for a one-node job (nothing of it needs the
    network); else the first node's address, which must not be loopback (`strata doctor`'s check)."""
    if job.nnodes == 1:
        return LOOPBACK
    master = job.hosts[0]
    try:
        ip = hostfile.resolve(master)
    except ConfigError:
        raise ConfigError(f"the master node {master} (the first of the step's nodes) does not resolve; "
                          f"check DNS or /etc/hosts on this node") from None
    if hostfile.is_loopback(ip):
        raise ConfigError(f"the master node {master} resolves to {ip} (loopback) on this node, so the other nodes "
                          f"cannot reach it; fix its entry in /etc/hosts or DNS")
    return ip


def socket_environment(job: SlurmJob, master_ip: str, environ=os.environ) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for this node: loopback for a one-node job, else
    the interface the route to the master leaves by (as `strata launch` sets them). Ones set by hand
    are kept when they name that interface and refused, as `strata doctor` does, when not."""
    if job.nnodes == 1:
        return {variable: loopback_interface() for variable in SOCKET_IFNAME_VARIABLES}
    _, interface = hostfile.route_interface(master_ip)
    if interface is None:
        raise ConfigError(f"no route from this node to the master {job.hosts[0]} ({master_ip}); check the network")
    wrong = {v: environ[v] for v in SOCKET_IFNAME_VARIABLES if v in environ and environ[v] != interface}
    if wrong:
        raise ConfigError(", ".join(f"{v}={name}" for v, name in wrong.items()) +
                          f", but the route to the master {master_ip} leaves by {interface}; fix: export "
                          f"GLOO_SOCKET_IFNAME={interface} NCCL_SOCKET_IFNAME={interface}, or unset them")
    return {v: interface for v in SOCKET_IFNAME_VARIABLES if v not in environ}


def check_tasks(job: SlurmJob, nproc: int) -> None:
    """--nproc G starts G ranks per node, so it wants one task per node; else each task is a rank."""
    if nproc > 1 and job.world != job.nnodes:
        raise ConfigError(f"starts {nproc} ranks on each node, so srun must run one task per node "
                          f"(srun --ntasks-per-node=1); this step has {job.world} tasks on {job.nnodes} node(s). "
                          f"Or leave --nproc out: each task is then one rank", "nproc", nproc)


def describe(job: SlurmJob, master_ip: str, socket_env: dict[str, str], per_node: int | None) -> str:
    """One line on stderr: where this job meets, and what it sets."""
    ranks = f"{job.nnodes} x {per_node} ranks (one task per node)" if per_node else f"{job.world} ranks (one task each)"
    where = (f"the rendezvous on {master_ip} (one node: loopback only)" if job.nnodes == 1 else
             f"master {job.hosts[0]} ({master_ip}:{job.port}; the rendezvous store listens there only; it is "
             f"unauthenticated: keep the port on a private network)")
    interfaces = ", ".join(f"{k}={v}" for k, v in socket_env.items()) or "socket interface as set"
    return f"strata: Slurm job {job.job_id}: {ranks} on {job.nnodes} node(s), {where}, {interfaces}"


# --- one task per rank ---------------------------------------------------------------------------------
def rank_environment(job: SlurmJob, master_ip: str) -> dict[str, str]:
    """What torchrun would give this rank, from Slurm's variables. Every rank's env:// rendezvous
    connects to the store rank 0 hosts (host_store) as a client: torch's own env:// would have rank 0
    listen on every interface."""
    env = {"RANK": str(job.rank), "WORLD_SIZE": str(job.world), "LOCAL_RANK": str(job.local_rank),
           "MASTER_ADDR": master_ip, "MASTER_PORT": str(job.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if job.world % job.nnodes == 0:  # block distribution: the same tasks on every node
        env["LOCAL_WORLD_SIZE"] = str(job.world // job.nnodes)
    return env


_HOSTED = []  # rank 0's store lives as long as the process: every rank's connection goes through it


def host_store(job: SlurmJob, master_ip: str, timeout_s: float) -> None:
    """On rank 0: the rendezvous store, listening on the master's address only."""
    if job.rank != 0:
        return
    if job.node_rank != 0:
        raise ConfigError(f"SLURM_PROCID 0 runs on node {job.node_rank} (SLURM_NODEID), but the rendezvous is on the "
                          f"first node of the list, {job.hosts[0]}; use srun's default block distribution")
    try:
        sock = listening_socket(master_ip, job.port)
    except OSError as e:
        raise ConfigError(f"MASTER_PORT {job.port}: cannot listen on {master_ip}:{job.port} ({e.strerror}); "
                          f"set MASTER_PORT to a free port") from None
    _HOSTED.append(TCPStore(master_ip, job.port, job.world, True, timedelta(seconds=timeout_s), multi_tenant=True,
                            master_listen_fd=sock.detach()))


# --- one task per node -------------------------------------------------------------------------------
def launch_node(job: SlurmJob, nproc: int, strata_argv: list[str], master_ip: str, socket_env: dict[str, str],
                max_restarts: int = 0, env: dict[str, str] | None = None) -> int:
    """This node's `nproc` ranks under torchrun's agent; node 0's agent hosts the store on the
    master's address (a one-node job: loopback, on any free port)."""
    return run_torchrun(strata_argv, nproc, nnodes=job.nnodes, node_rank=job.node_rank, store_address=master_ip,
                        store_port=job.port if job.nnodes > 1 else 0, max_restarts=max_restarts,
                        run_id=f"strata-slurm-{job.job_id}", env={**socket_env, **(env or {})})


# --- the sbatch script ---------------------------------------------------------------------------------
def check_interface_name(name: str) -> None:
    if not INTERFACE_NAME.fullmatch(name):
        raise ConfigError("not a network interface name (up to 15 letters, digits, '_', '.', ':', '-')",
                          "socket_ifname", name)


def sbatch_script(strata_argv: list[str], nodes: int, gpus_per_node: int, socket_ifname: str | None = None,
                  python: str = sys.executable) -> str:
    """An sbatch script that runs `strata <strata_argv>` on `nodes` x `gpus_per_node` ranks, one
    srun task per rank. Every variable it sets is named in a comment saying why."""
    command = f"{shlex.quote(python)} -m strata {shlex.join(strata_argv)}"
    find_interface = (f"SOCKET_IFNAME={shlex.quote(socket_ifname)}" if socket_ifname else
                      "SOCKET_IFNAME=$(ip -o -4 addr show | awk -v ip=\"$MASTER_IP\" "
                      "'{split($4, a, \"/\")} a[1] == ip && !found {print $2; found = 1}')")
    return f"""#!/bin/bash
# A strata training job, written by `strata launch --slurm-script`; submit it with `sbatch FILE`.
# srun starts one task per GPU, and each task is one rank: strata reads its place in the job from
# Slurm's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_JOB_NODELIST).
# Every task sees all of its node's GPUs and takes the one of its local rank (no --gpus-per-task).
#SBATCH --job-name=strata
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={gpus_per_node}
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --output=strata-%j.out

set -euo pipefail

# MASTER_NODE: the first node of the allocation, where this script runs; rank 0 hosts the
# rendezvous store there, as strata finds by itself. MASTER_IP: that node's address (empty when it
# does not resolve: strata then says so on every node). awk reads to the end, so that no command of
# a pipe dies of a closed pipe, which `set -o pipefail` would take for a failure.
MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')
MASTER_IP=$(getent ahostsv4 "$MASTER_NODE" | awk 'NR == 1 {{print $1}}' || true)

# MASTER_PORT: the store's port, derived from the job id (strata derives the same one when it is
# unset), so that two jobs sharing a node do not collide. The store is unauthenticated: whoever
# reaches the port can disrupt the job; keep it on a private network.
export MASTER_PORT=$(({DERIVED_PORT_BASE} + SLURM_JOB_ID % {DERIVED_PORT_SPAN}))

# GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: the network interface gloo and NCCL open their sockets
# on. Unset, gloo takes the interface this host's name resolves to and NCCL the first one that is
# up, often a management or container network the other nodes cannot reach: the job then hangs at
# its first collective. SOCKET_IFNAME: the interface holding the master's address here (or the one
# --socket-ifname gave); the nodes are assumed to name it alike, and strata checks on every node
# that its route to the master leaves by it (one line and exit code 2 when not). Left empty, each
# node's strata picks the interface of its own route to the master.
{find_interface}
if [ -n "$SOCKET_IFNAME" ]; then
    export GLOO_SOCKET_IFNAME="$SOCKET_IFNAME"
    export NCCL_SOCKET_IFNAME="$SOCKET_IFNAME"
fi

# OMP_NUM_THREADS: CPU threads per rank. The ranks of a node share its cores, as under torchrun.
export OMP_NUM_THREADS=1

echo "strata: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: master $MASTER_NODE ($MASTER_IP:$MASTER_PORT), interface ${{SOCKET_IFNAME:-per node}}"

# --kill-on-bad-exit: when one rank fails, srun stops the others at once instead of leaving them
# waiting for it until their collective timeout.
srun --kill-on-bad-exit=1 {command}

# Or one task per node, each running torchrun's agent with {gpus_per_node} ranks (what --max-restarts needs):
# srun --kill-on-bad-exit=1 --ntasks-per-node=1 {command} --nproc {gpus_per_node}
"""
