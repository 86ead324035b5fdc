"""The offload tiers' copy stream (issue 53): on an accelerator a tier's transfers run on a stream of
their own, ordered against compute by events (strata/memory/copy_stream.py). This machine has no
accelerator, so the device path runs with a recording stand-in for the copy stream on CPU tensors,
and the order of its operations is what is checked, counted, not timed: each transfer's copy stream
waits for the compute that was queued when it was asked for, each copy is issued on the copy
stream, a write's event is waited on the worker thread before its memory is freed, and a read's
event is waited by the compute stream (once per read), never by the host of the asking thread."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import torch

from strata.config import train_config
from strata.memory import copy_stream, tiers
from strata.memory.offload import HostOffloadAdamW
from strata.memory.tiers import Tier
from strata.train.trainer import train

BASE = dict(model="tiny", seq_len=32, steps=3, micro_batch=1, global_batch=4, progress=False, peak_flops=1e10,
            eval_batches=1, seed=9, checkpointing="full")


class RecordingReady(copy_stream.Ready):
    def __init__(self, copies: "RecordingCopies", number: int, tensors):
        super().__init__(None, tensors, torch.device("cpu"))
        self.copies, self.number = copies, number

    def wait_on(self, stream=None) -> None:
        self.copies.note("compute waits", self.number)

    def host_wait(self) -> None:
        self.copies.note("host waits", self.number, [t.untyped_storage().nbytes() for t in self.tensors])


class RecordingCopies:
    """copy_stream.CopyStream's interface on CPU tensors: the copies are made, and every step is
    logged as (on the main thread?, operation, mark or event number, detail)."""

    def __init__(self):
        self.log: list[tuple] = []
        self.names: list[tuple[str, torch.Tensor]] = []  # what the log calls the tensors it sees
        self.marks = self.events = 0
        self.lock = threading.Lock()
        self.on_copy_stream = threading.local()

    def note(self, *entry) -> None:
        with self.lock:
            self.log.append((threading.current_thread() is threading.main_thread(), *entry))

    def after_compute(self) -> int:
        with self.lock:
            self.marks += 1
            mark = self.marks
        self.note("mark", mark)
        return mark

    @contextmanager
    def issue(self, after):
        self.note("stream waits", after)
        self.on_copy_stream.now = True
        try:
            yield
        finally:
            self.on_copy_stream.now = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert getattr(self.on_copy_stream, "now", False), "a copy issued off the copy stream"
        self.note("copy", self.name_of(src), self.name_of(dst))
        dst.copy_(src)

    def landed(self, *tensors) -> RecordingReady:
        assert getattr(self.on_copy_stream, "now", False), "an event recorded off the copy stream"
        with self.lock:
            self.events += 1
            number = self.events
        self.note("event", number)
        return RecordingReady(self, number, tensors)

    def name_of(self, tensor: torch.Tensor) -> str:
        """By where its memory is now (a fetch gives a tensor new memory)."""
        return next((name for name, t in self.names if t.data_ptr() == tensor.data_ptr()), "?")

    def on(self, main: bool) -> list[tuple]:
        return [entry[1:] for entry in self.log if entry[0] == main]


def test_a_tier_s_transfers_run_on_its_copy_stream_in_the_order_the_events_state(monkeypatch):
    torch.manual_seed(0)
    a, b = torch.randn(64), torch.randn(32)
    a_was, b_was = a.clone(), b.clone()
    copies = RecordingCopies()
    tier = Tier("cpu", "params", None, 0, copies=copies)
    tier.reserve("a", a)
    tier.reserve("b", b)
    copies.names = [("a", a), ("b", b), ("host a", tier.host["a"]), ("host b", tier.host["b"])]
    released = []
    monkeypatch.setattr(tiers, "release", lambda t: (copies.note("release", copies.name_of(t)),
                                                      released.append(t), t.untyped_storage().resize_(0)))
    tier.write("a", a)  # mark 1
    tier.evict("b", b, dirty=True)  # mark 2
    tiers.wait(tier.fetch("b", b))  # mark 3
    assert torch.equal(b, b_was)
    tier.evict("a", a, dirty=False)  # no mark: nothing is copied
    tiers.wait(tier.zeros(a))  # mark 4
    assert torch.equal(a, torch.zeros(64))
    tier.evict("a", a, dirty=False)
    tiers.wait(tier.fetch("a", a))  # mark 5
    tier.close()
    assert torch.equal(a, a_was)

    assert copies.on(main=True) == [("mark", 1), ("mark", 2), ("mark", 3), ("compute waits", 3), ("mark", 4),
                                    ("compute waits", 4), ("mark", 5), ("compute waits", 5)]
    assert copies.on(main=False) == [
        ("stream waits", 1), ("copy", "a", "host a"), ("event", 1), ("host waits", 1, [256]),
        ("stream waits", 2), ("copy", "b", "host b"), ("event", 2), ("host waits", 2, [128]), ("release", "b"),
        ("stream waits", 3), ("copy", "host b", "b"), ("event", 3),
        ("release", "a"),
        ("stream waits", 4), ("event", 4),
        ("release", "a"),
        ("stream waits", 5), ("copy", "host a", "a"), ("event", 5)]
    # the rule, counted: the compute stream waits once per read (and zero-fill), the asking thread's
    # host never; writes are waited on the worker, with their memory still held
    kinds = [entry[0] for entry in copies.on(main=True)]
    assert kinds.count("compute waits") == 3 and kinds.count("host waits") == 0
    assert len(released) == 3


def test_the_cpu_tier_without_a_stand_in_copies_in_line_as_before():
    a = torch.randn(16)
    tier = Tier("cpu", "params", None, 0)
    tier.reserve("a", a)
    tier.evict("a", a, dirty=True)
    read = tier.fetch("a", a)
    assert read.result() is None  # nothing for the compute stream to wait for
    tiers.wait(read)
    tier.close()
    assert isinstance(tier.copies, copy_stream.HostCopies) and not tier.host["a"].is_pinned()


def test_the_host_optimizer_waits_only_for_the_gradients_and_the_compute_stream_for_the_weights():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2, fused=True)
    copies = RecordingCopies()
    offloaded = HostOffloadAdamW([{"params": twins, "weight_decay": 0.1}], 1e-2, (0.9, 0.999), copy_on_cpu=True,
                                 copies=copies)
    copies.names = [(f"param{i}", t) for i, t in enumerate(twins)] + \
        [(f"master{i}", m) for i, m in enumerate(offloaded.masters)]
    for _ in range(2):
        for p, t in zip(params, twins):
            p.grad = torch.randn_like(p)
            t.grad = p.grad.clone()
        reference.step()
        offloaded.step()
    for p, t in zip(params, twins):
        assert torch.equal(p, t)
    a_step = [("mark", 1), ("stream waits", 1), ("event", 1), ("host waits", 1, []),  # the gradients, down
              ("mark", 2), ("stream waits", 2), ("copy", "master0", "param0"), ("copy", "master1", "param1"),
              ("event", 2), ("compute waits", 2)]  # the weights, up: the compute stream waits

    def renumbered(entries, by):
        return [(e[0], e[1] + by, *e[2:]) if e[0] != "copy" else e for e in entries]
    assert copies.on(main=False) == []
    assert copies.on(main=True) == a_step + renumbered(a_step, 2)


def test_the_copy_stream_orders_itself_with_torch_s_device_generic_stream_and_event(monkeypatch):
    """CopyStream itself, on stand-ins for torch.Stream and torch.Event that log what is called (and
    only what torch's own classes have): the copy stream waits the compute mark and is current while
    the copies are issued, its event is what the compute stream waits (a read) or the worker (a write)."""
    log, stream_methods, event_methods = [], {"wait_event", "record_event", "__enter__", "__exit__"}, {"synchronize"}
    assert all(hasattr(torch.Stream, m) for m in stream_methods) and all(hasattr(torch.Event, m) for m in event_methods)

    class Event:
        def __init__(self, on):
            self.on = on

        def synchronize(self):
            log.append(("host waits", self.on))

    class Stream:
        def __init__(self, device=None, name="copy"):
            self.name = name

        def record_event(self):
            log.append(("event on", self.name))
            return Event(self.name)

        def wait_event(self, event):
            log.append((self.name + " waits", event.on))

        def __enter__(self):
            log.append(("current", self.name))

        def __exit__(self, *exc):
            log.append(("restored", self.name))
    compute = Stream(name="compute")
    monkeypatch.setattr(torch, "Stream", Stream)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: compute)
    copies = copy_stream.CopyStream(torch.device("cpu"))  # the device only names it here
    dst, src = torch.zeros(3), torch.arange(3.0)
    with copies.issue(copies.after_compute()):
        copies.copy(dst, src)
        ready = copies.landed()
    copy_stream.wait_for(ready)
    ready.host_wait()
    assert torch.equal(dst, src)
    assert log == [("event on", "compute"), ("copy waits", "compute"), ("current", "copy"), ("event on", "copy"),
                   ("restored", "copy"), ("compute waits", "copy"), ("host waits", "copy")]


def _recording(monkeypatch) -> list[RecordingCopies]:
    made = []

    def recording(device):
        made.append(RecordingCopies())
        return made[-1]
    monkeypatch.setattr(copy_stream, "for_device", recording)
    return made


def test_zero_infinity_training_on_the_device_path_never_blocks_the_main_thread_on_a_copy(monkeypatch, tmp_path):
    """ZeRO-3 with its shards in the cpu tier, the moments in host memory and the activations
    offloaded, run with the recording copy stream in every tier: the same losses and weights, the
    asking thread never waits a copy's event on the host, each read is waited by the compute stream
    at most once, and every write is waited on the worker."""
    settings = dict(BASE, offload_params="cpu", offload="cpu", offload_activations="cpu",
                    offload_dir=str(tmp_path))
    reference = train(train_config(**settings), keep_state=True)
    made = _recording(monkeypatch)
    recorded = train(train_config(**settings), keep_state=True)
    assert recorded["losses"] == reference["losses"]
    assert all(torch.equal(reference["state"][k], v) for k, v in recorded["state"].items())
    assert len(made) == 2  # the parameters' tier and the activations'
    for copies in made:
        on_main = [entry[0] for entry in copies.on(main=True)]
        assert set(on_main) <= {"mark", "compute waits"} and "compute waits" in on_main
        waited = [entry[1] for entry in copies.on(main=True) if entry[0] == "compute waits"]
        assert len(waited) == len(set(waited))
        worker = copies.on(main=False)
        marks_waited = [entry[1] for entry in worker if entry[0] == "stream waits"]
        assert marks_waited == sorted(marks_waited)  # in the order asked for
        writes_waited = [entry[1] for entry in worker if entry[0] == "host waits"]
        assert len(writes_waited) == len(set(writes_waited))  # each write's event, on the worker


# --- bench/offload_overlap.py: the overlap measured on a GPU, and what a CPU gives --------------------
def _overlap_bench():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import offload_overlap
    return offload_overlap


def test_the_overlap_of_copies_with_kernels_is_their_intersection_over_the_copy_time():
    bench = _overlap_bench()
    trace = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10},
             {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 5, "dur": 15},  # overlaps the first: [0, 20]
             {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 30, "dur": 10},
             {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 15, "dur": 20},
             {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 50, "dur": 10},
             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # the host's: not counted
             {"ph": "i", "cat": "kernel", "name": "marker", "ts": 16}]
    got = bench.summary(trace)
    assert got["read_overlap"] == 0.5  # [15, 20] and [30, 35] of [15, 35]
    assert got["write_overlap"] == 0.0
    assert got["kernel_ms"] == 30 / 1e3 and got["copy_ms"] == {"HtoD": 20 / 1e3, "DtoH": 10 / 1e3}
    assert got["device_span_ms"] == 60 / 1e3
    assert bench.overlap_fraction([], [(0, 1)]) is None


def test_the_overlap_bench_runs_on_a_cpu_and_says_why_it_measures_nothing():
    got = _overlap_bench().measure("cpu", quick=True)
    assert got["read_overlap"] is None and got["write_overlap"] is None and "CPU" in got["reason"]
    assert got["bytes_read"] == got["bytes_written"] == 2**16  # 1/16 MiB each way, through the tier
