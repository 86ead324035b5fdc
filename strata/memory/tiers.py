"""Where offloaded tensors wait between uses: ZeRO-Infinity's tiers (Rajbhandari et al. 2021).

  cpu   host memory (pinned on a GPU machine, so copies to the device run beside compute)
  disk  one file per rank and purpose under --offload-dir, read and written with pread/pwrite (not
        a memory map: mapped pages would count in the resident set, which is what this is for),
        unlinked as soon as it is open, so however the process ends its space comes back

A tensor is offloaded by keeping the tensor object and resizing its storage to zero bytes: views
of it (the optimizer's pieces, `.grad`) stay valid, and a fetch resizes the storage back and reads
into it. Reads and writes run on the tier's one worker thread, in order, and return at once; `wait`
blocks on a read and counts the time as I/O wait, the part of the transfers not hidden behind
compute.

On an accelerator the worker issues the copies on the tier's copy stream (copy_stream.py), not the
compute stream, so they run beside compute: each transfer starts after the compute queued when it
was asked for (an event); a write's worker waits for its copy's event before the write counts as
done or the tensor's memory is freed (the write's Future is what bounds the writes in flight, and
the disk tier writes the host bytes); a read's `wait` has the compute stream wait for the copy's
event, with no host synchronize. On a CPU the copies are plain copies, as they always were.

Every byte moved is counted per tier (`io`, reset per step by the trainer), as communication is
counted in strata/distributed/comm.py, when it is asked for (so in the step that needs it)."""

from __future__ import annotations

import ctypes
import os
import resource
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from strata.memory import copy_stream

TIERS = ("cpu", "disk")


@dataclass
class IOCounter:
    """Bytes read and written per tier and seconds spent waiting for reads, since the last reset."""
    read: dict[str, int] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)
    wait_s: float = 0.0

    def reset(self) -> None:
        self.read.clear()
        self.written.clear()
        self.wait_s = 0.0

    def record(self, kind: str, tier: str, nbytes: int) -> None:
        counts = self.read if kind == "read" else self.written
        counts[tier] = counts.get(tier, 0) + nbytes


io = IOCounter()


