"""Optimizer states off the device: `--offload cpu` (ZeRO-Offload, Ren et al. 2021) and
`--offload disk` (ZeRO-Infinity's NVMe tier, Rajbhandari et al. 2021).

`cpu`: fp32 master weights and Adam's moments in host memory, the optimizer step on the host: each
step copies the gradients this rank holds to the host, runs fused AdamW there (on the node's cores
divided among its ranks: `host_threads`), and copies the updated weights back. On a CPU device host and device memory are the same, so the master weights
are the parameters themselves and nothing moves (this machine measures nothing for it).

`disk`:
Adam's two moments (8 bytes per parameter in fp32, half of mixed-precision training's model
states) live in one file per rank under `--offload-dir`, not in memory. The step streams them
through a bounded buffer: for each chunk of `chunk_elements` elements it reads the moments, runs
PyTorch's fused AdamW kernel on that chunk of the parameter and gradient, and writes the moments
back; a reader thread fetches the next chunk while this one computes (read-ahead), so memory holds
at most two chunks of moments at any time. The kernel is elementwise, so the result is bit for bit
that of `torch.optim.AdamW(fused=True)` over the whole tensors. With ZeRO each rank streams only
its own shards (the tensors it is given).

With offloaded parameters (`--offload-params`, ZeRO-Infinity) the same `StreamingAdamW` runs a unit
of shards at a time, as the parameter tier reads them in, with the moments in memory, in host
memory (`--offload cpu`) or on disk: the optimizer step is then one pass over the tiers.

Reads and writes use pread/pwrite on a plain file, not a memory map: mapped pages would count in
the process's resident memory, which is what this is for."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from strata.memory import copy_stream, tiers


def host_threads() -> int:
    """The cores a rank's host optimizer step may use: the process's cores, shared by the node's
    ranks (LOCAL_WORLD_SIZE), at least one. The ranks compute with one thread each
    (OMP_NUM_THREADS=1, as torchrun and `strata launch` set it): on a GPU node that leaves most
    cores idle, and ZeRO-Offload's host Adam is what they can run."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


@contextmanager
def host_step_threads():
    """torch's CPU kernels (the fused AdamW among them) run on host_threads() inside the block. The
    update is elementwise, so its result does not depend on the thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(host_threads())
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """What masters and Adam's moments are kept in: fp32, or fp64 in an fp64 run."""
    return torch.promote_types(param.dtype, torch.float32)


