"""Training settings: one dataclass, filled from defaults, then a TOML file, then command-line flags,
and validated once, up front, before any process group exists."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import Field, asdict, dataclass, field, fields, replace

from strata.errors import ConfigError
from strata.files import check_output_dir, check_output_file
from strata.model.config import ModelConfig
from strata.model.presets import PRESETS
from strata.rules.comm_semantics import resolve_semantics
from strata.rules.constants import BUCKET_MB
from strata.rules.devices import check_device
from strata.rules.dtypes import DTYPES
from strata.rules.layout import Layout, check_layout, check_transfer_dtypes, data_parallel_degree
from strata.rules.limits import CEILINGS, FLOORS, check_ceiling
from strata.rules.pipeline_cut import make_layout
from strata.rules.schedules import SCHEDULES


def _key(default, help: str, section: str | None = None):
    """A setting: its default and the one text that explains it (the flag's help, docs/config.md);
    `section` on the first setting of a group of `--help`."""
    return field(default=default, metadata={"help": help, "section": section})


# A run's layout before its world size is known: dp None is what the world leaves (resolve_layout
# fills it in), and a micro-batch of 8 sequences (the planner's Layout defaults to 1).
RUN_LAYOUT = Layout(dp=None, micro_batch=8)
LAYOUT_SECTION = "layout: [layout] in a TOML config (strata/rules/layout.py)"


@dataclass(frozen=True)
class TrainConfig:
    """A run's settings, never changed once made (a resolved copy: strata/train/spec.py)."""
    model: str = _key("tiny", "model preset (tiny, small, gpt2-124m, llama-7b, ...)", "model and data")
    n_layers: int | None = _key(None, "override the preset's number of transformer blocks")
    n_heads: int | None = _key(None, "override the preset's attention heads (as many KV heads; each d_model / heads wide)")
    max_seq_len: int | None = _key(None, "override the model's context, its longest sequence (rotary and ALiBi models: "
                                         "with --init-from too, to train on longer sequences than it was trained on)")
    data: str = _key("synthetic", "directory written by `strata data prepare`, or 'synthetic'")
    vocab_size: int | None = _key(None, "synthetic data: vocabulary size (default: the preset's)")
    seq_len: int | None = _key(None, "tokens per sequence (default: the model's max_seq_len)")
    seed: int = _key(0, "weights, data order and sampling all derive from it")
    dtype: str = _key("fp32", "fp32 | fp64 | bf16 | fp16 (bf16, fp16: autocast with fp32 master weights; "
                              "fp16 with loss scaling)")
    steps: int = _key(100, "optimizer steps", "steps and batch (the micro-batch is the layout's)")
    global_batch: int | None = _key(None, "sequences per optimizer step, all ranks together "
                                          "(default: micro-batch x dp, no accumulation)")
    lr: float = _key(1e-3, "peak learning rate (AdamW)", "optimizer (AdamW) and learning-rate schedule (linear "
                                                         "warm-up, cosine decay to min_lr)")
    min_lr: float = _key(1e-4, "learning rate at the last step (cosine decay)")
    warmup_steps: int = _key(0, "linear warm-up steps")
    weight_decay: float = _key(0.1, "AdamW's decay, on matrices and embeddings")
    beta1: float = _key(0.9, "Adam's first-moment decay")
    beta2: float = _key(0.95, "Adam's second-moment decay")
    grad_clip: float = _key(1.0, "clip by the global gradient norm (0: off)")
    loss_scale: float = _key(65536.0, "fp16: initial dynamic loss scale")
    loss_scale_window: int = _key(1000, "fp16: good steps in a row before the loss scale doubles")
    min_loss_scale: float = _key(1.0, "fp16: gradients that overflow at this loss scale stop the run (exit code 1)")
    parallel: str = _key("manual", "manual: the layout flags; auto: the planner chooses dp, tp, pp, ZeRO, "
                                   "micro-batch, schedule, checkpointing", "processes and devices")
    layout: Layout = _key(RUN_LAYOUT, "every degree and choice of the layout", LAYOUT_SECTION)
    nproc: int = _key(1, "start N local processes (through torch.distributed.run)")
    emulate_stages: int = _key(1, "with --pp 1 --schedule pipedream[-vs]: follow the weight-version rule of P "
                                  "pipeline stages in one process (the reference a P-stage run equals)")
    allow_async: bool = _key(False, "with --parallel auto: let the planner choose an asynchronous schedule (2bw, "
                                    "pipedream), which changes the optimisation (no effect with --parallel manual)")
    compile: bool = _key(False, "torch.compile each transformer block's forward (after tensor parallelism; "
                                "checkpointing recomputes the compiled code)")
    offload_dir: str | None = _key(None, "with --offload disk, --offload-params disk or --offload-activations: where "
                                         "the files go (default: the temp directory)")
    bucket_mb: float = _key(BUCKET_MB, "gradient bucket size (MB) for data parallelism and ZeRO-1/2")
    device: str = _key("auto", "auto | cpu | cuda")
    timeout: float = _key(300.0, "seconds a collective may take before it fails")
    comm_semantics: str | None = _key(None, "native | nccl: communicate as the backend does, or by NCCL's rules "
                                            "on any backend (on a CPU: gloo run as NCCL would, a rehearsal of a GPU "
                                            "layout; default: $STRATA_COMM_SEMANTICS, else native)")
    eval_every: int = _key(0, "validate every N steps (0: only at the start and the end)",
                           "evaluation, outputs, checkpoints")
    eval_batches: int = _key(4, "validation batches (of the global batch) each time")
    metrics: str | None = _key(None, "write one JSON object per step to this file (rank 0)")
    tensorboard: str | None = _key(None, "write TensorBoard event files into this directory (rank 0; needs the "
                                         "tensorboard package)")
    run_dir: str | None = _key(None, "one directory for the run: config.toml, metrics, TensorBoard events, loss "
                                     "plot, checkpoints, log (--metrics, --save, --tensorboard still win)")
    save: str | None = _key(None, "save checkpoints under this directory")
    save_every: int = _key(0, "save every N steps (0: at the end)")
    keep: int = _key(0, "keep only the N checkpoints written last (0: all)")
    async_save: bool = _key(False, "write checkpoints in the background while training continues")
    resume: str | None = _key(None, "resume from a checkpoint, a save directory (its latest), or 'auto' "
                                    "(--save's last complete checkpoint, if any)")
    init_from: str | None = _key(None, "start from a checkpoint's weights and model shape (any layout; step 0, "
                                       "fresh optimizer)")
    max_restarts: int = _key(0, "with --nproc: when a rank fails, restart all and resume from the latest "
                                "checkpoint, up to N times")
    progress: bool = _key(True, "show a progress bar")
    trace: str | None = _key(None, "write the last step's pipeline timeline as a Chrome/Perfetto trace (JSON)")
    peak_flops: float | None = _key(None, "peak FLOP/s per device for MFU (default: a matmul measured once, cached)")

    def __post_init__(self):
        if self.run_dir:  # the run directory's paths for the outputs not given
            for name, path in run_dir_outputs(self.run_dir).items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, path)  # (frozen: made whole here)

    def to_dict(self) -> dict:
        """Every setting, the layout's as its own section (a checkpoint's metadata, config.toml)."""
        return asdict(self)


