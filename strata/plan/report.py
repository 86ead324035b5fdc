"""The planner's words: `--layout` parsed and checked by the trainer's own rule, the table, the memory chart."""

from __future__ import annotations

from strata.errors import ConfigError, as_flag
from strata.plan.workload import Estimate, Workload
from strata.rules import layout_text
from strata.rules.checkpointing import PLANNED_MODES
from strata.rules.layout import Layout, check_layout, check_transfer_dtypes, data_parallel_degree


def parse_layout(text: str, work: Workload, world: int) -> Layout:
    """'dp=8,tp=8,pp=16,zero=1,mb=1,v=2,ckpt=full,offload=cpu,interleaved,sp,reduce=bf16' (a mixture's
    expert parallelism: ep=8, carved out of dp; context parallelism: cp=4,cp_mode=ulysses): the
    Layout's fields under their keys (strata/rules/layout_text.py, what `describe()` writes), checked
    by the trainer's own layout check: the planner evaluates exactly the layouts `strata train` runs.
    Without dp=, dp is what the world leaves: world / (cp x tp x pp)."""
    try:
        values = layout_text.parse(text, Layout)
    except ConfigError as e:
        raise ConfigError(f"--layout {text}: {e}") from None
    values.setdefault("schedule", "interleaved" if values.get("virtual_stages", 1) > 1 else "1f1b")
    cp, tp, pp = values.get("cp", 1), values.get("tp", 1), values.get("pp", 1)
    for field in ("cp", "tp", "pp"):
        if values.get(field, 1) < 1:
            raise ConfigError(f"--layout {text}: {field}={values[field]}: must be >= 1")
    if "dp" not in values and world % (cp * tp * pp):
        named = "cp x tp x pp" if "cp" in values else "tp x pp"
        raise ConfigError(f"--layout {text}: {named} = {cp * tp * pp} does not divide the cluster's {world} devices")
    layout = Layout(**{"dp": data_parallel_degree(world, cp, tp, pp), **values})
    if layout.checkpointing not in PLANNED_MODES:
        raise ConfigError(f"--layout {text}: ckpt={layout.checkpointing}: the planner prices {', '.join(PLANNED_MODES)}")
    by_field = {f.name: key for key, f in layout_text.keys(Layout).items()}
    try:
        check_transfer_dtypes(layout.reduce_dtype, layout.gather_dtype, work.precision)
        check_layout(work.model, layout, world, work.seq_len, work.global_batch)
    except ConfigError as e:
        raise ConfigError(e.render(lambda field, value: f"--layout {text}: {by_field[field]}={value}"
                                   if field in by_field else as_flag(field, value))) from None
    return layout


def table(estimates: list[Estimate], costs: list | None = None) -> str:
    """One row per layout; with costs (strata/plan/run_cost.RunCosts, one per layout) the ideal run's
    days, device-hours and price too, the expected run's days and the goodput (ideal over expected
    time). A mixture of experts adds its all-to-all (ep) and its experts'
    gradient reduction (edp) to the communication, context parallelism its K/V ring or all-to-alls (cp)."""
    groups = ("tp", "dp", "pp") + (("ep", "edp") if any("ep" in e.comm_seconds for e in estimates) else ()) + \
        (("cp",) if any("cp" in e.comm_seconds for e in estimates) else ())
    head = (f"| layout | fits | GB/device: weights + grads + optimizer + activations + buffers | comm s/step: "
            f"{', '.join(groups)} | bubble | step s | tokens/s | TFLOP/s/device | MFU |")
    extra = [] if not costs else ["days", "device-hours"] + (["price"] if costs[0].ideal.price is not None else []) + \
        ["expected days", "goodput"]
    rows = [head + "".join(f" {name} |" for name in extra), "|" + "---|" * (9 + len(extra))]
    for i, e in enumerate(estimates):
        mem = e.memory_breakdown
        gb = " + ".join(f"{mem[k] / 1e9:.1f}" for k in ("weights", "gradients", "optimizer_states", "activations", "buffers"))
        if mem.get("weight_versions"):  # an asynchronous schedule's stashed weights
            gb += f" + {mem['weight_versions'] / 1e9:.1f} stashed weight versions"
        comm = ", ".join(f"{e.comm_seconds.get(g, 0.0):.3g}" for g in groups)
        rows.append(f"| {e.layout.describe()} | {'yes' if e.fits else 'no'} | {e.memory_bytes_per_device / 1e9:.1f} = {gb} "
                    f"| {comm} | {e.bubble:.1%} | {e.step_time_s:.3g} | {e.tokens_per_s:,.0f} "
                    f"| {e.tflops_per_device:.1f} | {e.mfu:.1%} |" + (_cost_cells(costs[i]) if costs else ""))
    return "\n".join(rows)


