"""What a model family's description is, and the helpers the descriptions share (the registry of
families is strata/model/families/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from fnmatch import fnmatchcase

import torch

from strata.errors import ConfigError
from strata.model.config import ModelConfig, Shapes

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
    "summed_replica": "whole on every rank after the group's one input conversion, feeding only this rank's "
                      "heads, so its gradient is a part, summed over the group (MLA's down projections and "
                      "their norms)",
    "output_norm": "whole on every rank, over a row-parallel layer's summed output before the residual (Gemma 2's "
                   "and OLMo 2's norms after a sub-block): no conversion (under sequence parallelism it sees 1/t "
                   "of the tokens: gradient summed)",
    "projection_norm": "a norm over a whole column-parallel projection's output (OLMo 2's q norm): its weight "
                       "split as the features are, the sum of squares summed over the group (so is its gradient)",
    "kv_projection_norm": "the same over K's whole output (OLMo 2's k norm); where K is whole on every rank "
                          "(normed_kv_column) the norm is whole too, over every KV head, and keeps this rank's "
                          "query heads' KV heads after it (gradient summed)",
    "normed_kv_column": "K under a kv_projection_norm: as kv_column, but when there are fewer KV heads than ranks "
                        "it computes every KV head (the norm after it needs them all)",
    "moe": "a mixture of experts' layer: its routing weights' gradients summed over the ranks (each holds a "
           "slice of every expert), the routed outputs summed, the router's input gradient counted once",
    "stacked_experts": "a mixture's stacked expert matrices: each expert split as an MLP is (w_gate, w_up by their "
               "d_ff rows, w_down by its d_ff columns), the partial outputs summed with the layer's one "
               "reduction; the experts themselves split over the expert-parallel group",
}


@dataclass(frozen=True)
class OwnBlock:
    """A family's own block (torchtitan gives each model its own modules), for a computation the
    shared Block (strata/model/layers.py) does not do: what the Transformer builds for every layer in
    its place, the rotary tables its attention reads, the shapes of its parameters (ModelConfig's
    counts, the planner's) and the check of the family's options (cfg.family_options).

    The block keeps the shared Block's interface (layers.AttentionBlock: forward(x, rope, bias,
    cache), `attn` with `wk`, `head_dim` and `core`), so the KV cache, selective checkpointing and
    context parallelism (which replace `attn.core`) work on it unchanged; its modules are placed
    under tensor parallelism by the description's `tensor_parallel` paths, so sequence
    parallelism, the pipeline's cuts and ZeRO-3's units (a block each) follow."""
    make: Callable  # (ModelConfig, RouterLosses | None, layer index) -> that layer's block module
    parameter_shapes: Callable[[ModelConfig, int], Shapes]  # a layer's block's, in the order it registers them
    check: Callable[[ModelConfig], None]  # ValueError naming what the block cannot compute
    rope_tables: Callable | None = None  # ModelConfig -> (cos, sin), (max_seq_len, width); None: layers.rope_tables
    # ModelConfig -> why context parallelism's ring cannot compute its attention (a soft cap, a window on
    # some layers only), or None when it can; read by rules/context.check_context before processes start
    context_refusal: Callable[[ModelConfig], str | None] | None = None
    # (ModelConfig, sequence length) -> heads x (q/k width + v width) x attended positions, summed over
    # the layers (ModelConfig.flops_per_token); None: the shared block's count
    attention_products: Callable[[ModelConfig, int], int] | None = None
    # ModelConfig -> c, the logits becoming c · tanh(logits / c) (Gemma 2's final_logit_softcapping), or 0
    final_logit_softcap: Callable[[ModelConfig], float] | None = None
    # (ModelConfig, layer index) -> whether that layer's MLP is the mixture of experts (DeepSeek's first
    # layers are dense); None: every layer's, when the config has experts
    moe_layer: Callable[[ModelConfig, int], bool] | None = None
    # (ModelConfig, layer index) -> the block's persistent buffers, state a checkpoint keeps that no
    # optimizer trains (DeepSeek-V3's expert bias); None: none
    buffer_shapes: Callable[[ModelConfig, int], Shapes] | None = None
    # without family_options the shared Block computes the family's models (Qwen3-MoE with a mixture in
    # every layer: a model written before its own block existed reads the same)
    optional: bool = False


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
    # its own block, when the shared Block cannot compute it (its options: cfg.family_options)
    block: OwnBlock | None = None

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


def read_options(cfg: ModelConfig, options_type: type):
    """cfg.family_options as the family's own frozen dataclass: every field given, and no other
    (so that two configs of one model hold equal options)."""
    given, names = dict(cfg.family_options), [f.name for f in fields(options_type)]
    unknown, missing = sorted(set(given) - set(names)), [n for n in names if n not in given]
    if unknown or missing:
        raise ValueError(f"family_options of a {cfg.family} model: " +
                         (f"{unknown[0]!r} is not one of them ({', '.join(names)})" if unknown else
                          f"{missing[0]!r} is missing"))
    return options_type(**given)


def check_option(name: str, value, kind: type, valid=None) -> None:
    """One family option: of `kind` (a bool is no number; a whole number is a float too), and
    `valid(value)` when given."""
    kinds = (int, float) if kind is float else kind
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kinds) or (valid and not valid(value)):
        raise ValueError(f"family_options: {name}={value!r} is not a valid {kind.__name__} here")


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


def put_fused_qkv(out: dict, name: str, value, fused_key: str, blocks: str, heads: int, head_dim: int) -> bool:
    """A family's fused per-head query_key_value tensor (`fused_key` in a block) put into `out` as
    strata's wq, wk and wv (exact views); False when `name` is not one."""
    fused = name_from_hf(name, {fused_key: "attn.qkv"}, {}, blocks)
    if fused is None:
        return False
    for proj, part in zip(("wq", "wk", "wv"), split_per_head(value, heads, head_dim)):
        out[fused.replace(".qkv.", f".{proj}.")] = part
    return True