LAYOUT_NAMES = frozenset(f.name for f in fields(Layout))


def train_config_from_dict(raw: dict) -> TrainConfig:
    """The config `to_dict` wrote (a run spec; the layout as its own section)."""
    return TrainConfig(**{**raw, "layout": Layout(**raw["layout"])})


def setting_fields() -> dict[str, Field]:
    """Every setting by its one name (a flag, a TOML key): the run's own, then its layout's."""
    own = {f.name: f for f in fields(TrainConfig) if f.name != "layout"}
    return {**own, **{f.name: f for f in fields(Layout)}}


def is_layout_setting(name: str) -> bool:
    return name in LAYOUT_NAMES


def settings_of(cfg: TrainConfig) -> dict:
    """Every setting's value by its one name (the layout's beside the run's own)."""
    return {name: getattr(cfg.layout if is_layout_setting(name) else cfg, name) for name in setting_fields()}


def default_of(name: str):
    return getattr(RUN_LAYOUT if is_layout_setting(name) else TrainConfig, name)


def train_config(**values) -> TrainConfig:
    """A config from settings by their names (as the flags give them): the layout's go into its section."""
    return with_settings(TrainConfig(), **values)


def with_settings(cfg: TrainConfig, **values) -> TrainConfig:
    """A copy with some settings changed, by their names (the layout's within its section)."""
    layout = {k: values.pop(k) for k in list(values) if is_layout_setting(k)}
    return replace(cfg, **values, layout=replace(cfg.layout, **layout))


