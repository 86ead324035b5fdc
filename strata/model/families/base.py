"""What a model family's description is, and the helpers the descriptions share (the registry of
families is strata/model/families/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from strata.errors import ConfigError
from strata.model.config import ModelConfig

# Where a module's parameters go under 1-D tensor parallelism (strata/parallel/tensor.py does it).
PLACEMENTS = {
    "vocabulary": "rows of the vocabulary split across ranks, padded to a multiple of t (embedding, head)",
    "column": "output features split: a slice of the heads or of d_ff per rank (a bias split alike)",
    "kv_column": "K or V: split by KV head, or whole on every rank when there are fewer KV heads than ranks "
                 "(each rank uses its query heads' KV heads; gradients summed)",
    "row": "input features split, the partial outputs summed (reduce-scattered under sequence parallelism: "
           "the outputs it keeps split); the bias added once",
    "input_norm": "whole on every rank; its output feeds column-parallel layers, so the group's one input "
                  "conversion follows it (under sequence parallelism it sees 1/t of the tokens: gradient summed)",
    "head_norm": "whole on every rank, over each head's features (q/k norms): each rank normalises its own "
                 "heads, gradient summed",
    "replicated": "whole on every rank, with a whole gradient (position table, the embedding's norm, a router)",
    "moe": "a mixture of experts' layer: its routing weights' gradients summed over the ranks (each holds a "
           "slice of every expert), the routed outputs summed, the router's input gradient counted once",
    "stacked_experts": "a mixture's stacked expert matrices: each expert split as an MLP is (w_gate, w_up by their "
               "d_ff rows, w_down by its d_ff columns), the partial outputs summed with the layer's one "
               "reduction; the experts themselves split over the expert-parallel group",
}


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    model_types: tuple[str, ...]  # the Hugging Face model_type values it reads (none: planning only)
    # module path (a block's as "blocks.*.<path>") -> its placement (PLACEMENTS)
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

    def placement(self, module_name: str) -> str | None:
        """The tensor-parallel placement of the module at this path (None: a container, or a layer
        without parameters)."""
        for pattern, placement in self.tensor_parallel.items():
            if fnmatchcase(module_name, pattern):
                return placement
        return None


def in_blocks(placements: dict[str, str]) -> dict[str, str]:
    """Placements of the modules inside every block, by their path in a block."""
    return {f"blocks.*.{path}": placement for path, placement in placements.items()}


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


def name_from_hf(key: str, layer: dict, top: dict, blocks: str) -> str | None:
    """A family's tensor name -> strata's: a top-level one by `top`, a block's
    f"{blocks}{N}.{module}.{leaf}" by `layer` (the family's module path in a block -> strata's);
    None when it is neither."""
    if key in top:
        return top[key]
    if key.startswith(blocks):
        block, _, rest = key[len(blocks):].partition(".")
        module, _, leaf = rest.rpartition(".")
        if module in layer:
            return f"blocks.{block}.{layer[module]}.{leaf}"
    return None


def names_to_hf(tensors: dict, layer: dict, top: dict, blocks: str, prefix: str = "", block_value=None) -> dict:
    """strata's tensors under a family's names (the inverse of name_from_hf), each with `prefix`
    (a base model's, e.g. "transformer."); block_value(module, leaf, value), when given, is what a
    block's tensor becomes (None: not written, for tensors the caller fuses)."""
    reverse_layer, reverse_top = {v: k for k, v in layer.items()}, {v: k for k, v in top.items()}
    out = {}
    for name, value in tensors.items():
        if name in reverse_top:
            out[prefix + reverse_top[name]] = value
            continue
        _, block, rest = name.split(".", 2)
        module, leaf = rest.rsplit(".", 1)
        value = block_value(module, leaf, value) if block_value is not None else value
        if value is not None:
            out[f"{prefix}{blocks}{block}.{reverse_layer[module]}.{leaf}"] = value
    return out


def tied_head_to_hf(out: dict, tensors: dict, cfg: ModelConfig, keys: list | None, name: str) -> None:
    """A tied head is no tensor of strata's; a file that stored it anyway gets it back (a copy:
    safetensors refuses two names on one storage)."""
    if cfg.tie_embeddings and keys is not None and name in keys:
        out[name] = tensors["embed.weight"].clone()
