"""Model families: one description each (torchtitan keeps a state-dict adapter and a parallelize
plan per model; picotron a name table), the one place that knows a family's Hugging Face
config.json, its tensor names and layouts, and where each of its parameters goes under tensor
parallelism.

A description says
- how to read a Hugging Face `config.json` into a ModelConfig (refusing, in one line naming the
  key, an option strata's model does not compute), and how to write one back over the original;
- how to rename (and re-lay-out) tensors from Hugging Face's names to strata's and back;
- `block`, when the shared Block cannot compute the family (GPT-J's and GPT-NeoX's parallel
  block): its own block module (base.OwnBlock), its options read from `cfg.family_options`;
- `tensor_parallel`: per module path (a block's as `blocks.*.<path>`), its placement (PLACEMENTS in
  base.py: vocabulary, column, kv_column, row, input_norm, head_norm, replicated), from which
  strata/parallel/tensor.py splits the model, the row placements being the outputs sequence
  parallelism keeps split.

The model's structure (its units: the input layers, each block, the output layers; what a pipeline
stage keeps; the tied matrix) is the Transformer's interface (`units`, `layers`, `keep`, `view`,
`tied_weight`, `keep_heads` in strata/model/transformer.py), and its parameter counts per unit are
`ModelConfig.unit_params`: ZeRO-3, the pipeline, checkpointing, the trainer and the planner read
those, and no module outside strata/model names a layer (tests/test_layers.py).

Adding a family is one file here (found by the registry below), its tests and its docs
(docs/architecture.md, "Adding a model family")."""

from __future__ import annotations

import importlib
import pkgutil

from strata.errors import ConfigError
from strata.model.config import FAMILY_PLACEMENTS, OWN_BLOCKS, ModelConfig
from strata.model.families.base import PLACEMENTS, Family  # noqa: F401 - the description's type, here too


# --- the registry: every module of this package but base.py describes one family (its FAMILY) -------
def _described() -> dict[str, Family]:
    found = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
        family = importlib.import_module(f"{__name__}.{module}").FAMILY
        found[family.name] = family
    return found


FAMILIES: dict[str, Family] = _described()
# ModelConfig counts a family's own block through its description (config.py imports no family)
OWN_BLOCKS.update({name: family.block for name, family in FAMILIES.items() if family.block is not None})
FAMILY_PLACEMENTS.update({name: frozenset(family.tensor_parallel.values()) for name, family in FAMILIES.items()})


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
