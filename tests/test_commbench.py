"""`strata bench comm`: the table and JSON, the bus-bandwidth factors and sizes (its agreement with
a direct timing of `dist.all_reduce` depends on the machine's load: bench/timing_checks.py)."""

import json
import os
import subprocess
import sys

import pytest

from strata.cli import main as strata_main
from strata.tools.commbench import BUS_FACTOR, parse_size, sizes_between


def test_bus_bandwidth_factors_and_sizes():
    assert BUS_FACTOR["all_reduce"](4) == 1.5 and BUS_FACTOR["all_gather"](4) == 0.75
    assert BUS_FACTOR["sendrecv"](8) == BUS_FACTOR["broadcast"](8) == 1
    assert parse_size("64M") == 64 * 2**20 and parse_size("1K") == 1024 and parse_size("4096") == 4096
    assert sizes_between(1024, 16384, 4) == [1024, 4096, 16384]


def test_the_command_prints_every_operation_as_json():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "strata", "bench", "comm", "--nproc", "2", "--max-bytes", "64K",
                          "--factor", "8", "--iters", "2", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout[out.stdout.index("{"):])["rows"]
    assert {r["op"] for r in rows} == set(BUS_FACTOR)
    assert {r["bytes"] for r in rows} == {1024, 8192, 65536}
    for r in rows:
        assert r["busbw"] == pytest.approx(r["algbw"] * BUS_FACTOR[r["op"]](2))


@pytest.mark.parametrize("args,message", [
    (["--ops", "all_reduce,gossip"], "--ops gossip: valid"),
    (["--max-bytes", "lots"], "is not a size"),
    (["--min-bytes", "1M", "--max-bytes", "1K"], "is above --max-bytes"),
    (["--nproc", "1"], "needs 2 or more ranks"),
    (["--dim", "tp"], "--dim tp: its groups have 1 rank"),
])
def test_bad_input_gets_one_line(args, message, capsys):
    assert strata_main(["bench", "comm", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
