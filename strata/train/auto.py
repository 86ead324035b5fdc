"""`strata train --parallel auto`: the planner picks dp, tp, pp, ZeRO, the micro-batch, the schedule,
activation checkpointing, context parallelism (cp and its mode) and (for a mixture of experts) ep for
the processes at hand, and says which and why."""

from __future__ import annotations

import os
from dataclasses import fields, replace

import torch

from strata.checkpoint import store
from strata.config import RUN_LAYOUT, TrainConfig, check_run_layout
from strata.errors import ConfigError
from strata.plan.cost import Cluster
from strata.plan.hardware import DEVICES, device_for_cuda_name
from strata.plan.inputs import build_cluster, cpu_local_cluster, default_profile_path, load_profile, workload
from strata.plan.search import explain, search
from strata.rules.dtypes import DTYPES
from strata.rules.layout import Layout
from strata.train.preflight import resume_source

# The layout's fields by what --parallel auto does with them (their `auto` metadata, rules/layout.py):
# "planned", the planner's choice (giving one is refused); "replaced", the planner's choice (the
# user's value only sizes the default global batch); "kept", the user's value, in the chosen layout.
PLANNED = tuple(f.name for f in fields(Layout) if f.metadata["auto"] == "planned")
KEPT = tuple(f.name for f in fields(Layout) if f.metadata["auto"] == "kept")


def local_cluster(processes: int) -> Cluster:
    """The processes of this job on this node: a GPU from the device table when there is one,
    else this CPU as `strata calibrate` measured it."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        match = device_for_cuda_name(name)  # the one table of CUDA names the metrics' MFU reads too
        if match is None:
            raise ConfigError(f"--parallel auto: {name!r} is not in the planner's device table "
                              f"({', '.join(DEVICES)}); choose the layout by hand")
        return build_cluster(match, 1, processes, None, "ib-200")
    if not os.path.isfile(default_profile_path()):
        raise ConfigError(f"--parallel auto: no calibration profile at {default_profile_path()}; "
                          f"run `strata calibrate --nproc {processes}` first")
    return cpu_local_cluster(processes, load_profile(None))


def choose(cfg: TrainConfig, world_size: int, model) -> tuple[TrainConfig, list[str]]:
    """The config with the planner's best runnable layout filled in, and the reasons."""
    given = [name for name in PLANNED if getattr(cfg.layout, name) != getattr(RUN_LAYOUT, name)]
    if given:
        raise ConfigError(f"--parallel auto chooses the layout; drop --{given[0].replace('_', '-')} "
                          f"(or use --parallel manual)")
    precision = cfg.dtype if DTYPES[cfg.dtype].autocast else "fp32"  # what the planner prices
    resumed = resumed_run(cfg)
    global_batch = cfg.global_batch if cfg.global_batch is not None else \
        resumed["global_batch"] if resumed else cfg.layout.micro_batch * world_size
    work = workload(model, global_batch, cfg.seq_len, precision, bucket_mb=cfg.bucket_mb)
    cluster = local_cluster(world_size)
    # the user's own settings (--compress, --offload, the transfer dtypes, ...) on every candidate:
    # priced as they will run
    kept = {name: getattr(cfg.layout, name) for name in KEPT}
    ranked, rejected = search(work, cluster, offload=False, allow_async=cfg.allow_async, compress=False, kept=kept)
    for e in ranked:
        chosen = replace(cfg, parallel="manual", global_batch=global_batch, layout=e.layout)
        try:
            check_run_layout(chosen, world_size, model)
        except ConfigError:
            continue  # a layout the planner allows but this strata does not run
        reasons = explain(e, ranked, rejected, cluster)
        return chosen, [f"--parallel auto chose {chosen.layout.describe()} for {world_size} x {cluster.device.name}: "
                        f"{reasons[0].split(': ', 2)[2]}", *reasons[1:], *replanned(resumed, chosen, world_size)]
    raise ConfigError(f"--parallel auto: no layout of {world_size} x {cluster.device.name} fits this model")


def resumed_run(cfg: TrainConfig) -> dict | None:
    """What the run this one resumes (--resume, --resume auto, a restart) was: its world size and
    global batch (sequences per step, from its data position), or None. With
    --parallel auto and no --global-batch, the resumed run keeps that batch whatever the world size
    now, so losing or adding a node changes the accumulation, not the optimisation."""
    source, _ = resume_source(cfg)
    if source is None:
        return None
    manifest = store.read_state(source)
    layout, position, saved = manifest["layout"], manifest["data_position"], manifest["config"]
    global_batch = position["sequences"] // position["step"] if position["step"] else \
        saved["global_batch"] or saved.get("layout", saved)["micro_batch"] * layout["dp"]  # (flat before [layout])
    known = {f.name for f in fields(Layout)}  # a record written before a field: its default
    world = Layout(**{k: v for k, v in layout.items() if k in known}).world_size
    return {"world": world, "global_batch": global_batch}


def replanned(resumed: dict | None, chosen: TrainConfig, world_size: int) -> list[str]:
    """The line that says the cluster changed since the checkpoint, and what was kept."""
    if resumed is None or resumed["world"] == world_size:
        return []
    lay = chosen.layout
    accumulation = chosen.global_batch // (lay.dp * lay.micro_batch)
    return [f"--parallel auto: the checkpoint was written by {resumed['world']} ranks, this run has {world_size}: "
            f"planned again, the global batch of {chosen.global_batch} sequences kept "
            f"({accumulation} micro-batch{'es' if accumulation > 1 else ''} of {lay.micro_batch} per step on each "
            f"of {lay.dp} data-parallel rank{'s' if lay.dp > 1 else ''})"]
