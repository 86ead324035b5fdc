"""`strata plan`: the table, the JSON, one given layout, the explanation, the memory chart."""

from __future__ import annotations

import json
import os

from strata.errors import ConfigError, as_flag
from strata.plan.cost import Estimate, Workload, estimate
from strata.plan.inputs import build_cluster, resolve_model, workload
from strata.plan.search import distinct, explain, refusal, search
from strata.rules.checkpointing import PLANNED_MODES
from strata.rules.layout import Layout, check_layout

# --layout's keys: the layout's fields under short names
LAYOUT_KEYS = {"dp": ("dp", int), "tp": ("tp", int), "pp": ("pp", int), "v": ("virtual_stages", int),
               "zero": ("zero", int), "mb": ("micro_batch", int), "ckpt": ("checkpointing", str),
               "offload": ("offload", str), "schedule": ("schedule", str), "sp": ("sequence_parallel", bool)}
KEY_OF_FIELD = {field: key for key, (field, _) in LAYOUT_KEYS.items()}
PLANNED_OFFLOAD = ("none", "cpu")  # what the cost model prices (disk: not yet)


def parse_layout(text: str, work: Workload, world: int) -> Layout:
    """'dp=8,tp=8,pp=16,zero=1,mb=1,v=2,ckpt=full,offload=cpu,schedule=interleaved,sp', checked by
    the trainer's own layout check: the planner evaluates exactly the layouts `strata train` runs."""
    values = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout {text}: unknown key {key!r}; valid: {', '.join(LAYOUT_KEYS)}")
        field, kind = LAYOUT_KEYS[key]
        try:
            values[field] = True if kind is bool else kind(value)
        except ValueError:
            raise ConfigError(f"--layout {text}: {key}={value} is not a number") from None
    values.setdefault("schedule", "interleaved" if values.get("virtual_stages", 1) > 1 else "1f1b")
    tp, pp = values.get("tp", 1), values.get("pp", 1)
    for field in ("tp", "pp"):
        if values.get(field, 1) < 1:
            raise ConfigError(f"--layout {text}: {field}={values[field]}: must be >= 1")
    if "dp" not in values and world % (tp * pp):
        raise ConfigError(f"--layout {text}: tp x pp = {tp * pp} does not divide the cluster's {world} devices")
    layout = Layout(**{"dp": world // (tp * pp), **values})
    if layout.checkpointing not in PLANNED_MODES:
        raise ConfigError(f"--layout {text}: ckpt={layout.checkpointing}: the planner prices {', '.join(PLANNED_MODES)}")
    if layout.offload not in PLANNED_OFFLOAD:
        raise ConfigError(f"--layout {text}: offload={layout.offload}: the planner prices {', '.join(PLANNED_OFFLOAD)}")
    try:
        check_layout(work.model, layout, world, work.seq_len, work.global_batch)
    except ConfigError as e:
        raise ConfigError(e.render(lambda field, value: f"--layout {text}: {KEY_OF_FIELD[field]}={value}"
                                   if field in KEY_OF_FIELD else as_flag(field, value))) from None
    return layout


def table(estimates: list[Estimate]) -> str:
    head = ("| layout | fits | GB/device: weights + grads + optimizer + activations + buffers | comm s/step: tp, dp, pp "
            "| bubble | step s | tokens/s | TFLOP/s/device | MFU |")
    rows = [head, "|" + "---|" * 9]
    for e in estimates:
        mem = e.memory_breakdown
        gb = " + ".join(f"{mem[k] / 1e9:.1f}" for k in ("weights", "gradients", "optimizer_states", "activations", "buffers"))
        comm = ", ".join(f"{e.comm_seconds[g]:.3g}" for g in ("tp", "dp", "pp"))
        rows.append(f"| {e.layout.describe()} | {'yes' if e.fits else 'no'} | {e.memory_bytes_per_device / 1e9:.1f} = {gb} "
                    f"| {comm} | {e.bubble:.1%} | {e.step_time_s:.3g} | {e.tokens_per_s:,.0f} "
                    f"| {e.tflops_per_device:.1f} | {e.mfu:.1%} |")
    return "\n".join(rows)


def chart(estimates: list[Estimate], path: str, title: str) -> None:
    """Stacked bars of each layout's memory per device, with the device's memory as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = ("weights", "gradients", "optimizer_states", "activations", "buffers")
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(estimates)), 4.5))
    bottoms = [0.0] * len(estimates)
    for part in parts:
        values = [e.memory_breakdown[part] / 1e9 for e in estimates]
        ax.bar(range(len(estimates)), values, bottom=bottoms, label=part.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xticks(range(len(estimates)), [e.layout.describe().replace(",", "\n", 3) for e in estimates], fontsize=7)
    ax.set_ylabel("GB per device")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_plan(args) -> int:
    model = resolve_model(args.model)
    work = workload(model, args.global_batch, args.seq_len, args.precision, args.optimizer)
    cluster = build_cluster(args.device, args.nodes, args.gpus_per_node, args.intra, args.network,
                            args.nics_per_node, args.profile, args.efficiency)
    if args.layout:
        e = estimate(work, cluster, parse_layout(args.layout, work, cluster.world))
        reason = refusal(e)
        if reason:
            e.notes.append(f"refused: {reason}")
        runs = e.fits and not reason
        shown, ranked, rejected = [e], [e] if runs else [], [] if runs else [e]
    else:
        ranked, rejected = search(work, cluster, offload=not args.no_offload)
        if not ranked:
            smallest = rejected[0] if rejected else None
            need = f"; the smallest layout needs {smallest.memory_bytes_per_device / 1e9:.1f} GB per device " \
                   f"({smallest.layout.describe()})" if smallest else ""
            raise ConfigError(f"no layout of {cluster.world} x {cluster.device.name} runs {args.model}{need}")
        shown = distinct(ranked)[:args.top]
    if args.json:
        print(json.dumps({"model": args.model, "parameters": model.num_params(), "world": cluster.world,
                          "device": cluster.device.name,
                          "layouts": [e.to_json() for e in shown]}, indent=1))
    else:
        print(f"{args.model} ({model.num_params() / 1e9:.2f}B parameters) on {args.nodes} x {args.gpus_per_node} "
              f"{cluster.device.name}, global batch {work.global_batch} x {work.seq_len} tokens, {work.precision}\n")
        print(table(shown))
        for e in shown:
            for note in e.notes:
                print(f"{e.layout.describe()}: {note}")
    if args.explain and (ranked or rejected):
        best = ranked[0] if ranked else rejected[0]
        print("\n" + "\n".join(explain(best, ranked, rejected, cluster)))
    if args.chart:
        chart(shown, args.chart, f"{args.model} on {cluster.world} x {cluster.device.name}")
        if not args.json:
            print(f"\nwrote {args.chart}")
    return 0


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


def run_serving_plan(args) -> int:
    """Memory and time per output token of serving a model, per device (comma-separated) and tp x pp."""
    from strata.plan.hardware import DEVICES, Device
    from strata.plan.inference import BYTES, Overheads, Serving, serving_layouts
    from strata.plan.inputs import CPU_LOCAL, bandwidth, default_profile_path, load_profile
    model = resolve_model(args.model)
    context = model.max_seq_len if args.context is None else args.context
    checks = [(args.batch >= 1, f"--batch {args.batch}: must be >= 1"),
              (1 <= context <= model.max_seq_len, f"--context {context}: must be between 1 and the model's "
                                                   f"{model.max_seq_len}"),
              (args.precision in BYTES, f"--precision {args.precision}: valid for --inference: {', '.join(BYTES)}"),
              (args.nodes == 1, f"--nodes {args.nodes}: --inference plans the devices of one node "
                                f"(set --gpus-per-node)"),
              (args.gpus_per_node >= 1, f"--gpus-per-node {args.gpus_per_node}: must be >= 1"),
              (any(n.strip() for n in args.device.split(",")), f"--device {args.device!r}: name one or more devices"),
              *((value is None or 0 <= value < float("inf"), f"--{flag} {value}: must be a number of microseconds >= 0")
                for flag, value in (("per-layer-us", args.per_layer_us), ("per-token-us", args.per_token_us)))]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    names = [n.strip() for n in args.device.split(",") if n.strip()]
    profile = None
    if args.profile or CPU_LOCAL in names:
        if not os.path.isfile(args.profile or default_profile_path()):
            raise ConfigError(f"--profile {args.profile or default_profile_path()}: no such file; "
                              f"run `strata calibrate --inference` first")
        profile = load_profile(args.profile).get("inference")
        if profile is None:
            raise ConfigError(f"--profile {args.profile or default_profile_path()}: no inference calibration in it; "
                              f"run `strata calibrate --inference` first")
    overheads = Overheads()
    if profile is not None:
        overheads = Overheads(profile["per_layer_s"], profile["per_token_s"], f"calibrated on {profile['device']}")
    if args.per_layer_us is not None or args.per_token_us is not None:
        overheads = Overheads(overheads.per_layer_s if args.per_layer_us is None else args.per_layer_us * 1e-6,
                              overheads.per_token_s if args.per_token_us is None else args.per_token_us * 1e-6, "given")
    work = Serving(model, args.batch, context, args.precision)
    shown, best = [], {}
    for name in names:
        read_bandwidth = ()
        if name == CPU_LOCAL:
            read_bandwidth = tuple(sorted((float(b), bw) for b, bw in profile["decode_bandwidth"].items()))
            device = Device(CPU_LOCAL, profile["memory_bytes"], {args.precision: profile["matmul_flops"]},
                            profile["memory_bandwidth"], None)
            link = 1e9  # processes on one machine: shared memory (TP is not worth it on one CPU)
        elif name in DEVICES:
            device = DEVICES[name]
            link = bandwidth(args.intra or ("nvlink" if device.nvlink_bandwidth else "pcie"), "--intra", device)
        else:
            raise ConfigError(f"--device {name}: valid: {', '.join([*DEVICES, CPU_LOCAL])}")
        ranked = serving_layouts(work, device, args.gpus_per_node, link, 5e-6, overheads,
                                 args.efficiency or (0.63 if name != CPU_LOCAL else 1.0), read_bandwidth)
        if ranked[0].fits:
            best[name] = ranked[0]
        shown += [(name, e) for e in ranked[:args.top]]
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch, "context": context, "precision": args.precision,
                          "overheads": overheads.__dict__,
                          "layouts": [{"device": n, **e.to_json()} for n, e in shown]}, indent=1))
        return 0
    print(f"{args.model} ({model.num_params() / 1e9:.2f}B parameters) serving in {args.precision}, batch {args.batch}, "
          f"{context} tokens of context, on up to {args.gpus_per_node} device(s) each; overheads "
          f"{overheads.per_layer_s * 1e6:.0f} us per layer + {overheads.per_token_s * 1e6:.0f} us per token "
          f"({overheads.source})\n")
    print(serving_table(shown))
    print()
    for name in names:
        if name not in best:
            print(f"{name}: no layout on {args.gpus_per_node} device(s) holds the weights and the KV cache")
            continue
        e = best[name]
        print(f"{name}: {e.describe()} serves it fastest: {e.token_latency_s * 1e3:.2f} ms per output token "
              f"({e.memory_bytes / 1e9:.1f} GB per device)")
    if len(best) > 1:
        first, *others = [n for n in names if n in best]
        for name in others:
            ratio = best[name].token_latency_s / best[first].token_latency_s
            print(f"{name} takes {ratio:.2f}x the time per token of {first} "
                  f"({'slower' if ratio > 1 else 'faster'} by {abs(ratio - 1):.0%})")
    return 0