def run_dir_outputs(run_dir: str) -> dict[str, str]:
    """The paths a run directory (--run-dir) gives the outputs not set otherwise
    (strata/train/run_dir.py writes the rest of it)."""
    paths = {"metrics": os.path.join(run_dir, "metrics.jsonl"), "save": os.path.join(run_dir, "ckpt")}
    if importlib.util.find_spec("tensorboard") is not None:  # events when they can be written
        paths["tensorboard"] = os.path.join(run_dir, "tb")
    return paths


def check_given(cfg: TrainConfig, given: set[str]) -> None:
    """Settings the user set that the run would not use: each refused in one line, never dropped.
    (Run where the user's settings are read, before the run is resolved: the resolved config also
    holds the launcher's choices. A --model beside --init-from is checked against the checkpoint:
    train/preflight.check_model_flag.)"""
    if cfg.dtype != "fp16":
        for name in ("loss_scale", "min_loss_scale", "loss_scale_window"):
            _need(name not in given, name, getattr(cfg, name),
                  f"only with dtype fp16: loss scaling keeps fp16's small gradients from flushing to zero, and "
                  f"{cfg.dtype} needs none")
    _need("allow_async" not in given or cfg.parallel == "auto", "allow_async", True,
          "only with --parallel auto (it lets the planner choose an asynchronous schedule); with a manual layout, "
          "name one with --schedule 2bw, pipedream or pipedream-vs")


# The paths a run writes: (field, a directory?, a file whose directory the writer makes?). The run
# directory first: it implies the others' defaults, and its error should name it.
OUTPUT_PATHS = (("run_dir", True, False), ("save", True, False), ("tensorboard", True, False),
                ("offload_dir", True, False), ("metrics", False, True), ("trace", False, False))


def check_output_paths(cfg: TrainConfig) -> None:
    """Every path the run writes can be written (strata/files.py's checks: a directory, or one
    made under an existing one, on storage, a file made and removed there), before any process
    starts."""
    for name, wants_dir, make_parents in OUTPUT_PATHS:
        path = getattr(cfg, name)
        if path is None:
            continue
        if path and "\0" not in path and os.path.exists(path) and os.path.isdir(path) != wants_dir:
            want, other = ("a directory", "a file") if wants_dir else ("a file", "a directory")
            raise ConfigError(f"is {other}; want {want}", name, path)
        if wants_dir:
            check_output_dir(path, name)
        else:
            check_output_file(path, name, make_parents)


def _need(ok: bool, field: str, value, reason: str) -> None:
    if not ok:
        raise ConfigError(reason, field, value)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class RunChecks:
    """How many runs `validate` has checked in this process: strata/train/spec.resolve checks a
    run once per launch, and its ranks none (a test counts them)."""
    runs = 0


def validate(cfg: TrainConfig, world_size: int, model: ModelConfig, settings_checked: bool = False) -> None:
    """Check every setting against the others, the world size and the model (the shape the run
    builds: see strata/train/preflight.model_shape); raise ConfigError naming the first bad field,
    its value and what would be valid. Pure: no file is read, and nothing of this machine (its
    memory is checked where a run starts: train/preflight.check_run_memory), so that `strata plan`
    and training accept the same layouts. settings_checked: check_run_settings passed already (the
    model's shape needs a valid preset before this runs)."""
    RunChecks.runs += 1
    if not settings_checked:
        check_run_settings(cfg)
    check_run_layout(cfg, world_size, model)


