"""Training settings: one dataclass, filled from defaults, then a TOML file, then command-line flags,
and validated once, up front, before any process group exists."""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, fields

from strata.model.presets import PRESETS

DTYPES = ("fp32", "fp64", "bf16", "fp16")


class ConfigError(ValueError):
    """A bad setting. The CLI prints it as one line and exits with code 2."""


@dataclass
class TrainConfig:
    # what to train on what
    model: str = "tiny"
    n_layers: int | None = None  # override the preset's number of blocks
    data: str = "synthetic"  # a directory written by `strata data prepare`, or "synthetic"
    vocab_size: int | None = None  # synthetic data only: override the preset's vocabulary
    seq_len: int | None = None  # default: the model's max_seq_len
    seed: int = 0
    dtype: str = "fp32"
    # batch: global_batch sequences per optimizer step, micro_batch per forward/backward
    steps: int = 100
    micro_batch: int = 8
    global_batch: int | None = None  # default: micro_batch x dp (no accumulation)
    # optimizer (AdamW) and learning-rate schedule (linear warm-up, cosine decay to min_lr)
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    loss_scale: float = 65536.0  # fp16: initial dynamic loss scale
    loss_scale_window: int = 1000  # fp16: good steps in a row before the scale doubles
    # layout
    parallel: str = "manual"  # manual: the flags below; auto: the planner chooses them
    nproc: int = 1
    dp: int | None = None  # default: what is left of the world after tp and pp
    tp: int = 1
    sequence_parallel: bool = False  # with tp: norms and residuals hold 1/tp of the sequence
    pp: int = 1
    schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved | zb
    virtual_stages: int = 1  # chunks per pipeline rank (interleaved schedule)
    pp_split: str | None = None  # blocks per chunk, e.g. "3,5" (default: balanced by FLOPs)
    zero: int = 0
    checkpointing: str = "none"  # activation checkpointing: none | full | selective | every:K
    offload: str = "none"  # none | cpu | disk: where the optimizer's states live and its step runs
    offload_dir: str | None = None  # --offload disk: directory of the moment files (default: the temp dir)
    reduce_dtype: str = "fp32"  # data-parallel gradient reduction: fp32 (the master gradients') | bf16
    bucket_mb: float = 25.0  # gradient bucket size for data parallelism and ZeRO-1/2
    device: str = "auto"  # auto | cpu | cuda
    timeout: float = 300.0  # seconds any collective may take before it fails
    # evaluation, output, checkpoints
    eval_every: int = 0  # 0: only before the first and after the last step
    eval_batches: int = 4
    metrics: str | None = None
    save: str | None = None
    save_every: int = 0  # 0: only at the end (when --save is given)
    keep: int = 0  # keep only the newest N checkpoints (0: all)
    async_save: bool = False  # write checkpoints in the background while training goes on
    resume: str | None = None  # a checkpoint, a save directory (its latest), or "auto": --save's latest if any
    init_from: str | None = None  # start from a checkpoint's weights (step 0, fresh optimizer)
    max_restarts: int = 0  # with --nproc: restart every rank this many times when one fails
    progress: bool = True
    trace: str | None = None  # pipeline: write the last step's timeline as a Chrome/Perfetto trace
    peak_flops: float | None = None  # FLOP/s per device for MFU; default: measured once and cached

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def to_dict(self) -> dict:
        return asdict(self)


def load_toml(path: str) -> dict:
    """Read a TOML config; keys are the long flag names with '_' or '-'."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    valid = TrainConfig.keys()
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in valid:
            raise ConfigError(f"--config {path}: unknown key {key!r}; valid keys: {', '.join(valid)}")
        out[name] = value
    return out


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_types(values: dict, source: str) -> None:
    """TOML values must have the field's type (an int where a float is wanted is fine)."""
    types = {f.name: f.type for f in fields(TrainConfig)}
    for key, value in values.items():
        base = types[key].split(" | ")[0]
        ok = isinstance(value, _TYPES[base]) and not (base in ("int", "float") and isinstance(value, bool))
        if not ok and not (value is None and "None" in types[key]):
            raise ConfigError(f"{source}: {key} = {value!r} is not of type {base}")