class HostOffloadAdamW:
    """AdamW whose masters and moments are in host memory. copy_on_cpu forces separate host masters
    on a CPU device too (tests exercise the copies that an accelerator needs). On an accelerator the
    copies run on a copy stream (copy_stream.py; `copies` replaces it): the gradients go down after
    the compute that made them and the host waits for that copy's event (the host step reads
    them: the one wait it needs); the updated weights go up after the compute queued before, and
    the compute stream, not the host, waits for them."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], copy_on_cpu: bool = False,
                 copies=None):
        self.device_params = [p for g in groups for p in g["params"]]
        on_host = lambda p: p.device.type == "cpu" and not copy_on_cpu  # noqa: E731
        pin = torch.accelerator.is_available()
        self.masters = [p if on_host(p) else
                        p.detach().to("cpu", state_dtype(p), copy=True).pin_memory() if pin else
                        p.detach().to("cpu", state_dtype(p), copy=True) for p in self.device_params]
        masters = iter(self.masters)
        host_groups = [{**g, "params": [next(masters) for _ in g["params"]]} for g in groups]
        self.inner = torch.optim.AdamW(host_groups, lr=lr, betas=betas, fused=True)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self.apart = [(p, m) for p, m in zip(self.device_params, self.masters) if m is not p]  # copied
        self.copies = copies if copies is not None or not self.apart else \
            copy_stream.for_device(self.device_params[0].device)

    @torch.no_grad()
    def step(self) -> None:
        if self.apart:
            with self.copies.issue(self.copies.after_compute()):
                for p, master in self.apart:
                    master.grad = p.grad.to("cpu", master.dtype, non_blocking=True) if p.grad is not None else None
                grads_down = self.copies.landed()
            if grads_down is not None:
                grads_down.host_wait()  # the host step reads them
        with host_step_threads():
            self.inner.step()
        if self.apart:
            with self.copies.issue(self.copies.after_compute()):  # after the compute reading the weights
                for p, master in self.apart:
                    self.copies.copy(p, master)
                weights_up = self.copies.landed()
            copy_stream.wait_for(weights_up)  # the compute stream waits, not the host

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def host_bytes(self) -> int:
        """Masters held apart from the device, and the moments."""
        masters = sum(m.numel() * m.element_size() for m, p in zip(self.masters, self.device_params) if m is not p)
        moments = sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
        return masters + moments


class StreamingAdamW:
    """AdamW with decoupled weight decay, stepping one tensor (or one chunk of it) at a time with
    PyTorch's fused kernel, its moments where `moments` keeps them (in memory, or in a file: the
    `--offload disk` stream). stream: None, or a callable yielding groups of the tensors to update
    in turn (ZeRO-Infinity's offloaded shards: each group is read in before and written back after,
    strata/parallel/zero3.py). Has what the trainer uses of a torch optimizer: param_groups (lr is
    set per step), step(), state, state_dict(), load_state_dict()."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], moments: "MemoryMoments | DiskMoments",
                 eps: float = 1e-8, stream=None):
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, **g} for g in groups]
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.group_of = [g for g in self.param_groups for _ in g["params"]]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.moments, self.stream = moments, stream
        moments.allocate(self.params)
        # on each parameter's device: the fused kernel reads its step there
        self.steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in self.params]

    @property
    def state(self) -> dict:
        """What a torch optimizer holds in memory (nothing when the moments are on disk)."""
        return self.moments.in_memory()

    @torch.no_grad()
    def step(self) -> None:
        with host_step_threads():
            for tensors in (self.stream() if self.stream is not None else [self.params]):
                self._step([self.index[id(t)] for t in tensors])

    def _step(self, indices: list[int]) -> None:
        work = []  # (tensor index, start, length) in the moments' order
        for i in indices:
            if self.params[i].grad is not None:
                self.steps[i] += 1
                work += self.moments.chunks(i, self.params[i].numel())
        pending = self.moments.read(*work[0]) if work else None
        for n, (i, start, length) in enumerate(work):
            avg, avg_sq = (m.to(self.params[i].device) for m in self.moments.result(pending))  # disk: via the host
            if n + 1 < len(work):  # read-ahead: the next chunk loads while this one computes
                pending = self.moments.read(*work[n + 1])
            group = self.group_of[i]
            param, grad = self.params[i].view(-1), self.params[i].grad.view(-1)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_([param[start:start + length]], [grad[start:start + length]], [avg], [avg_sq], [],
                                [self.steps[i]], amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            self.moments.write(i, start, avg, avg_sq)

    # --- checkpoints and accounting -------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim.AdamW's format (moments on disk are read back into memory for saving)."""
        state = {}
        for i, p in enumerate(self.params):
            avg, avg_sq = self.moments.result(self.moments.read(i, 0, p.numel()))
            state[i] = {"step": self.steps[i].clone(), "exp_avg": avg.view_as(p), "exp_avg_sq": avg_sq.view_as(p)}
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({k: v for k, v in g.items() if k != "params"} | {"params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        for i, p in enumerate(self.params):
            entry = saved["state"].get(i, saved["state"].get(str(i)))
            if entry is None:
                continue
            self.steps[i] = entry["step"].to(p.device, torch.float32).reshape(()).clone()
            self.moments.load(i, entry["exp_avg"].reshape(-1).float().contiguous(),
                              entry["exp_avg_sq"].reshape(-1).float().contiguous())

    def disk_bytes(self) -> int:
        return self.moments.disk_bytes()

    def host_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values())

    def close(self) -> None:
        self.moments.close()


class MemoryMoments:
    """Adam's moments as tensors in memory: on the parameters' device, or with `host` in host
    memory (`--offload cpu` beside offloaded parameters: each tensor's moments are copied to the
    device for its update and back, on a GPU; on a CPU device nothing moves)."""

    def __init__(self, host: bool = False):
        self.host = host
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.devices: list[torch.device] = []

    def allocate(self, params) -> None:
        for p in params:  # zeros: Adam's initial moments
            where = "cpu" if self.host else p.device
            self.tensors.append((torch.zeros(p.numel(), dtype=state_dtype(p), device=where),
                                 torch.zeros(p.numel(), dtype=state_dtype(p), device=where)))
            self.devices.append(p.device)

    def in_memory(self) -> dict:
        return {i: {"exp_avg": a, "exp_avg_sq": b} for i, (a, b) in enumerate(self.tensors)}

    def chunks(self, i: int, numel: int) -> list[tuple[int, int, int]]:
        return [(i, 0, numel)]

    def read(self, i: int, start: int, length: int):
        avg, avg_sq = (t[start:start + length] for t in self.tensors[i])
        return avg.to(self.devices[i]), avg_sq.to(self.devices[i])

    @staticmethod
    def result(pending):
        return pending

    def write(self, i: int, start: int, avg: torch.Tensor, avg_sq: torch.Tensor) -> None:
        for kept, new in zip(self.tensors[i], (avg, avg_sq)):
            if kept.device != new.device:  # else the kernel updated them in place
                kept[start:start + new.numel()].copy_(new)

    def load(self, i: int, avg: torch.Tensor, avg_sq: torch.Tensor) -> None:
        for kept, new in zip(self.tensors[i], (avg, avg_sq)):
            kept.copy_(new)

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class DiskMoments:
    """Adam's two moments in one file per rank, streamed in chunks of `chunk_elements` through a
    reader thread (at most two chunks in memory)."""

    def __init__(self, directory: str, rank: int, chunk_elements: int = 1 << 18):
        self.chunk = chunk_elements
        os.makedirs(directory, exist_ok=True)
        # the pid keeps two jobs on one machine (or one directory) apart
        self.path = os.path.join(directory, f"adam_moments_rank{rank}_pid{os.getpid()}.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.unlink(self.path)  # the open file lives on; its space returns however the process ends
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-offload")
        self.offsets, self.numels, self.dtypes, self.file_bytes = [], [], [], 0
        self.writes = []  # queued on the reader thread, not known to be done

    def allocate(self, params) -> None:
        # file layout: for each tensor, exp_avg then exp_avg_sq, contiguous
        for p in params:
            self.offsets.append(self.file_bytes)
            self.numels.append(p.numel())
            self.dtypes.append(state_dtype(p))
            self.file_bytes += 2 * p.numel() * self.dtypes[-1].itemsize
        os.ftruncate(self.fd, self.file_bytes)  # zeros: Adam's initial moments

    @staticmethod
    def in_memory() -> dict:
        return {}

    def chunks(self, i: int, numel: int) -> list[tuple[int, int, int]]:
        return [(i, s, min(self.chunk, numel - s)) for s in range(0, numel, self.chunk)]

    def _read(self, index: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        base, numel, dtype = self.offsets[index], self.numels[index], self.dtypes[index]
        avg = torch.empty(length, dtype=dtype)
        avg_sq = torch.empty(length, dtype=dtype)
        os.preadv(self.fd, [memoryview(avg.numpy())], base + start * dtype.itemsize)
        os.preadv(self.fd, [memoryview(avg_sq.numpy())], base + (numel + start) * dtype.itemsize)
        return avg, avg_sq

    def read(self, i: int, start: int, length: int):
        tiers.io.record("read", "disk", 2 * length * self.dtypes[i].itemsize)
        return self.reader.submit(self._read, i, start, length)

    @staticmethod
    def result(pending):
        tiers.wait(pending)
        return pending.result()

    def _write(self, index: int, start: int, avg: torch.Tensor, avg_sq: torch.Tensor) -> None:
        base, numel, element = self.offsets[index], self.numels[index], self.dtypes[index].itemsize
        os.pwritev(self.fd, [memoryview(avg.numpy())], base + start * element)
        os.pwritev(self.fd, [memoryview(avg_sq.numpy())], base + (numel + start) * element)

    def write(self, index: int, start: int, avg: torch.Tensor, avg_sq: torch.Tensor) -> None:
        """In the background, after the reads queued before it; at most two chunks wait."""
        tiers.io.record("written", "disk", 2 * avg.numel() * avg.element_size())
        self.writes = [w for w in self.writes if not w.done()]
        self.writes.append(self.reader.submit(self._write, index, start, avg.cpu(), avg_sq.cpu()))
        while len(self.writes) > 2:
            tiers.wait(self.writes.pop(0))

    def load(self, i: int, avg: torch.Tensor, avg_sq: torch.Tensor) -> None:
        self.write(i, 0, avg, avg_sq)

    def disk_bytes(self) -> int:
        return self.file_bytes

    def close(self) -> None:
        self.reader.shutdown()
        os.close(self.fd)
