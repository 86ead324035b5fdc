"""Bad inputs of issue 51 (hardening, second round), hosts: rows of tests/test_bad_input.py's table,
each (argv, what its one line must say, extra environment or None). A placeholder '{group.name}'
in argv is a path of tests/bad_input_files.py's fixture.

Malformed host names wherever one is read (a hostfile's line, Slurm's node list, MASTER_ADDR) and
Slurm variables that contradict each other. The hostfiles are written here, once, at import."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

HOSTFILES = tempfile.mkdtemp(prefix="strata-bad-hosts-")
atexit.register(shutil.rmtree, HOSTFILES, True)


def _hostfile(name: str, text: str) -> str:
    path = os.path.join(HOSTFILES, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


EMPTY_LABEL = _hostfile("empty_label", "a..b slots=2\n")
SECOND_LINE = _hostfile("second_line", "# the master first\nlocalhost slots=1\nnode-2..ib slots=1\n")
HYPHEN_FIRST = _hostfile("hyphen_first", "-node1 slots=1\n")
SPACE_IN_NAME = _hostfile("odd_character", "nöde1 slots=1\n")
NOT_ASCII = _hostfile("not_ascii", "n\u00f6de1 slots=1\n")
LONG_LABEL = _hostfile("long_label", "x" * 64 + ".cluster slots=1\n")
LONG_NAME = _hostfile("long_name", ".".join(["a" * 60] * 5) + " slots=1\n")
BAD_IPV4 = _hostfile("bad_ipv4", "10.0.0.256 slots=1\n")
OCTAL_IPV4 = _hostfile("octal_ipv4", "010.0.0.1 slots=1\n")
IPV6 = _hostfile("ipv6", "::1 slots=1\n")

VALID = "want an IPv4 or IPv6 address, or a name of dot-separated labels"
# A task srun started: Slurm's variables, set here by hand (one node, two tasks), as in test_bad_input.py.
SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost"}
TWO_NODES = {**SRUN_TASK, "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
TRAIN = ["train", "--model", "tiny", "--steps", "2", "--no-progress"]

CASES: list[tuple[list[str], str, dict | None]] = [
    # --- host names in a hostfile: strata launch and strata doctor read them alike -----------------------
    (["launch", "--hostfile", EMPTY_LABEL, "--", *TRAIN],
     f"--hostfile {EMPTY_LABEL}: line 1: 'a..b' is not a host name: an empty label (two dots in a row", None),
    (["launch", "--hostfile", EMPTY_LABEL, "--", *TRAIN], VALID, None),
    (["doctor", "--hostfile", EMPTY_LABEL], f"--hostfile {EMPTY_LABEL}: line 1: 'a..b' is not a host name", None),
    (["launch", "--hostfile", SECOND_LINE, "--", "doctor"], "line 3: 'node-2..ib' is not a host name", None),
    (["launch", "--hostfile", HYPHEN_FIRST, "--", "doctor"], "the label '-node1' starts with '-'", None),
    (["doctor", "--hostfile", SPACE_IN_NAME], "'nöde1' is not a host name: 'ö' is not a letter, a digit", None),
    (["launch", "--hostfile", NOT_ASCII, "--", "doctor"], "'n\u00f6de1' is not a host name: '\u00f6' is not a letter",
     None),
    (["doctor", "--hostfile", LONG_LABEL], "has 64 characters, more than 63", None),
    (["launch", "--hostfile", LONG_NAME, "--", "doctor"], "304 characters, more than 253", None),
    (["launch", "--hostfile", BAD_IPV4, "--", "doctor"], "'10.0.0.256' is not a host name: its last label is all "
                                                         "digits, but it is not an IPv4 address", None),
    (["doctor", "--hostfile", OCTAL_IPV4], "'010.0.0.1' is not a host name: its last label is all digits", None),
    (["launch", "--hostfile", IPV6, "--", "doctor"], "host ::1: an IPv6 address; strata's launcher and its checks "
                                                     "use IPv4", None),
    # --- host names in Slurm's node list, after expansion ------------------------------------------------
    (TRAIN, "SLURM_JOB_NODELIST 'a..b': 'a..b' is not a host name: an empty label",
     {**SRUN_TASK, "SLURM_JOB_NODELIST": "a..b"}),
    (TRAIN, "SLURM_JOB_NODELIST 'a..b,c': 'a..b' is not a host name",
     {**TWO_NODES, "SLURM_JOB_NODELIST": "a..b,c"}),
    (TRAIN, "SLURM_STEP_NODELIST 'gpu[1-2]-': 'gpu1-' is not a host name: the label 'gpu1-' ends with '-'",
     {**SRUN_TASK, "SLURM_STEP_NODELIST": "gpu[1-2]-"}),
    (TRAIN, "SLURM_JOB_NODELIST '10.0.0.[254-256]': '10.0.0.256' is not a host name",
     {**SRUN_TASK, "SLURM_JOB_NODELIST": "10.0.0.[254-256]"}),
    (TRAIN, "SLURM_JOB_NODELIST 'n![1-2]': 'n!' is not part of a host name",
     {**SRUN_TASK, "SLURM_JOB_NODELIST": "n![1-2]"}),
    # --- MASTER_ADDR, as strata doctor reads it ------------------------------------------------------------
    (["doctor"], f"MASTER_ADDR: 'a..b' is not a host name: an empty label (two dots in a row, or a dot first); {VALID}",
     {"MASTER_ADDR": "a..b"}),
    (["doctor"], "MASTER_ADDR: '' is not a host name: it is empty", {"MASTER_ADDR": ""}),
    (["doctor"], "MASTER_ADDR: 'x\u00e9' is not a host name", {"MASTER_ADDR": "x\u00e9"}),
    # --- Slurm's variables against each other ---------------------------------------------------------
    (TRAIN, "SLURM_LOCALID 7: this node (SLURM_NODEID 0) runs at most 2 task(s) (SLURM_NTASKS 2 on 1 node(s)), "
            "so a local rank is 0-1", {**SRUN_TASK, "SLURM_LOCALID": "7"}),
    (TRAIN, "SLURM_LOCALID 1: this node (SLURM_NODEID 1) runs 1 task(s) (SLURM_TASKS_PER_NODE '3,1')",
     {**TWO_NODES, "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_NODEID": "1", "SLURM_LOCALID": "1",
      "SLURM_TASKS_PER_NODE": "3,1"}),
    (TRAIN, "SLURM_LOCALID 2: this node (SLURM_NODEID 0) runs 2 task(s) (SLURM_STEP_TASKS_PER_NODE '2(x2)')",
     {**TWO_NODES, "SLURM_NTASKS": "4", "SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
      "SLURM_TASKS_PER_NODE": "4(x2)"}),  # the step's list wins over the job's
    (TRAIN, "SLURM_LOCALID 1: this node (SLURM_NODEID 0) runs at most 1 task(s) (SLURM_NTASKS_PER_NODE)",
     {**TWO_NODES, "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "1"}),
    (TRAIN, "SLURM_TASKS_PER_NODE '1(x2)': gives more than the step's 1 node(s)",
     {**SRUN_TASK, "SLURM_TASKS_PER_NODE": "1(x2)"}),
    (TRAIN, "SLURM_TASKS_PER_NODE '2': gives 1 node(s), but the step has 2",
     {**TWO_NODES, "SLURM_TASKS_PER_NODE": "2"}),
    (TRAIN, "SLURM_TASKS_PER_NODE '3': adds up to 3 tasks, but SLURM_NTASKS is 2",
     {**SRUN_TASK, "SLURM_TASKS_PER_NODE": "3"}),
    (TRAIN, "SLURM_TASKS_PER_NODE '2(x)': '2(x)' is not a count N >= 1 or N(xM)",
     {**SRUN_TASK, "SLURM_TASKS_PER_NODE": "2(x)"}),
    (TRAIN, "SLURM_TASKS_PER_NODE '0,2': '0' is not a count N >= 1", {**TWO_NODES, "SLURM_TASKS_PER_NODE": "0,2"}),
    (TRAIN, "SLURM_NTASKS_PER_NODE '0': want a whole number >= 1",
     {**SRUN_TASK, "SLURM_NTASKS_PER_NODE": "0"}),
    (TRAIN, "SLURM_NTASKS 1: fewer tasks than the step's 2 node(s)", {**TWO_NODES, "SLURM_NTASKS": "1"}),
    (TRAIN, "SLURM_PROCID 1: must be below SLURM_STEP_NUM_TASKS 1",
     {**SRUN_TASK, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "1"}),
    (TRAIN, "SLURM_NODEID 2: must be below the step's 2 node(s)", {**TWO_NODES, "SLURM_NODEID": "2"}),
]
