"""Host names are checked by the rules of host names (RFC 1123) before anything resolves them, and
Slurm's variables are checked against each other: the functions on their own. The command lines
that reach them are rows of tests/bad_input_hosts.py."""

import re
import socket

import pytest

from strata.distributed import hostfile
from strata.distributed.hostfile import check_host_name, host_name_problem, parse_hostfile, resolve
from strata.distributed.slurm import expand_nodelist, expand_tasks_per_node, read_job
from strata.errors import ConfigError


@pytest.mark.parametrize("name", [
    "localhost", "node01", "gpu-7", "Node-1.cluster.local", "node1.cluster.", "7node", "a", "x" * 63,
    ".".join(["a" * 63] * 3) + "." + "b" * 61,  # 253 characters
    "10.0.0.7", "255.255.255.255", "0.0.0.0", "::1", "fe80::1%eth0", "2001:db8::42",
])
def test_host_names_and_addresses_pass(name):
    assert host_name_problem(name) is None
    check_host_name(name, "here")


@pytest.mark.parametrize("name,problem", [
    ("", "it is empty"),
    ("a..b", "an empty label (two dots in a row, or a dot first)"),
    (".node", "an empty label"),
    ("node..", "an empty label"),
    ("-node", "the label '-node' starts with '-'"),
    ("node-", "the label 'node-' ends with '-'"),
    ("a.-b.c", "the label '-b' starts with '-'"),
    ("node 1", "' ' is not a letter, a digit, '-', '_' or '.'"),
    ("_node1", "the label '_node1' starts with '_'"),
    ("n\u00f6de", "'\u00f6' is not a letter, a digit, '-', '_' or '.'"),
    ("node\u00b2", "'\u00b2' is not a letter"),  # a digit to str.isdigit, not an ASCII one
    ("a b", "' ' is not a letter"),
    ("a\x00b", "'\\x00' is not a letter"),
    ("[::1]", "'[' is not a letter"),
    ("x" * 64, "has 64 characters, more than 63"),
    (".".join(["a" * 63] * 4) + "b", "256 characters, more than 253"),
    ("10.0.0.256", "its last label is all digits, but it is not an IPv4 address"),
    ("10.1", "its last label is all digits"),  # the resolver would read 10.0.0.1
    ("010.0.0.1", "its last label is all digits"),  # inet_aton would read 8.0.0.1
    ("123", "its last label is all digits"),
])
def test_malformed_names_say_why(name, problem):
    assert problem in host_name_problem(name)
    with pytest.raises(ConfigError) as caught:
        check_host_name(name, "MASTER_ADDR")
    message = str(caught.value)
    assert message.startswith("MASTER_ADDR: ") and problem in message and hostfile.VALID_HOST in message
    assert "\n" not in message


def test_a_very_long_name_is_shortened_in_the_message():
    with pytest.raises(ConfigError) as caught:
        check_host_name("a" * 10_000, "here")
    assert len(str(caught.value)) < 500 and "...'" in str(caught.value)


