"""The fields of a checkpoint's manifest that readers use, checked to be of the types strata
writes there: a manifest whose checksums all agree may still carry a field changed by hand or
by another tool, and a wrong type would fail far from the file that holds it."""

from __future__ import annotations

import math
from dataclasses import fields

import torch

from strata.errors import CorruptError
from strata.model.config import ModelConfig


def whole(value: object, least: int = 0) -> bool:
    """A whole number >= least (a bool is not one, though Python counts it as an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_records(manifest: dict, where: str) -> None:
    """The optional records readers use: the run's config and layout (objects), the data position
    and the loss scaler (counts, a finite positive scale), and a converted model's record of its
    Hugging Face origin (its config.json, tensor names, dtype and side files)."""
    for key in ("config", "layout", "data_position", "loss_scaler", "hf"):
        if key in manifest and not isinstance(manifest[key], dict):
            raise CorruptError(f"{where}: {key!r} is a JSON {type(manifest[key]).__name__}, not an object")
    problems = []
    position = manifest.get("data_position", {})
    problems += [f"data_position.{k}" for k in ("step", "sequences") if k in position and not whole(position[k])]
    scaler = manifest.get("loss_scaler")
    if scaler is not None:
        scale = scaler.get("scale")
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < math.inf):
            problems.append("loss_scaler.scale")
        problems += [f"loss_scaler.{k}" for k in ("good_steps", "skipped_steps") if not whole(scaler.get(k))]
    layout = manifest.get("layout", {})
    problems += [f"layout.{k}" for k in ("dp", "cp", "tp", "pp") if k in layout and not whole(layout[k], 1)]
    origin = manifest.get("hf", {})
    checks = {"config": lambda v: isinstance(v, dict), "source": lambda v: isinstance(v, str),
              "keys": lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
              "dtype": lambda v: isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype)
              and getattr(torch, v).is_floating_point,
              "side_files": lambda v: isinstance(v, dict) and all(isinstance(c, dict) for c in v.values())}
    problems += [f"hf.{k}" for k, ok in checks.items() if k in origin and not ok(origin[k])]
    if problems:
        raise CorruptError(f"{where}: {problems[0]} is not what strata writes there")


# What a ModelConfig field's annotation lets a manifest hold (ModelConfig.validate checks ranges and
# choices; a flag given as a string, or a count as a float, would pass it and fail far later).
_FIELD_TYPES = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
                "None": lambda v: v is None}


def field_problem(raw: dict) -> str | None:
    """The first field of a recorded model config whose value its annotation does not allow, or None."""
    for f in fields(ModelConfig):
        kinds = [k.strip() for k in str(f.type).split("|")]
        kinds = ["str" if k.startswith("Literal[") else k for k in kinds]
        if f.name in raw and all(k in _FIELD_TYPES for k in kinds) and \
                not any(_FIELD_TYPES[k](raw[f.name]) for k in kinds):
            return f"{f.name}={repr(raw[f.name])[:40]}: want {' or '.join(kinds)}"
    return None