def peak_resident_bytes() -> int:
    """The process's peak resident set so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _raw(tensor: torch.Tensor):
    """A contiguous CPU tensor's bytes as a buffer for pread/pwrite (any dtype, bf16 included).
    Not through numpy: a storage numpy has seen can no longer be resized, which offloading does."""
    return (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())


class Tier:
    """Space for named tensors in one tier, with one worker thread. A fetched tensor is read back
    into its own storage, on its own device (with the cpu tier on a CPU machine the copies are
    real, so the path a GPU takes runs here too). copies: where the copies run (copy_stream.py;
    by default chosen for the first tensor's device)."""

    def __init__(self, kind: str, purpose: str, directory: str | None, rank: int, copies=None):
        if kind not in TIERS:
            raise ValueError(f"tier {kind!r}: valid {', '.join(TIERS)}")
        self.kind = kind
        self.offsets: dict[str, int] = {}  # disk: key -> byte offset in the file
        self.host: dict[str, torch.Tensor] = {}  # cpu: key -> the host copy
        self.end = 0
        self.fd = None
        if kind == "disk":
            os.makedirs(directory, exist_ok=True)
            # the pid keeps two jobs on one machine (or one directory) apart
            self.path = os.path.join(directory, f"{purpose}_rank{rank}_pid{os.getpid()}.bin")
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.unlink(self.path)  # the open file lives on; its space returns however the process ends
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"strata-{purpose}")
        self.writes: list[Future] = []  # writes not known to be done
        self.copies = copies

    def _copies(self, tensor: torch.Tensor):
        """The copy stream of the tensors' device (a tier holds one device's tensors)."""
        if self.copies is None:
            self.copies = copy_stream.for_device(tensor.device)
        return self.copies

    # --- space ----------------------------------------------------------------------------------
    def reserve(self, key: str, tensor: torch.Tensor) -> None:
        """Room for `key`, the size of `tensor` (its contents are not written)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.kind == "disk":
            self.offsets[key] = self.end
            self.end += nbytes
            os.ftruncate(self.fd, self.end)
        else:
            host = torch.empty(tensor.numel(), dtype=tensor.dtype)
            # pinned for an accelerator's tensors: the copies run beside compute only from pinned memory
            self.host[key] = host.pin_memory() if tensor.device.type != "cpu" else host

    def bytes_held(self) -> int:
        return self.end if self.kind == "disk" else sum(t.numel() * t.element_size() for t in self.host.values())

    # --- transfers ----------------------------------------------------------------------------
    # Every transfer, and every change of a tensor's storage size, runs on the one worker thread, in
    # the order it was asked for: a read queued after a write of the same key sees what was written,
    # and the caller touches a tensor only after waiting for its read (or never again after its
    # eviction). Writes hold their tensor's memory until done: at most MAX_WRITES wait, then the
    # caller waits (counted as I/O wait) so a slow disk cannot pile up memory.
    MAX_WRITES = 2

    # On the worker thread; `after`: the compute stream's mark when the transfer was asked for.
    def _write(self, key: str, flat: torch.Tensor, after) -> None:
        copies = self._copies(flat)
        with copies.issue(after):
            if self.kind == "disk":
                staged = flat.cpu()  # on an accelerator: the copy stream, and this thread, wait
            else:
                copies.copy(self.host[key], flat)
            written = copies.landed(flat)
        if written is not None:
            # this thread, not the caller's: the bytes are in host memory before the write counts
            # as done (the writes in flight are bounded by that) and before the memory is freed
            written.host_wait()
        if self.kind == "disk":
            os.pwritev(self.fd, [_raw(staged)], self.offsets[key])

    def _read(self, key: str, tensor: torch.Tensor, after):
        copies = self._copies(tensor)
        with copies.issue(after):  # the memory is allocated on the copy stream
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            flat = tensor.view(-1)
            if self.kind == "disk":
                if flat.device.type == "cpu":
                    os.preadv(self.fd, [_raw(flat)], self.offsets[key])
                else:  # through host memory
                    staged = torch.empty_like(flat, device="cpu")
                    os.preadv(self.fd, [_raw(staged)], self.offsets[key])
                    flat.copy_(staged)  # pageable: the copy stream (and this thread) wait
            else:
                copies.copy(flat, self.host[key])
            return copies.landed(tensor)  # `wait` has the compute stream wait for it

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Store the tensor's contents under `key` (in the background; the tensor must not change)."""
        io.record("written", self.kind, tensor.numel() * tensor.element_size())
        after = self._copies(tensor).after_compute()
        self._queue_write(self.worker.submit(self._write, key, tensor.detach().reshape(-1), after))

    def evict(self, key: str, tensor: torch.Tensor, dirty: bool) -> None:
        """Free the tensor's memory; with `dirty` its contents are written first (else the tier's
        copy is current and they are dropped). The caller does not touch it again before a fetch.
        Freed without waiting for the compute stream: memory read in by the tier was recorded on
        it when the compute stream waited for the read (copy_stream.Ready.wait_on)."""
        after = self._copies(tensor).after_compute() if dirty else None
        def run():
            if dirty:
                self._write(key, tensor.detach().reshape(-1), after)  # waits for the write's copy
            release(tensor)
        done = self.worker.submit(run)
        if dirty:
            io.record("written", self.kind, tensor.numel() * tensor.element_size())
            self._queue_write(done)

    def _queue_write(self, done: Future) -> None:
        self.writes = [w for w in self.writes if not w.done()] + [done]
        while len(self.writes) > self.MAX_WRITES:
            wait(self.writes.pop(0))

    def fetch(self, key: str, tensor: torch.Tensor) -> Future:
        """Give the tensor its memory back and read its contents into it (background); wait() on
        the result before using it."""
        io.record("read", self.kind, tensor.numel() * tensor.element_size())
        return self.worker.submit(self._read, key, tensor, self._copies(tensor).after_compute())

    def zeros(self, tensor: torch.Tensor) -> Future:
        """Give the tensor its memory back, zeroed (in queue order, like a fetch)."""
        copies = self._copies(tensor)
        after = copies.after_compute()
        def run():
            with copies.issue(after):
                tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
                tensor.zero_()
                return copies.landed(tensor)
        return self.worker.submit(run)

    def close(self) -> None:
        self.worker.shutdown()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def release(tensor: torch.Tensor) -> None:
    """Free an offloaded tensor's memory: its storage resized to zero bytes, the tensor kept."""
    tensor.untyped_storage().resize_(0)


def wait(future: Future | None) -> None:
    """Block until a fetch has landed, counting the time as I/O wait. On an accelerator the host
    waits only for the worker to have queued the copy; the compute stream waits for the copy."""
    if future is None:
        return
    if not future.done():
        started = time.perf_counter()
        result = future.result()
        io.wait_s += time.perf_counter() - started
    else:
        result = future.result()  # raise what the reader raised
    copy_stream.wait_for(result)


class _Saved:
    """A tensor kept for backward, in a tier."""

    def __init__(self, key: str, like: torch.Tensor):
        self.key, self.shape, self.dtype, self.device = key, like.shape, like.dtype, like.device
        self.tensor: torch.Tensor | None = None
        self.read: Future | None = None


class OffloadedActivations:
    """Saved-tensor hooks that put what a checkpointed region keeps (its inputs) in a tier and read
    it back when backward recomputes the region; reading one starts the read of the one saved
    before it, which backward needs next. The tier's space is reused once every saved tensor of a
    step has been read back."""

    def __init__(self, tier: Tier):
        self.tier = tier
        self.live: list[_Saved] = []  # in the order they were saved
        self.count = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if tensor.numel() == 0:
            return tensor
        saved = _Saved(f"activation{self.count}", tensor)
        self.count += 1
        if not self.live:  # nothing saved is waiting: the space starts over
            self.tier.end, self.tier.offsets, self.tier.host = 0, {}, {}
        self.tier.reserve(saved.key, tensor)
        self.tier.write(saved.key, tensor.contiguous())
        self.live.append(saved)
        return saved

    def _fetch(self, saved: _Saved) -> None:
        if saved.tensor is None:
            saved.tensor = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
            saved.read = self.tier.fetch(saved.key, saved.tensor)

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        self._fetch(saved)
        wait(saved.read)
        if saved in self.live:
            at = self.live.index(saved)
            if at > 0:
                self._fetch(self.live[at - 1])
            self.live.remove(saved)
        return saved.tensor