def test_a_hostfile_names_the_line_of_a_bad_host(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1 slots=2\n# a comment\nnode..2 slots=2\n")
    with pytest.raises(ConfigError, match=re.escape(f"--hostfile {path}: line 3: 'node..2' is not a host name")):
        parse_hostfile(str(path))
    path.write_text("node1 slots=2\n10.0.0.2 slots=2\nnode3.cluster. slots=2\n")
    assert [h.name for h in parse_hostfile(str(path))] == ["node1", "10.0.0.2", "node3.cluster."]


@pytest.mark.parametrize("error", [UnicodeError("encoding with 'idna' codec failed"), socket.gaierror(-2, "unknown"),
                                   OSError("no network")])
def test_whatever_resolution_raises_is_one_line(monkeypatch, error):
    def failing(name):
        raise error
    monkeypatch.setattr(socket, "gethostbyname", failing)
    with pytest.raises(ConfigError, match=r"host 'node1' does not resolve \(.*\); put its IP address"):
        resolve("node1")


def test_resolve_checks_the_name_and_refuses_ipv6(monkeypatch):
    monkeypatch.setattr(socket, "gethostbyname", lambda name: pytest.fail(f"{name!r} reached the resolver"))
    with pytest.raises(ConfigError, match="host: 'a..b' is not a host name"):
        resolve("a..b")
    with pytest.raises(ConfigError, match="host ::1: an IPv6 address"):
        resolve("::1")


# --- Slurm ------------------------------------------------------------------------------------------
def test_a_node_list_is_checked_after_expansion():
    assert expand_nodelist("10.0.0.[254-255],gpu-[1-2].ib") == ["10.0.0.254", "10.0.0.255", "gpu-1.ib", "gpu-2.ib"]
    with pytest.raises(ConfigError, match=re.escape("SLURM_JOB_NODELIST '10.0.0.[255-256]': '10.0.0.256' is not "
                                                    "a host name")):
        expand_nodelist("10.0.0.[255-256]")
    with pytest.raises(ConfigError, match=re.escape("SLURM_STEP_NODELIST 'n[1-2]-': 'n1-' is not a host name: "
                                                    "the label 'n1-' ends with '-'")):
        expand_nodelist("n[1-2]-", "SLURM_STEP_NODELIST")


@pytest.mark.parametrize("text,counts", [
    ("8", [8]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), ("1,3,2(x2)", [1, 3, 2, 2]),
])
def test_tasks_per_node_expand_as_slurm_writes_them(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2,", "x", "2(x)", "2(3)", "0", "2(x0)", "-1", "2 (x3)", "9" * 12])
def test_a_malformed_tasks_per_node_list_is_named(text):
    with pytest.raises(ConfigError, match=re.escape(f"SLURM_TASKS_PER_NODE {text!r}: ")):
        expand_tasks_per_node(text)


def _task(**changes) -> dict[str, str]:
    """Task 0 of a step of 4 tasks on 2 nodes, 3 and 1 (srun -n4 -N2), changed as given."""
    task = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "3,1"}
    return {k: v for k, v in {**task, **changes}.items() if v is not None}


def test_consistent_variables_are_read():
    assert read_job(_task(SLURM_LOCALID="2")).local_rank == 2
    assert read_job(_task(SLURM_PROCID="3", SLURM_NODEID="1")).node_rank == 1
    assert read_job(_task(SLURM_TASKS_PER_NODE=None, SLURM_LOCALID="2")).local_rank == 2  # at most 4 - 1 here
    # srun -E keeps the job's SLURM_NTASKS and SLURM_TASKS_PER_NODE; the step's own variables win
    step = read_job(_task(SLURM_NTASKS="16", SLURM_TASKS_PER_NODE="8(x2)", SLURM_STEP_NUM_TASKS="4",
                          SLURM_STEP_NUM_NODES="2", SLURM_STEP_TASKS_PER_NODE="3,1"))
    assert (step.world, step.nnodes) == (4, 2)


@pytest.mark.parametrize("changes,needle", [
    ({"SLURM_LOCALID": "3"}, "SLURM_LOCALID 3: this node (SLURM_NODEID 0) runs 3 task(s) (SLURM_TASKS_PER_NODE "
                             "'3,1'), so a local rank is 0-2"),
    ({"SLURM_NODEID": "1", "SLURM_LOCALID": "1"}, "runs 1 task(s) (SLURM_TASKS_PER_NODE '3,1'), so a local rank is 0-0"),
    ({"SLURM_TASKS_PER_NODE": None, "SLURM_LOCALID": "4"}, "runs at most 3 task(s) (SLURM_NTASKS 4 on 2 node(s))"),
    ({"SLURM_TASKS_PER_NODE": None, "SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "2"},
     "runs at most 2 task(s) (SLURM_NTASKS_PER_NODE)"),
    ({"SLURM_TASKS_PER_NODE": "3"}, "SLURM_TASKS_PER_NODE '3': gives 1 node(s), but the step has 2"),
    ({"SLURM_TASKS_PER_NODE": "2(x3)"}, "SLURM_TASKS_PER_NODE '2(x3)': gives more than the step's 2 node(s)"),
    ({"SLURM_TASKS_PER_NODE": "2,1"}, "SLURM_TASKS_PER_NODE '2,1': adds up to 3 tasks, but SLURM_NTASKS is 4"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2,2", "SLURM_LOCALID": "2"}, "(SLURM_STEP_TASKS_PER_NODE '2,2')"),
    ({"SLURM_NTASKS": "1"}, "SLURM_NTASKS 1: fewer tasks than the step's 2 node(s)"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "2"}, "SLURM_PROCID 2: must be below SLURM_STEP_NUM_TASKS 2"),
])
def test_contradicting_variables_are_refused_naming_them(changes, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        read_job(_task(**changes))
