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

from collections.abc import Callable
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.model.config import ModelConfig

PLACEMENTS = ("column", "row", "vocabulary", "replicated")


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    model_types: tuple[str, ...]  # the Hugging Face model_type values it reads (none: planning only)
    tensor_parallel: dict[str, str]
    # hf config.json, where (for errors) -> ModelConfig
    config_from_hf: Callable[[dict, str], ModelConfig] | None = None
    # ModelConfig, the original config.json ({} when none) -> config.json
    config_to_hf: Callable[[ModelConfig, dict], dict] | None = None
    # Hugging Face tensors, ModelConfig, where -> strata's tensors
    tensors_from_hf: Callable[[dict, ModelConfig, str], dict] | None = None
    # strata's tensors, ModelConfig, the original file's tensor names (or None) -> Hugging Face's
    tensors_to_hf: Callable[[dict, ModelConfig, list | None], dict] | None = None

    @property
    def converts(self) -> bool:
        return self.config_from_hf is not None


# --- what the descriptions share --------------------------------------------------------------
def refuse_set(hf: dict, where: str, *keys: str) -> None:
    """One line naming the first of `keys` that the config.json turns on (strata does not compute it)."""
    for key in keys:
        if hf.get(key):
            raise ConfigError(f"{where}: config.json: {key}={hf[key]!r} is not supported")


def check_choice(hf: dict, where: str, key: str, valid: tuple, default) -> None:
    """The config.json's `key` (or its default when absent) is one of `valid`."""
    value = hf.get(key, default)
    if value not in valid:
        raise ConfigError(f"{where}: config.json: {key}={value!r} is not supported; valid: "
                          f"{', '.join(map(str, valid))}")


def tied_head_to_hf(out: dict, tensors: dict, cfg: ModelConfig, keys: list | None, name: str) -> None:
    """A tied head is no tensor of strata's; a file that stored it anyway gets it back (a copy:
    safetensors refuses two names on one storage)."""
    if cfg.tie_embeddings and keys is not None and name in keys:
        out[name] = tensors["embed.weight"].clone()


# --- the registry ---------------------------------------------------------------------------------
def _registry() -> dict[str, Family]:
    from strata.model.families import bloom, gemma, gpt2, gptj, llama, mistral, qwen2, qwen3
    return {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY, gemma.FAMILY,
                                gpt2.FAMILY, bloom.FAMILY, gptj.FAMILY)}


FAMILIES: dict[str, Family] = _registry()


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
