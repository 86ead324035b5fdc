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
import os
import re
import shutil
import threading
import time

import torch.distributed as dist
from safetensors.torch import save_file

from strata.checkpoint.shards import ShardReader
from strata.errors import ConfigError, CorruptError
from strata.files import inside, read_json_object
from strata.model.config import ModelConfig

MANIFEST = "manifest.json"
FORMAT = "strata-sharded-1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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
    if not os.path.isfile(pointer):
        return None
    with open(pointer, "rb") as f:
        name = f.read(256).decode("utf-8", "replace").strip()
    if not _STEP_DIR.match(name):
        raise CorruptError(f"{pointer}: names {name!r}, not a step directory (step_NNNNNN) of {save_dir}")
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
    newest = step_dir(save_dir, steps[-1])
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
    """The manifest's JSON, its shape checked: every listed file a plain name with a size and a sha256."""
    where = os.path.join(path, MANIFEST)
    manifest = read_json_object(where, "a checkpoint's manifest")
    if manifest.get("format") != FORMAT:
        raise CorruptError(f"{where}: format {manifest.get('format')!r}; this strata reads {FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()):
        raise CorruptError(f"{where}: 'files' must map each file name to its bytes and sha256")
    for name in files:
        inside(path, name, where)
    for key, kind in (("step", int), ("model_config", dict)):
        if not isinstance(manifest.get(key), kind):
            raise CorruptError(f"{where}: {key!r} is missing or not a {kind.__name__}")
    return manifest


def read_state(path: str) -> dict:
    """The manifest of a checkpoint (or of a save directory's latest), every file checked to exist
    with its recorded size."""
    path = resolve(path)
    manifest = _manifest(path)
    for name, entry in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptError(f"checkpoint {path}: {name} is missing")
        if os.path.getsize(file) != entry["bytes"]:
            raise CorruptError(f"checkpoint {path}: {name} has {os.path.getsize(file)} bytes, the manifest says "
                               f"{entry['bytes']} (truncated or replaced)")
    return manifest


def model_config(manifest: dict, path: str) -> ModelConfig:
    """The model shape a checkpoint records."""
    try:
        cfg = ModelConfig.from_dict(manifest["model_config"])
        cfg.validate()
    except (TypeError, ValueError) as e:
        raise CorruptError(f"checkpoint {path}: its model_config is not a valid model ({e})") from None
    return cfg


def _verifier(path: str, manifest: dict):
    def verify(name: str) -> str:
        """The file's path, once its bytes match the manifest's sha256."""
        if name not in manifest["files"]:
            raise CorruptError(f"checkpoint {path}: {name} is not in the manifest")
        file = inside(path, name, f"checkpoint {path}")
        with open(file, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != manifest["files"][name]["sha256"]:
            raise CorruptError(f"checkpoint {path}: {name} fails its checksum (sha256 {digest[:12]}..., "
                               f"the manifest says {manifest['files'][name]['sha256'][:12]}...): the file is corrupted")
        return file
    return verify


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
