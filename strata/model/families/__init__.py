"""Model families: one description each (torchtitan keeps a state-dict adapter and a parallelize
plan per model; picotron a name table), the one place that knows a family's Hugging Face
config.json, its tensor names and layouts, and where each of its parameters goes under tensor
parallelism.

A description says
- how to read a Hugging Face `config.json` into a ModelConfig (refusing, in one line naming the
  key, an option strata's model does not compute), and how to write one back over the original;
- how to rename (and re-lay-out) tensors from Hugging Face's names to strata's and back;
- `tensor_parallel`: per parameter path, inside a block (the path under `blocks.N.`) or at the
  top of the model, its placement: "column" (output features split), "row" (input features
  split, bias replicated), "vocabulary" (rows of the vocabulary split, padded) or "replicated".

Adding a family is one file here, one line in FAMILIES, and its tests (docs/architecture.md)."""

from __future__ import annotations

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families import bloom, gemma, gpt2, gptj, llama, mistral, qwen2, qwen3
from strata.model.families.base import PLACEMENTS, Family  # noqa: F401 - the description's type, here too

# --- the registry ---------------------------------------------------------------------------------
FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY,
                                                  gemma.FAMILY, gpt2.FAMILY, bloom.FAMILY, gptj.FAMILY)}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"model family {name!r} is not described; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def model_types() -> list[str]:
    return [kind for family in FAMILIES.values() for kind in family.model_types]


def family_of_model_type(kind, where: str) -> Family:
    """The family that reads a Hugging Face config.json of this model_type."""
    for family in FAMILIES.values():
        if kind in family.model_types:
            return family
    raise ConfigError(f"{where}: model_type {kind!r} is not supported; valid: {', '.join(model_types())}")


def converting_family(cfg: ModelConfig) -> Family:
    """The family that writes this model as a Hugging Face one."""
    family = get_family(cfg.family)
    if not family.converts:
        raise ConfigError(f"model family {cfg.family!r} has no Hugging Face conversion; "
                          f"those with one: {', '.join(f.name for f in FAMILIES.values() if f.converts)}")
    return family
