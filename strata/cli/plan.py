"""`strata plan`: the planner's table, JSON, explanation and chart for a model on a cluster, for
training or (--inference) serving. The arithmetic is in strata/plan; this reads the user's words.

Handlers import the engine only when they run: parsing flags and `--help` never import torch."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

from strata.cli.parser import PLAN_DEFAULTS
from strata.errors import ConfigError
from strata.plan.cost import estimate
from strata.plan.goodput import GoodputSettings
from strata.plan.hardware import DEVICES, Device
from strata.plan.inference import BYTES, Overheads, Serving, serving_layouts, stack_overheads
from strata.plan.inputs import (
    CPU_LOCAL,
    bandwidth,
    build_cluster,
    check_efficiency,
    check_fp8,
    default_profile_path,
    load_profile,
    workload,
)
from strata.plan.report import chart, goodput_lines, parse_layout, serving_table, table
from strata.plan.run_cost import expected_cost, fastest_days, parse_count, smallest_cluster
from strata.plan.search import distinct, explain, refusal, search
from strata.plan.workload import with_framework
from strata.rules.constants import BUCKET_MB, DEFAULT_EFFICIENCY
from strata.rules.limits import CEILINGS, check_ceiling

# The expected run's settings (strata/plan/goodput.py), read with --tokens; None: GoodputSettings' default
GOODPUT_FLAGS = ("save_every", "eval_every", "eval_batches", "storage_bandwidth", "failure_rate", "restart_minutes")
# The flags only one of plan's modes reads (--nodes has its own line: --inference plans one node)
TRAINING_ONLY = ("global_batch", "seq_len", "optimizer", "bucket_mb", "framework", "layout", "explain", "chart", "no_offload", "allow_async",
                 "network", "nics_per_node", "tokens", "price_per_device_hour", "days", "fp8", "power_cap",
                 *GOODPUT_FLAGS)
SERVING_ONLY = ("batch", "context", "serving_stack", "per_layer_us", "per_token_us")


def plan_command(args, argv: list[str]) -> int:
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: must be >= 1")
    check_ceiling("top", args.top)
    check_mode_flags(args)
    for name, default in PLAN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return run_serving_plan(args) if args.inference else run_plan(args)


def check_mode_flags(args) -> None:
    """A flag the chosen mode (training, or --inference serving) does not read is refused, not dropped."""
    unread = SERVING_ONLY if not args.inference else TRAINING_ONLY
    given = [name for name in unread if getattr(args, name) not in (None, False)]
    if given:
        name = given[0]
        value = getattr(args, name)
        flag = f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
        raise ConfigError(f"{flag}: only {'with' if not args.inference else 'without'} --inference "
                          f"({'serving' if not args.inference else 'training'} plans read it)")


def run_plan(args) -> int:
    from strata.checkpoint.models import resolve_model  # torch comes with checkpoints: only when planning
    model = resolve_model(args.model)
    work = workload(model, args.global_batch, args.seq_len, args.precision, args.optimizer,
                    BUCKET_MB if args.bucket_mb is None else args.bucket_mb, args.fp8)
    if args.framework is not None:  # its switches and its buckets, unless --bucket-mb says otherwise
        work = with_framework(work, args.framework)
        work = work if args.bucket_mb is None else dataclasses.replace(work, bucket_mb=args.bucket_mb)
    tokens, nodes = _check_cost_flags(args)
    goodput = GoodputSettings(**{name: getattr(args, name) for name in GOODPUT_FLAGS
                                 if getattr(args, name) is not None}).check()

    def cluster_of(nodes: int):
        return build_cluster(args.device, nodes, args.gpus_per_node, args.intra, args.network,
                             args.nics_per_node, args.profile, args.efficiency, args.power_cap)
    if args.fp8:  # a device without FP8 is refused before any search
        check_fp8(cluster_of(1).device, args.precision)

    @functools.lru_cache(maxsize=None)  # --days searches the node count it then shows once already
    def searched(nodes: int):
        return search(work, cluster_of(nodes), offload=not args.no_offload, allow_async=args.allow_async)
    if args.days is not None:
        nodes_at_most = CEILINGS["nodes"].value
        floor = fastest_days(work, cluster_of(1).device, nodes_at_most * args.gpus_per_node, tokens)
        if floor > args.days:  # refused at once, not after searching up to the largest cluster
            raise ConfigError(f"--days {args.days:g}: {tokens:.3g} tokens take at least {floor:.3g} days even on "
                              f"{nodes_at_most:,} nodes x {args.gpus_per_node} {args.device} computing at their peak "
                              f"FLOP/s")
        nodes, _ = smallest_cluster(lambda n: next(iter(searched(n)[0]), None), tokens, args.days)
    cluster = cluster_of(nodes)
    if args.layout:
        e = estimate(work, cluster, parse_layout(args.layout, work, cluster.world))
        reason = refusal(e)
        if reason:
            e.notes.append(f"refused: {reason}")
        runs = e.fits and not reason
        shown, ranked, rejected = [e], [e] if runs else [], [] if runs else [e]
    else:
        ranked, rejected = searched(nodes)
        if not ranked:
            smallest = rejected[0] if rejected else None
            tiers = "".join(f" ({n.removeprefix('does not fit: ')})" for n in smallest.notes
                            if n.startswith("does not fit")) if smallest else ""
            need = f"; the smallest layout needs {smallest.memory_bytes_per_device / 1e9:.1f} GB per device " \
                   f"({smallest.layout.describe()}){tiers}" if smallest else ""
            raise ConfigError(f"no layout of {cluster.world} x {cluster.device.name} runs {args.model}{need}")
        shown = distinct(ranked)[:args.top]
    costs = [expected_cost(work, e, tokens, args.gpus_per_node, goodput, args.price_per_device_hour)
             for e in shown] if tokens else None
    if args.json:
        layouts = [{**e.to_json(), **(cost.to_json() if costs else {})} for e, cost in zip(shown, costs or shown)]
        print(json.dumps({"model": args.model, "parameters": model.num_params(), "world": cluster.world,
                          "nodes": nodes, "device": cluster.device.name, "tokens": tokens, "layouts": layouts},
                         indent=1))
    else:
        active = f", {model.active_params() / 1e9:.2f}B active" if model.moe else ""
        print(f"{args.model} ({model.num_params() / 1e9:.2f}B parameters{active}) on {nodes} x {args.gpus_per_node} "
              f"{cluster.device.name}, global batch {work.global_batch} x {work.seq_len} tokens, {work.precision}\n")
        print(table(shown, costs))
        for e in shown:
            for note in e.notes:
                print(f"{e.layout.describe()}: {note}")
        if costs:
            print("\n" + _cost_line(shown[0], costs[0], tokens, nodes, cluster, args))
    if args.explain and (ranked or rejected):
        best = ranked[0] if ranked else rejected[0]
        print("\n" + "\n".join(explain(best, ranked, rejected, cluster)))
    if args.explain and costs:
        print("\n" + "\n".join(goodput_lines(costs[0])))
    if args.chart:
        chart(shown, args.chart, f"{args.model} on {cluster.world} x {cluster.device.name}")
        if not args.json:
            print(f"\nwrote {args.chart}")
    return 0


def _check_cost_flags(args) -> tuple[float | None, int]:
    """(training tokens or None, the nodes to plan for: --nodes, 1, or a placeholder --days replaces)."""
    tokens = parse_count(args.tokens, "--tokens") if args.tokens is not None else None
    if args.price_per_device_hour is not None and not (math.isfinite(args.price_per_device_hour)
                                                       and args.price_per_device_hour >= 0):
        raise ConfigError(f"--price-per-device-hour {args.price_per_device_hour}: must be a price >= 0")
    given = [(f"--{name.replace('_', '-')}", getattr(args, name)) for name in GOODPUT_FLAGS]
    for flag, value in (("--price-per-device-hour", args.price_per_device_hour), ("--days", args.days), *given):
        if value is not None and tokens is None:
            raise ConfigError(f"{flag} {value}: needs --tokens (the tokens the run trains)")
    if args.days is not None:
        if not (math.isfinite(args.days) and args.days > 0):
            raise ConfigError(f"--days {args.days}: must be > 0")
        if args.nodes is not None:
            raise ConfigError(f"--nodes {args.nodes}: --days finds the number of nodes; leave --nodes out")
        if args.layout:
            raise ConfigError(f"--layout {args.layout}: a layout fixes the world size; --days searches it")
    return tokens, args.nodes if args.nodes is not None else 1


def _cost_line(e, cost, tokens: float, nodes: int, cluster, args) -> str:
    ideal, expected = cost.ideal, cost.expected
    price = f", {ideal.price:,.0f} at {args.price_per_device_hour:g} per device-hour" if ideal.price is not None else ""
    within = f" (the fewest nodes within {args.days:g} days)" if args.days is not None else ""
    expected_price = f", {expected.price:,.0f}" if expected.price is not None else ""
    return (f"training {tokens:.3g} tokens with {e.layout.describe()}: {ideal.train_days:,.1f} days on {nodes} x "
            f"{args.gpus_per_node} {cluster.device.name}{within}, {ideal.device_hours:,.0f} device-hours{price}; "
            f"expected with checkpoints, evaluation and failures: {expected.train_days:,.1f} days, "
            f"{expected.device_hours:,.0f} device-hours{expected_price} (goodput {cost.goodput:.1%}; --explain)")


def run_serving_plan(args) -> int:
    """Memory and time per output token of serving a model, per device (comma-separated) and tp x pp."""
    from strata.checkpoint.models import resolve_model  # torch comes with checkpoints: only when planning
    model = resolve_model(args.model)
    context = model.max_seq_len if args.context is None else args.context
    _check_serving_flags(args, model, context)
    names = [n.strip() for n in args.device.split(",") if n.strip()]
    profile = _inference_profile(args, names)
    overheads = _overheads(args, profile)
    work = Serving(model, args.batch, context, args.precision)
    shown, best = [], {}
    for name in names:
        ranked = _serving_layouts_on(name, args, work, overheads, profile)
        if ranked[0].fits:
            best[name] = ranked[0]
        shown += [(name, e) for e in ranked[:args.top]]
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch, "context": context, "precision": args.precision,
                          "overheads": {**dataclasses.asdict(overheads), "per_token_s": overheads.per_step_s},
                          "layouts": [{"device": n, **e.to_json()} for n, e in shown]}, indent=1))
        return 0
    print(f"{args.model} ({model.num_params() / 1e9:.2f}B parameters) serving in {args.precision}, batch {args.batch}, "
          f"{context} tokens of context, on up to {args.gpus_per_node} device(s) each; the stack's fixed cost "
          f"{overheads.per_layer_s * 1e6:.0f} us per layer + {overheads.per_step_s * 1e6:.0f} us per step "
          f"({overheads.source}; per layer {_hidden(overheads)})\n")
    print(serving_table(shown) + "\n")
    print("\n".join(_serving_summary(names, best, args.gpus_per_node)))
    return 0


def _check_serving_flags(args, model, context: int) -> None:
    checks = [(args.batch >= 1, f"--batch {args.batch}: must be >= 1"),
              (1 <= context <= model.max_seq_len, f"--context {context}: must be between 1 and the model's "
                                                   f"{model.max_seq_len}"),
              (args.precision in BYTES, f"--precision {args.precision}: valid for --inference: {', '.join(BYTES)}"),
              (args.nodes in (None, 1), f"--nodes {args.nodes}: --inference plans the devices of one node "
                                f"(set --gpus-per-node)"),
              (args.gpus_per_node >= 1, f"--gpus-per-node {args.gpus_per_node}: must be >= 1"),
              (all(n.strip() for n in args.device.split(",")), f"--device {args.device!r}: name one or more devices, "
                                                              f"comma-separated, with no empty name"),
              *((value is None or 0 <= value < float("inf"), f"--{flag} {value}: must be a number of microseconds >= 0")
                for flag, value in (("per-layer-us", args.per_layer_us), ("per-token-us", args.per_token_us)))]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    for name in ("batch", "gpus_per_node"):
        check_ceiling(name, getattr(args, name))
    check_efficiency(args.efficiency)


def _inference_profile(args, names: list[str]) -> dict | None:
    """What `strata calibrate --inference` measured, when a profile is named or cpu-local is asked for."""
    if not (args.profile or CPU_LOCAL in names):
        return None
    path = args.profile or default_profile_path()
    if not os.path.isfile(path):
        raise ConfigError(f"--profile {path}: no such file; run `strata calibrate --inference` first")
    profile = load_profile(args.profile).get("inference")
    if profile is None:
        raise ConfigError(f"--profile {path}: no inference calibration in it; run `strata calibrate --inference` first")
    return profile


def _overheads(args, profile: dict | None) -> Overheads:
    """The serving stack's fixed costs: its profile (strata's own calibrated where a profile has
    them), or the flags'."""
    overheads = stack_overheads(args.serving_stack or "strata", profile)
    if args.per_layer_us is not None or args.per_token_us is not None:
        overheads = dataclasses.replace(
            overheads, source="given",
            per_layer_s=overheads.per_layer_s if args.per_layer_us is None else args.per_layer_us * 1e-6,
            per_step_s=overheads.per_step_s if args.per_token_us is None else args.per_token_us * 1e-6)
    return overheads


