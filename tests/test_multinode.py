"""Two nodes for real: two network namespaces joined by a veth pair, each running `strata launch
--hostfile` with one rank, train with the losses of a one-node two-process run. The launcher finds
each node's rank from its addresses and sets the socket interface (the veth; without it gloo
would not know which interface to use across namespaces)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from distributed import free_port

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None
    or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0,
    reason="needs root and `ip netns` (network namespaces) to build two nodes on one machine")

TRAIN = ["train", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "5", "--no-progress",
         "--eval-batches", "1", "--peak-flops", "1e10", "--timeout", "60"]


def _sh(*args):
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture
def two_nodes():
    """(namespace, address) of two nodes joined by a veth pair."""
    tag = f"{os.getpid() % 100000}"
    nodes = [(f"strata-a{tag}", "10.231.7.1", f"sva{tag}"), (f"strata-b{tag}", "10.231.7.2", f"svb{tag}")]
    try:
        for ns, _, _ in nodes:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", nodes[0][2], "type", "veth", "peer", "name", nodes[1][2])
        for ns, ip, dev in nodes:
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield [(ns, ip) for ns, ip, _ in nodes]
    finally:
        for ns, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"]


@needs_netns
def test_two_nodes_through_strata_launch_train_like_one_node(two_nodes, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{ip} slots=1\n" for _, ip in two_nodes))
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    env["OMP_NUM_THREADS"] = "1"
    port = str(free_port())
    jobs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "strata", "launch", "--hostfile",
                              str(hostfile), "--master-port", port, "--", *TRAIN, "--metrics",
                              str(tmp_path / f"node{i}.jsonl")],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, (ns, _) in enumerate(two_nodes)]
    outputs = [job.communicate(timeout=300)[0] for job in jobs]
    for job, out in zip(jobs, outputs):
        assert job.returncode == 0, out[-3000:]
    assert "node 0 of 2" in outputs[0] and "node 1 of 2" in outputs[1]
    assert "GLOO_SOCKET_IFNAME=sva" in outputs[0] and "GLOO_SOCKET_IFNAME=svb" in outputs[1]
    local = subprocess.run([sys.executable, "-m", "strata", *TRAIN, "--nproc", "2", "--metrics",
                            str(tmp_path / "local.jsonl")], env=env, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    assert _losses(tmp_path / "node0.jsonl") == pytest.approx(_losses(tmp_path / "local.jsonl"), rel=1e-6, abs=0)


def test_the_hostfile_is_checked(tmp_path, capsys):
    from strata.cli import main as strata_main
    cases = {"localhost slots=1\n10.1.2.3 slots=1\n": "localhost resolves to 127.0.0.1 (loopback)",
             "10.1.2.3 slots=two\n": "want 'HOST slots=N'",
             "10.1.2.3 slots=1\n10.1.2.4 slots=2\n": "every host needs the same slots",
             "10.1.2.3 slots=1\n10.1.2.4 slots=1\n": "this host",
             "# nothing\n": "no hosts in it"}
    for text, message in cases.items():
        (tmp_path / "hosts").write_text(text)
        assert strata_main(["launch", "--hostfile", str(tmp_path / "hosts"), "--dry-run", "--", "train"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (text, err)
    (tmp_path / "hosts").write_text("127.0.0.1 slots=2\n")
    assert strata_main(["launch", "--hostfile", str(tmp_path / "hosts"), "--dry-run", "--", "train"]) == 0
    out = capsys.readouterr().out
    assert "--nnodes=1 --node-rank=0 --nproc-per-node=2 --master-addr=127.0.0.1" in out and out.strip().endswith("train")