def _cost_cells(cost) -> str:
    ideal = cost.ideal
    price = f" {ideal.price:,.0f} |" if ideal.price is not None else ""
    return f" {ideal.train_days:,.1f} | {ideal.device_hours:,.0f} |{price} {cost.expected.train_days:,.1f} | {cost.goodput:.1%} |"


def goodput_lines(cost) -> list[str]:
    """--explain: where the expected run's time beyond the ideal goes, each term as a share of the
    ideal time, so that the shares add up to expected / ideal - 1."""
    lost, ideal_s = cost.losses, cost.ideal.train_days * 86400
    interval = "--save-every" if not lost.young else "no interruptions, so at the end only" if not lost.failure_rate \
        else "Young's interval for one interruption every " + _duration(1 / lost.failure_rate)
    failures = lost.expected_failures(ideal_s)
    why = {"checkpoints": f"{lost.saves:,} saves of {lost.checkpoint_bytes / 1e12:.3g} TB, {lost.save_s:.3g} s each, "
                          f"training waiting (every {lost.save_every:,} steps, {_duration(lost.save_every * lost.step_s)}; "
                          f"{interval})",
           "evaluation": f"{lost.evaluations:,} evaluations, {lost.eval_s:.3g} s each, forward passes only",
           "failures": f"{failures:,.1f} expected interruptions, each {_duration(lost.restart_s)} to restart, "
                       f"{lost.save_s:.3g} s to read the checkpoint back and {_duration(lost.lost_s)} of lost steps "
                       f"on average"}
    lines = [f"the expected run: {cost.expected.train_days:,.1f} days where the ideal takes "
             f"{cost.ideal.train_days:,.1f} (goodput {cost.goodput:.1%}):"]
    return lines + [f"  {name} +{seconds / ideal_s:.1%}: {why[name]}" for name, seconds in lost.seconds().items()]


def _duration(seconds: float) -> str:
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"


def chart(estimates: list[Estimate], path: str, title: str) -> None:
    """Stacked bars of each layout's memory per device, with the device's memory as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = ("weights", "gradients", "optimizer_states", "activations", "buffers")
    parts += ("weight_versions",) if any(e.memory_breakdown.get("weight_versions") for e in estimates) else ()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(estimates)), 4.5))
    bottoms = [0.0] * len(estimates)
    for part in parts:
        values = [e.memory_breakdown.get(part, 0.0) / 1e9 for e in estimates]
        ax.bar(range(len(estimates)), values, bottom=bottoms, label=part.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xticks(range(len(estimates)), [e.layout.describe().replace(",", "\n", 3) for e in estimates], fontsize=7)
    ax.set_ylabel("GB per device")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- serving: strata plan --inference ----------------------------------------------------------
def serving_table(estimates: list) -> str:
    rows = ["| device | layout | fits | GB/device: weights + KV cache | memory ms | compute ms | overhead ms "
            "| tp comm ms | pp comm ms | ms/token | tokens/s |", "|" + "---|" * 11]
    for name, e in estimates:
        rows.append(f"| {name} | {e.describe()} | {'yes' if e.fits else 'no'} | {e.memory_bytes / 1e9:.1f} = "
                    f"{e.weight_bytes / 1e9:.1f} + {e.kv_cache_bytes / 1e9:.2f} | {e.memory_s * 1e3:.2f} "
                    f"| {e.compute_s * 1e3:.2f} | {e.overhead_s * 1e3:.2f} | {e.tp_comm_s * 1e3:.3f} "
                    f"| {e.pp_comm_s * 1e3:.3f} | {e.token_latency_s * 1e3:.2f} | {e.tokens_per_s:,.1f} |")
    return "\n".join(rows)
