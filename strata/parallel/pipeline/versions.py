"""Weight stashing: the weight versions an asynchronous schedule computes with.

Under PipeDream and PipeDream-2BW (strata/rules/schedules.py) the micro-batches of step s compute,
forward and backward, with the weights as they were `delay` updates before the newest, while the
optimizer keeps updating the newest. Each group of parameters (a pipeline stage; in one process,
each stage it emulates) keeps here:

  - the masters: the parameters' own storage as data parallelism laid it out, which the optimizer
    updates in place (under ZeRO-1, this rank's shards of them, gathered back after the step);
  - a stash per live version: a copy of the masters taken right after the update that made it, kept
    while a step that will compute with it may still run (the `delay` + 1 newest versions).

Before a micro-batch's forward or backward the parameters' .data are pointed at its version's stash
(a pointer swap, no copy): the forward saves the parameters themselves for backward, and their
values are read when the backward runs, so the backward must see the same version again. The
optimizer never updates the parameter objects (see `Replicate.separate_optimizer_targets`), whose
autograd version counters would otherwise tell the graphs of micro-batches still in flight that
their saved weights changed under them.

What it costs: the stashes (2 per stage for 2BW, p - i on stage i for PipeDream) besides the
masters; the paper's 2BW updates out of place into the freed buffer and keeps 2 in all, where
strata keeps 3 (the optimizers update in place)."""

from __future__ import annotations

import torch
from torch import nn


class WeightVersions:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]], delay: int):
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.masters = [p.data for p in self.params]
        self.delay = delay
        self.newest = 0  # updates the masters have had
        self.stashes: dict[int, list[torch.Tensor]] = {0: self._copy_masters()}
        self.peak_versions = 1

    def _copy_masters(self) -> list[torch.Tensor]:
        return [m.detach().clone() for m in self.masters]

    def use_step(self, step: int) -> None:
        """Compute with the version step `step` uses: `delay` updates before the one that step
        starts from, and the initial weights while the run is younger than the delay."""
        for p, t in zip(self.params, self.stashes[max(step - self.delay, 0)]):
            p.data = t

    def use_masters(self) -> None:
        """Point the parameters back at the masters: what evaluation, a checkpoint and the optimizer see."""
        for p, t in zip(self.params, self.masters):
            p.data = t

    def updated(self) -> None:
        """After an optimizer step (and ZeRO-1's gather): stash the new version and drop those no
        step to come uses (older than newest - delay)."""
        self.newest += 1
        self.stashes[self.newest] = self._copy_masters()
        for version in [v for v in self.stashes if v < self.newest - self.delay]:
            del self.stashes[version]
        self.peak_versions = max(self.peak_versions, len(self.stashes))

    def stash_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for stash in self.stashes.values() for t in stash)

    # --- checkpoints ------------------------------------------------------------------------------
    def older(self) -> dict[int, dict[str, torch.Tensor]]:
        """The stashed versions older than the newest, by how many updates older (the newest is the
        masters, saved as the parameters)."""
        return {self.newest - v: dict(zip(self.names, stash)) for v, stash in self.stashes.items() if v < self.newest}

    @torch.no_grad()
    def restore(self, newest: int, older: dict[int, dict[str, torch.Tensor]]) -> None:
        """After the masters were loaded from a checkpoint of step `newest`: stash them as the newest
        version and `older` (by age, as `older` gave them) as those before it; an age it lacks (a
        checkpoint of a synchronous schedule) starts as the loaded weights, as the run's first
        steps do."""
        self.use_masters()
        self.newest = newest
        self.stashes = {newest: self._copy_masters()}
        for age in range(1, min(self.delay, newest) + 1):
            self.stashes[newest - age] = ([older[age][name].to(m.device, m.dtype).view_as(m).clone()
                                           for name, m in zip(self.names, self.masters)]
                                          if age in older else self._copy_masters())
