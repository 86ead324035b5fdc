"""Which TCP sockets a process tree listens on, read from /proc (Linux): the fds of every process
in the tree name socket inodes, and /proc/net/tcp{,6} gives each listening inode its address."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import struct

TCP_LISTEN = "0A"


def process_tree(root: int) -> list[int]:
    """root and all its descendants (alive now)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def kill_tree(root: int) -> None:
    """SIGKILL root and every descendant (torchrun starts its workers in sessions of their own, so
    killing the launcher's process group leaves them running)."""
    for pid in reversed(process_tree(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_address: str, version: int) -> str:
    ip_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(ip_hex)
    if version == 4:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
    else:  # four little-endian 32-bit words
        words = struct.unpack(">4I", raw)
        ip = socket.inet_ntop(socket.AF_INET6, struct.pack("<4I", *words))
    return f"{ip}:{int(port_hex, 16)}"


def listening_sockets(pid: int | str = "self") -> dict[int, str]:
    """inode -> 'address:port' of every listening TCP socket in the network namespace of `pid`."""
    found = {}
    for path, version in ((f"/proc/{pid}/net/tcp", 4), (f"/proc/{pid}/net/tcp6", 6)):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:  # no IPv6, or the process exited (a poll can race its end)
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == TCP_LISTEN:
                found[int(parts[9])] = _address(parts[1], version)
    return found


def listeners_of_tree(root: int) -> dict[int, list[str]]:
    """pid -> the addresses its listening sockets are bound to, for root's whole process tree."""
    listening = listening_sockets(root)
    out = {}
    for pid in process_tree(root):
        mine = sorted(listening[i] for i in socket_inodes(pid) if i in listening)
        if mine:
            out[pid] = mine
    return out


def host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(host(address)).is_loopback


def run_watching(commands: list[list[str]], envs: list[dict], logs_dir, timeout: float = 300.0
                 ) -> tuple[list[str], list[set[str]]]:
    """Start the commands together, each exiting 0; their output, and every address each one's
    process tree listened on while it ran. A hang fails the test instead of stalling the suite."""
    import subprocess
    import time
    logs = [open(logs_dir / f"task{i}.log", "w+") for i in range(len(commands))]
    jobs = [subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            for command, env, log in zip(commands, envs, logs)]
    seen = [set() for _ in jobs]
    deadline = time.monotonic() + timeout
    while any(job.poll() is None for job in jobs) and time.monotonic() < deadline:
        for i, job in enumerate(jobs):
            seen[i].update(a for addresses in listeners_of_tree(job.pid).values() for a in addresses)
        time.sleep(0.2)
    outputs = []
    for job, log in zip(jobs, logs):
        if job.poll() is None:
            kill_tree(job.pid)
        job.wait(timeout=10)
        log.seek(0)
        outputs.append(log.read())
        assert job.returncode == 0, log.name + "\n" + outputs[-1][-3000:]
    return outputs, seen
