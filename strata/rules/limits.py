"""The largest (and a few smallest) values strata accepts, in one table: counts against a ceiling
no real run reaches, each with its reason, and what a run's processes hold at least against this
machine's memory. The run's settings (strata/config.py), the layout rules, the planner's inputs
(strata/plan/inputs.py, strata/cli/plan.py) and the other commands' flags read it; docs/cli.md
prints it. A model's shape has its ceilings next to ModelConfig (SHAPE_LIMITS in
strata/model/config.py, a layer below this one, where config.json and checkpoints are read), and
they are part of this table.

Everything a ceiling guards would otherwise fail late: a numpy or torch size error, a hang while
allocating, a loop of 10^19 steps, a timedelta overflow."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.model.config import SHAPE_LIMITS


@dataclass(frozen=True)
class Bound:
    value: int | float
    why: str

    def text(self) -> str:
        return f"{self.value:,}" if isinstance(self.value, int) else f"{self.value:g}"


CEILINGS: dict[str, Bound] = {
    # strata train (TrainConfig's fields)
    "steps": Bound(10**9, "the longest runs take a few million optimizer steps"),
    "global_batch": Bound(2**20, "sequences per step; the largest runs use a few thousand"),
    "micro_batch": Bound(2**20, "sequences per forward pass; the largest runs' steps hold a few thousand"),
    "compress_rank": Bound(2**10, "PowerSGD's published runs use rank 1-32; past a few hundred nothing is saved"),
    "compress_after": Bound(10**9, "steps; the longest runs take a few million"),
    "var_update_scaler": Bound(10**9, "v's updates at each spacing; DeepSpeed's default is 16"),
    "eval_batches": Bound(10**6, "each is a global batch of validation sequences"),
    "loss_scale_window": Bound(10**9, "steps; the longest runs take a few million"),
    "nproc": Bound(1024, "processes started on this machine"),
    "loss_scale": Bound(2**64, "a larger first scale only skips steps while it halves (torch and DeepSpeed start "
                               "at 2**16)"),
    "timeout": Bound(30 * 86400, "30 days, in seconds: a collective that waits longer has hung"),
    "bucket_mb": Bound(2**20, "1 TiB, more than any device holds"),
    "max_restarts": Bound(1000, "each restart resumes from the last checkpoint; more is a crash loop"),
    "seed": Bound(2**63 - 1, "a random generator's seed holds 64 bits"),  # train's and generate's
    # a model's shape: config.json, checkpoints, and the train flags that override them
    **{name: Bound(limit, why) for name, (limit, why) in SHAPE_LIMITS.items()},
    # strata plan
    "nodes": Bound(2**16, "65,536 nodes, where --days' search gives up too"),
    "gpus_per_node": Bound(1024, "the largest NVLink domains hold 576 devices"),
    "nics_per_node": Bound(64, "a DGX node has 8 (one per GPU)"),
    "top": Bound(10**4, "layouts printed"),
    "batch": Bound(2**20, "sequences decoded together; serving batches hold hundreds"),
    # strata generate, bench
    "max_new_tokens": Bound(2**24, "the longest contexts are about 10M tokens"),
    "micro_batches": Bound(2**20, "groups of requests in flight; each holds one or more"),
    "iters": Bound(10**6, "calls timed per message size"),
    "runs": Bound(10**4, "runs of each prompt and length"),
    "threads": Bound(4096, "compute threads"),
    "factor": Bound(2**20, "the step between message sizes"),
}
FLOORS: dict[str, Bound] = {
    "seed": Bound(0, "seeds count from 0"),
    # each bucket is one collective: below a kilobyte, every few hundred parameters cost a
    # collective's fixed latency of their own (and 1e-300 MB would mean one element per bucket)
    "bucket_mb": Bound(0.001, "about a kilobyte: each bucket is one collective, whose fixed latency smaller "
                              "ones would pay every few hundred parameters"),
}
# What a process of a run holds before its first tensor: the Python interpreter with torch and
# strata imported (torch's import alone: about 276 MB, measured with ru_maxrss).
PROCESS_BYTES = 2**28


def check_ceiling(field: str, value) -> None:
    """ConfigError naming the field unless value is at most its ceiling (and, where it has one, at
    least its floor). NaN is refused too (it compares as neither)."""
    if value is None:
        return
    ceiling, floor = CEILINGS.get(field), FLOORS.get(field)
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError("must be a number", field, value)
    if ceiling is not None and value > ceiling.value:
        raise ConfigError(f"must be at most {ceiling.text()} ({ceiling.why})", field, value)
    if floor is not None and value < floor.value:
        raise ConfigError(f"must be at least {floor.text()} ({floor.why})", field, value)


def machine_memory() -> int:
    """This machine's memory in bytes (as `strata calibrate` reads it); 0 where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def size_text(n: float) -> str:
    """Bytes as a person reads them: '12.3 GB', '4.0 MB'."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} bytes"


def check_fits_machine(needs: list[tuple[str, object, float, str]], memory: int | None = None) -> None:
    """`needs`: (field, value, bytes, what holds them) of what the run's processes on this machine
    hold at least, together. Refused, naming the field of the largest, when their sum exceeds this
    machine's memory: the run would otherwise swap, hang or be killed while it allocates."""
    memory = machine_memory() if memory is None else memory
    total = sum(n[2] for n in needs)
    if not memory or total <= memory:
        return
    field, value, largest, what = max(needs, key=lambda n: n[2])
    others = f"; with the rest, at least {size_text(total)}" if total > largest * 1.05 else ""
    raise ConfigError(f"the run needs at least {size_text(largest)} of memory for {what}{others}, and this machine "
                      f"has {size_text(memory)}", field, value)


def markdown_table() -> str:
    """The ceilings and floors as docs/cli.md prints them (tests/test_numeric_extremes.py checks
    that the page holds this table as it is)."""
    rows = ["| setting | limit | why |", "|---|---|---|"]
    for word, table in (("at most", CEILINGS), ("at least", FLOORS)):
        rows += [f"| `{name.replace('_', '-')}` | {word} {bound.text()} | {bound.why} |" for name, bound in table.items()]
    return "\n".join(rows)
