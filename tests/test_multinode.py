"""Two nodes for real: two network namespaces joined by a veth pair, each running `strata launch
--hostfile` with one rank, train with the losses of a one-node two-process run. The launcher finds
each node's rank from its addresses and sets the socket interface (the veth; without it gloo
would not know which interface to use across namespaces)."""

import json
import os
import subprocess
import sys

import netns
import pytest
from netns import needs_netns

from distributed import free_port
from listeners import host, run_watching

TRAIN = ["train", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "5", "--no-progress",
         "--eval-batches", "1", "--peak-flops", "1e10", "--timeout", "60"]


def _losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"]


@needs_netns
def test_two_nodes_through_strata_launch_train_like_one_node(two_nodes, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{ip} slots=1\n" for _, ip, _ in two_nodes))
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    env["OMP_NUM_THREADS"] = "1"
    port = str(free_port())
    commands = [["ip", "netns", "exec", ns, sys.executable, "-m", "strata", "launch", "--hostfile", str(hostfile),
                 "--master-port", port, "--", *TRAIN, "--metrics", str(tmp_path / f"node{i}.jsonl")]
                for i, (ns, _, _) in enumerate(two_nodes)]
    outputs, seen = run_watching(commands, [env, env], tmp_path)  # seen: each node's listening addresses
    # the store listens on the master's address only; nothing of either node listens on every interface
    assert f"{two_nodes[0][1]}:{port}" in seen[0], seen[0]
    for (_, ip, _), addresses in zip(two_nodes, seen):
        assert addresses and all(host(a) in (ip, "127.0.0.1") for a in addresses), (ip, addresses)
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


# --- strata doctor --------------------------------------------------------------------------------
def _strata_in(ns, *args, env=None):
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "strata", *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=300)


def test_doctor_names_a_loopback_host_with_its_fix(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=1\n10.231.9.9 slots=1\n")
    result = subprocess.run([sys.executable, "-m", "strata", "doctor", "--hostfile", str(tmp_path / "hosts")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "FAIL host localhost: resolves to 127.0.0.1 (loopback)" in result.stdout
    assert "fix: use its IP address in" in result.stdout


@needs_netns
def test_doctor_catches_an_unset_socket_interface_across_namespaces(two_nodes, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{ip} slots=1\n" for _, ip, _ in two_nodes))
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    unset = _strata_in(two_nodes[1][0], "doctor", "--hostfile", hostfile, env=env)
    assert unset.returncode == 1, unset.stdout + unset.stderr
    line = next(x for x in unset.stdout.splitlines() if "socket interface" in x)
    assert line.startswith("FAIL") and "are unset" in line and "fix: export GLOO_SOCKET_IFNAME=svb" in line, line
    fixed = _strata_in(two_nodes[1][0], "doctor", "--hostfile", hostfile,
                       env={**env, "GLOO_SOCKET_IFNAME": line.split("GLOO_SOCKET_IFNAME=")[1].split()[0]})
    assert fixed.returncode == 0, fixed.stdout


@needs_netns
def test_doctor_finds_a_link_too_slow_for_the_planned_layout(two_nodes, tmp_path):
    netns.shape(two_nodes, "10mbit", "32kb")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{ip} slots=1\n" for _, ip, _ in two_nodes))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "strata", "launch", "--hostfile",
                              str(hostfile), "--master-port", str(port), "--", "doctor", "--bandwidth",
                              "--bandwidth-bytes", "1M", "--model", "llama-7b", "--layout", "dp=2,zero=3",
                              "--global-batch", "8", "--seq-len", "2048"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for ns, _, _ in two_nodes]
    out = [job.communicate(timeout=300)[0] for job in jobs][0]
    assert any(x.startswith("ok   clocks: the ranks' clocks agree") for x in out.splitlines()), out
    bandwidth = next(x for x in out.splitlines() if x.startswith("ok   bandwidth"))
    assert "bus bandwidth 0.00" in bandwidth, bandwidth  # about 0.001 GB/s: 10 Mbit/s
    planned = next(x for x in out.splitlines() if "planned layout" in x)
    assert planned.startswith("FAIL") and "of each step would be communication" in planned and "fix:" in planned, out
