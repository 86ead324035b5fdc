"""Two "nodes" on one machine: network namespaces joined by a veth pair (needs root and `ip`), for
the multi-node tests and bench/timing_checks.py."""

import contextlib
import os
import shutil
import subprocess

import pytest


def available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and \
        subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


needs_netns = pytest.mark.skipif(
    not available(), reason="needs root and `ip netns` (network namespaces) to build two nodes on one machine")


def sh(*args) -> None:
    subprocess.run(args, check=True, capture_output=True)


@contextlib.contextmanager
def two_nodes(name: str, subnet: str):
    """[(namespace, address, veth device)] of two nodes at subnet.1 and subnet.2, removed after."""
    tag = f"{os.getpid() % 100000}"
    nodes = [(f"strata-{name}a{tag}", f"{subnet}.1", f"{name}va{tag}"),
             (f"strata-{name}b{tag}", f"{subnet}.2", f"{name}vb{tag}")]
    try:
        for ns, _, _ in nodes:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", nodes[0][2], "type", "veth", "peer", "name", nodes[1][2])
        for ns, ip, dev in nodes:
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for ns, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def shape(nodes, rate: str, burst: str) -> None:
    """Limit both directions of the link with a token bucket (tc tbf); tbf needs a burst of at
    least rate/HZ (about 512 KB at 1 Gbit/s) to reach its rate."""
    for ns, _, dev in nodes:
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
           "burst", burst, "latency", "100ms")
