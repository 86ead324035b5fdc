"""A training run resolved once: `resolve(config, world) -> RunSpec`.

The process that starts the ranks (the launcher, `strata launch` on each node, an srun task per
node) resolves the run: it checks every setting, computes the model's shape, chooses the layout
under `--parallel auto`, fills in dp, the ZeRO stage and the global batch, and checks the run's
files (train/preflight.py). The ranks get the result as one file (`strata train --spec FILE`,
written by `write`), so nothing is parsed, chosen or checked again there. A process that is its
own launcher (one process; a rank torchrun started by hand; an srun task per rank) resolves in
place. `validate` counts the runs it checks (config.RunChecks.runs): one per launch."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace

from strata.config import (
    TrainConfig,
    check_run_settings,
    global_batch_size,
    resolve_layout,
    train_config_from_dict,
    validate,
)
from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.train.auto import choose
from strata.train.preflight import model_shape, preflight


@dataclass(frozen=True)
class RunSpec:
    """What every rank runs: the config resolved for `world_size` ranks (parallel manual, the
    layout's dp and ZeRO stage and the global batch filled in), the model's shape (before the
    data's vocabulary, which setup reads from the data), and whether the run's files were checked."""
    config: TrainConfig
    model: ModelConfig
    world_size: int
    files_checked: bool = False

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "model": self.model.to_dict(), "world_size": self.world_size,
                "files_checked": self.files_checked}

    @classmethod
    def from_dict(cls, raw: dict) -> RunSpec:
        return cls(train_config_from_dict(raw["config"]), ModelConfig.from_dict(raw["model"]), raw["world_size"],
                   raw["files_checked"])


def resolve(cfg: TrainConfig, world_size: int, announce: bool = True) -> RunSpec:
    """Check the run once and resolve it for `world_size` ranks (announce: print --parallel auto's
    choice and reasons, as rank 0 or the launcher)."""
    check_run_settings(cfg)  # the settings alone, before the model's shape is read from them
    model = model_shape(cfg)
    if cfg.parallel == "auto":
        cfg, reasons = choose(cfg, world_size, model)
        if announce:
            print("\n".join(reasons), file=sys.stderr, flush=True)
    validate(cfg, world_size, model, settings_checked=True)
    resolved = replace(cfg, parallel="manual", global_batch=global_batch_size(cfg, world_size),
                       layout=resolve_layout(cfg, world_size))
    return RunSpec(resolved, model, world_size)


def check_files(spec: RunSpec, announce: bool = True) -> RunSpec:
    """The run's files checked (preflight), once; its notes printed (announce) and the spec marked."""
    notes = preflight(spec.config)
    if announce and notes:
        print("\n".join(notes), file=sys.stderr, flush=True)
    return replace(spec, files_checked=True)


def write(spec: RunSpec, directory: str) -> str:
    """The spec as a file for the ranks (in the launcher's own temporary directory)."""
    path = os.path.join(directory, "run_spec.json")
    with open(path, "w") as f:
        json.dump(spec.to_dict(), f)
    return path


def read(path: str) -> RunSpec:
    """A spec a launcher wrote: the whole of it, or one line saying what is wrong."""
    try:
        with open(path) as f:
            return RunSpec.from_dict(json.load(f))
    except OSError as e:
        raise ConfigError(f"cannot be read ({e.strerror or e})", "spec", path) from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"is not a run spec strata wrote ({type(e).__name__}: {e})", "spec", path) from None
