"""What a training run checks of its files before any process starts: the checkpoint it resumes
or starts from (everything but its tensors' values: every file's checksum, the shards' headers
and descriptions, the model), the save directory it writes into, the data it reads, and the
paths it writes.

The launcher runs these once (so a problem is one line, not one per rank) and says so in the run's
spec (strata/train/spec.py); a rank started some other way (torchrun by hand) runs them itself."""

from __future__ import annotations

import os
from dataclasses import replace

from strata.checkpoint import store
from strata.config import TrainConfig, data_parallel_size, global_batch_size, sequence_length
from strata.data.loader import check_token_ids, check_windows, read_meta
from strata.errors import ConfigError
from strata.model.config import ModelConfig, infer_family
from strata.model.presets import PRESETS
from strata.rules.dtypes import DTYPES
from strata.rules.limits import PROCESS_BYTES, check_fits_machine, size_text
from strata.rules.offload import MASTER_BYTES, MOMENT_BYTES
from strata.train.optim import offload_dir
from strata.train.run_dir import check_outputs


def resume_source(cfg: TrainConfig) -> tuple[str | None, str | None]:
    """(the checkpoint to resume from, a note to print about how it was found): --resume, or with
    `--resume auto` (and after a restart by torchrun, when --save is set) the save directory's last
    complete checkpoint written, if there is one."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if cfg.resume == "auto" or (cfg.resume is None and restarted and cfg.save):
        return store.resume_point(cfg.save) if cfg.save else (None, None)
    return cfg.resume, None


def saves_after(cfg: TrainConfig, steps_done: int) -> bool:
    """Whether a checkpoint is written once `steps_done` steps are done: every --save-every, and the last."""
    return bool(cfg.save) and ((cfg.save_every and steps_done % cfg.save_every == 0) or steps_done == cfg.steps)


def steps_to_save(cfg: TrainConfig, start_step: int) -> list[int]:
    return [k for k in range(start_step + 1, cfg.steps + 1) if saves_after(cfg, k)]


def model_shape(cfg: TrainConfig) -> ModelConfig:
    """The model's shape: the preset, or --init-from's checkpoint; --n-layers, --n-heads and
    --max-seq-len applied."""
    base = PRESETS[cfg.model]
    if cfg.init_from:
        base = store.model_config(store.read_state(cfg.init_from), store.resolve(cfg.init_from))
    if cfg.n_heads:  # as many KV heads, d_model / heads wide
        base = replace(base, n_heads=cfg.n_heads, n_kv_heads=None, d_head=None)
    if cfg.max_seq_len and cfg.max_seq_len != base.max_seq_len and base.position == "learned" and cfg.init_from:
        raise ConfigError(f"not with --init-from a model with learned positions: its position table has "
                          f"{base.max_seq_len} rows", "max_seq_len", cfg.max_seq_len)
    return base.with_overrides(n_layers=cfg.n_layers, max_seq_len=cfg.max_seq_len)


def check_model_flag(cfg: TrainConfig) -> None:
    """--model given beside --init-from: the checkpoint fixes the model, so a preset of another
    shape is refused (never dropped); one of the checkpoint's shape says the same thing. The
    vocabulary and context are left out of the comparison: data and --max-seq-len set them."""
    if cfg.model not in PRESETS:  # before the checkpoint is read: the name alone is wrong
        raise ConfigError(f"unknown preset; valid: {', '.join(PRESETS)}", "model", cfg.model)
    saved = model_shape(replace(cfg, n_layers=None, max_seq_len=None, n_heads=None))
    preset = PRESETS[cfg.model]
    if replace(saved, vocab_size=preset.vocab_size, max_seq_len=preset.max_seq_len) != preset:
        shape = f"{saved.n_layers} layers, d_model {saved.d_model}, {saved.n_heads} heads, {infer_family(saved)}"
        raise ConfigError(f"the checkpoint of --init-from {cfg.init_from} holds another model ({shape}); leave "
                          f"--model out: the checkpoint fixes the model", "model", cfg.model)


def data_vocab_size(cfg: TrainConfig, model_vocab: int) -> int:
    """The vocabulary the data brings: its tokenizer's, or synthetic data's (--vocab-size or the model's)."""
    if cfg.data == "synthetic":
        return cfg.vocab_size or model_vocab
    return read_meta(cfg.data)["vocab_size"]


def check_run_memory(cfg: TrainConfig, world_size: int, model: ModelConfig, memory: int | None = None) -> None:
    """What this machine's processes of the run hold at least, against its memory (rules/limits.py):
    lower bounds, so that a run which fits is never refused, and one that cannot is refused before
    it allocates. Each process: the interpreter; its share of the weights (one copy over the whole
    world, none in memory with offload_params disk); a step's token windows (the loader's int64
    rows); one micro-batch's embedding output (split at most over cp x tp); the rotary tables
    (strata/model/layers.rope_tables: cos and sin, float64, max_seq_len x head_dim each)."""
    lay = cfg.layout
    local = cfg.nproc if world_size == cfg.nproc else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    seq_len, dp = sequence_length(cfg, model), data_parallel_size(cfg, world_size)
    weight_bytes = 8 if cfg.dtype == "fp64" else 4
    shape_field = next((f for f in ("n_layers", "vocab_size", "max_seq_len") if getattr(cfg, f) is not None), "model")
    context_field = "max_seq_len" if cfg.max_seq_len is not None else "model"
    rows = global_batch_size(cfg, world_size) // max(dp, 1)
    needs = [
        ("nproc", cfg.nproc, local * PROCESS_BYTES, f"{local} process(es) of Python and torch"),
        (shape_field, getattr(cfg, shape_field), 0 if lay.offload_params == "disk" else
         model.num_params() * weight_bytes * local / world_size, f"this machine's share of the weights "
                                                                 f"({model.num_params():,} parameters)"),
        ("global_batch", global_batch_size(cfg, world_size),
         local * (global_batch_size(cfg, world_size) + rows * (seq_len + 1)) * 8,
         f"a step's token windows ({rows} x {seq_len + 1} int64 on each process)"),
        ("micro_batch", lay.micro_batch, local * lay.micro_batch * seq_len * model.d_model *
         DTYPES[cfg.dtype].bytes / (lay.cp * lay.tp), f"one micro-batch's embedding output on each process "
                                                       f"({lay.micro_batch} x {seq_len} x {model.d_model})"),
        (context_field, getattr(cfg, context_field),
         local * 2 * model.max_seq_len * model.head_dim * 8 if model.position == "rope" else 0,
         f"the rotary tables of a {model.max_seq_len:,}-token context on each process"),
    ]
    check_fits_machine(needs, memory)


def check_offload_space(cfg: TrainConfig, model: ModelConfig) -> None:
    """Disk offload's files fit where they go: 8 bytes per parameter for the shards and their
    gradients (--offload-params disk), 8 for Adam's moments (--offload disk; each data-parallel
    replica its own under ZeRO-0), this machine's share of them (its processes out of the world)."""
    lay = cfg.layout
    replicas = max(1, cfg.nproc // (lay.tp * lay.pp)) if lay.zero == 0 and lay.offload_params == "none" else 1
    per_param = 2 * MASTER_BYTES * (lay.offload_params == "disk") + MOMENT_BYTES * replicas * (lay.offload == "disk")
    if not per_param:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.nproc))
    needed = model.num_params() * per_param * min(1.0, local / int(os.environ.get("WORLD_SIZE", cfg.nproc)))
    directory = offload_dir(cfg)
    existing = directory
    while not os.path.isdir(existing):  # the directory is made when training starts
        existing = os.path.dirname(os.path.abspath(existing))
    try:
        disk = os.statvfs(existing)
    except OSError as e:
        raise ConfigError(f"its free space cannot be read ({e.strerror or e}); choose a directory on a disk",
                          "offload_dir", directory) from None
    if disk.f_blocks == 0:  # /proc, /sys: a file system with no storage behind it
        raise ConfigError(f"{existing} is on a file system with no storage (size 0); choose a directory on a disk",
                          "offload_dir", directory)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{existing} cannot be written by this user; choose a directory you can write",
                          "offload_dir", directory)
    free = disk.f_bavail * disk.f_frsize
    if needed > free:
        raise ConfigError(f"the disk offload needs about {size_text(needed)} there ({per_param} bytes per parameter of "
                          f"{model.num_params() / 1e9:.2f}B) and {size_text(free)} are free; choose a larger disk",
                          "offload_dir", directory)


