"""What a training run holds while it runs (`Run`): built once by `trainer.setup`, read by the
loop, the evaluation and the checkpoints (run_state.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.checkpoint import store
from strata.config import TrainConfig
from strata.data.loader import BatchLoader
from strata.distributed.mesh import ParallelDims
from strata.model.config import ModelConfig
from strata.model.transformer import Transformer
from strata.parallel.data import DataParallel
from strata.parallel.expert import ExpertAxes
from strata.parallel.pipeline.executor import PipelineExecutor
from strata.parallel.pipeline.versions import WeightVersions
from strata.train.loss_scale import LossScaler


@dataclass
class StepState:
    """What changes while a run runs: where it started (restore sets it), and what the last step left."""
    start_step: int = 0
    hf_origin: dict | None = None  # a converted model's Hugging Face config, names and dtype: saved along
    skipped: bool = False  # the last step's gradients overflowed (fp16) and it was skipped
    activation_bytes: int | None = None  # saved for backward by one micro-batch (counted once)
    update_s: float = 0.0  # the last optimizer step's seconds (with offload: its pass over the tiers)
    drained: bool = True  # asynchronous pipeline: nothing is in flight (the next step fills it)
    routed: dict | None = None  # a mixture of experts: the last step's auxiliary loss, load and drops


@dataclass(frozen=True)
class Run:
    """The run's wiring, built once by `setup` and never reassigned; what changes is in `state`."""
    cfg: TrainConfig  # resolved (strata/train/spec.py): the layout's dp and ZeRO stage, the global batch
    model_cfg: ModelConfig
    device: torch.device
    rank: int
    world_size: int
    dims: ParallelDims
    dp_rank: int
    dp_group: object  # the ranks gradients are averaged over: dp, and with --cp > 1 dp x cp
    tp_group: object
    model: Transformer
    parallel: DataParallel  # data parallelism / ZeRO: gradient sync, sharded states
    optimizer: torch.optim.Optimizer
    train_data: BatchLoader
    val_data: BatchLoader
    pieces: list  # what this rank holds of each logical tensor (checkpoints)
    owns_process_group: bool = False
    groups_before: frozenset = frozenset()  # the process groups that existed before this run made its own
    pp_group: object = None
    pipeline: PipelineExecutor | None = None  # with --pp > 1: runs the schedule
    embedding_group: object = None  # first and last stage, when the embedding is tied
    stage_layout: object = None  # the PipelineLayout
    scaler: LossScaler | None = None  # fp16 only
    checkpointer: store.Checkpointer | None = None
    versions: list[WeightVersions] | None = None  # asynchronous schedules: per (emulated) stage
    expert_axes: ExpertAxes | None = None  # with --ep > 1
    state: StepState = field(default_factory=StepState)