def check_run_layout(cfg: TrainConfig, world_size: int, model: ModelConfig) -> None:
    """The run's layout against the world size, the model and the run's other settings (what
    --parallel auto checks of each layout the planner offers)."""
    lay = cfg.layout
    _need(cfg.nproc == 1 or world_size == cfg.nproc, "nproc", cfg.nproc,
          f"does not match the {world_size} processes launched")
    _need(cfg.max_restarts == 0 or world_size > 1, "max_restarts", cfg.max_restarts,
          "only with --nproc 2 or more: one process has no ranks to restart (run it again with --resume auto)")
    seq_len = sequence_length(cfg, model)
    _need(world_size % (lay.tp * lay.pp) == 0, "tp", lay.tp,
          f"tp x pp = {lay.tp * lay.pp} does not divide the world size {world_size}")
    _need(world_size % (lay.cp * lay.tp * lay.pp) == 0, "cp", lay.cp,
          f"cp x tp x pp = {lay.cp * lay.tp * lay.pp} does not divide the world size {world_size}")
    check_layout(model, layout_of(cfg, world_size), world_size, seq_len, global_batch_size(cfg, world_size))
    _need(lay.pp > 1 or not cfg.trace, "trace", cfg.trace, "only with pp 2 or more")
    check_asynchronous_run(cfg, model)
    # Zero-bubble's W step intercepts the torch functions the forward calls; compiled code calls none.
    _need(not (cfg.compile and lay.pp > 1 and lay.schedule in SCHEDULES and SCHEDULES[lay.schedule].splits_backward),
          "schedule", lay.schedule, "not with --compile: its deferred weight gradients intercept torch functions, "
          "which compiled code does not call; valid with --compile: "
          + ", ".join(name for name, spec in SCHEDULES.items() if not spec.splits_backward))


def check_asynchronous_run(cfg: TrainConfig, model: ModelConfig) -> None:
    """The run settings an asynchronous schedule needs (its layout: rules/layout.check_asynchronous)."""
    lay = cfg.layout
    spec = SCHEDULES.get(lay.schedule)
    asynchronous = spec is not None and spec.asynchronous
    if asynchronous:
        _need(cfg.grad_clip == 0, "grad_clip", cfg.grad_clip,
              f"not with --schedule {lay.schedule}: clipping by the global norm would make every stage wait for "
              f"the others' gradients each step, the flush this schedule removes; use --grad-clip 0")
        _need(cfg.dtype != "fp16", "dtype", cfg.dtype,
              f"not with --schedule {lay.schedule}: fp16's loss scaling skips a step on every stage at once when "
              f"one overflows, which needs them to meet; use bf16, fp32 or fp64")
    _need(cfg.emulate_stages >= 1, "emulate_stages", cfg.emulate_stages, "must be >= 1")
    if cfg.emulate_stages > 1:
        _need(lay.pp == 1 and asynchronous and spec.update_per_micro_batch, "emulate_stages", cfg.emulate_stages,
              "only with --pp 1 --schedule pipedream or pipedream-vs (2BW's versions do not depend on the stages)")
        _need(not model.tie_embeddings or not spec.tied_apart(cfg.emulate_stages), "emulate_stages", cfg.emulate_stages,
              "not with a tied embedding (its first and last stage would compute with different versions)")
        try:  # the emulated stages' cut is valid
            make_layout(model, cfg.emulate_stages, 1, sequence_length(cfg, model), lay.pp_split)
        except ConfigError as e:
            field = "emulate_stages" if e.field == "pp" else e.field
            raise ConfigError(e.reason, field, cfg.emulate_stages if field == "emulate_stages" else e.value) from None


