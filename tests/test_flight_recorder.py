"""NCCL failure reports from PyTorch's flight recorder: real dumps of a hang, recorded by gloo on
three ranks (torch 2.13's gloo records collectives into the same ring as NCCL, in the same format)
and written by `flight_recorder.dump()`; the line that names the collective the job hung in; the
launcher's last line read from them; `strata doctor --flight-recorder`; and every bad input to it
as one line."""

import os
import pickle
import shutil
import sys
import time

import pytest
import torch
import torch.distributed as dist

from strata.distributed import flight_recorder, launch
from strata.tools import doctor

from cli_runner import run_strata
from distributed import run_on_ranks

HUNG_IN = "rank 2 did not arrive at collective all_reduce #3 on process group 'pp' (name "


def _skip_an_all_reduce(prefix: str, buffer_size: str):
    """Ranks 1 and 2 form the group 'pp'. After two all-reduces on it, rank 2 is elsewhere when
    rank 1 enters the third (in flight, as on NCCL, where a collective does not block the host).
    Every rank then writes its dump, as NCCL's watchdog makes every rank do on a timeout; only then
    does rank 2 join, so that the ranks finish cleanly without waiting for a timeout."""
    # Set here, not in the test's environment: the ranks are forked from a fork server, which keeps
    # the environment of its own start (the first distributed test's), so a variable the test sets
    # reaches them only when this test happens to start it. torch reads the size when the recorder
    # first records, at this process's first collective (below).
    os.environ["TORCH_FR_BUFFER_SIZE"] = buffer_size
    rank = dist.get_rank()
    pp = dist.new_group([1, 2], group_desc="pp")
    x = torch.ones(4)
    dist.all_reduce(x)
    pending = None
    if rank in (1, 2):
        dist.all_reduce(x, group=pp)
        dist.all_reduce(x, group=pp)
        if rank == 1:
            pending = dist.all_reduce(x, group=pp, async_op=True)
    time.sleep(0.2)  # rank 1's third all-reduce is on its way
    path = flight_recorder.dump(prefix)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"dumped/{rank}", "1")
    store.wait([f"dumped/{r}" for r in range(dist.get_world_size())])
    if rank == 2:
        dist.all_reduce(x, group=pp)
    if pending is not None:
        pending.wait()
    return path


@pytest.fixture(scope="module")
def dumps_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fr") / "dumps"
    results = run_on_ranks(_skip_an_all_reduce, 3, str(directory / "rank_"), "64", timeout=60)
    assert results == [str(directory / f"rank_{r}") for r in range(3)]
    return directory


def test_a_dump_is_the_flight_recorder_with_every_group_named(dumps_dir):
    dumps = flight_recorder.read_dumps(str(dumps_dir))
    assert sorted(dumps) == [0, 1, 2]
    assert dumps[1]["version"] == "2.10"
    entries = dumps[1]["entries"]
    assert [(e["process_group"][1], e["collective_seq_id"], e["profiling_name"]) for e in entries] == [
        ("default_pg", 1, "gloo:all_reduce"), ("pp", 1, "gloo:all_reduce"), ("pp", 2, "gloo:all_reduce"),
        ("pp", 3, "gloo:all_reduce")]
    assert entries[-1]["retired"] is False  # in flight when the dump was written
    pp_name = entries[1]["process_group"][0]
    assert dumps[2]["pg_config"][pp_name] == {"name": pp_name, "desc": "pp", "ranks": "[1, 2]"}
    assert dumps[0]["pg_config"]["0"]["ranks"] == "[0, 1, 2]"
    assert not [name for name in os.listdir(dumps_dir) if name.endswith(".partial")]


def test_the_line_names_the_collective_its_group_and_the_rank_that_never_arrived(dumps_dir):
    dumps = flight_recorder.read_dumps(str(dumps_dir))
    line = flight_recorder.diagnose(dumps, world_size=3)
    assert line.startswith(HUNG_IN), line
    assert line.endswith(", ranks [1, 2]): rank 1 entered it and did not finish; "
                         "rank 2 last entered all_reduce #2 on it"), line
    # a rank that left no dump: the one collective waiting shows, and the rank is named
    del dumps[2]
    line = flight_recorder.diagnose(dumps, world_size=3)
    assert line.startswith("collective all_reduce #3 on process group 'pp' (name "), line
    assert line.endswith("did not finish: rank 1 entered it; no dump from rank 2 (died before it could write one)")
    # rank 0 alone waits for nobody
    assert flight_recorder.diagnose({0: dumps[0]}) is None


