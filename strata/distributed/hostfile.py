"""`strata launch --hostfile FILE`: one command, the same on every node, that starts this node's
share of a multi-node job through torchrun.

The hostfile is DeepSpeed's: one `host slots=N` per line (`#` comments). The first host is the
master. Each node finds its rank by matching the hosts against its own addresses, resolves the
master to an IP (a name that resolves to loopback is an error: the other nodes could not reach it),
and picks the network interface its route to the master leaves by, exporting it as
GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless they are set: the wrong interface is the most
common multi-node failure.

Every host name is checked before it is resolved, wherever it was read (a hostfile's line, Slurm's
node list, MASTER_ADDR): the resolver's own refusal of a malformed name is a UnicodeError from
the idna codec, not an answer."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import socket
import struct
import sys
from dataclasses import dataclass

from strata.errors import ConfigError

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
# RFC 1123 section 2.1 (RFC 952's names, a label may start with a digit): labels of letters, digits
# and '-', neither first nor last, 63 characters at most (RFC 1035 2.3.4), 253 in all; one trailing
# dot (a fully qualified name) is allowed.
# RFC 1123's letters, digits and '-', and '_' inside a label: not a DNS name's, but clusters name
# nodes so (gpu_01), /etc/hosts and Slurm take them, and resolving one raises nothing
HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?")
HOST_NAME = re.compile(rf"{HOST_LABEL.pattern}(\.{HOST_LABEL.pattern})*\.?")
MAX_HOST_NAME = 253
IPV4_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"  # no leading zero: inet_aton reads 010 as octal
IPV4 = re.compile(rf"{IPV4_OCTET}(\.{IPV4_OCTET}){{3}}")
VALID_HOST = ("want an IPv4 or IPv6 address, or a name of dot-separated labels of 1-63 letters, digits, '-' and '_' "
              "(not first or last), 253 characters at most, e.g. node01.cluster or 10.0.0.7")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int


def host_name_problem(name: str) -> str | None:
    """Why `name` is neither an IP address nor a host name by RFC 1123; None when it is one."""
    stripped = name.removesuffix(".")
    if IPV4.fullmatch(name) or (len(stripped) <= MAX_HOST_NAME and HOST_NAME.fullmatch(name)
                                and not stripped.rpartition(".")[2].isdigit()):
        return None  # the common cases, at once (a Slurm node list may name 100,000 hosts)
    try:
        ipaddress.ip_address(name)
        return None
    except ValueError:
        pass
    if not name:
        return "it is empty"
    if len(stripped) > MAX_HOST_NAME:
        return f"{len(stripped)} characters, more than {MAX_HOST_NAME}"
    odd = next((c for c in name if not (c.isascii() and (c.isalnum() or c in "-_."))), None)
    if odd is not None:
        return f"{odd!r} is not a letter, a digit, '-', '_' or '.'"
    labels = stripped.split(".")
    for label in labels:
        if not label:
            return "an empty label (two dots in a row, or a dot first)"
        if len(label) > 63:
            return f"the label {_shown(label)} has {len(label)} characters, more than 63"
        if not HOST_LABEL.fullmatch(label):
            return f"the label {label!r} {'starts' if not label[0].isalnum() else 'ends'} with {label[0] if not label[0].isalnum() else label[-1]!r}"
    if labels[-1].isdigit():  # the resolver reads 10.1 as 10.0.0.1, 010.0.0.1 as 8.0.0.1, 10.0.0.256 as a name
        return "its last label is all digits, but it is not an IPv4 address (four numbers 0-255, no leading zeros)"
    return None


def check_host_name(name: str, where: str) -> None:
    """Refuse a malformed host name in one line naming where it was read (`where`: the file and
    line, or the variable)."""
    problem = host_name_problem(name)
    if problem is not None:
        raise ConfigError(f"{where}: {_shown(name)} is not a host name: {problem}; {VALID_HOST}")


def _shown(text: str, most: int = 60) -> str:
    return repr(text if len(text) <= most else text[:most] + "...")


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
        check_host_name(parts[0], f"--hostfile {path}: line {number}")
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
    """The IPv4 address of a host (its callers checked the name where they read it; checked again
    here, so that nothing reaches the resolver unchecked)."""
    check_host_name(name, "host")
    if ":" in name:
        raise ConfigError(f"host {name}: an IPv6 address; strata's launcher and its checks use IPv4: give the "
                          f"host's IPv4 address, or a name that resolves to one")
    try:
        return socket.gethostbyname(name)
    except (OSError, UnicodeError) as e:
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