def check_run_settings(cfg: TrainConfig) -> None:
    """Every setting on its own (ranges, names), and the ones that only make sense together."""
    lay = cfg.layout
    _need(cfg.model in PRESETS, "model", cfg.model, f"unknown preset; valid: {', '.join(PRESETS)}")
    _need(cfg.n_layers is None or cfg.n_layers >= 1, "n_layers", cfg.n_layers, "must be >= 1")
    _need(cfg.max_seq_len is None or cfg.max_seq_len >= 1, "max_seq_len", cfg.max_seq_len, "must be >= 1")
    if cfg.n_heads is not None and cfg.model in PRESETS:
        width = PRESETS[cfg.model].d_model
        _need(cfg.n_heads >= 1 and width % cfg.n_heads == 0, "n_heads", cfg.n_heads,
              f"must divide the model's d_model {width}")
    check_checkpoint_flags(cfg)
    _need(cfg.parallel in ("manual", "auto"), "parallel", cfg.parallel, "valid: manual, auto")
    # (--allow-async stays in the resolved config after --parallel auto's choice, as --parallel manual: no effect)
    _need(not cfg.allow_async or cfg.parallel != "auto" or (cfg.grad_clip == 0 and cfg.dtype != "fp16"), "allow_async", True,
          "the asynchronous schedules run without clipping and without fp16; add --grad-clip 0 (and use bf16 or fp32)")
    _need(cfg.dtype in DTYPES, "dtype", cfg.dtype, f"valid: {', '.join(DTYPES)}")
    _need(cfg.data == "synthetic" or os.path.isfile(os.path.join(cfg.data, "meta.json")), "data", cfg.data,
          f"no meta.json there; run `strata data prepare --out {cfg.data}` first, or use --data synthetic")
    check_device(cfg.device)
    resolve_semantics(cfg.comm_semantics)
    values = settings_of(cfg)
    for name in ("steps", "micro_batch", "nproc", "tp", "cp", "pp", "virtual_stages", "eval_batches",
                 "loss_scale_window"):
        _need(values[name] >= 1, name, values[name], "must be >= 1")
    for name in ("warmup_steps", "save_every", "eval_every"):
        _need(getattr(cfg, name) >= 0, name, getattr(cfg, name), "must be >= 0")
    _need(cfg.warmup_steps <= cfg.steps, "warmup_steps", cfg.warmup_steps,
          f"must be at most steps {cfg.steps} (the learning rate would never reach lr)")
    _need(lay.dp is None or lay.dp >= 1, "dp", lay.dp, "must be >= 1")
    for name in ("lr", "timeout", "loss_scale", "bucket_mb"):
        _need(_finite(getattr(cfg, name)) and getattr(cfg, name) > 0, name, getattr(cfg, name), "must be > 0")
    _need(_finite(cfg.min_lr) and 0 <= cfg.min_lr <= cfg.lr, "min_lr", cfg.min_lr, f"must be between 0 and lr {cfg.lr}")
    _need(_finite(cfg.weight_decay) and cfg.weight_decay >= 0, "weight_decay", cfg.weight_decay, "must be >= 0")
    for name in ("beta1", "beta2"):
        _need(_finite(getattr(cfg, name)) and 0 <= getattr(cfg, name) < 1, name, getattr(cfg, name),
              "must be in [0, 1) (Adam's moment decay)")
    _need(_finite(cfg.grad_clip) and cfg.grad_clip >= 0, "grad_clip", cfg.grad_clip, "must be >= 0 (0 disables clipping)")
    _need(_finite(cfg.min_loss_scale) and 0 < cfg.min_loss_scale <= cfg.loss_scale, "min_loss_scale",
          cfg.min_loss_scale, f"must be > 0 and at most loss_scale {cfg.loss_scale}")
    _need(cfg.peak_flops is None or (_finite(cfg.peak_flops) and cfg.peak_flops > 0), "peak_flops", cfg.peak_flops,
          "must be > 0 FLOP/s")
    for name, value in values.items():  # the ceilings (and floors) of rules/limits.py
        if name in CEILINGS or name in FLOORS:
            check_ceiling(name, value)
    _need(cfg.vocab_size is None or cfg.vocab_size >= 2, "vocab_size", cfg.vocab_size, "must be >= 2")
    _need(cfg.vocab_size is None or cfg.data == "synthetic", "vocab_size", cfg.vocab_size,
          "only for --data synthetic; a data set brings its tokenizer's")
    _need(cfg.offload_dir is None or "disk" in (lay.offload, lay.offload_params) or lay.offload_activations != "none",
          "offload_dir", cfg.offload_dir, "only with offload disk, offload_params disk or offload_activations cpu")
    _need(lay.offload_params == "none" or cfg.dtype != "fp16", "offload_params", lay.offload_params,
          "not with dtype fp16 (loss scaling checks the gradients in memory); use bf16")
    check_transfer_dtypes(lay.reduce_dtype, lay.gather_dtype, cfg.dtype)  # against dp and zero: check_layout


