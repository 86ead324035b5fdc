"""strata under Slurm, without Slurm: the tasks srun would start are started here with the variables
srun would give them. One task per rank and one task per node running --nproc ranks both train with
the losses of `strata train --nproc 2`; the node-list expansion, the reading of the job and the
sbatch script are checked on their own."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from netns import needs_netns

from strata.distributed.slurm import (
    expand_nodelist,
    rank_environment,
    read_job,
    sbatch_script,
    socket_environment,
    started_by_srun,
)
from strata.errors import ConfigError

from distributed import free_port
from listeners import host, run_watching

TRAIN = ["train", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "3", "--no-progress",
         "--eval-batches", "1", "--peak-flops", "1e10", "--timeout", "60"]


def _task(rank: int, ntasks: int, nodes: int = 1, nodelist: str = "localhost", **extra) -> dict[str, str]:
    """The variables srun gives task `rank` of a step of `ntasks` tasks, block-distributed over `nodes`."""
    per_node = ntasks // nodes
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks),
            "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node), "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NODELIST": nodelist, **extra}


# --- node lists ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,hosts", [
    ("localhost", ["localhost"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b5,c[07-08]", ["a1", "a2", "b5", "c07", "c08"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),  # no padding: the first number has one digit
    ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),  # several groups: every combination
    ("n[3]", ["n3"]),
    ("10.0.0.[1-2],10.0.1.9", ["10.0.0.1", "10.0.0.2", "10.0.1.9"]),
    ("x-[1-2]-ib", ["x-1-ib", "x-2-ib"]),
])
def test_node_lists_expand_as_slurm_does(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text,needle", [
    ("node[01-", "a '[' is not closed"),
    ("node01-]", "']' without '['"),
    ("n[1-[2]]", "brackets inside brackets"),
    ("a,,b", "an empty name"),
    ("a,", "an empty name"),
    ("", "empty"),
    ("n[]", "is not a number or a range"),
    ("n[a-b]", "'a-b' is not a number or a range"),
    ("n[5-2]", "the range 5-2 runs backwards"),
    ("n[1-2,]", "'' is not a number or a range"),
    ("n[0-999999999]", "expands to more than 100,000 hosts"),
    ("r[0-999]n[0-999]", "expands to more than 100,000 hosts"),
    ("node 1", "'node 1' is not part of a host name"),
    ("n;rm", "is not part of a host name"),
])
def test_a_malformed_node_list_is_one_line_naming_it(text, needle):
    with pytest.raises(ConfigError) as caught:
        expand_nodelist(text)
    assert needle in str(caught.value) and str(caught.value).startswith(f"SLURM_JOB_NODELIST {text!r}: ")


# --- the job ---------------------------------------------------------------------------------------
def test_the_job_is_read_from_slurms_variables():
    job = read_job(_task(5, 8, nodes=2, nodelist="gpu[07-08]"))
    assert (job.rank, job.world, job.local_rank, job.node_rank) == (5, 8, 1, 1)
    assert job.hosts == ("gpu07", "gpu08") and job.port == 15000 + 4242 % 10000
    assert read_job(_task(0, 2, MASTER_PORT="29999")).port == 29999
    # a step on part of the allocation: its own node list
    step = read_job(_task(0, 2, nodes=2, nodelist="n[1-4]", SLURM_STEP_NODELIST="n[3-4]"))
    assert step.hosts == ("n3", "n4")
    assert read_job(_task(0, 2, nodes=2, nodelist="n[1-4]")).hosts == ("n1", "n2")
    env = rank_environment(job, "10.0.0.7")
    assert env == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": str(job.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize("change,needle", [
    ({"SLURM_NTASKS": "two"}, "SLURM_NTASKS 'two': want a whole number >= 1"),
    ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS '0': want a whole number >= 1"),
    ({"SLURM_NTASKS": "\u00b2"}, "SLURM_NTASKS '\u00b2': want a whole number >= 1"),  # a digit, but not 0-9
    ({"SLURM_NTASKS": "9" * 5000}, "want a whole number >= 1"),
    ({"SLURM_PROCID": "2"}, "SLURM_PROCID 2: must be below SLURM_NTASKS 2"),
    ({"SLURM_NODEID": "1"}, "SLURM_NODEID 1: must be below the step's 1 node(s)"),
    ({"SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "n[1-2]"}, "names 2 node(s), fewer than the step's 3"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT '70000': valid 1-65535"),
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID '-1': want a whole number >= 0"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set"),
])
def test_bad_slurm_variables_are_named(change, needle):
    env = {k: v for k, v in {**_task(0, 2), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(needle)):
        read_job(env)


def test_only_the_tasks_of_a_job_step_are_ranks():
    assert started_by_srun(_task(0, 2))
    no_step = {k: v for k, v in _task(0, 2).items() if k != "SLURM_STEP_ID"}  # the batch script, salloc's shell
    assert not started_by_srun(no_step)
    assert not started_by_srun({**_task(0, 2), "LOCAL_RANK": "0"})  # torchrun inside srun: torchrun's rank
    assert not started_by_srun({})


def test_one_node_stays_on_loopback_and_a_hand_set_interface_is_checked():
    one_node = read_job(_task(0, 2))
    assert set(socket_environment(one_node, "127.0.0.1", {"NCCL_SOCKET_IFNAME": "eth9"}).values()) == {"lo"}
    two_nodes = read_job(_task(0, 2, nodes=2, nodelist="127.0.0.1,127.0.0.2"))
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME=eth9, but the route to the master 127.0.0.1 "
                                          "leaves by lo"):
        socket_environment(two_nodes, "127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9"})


# --- the sbatch script ------------------------------------------------------------------------------
def _assigned(script: str) -> set[str]:
    """The shell variables a script sets: statements NAME=... or export NAME=... (comments left out)."""
    return {m.group(1) for m in re.finditer(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", script, re.MULTILINE)}


@pytest.mark.parametrize("interface", [None, "ib0"])
def test_the_sbatch_script_is_valid_bash_and_says_why_for_every_variable(tmp_path, capsys, interface):
    from strata.cli import main
    path = tmp_path / "job.sh"
    flags = ["--socket-ifname", interface] if interface else []
    command = ["train", "--model", "tiny", "--dp", "16", "--metrics", str(tmp_path / "it's metrics.jsonl")]
    assert main(["launch", "--slurm-script", str(path), "--nodes", "2", "--gpus-per-node", "8", *flags,
                 "--", *command]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    script = path.read_text()
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    comments = "\n".join(line for line in script.splitlines() if line.lstrip().startswith("#"))
    assigned = _assigned(script)
    assert {"MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS"} <= assigned
    assert all(re.search(rf"\b{name}\b", comments) for name in assigned), \
        [name for name in assigned if not re.search(rf"\b{name}\b", comments)]
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=8" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert shlex.split(srun)[-len(command):] == command  # quoted for the shell, as given
    assert ("SOCKET_IFNAME=ib0" in script) == bool(interface)


def test_the_script_is_what_sbatch_script_writes():
    script = sbatch_script(["train", "--model", "small"], 4, 2, python="/opt/venv/bin/python")
    assert "srun --kill-on-bad-exit=1 /opt/venv/bin/python -m strata train --model small" in script
    assert "--ntasks-per-node=1 /opt/venv/bin/python -m strata train --model small --nproc 2" in script


# --- training under srun (simulated) ------------------------------------------------------------------
def _losses(path) -> list[float]:
    return [r["loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"]


def _environment(**changes) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and not k.endswith("SOCKET_IFNAME")}
    return {**env, "OMP_NUM_THREADS": "1", **changes}


@pytest.fixture(scope="module")
def nproc_2_losses(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "local.jsonl"
    local = subprocess.run([sys.executable, "-m", "strata", *TRAIN, "--nproc", "2", "--metrics", str(path)],
                           env=_environment(), capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    return _losses(path)


def test_one_task_per_rank_trains_like_nproc_2_and_listens_on_loopback(tmp_path, nproc_2_losses):
    port = str(free_port())
    metrics = str(tmp_path / "slurm.jsonl")
    command = [sys.executable, "-m", "strata", *TRAIN, "--metrics", metrics]
    outputs, seen = run_watching([command, command], [_environment(**_task(r, 2), MASTER_PORT=port) for r in (0, 1)],
                               tmp_path)
    assert _losses(metrics) == pytest.approx(nproc_2_losses, rel=1e-6, abs=0)
    assert "strata: Slurm job 4242: 2 ranks (one task each) on 1 node(s)" in outputs[0]
    assert "Slurm job" not in outputs[1]  # one line, from rank 0
    assert f"127.0.0.1:{port}" in seen[0]  # rank 0 hosts the store, on loopback
    assert all(host(a) == "127.0.0.1" for addresses in seen for a in addresses), seen


def test_one_task_per_node_runs_its_nproc_ranks_like_nproc_2(tmp_path, nproc_2_losses):
    metrics = str(tmp_path / "node.jsonl")
    command = [sys.executable, "-m", "strata", *TRAIN, "--nproc", "2", "--metrics", metrics]
    outputs, seen = run_watching([command], [_environment(**_task(0, 1))], tmp_path)
    assert _losses(metrics) == pytest.approx(nproc_2_losses, rel=1e-6, abs=0)
    assert "1 x 2 ranks (one task per node) on 1 node(s)" in outputs[0]
    assert seen[0] and all(host(a) == "127.0.0.1" for a in seen[0]), seen


@needs_netns
def test_two_nodes_of_a_slurm_job_meet_at_the_first(two_nodes, tmp_path, nproc_2_losses):
    """Two network namespaces as two nodes, one task each: the master is the first node of the
    list, the store listens on its address only, and each node's gloo uses its veth."""
    port = str(free_port())
    master = two_nodes[0][1]
    nodelist = f"{master.rsplit('.', 1)[0]}.[1-2]"  # the two nodes' addresses, .1 and .2, as Slurm lists them
    metrics = [str(tmp_path / f"node{i}.jsonl") for i in (0, 1)]
    commands = [["ip", "netns", "exec", ns, sys.executable, "-m", "strata", *TRAIN, "--metrics", metrics[i]]
                for i, (ns, _, _) in enumerate(two_nodes)]
    envs = [_environment(**_task(i, 2, nodes=2, nodelist=nodelist), MASTER_PORT=port) for i in (0, 1)]
    outputs, seen = run_watching(commands, envs, tmp_path)
    assert _losses(metrics[0]) == pytest.approx(nproc_2_losses, rel=1e-6, abs=0)
    assert f"master {master} ({master}:{port}" in outputs[0] and f"GLOO_SOCKET_IFNAME={two_nodes[0][2]}" in outputs[0]
    assert f"{two_nodes[0][1]}:{port}" in seen[0]
    for (_, ip, _), addresses in zip(two_nodes, seen):
        assert addresses and all(host(a) in (ip, "127.0.0.1") for a in addresses), (ip, addresses)