def make_config(file_values: dict, flag_values: dict, source: str = "--config") -> TrainConfig:
    """Defaults < config file < flags (flags given as None were not set)."""
    _check_types(file_values, source)
    values = dict(file_values)
    values.update({k: v for k, v in flag_values.items() if v is not None})
    cfg = TrainConfig(**values)
    for f in fields(TrainConfig):  # TOML gives ints where floats are meant, and vice versa
        value = getattr(cfg, f.name)
        if f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
            setattr(cfg, f.name, float(value))
    return cfg


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Check every setting against the others and the world size; raise ConfigError on the first
    problem with a message that names the value and what would be valid."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(cfg.model in PRESETS, f"--model {cfg.model}: unknown preset; valid: {', '.join(PRESETS)}")
    need(cfg.n_layers is None or cfg.n_layers >= 1, f"--n-layers {cfg.n_layers}: must be >= 1")
    check_checkpoint_flags(cfg)
    need(cfg.parallel in ("manual", "auto"), f"--parallel {cfg.parallel}: valid: manual, auto")
    model = model_shape(cfg)
    need(cfg.dtype in DTYPES, f"--dtype {cfg.dtype}: valid: {', '.join(DTYPES)}")
    need(cfg.data == "synthetic" or os.path.isfile(os.path.join(cfg.data, "meta.json")),
         f"--data {cfg.data}: no meta.json there; run `strata data prepare --out {cfg.data}` "
         f"first, or use --data synthetic")
    need(cfg.device in ("auto", "cpu", "cuda"), f"--device {cfg.device}: valid: auto, cpu, cuda")
    for name in ("steps", "micro_batch", "nproc", "tp", "pp", "virtual_stages", "eval_batches"):
        need(getattr(cfg, name) >= 1, f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 1")
    for name in ("warmup_steps", "save_every", "eval_every"):
        need(getattr(cfg, name) >= 0, f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0")
    need(cfg.lr > 0, f"--lr {cfg.lr}: must be > 0")
    need(0 <= cfg.min_lr <= cfg.lr, f"--min-lr {cfg.min_lr}: must be between 0 and --lr {cfg.lr}")
    need(cfg.loss_scale > 0, f"--loss-scale {cfg.loss_scale}: must be > 0")
    need(cfg.loss_scale_window >= 1, f"--loss-scale-window {cfg.loss_scale_window}: must be >= 1")
    need(cfg.grad_clip >= 0, f"--grad-clip {cfg.grad_clip}: must be >= 0 (0 disables clipping)")
    need(cfg.timeout > 0, f"--timeout {cfg.timeout}: must be > 0 seconds")
    seq_len = cfg.seq_len or model.max_seq_len
    need(1 <= seq_len <= model.max_seq_len,
         f"--seq-len {seq_len}: must be between 1 and the model's max_seq_len {model.max_seq_len}")

    # layout: the product of the degrees is the world size
    need(cfg.zero in (0, 1, 2, 3), f"--zero {cfg.zero}: valid: 0, 1, 2, 3")
    need(world_size % (cfg.tp * cfg.pp) == 0,
         f"--tp {cfg.tp} x --pp {cfg.pp} = {cfg.tp * cfg.pp} does not divide the world size {world_size}")
    dp = cfg.dp if cfg.dp is not None else world_size // (cfg.tp * cfg.pp)
    need(dp >= 1, f"--dp {dp}: must be >= 1")
    need(dp * cfg.tp * cfg.pp == world_size,
         f"--dp {dp} x --tp {cfg.tp} x --pp {cfg.pp} = {dp * cfg.tp * cfg.pp}, "
         f"but the world size is {world_size}; the product must equal it")
    check_tensor_parallel(model, cfg.tp)
    need(not cfg.sequence_parallel or cfg.tp > 1, "--sequence-parallel: needs --tp 2 or more")
    need(not cfg.sequence_parallel or seq_len % cfg.tp == 0,
         f"--sequence-parallel: --seq-len {seq_len} must be a multiple of --tp {cfg.tp}")
    need(cfg.vocab_size is None or cfg.vocab_size >= 2, f"--vocab-size {cfg.vocab_size}: must be >= 2")
    need(cfg.vocab_size is None or cfg.data == "synthetic",
         f"--vocab-size {cfg.vocab_size}: only for --data synthetic; a data set brings its tokenizer's")
    check_pipeline(cfg, model, seq_len)
    from strata.memory.checkpointing import parse
    parse(cfg.checkpointing)
    need(cfg.offload in ("none", "disk", "cpu"), f"--offload {cfg.offload}: valid: none, disk, cpu")
    need(cfg.offload_dir is None or cfg.offload == "disk", f"--offload-dir {cfg.offload_dir}: only with --offload disk")

    # batch: global = micro x accumulation x dp
    need(cfg.global_batch is None or cfg.global_batch >= 1, f"--global-batch {cfg.global_batch}: must be >= 1")
    need(cfg.global_batch is None or cfg.global_batch % (cfg.micro_batch * dp) == 0,
         f"--global-batch {cfg.global_batch}: must be a multiple of --micro-batch {cfg.micro_batch} "
         f"x dp {dp} = {cfg.micro_batch * dp}")

    # what this version can run (the degrees above are already checked)
    need(cfg.zero == 0 or dp > 1,
         f"--zero {cfg.zero}: ZeRO shards states across data-parallel ranks, and dp is 1; "
         f"use --zero 0, or --nproc N with dp > 1")
    need(cfg.reduce_dtype in ("fp32", "bf16"), f"--reduce-dtype {cfg.reduce_dtype}: valid: fp32, bf16")
    need(cfg.reduce_dtype == "fp32" or dp > 1,
         f"--reduce-dtype {cfg.reduce_dtype}: sets the dtype of data-parallel reductions, and dp is 1")
    need(cfg.reduce_dtype == "fp32" or cfg.dtype != "fp64", "--reduce-dtype bf16: not with --dtype fp64")
    need(cfg.bucket_mb > 0, f"--bucket-mb {cfg.bucket_mb}: must be > 0")
    need(cfg.nproc == 1 or world_size == cfg.nproc,
         f"--nproc {cfg.nproc}: does not match the {world_size} processes launched")


def model_shape(cfg: TrainConfig):
    """The model's shape (a ModelConfig): the preset, or --init-from's checkpoint; --n-layers applied."""
    from strata.model.config import ModelConfig
    base = PRESETS[cfg.model]
    if cfg.init_from:
        from strata.checkpoint.store import read_state
        base = ModelConfig.from_dict(read_state(cfg.init_from)["model_config"])
    return base.with_overrides(n_layers=cfg.n_layers or base.n_layers)


def check_checkpoint_flags(cfg: TrainConfig) -> None:
    """--save, --resume, --init-from and what goes with them."""
    if cfg.resume == "auto" and not cfg.save:
        raise ConfigError("--resume auto: resumes from --save's latest checkpoint; give --save DIR too")
    if cfg.resume not in (None, "auto") and not os.path.isdir(cfg.resume):
        raise ConfigError(f"--resume {cfg.resume}: no such directory (or 'auto': --save's latest, if any)")
    if cfg.init_from is not None and not os.path.isdir(cfg.init_from):
        raise ConfigError(f"--init-from {cfg.init_from}: no such directory")
    if cfg.init_from is not None and cfg.resume is not None:
        raise ConfigError("--init-from and --resume: choose one (--resume continues a run, --init-from starts "
                          "a new one from a checkpoint's weights)")
    if cfg.init_from is not None and cfg.n_layers is not None:
        raise ConfigError("--n-layers: not with --init-from (the checkpoint fixes the model's shape)")
    for name in ("keep", "max_restarts"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0")
    if (cfg.keep or cfg.async_save) and not cfg.save:
        raise ConfigError(f"--{'keep' if cfg.keep else 'async-save'}: only with --save DIR")


def check_pipeline(cfg: TrainConfig, model, seq_len: int) -> None:
    """The pipeline settings, and whether the model can be cut into pp x virtual-stages chunks."""
    from strata.parallel.pipeline.schedules import SCHEDULES
    from strata.parallel.pipeline.stage import make_layout
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {cfg.schedule}: valid: {', '.join(SCHEDULES)}")
    if cfg.schedule == "interleaved" and cfg.virtual_stages < 2:
        raise ConfigError(f"--schedule interleaved: needs --virtual-stages 2 or more (got {cfg.virtual_stages})")
    if cfg.schedule != "interleaved" and cfg.virtual_stages != 1:
        raise ConfigError(f"--virtual-stages {cfg.virtual_stages}: only with --schedule interleaved")
    if cfg.pp == 1:
        for name, value in (("pp_split", cfg.pp_split), ("trace", cfg.trace)):
            if value:
                raise ConfigError(f"--{name.replace('_', '-')} {value}: only with --pp 2 or more")
        return
    if cfg.zero >= 2:
        raise ConfigError(f"--zero {cfg.zero} with --pp {cfg.pp}: ZeRO-2/3 would reduce-scatter gradients "
                          f"(ZeRO-3 also gather parameters) on every micro-batch, m times the traffic; "
                          f"use --zero 1 (as DeepSpeed and Megatron-LM do with pipelines) or --zero 0")
    make_layout(model, cfg.pp, cfg.virtual_stages, seq_len, cfg.pp_split)


def check_tensor_parallel(model, tp: int) -> None:
    """Can a model of this shape (a ModelConfig) be split over tp ranks? (training and generation)"""
    if model.n_heads % tp:
        raise ConfigError(f"--tp {tp}: must divide the model's {model.n_heads} attention heads")
    if model.kv_heads % tp and tp % model.kv_heads:
        raise ConfigError(f"--tp {tp}: must divide the model's {model.kv_heads} KV heads or be a multiple of them")
    if model.d_ff % tp:
        raise ConfigError(f"--tp {tp}: must divide the model's d_ff {model.d_ff}")
    if tp > 1 and model.position == "alibi":
        raise ConfigError(f"--tp {tp}: ALiBi models run with --tp 1 for now")


def data_parallel_size(cfg: TrainConfig, world_size: int) -> int:
    return cfg.dp if cfg.dp is not None else world_size // (cfg.tp * cfg.pp)


def global_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Sequences per optimizer step: as given, or one micro-batch per data-parallel rank."""
    return cfg.global_batch or cfg.micro_batch * data_parallel_size(cfg, world_size)