def split_per_head(fused, heads: int, head_dim: int) -> tuple:
    """A fused query_key_value laid out per head (BLOOM, GPT-NeoX: output rows (heads, 3,
    head_dim), q, k and v of head 0, then of head 1, ...) -> strata's q, k and v."""
    per_head = fused.view(heads, 3, head_dim, *fused.shape[1:])
    return tuple(per_head[:, i].reshape(heads * head_dim, *fused.shape[1:]).contiguous() for i in range(3))


def join_per_head(q, k, v, heads: int, head_dim: int):
    """The inverse of split_per_head, bit for bit."""
    fused = torch.stack([t.reshape(heads, head_dim, *t.shape[1:]) for t in (q, k, v)], dim=1)
    return fused.reshape(3 * heads * head_dim, *q.shape[1:])


def tied_head_to_hf(out: dict, tensors: dict, cfg: ModelConfig, keys: list | None, name: str) -> None:
    """A tied head is no tensor of strata's; a file that stored it anyway gets it back (a copy:
    safetensors refuses two names on one storage)."""
    if cfg.tie_embeddings and keys is not None and name in keys:
        out[name] = tensors["embed.weight"].clone()


def head_to_hf(out: dict, tensors: dict, cfg: ModelConfig, keys: list | None, name: str) -> None:
    """The head under the file's `name`: strata's own when untied, else the tied copy where the file
    stored one (for a family that writes its blocks by hand, not through names_to_hf)."""
    if cfg.tie_embeddings:
        tied_head_to_hf(out, tensors, cfg, keys, name)
    else:
        out[name] = tensors["head.weight"]


def default_rope_from_hf(hf: dict, where: str) -> dict:
    """A config.json's RoPE entry, transformers 5's `rope_parameters` or an older file's
    `rope_scaling` ({} when neither), refused in one line unless it is the default RoPE."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: config.json: rope_parameters / rope_scaling must be an object, not {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"{where}: config.json: rope_type {kind!r} is not supported; valid: default")
    return rope


def default_rope_theta_from_hf(hf: dict, where: str) -> float:
    """The default RoPE's base: inside `rope_parameters`, or an older file's `rope_theta`."""
    return default_rope_from_hf(hf, where).get("rope_theta", hf.get("rope_theta", 10000.0))


def default_rope_to_hf(hf: dict, cfg: ModelConfig, original: dict) -> None:
    """Write the default RoPE's base in the form the original file used (transformers 5's
    `rope_parameters` when there is no original)."""
    if "rope_parameters" in hf or not original:
        hf["rope_parameters"] = {**(hf.get("rope_parameters") or {}), "rope_type": "default",
                                 "rope_theta": cfg.rope_theta}
    else:
        hf["rope_theta"] = cfg.rope_theta
