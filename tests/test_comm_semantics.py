"""NCCL's rules on gloo (`comm_semantics = nccl`, strata/distributed/rehearsal.py): each rule has a
case that NCCL would hang or refuse and gloo lets through. Under the mode the case fails as on a
GPU, reported within the timeout; with that one rule switched off (comm.configure's `rules`) it
passes as gloo lets it, so each test fails without its rule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from strata.distributed import comm, rehearsal
from strata.errors import CollectiveError

from distributed import run_on_ranks

TIMEOUT_S = 3.0  # each group's collective timeout: what the watchdog enforces


def _configure(semantics: str, without: str | None):
    comm.configure(semantics, torch.device("cpu"), tuple(r for r in comm.RULES if r != without))


def _outcome(fn):
    """What a case ended in on this rank: its value, or the first line of the failure."""
    try:
        return "ok", fn()
    except CollectiveError as e:
        return "failed", str(e)
    finally:
        comm.close_streams()


# --- one stream per group, and sends that wait for their receive ----------------------------------------
def _crossed_blocking_sends(semantics, without):
    """Each rank sends to the other, then receives: fine where a send can complete before its
    receive is posted or while the receive waits beside it; on NCCL each send waits for a receive
    queued behind it on the same stream."""
    _configure(semantics, without)
    peer = 1 - dist.get_rank()

    def case():
        sent = comm.send_recv([(torch.full((4,), float(dist.get_rank()), device="cpu"), peer)], [], None, "world")
        got = torch.empty(4, device="cpu")
        received = comm.send_recv([], [(got, peer)], None, "world")
        received.wait()
        sent.wait()
        return got.tolist()
    return _outcome(case)


def test_crossed_blocking_sends_hang_on_one_stream_and_the_watchdog_reports_them_within_the_timeout():
    ranks = run_on_ranks(_crossed_blocking_sends, 2, "nccl", None, collective_timeout=TIMEOUT_S, timeout=60)
    for rank, (status, text) in enumerate(ranks):
        assert status == "failed", text
        assert "send #1 on process group 'world'" in text and f"with rank {1 - rank}" in text
        assert "watchdog" in text and "--timeout" in text
    # without the rule (each operation as gloo runs it) the same code completes
    ranks = run_on_ranks(_crossed_blocking_sends, 2, "nccl", "streams", collective_timeout=TIMEOUT_S, timeout=60)
    assert ranks == [("ok", [1.0] * 4), ("ok", [0.0] * 4)]


# --- a batched point-to-point call is one operation -------------------------------------------------------
def _exchange_in_one_batch(semantics, without):
    _configure(semantics, without)
    peer = 1 - dist.get_rank()

    def case():
        got = torch.empty(4, device="cpu")
        handle = comm.send_recv([(torch.full((4,), float(dist.get_rank()), device="cpu"), peer)], [(got, peer)],
                                None, "world")
        handle.wait()  # one handle: the send and the receive both done
        return got.tolist()
    return _outcome(case)


def test_a_batched_send_and_receive_is_one_operation_with_one_handle():
    ranks = run_on_ranks(_exchange_in_one_batch, 2, "nccl", None, collective_timeout=TIMEOUT_S, timeout=60)
    assert ranks == [("ok", [1.0] * 4), ("ok", [0.0] * 4)]
    # run as two operations in order, the batch is the crossed sends above: it hangs
    ranks = run_on_ranks(_exchange_in_one_batch, 2, "nccl", "batches", collective_timeout=TIMEOUT_S, timeout=60)
    assert all(status == "failed" and "send_recv #1" in text for status, text in ranks), ranks


# --- tags are ignored -----------------------------------------------------------------------------------
def _tagged(semantics, without):
    """Rank 0 sends A (tag 1), then B (tag 2); rank 1 posts a receive for tag 2 first. gloo matches
    by tag; NCCL has no tags and matches in order."""
    _configure(semantics, without)

    def case():
        if dist.get_rank() == 0:
            a = comm.send_recv([(torch.full((2,), 1.0, device="cpu"), 1, 1)], [], None, "world")
            b = comm.send_recv([(torch.full((2,), 2.0, device="cpu"), 1, 2)], [], None, "world")
            a.wait()
            b.wait()
            return None
        first, second = torch.empty(2, device="cpu"), torch.empty(2, device="cpu")
        for buffer, tag in ((first, 2), (second, 1)):
            comm.send_recv([], [(buffer, 0, tag)], None, "world").wait()
        return first.tolist(), second.tolist()
    return _outcome(case)


def test_tags_are_ignored_and_a_pairs_messages_match_in_order():
    _, (status, got) = run_on_ranks(_tagged, 2, "nccl", None, collective_timeout=TIMEOUT_S, timeout=60)
    assert (status, got) == ("ok", ([1.0, 1.0], [2.0, 2.0]))  # in order: A into the first receive
    _, (status, got) = run_on_ranks(_tagged, 2, "native", None, collective_timeout=TIMEOUT_S, timeout=60)
    assert (status, got) == ("ok", ([2.0, 2.0], [1.0, 1.0]))  # gloo matched by tag
    # with tags kept but one stream per group, the send of tag 1 waits for a receive queued behind
    # the one for tag 2: NCCL's ordering and gloo's matching together hang
    ranks = run_on_ranks(_tagged, 2, "nccl", "no_tags", collective_timeout=TIMEOUT_S, timeout=60)
    assert all(status == "failed" for status, _ in ranks), ranks


# --- device tensors only ----------------------------------------------------------------------------------
def _host_tensor(semantics, without, made):
    _configure(semantics, without)

    def case():
        if made == "host":
            t = torch.tensor([float(dist.get_rank())])  # no device: host memory on a GPU machine
        elif made == "strided":
            t = torch.zeros(4, 2, device="cpu").t()
        else:
            t = torch.tensor([float(dist.get_rank())], device="cpu")
        comm.all_reduce(t, None, "world")
        return t.tolist()
    try:
        return _outcome(case)
    finally:
        rehearsal.host_tensors.uninstall()


@pytest.mark.parametrize("made,words", [("host", "a tensor made on the host"), ("strided", "non-contiguous")])
def test_a_host_or_strided_tensor_on_a_device_group_is_refused_naming_the_op(made, words):
    ranks = run_on_ranks(_host_tensor, 2, "nccl", None, made, collective_timeout=TIMEOUT_S, timeout=60)
    for status, text in ranks:
        assert status == "failed" and text.startswith("all_reduce on process group 'world'") and words in text
    ranks = run_on_ranks(_host_tensor, 2, "nccl", "device_tensors", made, collective_timeout=TIMEOUT_S, timeout=60)
    assert [status for status, _ in ranks] == ["ok", "ok"]
    ranks = run_on_ranks(_host_tensor, 2, "nccl", None, "device", collective_timeout=TIMEOUT_S, timeout=60)
    assert ranks == [("ok", [1.0]), ("ok", [1.0])]


# --- waits do not time out; the watchdog names the operation that hung ----------------------------------
def _queued_behind_a_hang(semantics, without):
    """Rank 1 never enters all-reduce #1; rank 0 waits for #2, queued behind it on the same stream."""
    _configure(semantics, without)

    def case():
        if dist.get_rank() == 1:
            import time
            time.sleep(3 * TIMEOUT_S)
            return None
        first = comm.all_reduce(torch.ones(2, device="cpu"), None, "world", async_op=True)
        second = comm.all_reduce(torch.ones(2, device="cpu"), None, "world", async_op=True)
        second.wait()
        first.wait()
    return _outcome(case)


