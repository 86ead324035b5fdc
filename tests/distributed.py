"""Run a function on N gloo ranks in separate processes, the way every distributed test does.

- Each rank is a process forked from a fork server that has torch imported already (quick to start,
  and safe: the server has no threads of its own), with 1 compute thread.
- A free port for the rendezvous; every collective times out after `collective_timeout` seconds.
- Communication under $STRATA_COMM_SEMANTICS (`make test` sets nccl: NCCL's rules on gloo).
- The first rank to fail ends the run: its traceback is raised in the test, the others are killed.
- The whole run is bounded by `timeout` seconds: a hang fails the test, naming the ranks that did
  not finish."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

_CONTEXT = mp.get_context("forkserver")


def _strata_modules() -> list[str]:
    """strata's modules, for the fork server to import once instead of every rank and every CLI run
    importing them again (strata.parallel.tensor_comm alone pulls in torch._dynamo: over a second
    a process). Only those that import here: one that fails is left to fail in its own test (the
    fork server would die on it). The code run is the same; ranks started by torchrun and the
    subprocess tests still import strata afresh."""
    import importlib
    import pkgutil

    import strata
    names = []
    for module in pkgutil.walk_packages(strata.__path__, "strata."):
        if module.name in ("strata.__main__", "strata.demo"):
            continue
        try:
            importlib.import_module(module.name)
        except Exception:  # noqa: BLE001 - reported by the tests that import it
            continue
        names.append(module.name)
    return names


_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "numpy", *_strata_modules()])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, collective_timeout, results, args, kwargs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout))
        from strata.distributed import comm
        comm.configure()  # $STRATA_COMM_SEMANTICS from the start: tensors made on the host are marked
        # Plain pickle, not torch's shared-memory reductions: the rank exits right after, and a
        # tensor shared by file descriptor would be gone before the test reads it.
        results.put((rank, "ok", pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        from strata.distributed import comm
        comm.close_streams(wait_s=2.0)  # under NCCL's rules: no stream inside gloo while its groups go
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0, collective_timeout: float = 60.0,
                 **kwargs) -> list:
    """fn(*args, **kwargs) on each of `world_size` ranks; returns the results in rank order.
    fn must be a module-level function (it is pickled into the workers). The free port is found
    before rank 0 binds it, so another test's process may take it between the two (pytest-xdist
    runs two at once): a launch whose store found its address in use is made again on a new port
    (nothing of fn ran: the rendezvous comes first)."""
    for attempt in range(3):
        try:
            return _launch(fn, world_size, args, kwargs, timeout, collective_timeout)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def _launch(fn, world_size: int, args: tuple, kwargs: dict, timeout: float, collective_timeout: float) -> list:
    port = free_port()
    results = _CONTEXT.Queue()
    procs = [_CONTEXT.Process(target=_worker, daemon=True,
                              args=(fn, rank, world_size, port, collective_timeout, results, args, kwargs))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            done[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
    return [done[r] for r in range(world_size)]


def _each(fn, settings_list: list) -> list:
    return [fn(settings) for settings in settings_list]


class SharedLaunches:
    """fn(settings) on N ranks for many settings, grouped so that fewer process groups start:
    each (world, keys) of `launches` runs its keys (tuples of sorted settings items) one after
    another in one group; a key in none gets a group of its own. Every launch runs once."""

    def __init__(self, fn, launches: list, timeout: float):
        self.fn, self.launches, self.timeout = fn, launches, timeout
        self._done: dict = {}

    def _launch(self, world: int, keys: tuple) -> dict:
        if (world, keys) not in self._done:
            per_rank = run_on_ranks(_each, world, self.fn, [dict(key) for key in keys], timeout=self.timeout)
            self._done[(world, keys)] = {key: [rank[i] for rank in per_rank] for i, key in enumerate(keys)}
        return self._done[(world, keys)]

    def __call__(self, world: int, key: tuple) -> list:
        """Every rank's result of the run `key`, from the launch that holds it."""
        for launch_world, keys in self.launches:
            if launch_world == world and key in keys:
                return self._launch(launch_world, keys)[key]
        return self._launch(world, (key,))[key]


def assert_states_close(state: dict, reference: dict, dtype: str, lr: float) -> None:
    """A parallel run's final parameters against one process's. fp64: to 1e-10. fp32: Adam divides
    each gradient element by its own root mean square, so an element whose gradient is at fp32's
    rounding size moves by up to a step of lr either way, whatever the layout's order of sums: to
    1e-4 (and 1e-3 relative) but for at most one element in a thousand, each within one step of lr."""
    for name, value in reference.items():
        if dtype == "fp64":
            torch.testing.assert_close(state[name], value, rtol=1e-8, atol=1e-10)
            continue
        off = (state[name] - value).abs() > 1e-4 + 1e-3 * value.abs()
        assert int(off.sum()) <= max(1, value.numel() // 1000), (name, int(off.sum()), value.numel())
        torch.testing.assert_close(state[name], value, rtol=0, atol=lr)


def assert_compressed_runs_follow_the_rule(compressed: list, reference: list[float], plain: list[float],
                                           uncompressed_steps: int) -> None:
    """Every rank's losses of a compressed run equal the single-process rule's in fp64 (1e-10), and
    the rule changed the run after its uncompressed steps (a compression that did nothing would pass
    the first check): equal to the plain run's losses through the first compressed step's, apart at
    the end."""
    import pytest
    import torch
    for losses in compressed:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-10, atol=0)
        assert losses[:uncompressed_steps + 1] == pytest.approx(plain[:uncompressed_steps + 1], rel=1e-12)
        assert abs(losses[-1] - plain[-1]) > 1e-8
