"""`strata launch --hostfile FILE`: one command, the same on every node, that starts this node's
share of a multi-node job through torchrun.

The hostfile is DeepSpeed's: one `host slots=N` per line (`#` comments). The first host is the
master. Each node finds its rank by matching the hosts against its own addresses, resolves the
master to an IP (a name that resolves to loopback is an error: the other nodes could not reach it),
and picks the network interface its route to the master leaves by, exporting it as
GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless they are set: the wrong interface is the most
common multi-node failure."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass

from strata.errors import ConfigError

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int


def parse_hostfile(path: str) -> list[Host]:
    if not os.path.isfile(path):
        raise ConfigError(f"--hostfile {path}: no such file")
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"--hostfile {path}: not UTF-8 text; want 'HOST slots=N' lines") from None
    hosts = []
    for number, raw in enumerate(lines, 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        slots = [p for p in parts[1:] if p.startswith("slots=")]
        if len(parts) != 2 or len(slots) != 1 or not slots[0][6:].isdigit() or int(slots[0][6:]) < 1:
            raise ConfigError(f"--hostfile {path}: line {number} {text!r}: want 'HOST slots=N' with N >= 1")
        hosts.append(Host(parts[0], int(slots[0][6:]), number))
    if not hosts:
        raise ConfigError(f"--hostfile {path}: no hosts in it")
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ConfigError(f"--hostfile {path}: a host is listed twice ({sorted(n for n in names if names.count(n) > 1)[0]})")
    if len({h.slots for h in hosts}) != 1:
        raise ConfigError(f"--hostfile {path}: every host needs the same slots (torchrun starts as many ranks on each)")
    return hosts


def resolve(name: str) -> str:
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        raise ConfigError(f"host {name!r} does not resolve ({e}); put its IP address in the hostfile") from None


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def local_addresses() -> dict[str, str]:
    """IPv4 address -> interface name, for every interface of this machine (network namespace)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            found[socket.inet_ntoa(packed[20:24])] = name
    return found


def route_interface(ip: str) -> tuple[str | None, str | None]:
    """(this machine's address, its interface) on the route to `ip`: a UDP socket 'connected' to
    it asks the kernel's routing table, nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
        except OSError:
            return None, None
        mine = s.getsockname()[0]
    return mine, local_addresses().get(mine)


def node_rank(hosts: list[Host], path: str) -> int:
    mine = local_addresses()
    for rank, host in enumerate(hosts):
        if resolve(host.name) in mine and not (len(hosts) > 1 and is_loopback(resolve(host.name))):
            return rank
    raise ConfigError(f"--hostfile {path}: this host ({socket.gethostname()}, addresses "
                      f"{', '.join(sorted(a for a in mine if not is_loopback(a)))}) is not in it; "
                      f"add it, or pass --node-rank")


@dataclass(frozen=True)
class Plan:
    """What this node runs: torchrun's arguments and the environment it adds."""
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    env: dict[str, str]

    def torchrun_argv(self, strata_argv: list[str]) -> list[str]:
        """The torchrun command this node's launch amounts to (strata runs the agent in-process, with
        the rendezvous store bound to master_addr instead of every interface)."""
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}",
                f"--node-rank={self.node_rank}", f"--nproc-per-node={self.nproc_per_node}",
                f"--master-addr={self.master_addr}", f"--master-port={self.master_port}",
                "-m", "strata", *strata_argv]


def plan(path: str, master_port: int, forced_rank: int | None = None) -> Plan:
    hosts = parse_hostfile(path)
    master_ip = resolve(hosts[0].name)
    if len(hosts) > 1:
        for host in hosts:
            ip = resolve(host.name)
            if is_loopback(ip):
                raise ConfigError(f"--hostfile {path}: line {host.line}: {host.name} resolves to {ip} (loopback); "
                                  f"the other nodes cannot reach it: put its IP address in the hostfile")
    rank = forced_rank if forced_rank is not None else node_rank(hosts, path)
    if not 0 <= rank < len(hosts):
        raise ConfigError(f"--node-rank {rank}: valid 0-{len(hosts) - 1} for {len(hosts)} hosts")
    env = {}
    _, interface = route_interface(master_ip)
    if interface is not None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if variable not in os.environ:
                env[variable] = interface
    return Plan(len(hosts), rank, hosts[0].slots, master_ip, master_port, env)
