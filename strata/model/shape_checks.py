"""What ModelConfig (strata/model/config.py) checks and infers field by field: the largest value of
each field strata accepts, the checks validate applies, and the family a config without one
implies."""

from __future__ import annotations

# The largest shape strata accepts, field by field: far past every published model, short of what
# overflows a tensor's size or runs the planner for hours. Read from a config.json or a checkpoint,
# a shape beyond them is refused before anything is allocated (strata/rules/limits.py lists every
# ceiling, these included, and docs/cli.md prints them).
SHAPE_LIMITS: dict[str, tuple[int, str]] = {
    "vocab_size": (2**24, "the largest vocabularies hold about 256K tokens"),
    "n_layers": (1024, "the deepest trained transformers have about 1,000 blocks (DeepNet)"),
    "d_model": (2**17, "the widest models are about 25K wide"),
    "n_heads": (2**12, "the most heads are about 128"),
    "n_kv_heads": (2**12, "the most heads are about 128"),
    "d_head": (2**12, "the widest heads are 256 wide"),
    "d_ff": (2**20, "the widest MLPs are about 74K wide"),
    "expert_d_ff": (2**20, "the widest MLPs are about 74K wide"),
    "shared_d_ff": (2**20, "the widest MLPs are about 74K wide"),
    "max_seq_len": (2**24, "the longest contexts are about 10M tokens"),
    "sliding_window": (2**24, "the longest contexts are about 10M tokens"),
    "rope_original_max_seq_len": (2**24, "the longest contexts are about 10M tokens"),
    "n_experts": (2**14, "the most experts per layer are a few hundred"),
}


def check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    check_limit(name, value)


def check_limit(name: str, value: int) -> None:
    if name in SHAPE_LIMITS and value > SHAPE_LIMITS[name][0]:
        limit, why = SHAPE_LIMITS[name]
        raise ValueError(f"{name}={value!r} must be at most {limit:,} ({why})")


def check_positive(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{name}={value!r} must be a positive number")


def infer_family(cfg) -> str:
    """The family a config's options describe: what a manifest written before `family` existed
    holds (those knew llama, gpt2 and bloom shapes; gptj: the GPT-J preset's shape then, which
    computed the shared block: without GPT-J's family_options it is refused by validate)."""
    if cfg.n_experts:
        return "qwen2_moe" if cfg.qkv_bias else "mixtral"
    if cfg.position == "alibi" or cfg.embedding_norm:
        return "bloom"
    if cfg.position == "learned":
        return "gpt2"
    if cfg.norm == "layernorm":
        return "gptj"
    if cfg.norm == "gemma_rmsnorm":
        return "gemma"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    if cfg.sliding_window:
        return "mistral"
    return "llama"