def test_the_watchdog_names_the_operation_that_hung_not_the_one_waited_for():
    status, text = run_on_ranks(_queued_behind_a_hang, 2, "nccl", None, collective_timeout=TIMEOUT_S, timeout=60)[0]
    assert status == "failed" and "collective all_reduce #1 on process group 'world'" in text, text
    assert "1 (entered none)" in text and "watchdog" in text
    # without the watchdog gloo's own timeout ends #1 unseen, #2 runs and hangs, and #2 is blamed
    status, text = run_on_ranks(_queued_behind_a_hang, 2, "nccl", "watchdog", collective_timeout=TIMEOUT_S,
                                timeout=60)[0]
    assert status == "failed" and "all_reduce #1" not in text, text


# --- the watchdog writes the flight recorder's dump, and has every other rank write its own ------------
def _hang_with_dumps(directory):
    import os
    import time
    os.environ.update(TORCH_FR_BUFFER_SIZE="100", TORCH_NCCL_DUMP_ON_TIMEOUT="1",
                      TORCH_FR_DUMP_TEMP_FILE=os.path.join(directory, "rank_"))
    _configure("nccl", None)
    comm.all_reduce(torch.ones(2, device="cpu"), None, "world")  # both ranks' streams (and watchdogs) run
    if dist.get_rank() == 1:  # never enters all-reduce #2: waits until rank 0 has reported
        dist.distributed_c10d._get_default_store().wait(["reported"], __import__("datetime").timedelta(seconds=60))
        # its watchdog polls the store for the dump signal once a second; a loaded machine may be slower,
        # so wait for the file itself (bounded) instead of a fixed time
        deadline = time.monotonic() + 30
        while "rank_1" not in os.listdir(directory) and time.monotonic() < deadline:
            time.sleep(rehearsal.Watchdog.CHECK_EVERY_S)
        return sorted(os.listdir(directory))
    result = _outcome(lambda: comm.all_reduce(torch.ones(2, device="cpu"), None, "world"))
    time.sleep(2.5)  # the signal reaches rank 1's watchdog within about a second
    dist.distributed_c10d._get_default_store().set("reported", "1")
    return result


def test_the_watchdog_dumps_the_flight_record_and_every_rank_writes_its_own(tmp_path):
    from strata.distributed import flight_recorder
    (status, text), files = run_on_ranks(_hang_with_dumps, 2, str(tmp_path), collective_timeout=TIMEOUT_S,
                                         timeout=90)
    assert status == "failed" and "all_reduce #2" in text
    assert files == ["rank_0", "rank_1"]
    line = flight_recorder.diagnose(flight_recorder.read_dumps(str(tmp_path)), world_size=2)
    assert line.startswith("rank 1 did not arrive at collective all_reduce #2 on process group 'default_pg'"), line
    assert "rank 1 last entered all_reduce #1" in line, line


# --- a run says which rules it ran under ---------------------------------------------------------------
@pytest.mark.parametrize("semantics,words", [("nccl", "communication: NCCL's rules rehearsed on gloo"),
                                             ("native", "communication: native")])
def test_a_run_says_its_semantics_in_its_logs_first_line_and_every_metrics_record(tmp_path, semantics, words):
    import json

    from strata.config import train_config
    from strata.train.trainer import train
    train(train_config(model="tiny", seq_len=16, steps=2, micro_batch=1, eval_batches=1, progress=False,
                      peak_flops=1e10, run_dir=str(tmp_path / "run"), comm_semantics=semantics))
    first = (tmp_path / "run" / "train.log").read_text().splitlines()[0]
    assert words in first, first
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"train", "eval"}
    assert all(r["comm_semantics"] == semantics for r in records)