def preflight(cfg: TrainConfig) -> list[str]:
    """Check the run's files; returns notes to print once (how the resume point was found).
    Raises ConfigError / CorruptError with one line."""
    notes = []
    check_outputs(cfg)  # every path the run writes; the tensorboard package; config.toml's text
    base = model_shape(cfg)  # reads --init-from's manifest
    if cfg.init_from:  # every file of it, checksums included (the tokenizer's too, as `generate` checks it)
        store.check_checkpoint(cfg.init_from)
    if cfg.data != "synthetic":
        meta = read_meta(cfg.data)
        check_windows(meta, sequence_length(cfg, base))
        check_token_ids(cfg.data, meta)
    model = base.with_overrides(vocab_size=data_vocab_size(cfg, base.vocab_size))
    check_run_memory(cfg, int(os.environ.get("WORLD_SIZE", cfg.nproc)), model)
    check_offload_space(cfg, model)
    if cfg.init_from and model.vocab_size != base.vocab_size:
        raise ConfigError(f"--init-from {cfg.init_from}: the model's vocabulary is {base.vocab_size}, "
                          f"the data's {model.vocab_size}; they must be equal")
    source, note = resume_source(cfg)
    notes += [note] if note else []
    start_step = 0
    if source is not None:
        start_step = _check_resumable(source, model)
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0  # after the last save: nothing left
        if start_step > cfg.steps or (start_step == cfg.steps and not restarted):
            raise ConfigError(f"the checkpoint {source} is at step {start_step} already; give steps above it to "
                              f"train on", "steps", cfg.steps)
    if cfg.save:
        store.check_no_overwrite(cfg.save, steps_to_save(cfg, start_step))
        store.check_same_run(cfg.save, source)
    return notes


def check_same_model(saved, model, path: str) -> None:
    """A checkpoint's model shape must be the run's. The context (max_seq_len) sizes no weight but
    a learned position table: a rotary or ALiBi model may go on with a longer or shorter one."""
    if model.position != "learned":
        saved = replace(saved, max_seq_len=model.max_seq_len)
    if saved != model:
        diff = [f"{k} (saved {v}, now {getattr(model, k)})" for k, v in saved.to_dict().items()
                if getattr(model, k) != v]
        raise ConfigError(f"checkpoint {path}: its model differs from this one in {', '.join(diff)}")


def _check_resumable(source: str, model) -> int:
    """The step a checkpoint resumes at, once its files and its model are checked."""
    path, manifest, saved = store.check_checkpoint(source, resume=True)
    check_same_model(saved, model, path)
    return manifest["step"]