def _serving_layouts_on(name: str, args, work, overheads: Overheads, profile: dict | None) -> list:
    """Every tp x pp on up to --gpus-per-node devices named `name`, fastest first."""
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
    return serving_layouts(work, device, args.gpus_per_node, link, 5e-6, overheads,
                           args.efficiency if args.efficiency is not None else
                           (DEFAULT_EFFICIENCY if name != CPU_LOCAL else 1.0), read_bandwidth)


def _hidden(overheads: Overheads) -> str:
    if overheads.per_layer_on_host:
        return "on the host: hidden behind a GPU's time where shorter, added on cpu-local"
    return "on the device's timeline: added"


def _serving_summary(names: list[str], best: dict, devices: int) -> list[str]:
    lines = []
    for name in names:
        if name not in best:
            lines.append(f"{name}: no layout on {devices} device(s) holds the weights and the KV cache")
            continue
        e = best[name]
        lines.append(f"{name}: {e.describe()} serves it fastest: {e.token_latency_s * 1e3:.2f} ms per output token "
                     f"({e.memory_bytes / 1e9:.1f} GB per device); the stack's fixed cost is {e.fixed_share:.0%} of "
                     f"it ({e.overhead_s * 1e3:.2f} ms): bytes, FLOPs and links alone take {e.bound_s * 1e3:.2f} ms")
    first, *others = [n for n in names if n in best] or [None]
    for name in others:
        ratio = best[name].token_latency_s / best[first].token_latency_s
        lines.append(f"{name} takes {ratio:.2f}x the time per token of {first} "
                     f"({'slower' if ratio > 1 else 'faster'} by {abs(ratio - 1):.0%})")
    return lines
