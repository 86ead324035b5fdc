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

import torch.distributed as dist
from safetensors.torch import save_file

from strata.checkpoint.shards import ShardReader
from strata.config import ConfigError

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
                                                       **state, "files": files})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.save_dir)
            with open(os.path.join(self.save_dir, "latest.tmp"), "w") as f:
                f.write(os.path.basename(final))
            os.replace(os.path.join(self.save_dir, "latest.tmp"), os.path.join(self.save_dir, "latest"))
            self._prune()
        self._barrier()  # the save is complete on every rank when save() returns

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        steps = sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(self.save_dir)) if m)
        for old in steps[:-self.keep]:
            shutil.rmtree(step_dir(self.save_dir, old), ignore_errors=True)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


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
def latest(save_dir: str) -> str | None:
    """The newest complete checkpoint under save_dir, or None."""
    pointer = os.path.join(save_dir, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(save_dir, f.read().strip())
    return path if os.path.isfile(os.path.join(path, MANIFEST)) else None


def resolve(path: str) -> str:
    """A checkpoint directory, or a save directory whose `latest` names one."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    found = latest(path)
    if found is None:
        raise ConfigError(f"{path}: not a complete checkpoint (no {MANIFEST}) and no 'latest' naming one in it")
    return found


def read_state(path: str) -> dict:
    """The manifest of a checkpoint (or of a save directory's latest), every file checked to exist
    with its recorded size."""
    path = resolve(path)
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path}: format {manifest.get('format')!r}, this strata reads {FORMAT!r}")
    for name, entry in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ConfigError(f"checkpoint {path}: {name} is missing")
        if os.path.getsize(file) != entry["bytes"]:
            raise ConfigError(f"checkpoint {path}: {name} has {os.path.getsize(file)} bytes, the manifest says "
                              f"{entry['bytes']} (truncated or replaced)")
    return manifest


def open_checkpoint(path: str) -> tuple[str, dict, ShardReader]:
    """(directory, manifest, a reader that verifies each file's checksum before using it)."""
    path = resolve(path)
    manifest = read_state(path)

    def verify(name: str) -> None:
        if name not in manifest["files"]:
            raise ConfigError(f"checkpoint {path}: {name} is not in the manifest")
        with open(os.path.join(path, name), "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != manifest["files"][name]["sha256"]:
            raise ConfigError(f"checkpoint {path}: {name} fails its checksum (sha256 {digest[:12]}..., "
                              f"the manifest says {manifest['files'][name]['sha256'][:12]}...): the file is corrupted")
    return path, manifest, ShardReader(path, manifest["files"], verify)
