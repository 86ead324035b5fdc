"""Checkpoint directories: written atomically, checked on load, optionally in the background.

    <save dir>/
      step_000010/
        shard_<rank>.safetensors   this rank's pieces (strata/checkpoint/shards.py), written in parallel
        shard_<rank>.json          where each piece sits in the logical tensors; the rank's random streams
        tokenizer.json             when trained on prepared data: enough to generate from
        manifest.json              written last: step, configs, layout, and every file's size and sha256
      latest                       names the newest complete checkpoint

Every rank writes into `step_NNNNNN.tmp`; when all have finished, rank 0 writes the manifest and
renames the directory into place, then rewrites `latest` (each by an atomic rename). A save killed
midway leaves only a `.tmp` directory, which no load ever reads and the next save removes. On load,
every listed file must exist with its recorded size, and a file's checksum is verified before any
of its bytes are used: a truncated, missing or altered file stops the load with an error naming it.

`--async-save`: the tensors are copied to host memory (a consistent snapshot) and the rest runs
in a thread, so training continues while the files are written; the thread coordinates with the
other ranks on a process group of its own. One save is in flight at a time."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import threading
import time

import torch.distributed as dist
from safetensors.torch import save_file

from strata.checkpoint.records import check_records, field_problem, whole
from strata.checkpoint.shards import ShardReader
from strata.errors import ConfigError, CorruptError
from strata.files import inside, read_json_object
from strata.model.config import ModelConfig
from strata.model.transformer import build_model, tensor_shapes

MANIFEST = "manifest.json"
FORMAT = "strata-sharded-1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step_{step:06d}")


class Checkpointer:
    """Writes this rank's part of each checkpoint; group is a process group for coordination (None
    for a single process). keep > 0 keeps only the newest `keep` checkpoints."""

    def __init__(self, save_dir: str, rank: int, world_size: int, group=None, keep: int = 0,
                 background: bool = False):
        self.save_dir, self.rank, self.world_size, self.group = save_dir, rank, world_size, group
        self.keep, self.background = keep, background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, tensors: dict, shard_meta: dict, state: dict, extra_files: tuple[str, ...] = ()) -> str:
        """Write checkpoint `step` from a snapshot (tensors on the host, not changed afterwards).
        Returns its directory, which exists once the save has finished (see `wait`)."""
        self.wait()
        args = (step, tensors, shard_meta, state, extra_files)
        if self.background:
            self._thread = threading.Thread(target=self._write_catching, args=args, name=f"save-step-{step}",
                                            daemon=True)
            self._thread.start()
        else:
            self._write(*args)
        return step_dir(self.save_dir, step)

    def wait(self) -> None:
        """Block until the save in flight (if any) has finished; re-raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write_catching(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = e

    def _write(self, step: int, tensors: dict, shard_meta: dict, state: dict, extra_files) -> None:
        final = step_dir(self.save_dir, step)
        tmp = final + ".tmp"
        if os.path.exists(final):  # a checkpoint is never replaced in place (every rank sees it alike)
            raise ConfigError(f"{final} exists already; a save never replaces a checkpoint (save elsewhere, "
                              f"or resume from it)")
        if self.rank == 0:
            os.makedirs(self.save_dir, exist_ok=True)
            for name in os.listdir(self.save_dir):  # what killed saves left behind
                if name.endswith(".tmp") and os.path.isdir(os.path.join(self.save_dir, name)):
                    shutil.rmtree(os.path.join(self.save_dir, name), ignore_errors=True)
            os.makedirs(tmp)
        self._barrier()
        names = [f"shard_{self.rank}.safetensors", f"shard_{self.rank}.json"]
        save_file(tensors, os.path.join(tmp, names[0]))
        _write_json(os.path.join(tmp, names[1]), shard_meta)
        if self.rank == 0:
            for path in extra_files:
                shutil.copy(path, tmp)
                names.append(os.path.basename(path))
        listing = {name: _describe(os.path.join(tmp, name)) for name in names}
        listings = [None] * self.world_size if self.rank == 0 else None
        if self.group is not None:
            dist.gather_object(listing, listings, dst=0, group=self.group)
        else:
            listings = [listing]
        if self.rank == 0:
            files = {name: entry for part in listings for name, entry in part.items()}
            _write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "step": step, "world_size": self.world_size,
                                                       "saved_at": time.time(), **state, "files": files})
            os.replace(tmp, final)
            _fsync_dir(self.save_dir)
            with open(os.path.join(self.save_dir, "latest.tmp"), "w") as f:
                f.write(os.path.basename(final))
            os.replace(os.path.join(self.save_dir, "latest.tmp"), os.path.join(self.save_dir, "latest"))
            self._prune(keep_step=step)
        self._barrier()  # the save is complete on every rank when save() returns

    def _prune(self, keep_step: int) -> None:
        """Keep the newest `keep` checkpoints by the time they were written (not by step number: a
        run resumed from an older step writes newer checkpoints of lower steps), and always the
        one just written."""
        if self.keep <= 0:
            return
        for old in by_writing_time(self.save_dir)[:-self.keep]:
            if old != keep_step:
                shutil.rmtree(step_dir(self.save_dir, old), ignore_errors=True)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def _saved_at(path: str) -> float:
    """When a checkpoint was written: its manifest's record, else the manifest file's time."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return float(json.load(f)["saved_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return os.path.getmtime(os.path.join(path, MANIFEST))


def check_same_run(save_dir: str, source: str | None) -> None:
    """A run saves into a directory of its own run only: a save directory that holds checkpoints
    takes a run that resumes from one of them (--resume auto, or --resume naming it or one of its
    checkpoints), never a fresh run or one resumed from elsewhere, whose checkpoints would mix
    with the other run's (and `latest`, and --keep's pruning, would mix the two)."""
    steps = complete_steps(save_dir)
    if not steps:
        return
    if source is not None and os.path.realpath(os.path.dirname(resolve(source))) == os.path.realpath(save_dir):
        return
    raise ConfigError(f"holds the checkpoints of another run (newest: step {max(steps)}); continue that run "
                      f"with --resume auto, or save elsewhere", "save", save_dir)


def check_no_overwrite(save_dir: str, steps_to_save: list[int]) -> None:
    """A run must not be about to write a checkpoint that exists already (checked before it starts)."""
    existing = set(complete_steps(save_dir))
    clash = sorted(existing.intersection(steps_to_save))
    if clash:
        raise ConfigError(f"--save {save_dir}: holds step {clash[0]} already, which this run would save again "
                          f"(newest there: step {max(existing)}); resume with --resume auto, or save elsewhere")


def _describe(path: str) -> dict:
    with open(path, "rb") as f:
        return {"bytes": os.path.getsize(path), "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading ------------------------------------------------------------------------------------
def _pointer(save_dir: str) -> str | None:
    """What `latest` names (a step directory's name), or None when there is no `latest`."""
    pointer = os.path.join(save_dir, "latest")
    if not os.path.lexists(pointer):
        return None
    inside(save_dir, "latest", save_dir)  # a link to a file elsewhere is not this directory's pointer
    if not os.path.isfile(pointer):
        return None
    with open(pointer, "rb") as f:
        name = f.read(256).decode("utf-8", "replace").strip()
    if not _STEP_DIR.match(name):
        raise CorruptError(f"{pointer}: names {name!r}, not a step directory (step_NNNNNN) of {save_dir}")
    inside(save_dir, name, pointer)
    return name


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def complete_steps(save_dir: str) -> list[int]:
    """The steps of the complete checkpoints under save_dir, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    found = (_STEP_DIR.match(name) for name in os.listdir(save_dir))
    return sorted(int(m.group(1)) for m in found if m and is_complete(os.path.join(save_dir, m.group(0))))


def latest(save_dir: str) -> str | None:
    """The checkpoint `latest` names, if it is complete; else None."""
    name = _pointer(save_dir)
    return os.path.join(save_dir, name) if name and is_complete(os.path.join(save_dir, name)) else None


def by_writing_time(save_dir: str) -> list[int]:
    """The steps of the complete checkpoints under save_dir, in the order they were written."""
    return sorted(complete_steps(save_dir), key=lambda k: _saved_at(step_dir(save_dir, k)))


def resume_point(save_dir: str) -> tuple[str | None, str | None]:
    """(the checkpoint to resume from, a note to print) for --resume auto: the complete checkpoint
    written last, which is what `latest` names unless a save was killed between writing its
    checkpoint and moving the pointer, or the pointer's checkpoint was removed; the note says so.
    (None, None) when save_dir holds no complete checkpoint."""
    named = _pointer(save_dir)
    steps = by_writing_time(save_dir)
    if not steps:
        note = f"{save_dir}/latest names {named}, which is not a complete checkpoint, and no other checkpoint " \
               f"is complete; starting from step 0" if named else None
        return None, note
    newest = inside(save_dir, os.path.basename(step_dir(save_dir, steps[-1])), save_dir)
    if named == os.path.basename(newest):
        return newest, None
    why = f"latest names {named}, which is not the last complete checkpoint written" if named else "there is no latest"
    return newest, f"{save_dir}: {why}; resuming from the last complete checkpoint written, {os.path.basename(newest)}"


def resolve(path: str) -> str:
    """A checkpoint directory, or a save directory whose `latest` names one."""
    if is_complete(path):
        return path
    found = latest(path)
    if found is None:
        raise ConfigError(f"{path}: not a complete checkpoint (no {MANIFEST}) and no 'latest' naming one in it")
    return found


def _manifest(path: str) -> dict:
    """The manifest's JSON, its shape checked: every listed file a plain name with a size and a
    sha256, and every field a reader uses of the type it uses (see checkpoint/records.py)."""
    where = inside(path, MANIFEST, f"checkpoint {path}")
    manifest = read_json_object(where, "a checkpoint's manifest")
    if manifest.get("format") != FORMAT:
        raise CorruptError(f"{where}: format {manifest.get('format')!r}; this strata reads {FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and whole(e.get("bytes")) and isinstance(e.get("sha256"), str)
            and _SHA256.fullmatch(e["sha256"]) for e in files.values()):
        raise CorruptError(f"{where}: 'files' must map each file name to its bytes and sha256 (64 hex digits)")
    for name in files:
        inside(path, name, where)
    for key, kind in (("step", int), ("model_config", dict)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise CorruptError(f"{where}: {key!r} is missing or not a {kind.__name__}")
    if manifest["step"] < 0:
        raise CorruptError(f"{where}: 'step' is {manifest['step']}; want a step count >= 0")
    check_records(manifest, where)
    return manifest


def read_state(path: str) -> dict:
    """The manifest of a checkpoint (or of a save directory's latest), every file checked to exist
    with its recorded size."""
    path = resolve(path)
    manifest = _manifest(path)
    for name, entry in manifest["files"].items():
        file = inside(path, name, f"checkpoint {path}")
        if not os.path.isfile(file):
            raise CorruptError(f"checkpoint {path}: {name} is missing")
        if os.path.getsize(file) != entry["bytes"]:
            raise CorruptError(f"checkpoint {path}: {name} has {os.path.getsize(file)} bytes, the manifest says "
                               f"{entry['bytes']} (truncated or replaced)")
    return manifest


def model_config(manifest: dict, path: str) -> ModelConfig:
    """The model shape a checkpoint records."""
    problem = field_problem(manifest["model_config"])
    if problem:
        raise CorruptError(f"checkpoint {path}: its model_config is not a valid model ({problem})")
    try:
        cfg = ModelConfig.from_dict(manifest["model_config"])
        cfg.validate()
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise CorruptError(f"checkpoint {path}: its model_config is not a valid model ({e})") from None
    return cfg


def checked_model_config(path: str, manifest: dict, reader: ShardReader) -> ModelConfig:
    """The model a checkpoint records, once its tensors are checked to be that model's: the same
    names and shapes. The count of parameters is compared first (arithmetic), so that a
    model_config changed to an absurd size is refused before a model is built from it."""
    cfg = model_config(manifest, path)
    held = {name: reader.shape(name) for name in reader.names()}
    count, described = sum(math.prod(shape) for shape in held.values()), cfg.num_params() + cfg.buffer_elements()
    if described != count:
        raise CorruptError(f"checkpoint {path}: its model_config describes {described:,} parameters (and "
                           f"buffers), its shards hold {count:,} (the manifest or the shards were changed)")
    wanted = tensor_shapes(build_model(cfg, seed=None))
    differ = sorted(set(wanted) ^ set(held)) or [n for n in sorted(wanted) if wanted[n] != held[n]]
    if differ:
        name = differ[0]
        raise CorruptError(f"checkpoint {path}: its model_config wants {name!r} of shape "
                           f"{list(wanted[name]) if name in wanted else None}, its shards hold "
                           f"{list(held[name]) if name in held else None}")
    return cfg


# The files this process has found to match their manifest's sha256, by what identifies their bytes
# on disk (and the sha256 they matched): the check before the ranks start and the load that follows
# in the same process hash each file once. Writing a file changes its ctime; only a write within the
# same clock tick as the previous one, after the check, would go unseen.
_VERIFIED: set[tuple] = set()


def _verifier(path: str, manifest: dict):
    def verify(name: str) -> str:
        """The file's path, once its bytes match the manifest's sha256."""
        if name not in manifest["files"]:
            raise CorruptError(f"checkpoint {path}: {name} is not in the manifest")
        file = inside(path, name, f"checkpoint {path}")
        want = manifest["files"][name]["sha256"]
        try:
            stat = os.stat(file)
            identity = (os.path.realpath(file), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns,
                        stat.st_ctime_ns, want)
            if identity in _VERIFIED:
                return file
            with open(file, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            raise CorruptError(f"checkpoint {path}: {name} cannot be read ({e.strerror or e})") from None
        if digest != want:
            raise CorruptError(f"checkpoint {path}: {name} fails its checksum (sha256 {digest[:12]}..., "
                               f"the manifest says {want[:12]}...): the file is corrupted")
        _VERIFIED.add(identity)
        return file
    return verify


def verify_files(path: str, manifest: dict) -> None:
    """Every file of a checkpoint against its sha256 (the shards' data files, the tokenizer, any
    other): a checksum that fails is one line before any process that loads it starts."""
    verify = _verifier(path, manifest)
    for name in manifest["files"]:
        verify(name)


def verified_file(path: str, name: str) -> str | None:
    """A checkpoint's extra file (tokenizer.json), checked against the manifest; None if it has none."""
    path = resolve(path)
    manifest = read_state(path)
    return _verifier(path, manifest)(name) if name in manifest["files"] else None


def open_checkpoint(path: str) -> tuple[str, dict, ShardReader]:
    """(directory, manifest, a reader that verifies each file's checksum before using it)."""
    path = resolve(path)
    manifest = read_state(path)
    return path, manifest, ShardReader(path, manifest["files"], _verifier(path, manifest))


def check_checkpoint(path: str, resume: bool = False) -> tuple[str, dict, ModelConfig]:
    """(directory, manifest, model) once everything about a checkpoint that needs no tensor's
    values is checked: the manifest, every file's size, the shards' descriptions and headers,
    for resume that it holds optimizer state, the tensors against the model_config, and every
    file's sha256, the tokenizer's included (last: the cheap checks first). The process that
    starts ranks runs this once, so that a damaged checkpoint is one line before any of them
    starts; each rank still checks what it reads (in a process that checked it already, a file
    unchanged since is not hashed again)."""
    path, manifest, reader = open_checkpoint(path)
    with reader:
        if resume and not reader.has_optimizer:
            raise ConfigError("the checkpoint holds no optimizer state (a converted model?); use --init-from to "
                              "start training from its weights", "resume", path)
        cfg = checked_model_config(path, manifest, reader)
    verify_files(path, manifest)
    return path, manifest, cfg
