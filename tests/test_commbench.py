"""`strata bench comm`: the table and JSON, and its bus bandwidth against a direct timing of
`dist.all_reduce` in the same processes."""

import json
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from strata.cli import main as strata_main
from strata.tools.commbench import BUS_FACTOR, measure, parse_size, sizes_between

from distributed import run_on_ranks

SIZE = 64 * 2**20


def _bench_and_direct(rounds):
    """Alternate the benchmark and a plain timed dist.all_reduce of 64 MiB; medians of each."""
    bench, direct = [], []
    tensor = torch.ones(SIZE // 4)
    for _ in range(rounds):
        bench.append(measure("all_reduce", SIZE, dist.group.WORLD, "world", iters=3)["busbw"])
        dist.barrier()
        started = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(tensor)
        seconds = torch.tensor([(time.perf_counter() - started) / 3], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        direct.append(SIZE / seconds.item() * BUS_FACTOR["all_reduce"](dist.get_world_size()))
    return statistics.median(bench), statistics.median(direct)


def test_the_64_mib_all_reduce_bus_bandwidth_agrees_with_a_direct_timing():
    bench, direct = run_on_ranks(_bench_and_direct, 2, 9, timeout=300)[0]
    assert bench == pytest.approx(direct, rel=0.10), (bench, direct)


def test_bus_bandwidth_factors_and_sizes():
    assert BUS_FACTOR["all_reduce"](4) == 1.5 and BUS_FACTOR["all_gather"](4) == 0.75
    assert BUS_FACTOR["sendrecv"](8) == BUS_FACTOR["broadcast"](8) == 1
    assert parse_size("64M") == SIZE and parse_size("1K") == 1024 and parse_size("4096") == 4096
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
