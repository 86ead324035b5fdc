"""Training that survives a crash: a rank killed with SIGKILL mid-run is restarted by torchrun and
the job ends with the uninterrupted run's parameters; a collective a rank never joins fails within
the timeout, naming the operation, the group and the missing rank; a non-finite loss or gradient
stops training with one line, before the update, leaving the checkpoints intact."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from strata.checkpoint import shards, store
from strata.cli import main as strata_main
from strata.distributed import comm
from strata.errors import CollectiveError

from distributed import run_on_ranks
from listeners import kill_tree, process_tree

TRAIN = ["train", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "80", "--lr", "3e-3",
         "--eval-batches", "1", "--no-progress", "--peak-flops", "1e10", "--nproc", "2", "--save-every", "5"]


def _strata(*args, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "strata", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def _descendants_with_rank(root: int, rank: int) -> list[int]:
    """Processes under `root` whose environment says RANK=<rank> (torchrun's workers)."""
    found = []
    for pid in process_tree(root)[1:]:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    found.append(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def _final_params(save_dir) -> dict:
    with store.open_checkpoint(str(save_dir))[2] as reader:
        return shards.read_full(reader)


def _records_written_so_far(metrics) -> list[dict]:
    """The complete lines of a metrics file still being written: the last may be cut mid-record."""
    text = metrics.read_text() if metrics.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


def test_a_rank_killed_mid_run_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path):
    straight = _strata(*TRAIN, "--save", tmp_path / "straight")
    kill_at = random.Random().randint(8, 40)
    metrics = tmp_path / "metrics.jsonl"
    job = _strata(*TRAIN, "--save", tmp_path / "killed", "--max-restarts", "1", "--metrics", metrics)
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and time.monotonic() < deadline and job.poll() is None:
        steps = [r.get("step", 0) for r in _records_written_so_far(metrics)]
        if steps and max(steps) >= kill_at:
            victims = _descendants_with_rank(job.pid, 1)
            if victims:
                os.kill(victims[0], signal.SIGKILL)
                killed = max(steps)
        time.sleep(0.005)
    out, _ = job.communicate(timeout=300)
    assert killed is not None, f"the run ended before step {kill_at}:\n{out[-2000:]}"
    assert job.returncode == 0, out[-3000:]
    assert "resuming from" in out, out[-3000:]  # the restarted ranks found the last checkpoint
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    # appended after the restart, the replayed steps once: what the crash logged past the checkpoint is dropped
    assert sorted(r["step"] for r in logged if r["kind"] == "train") == list(range(1, 81))
    straight_out, _ = straight.communicate(timeout=300)
    assert straight.returncode == 0, straight_out[-3000:]
    expected, got = _final_params(tmp_path / "straight"), _final_params(tmp_path / "killed")
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} differs (killed at step {killed})"


def _continue_once_terminated(pids: list[int], stop: threading.Event) -> None:
    """SIGCONT each stopped process in `pids` once a SIGTERM is pending on it."""
    waiting = set(pids)
    while waiting and not stop.wait(0.05):
        for pid in list(waiting):
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except (FileNotFoundError, ProcessLookupError):
                waiting.discard(pid)
                continue
            pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
            if pending & (1 << (signal.SIGTERM - 1)):
                os.kill(pid, signal.SIGCONT)
                waiting.discard(pid)


def test_a_hung_rank_is_named_in_the_last_line(tmp_path):
    """Rank 1 freezes (SIGSTOP) mid-run: rank 0's next collective times out, and the launcher's
    last line names rank 1 as the one that never arrived (rank 0 only waited for it)."""
    metrics = tmp_path / "metrics.jsonl"
    # --timeout also bounds the ranks' start (gloo connects them under it): at 5 s a rank still
    # importing torch on a loaded machine failed the start once ("wait timeout after 5000ms")
    job = _strata(*TRAIN[:-2], "--steps", "1000", "--timeout", "15", "--metrics", metrics, start_new_session=True)
    frozen = []
    deadline = time.monotonic() + 120
    while not frozen and time.monotonic() < deadline and job.poll() is None:
        if len(_records_written_so_far(metrics)) >= 3:
            frozen = _descendants_with_rank(job.pid, 1)
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
        time.sleep(0.05)
    # The launcher gives up on the frozen rank with SIGTERM and would wait torchrun's 30 s before
    # SIGKILL; once the SIGTERM is pending, let it through (the rank dies without running any code).
    stop = threading.Event()
    watcher = threading.Thread(target=_continue_once_terminated, args=(frozen, stop), daemon=True)
    watcher.start()
    try:
        out, _ = job.communicate(timeout=180)
    finally:
        stop.set()
        watcher.join()
        kill_tree(job.pid)
        for pid in frozen:  # orphaned, if the launcher is gone already
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert frozen, out[-2000:]
    last = out.strip().splitlines()[-1]
    assert job.returncode == 1, out[-3000:]
    assert last.startswith("strata: error: rank 1 did not arrive at collective"), out[-3000:]
    assert "rank 0 waited for it" in last, last
    assert "Traceback" not in out, out[-3000:]


