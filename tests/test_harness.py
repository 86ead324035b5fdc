"""The multi-rank helper itself: results come back, failures surface with the rank's traceback,
and a hang becomes a failure instead of a stuck suite."""

import time

import pytest
import torch
import torch.distributed as dist

from distributed import run_on_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), torch.get_num_threads()


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def _rank_one_hangs():
    if dist.get_rank() == 1:
        time.sleep(60)
    return "done"


def _skips_a_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(30)


def test_results_come_back_in_rank_order():
    assert run_on_ranks(_sum_of_ranks, 4) == [(r, 4, 6.0, 1) for r in range(4)]


def test_a_failing_rank_fails_the_test_with_its_traceback():
    # rank 0's barrier would wait 600 s for its peer, the run only 120 s: the failure must come from
    # rank 1's error, not from either timeout
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed(.|\n)*boom on rank one"):
        run_on_ranks(_rank_one_raises, 2, collective_timeout=600, timeout=120)


def test_a_hanging_rank_becomes_a_timeout():
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish"):
        run_on_ranks(_rank_one_hangs, 2, timeout=8)


def test_a_skipped_collective_times_out_instead_of_hanging():
    with pytest.raises(RuntimeError, match="rank 0 of 2 failed"):
        run_on_ranks(_skips_a_collective, 2, collective_timeout=3, timeout=25)


def test_a_port_taken_between_finding_and_binding_it_is_replaced(monkeypatch):
    """Another process took the free port before rank 0's store bound it (CI saw EADDRINUSE): the
    launch is made again on a new port, once fn has not run anywhere."""
    import socket

    import distributed
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = distributed.free_port
    monkeypatch.setattr(distributed, "free_port", lambda: ports.pop() if ports else real())
    try:
        assert [rank for rank, *_ in run_on_ranks(_sum_of_ranks, 2)] == [0, 1]
    finally:
        taken.close()
    assert not ports  # the taken port was tried first
