"""`strata doctor`: find what breaks multi-node training before a job is launched. Each check ends
in `ok` or `FAIL` with one line, and every problem with the one-line fix.

Alone it checks this node: torch and its backends, devices, the rendezvous address; with
`--hostfile`, every host (resolves, not to loopback, reachable) and the socket interface gloo and
NCCL will use. Launched on every node (`strata launch --hostfile H -- doctor --bandwidth --model M
--layout L`) it also measures the bandwidth between the nodes and asks the planner whether the
planned layout can live with it. With `--flight-recorder DIR` it reads a hung job's flight-recorder
dumps and names the collective the job hung in."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.checkpoint.models import resolve_model
from strata.distributed import flight_recorder, hostfile
from strata.distributed.mesh import init_distributed, pick_device
from strata.errors import ConfigError
from strata.plan.cost import estimate
from strata.plan.inputs import TCP_GOODPUT, build_cluster, workload
from strata.plan.report import parse_layout
from strata.tools.commbench import measure

# A planned layout that would spend more than this share of each step communicating fails the check.
SLOW_LINK_SHARE = 0.5


@dataclass(frozen=True)
class DoctorConfig:
    """What `strata doctor` checks, typed (strata/cli/tools.doctor_config builds it from the flags
    and checks them): a hostfile's hosts, a hung job's flight-recorder dumps, and, launched on
    every node, the measured link against a planned job (its model, layout, device and workload)."""
    hostfile: str | None = None
    flight_recorder: str | None = None
    bandwidth: bool = False
    bandwidth_bytes: int = 16 * 2**20
    model: str | None = None
    layout: str | None = None
    device: str = "A100-80G"
    global_batch: int = 8
    seq_len: int | None = None
    precision: str = "bf16"


@dataclass
class Finding:
    status: str  # ok | note (nothing wrong, but know it) | FAIL
    check: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:4} {self.check}: {self.detail}" + (f"; fix: {self.fix}" if self.fix else "")


def check_runtime() -> list[Finding]:
    found = [Finding("ok", "torch", f"{torch.__version__}, gloo {'yes' if dist.is_gloo_available() else 'no'}, "
                                    f"nccl {'yes' if dist.is_nccl_available() else 'no'}")]
    if torch.cuda.is_available():
        memory = [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(torch.cuda.device_count())]
        found.append(Finding("ok", "devices", f"{len(memory)} x {torch.cuda.get_device_name()} "
                                              f"({', '.join(f'{m:.0f}' for m in memory)} GiB)"))
    else:
        found.append(Finding("ok", "devices", f"no CUDA device: cpu + gloo, {len(os.sched_getaffinity(0))} cores"))
    return found


def check_rendezvous() -> list[Finding]:
    addr = os.environ.get("MASTER_ADDR")
    if addr is None:
        return [Finding("ok", "rendezvous", "MASTER_ADDR unset (strata launch and torchrun set it)")]
    hostfile.check_host_name(addr, "MASTER_ADDR")  # a malformed name is the user's input: one line, exit 2
    try:
        ip = str(ipaddress.ip_address(addr)) if ":" in addr else socket.gethostbyname(addr)  # IPv6: as given
    except (OSError, UnicodeError):
        return [Finding("FAIL", "rendezvous", f"MASTER_ADDR {addr} does not resolve", "set it to the master's IP")]
    if hostfile.is_loopback(ip) and int(os.environ.get("WORLD_SIZE", 1)) > int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        return [Finding("FAIL", "rendezvous", f"MASTER_ADDR {addr} is loopback ({ip}) in a multi-node job",
                        "set MASTER_ADDR to the master's IP address")]
    return [Finding("ok", "rendezvous", f"MASTER_ADDR {addr} -> {ip}, port {os.environ.get('MASTER_PORT', '?')}")]


def check_hosts(path: str) -> list[Finding]:
    hosts = hostfile.parse_hostfile(path)
    found = []
    for host in hosts:
        try:
            ip = hostfile.resolve(host.name)
        except ConfigError:
            found.append(Finding("FAIL", f"host {host.name}", "an IPv6 address (the launcher uses IPv4)"
                                 if ":" in host.name else "does not resolve",
                                 f"put its IPv4 address in {path} (line {host.line})"))
            continue
        if hostfile.is_loopback(ip) and len(hosts) > 1:
            found.append(Finding("FAIL", f"host {host.name}", f"resolves to {ip} (loopback): the other nodes cannot "
                                                              f"reach it", f"use its IP address in {path} (line {host.line})"))
            continue
        mine, interface = hostfile.route_interface(ip)
        if mine is None:
            found.append(Finding("FAIL", f"host {host.name}", f"{ip}: no route from this node",
                                 "check the network (ip route) or the address"))
        elif not answers(ip):
            found.append(Finding("FAIL", f"host {host.name}", f"{ip} does not answer (route via {interface})",
                                 "check that the host is up and no firewall drops this node's packets"))
        else:
            found.append(Finding("ok", f"host {host.name}", f"{ip} answers, route via {interface} from {mine}"))
    try:
        master_ip = hostfile.resolve(hosts[0].name)
    except ConfigError:
        return found  # the master's FAIL is above; the checks below need its address
    found.append(check_interface(master_ip, len(hosts) > 1))
    found.append(check_store_exposure(master_ip))
    return found


def check_store_exposure(master_ip: str) -> Finding:
    """The rendezvous store has no authentication: whoever reaches its port can rewrite the job's
    keys, and the launcher unpickles some of them. strata binds it to the master's address only; the
    network that address is on must be private."""
    what = (f"the rendezvous store (on {master_ip}, port --master-port, 29500 by default) is unauthenticated: "
            f"anyone who can connect to it can disrupt the job and run code in its launcher")
    if ipaddress.ip_address(master_ip).is_global:
        return Finding("FAIL", "store", f"{what}, and {master_ip} is a public address",
                       "put the nodes' private-network addresses in the hostfile, or firewall the port to the "
                       "job's nodes")
    return Finding("note", "store", f"{what}; keep the port on a private network")


def answers(ip: str, port: int = 22, timeout: float = 1.5) -> bool:
    """Does the host answer a TCP connection (accepted, or refused: either way it is there)?"""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def check_interface(master_ip: str, multi_node: bool) -> Finding:
    """Which interface gloo/NCCL will use: the variables if set, else what this host's name
    resolves to (gloo's default); it must be the one the route to the master leaves by."""
    mine, interface = hostfile.route_interface(master_ip)
    set_to = {v: os.environ[v] for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if v in os.environ}
    fix = f"export GLOO_SOCKET_IFNAME={interface} NCCL_SOCKET_IFNAME={interface} (strata launch sets them)"
    if interface is None:
        return Finding("FAIL", "socket interface", f"no route to the master {master_ip}", "check the network")
    wrong = {v: name for v, name in set_to.items() if name != interface}
    if wrong:
        return Finding("FAIL", "socket interface", ", ".join(f"{v}={n}" for v, n in wrong.items()) +
                       f", but the route to the master {master_ip} leaves by {interface}", fix)
    if set_to:
        return Finding("ok", "socket interface", f"{interface} ({mine}), as set")
    try:
        default = socket.gethostbyname(socket.gethostname())
    except (OSError, UnicodeError):  # this host's own name may be malformed too
        default = None
    if multi_node and default != mine:
        return Finding("FAIL", "socket interface", f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME are unset: gloo would "
                       f"use {socket.gethostname()} -> {default}, but the route to the master {master_ip} leaves "
                       f"by {interface} ({mine})", fix)
    return Finding("ok", "socket interface", f"{interface} ({mine}): this host's name resolves to it")


def check_clocks(world: int, tolerance_s: float = 1.0) -> Finding:
    """The ranks' wall clocks, read together after a barrier: logs, traces and timeouts compare
    them, so nodes whose clocks disagree by seconds mislead."""
    dist.barrier()
    clocks = torch.zeros(world, dtype=torch.float64)
    clocks[dist.get_rank()] = time.time()
    dist.all_reduce(clocks)
    spread = (clocks.max() - clocks.min()).item()
    if spread > tolerance_s:
        return Finding("FAIL", "clocks", f"the ranks' clocks differ by {spread:.1f} s",
                       "synchronise the nodes' clocks (chrony or systemd-timesyncd)")
    return Finding("ok", "clocks", f"the ranks' clocks agree within {spread * 1e3:.0f} ms")


def check_bandwidth(config: DoctorConfig) -> list[Finding]:
    """On every rank of a launched job: the measured inter-node bus bandwidth, and the planned
    layout's step under it."""
    init_distributed(pick_device("cpu"), 120)
    world = dist.get_world_size()
    nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    found = [check_clocks(world)]
    row = measure("all_reduce", config.bandwidth_bytes, dist.group.WORLD, "world", iters=3)
    busbw = row["busbw"]
    found += [Finding("ok", "bandwidth", f"all-reduce of {row['bytes'] / 2**20:.0f} MiB over {world} ranks on {nodes} "
                                        f"nodes: bus bandwidth {busbw / 1e9:.3f} GB/s")]
    if config.model:
        work = workload(resolve_model(config.model), config.global_batch, config.seq_len, config.precision)
        # the measured bandwidth is what TCP delivered already: hand the planner the line rate it implies
        line_rate = busbw * (world // nodes) / TCP_GOODPUT
        cluster = build_cluster(config.device, nodes, world // nodes, None, str(line_rate / 1e9))
        e = estimate(work, cluster, parse_layout(config.layout or f"dp={world}", work, world))
        comm = sum(e.comm_seconds.values())
        share = comm / (comm + e.compute_s)
        status = "FAIL" if share > SLOW_LINK_SHARE else "ok"
        found.append(Finding(status, "planned layout", f"{e.layout.describe()} of {config.model} on {config.device}: at the "
                             f"measured link, {share:.0%} of each step would be communication "
                             f"({comm:.2f} s against {e.compute_s:.2f} s of compute)",
                             "a faster network, fewer nodes, or a layout that crosses nodes with pipeline stages "
                             "(`strata plan --network ... --explain` shows which)" if status == "FAIL" else ""))
    dist.destroy_process_group()
    return found


def check_flight_recorder(directory: str) -> Finding:
    """The collective a hung job's dumps show it waiting in (strata/distributed/flight_recorder.py)."""
    dumps = flight_recorder.read_dumps(directory)
    read = f"{len(dumps)} dump{'s' if len(dumps) > 1 else ''} (rank{'s' if len(dumps) > 1 else ''} " \
           f"{flight_recorder.rank_list(dumps)})"
    hung_in = flight_recorder.diagnose(dumps)
    if hung_in is None:
        return Finding("ok", "flight recorder", f"{read}: no collective in them waits for a rank")
    return Finding("FAIL", "flight recorder", f"{read}: {hung_in}",
                   "find what the ranks named did instead (their output); `python -m "
                   f"torch.distributed.flight_recorder.fr_trace {directory}` lists the mismatches")


def run(config: DoctorConfig) -> int:
    findings = check_runtime() + check_rendezvous()
    if config.flight_recorder:
        findings.append(check_flight_recorder(config.flight_recorder))
    if config.hostfile:
        findings += check_hosts(config.hostfile)
    if config.bandwidth:
        findings += check_bandwidth(config)
    if int(os.environ.get("RANK", 0)) == 0:
        print("\n".join(f.line() for f in findings), flush=True)
    failed = [f for f in findings if f.status == "FAIL"]
    if failed and int(os.environ.get("RANK", 0)) == 0:
        print(f"strata doctor: {len(failed)} problem{'s' if len(failed) > 1 else ''} found", file=sys.stderr)
    return 1 if failed else 0