def _skip_a_collective(timeout_s):
    """Rank 1 never joins rank 0's second all-reduce (it is busy elsewhere). The group gets the
    timeout explicitly (torch gives a new group 30 minutes): without it rank 0 would only fail when
    rank 1 exits, with "connection closed", not a timeout."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s))
    x = torch.ones(4, device="cpu")
    comm.all_reduce(x, group, "dp")
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        # busy until rank 0 has its answer; polled, not store.wait: a blocking wait would hold the
        # store's client and keep this rank's arrivals thread from posting #1
        while not store.check(["answered"]):
            time.sleep(0.1)
        store.set("read", "1")
        return None
    try:
        comm.all_reduce(x, group, "dp")
    except RuntimeError as e:
        answer = str(e)
    else:
        answer = "no error"
    store.set("answered", "1")
    # rank 0 hosts the store: leaving before rank 1 has read "answered" would end its poll with
    # "connection closed"
    store.wait(["read"], timedelta(seconds=timeout_s + 30))
    return answer


def test_a_rank_that_skips_a_collective_gets_a_timeout_error_naming_it():
    timeout_s = 3
    message = run_on_ranks(_skip_a_collective, 2, timeout_s, collective_timeout=timeout_s, timeout=120)[0]
    assert "collective all_reduce #2 on process group 'dp' (ranks [0, 1])" in message, message
    assert "ranks that did not arrive: 1 (last entered #1 all_reduce)" in message, message
    # the timeout fired, not the peer's exit: gloo's own, or under NCCL's rules the watchdog
    assert "Timed out" in message or "watchdog: no progress for 3 s" in message, message


def _skip_a_receive(timeout_s):
    """Rank 0 sends to rank 1, which never posts the receive (context parallelism's ring and the
    pipeline exchange by point-to-point sends: a failure there names the peer)."""
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.wait(["answered"], timedelta(seconds=timeout_s + 30))
        store.set("read", "1")
        return None
    try:
        comm.send_recv([(torch.ones(4, device="cpu"), 1)], [], None, "cp").wait()
    except CollectiveError as e:
        answer = (str(e), e.missing)
    else:
        answer = ("no error", [])
    store.set("answered", "1")
    store.wait(["read"], timedelta(seconds=timeout_s + 30))
    return answer


def test_a_send_nobody_receives_times_out_naming_the_peer():
    message, missing = run_on_ranks(_skip_a_receive, 2, 3, collective_timeout=3, timeout=120)[0]
    # native: "send on ..."; under NCCL's rules the send's number on its group too: "send #1 on ..."
    assert re.match(r"send( #1)? on process group 'cp' \(with rank 1, which never posted its side\)", message), \
        message
    assert missing == [1]


def test_a_non_finite_gradient_stops_before_the_update_with_one_line(tmp_path, capsys):
    code = strata_main(["train", "--model", "tiny", "--steps", "5", "--lr", "1e30", "--no-progress",
                        "--save", str(tmp_path / "ck"), "--save-every", "1"])
    err = capsys.readouterr().err
    assert code == 1 and "step 2: the gradient norm is nan; stopped before the update" in err, err
    assert "Traceback" not in err
    # the step-1 checkpoint is complete and finite: a rerun with a sane lr resumes from it
    assert store.latest(str(tmp_path / "ck")).endswith("step_000001")
    assert all(torch.isfinite(t).all() for t in _final_params(tmp_path / "ck").values())
