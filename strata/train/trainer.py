"""`strata train`: set up the layout, the model, the data and the optimizer, then run the loop."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.checkpoint import shards, store
from strata.config import TrainConfig, sequence_length
from strata.data.loader import BatchLoader, TokenSource, open_split, synthetic_split
from strata.distributed import comm
from strata.distributed.mesh import Mesh, ParallelDims, init_distributed, pick_device, process_groups, release_groups
from strata.distributed.timing import synchronize_stream
from strata.errors import ConfigError
from strata.memory import tiers
from strata.memory.activations import count_saved_activations
from strata.memory.offload import StreamingAdamW
from strata.parallel.apply import compile_seconds, parallelize
from strata.parallel.expert import ExpertAxes, routed_rows
from strata.parallel.pipeline.executor import PipelineExecutor
from strata.parallel.pipeline.stage import chunk_views, stage_parameters
from strata.parallel.pipeline.timeline import gather_timeline, write_trace
from strata.parallel.pipeline.versions import WeightVersions
from strata.parallel.tensor_nd import GridGroups
from strata.rules.dtypes import DTYPES, parameter_dtype, torch_dtype
from strata.rules.pipeline_cut import make_layout
from strata.rules.pipeline_wire import activation_wire
from strata.rules.schedules import SCHEDULES
from strata.rules.tensor_modes import grid_of
from strata.train import metrics as m
from strata.train.log import RunLog
from strata.train.loss_scale import LossScaler
from strata.train.optim import build_optimizer, lr_at, offload_dir
from strata.train.preflight import saves_after
from strata.train.run import Run
from strata.train.run_state import full_model_state, restore, save_checkpoint
from strata.train.spec import RunSpec, check_files, resolve


def load_data(cfg: TrainConfig, split: str, vocab_size: int) -> TokenSource:
    if cfg.data == "synthetic":
        return synthetic_split(vocab_size, cfg.seed, split)
    return open_split(cfg.data, split)


def setup(run_input: TrainConfig | RunSpec, checked: bool = False) -> Run:
    """Everything the loop needs: the process groups, the data, the model split and wrapped for
    this rank, the optimizer, and the state to start from. run_input: the spec the launcher resolved
    (strata/train/spec.py), or a config this process resolves itself, as its own launcher (one
    process, a rank torchrun started by hand, the tests). checked: the run's files were checked
    already (train/preflight.py), in this process."""
    given = run_input.config if isinstance(run_input, RunSpec) else run_input
    device = pick_device(given.device)
    rank, world_size, owns_process_group = init_distributed(device, given.timeout, given.comm_semantics)
    groups_before = process_groups()
    spec = _spec_here(run_input, world_size, rank, checked)
    cfg, lay = spec.config, spec.config.layout  # the caller's config is left as it was given
    dims = ParallelDims(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, shards=lay.shards)
    mesh = Mesh.build(dims, rank, device.type, cfg.timeout)
    groups = mesh.groups
    experts = ExpertAxes(*mesh.expert_axes(lay.ep)) if lay.ep > 1 else None
    grid = grid_of(lay.tp_mode, lay.tp, lay.tp_depth)
    grid_groups = GridGroups(grid, mesh.coordinate("tp"), mesh.tensor_axes(grid)) if grid.mode != "1d" else None
    dp_rank, tp_rank, pp_rank = (mesh.coordinate(d) for d in ("dp", "tp", "pp"))
    train_source = load_data(cfg, "train", cfg.vocab_size or spec.model.vocab_size)
    val_source = load_data(cfg, "val", cfg.vocab_size or spec.model.vocab_size)
    # A real data set brings its tokenizer's vocabulary; the preset gives the rest of the shape.
    model_cfg = spec.model.with_overrides(vocab_size=train_source.vocab_size)
    seq_len = sequence_length(cfg, model_cfg)
    stage_layout = make_layout(model_cfg, lay.pp, lay.virtual_stages, seq_len, lay.pp_split) if dims.pp > 1 else None
    torch.manual_seed(cfg.seed)
    model, parallel = parallelize(model_cfg, cfg, device, parameter_dtype(cfg.dtype), groups["dp"], groups["tp"],
                                  (stage_layout, pp_rank, groups["pp"]) if stage_layout is not None else None,
                                  offload_dir(cfg), rank, grid_groups, experts, mesh.context_axis(),
                                  (groups["dp_shard"], groups["dp_replicate"]) if groups["dp_shard"] else None,
                                  mesh.node_axis(lay.hpz_partition_size))
    optimizer = build_optimizer(*parallel.optimizer_param_groups(), cfg, rank,
                                parallel.sharding.stream_units if lay.offload_params != "none" else None,
                                parallel.sharding)
    versions = _weight_versions(cfg, model, model_cfg, stage_layout, pp_rank, seq_len) \
        if SCHEDULES[lay.schedule].asynchronous else None
    run = Run(cfg, model_cfg, device, rank, world_size, dims, dp_rank, groups["dp"], groups["tp"], model, parallel,
              optimizer, BatchLoader(train_source, seq_len, cfg.global_batch, cfg.seed, "train", dp_rank, dims.dp, device),
              BatchLoader(val_source, seq_len, cfg.global_batch, cfg.seed, "val", dp_rank, dims.dp, device),
              shards.local_pieces(model, parallel, tp_rank, dims.tp, dp_rank == tp_rank == mesh.coordinate("cp") == 0),
              owns_process_group, groups_before,
              scaler=LossScaler(cfg.loss_scale, cfg.loss_scale_window, device, min_scale=cfg.min_loss_scale)
              if cfg.dtype == "fp16" else None,
              checkpointer=store.Checkpointer(cfg.save, rank, world_size, mesh.side_group(), cfg.keep, cfg.async_save)
              if cfg.save else None, versions=versions, expert_axes=experts,
              **(_pipeline(cfg, model, model_cfg, stage_layout, pp_rank, mesh, seq_len, device, versions)
                 if stage_layout is not None else {}))
    restore(run)
    return run


def _spec_here(run_input: TrainConfig | RunSpec, world_size: int, rank: int, checked: bool) -> RunSpec:
    """The launcher's spec, for the world it was resolved for; or this process's own resolution.
    The run's files are checked here unless the launcher (or this process's caller) did."""
    if not isinstance(run_input, RunSpec):
        run_input = resolve(run_input, world_size, announce=rank == 0)
    if run_input.world_size != world_size:
        raise ConfigError(f"the run's spec was resolved for {run_input.world_size} processes, and {world_size} "
                          f"were launched")
    return run_input if checked or run_input.files_checked else check_files(run_input, announce=rank == 0)


def _pipeline(cfg: TrainConfig, model, model_cfg, stage_layout, pp_rank: int, mesh: Mesh, seq_len: int, device,
              versions) -> dict:
    """The pipeline's wiring of this rank: its group and links, the executor of its chunks."""
    lay = cfg.layout
    # what passes between stages: the hidden states of this rank's chunks of the sequence (1/cp),
    # 1/tp of them under sequence parallelism,
    # this rank's sequences and features under multi-dimensional tensor parallelism; in the dtype of
    # the wire (16 bits under mixed precision), whatever dtype the stages compute in
    grid = grid_of(lay.tp_mode, lay.tp, lay.tp_depth)
    shape = (lay.micro_batch // grid.batch_parts, seq_len // lay.cp // (lay.tp if lay.sequence_parallel else 1),
             model_cfg.d_model // grid.hidden_parts)
    links = mesh.pipeline_links(wraps=stage_layout.virtual_stages > 1)
    pp_group = mesh.groups["pp"]
    executor = PipelineExecutor(chunk_views(model, stage_layout, pp_rank), stage_layout, lay.schedule, pp_group,
                                links, shape, torch_dtype(activation_wire(cfg.dtype)), device,
                                lambda: autocast_for(cfg, device),
                                model, versions[0] if versions else None)
    return {"pp_group": pp_group, "stage_layout": stage_layout, "pipeline": executor,
            "embedding_group": mesh.embedding_group() if model_cfg.tie_embeddings else None}


def _weight_versions(cfg: TrainConfig, model, model_cfg, stage_layout, pp_rank: int,
                     seq_len: int) -> list[WeightVersions]:
    """The weight versions an asynchronous schedule stashes: this rank's stage's, or in one process
    each emulated stage's (--emulate-stages P runs the version rule of P stages), with its delay."""
    spec = SCHEDULES[cfg.layout.schedule]
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if stage_layout is not None:
        return [WeightVersions(trainable, spec.delay(cfg.layout.pp, pp_rank))]
    if cfg.emulate_stages == 1:
        return [WeightVersions(trainable, spec.delay(1, 0))]
    emulated = make_layout(model_cfg, cfg.emulate_stages, 1, seq_len, cfg.layout.pp_split)
    return [WeightVersions(named, spec.delay(cfg.emulate_stages, stage))
            for stage, named in enumerate(stage_parameters(model, emulated))]


def autocast(run: Run):
    return autocast_for(run.cfg, run.device)


def autocast_for(cfg: TrainConfig, device: torch.device):
    if DTYPES[cfg.dtype].autocast:
        return torch.autocast(device.type, dtype=torch_dtype(cfg.dtype))
    return contextlib.nullcontext()


def train_step(run: Run, step: int) -> tuple[float, float, dict[str, int]]:
    """One optimizer step: forward/backward over this rank's micro-batches, gradients averaged over
    data-parallel ranks, clipping by the global norm, AdamW. Returns (loss, grad_norm, the model
    state bytes at their peak: after the update, before the gradients are freed); an fp16 step
    whose gradients overflowed is skipped on every rank and reports an infinite norm."""
    cfg, model = run.cfg, run.model
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    micro_batches = run.train_data.micro_batches(step, cfg.layout.micro_batch)
    scale = run.scaler.scale if run.scaler is not None else 1.0
    if model.router_losses is not None:  # the auxiliary loss's gradient scaled as the loss's is
        model.router_losses.grad_scale = scale * run.parallel.loss_factor / len(micro_batches)
    if run.pipeline is not None:
        run.pipeline.loss_scale = scale * run.parallel.loss_factor
        loss_sum = pipeline_forward_backward(run, micro_batches)
    else:
        loss_sum = forward_backward(run, step, micro_batches, scale)
    if run.dp_group is not None:
        comm.all_reduce(loss_sum, run.dp_group, "dp")
        loss_sum /= run.dims.replicas
    mean_loss = loss_sum / len(micro_batches)
    if model.router_losses is not None:
        run.state.routed = m.routed(run, len(micro_batches))
        m.balance_experts(run)
    if run.scaler is not None:  # fp16: the loss may overflow with the gradients; the scaler decides
        finite = run.scaler.unscale_and_check(run.parallel.local_grads())
        run.scaler.update(finite)
        run.state.skipped = not finite
        if not finite:  # on every rank alike: the weights and Adam's moments stay as they were
            states = run.parallel.state_bytes(run.optimizer)
            run.parallel.zero_grad()
            return mean_loss.item(), float("inf"), states
    grad_norm = run.parallel.grad_norm()
    # the step's one read of the device: the loss and the norm together (both global, so every
    # rank stops alike when one is not finite, before the update)
    loss, norm = torch.stack([mean_loss, grad_norm.double()]).tolist()
    for what, value in (("loss", loss), ("gradient norm", norm))[run.scaler is not None:]:  # fp16: the scaler's
        if not math.isfinite(value):
            raise FloatingPointError(f"step {step + 1}: the {what} is {value}; stopped before the update "
                                     f"({divergence_advice(cfg.dtype)})")
    if cfg.grad_clip > 0:
        run.parallel.clip_(cfg.grad_clip, grad_norm)
    return loss, norm, update(run)


def forward_backward(run: Run, step: int, micro_batches: list, scale: float) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches without a pipeline, the gradients
    accumulated (and reduced as the data-parallel strategy does); the sum of their losses."""
    model = run.model
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    for versions in run.versions or ():  # weight stashing in one process: the reference of the rule
        versions.use_step(step)
    for i, (inputs, targets) in enumerate(micro_batches):
        # Shapes never change: count what a micro-batch saves for backward once (hooks cost time).
        count = run.state.activation_bytes is None
        with run.parallel.backward(is_last_micro_batch=i == len(micro_batches) - 1), autocast(run), \
                count_saved_activations(model) if count else contextlib.nullcontext() as saved:
            loss = model(inputs.to(run.device), targets.to(run.device))
            if count:
                run.state.activation_bytes = saved.bytes
            # Every micro-batch has the same number of tokens: the mean of means is the batch mean.
            # (the average over micro-batches and over the data-parallel ranks: their reductions sum)
            (loss * (scale * run.parallel.loss_factor / len(micro_batches))).backward()
        loss_sum += loss.detach().double()
    for versions in run.versions or ():
        versions.use_masters()
    return loss_sum


def divergence_advice(dtype: str) -> str:
    """What to try when a loss or a gradient norm stops being finite, for the run's precision (never
    the one it has: a bf16 run is not told to use bf16)."""
    return {"fp16": "lower --lr, or use bf16 (fp16 overflows above 65504)",
            "bf16": "lower --lr or --grad-clip, or try fp32 (bf16 keeps 8 significant bits)"}.get(
        dtype, "lower --lr or --grad-clip, or add --warmup-steps")


def update(run: Run) -> dict[str, int]:
    """The optimizer step on the accumulated (reduced, clipped) gradients; a new weight version
    under an asynchronous schedule. Returns the model-state bytes at their peak: after the update,
    before the gradients are freed."""
    started = time.perf_counter()
    run.parallel.prepare_step()
    run.optimizer.step()
    run.parallel.after_step()
    synchronize_stream(run.device)  # its kernels, not the next step's, own the time
    run.state.update_s = time.perf_counter() - started
    if run.versions:  # the stash copies the updated weights: ZeRO-1's gathers of them must be done
        run.parallel.sharding.wait_parameters()
    for versions in run.versions or ():
        versions.updated()
    states = run.parallel.state_bytes(run.optimizer)
    if run.versions:
        states["versions"] = sum(v.stash_bytes() for v in run.versions)
    run.parallel.zero_grad()
    return states


@dataclass
class PendingMetrics:
    """An asynchronous pipeline step's loss and gradient norm: known on the last stage and summed
    over the stages by a reduction that completes in the background (waiting for it at the end of
    the step would make every stage wait for the first, the flush the schedule removes)."""
    step: int
    sums: torch.Tensor  # (loss sum over micro-batches, squared gradient norm)
    work: object
    micro_batches: int

    def wait(self) -> tuple[float, float]:
        self.work.wait()
        loss = self.sums[0].item() / self.micro_batches
        grad_norm = math.sqrt(self.sums[1].item())
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # every rank alike: the sums were reduced
            raise FloatingPointError(f"step {self.step + 1}: the loss is {loss} and the gradient norm {grad_norm} "
                                     f"(an asynchronous schedule learns it a step late); lower --lr")
        return loss, grad_norm


def async_pipeline_step(run: Run, step: int) -> tuple[PendingMetrics, dict[str, int]]:
    """One step of an asynchronous schedule (PipeDream-2BW, PipeDream): this rank's segment of the
    flushless pipeline, its data-parallel reduction and its own update, without meeting the other
    stages (but through the activations, and a tied embedding's gradient sum)."""
    cfg = run.cfg
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    per_step = cfg.global_batch // (cfg.layout.micro_batch * run.dims.dp)  # micro-batches of a step on this rank
    steps: dict[int, list] = {}  # the steps whose micro-batches this segment reads: this one and later ones

    def micro_batch(k: int):
        if k // per_step not in steps:
            steps[k // per_step] = run.train_data.micro_batches(k // per_step, cfg.layout.micro_batch)
        return steps[k // per_step][k % per_step]

    run.pipeline.loss_scale = run.parallel.loss_factor
    with run.parallel.backward(is_last_micro_batch=False):
        pause = next(s for s in range(step + 1, cfg.steps + 1) if pauses_after(cfg, s))
        loss_sum = run.pipeline.segment(micro_batch, per_step, step, fill=run.state.drained, stop=pause * per_step)
    run.state.drained = pause == step + 1
    if run.embedding_group is not None:
        comm.all_reduce(run.model.tied_weight().grad, run.embedding_group, "embedding")
    run.parallel.reduce_gradients()
    if run.dp_group is not None:
        comm.all_reduce(loss_sum, run.dp_group, "dp")
        loss_sum /= run.dims.replicas
    sums = torch.stack([loss_sum, run.parallel.grad_squares()])
    work = comm.all_reduce(sums, run.pp_group, "pp", async_op=True)
    return PendingMetrics(step, sums, work, per_step), update(run)


def pipeline_forward_backward(run: Run, micro_batches) -> torch.Tensor:
    """The schedule, with gradients accumulating untouched; then the tied embedding's two copies
    get the sum of their gradients and data parallelism reduces. Returns the loss sum on every rank."""
    with run.parallel.backward(is_last_micro_batch=False):
        loss_sum = run.pipeline.step(micro_batches)
    run.parallel.reduce_gradients(run.embedding_group)  # with the tied embedding's sum (parallel/data.py)
    comm.all_reduce(loss_sum, run.pp_group, "pp")  # only the last stage had it
    return loss_sum


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean validation loss over eval_batches fixed batches (the same ones every time) of
    global-batch sequences each, so the number does not depend on the layout."""
    run.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    count = 0
    for batch_index in range(run.cfg.eval_batches):
        for inputs, targets in run.val_data.micro_batches(batch_index, run.cfg.layout.micro_batch):
            count += 1
            if run.pipeline is not None:
                total += run.pipeline.forward_only(inputs, targets)
                continue
            with autocast(run):
                total += run.model(inputs.to(run.device), targets.to(run.device)).double()
    if run.pp_group is not None:  # only the last stage has the loss
        comm.all_reduce(total, run.pp_group, "pp")
    if run.dp_group is not None:
        comm.all_reduce(total, run.dp_group, "dp")
        total /= run.dims.replicas
    run.model.train()
    return (total / count).item()


def train(run_input: TrainConfig | RunSpec, keep_state: bool = False, checked: bool = False) -> dict:
    """Run training (a spec the launcher resolved, or a config: see `setup`); returns a summary:
    losses, validation losses, the metrics records, the final checkpoint, and with keep_state the
    full final parameters (gathered, on every rank)."""
    run = setup(run_input, checked)
    cfg = run.cfg
    log = RunLog(run)
    if run.state.start_step == 0:
        validate_and_log(run, log, 0)
    try:  # a non-finite loss stops training; a checkpoint being written is finished first
        pending = None  # an asynchronous pipeline's step whose loss is still being summed, and its record
        for step in range(run.state.start_step, cfg.steps):
            comm.counter.reset()
            tiers.io.reset()
            routed_rows.reset()
            started = time.perf_counter()
            if run.versions and run.pipeline is not None:
                metrics, states = async_pipeline_step(run, step)
            else:
                loss, grad_norm, states = train_step(run, step)
            synchronize_stream(run.device)  # the optimizer's kernels belong to this step, not the next
            record = log.measure(run, step, states, time.perf_counter() - started)
            if run.versions and run.pipeline is not None:
                if pending is not None:  # the step before: its sums are in by now, or soon
                    log.emit(pending[1], *pending[0].wait())
                pending = (metrics, record)
                if run.state.drained:
                    log.emit(record, *metrics.wait())
                    pending = None
            else:
                log.emit(record, loss, grad_norm)
            if cfg.compile and step == run.state.start_step:
                log.compiled(step + 1, compile_seconds())
            evaluate_and_save(run, log, step + 1)
    except FloatingPointError:
        if run.checkpointer is not None:
            run.checkpointer.wait()
        raise
    return finish(run, log, keep_state)


def validate_and_log(run: Run, log: RunLog, step: int) -> None:
    val_loss = evaluate(run)
    if not math.isfinite(val_loss):  # every rank alike: the loss was all-reduced
        raise FloatingPointError(f"step {step}: the validation loss is {val_loss}; stopped "
                                 f"({divergence_advice(run.cfg.dtype)})")
    log.evaluation(step, val_loss)


def evaluates_after(cfg: TrainConfig, steps_done: int) -> bool:
    """--eval-every's steps, and the last."""
    return steps_done == cfg.steps or bool(cfg.eval_every and steps_done % cfg.eval_every == 0)


def pauses_after(cfg: TrainConfig, steps_done: int) -> bool:
    """Whether something other than the next step comes after `steps_done` steps: a validation, a
    checkpoint, the end. An asynchronous pipeline drains before it."""
    return evaluates_after(cfg, steps_done) or saves_after(cfg, steps_done)


def evaluate_and_save(run: Run, log: RunLog, steps_done: int) -> None:
    """Validate and save when --eval-every and --save-every say so, and after the last step."""
    if evaluates_after(run.cfg, steps_done):
        validate_and_log(run, log, steps_done)
    if saves_after(run.cfg, steps_done):
        log.summary["checkpoint"] = save_checkpoint(run, steps_done)


def finish(run: Run, log: RunLog, keep_state: bool) -> dict:
    """Wait for the last save, close the files, write the pipeline trace; the summary."""
    cfg = run.cfg
    if run.checkpointer is not None:
        run.checkpointer.wait()
    log.close()
    if isinstance(run.optimizer, StreamingAdamW):
        run.optimizer.close()
    if cfg.trace and run.pipeline is not None:
        timelines = gather_timeline(run.pipeline)
        if timelines is not None:
            write_trace(cfg.trace, timelines, {"schedule": cfg.layout.schedule, "pp": cfg.layout.pp,
                                               "virtual_stages": cfg.layout.virtual_stages, "step": cfg.steps})
    summary = {**log.summary, "model": run.model}
    if keep_state:
        summary["state"] = full_model_state(run)
    run.parallel.close()
    comm.close_streams()
    if run.owns_process_group:
        dist.destroy_process_group()
    else:  # inside a caller's process group: the groups this run made go, the caller's stay
        release_groups(run.groups_before)
    return summary