FAKE_SRUN = """#!/bin/bash
# srun for the test: FAKE_NTASKS tasks of one node, each with the variables srun gives its tasks
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((rank = 0; rank < FAKE_NTASKS; rank++)); do
    SLURM_STEP_ID=0 SLURM_PROCID=$rank SLURM_LOCALID=$rank SLURM_NODEID=0 SLURM_NTASKS=$FAKE_NTASKS \\
        SLURM_NNODES=1 "$@" &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || exit 1; done
"""


def test_the_sbatch_script_runs_its_job(tmp_path, nproc_2_losses):
    """The script itself, run as sbatch would on the first node, with stand-ins for scontrol and srun
    on one node of two GPUs' worth of ranks: it trains as `--nproc 2` does."""
    from strata.cli import main
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$3"\n')  # `scontrol show hostnames LIST`: one node
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    metrics = str(tmp_path / "job.jsonl")
    assert main(["launch", "--slurm-script", str(tmp_path / "job.sh"), "--nodes", "1", "--gpus-per-node", "2",
                 "--", *TRAIN, "--metrics", metrics]) == 0
    env = _environment(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4243", SLURM_JOB_NODELIST="localhost",
                       FAKE_NTASKS="2")
    job = subprocess.run(["bash", str(tmp_path / "job.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    assert "strata: job 4243 on localhost: master localhost (127.0.0.1:19243), interface lo" in job.stdout
    assert _losses(metrics) == pytest.approx(nproc_2_losses, rel=1e-6, abs=0)
