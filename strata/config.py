"""Training settings: one dataclass, filled from defaults, then a TOML file, then command-line flags,
and validated once, up front, before any process group exists."""

from __future__ import annotations

import importlib.util
import math
import os
import tomllib
from dataclasses import asdict, dataclass, field, fields

from strata.errors import ConfigError
from strata.files import check_output_dir, check_output_file
from strata.model.config import ModelConfig
from strata.model.presets import PRESETS
from strata.rules.comm_semantics import resolve_semantics
from strata.rules.constants import BUCKET_MB
from strata.rules.devices import check_device
from strata.rules.dtypes import DTYPES
from strata.rules.layout import Layout, check_layout, check_transfer_dtypes, data_parallel_degree
from strata.rules.limits import CEILINGS, FLOORS, PROCESS_BYTES, check_ceiling, check_fits_machine
from strata.rules.pipeline_cut import make_layout
from strata.rules.schedules import SCHEDULES


def _key(default, help: str):
    """A setting: its default and the one text that explains it (the flag's help, docs/config.md)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # what to train on what
    model: str = _key("tiny", "model preset (tiny, small, gpt2-124m, llama-7b, ...)")
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
    # batch: global_batch sequences per optimizer step, micro_batch per forward/backward
    steps: int = _key(100, "optimizer steps")
    micro_batch: int = _key(8, "sequences per forward/backward on one rank")
    global_batch: int | None = _key(None, "sequences per optimizer step, all ranks together "
                                          "(default: micro-batch x dp, no accumulation)")
    # optimizer (AdamW) and learning-rate schedule (linear warm-up, cosine decay to min_lr)
    lr: float = _key(1e-3, "peak learning rate (AdamW)")
    min_lr: float = _key(1e-4, "learning rate at the last step (cosine decay)")
    warmup_steps: int = _key(0, "linear warm-up steps")
    weight_decay: float = _key(0.1, "AdamW's decay, on matrices and embeddings")
    beta1: float = _key(0.9, "Adam's first-moment decay")
    beta2: float = _key(0.95, "Adam's second-moment decay")
    grad_clip: float = _key(1.0, "clip by the global gradient norm (0: off)")
    loss_scale: float = _key(65536.0, "fp16: initial dynamic loss scale")
    loss_scale_window: int = _key(1000, "fp16: good steps in a row before the loss scale doubles")
    min_loss_scale: float = _key(1.0, "fp16: gradients that overflow at this loss scale stop the run (exit code 1)")
    # layout
    parallel: str = _key("manual", "manual: the layout flags; auto: the planner chooses dp, tp, pp, ZeRO, "
                                   "micro-batch, schedule, checkpointing")
    nproc: int = _key(1, "start N local processes (through torch.distributed.run)")
    dp: int | None = _key(None, "data-parallel degree (default: world / (cp x tp x pp))")
    tp: int = _key(1, "tensor-parallel degree")
    tp_mode: str = _key("1d", "how --tp cuts the matrices: 1d (Megatron) | 2d (q x q grid, SUMMA) | 2.5d (q x q x "
                              "--tp-depth, Tesseract) | 3d (q x q x q); 2d/2.5d/3d split activations too")
    tp_depth: int = _key(1, "with --tp-mode 2.5d: the grid's depth d (--tp = q x q x d)")
    sequence_parallel: bool = _key(False, "with --tp: split norms and residuals along the sequence too")
    ep: int = _key(1, "expert-parallel degree: a mixture's experts split over this many of the data-parallel ranks")
    capacity_factor: float | None = _key(None, "mixture of experts: each expert takes at most factor x tokens x k / "
                                               "n_experts of a micro-batch's tokens, the rest dropped (default: dropless)")
    cp: int = _key(1, "context-parallel degree: each sequence split over this many ranks (2 x cp chunks, rank r "
                      "holding chunks r and 2cp-1-r), for long sequences")
    cp_mode: str = _key("ring", "how context parallelism attends: ring (K and V passed around the cp ranks, "
                                "overlapped with attention) | ulysses (all-to-all to a split of the heads; cp must "
                                "divide heads / tp)")
    pp: int = _key(1, "pipeline-parallel degree (stages)")
    schedule: str = _key("1f1b", "pipeline schedule: gpipe | 1f1b | interleaved | zb (zero-bubble ZB-H1) | "
                                 "2bw (PipeDream-2BW) | pipedream | pipedream-vs (vertical sync); the last three asynchronous: "
                                 "stale weights, no flush")
    virtual_stages: int = _key(1, "with --schedule interleaved: model chunks per pipeline rank")
    pp_split: str | None = _key(None, "blocks per pipeline chunk, e.g. 3,5 (default: balanced by FLOPs)")
    emulate_stages: int = _key(1, "with --pp 1 --schedule pipedream[-vs]: follow the weight-version rule of P "
                                  "pipeline stages in one process (the reference a P-stage run equals)")
    allow_async: bool = _key(False, "with --parallel auto: let the planner choose an asynchronous schedule (2bw, "
                                    "pipedream), which changes the optimisation (no effect with --parallel manual)")
    zero: int = _key(0, "ZeRO stage 0-3")
    checkpointing: str = _key("none", "activation checkpointing: none | full | selective | every:K "
                                      "(first K blocks of each chunk)")
    compile: bool = _key(False, "torch.compile each transformer block's forward (after tensor parallelism; "
                                "checkpointing recomputes the compiled code)")
    offload: str = _key("none", "none | cpu | disk: optimizer step in host memory (cpu), or Adam's moments "
                                "in a file (disk)")
    offload_params: str = _key("none", "none | cpu | disk: ZeRO-Infinity: ZeRO-3's parameter shards and their gradients "
                                       "in host memory or in files under --offload-dir, read in a unit at a time "
                                       "(ZeRO-3: implied by the default --zero 0, on one process too)")
    offload_activations: str = _key("none", "none | cpu: with --checkpointing full or every:K (not with --pp), the block "
                                            "inputs kept for backward go to "
                                            "host memory (on a GPU) or to a file under --offload-dir (on a CPU device)")
    offload_dir: str | None = _key(None, "with --offload disk, --offload-params disk or --offload-activations: where "
                                         "the files go (default: the temp directory)")
    reduce_dtype: str = _key("fp32", "dtype of the data-parallel gradient reduction: fp32 (the master gradients') "
                                     "or bf16 (half the bytes)")
    gather_dtype: str = _key("fp32", "with ZeRO-1/2/3: dtype the parameters are all-gathered in: fp32 (the masters) "
                                     "or, with --dtype bf16, bf16 (half the bytes; the layers then compute with "
                                     "bf16 weights, as DeepSpeed's bf16 mode and FSDP2's param_dtype do)")
    bucket_mb: float = _key(BUCKET_MB, "gradient bucket size (MB) for data parallelism and ZeRO-1/2")
    device: str = _key("auto", "auto | cpu | cuda")
    timeout: float = _key(300.0, "seconds a collective may take before it fails")
    comm_semantics: str | None = _key(None, "native | nccl: communicate as the backend does, or by NCCL's rules "
                                            "on any backend (on a CPU: gloo run as NCCL would, a rehearsal of a GPU "
                                            "layout; default: $STRATA_COMM_SEMANTICS, else native)")
    # evaluation, output, checkpoints
    eval_every: int = _key(0, "validate every N steps (0: only at the start and the end)")
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
                    setattr(self, name, path)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def to_dict(self) -> dict:
        return asdict(self)


def run_dir_outputs(run_dir: str) -> dict[str, str]:
    """The paths a run directory (--run-dir) gives the outputs not set otherwise
    (strata/train/run_dir.py writes the rest of it)."""
    paths = {"metrics": os.path.join(run_dir, "metrics.jsonl"), "save": os.path.join(run_dir, "ckpt")}
    if importlib.util.find_spec("tensorboard") is not None:  # events when they can be written
        paths["tensorboard"] = os.path.join(run_dir, "tb")
    return paths


def load_toml(path: str) -> dict:
    """Read a TOML config; keys are the long flag names with '_' or '-'."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path}: is a directory; want a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    valid = TrainConfig.keys()
    out, spelled = {}, {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in valid:
            raise ConfigError(f"--config {path}: unknown key {key!r}; valid keys: {', '.join(valid)}")
        if name in out:  # seq-len and seq_len: one value would win and the other vanish
            raise ConfigError(f"--config {path}: {spelled[name]!r} and {key!r} both set {name}; keep one")
        out[name], spelled[name] = value, key
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


def given_settings(file_values: dict, flag_values: dict) -> set[str]:
    """The settings the user set: every flag given, and the config file's keys whose value is not
    the default (a config.toml that --run-dir wrote lists every key, defaults included)."""
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    return {k for k, v in flag_values.items() if v is not None} | \
        {k for k, v in file_values.items() if v != defaults[k]}


def check_given(cfg: TrainConfig, given: set[str]) -> None:
    """Settings the user set that the run would not use: each refused in one line, never dropped.
    (Run in the process the user started: the ranks' argv also holds the launcher's choices. A
    --model beside --init-from is checked against the checkpoint: train/preflight.check_model_flag.)"""
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


def validate(cfg: TrainConfig, world_size: int, model: ModelConfig) -> None:
    """Check every setting against the others, the world size and the model (the shape the run
    builds: see strata/train/preflight.model_shape); raise ConfigError naming the first bad field,
    its value and what would be valid. Pure: no file is read, and nothing of this machine (its
    memory is checked where a run starts: check_run_memory), so that `strata plan` and training
    accept the same layouts."""
    check_run_settings(cfg)
    _need(cfg.nproc == 1 or world_size == cfg.nproc, "nproc", cfg.nproc,
          f"does not match the {world_size} processes launched")
    _need(cfg.max_restarts == 0 or world_size > 1, "max_restarts", cfg.max_restarts,
          "only with --nproc 2 or more: one process has no ranks to restart (run it again with --resume auto)")
    seq_len = sequence_length(cfg, model)
    _need(world_size % (cfg.tp * cfg.pp) == 0, "tp", cfg.tp,
          f"tp x pp = {cfg.tp * cfg.pp} does not divide the world size {world_size}")
    _need(world_size % (cfg.cp * cfg.tp * cfg.pp) == 0, "cp", cfg.cp,
          f"cp x tp x pp = {cfg.cp * cfg.tp * cfg.pp} does not divide the world size {world_size}")
    check_layout(model, layout_of(cfg, world_size), world_size, seq_len, global_batch_size(cfg, world_size))
    _need(cfg.pp > 1 or not cfg.trace, "trace", cfg.trace, "only with pp 2 or more")
    check_asynchronous_run(cfg, model)
    # Zero-bubble's W step intercepts the torch functions the forward calls; compiled code calls none.
    _need(not (cfg.compile and cfg.pp > 1 and cfg.schedule in SCHEDULES and SCHEDULES[cfg.schedule].splits_backward),
          "schedule", cfg.schedule, "not with --compile: its deferred weight gradients intercept torch functions, "
          "which compiled code does not call; valid with --compile: "
          + ", ".join(name for name, spec in SCHEDULES.items() if not spec.splits_backward))


def check_run_memory(cfg: TrainConfig, world_size: int, model: ModelConfig, memory: int | None = None) -> None:
    """What this machine's processes of the run hold at least, against its memory (rules/limits.py):
    lower bounds, so that a run which fits is never refused, and one that cannot is refused before
    it allocates. Each process: the interpreter; its share of the weights (one copy over the whole
    world, none in memory with offload_params disk); a step's token windows (the loader's int64
    rows); one micro-batch's embedding output (split at most over cp x tp); the rotary tables
    (strata/model/layers.rope_tables: cos and sin, float64, max_seq_len x head_dim each)."""
    local = cfg.nproc if world_size == cfg.nproc else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    seq_len, dp = sequence_length(cfg, model), data_parallel_size(cfg, world_size)
    weight_bytes = 8 if cfg.dtype == "fp64" else 4
    shape_field = next((f for f in ("n_layers", "vocab_size", "max_seq_len") if getattr(cfg, f) is not None), "model")
    context_field = "max_seq_len" if cfg.max_seq_len is not None else "model"
    rows = global_batch_size(cfg, world_size) // max(dp, 1)
    needs = [
        ("nproc", cfg.nproc, local * PROCESS_BYTES, f"{local} process(es) of Python and torch"),
        (shape_field, getattr(cfg, shape_field), 0 if cfg.offload_params == "disk" else
         model.num_params() * weight_bytes * local / world_size, f"this machine's share of the weights "
                                                                 f"({model.num_params():,} parameters)"),
        ("global_batch", global_batch_size(cfg, world_size),
         local * (global_batch_size(cfg, world_size) + rows * (seq_len + 1)) * 8,
         f"a step's token windows ({rows} x {seq_len + 1} int64 on each process)"),
        ("micro_batch", cfg.micro_batch, local * cfg.micro_batch * seq_len * model.d_model *
         DTYPES[cfg.dtype].bytes / (cfg.cp * cfg.tp), f"one micro-batch's embedding output on each process "
                                                       f"({cfg.micro_batch} x {seq_len} x {model.d_model})"),
        (context_field, getattr(cfg, context_field),
         local * 2 * model.max_seq_len * model.head_dim * 8 if model.position == "rope" else 0,
         f"the rotary tables of a {model.max_seq_len:,}-token context on each process"),
    ]
    check_fits_machine(needs, memory)


def check_asynchronous_run(cfg: TrainConfig, model: ModelConfig) -> None:
    """The run settings an asynchronous schedule needs (its layout: rules/layout.check_asynchronous)."""
    spec = SCHEDULES.get(cfg.schedule)
    asynchronous = spec is not None and spec.asynchronous
    if asynchronous:
        _need(cfg.grad_clip == 0, "grad_clip", cfg.grad_clip,
              f"not with --schedule {cfg.schedule}: clipping by the global norm would make every stage wait for "
              f"the others' gradients each step, the flush this schedule removes; use --grad-clip 0")
        _need(cfg.dtype != "fp16", "dtype", cfg.dtype,
              f"not with --schedule {cfg.schedule}: fp16's loss scaling skips a step on every stage at once when "
              f"one overflows, which needs them to meet; use bf16, fp32 or fp64")
    _need(cfg.emulate_stages >= 1, "emulate_stages", cfg.emulate_stages, "must be >= 1")
    if cfg.emulate_stages > 1:
        _need(cfg.pp == 1 and asynchronous and spec.update_per_micro_batch, "emulate_stages", cfg.emulate_stages,
              "only with --pp 1 --schedule pipedream or pipedream-vs (2BW's versions do not depend on the stages)")
        _need(not model.tie_embeddings or not spec.tied_apart(cfg.emulate_stages), "emulate_stages", cfg.emulate_stages,
              "not with a tied embedding (its first and last stage would compute with different versions)")
        try:  # the emulated stages' cut is valid
            make_layout(model, cfg.emulate_stages, 1, sequence_length(cfg, model), cfg.pp_split)
        except ConfigError as e:
            field = "emulate_stages" if e.field == "pp" else e.field
            raise ConfigError(e.reason, field, cfg.emulate_stages if field == "emulate_stages" else e.value) from None


def check_run_settings(cfg: TrainConfig) -> None:
    """Every setting on its own (ranges, names), and the ones that only make sense together."""
    _need(cfg.model in PRESETS, "model", cfg.model, f"unknown preset; valid: {', '.join(PRESETS)}")
    _need(cfg.n_layers is None or cfg.n_layers >= 1, "n_layers", cfg.n_layers, "must be >= 1")
    _need(cfg.max_seq_len is None or cfg.max_seq_len >= 1, "max_seq_len", cfg.max_seq_len, "must be >= 1")
    if cfg.n_heads is not None and cfg.model in PRESETS:
        width = PRESETS[cfg.model].d_model
        _need(cfg.n_heads >= 1 and width % cfg.n_heads == 0, "n_heads", cfg.n_heads,
              f"must divide the model's d_model {width}")
    check_checkpoint_flags(cfg)
    _need(cfg.parallel in ("manual", "auto"), "parallel", cfg.parallel, "valid: manual, auto")
    # (--allow-async stays in the ranks' argv after --parallel auto's choice, as --parallel manual: no effect there)
    _need(not cfg.allow_async or cfg.parallel != "auto" or (cfg.grad_clip == 0 and cfg.dtype != "fp16"), "allow_async", True,
          "the asynchronous schedules run without clipping and without fp16; add --grad-clip 0 (and use bf16 or fp32)")
    _need(cfg.dtype in DTYPES, "dtype", cfg.dtype, f"valid: {', '.join(DTYPES)}")
    _need(cfg.data == "synthetic" or os.path.isfile(os.path.join(cfg.data, "meta.json")), "data", cfg.data,
          f"no meta.json there; run `strata data prepare --out {cfg.data}` first, or use --data synthetic")
    check_device(cfg.device)
    resolve_semantics(cfg.comm_semantics)
    for name in ("steps", "micro_batch", "nproc", "tp", "cp", "pp", "virtual_stages", "eval_batches",
                 "loss_scale_window"):
        _need(getattr(cfg, name) >= 1, name, getattr(cfg, name), "must be >= 1")
    for name in ("warmup_steps", "save_every", "eval_every"):
        _need(getattr(cfg, name) >= 0, name, getattr(cfg, name), "must be >= 0")
    _need(cfg.warmup_steps <= cfg.steps, "warmup_steps", cfg.warmup_steps,
          f"must be at most steps {cfg.steps} (the learning rate would never reach lr)")
    _need(cfg.dp is None or cfg.dp >= 1, "dp", cfg.dp, "must be >= 1")
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
    for f in fields(TrainConfig):  # the ceilings (and floors) of rules/limits.py
        if f.name in CEILINGS or f.name in FLOORS:
            check_ceiling(f.name, getattr(cfg, f.name))
    _need(cfg.vocab_size is None or cfg.vocab_size >= 2, "vocab_size", cfg.vocab_size, "must be >= 2")
    _need(cfg.vocab_size is None or cfg.data == "synthetic", "vocab_size", cfg.vocab_size,
          "only for --data synthetic; a data set brings its tokenizer's")
    _need(cfg.offload_dir is None or "disk" in (cfg.offload, cfg.offload_params) or cfg.offload_activations != "none",
          "offload_dir", cfg.offload_dir, "only with offload disk, offload_params disk or offload_activations cpu")
    _need(cfg.offload_params == "none" or cfg.dtype != "fp16", "offload_params", cfg.offload_params,
          "not with dtype fp16 (loss scaling checks the gradients in memory); use bf16")
    check_transfer_dtypes(cfg.reduce_dtype, cfg.gather_dtype, cfg.dtype)  # against dp and zero: check_layout


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


def layout_of(cfg: TrainConfig, world_size: int) -> Layout:
    """The layout a config asks for (dp defaults to what tp and pp leave of the world)."""
    return Layout(data_parallel_size(cfg, world_size), cfg.tp, cfg.pp, cfg.virtual_stages, zero_stage(cfg),
                  cfg.micro_batch, cfg.checkpointing, cfg.offload, cfg.sequence_parallel, cfg.schedule,
                  cfg.pp_split if cfg.emulate_stages == 1 else None,  # else the emulated stages' cut
                  cfg.reduce_dtype, cfg.gather_dtype, cfg.offload_params, cfg.offload_activations, cfg.tp_mode,
                  cfg.tp_depth, cfg.ep, cfg.capacity_factor, cfg.cp, cfg.cp_mode)


def zero_stage(cfg: TrainConfig) -> int:
    """The ZeRO stage a run uses: --offload-params streams ZeRO-3's shards, so with the default
    --zero 0 it means stage 3, on any number of processes (on one, ZeRO-Infinity on one device);
    else --zero."""
    return 3 if cfg.offload_params != "none" and cfg.zero == 0 else cfg.zero


def sequence_length(cfg: TrainConfig, model: ModelConfig) -> int:
    """Tokens per sequence: as given, or the model's context."""
    return cfg.seq_len if cfg.seq_len is not None else model.max_seq_len


def data_parallel_size(cfg: TrainConfig, world_size: int) -> int:
    return cfg.dp if cfg.dp is not None else data_parallel_degree(world_size, cfg.cp, cfg.tp, cfg.pp)


def global_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Sequences per optimizer step: as given, or one micro-batch per data-parallel rank."""
    if cfg.global_batch is not None:  # 0 is a bad value for validate to refuse, not "unset"
        return cfg.global_batch
    return cfg.micro_batch * data_parallel_size(cfg, world_size)
