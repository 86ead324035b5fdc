"""Search: every layout strata can run for a model on a cluster, estimated, the ones that do not fit
(or whose communication alone dwarfs the compute) set aside, the rest ranked by step time. And
`explain`: why the winner wins, in the numbers that decide it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.plan.context import context_degrees, context_lines, data_parallel_twin, searched_micro_batches
from strata.plan.cost import Cluster, Estimate, Workload, estimate
from strata.plan.experts import expert_degrees, moe_lines
from strata.rules.checkpointing import PLANNED_MODES
from strata.rules.layout import ZERO_STAGES, Layout, check_layout, check_tensor_parallel
from strata.rules.schedules import SCHEDULES
from strata.rules.tensor_modes import grid_of

MICRO_BATCHES = (1, 2, 4, 8)
# A layout whose communication takes this many times its compute is refused, whatever it fits in.
REFUSE_COMM_OVER_COMPUTE = 10.0


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(work: Workload, world: int, offload: bool = True, transfers: tuple[str, str] = ("fp32", "fp32"),
            allow_async: bool = False, params_offload: bool = False, per_node: int | None = None,
            compress: bool = True, kept: dict | None = None) -> Iterator[Layout]:
    """Every layout of `world` devices strata runs for this model and batch: the candidates below,
    each passed through the trainer's own layout check. transfers: the (reduce, gather) dtypes the
    run asked for; a layout they do not apply to (bf16 reductions without dp, bf16 gathers
    without ZeRO) is not run, so not offered. allow_async: offer the asynchronous schedules too,
    which change the optimisation (stale weights), so only when asked. params_offload: instead,
    the ZeRO-Infinity layouts (ZeRO-3 with its shards in host memory or on disk), which `search`
    tries only when nothing else fits. per_node: devices a node holds, to offer hybrid sharding
    (ZeRO over a node's dp ranks, replicated across nodes) where dp crosses nodes. compress: offer
    data parallelism's compressed twins too (`strata plan` does; `--parallel auto` keeps the user's
    --compress, so it is not offered there). kept: fields set on every candidate (`--parallel
    auto`'s, the user's own: --compress, --offload, ...), so each is priced as it will run; the
    candidates that differ only in them are one."""
    candidates = _infinity_candidates(work, world, offload, transfers) if params_offload else \
        _candidates(work, world, offload, transfers, allow_async, per_node, compress)
    seen: set[Layout] = set()
    for layout in candidates:
        if kept:
            layout = replace(layout, **kept)
            if layout in seen:
                continue
            seen.add(layout)
        try:
            check_layout(work.model, layout, world, work.seq_len, work.global_batch)
        except ConfigError:
            continue
        yield layout


def _candidates(work: Workload, world: int, offload: bool, transfers: tuple[str, str],
                allow_async: bool, per_node: int | None = None, compress: bool = True) -> Iterator[Layout]:
    """The search space: every split of the world into tp x pp x cp x dp (cp: plan/context.py's
    degrees, ring and Ulysses, with micro-batches of 1), the schedules worth trying for each
    pipeline depth, ZeRO stages, micro-batches, checkpointing, optimizer offload, SP, and for a
    mixture of experts each expert-parallel degree (divisors of its experts that divide dp)."""
    for t in divisors(world):
        for p in divisors(world // t):
            for c, cp_mode in context_degrees(work.model, world // (t * p)):
                d = world // (t * p * c)
                modes = _tensor_modes(work.model, t) if c == 1 else \
                    [m for m in _tensor_modes(work.model, t) if m[1] == "1d"]
                for v, schedule in _schedules(work.model.n_layers, p, allow_async):
                    for zero in ZERO_STAGES:
                        for b in searched_micro_batches(c, MICRO_BATCHES):
                            for checkpointing in PLANNED_MODES:
                                for place in ("none", "cpu") if offload else ("none",):
                                    for sp, mode, depth in modes:
                                        for ep in expert_degrees(work.model, d):
                                            flat = Layout(dp=d, tp=t, pp=p, virtual_stages=v, zero=zero, micro_batch=b,
                                                          checkpointing=checkpointing, offload=place,
                                                          sequence_parallel=sp, schedule=schedule, reduce_dtype=transfers[0], gather_dtype=transfers[1],
                                                          tp_mode=mode, tp_depth=depth, ep=ep, cp=c, cp_mode=cp_mode)
                                            yield flat
                                            if compress and zero < 2 and d > 1 and t == c == ep == 1:  # dp (and pp)
                                                yield from _compressed(flat)
                                            if zero == 3 and p > 1:  # a stage's units kept gathered through its micro-batches
                                                yield replace(flat, reshard_after_forward=False)
                                            shard = node_shards(flat, per_node)
                                            if shard:
                                                yield replace(flat, dp_shard=shard)
                                            if shard and zero == 3:  # ZeRO++'s hpZ: backward gathers in the node
                                                yield replace(flat, hpz_partition_size=shard)


def _compressed(lay: Layout) -> Iterator[Layout]:
    """ZeRO-0's and ZeRO-1's compressed twins, for slow networks: PowerSGD at rank 4 (the issue's and
    Vogels et al.'s choice; ZeRO-0 only) and 1-bit Adam after a warm-up step (the planner prices the
    steps after it), both also beside a synchronous pipeline (each stage compresses its own
    parameters over its dp group)."""
    if lay.pp == 1 or not SCHEDULES[lay.schedule].asynchronous:
        if lay.zero == 0:
            yield replace(lay, compress="powersgd", compress_rank=4)
        yield replace(lay, compress="onebit", compress_after=1)


def node_shards(lay: Layout, per_node: int | None) -> int | None:
    """Hybrid sharding's shard group worth trying: a node's dp ranks (ZeRO's collectives on its
    links, the replicas' all-reduce across nodes), where ZeRO's dp ranks span nodes; else None.
    Beside a pipeline too: a stage's dp x tp ranks are adjacent (pp is outermost), so its shard
    groups are a node's as well. What the runtime runs it with is check_hybrid_sharding's to say
    (`layouts` passes every candidate through check_layout)."""
    if per_node is None or not lay.zero or per_node % lay.tp or lay.dp * lay.tp <= per_node:
        return None
    shard = per_node // lay.tp
    return shard if 2 <= shard < lay.dp and lay.dp % shard == 0 else None


def _tensor_modes(cfg: ModelConfig, t: int) -> list[tuple[bool, str, int]]:
    """(sequence parallelism, tp_mode, tp_depth) worth trying on t ranks: 1-D with and without
    sequence parallelism where the model splits t ways, and every grid t makes (2-D on q², 3-D on
    q³, 2.5-D on q² x d). 1-D where it does not (t not dividing the heads, say) is left out here
    rather than built into thousands of layouts that check_layout would refuse one by one: it
    refuses every layout with tp_mode 1d whose check_tensor_parallel fails, so `layouts` yields
    the same layouts either way."""
    if t == 1:
        return [(False, "1d", 1)]
    try:
        check_tensor_parallel(cfg, t)
        found = [(False, "1d", 1), (True, "1d", 1)]
    except ConfigError:
        found = []
    for mode in ("2d", "3d"):
        try:
            grid_of(mode, t)
        except ConfigError:
            continue
        found.append((False, mode, 1))
    for depth in divisors(t)[1:-1]:
        try:
            grid_of("2.5d", t, depth)
        except ConfigError:
            continue
        found.append((False, "2.5d", depth))
    return found


def _infinity_candidates(work: Workload, world: int, offload: bool, transfers: tuple[str, str]) -> Iterator[Layout]:
    """ZeRO-3 over tp x dp (no pipeline: ZeRO-Infinity runs without stages) with its shards in host
    memory or on disk, Adam's moments beside them or in device memory, checkpointed activations
    kept or offloaded too."""
    if not offload:
        return
    for t in divisors(world):
        for b in MICRO_BATCHES:
            for checkpointing in PLANNED_MODES:
                for params in ("cpu", "disk"):
                    for moments in ("none", "cpu", "disk"):
                        for activations in ("none", "cpu") if checkpointing != "none" else ("none",):
                            for sp in (False, True) if t > 1 else (False,):
                                yield Layout(dp=world // t, tp=t, zero=3, micro_batch=b, checkpointing=checkpointing,
                                             offload=moments, sequence_parallel=sp, reduce_dtype=transfers[0], gather_dtype=transfers[1],
                                             offload_params=params, offload_activations=activations)


def _schedules(n_layers: int, p: int, allow_async: bool) -> list[tuple[int, str]]:
    if p == 1:
        return [(1, "1f1b")]
    found = [(1, "1f1b"), (1, "zb")] + ([(1, name) for name, spec in SCHEDULES.items() if spec.asynchronous]
                                        if allow_async else [])
    found += [(v, "interleaved") for v in (2, 4) if n_layers % (p * v) == 0]
    return found


def refusal(e: Estimate) -> str | None:
    """Why a layout is set aside even if it fits: communication that takes minutes per step."""
    comm = sum(e.comm_seconds.values())
    if e.compute_s > 0 and comm > REFUSE_COMM_OVER_COMPUTE * e.compute_s:
        return (f"communication alone takes {_duration(comm)} per step, {comm / e.compute_s:.0f}x the compute "
                f"({_duration(e.compute_s)})")
    return None


def search(work: Workload, cluster: Cluster, offload: bool = True, transfers: tuple[str, str] = ("fp32", "fp32"),
           allow_async: bool = False, compress: bool = True, kept: dict | None = None
           ) -> tuple[list[Estimate], list[Estimate]]:
    """(runnable layouts fastest first, the rest: not fitting or refused, smallest memory first).
    Parameter offload (ZeRO-Infinity) is offered only when nothing else fits, as a last resort: it
    trades device memory for transfers over PCIe or from disk on every step. kept: see `layouts`."""
    ranked, rejected = _estimates(work, cluster, layouts(work, cluster.world, offload, transfers, allow_async,
                                                         per_node=cluster.devices_per_node, compress=compress,
                                                         kept=kept))
    if not ranked and offload:
        last_resort, still = _estimates(work, cluster, layouts(work, cluster.world, offload, transfers,
                                                               params_offload=True))
        for e in last_resort:
            e.notes.append("parameters offloaded: no layout without it fits")
        ranked, rejected = last_resort, sorted(rejected + still, key=lambda e: e.memory_bytes_per_device)
    return ranked, rejected


def _estimates(work: Workload, cluster: Cluster, candidates) -> tuple[list[Estimate], list[Estimate]]:
    """Every candidate estimated, but a context-parallel one whose data-parallel twin runs
    (plan/context.data_parallel_twin: as fast or faster wherever it fits), which is set aside
    unpriced: the layouts with cp > 1 go last, once the others' verdicts are in."""
    ranked, rejected, held_back = [], [], []
    for layout in candidates:
        if layout.cp > 1:
            held_back.append(layout)
            continue
        _add(estimate(work, cluster, layout), ranked, rejected)
    runs = {e.layout for e in ranked}
    for layout in held_back:
        if data_parallel_twin(layout) not in runs:
            _add(estimate(work, cluster, layout), ranked, rejected)
    ranked.sort(key=lambda e: (e.step_time_s, e.memory_bytes_per_device))
    rejected.sort(key=lambda e: e.memory_bytes_per_device)
    return ranked, rejected


def _add(e: Estimate, ranked: list[Estimate], rejected: list[Estimate]) -> None:
    reason = refusal(e)
    if reason:
        e.notes.append(f"refused: {reason}")
    (ranked if e.fits and not reason else rejected).append(e)


def distinct(estimates: list[Estimate]) -> list[Estimate]:
    """The best of each shape (degrees, expert and context parallelism, ZeRO stage, schedule, tensor-parallel mode):
    variants that differ only in a knob that does not matter there (sequence parallelism, a checkpointing mode) would
    crowd a table."""
    seen, kept = set(), []
    for e in estimates:
        lay = e.layout
        key = (lay.dp, lay.shards, lay.tp, lay.pp, lay.virtual_stages, lay.zero, lay.schedule, lay.tp_mode, lay.tp_depth, lay.ep,
               lay.cp, lay.cp_mode, lay.reshard_after_forward, lay.hpz_partition_size, lay.compress)
        if key not in seen:
            seen.add(key)
            kept.append(e)
    return kept


# --- explain ----------------------------------------------------------------------------------------
def explain(best: Estimate, ranked: list[Estimate], rejected: list[Estimate], cluster: Cluster) -> list[str]:
    """Plain sentences: what the winner spends its step on, and why each obvious alternative
    (no tensor parallelism, no pipeline, pure data parallelism, ZeRO-3, TP across nodes) loses."""
    lines = [f"best: {best.layout.describe()}: {_duration(best.step_time_s)} per step, "
             f"{_rate(best.tflops_per_device)} per device ({best.mfu:.0%} MFU), "
             f"{best.memory_bytes_per_device / 1e9:.1f} GB of {cluster.device.memory_bytes / 1e9:.0f} GB per device; "
             f"{_shares(best)}"]
    if cluster.device.name == "cpu-local":
        link = "gloo between the processes of this machine"
    elif cluster.device.nvlink_bandwidth and cluster.intra_bandwidth >= cluster.device.nvlink_bandwidth:
        link = "NVLink"
    else:
        link = f"{cluster.intra_bandwidth / 1e9:.0f} GB/s inside a node (no NVLink)"
    alternatives = {
        "without tensor parallelism (tp=1)": lambda lay: lay.tp == 1,
        "without pipeline parallelism (pp=1)": lambda lay: lay.pp == 1,
        "data parallelism alone (tp=1, pp=1, ZeRO-0)": lambda lay: lay.tp == 1 and lay.pp == 1 and lay.zero == 0
        and lay.cp == 1,
        "with ZeRO-3": lambda lay: lay.zero == 3,
        f"with tensor parallelism over {link} (tp>1)": lambda lay: lay.tp > 1,
        "with tensor parallelism across nodes": lambda lay: lay.tp > cluster.devices_per_node,
        "with Megatron's 1-D tensor parallelism (tp_mode=1d, tp>1)": lambda lay: lay.tp > 1 and lay.tp_mode == "1d",
        "with 2-D, 2.5-D or 3-D tensor parallelism": lambda lay: lay.tp_mode != "1d",
        "with hybrid sharding (ZeRO inside a node, replicas across nodes: dp_shard)":
            lambda lay: lay.shards < lay.replicas,
        "with ZeRO over every dp rank (flat, zero>0)": lambda lay: lay.zero > 0 and lay.shards == lay.replicas,
        f"with ZeRO++'s hpZ (ZeRO-3's backward gathers over a node's {link}: hpz)": lambda lay: lay.hpz_partition_size > 1,
        "with ZeRO-3 gathering over every dp rank twice (no hpZ)": lambda lay: lay.zero == 3 and lay.hpz_partition_size == 1,
        "with compressed gradients (compress: PowerSGD or 1-bit Adam, beside data parallelism and pipelines)":
            lambda lay: lay.compress != "none",
        "without compressed gradients": lambda lay: lay.compress == "none",
    }
    if best.total_params != best.active_params:  # a mixture of experts: where its experts live, and why
        lines += moe_lines(best, ranked, cluster)
        alternatives["without expert parallelism (ep=1)"] = lambda lay: lay.ep == 1
        alternatives["with expert parallelism (ep>1)"] = lambda lay: lay.ep > 1
        alternatives["with the expert-parallel group across nodes"] = \
            lambda lay: lay.ep > 1 and lay.ep * lay.tp > cluster.devices_per_node
    lines += context_lines(best, ranked, rejected, cluster)
    if best.layout.offload_params != "none":
        lines.append(_offload_line(best, rejected))
    spec = SCHEDULES[best.layout.schedule]
    if spec.asynchronous:  # a choice the user allowed: say what it changes
        lines.append(f"{best.layout.schedule} ({spec.source}): no pipeline flush, so no bubble in steady state, but every "
                     f"micro-batch computes with weights up to {spec.delay(best.layout.pp, 0)} update(s) old "
                     f"(a different optimisation, not the synchronous run); the first stage stashes "
                     f"{spec.versions(best.layout.pp, 0)} copies of its weights "
                     f"({best.memory_breakdown.get('weight_versions', 0) / 1e9:.1f} GB on the fullest stage)")
        alternatives["with a synchronous schedule"] = lambda lay: not SCHEDULES[lay.schedule].asynchronous
    # how the chosen tp degree's matrices are cut, against the other kind; else how the best grid fares
    grid = next((e for e in ranked if e.layout.tp_mode != "1d"), None)
    mode_line = _tensor_mode_line(best, ranked) or (_tensor_mode_line(grid, ranked) if grid else None)
    if mode_line:
        lines.append(mode_line)
    for label, wanted in alternatives.items():
        if wanted(best.layout):
            continue
        rival = next((e for e in ranked if wanted(e.layout)), None)
        if rival is not None:
            slower = rival.step_time_s / best.step_time_s - 1
            lines.append(f"{label}: best is {rival.layout.describe()}, {slower:.0%} slower; {_shares(rival)}")
            continue
        rival = next((e for e in rejected if wanted(e.layout)), None)
        if rival is not None:
            why = next((n for n in rival.notes if n.startswith(("refused", "does not fit"))), None) or \
                f"does not fit: needs {rival.memory_bytes_per_device / 1e9:.1f} GB per device at least " \
                f"({rival.layout.describe()})"
            lines.append(f"{label}: {why}")
    return lines


def _tensor_mode_line(chosen: Estimate, ranked: list[Estimate]) -> str | None:
    """How `chosen`'s way of cutting tensor parallelism's matrices compares with the best layout of
    the other kind (1-D against 2-D/2.5-D/3-D) at the same degrees: what each rank sends over its
    tensor-parallel groups, in how long, and what it keeps as activations."""
    lay = chosen.layout
    if lay.tp == 1:
        return None
    rival = next((e for e in ranked if (e.layout.dp, e.layout.tp, e.layout.pp) == (lay.dp, lay.tp, lay.pp)
                  and (e.layout.tp_mode == "1d") != (lay.tp_mode == "1d")), None)
    if rival is None:
        return None

    def mode(e: Estimate) -> str:
        depth = f" (depth {e.layout.tp_depth})" if e.layout.tp_depth > 1 else ""
        return e.layout.tp_mode + depth + (" with sequence parallelism" if e.layout.sequence_parallel else "") + \
            f" ({e.layout.describe()})"

    def spends(e: Estimate) -> str:
        return (f"{e.comm_bytes.get('tp', 0) / 1e9:.2f} GB per rank per step over its tensor-parallel groups "
                f"({_duration(e.comm_seconds.get('tp', 0))}), {e.memory_breakdown['activations'] / 1e9:.2f} GB "
                f"of activations")

    change = rival.step_time_s / chosen.step_time_s - 1
    grid = chosen if lay.tp_mode != "1d" else rival
    why = ("Why: a grid moves blocks of the weights and activations that shrink as the group grows, and gathers every "
           "weight block again for each micro-batch; 1-D moves every token's activations whatever the group's size. "
           "So the grid wins with large groups, slow links and many tokens per micro-batch, 1-D with small groups "
           "over fast links")
    if grid.comm_bytes.get("tp", 0) >= (rival if grid is chosen else chosen).comm_bytes.get("tp", 0):
        why += "; here the grid moves more"
    else:
        why += "; here the grid moves less"
    return (f"tensor parallelism at dp={lay.dp}, tp={lay.tp}, pp={lay.pp} as {mode(chosen)}: {spends(chosen)}; "
            f"as {mode(rival)}: {spends(rival)}, {abs(change):.0%} {'slower' if change >= 0 else 'faster'}. {why}")


def _offload_line(best: Estimate, rejected: list[Estimate]) -> str:
    """Why the parameters leave the device, and what it costs."""
    kept = [e for e in rejected if e.layout.offload_params == "none"]
    smallest = min(kept, key=lambda e: e.memory_bytes_per_device, default=None)
    why = (f"the smallest layout that keeps them needs {smallest.memory_bytes_per_device / 1e9:.1f} GB per device "
           f"({smallest.layout.describe()})") if smallest is not None else "no layout keeps them"
    held = ", ".join(f"{tier} {nbytes / 1e9:.1f} GB" for tier, nbytes in best.tier_bytes.items())
    return (f"parameters offloaded (ZeRO-Infinity), because nothing else fits: {why}. Per device the tiers hold "
            f"{held}; their transfers take {_duration(best.io_s)} per step, {_duration(best.exposed_io_s)} of it "
            f"not hidden behind compute or the optimizer step")


def _shares(e: Estimate) -> str:
    parts = []
    for name, share in e.shares().items():
        group = name.split()[0]
        total = e.comm_seconds.get(group, 0.0) / e.step_time_s if name.endswith("communication") else share
        if total < 0.005:  # nothing, or less than the rounding shows
            continue
        hidden = f" exposed, of {total:.0%} in all (the rest overlaps compute)" if total > share + 0.005 else ""
        parts.append(f"{name} {share:.0%}{hidden}")
    return "of the step (the parts add up to it): " + ", ".join(parts)


def _rate(tflops: float) -> str:
    return f"{tflops:.0f} TFLOP/s" if tflops >= 10 else f"{tflops * 1e3:.0f} GFLOP/s" if tflops < 1 else f"{tflops:.1f} TFLOP/s"


def _duration(seconds: float) -> str:
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms"
