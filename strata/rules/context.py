"""Context parallelism's rules, which the trainer and the planner share: which layouts split the
sequence over cp ranks, which tokens of it each rank holds, and what its attention moves.

The split (Megatron-core's and torchtitan's load balancing): a sequence of s tokens is cut into
2·cp equal chunks and rank r of the context-parallel group holds chunks r and 2·cp-1-r. Under a
causal mask a query sees the keys before it, so a rank holding only early tokens would have
little to do; each pair holds one early and one late chunk, and every rank's queries see about
the same number of keys.

Attention is the only layer that reads other tokens. Two ways to give it the whole sequence:
- ring (Liu, Zaharia, Abbeel 2023, "Ring Attention"): each rank's K and V blocks travel around
  the ring, cp-1 hops, each hop sent while the block before is attended to; the softmax is merged
  exactly across blocks with running log-sum-exps. The backward passes K and V around again, with
  the gradients of K and V accumulating as they travel and a last hop to bring them home.
- ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses"): an all-to-all turns the sequence split of q,
  k and v into a head split (each rank all s tokens of heads/cp heads), attention runs as on one
  device, and an all-to-all turns the output back; the backward runs the same four the other way.

Traffic per attention layer and micro-batch on each rank, with |K| the bytes of the layer's keys
over the whole sequence on one tensor-parallel rank (b·s·kv_heads/tp·head_dim elements; |V| the
same) and |Q| the queries' (b·s·heads/tp·head_dim):
  ring     forward: (cp-1)/cp·(|K| + |V|) = 2(cp-1)/cp·|K|, sent to the next rank in cp-1 hops
           backward: the same again, plus the gradients of K and V, cp hops of 1/cp each: |dK| + |dV|
  ulysses  forward: (cp-1)/cp² of (|Q| + |K| + |V| + |O|), O the output (|O| = |Q|): each all-to-all
           sends (cp-1)/cp of what the rank holds, 1/cp of the layer's; the backward the same again
So the ring moves K and V cp-1 times over whatever cp, and Ulysses 1/cp of all four tensors, less
per rank as cp grows (Jacobs et al.'s point), but on the critical path, with nothing to overlap.
What recomputation sends again: `recomputed_traffic`. Ulysses needs the heads each
tensor-parallel rank holds to divide by cp; KV heads that do not (grouped-query attention with
fewer KV heads than cp) are repeated to one per query head before the exchange, |K| = |Q|."""

from __future__ import annotations

from strata.errors import ConfigError
from strata.model.config import ModelConfig

CP_MODES = ("ring", "ulysses")


def check_context(model: ModelConfig, cp: int, cp_mode: str, tp: int, tp_mode: str, sequence_parallel: bool,
                  seq_len: int) -> None:
    """Raise ConfigError (naming the field) unless strata splits this model's sequences over cp
    ranks this way."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ConfigError("must be >= 1", "cp", cp)
    if cp_mode not in CP_MODES:
        raise ConfigError(f"valid: {', '.join(CP_MODES)}", "cp_mode", cp_mode)
    if cp == 1:
        if cp_mode != "ring":
            raise ConfigError("chooses how context parallelism attends, and cp is 1", "cp_mode", cp_mode)
        return
    if seq_len % (2 * cp):
        raise ConfigError(f"must be a multiple of 2 x cp = {2 * cp} (each rank holds 2 of {2 * cp} equal chunks "
                          f"of every sequence)", "seq_len", seq_len)
    if sequence_parallel and seq_len % (cp * tp):
        raise ConfigError(f"must be a multiple of cp x tp = {cp * tp} with sequence parallelism (each rank's part "
                          f"of the sequence is split tp ways again)", "seq_len", seq_len)
    if tp_mode != "1d":
        raise ConfigError(f"not with cp {cp}: context parallelism runs with tp_mode 1d", "tp_mode", tp_mode)
    if model.moe and model.router_aux_coef:  # (routing itself is per token: DeepSeek-V3's, without it, runs)
        raise ConfigError("not with a mixture of experts whose router has a load-balancing loss (router_aux_coef "
                          f"{model.router_aux_coef:g}): it is a product of averages over whole sequences", "cp", cp)
    own = model.own_block()  # a family's own attention the ring cannot compute (families/base.OwnBlock)
    refusal = own.context_refusal(model) if own is not None and own.context_refusal is not None else None
    if refusal:
        raise ConfigError(f"not for a {model.family} model: {refusal}", "cp", cp)
    if cp_mode == "ulysses" and (model.n_heads // tp) % cp:
        raise ConfigError(f"cp {cp} must divide the {model.n_heads // tp} attention heads each tensor-parallel rank "
                          f"holds (ulysses gives each rank heads / cp of them); use cp_mode ring", "cp_mode", cp_mode)


def chunk_bounds(seq_len: int, cp: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, stop) ranges of a sequence of seq_len tokens that rank cp_rank holds:
    chunks cp_rank and 2·cp-1-cp_rank of 2·cp."""
    chunk = seq_len // (2 * cp)
    late = 2 * cp - 1 - cp_rank
    return (cp_rank * chunk, (cp_rank + 1) * chunk), (late * chunk, (late + 1) * chunk)