def check_checkpoint_flags(cfg: TrainConfig) -> None:
    """--save, --resume, --init-from and what goes with them."""
    _need(cfg.resume != "auto" or bool(cfg.save), "resume", "auto",
          "resumes from the save directory's last checkpoint; give --save DIR too")
    _need(cfg.resume in (None, "auto") or os.path.isdir(cfg.resume), "resume", cfg.resume,
          "no such directory (or 'auto': --save's latest, if any)")
    _need(cfg.init_from is None or os.path.isdir(cfg.init_from), "init_from", cfg.init_from, "no such directory")
    # --resume auto with --init-from: continue the run if it saved a checkpoint, else start it from the weights
    _need(cfg.init_from is None or cfg.resume in (None, "auto"), "init_from", cfg.init_from,
          "not with --resume DIR: choose one (--resume continues a run, --init-from starts a new one from a "
          "checkpoint's weights; with --resume auto, the run continues from its own checkpoint when it has one)")
    for name in ("n_layers", "n_heads"):
        _need(cfg.init_from is None or getattr(cfg, name) is None, name, getattr(cfg, name),
              "not with --init-from (the checkpoint fixes the model's shape)")
    for name in ("keep", "max_restarts"):
        _need(getattr(cfg, name) >= 0, name, getattr(cfg, name), "must be >= 0")
    _need(not cfg.keep or bool(cfg.save), "keep", cfg.keep, "only with --save DIR")
    _need(not cfg.save_every or bool(cfg.save), "save_every", cfg.save_every, "only with --save DIR")
    _need(not cfg.async_save or bool(cfg.save), "async_save", True, "only with --save DIR")


def resolve_layout(cfg: TrainConfig, world_size: int) -> Layout:
    """The layout a run of this world size uses: dp what cp, tp and pp leave of the world unless
    given, and the ZeRO stage --offload-params implies."""
    return replace(cfg.layout, dp=data_parallel_size(cfg, world_size), zero=zero_stage(cfg))


def layout_of(cfg: TrainConfig, world_size: int) -> Layout:
    """The layout the rules check: the resolved one, whose pipeline cut is the run's own (with
    --emulate-stages, --pp-split cuts the emulated stages: check_asynchronous_run checks it)."""
    layout = resolve_layout(cfg, world_size)
    return layout if cfg.emulate_stages == 1 else replace(layout, pp_split=None)


def zero_stage(cfg: TrainConfig) -> int:
    """The ZeRO stage a run uses: --offload-params streams ZeRO-3's shards, so with the default
    --zero 0 it means stage 3, on any number of processes (on one, ZeRO-Infinity on one device);
    else --zero."""
    lay = cfg.layout
    return 3 if lay.offload_params != "none" and lay.zero == 0 else lay.zero


def sequence_length(cfg: TrainConfig, model: ModelConfig) -> int:
    """Tokens per sequence: as given, or the model's context."""
    return cfg.seq_len if cfg.seq_len is not None else model.max_seq_len


def data_parallel_size(cfg: TrainConfig, world_size: int) -> int:
    lay = cfg.layout
    return lay.dp if lay.dp is not None else data_parallel_degree(world_size, lay.cp, lay.tp, lay.pp)


def global_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Sequences per optimizer step: as given, or one micro-batch per data-parallel rank."""
    if cfg.global_batch is not None:  # 0 is a bad value for validate to refuse, not "unset"
        return cfg.global_batch
    return cfg.layout.micro_batch * data_parallel_size(cfg, world_size)
