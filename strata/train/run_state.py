"""A run's state in and out of layout-free checkpoints: resuming (--resume, a restart) or starting
from one's weights (--init-from), saving, and the whole logical model for the caller."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

from strata.checkpoint import shards, store
from strata.distributed import comm
from strata.errors import ConfigError
from strata.parallel.expert import gather_experts
from strata.parallel.tensor import gather_tensor_parallel, shard_specs
from strata.train.preflight import check_same_model, resume_source
from strata.train.run import Run


def restore(run: Run) -> None:
    """Resume from a checkpoint (--resume, --resume auto, a restart), or start from one's weights."""
    source, _ = resume_source(run.cfg)  # the launcher (or rank 0, see preflight) printed how it was found
    if source is not None:
        state = load_checkpoint(run, source, resume=True)
        run.state.start_step = state["step"]
        if run.scaler is not None and "loss_scaler" in state:
            run.scaler.load_state_dict(state["loss_scaler"])
        if run.rank == 0:
            print(f"resuming from {store.resolve(source)} at step {run.state.start_step}", file=sys.stderr, flush=True)
    elif run.cfg.init_from:
        load_checkpoint(run, run.cfg.init_from, resume=False)


def load_checkpoint(run: Run, source: str, resume: bool) -> dict:
    """Fill this rank's pieces from a checkpoint saved under any layout; with resume, also Adam's
    moments and this rank's random streams. Returns the manifest."""
    path, manifest, reader = store.open_checkpoint(source)
    check_same_model(store.model_config(manifest, path), run.model_cfg, path)
    with reader, run.parallel.in_memory():
        restored = shards.load_pieces(reader, run.pieces, run.optimizer if resume else None, run.rank)
        if resume and not restored:
            raise ConfigError(f"--resume {source}: the checkpoint holds no optimizer state "
                              f"(a converted model?); use --init-from to start training from its weights")
        if resume and reader.rngs:  # the same rank's streams; under a smaller old world, rank 0's
            shards.set_rng_state(reader.rngs.get(run.rank, reader.rngs[0]))
        run.parallel.after_step()  # ZeRO-1/2: gather every rank's loaded shard into the parameters
        if run.versions:
            _restore_versions(run, reader, manifest.get("data_position", {}).get("step", manifest["step"])
                              if resume else 0)
    run.state.hf_origin = manifest.get("hf")  # so --to-hf and generate still know the model it came from
    return manifest


def _restore_versions(run: Run, reader: shards.ShardReader, step: int) -> None:
    """An asynchronous schedule's older weights, as the checkpoint saved them; one saved without
    them (by a synchronous schedule, or by --init-from's new start) starts the rule afresh, every
    version the loaded weights."""
    tp_rank = dist.get_rank(run.tp_group) if run.tp_group is not None else 0
    for versions in run.versions:
        older = {age: {name: reader.read(shards.version_kind(age), name,
                                         shards.box_region(run.parallel, p, tp_rank, run.dims.tp))
                       for name, p in zip(versions.names, versions.params)}
                 for age in range(1, min(versions.delay, step) + 1)
                 if all(reader.has_version(age, name) for name in versions.names)}
        missing = min(versions.delay, step) - len(older)
        if missing and run.rank == 0:
            print(f"note: the checkpoint holds no weights older than its last update for {missing} of the "
                  f"versions --schedule {run.cfg.layout.schedule} computes with; they start as the loaded weights",
                  file=sys.stderr, flush=True)
        versions.restore(step, older)


def save_checkpoint(run: Run, step: int) -> str:
    """Snapshot this rank's pieces and hand them to the checkpointer (which may write them in the
    background)."""
    older = {}
    for versions in run.versions or ():  # the stages (emulated in one process) hold disjoint parameters
        for age, weights in versions.older().items():
            older.setdefault(age, {}).update(weights)
    with run.parallel.in_memory():
        tensors, meta = shards.snapshot(run.pieces, run.optimizer, older)
    state = {"config": run.cfg.to_dict(), "model_config": run.model_cfg.to_dict(), "layout": layout(run),
             "data_position": {"step": step, "sequences": step * run.cfg.global_batch}}
    if run.scaler is not None:
        state["loss_scaler"] = run.scaler.state_dict()
    if run.state.hf_origin is not None:
        state["hf"] = run.state.hf_origin
    tokenizer = os.path.join(run.cfg.data, "tokenizer.json")
    return run.checkpointer.save(step, tensors, meta, state, (tokenizer,) if os.path.isfile(tokenizer) else ())


def full_model_state(run: Run) -> dict[str, torch.Tensor]:
    """The logical model's tensors (every rank takes part: ZeRO-3 and tensor parallelism gather)."""
    state = run.parallel.full_state_dict()
    if run.tp_group is not None:
        state = gather_tensor_parallel(state, shard_specs(run.model), run.tp_group)
    if run.expert_axes is not None:
        names = run.parallel.sharding.expert_names  # empty where this stage holds no MoE layer
        state = gather_experts(state, shard_specs(run.model), names, run.expert_axes)
    if run.pp_group is not None:  # every stage's layers (a tied embedding's copies are equal)
        stages = comm.gather_objects({k: v.cpu() for k, v in state.items()}, run.pp_group, "pp")
        state = {k: v.to(run.device) for stage in stages for k, v in stage.items()}
    return state


def layout(run: Run) -> dict:
    """The layout, as a checkpoint records it: every field of the run's resolved Layout, and the
    pipeline's cut (any layout loads any checkpoint)."""
    blocks = list(run.stage_layout.blocks_per_chunk) if run.stage_layout else None
    return {**asdict(run.cfg.layout), "blocks_per_chunk": blocks}