def local_kv_heads(model: ModelConfig, tp: int) -> int:
    """The KV heads one tensor-parallel rank computes with (all its query heads read them)."""
    return max(1, model.kv_heads // tp)


def exchanged_kv_heads(model: ModelConfig, tp: int, cp: int) -> int:
    """KV heads per tensor-parallel rank that Ulysses' all-to-all moves: its own, or, when cp does
    not divide them, one per query head (repeated before the exchange)."""
    kv = local_kv_heads(model, tp)
    return kv if kv % cp == 0 else model.n_heads // tp


def attention_traffic(model: ModelConfig, cp: int, cp_mode: str, tp: int, tokens: int, act_bytes: float,
                      grad_bytes: float) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends over the context-parallel group per attention
    layer and micro-batch of `tokens` tokens (micro-batch x sequence, the whole sequence), with
    activations of act_bytes and, for the ring, K and V gradients travelling in grad_bytes."""
    if cp == 1:
        return 0.0, 0.0
    ring = (cp - 1) / cp
    q = tokens * model.n_heads // tp * model.head_dim
    if cp_mode == "ring":
        kv = 2 * tokens * local_kv_heads(model, tp) * model.head_dim
        return ring * kv * act_bytes, ring * kv * act_bytes + kv * grad_bytes
    kv = 2 * tokens * exchanged_kv_heads(model, tp, cp) * model.head_dim
    forward = ring / cp * (2 * q + kv) * act_bytes
    return forward, forward


def ring_gradient_bytes(act_bytes: float) -> float:
    """Bytes per element of the K and V gradients the ring sends: they accumulate in at least fp32
    as they travel (the activations' dtype when wider: fp64)."""
    return max(act_bytes, 4)


def recomputed_traffic(model: ModelConfig, cp: int, cp_mode: str, tp: int, tokens: int, act_bytes: float,
                       checkpointing: str) -> float:
    """Bytes the backward's recomputation sends again per attention layer and micro-batch, for the
    layer's own checkpointing ("none", "selective", "full"; under every:K the first K blocks of a
    chunk are "full", the rest "none"): the forward's under full checkpointing (the block is rerun
    up to its last saved tensor, past attention); under selective (the core attention rerun) the
    ring's forward, and Ulysses' but the output's all-to-all: torch's checkpoint stops recomputing
    once the tensors backward needs are back, and attention's output is kept before that last
    exchange."""
    if checkpointing not in ("none", "selective", "full"):
        raise ValueError(f"a layer's checkpointing is none, selective or full, not {checkpointing!r}")
    forward, _ = attention_traffic(model, cp, cp_mode, tp, tokens, act_bytes, act_bytes)
    if checkpointing == "none" or cp == 1:
        return 0.0
    if checkpointing == "selective" and cp_mode == "ulysses":
        q = tokens * model.n_heads // tp * model.head_dim
        kv = 2 * tokens * exchanged_kv_heads(model, tp, cp) * model.head_dim
        return forward * (q + kv) / (2 * q + kv)
    return forward


def extra_activation_elements(model: ModelConfig, cp: int, cp_mode: str, tp: int, tokens: int) -> float:
    """Elements one attention layer keeps for backward per micro-batch on a rank beyond 1/cp of
    what one rank would keep for the whole sequence (tokens: micro-batch x sequence). The ring
    keeps exactly 1/cp (its output is the copy the output projection reads). Ulysses' attention
    keeps its output in the head split besides the sequence-split copy the projection keeps
    (b·s/cp·heads/tp·head_dim), and K and V as exchanged: repeated to one per query head when cp
    does not divide the KV heads."""
    if cp == 1 or cp_mode == "ring":
        return 0.0
    repeated = exchanged_kv_heads(model, tp, cp) - local_kv_heads(model, tp)
    return tokens / cp * (model.n_heads // tp + 2 * repeated) * model.head_dim