def test_the_launcher_names_the_hang_from_the_dumps_when_no_rank_left_a_note(dumps_dir, tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    line = launch._what_failed(str(reports), 0, -6, str(dumps_dir), world_size=3)
    assert line.startswith(HUNG_IN), line
    assert line.endswith(f"; the ranks' flight-recorder dumps are in {dumps_dir} "
                         f"(`strata doctor --flight-recorder {dumps_dir}` reads them)"), line
    empty = tmp_path / "no_dumps"
    empty.mkdir()
    assert launch._what_failed(str(reports), 1, -6, str(empty), 3) == "rank 1 failed with exit code -6; its output is above"
    # a rank's note (gloo's CollectiveError) still comes first
    (reports / "rank_0.json").write_text('{"rank": 0, "where": "collective all_reduce #3 on process group \'pp\'", '
                                         '"missing": [2]}')
    assert launch._what_failed(str(reports), 0, 1, str(dumps_dir), 3).startswith("rank 2 did not arrive at collective "
                                                                                 "all_reduce #3 on process group 'pp';")


def test_run_torchrun_gives_the_ranks_the_variables_and_keeps_the_dumps_of_a_failed_run(dumps_dir, monkeypatch,
                                                                                       capsys):
    """torchrun's run() replaced by one that sees the ranks' environment, leaves the dumps NCCL's
    watchdog would, and fails as torchrun does."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "TORCH_NCCL_ENABLE_MONITORING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's own value
    seen = {}

    def hung(args):
        seen.update(os.environ)
        prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
        for rank in range(3):
            shutil.copy(dumps_dir / f"rank_{rank}", f"{prefix}{rank}")
        raise ChildFailedError("strata", {0: ProcessFailure(0, 1, -6, "/nonexistent")})

    monkeypatch.setattr(torchrun, "run", hung)
    assert launch.run_torchrun(["train"], 3) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"strata: error: {HUNG_IN}"), last
    kept = os.path.dirname(seen["TORCH_FR_DUMP_TEMP_FILE"])
    assert os.path.basename(kept).startswith("strata-flight-recorder-") and f"are in {kept} " in last
    assert sorted(os.listdir(kept)) == ["rank_0", "rank_1", "rank_2"]
    shutil.rmtree(kept)
    assert seen["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == seen["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(kept, "rank_")
    assert seen["TORCH_FR_BUFFER_SIZE"] == str(flight_recorder.BUFFER_SIZE)
    assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and seen["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ  # only while the ranks run

    def finished(args):
        seen["prefix"] = os.environ["TORCH_FR_DUMP_TEMP_FILE"]

    monkeypatch.setattr(torchrun, "run", finished)
    assert launch.run_torchrun(["train"], 3) == 0
    assert not os.path.exists(os.path.dirname(seen["prefix"]))


def test_the_users_settings_win_under_either_name(monkeypatch, tmp_path):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")  # the deprecated name: the user turned it off
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(tmp_path / "mine_"))
    assert flight_recorder.nccl_debug_environment(str(tmp_path / "job")) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert flight_recorder.dump_prefix() == str(tmp_path / "mine_")


def _dump(rank: int, groups: dict, entries: list) -> dict:
    """A dump as ProcessGroupNCCL writes it (torch 2.13's gloo records no send or receive, so the
    point-to-point cases are written by hand, in the same format)."""
    return {"version": "2.10", "pg_status": {}, "entries": entries,
            "pg_config": {name: {"name": name, "desc": desc, "ranks": str(ranks)} for name, (desc, ranks) in groups.items()}}


def _entry(record: int, group: tuple, seq: int, name: str, state: str = "completed", p2p_seq: int = 0) -> dict:
    p2p = " " in name
    return {"record_id": record, "process_group": group, "collective_seq_id": seq, "p2p_seq_id": p2p_seq,
            "profiling_name": f"nccl:{name}", "state": state, "retired": state == "completed", "is_p2p": p2p,
            "time_created_ns": 1000 + record, "input_sizes": [[4]], "timeout_ms": 600000}


PP, TP = ("1", "pp"), ("2", "tp")
GROUPS = {"0": ("default_pg", [0, 1, 2, 3]), "1": ("pp", [0, 2]), "2": ("tp", [0, 1])}


def test_a_send_whose_receive_was_never_posted_names_the_peer():
    dumps = {0: _dump(0, GROUPS, [_entry(0, PP, 1, "all_reduce"), _entry(1, PP, 1, "send 0->1", "scheduled", p2p_seq=1)]),
             2: _dump(2, GROUPS, [_entry(0, PP, 1, "all_reduce")])}
    line = flight_recorder.diagnose(dumps)
    assert line == ("rank 2 did not post its side of rank 0's send #1 (to rank 2) on process group 'pp' "
                    "(name '1', ranks [0, 2]): rank 0 entered it and did not finish; rank 2 last entered "
                    "all_reduce #1 on it"), line
    dumps[2]["entries"].append(_entry(1, PP, 1, "recv 1<-0", "scheduled", p2p_seq=1))
    assert flight_recorder.diagnose(dumps) is None  # both sides posted: nobody is missing


def test_a_rank_missing_because_it_waits_elsewhere_is_not_the_cause():
    """Rank 0 waits in pp #3 for rank 2, which never came; rank 1 waits in tp #5 for rank 0, which
    is stuck in pp: the line names rank 2 in pp, not rank 0 in tp."""
    dumps = {0: _dump(0, GROUPS, [_entry(0, TP, 4, "all_reduce"), _entry(1, PP, 2, "all_gather"),
                                  _entry(2, PP, 3, "all_gather", "scheduled")]),
             1: _dump(1, GROUPS, [_entry(0, TP, 4, "all_reduce"), _entry(1, TP, 5, "all_reduce", "scheduled")]),
             2: _dump(2, GROUPS, [_entry(0, PP, 2, "all_gather")])}
    line = flight_recorder.diagnose(dumps, world_size=4)
    assert line.startswith("rank 2 did not arrive at collective all_gather #3 on process group 'pp' (name '1', "
                           "ranks [0, 2]): rank 0 entered it"), line
    assert line.endswith("; no dump from rank 3 (died before it could write one)"), line


def test_ranks_that_disagree_on_the_operation_are_named():
    dumps = {0: _dump(0, GROUPS, [_entry(0, TP, 7, "all_reduce", "scheduled")]),
             1: _dump(1, GROUPS, [_entry(0, TP, 7, "all_gather", "scheduled")])}
    assert flight_recorder.diagnose(dumps) == (
        "the ranks disagree at collective #7 on process group 'tp' (name '2', ranks [0, 1]): rank 1 in all_gather; "
        "rank 0 in all_reduce (they took different paths through the code)")


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran",))


def test_files_that_are_not_a_whole_dump_are_skipped_and_never_run(dumps_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mixed = tmp_path / "mixed"
    shutil.copytree(dumps_dir, mixed)
    whole = (mixed / "rank_2").read_bytes()
    (mixed / "rank_2").write_bytes(whole[: len(whole) // 2])  # a rank killed while writing it
    (mixed / "rank_3").write_bytes(pickle.dumps({"version": "2.10", "entries": [_RunsCode()]}))
    (mixed / "notes_4").write_text("not a dump\n")
    (mixed / "rank_x").write_bytes(whole)  # no rank in its name
    assert sorted(flight_recorder.read_dumps(str(mixed))) == [0, 1]
    assert not (tmp_path / "ran").exists()
    assert flight_recorder.read_dumps(str(tmp_path / "nonexistent")) == {}


def test_doctor_reads_the_dumps_and_names_the_hang(dumps_dir):
    result = run_strata("doctor", "--flight-recorder", dumps_dir)
    assert result.returncode == 1, result.stderr
    line = next(line for line in result.stdout.splitlines() if "flight recorder" in line)
    assert line.startswith(f"FAIL flight recorder: 3 dumps (ranks 0-2): {HUNG_IN}"), line
    assert "fix: find what the ranks named did instead" in line
    assert result.stderr.strip() == "strata doctor: 1 problem found"


def test_doctor_says_ok_when_no_collective_waits(dumps_dir, tmp_path):
    shutil.copy(dumps_dir / "rank_0", tmp_path / "rank_0")
    assert doctor.check_flight_recorder(str(tmp_path)).line() == (
        "ok   flight recorder: 1 dump (rank 0): no collective in them waits for a rank")


@pytest.mark.parametrize("where,needle", [
    ("nonexistent", "--flight-recorder {dir}/nonexistent: no such directory; want the directory of the ranks' dumps"),
    ("a_file", "--flight-recorder {dir}/a_file: is a file; want the directory of the ranks' dumps"),
    ("foreign", "--flight-recorder {dir}/foreign: no flight-recorder dump in it"),
])
def test_doctor_refuses_a_bad_dump_directory_in_one_line(tmp_path, where, needle):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "rank_0").write_text("not a pickle")
    result = run_strata("doctor", "--flight-recorder", tmp_path / where)
    assert result.returncode == 2, result
    assert result.stderr.strip() == "strata: error: " + needle.format(dir=tmp_path) + (
        " (a dump is a file named <prefix><rank>, e.g. rank_0, written on a timeout with TORCH_FR_BUFFER_SIZE set)"
        if where == "foreign" else ""), result.stderr
    assert result.stdout == ""


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
