"""What `--model` names when a command takes a model without training it (plan, doctor): a preset,
a strata checkpoint (or save) directory, or a Hugging Face config.json (or its directory)."""

from __future__ import annotations

import os

from strata.checkpoint.hf import model_config_from_hf
from strata.checkpoint.store import model_config, read_state, resolve
from strata.errors import ConfigError
from strata.files import read_json
from strata.model.config import ModelConfig
from strata.model.presets import PRESETS


def resolve_model(spec: str) -> ModelConfig:
    if spec in PRESETS:
        return PRESETS[spec]
    if os.path.isdir(spec) and not os.path.isfile(os.path.join(spec, "config.json")):
        return model_config(read_state(spec), resolve(spec))
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ConfigError(f"not a preset ({', '.join(PRESETS)}), a checkpoint directory or a Hugging Face "
                          f"config.json", "model", spec)
    return model_config_from_hf(read_json(path, "a Hugging Face config.json"), f"--model {spec}")
