"""PowerSGD (--compress powersgd): ZeRO-0's all-reduce of each gradient matrix replaced by two
all-reduces of its rank-r factors, with error feedback and a warm start (Vogels, Karimireddy and
Jaggi, "PowerSGD", NeurIPS 2019), as PyTorch's DDP hook computes it
(torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook); which matrices, and the bytes:
strata/rules/compression.py.

Per bucket, when backward completes it (the buckets' overlap is kept for the first round):
  1. M = this rank's gradient + its error from the last step (each rank's gradient carries 1/N
     of the loss already: the sums below are the average, as everywhere in strata)
  2. P = M Q, all-reduced with every tensor left whole (vectors and small matrices: exact)
  3. P orthonormalised (reduced QR, in fp32 at least); Q = M^T P
After backward, every bucket's Q in one all-reduce (in bucket order, the same on every rank);
then per matrix:
  4. the gradient becomes P Q^T; the error keeps M - P Q^T / N, so that the ranks' errors sum to
     what the approximation missed; Q is kept for the next step (the warm start)
Q starts as standard normal draws, one generator per parameter seeded with (--seed, the
parameter's name: rules/compression.q_seed), orthonormalised: the same on every rank, and on every
pipeline stage for the same matrix (a stage holds some of the model's parameters, under their
model-wide names; a tied embedding's two copies, on the first and last stage, share its name).
Under a pipeline (ZeRO-0), each stage compresses its own parameters' gradients over its dp group
after the schedule (`reduce_all`), a tied embedding's copies after their gradients were summed
over the embedding group: per matrix the rule is the dp-only one, so both copies keep the same Q
and the same error. The first --compress-after steps all-reduce uncompressed (PyTorch's start_powerSGD_iter).
The factors and errors live on the rank and are not written to checkpoints: a resumed run starts
them afresh (Q drawn again, errors zero)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from strata.distributed import comm
from strata.parallel.buckets import Bucket
from strata.parallel.gradients import Replicate
from strata.rules.compression import compressible, matrix_shape, q_seed


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    """P's columns orthonormalised (reduced QR), computed in fp32 at least."""
    wide = p if p.dtype in (torch.float32, torch.float64) else p.float()
    return torch.linalg.qr(wide, mode="reduced").Q.to(p.dtype)


def initial_q(shape: tuple[int, ...], rank: int, seed: int, name: str, like: torch.Tensor) -> torch.Tensor:
    """The first Q of the parameter named `name`: (m, r) standard normal draws, orthonormalised."""
    generator = torch.Generator().manual_seed(q_seed(seed, name))
    draws = torch.randn(matrix_shape(shape)[1], rank, generator=generator, dtype=torch.float64)
    return orthonormal(draws).to(dtype=like.dtype, device=like.device)


def outside_autocast(like: torch.Tensor):
    """The factors' products in the gradients' own dtype (the fp32 masters' under bf16). Backward's
    hooks run inside the step's autocast: a product there would come out bf16 in a bucket a hook
    launched and fp32 in one retired at the end, as each rank's timing decides (and the ranks'
    wires would differ in size)."""
    return torch.autocast(device_type=like.device.type, enabled=False)


class PowerSGDReplicate(Replicate):
    """ZeRO-0 with PowerSGD: every rank holds the whole model; the gradient matrices travel as
    rank-`rank` factors from step `after` on."""

    def __init__(self, params: list[nn.Parameter], settings, rank: int, after: int, seed: int, names: list[str]):
        """names: the parameters' names in the whole model, in the order of `params` (their Q's seeds)."""
        super().__init__(params, settings)
        self.rank, self.after, self.steps = rank, after, 0
        self.names = dict(zip(params, names, strict=True))
        self.compressed = {p for p in params if compressible(tuple(p.shape), rank)}
        self.seed = seed
        self.qs: dict[nn.Parameter, torch.Tensor] = {}  # the warm start: last step's summed Q
        self.errors: dict[nn.Parameter, torch.Tensor] = {}
        self._factored: dict[int, list] = {}  # bucket index -> (param, orthonormal P, this rank's Q)

    @property
    def compressing(self) -> bool:
        return self.group is not None and self.steps >= self.after

    def _matrix(self, param: nn.Parameter) -> torch.Tensor:
        return self.gradients.views[param].view(matrix_shape(tuple(param.shape)))

    def _start(self, bucket: Bucket):
        if not self.compressing:
            return super()._start(bucket)
        with outside_autocast(self.grad_buffer):
            return self._p_round(bucket)

    def _p_round(self, bucket: Bucket):
        parts = []
        for param in bucket.params:
            if param not in self.compressed:
                parts.append(self.gradients.views[param].reshape(-1))
                continue
            m = self._matrix(param)
            if param in self.errors:
                m.add_(self.errors[param])
            if param not in self.qs:
                self.qs[param] = initial_q(tuple(param.shape), self.rank, self.seed, self.names[param], m)
            parts.append((m @ self.qs[param]).reshape(-1))
        self._wires[bucket.index] = wire = torch.cat(parts)
        return comm.all_reduce(wire, self.group, self.group_name, async_op=True)

    def _finish(self, bucket: Bucket) -> None:
        """The P round is in: the whole tensors take their sums, each P is orthonormalised and this
        rank's Q = M^T P computed; the Q round waits for every bucket (`_q_round`)."""
        if not self.compressing:
            return super()._finish(bucket)
        with outside_autocast(self.grad_buffer):
            self._factor(bucket)

    def _factor(self, bucket: Bucket) -> None:
        wire, at, factored = self._wires.pop(bucket.index), 0, []
        for param in bucket.params:
            if param not in self.compressed:
                self.gradients.views[param].view(-1).copy_(wire[at:at + param.numel()])
                at += param.numel()
                continue
            n = param.shape[0]
            p = orthonormal(wire[at:at + n * self.rank].view(n, self.rank))
            at += n * self.rank
            factored.append((param, p, self._matrix(param).t() @ p))
        self._factored[bucket.index] = factored

    def _q_round(self) -> None:
        """Every bucket's Q factors in one all-reduce, in bucket order: the P rounds finish in an
        order each rank's timing decides (the buckets' throttle retires what is done), and a
        collective issued from there would meet another on the next rank."""
        factored = [entry for index in sorted(self._factored) for entry in self._factored[index]]
        self._factored = {}
        if not factored:  # vectors and small matrices only: sent whole in the P round
            return
        q_wire = torch.cat([q.reshape(-1) for _, _, q in factored])
        comm.all_reduce(q_wire, self.group, self.group_name)
        with outside_autocast(self.grad_buffer):
            self._decompress(factored, q_wire)

    def _decompress(self, factored: list, q_wire: torch.Tensor) -> None:
        at = 0
        for param, p, q in factored:
            q_sum = q_wire[at:at + q.numel()].view_as(q)
            at += q.numel()
            m, approximation = self._matrix(param), p @ q_sum.t()
            self.errors[param] = m - approximation / self.dp_size
            m.copy_(approximation)
            self.qs[param] = q_sum.clone()

    @contextmanager
    def backward(self, sync: bool, final: bool = True):
        with super().backward(sync, final):
            yield
        if self.compressing and sync:
            self._q_round()

    def reduce_all(self) -> None:
        super().reduce_all()
        if self.compressing:
            self._q_round()

    def after_step(self) -> None:
        self.steps += 1

    def _grads_bytes(self) -> int:
        """The gradients, and the state compression keeps beside them (errors, Q factors)."""
        kept = list(self.errors.values()) + list(self.qs.values())
        return super()._grads_bytes() + sum(t.numel() * t.element_size() for t in kept)
