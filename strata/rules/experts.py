"""Expert parallelism's rules, which the trainer and the planner share: which layouts split a
mixture's experts, how the expert-parallel group is carved out of the data-parallel ranks, and
what its all-to-all moves.

The layout (Megatron-core's and DeepSpeed-MoE's): ep ranks of the dp ranks form an expert-parallel
group that holds every expert once (n_experts / ep per rank); the dp / ep groups of ranks holding
the same experts are the expert-data-parallel groups over which the experts' gradients are
reduced (and their ZeRO-1/2 states sharded). Dense parameters stay data-parallel over all dp
ranks. The ep ranks of a group are adjacent dp ranks, so with tp innermost a group spans ep x tp
consecutive ranks: inside a node while ep x tp fits one.

Traffic per MoE layer and micro-batch, on each rank, with r_j the rows (token, expert) this rank
routes to rank j's experts and s_j the rows rank j routes to this rank's (Megatron's
`MoEAlltoAllTokenDispatcher`): the dispatch sends sum_{j != me} r_j rows of d_model and the
combine sends sum_{j != me} s_j back; backward runs the two the other way, the same volume
again. The counts (n_experts / ep per peer) go first, in int64, so that each rank can size what
it receives."""

from __future__ import annotations

from strata.errors import ConfigError
from strata.model.config import ModelConfig

COUNT_BYTES = 8  # the routed-row counts are exchanged as int64


def check_experts(model: ModelConfig, ep: int, dp: int, zero: int, tp_mode: str, sequence_parallel: bool,
                  capacity_factor: float | None, offload_params: str = "none") -> None:
    """Raise ConfigError (naming the field) unless strata splits this model's experts over ep of
    the dp ranks with these options."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ConfigError("must be >= 1", "ep", ep)
    if capacity_factor is not None:
        if not model.moe:
            raise ConfigError("applies to a mixture of experts, and the model has none", "capacity_factor",
                              capacity_factor)
        if not isinstance(capacity_factor, (int, float)) or isinstance(capacity_factor, bool) or \
                not 0 < capacity_factor < float("inf"):
            raise ConfigError("must be a positive number (e.g. 1.25), or left out for dropless routing",
                              "capacity_factor", capacity_factor)
        most = model.n_experts / model.experts_per_token  # from here on an expert may take every token
        if capacity_factor > most:
            raise ConfigError(f"must be at most n_experts / experts_per_token = {most:g}: from there on no token is "
                              f"ever dropped (leave it out for dropless routing)", "capacity_factor", capacity_factor)
    if not model.moe:
        if ep > 1:
            raise ConfigError("splits a mixture's experts, and the model has none (try --model tiny-moe)", "ep", ep)
        return
    if tp_mode != "1d":
        raise ConfigError("a mixture of experts runs with tp_mode 1d (Megatron's split of each expert)",
                          "tp_mode", tp_mode)
    if sequence_parallel:
        raise ConfigError("not with a mixture of experts: the router reads whole sequences", "sequence_parallel", True)
    if ep == 1:
        return
    if model.n_experts % ep:
        raise ConfigError(f"must divide the model's {model.n_experts} experts", "ep", ep)
    if dp % ep:
        raise ConfigError(f"is carved out of the data-parallel ranks: must divide dp {dp}", "ep", ep)
    if zero == 3:
        raise ConfigError(f"not with ep {ep}: ZeRO-3 would gather each expert over every rank; use zero 1 or 2 "
                          f"(expert states are sharded over their own data-parallel group)",
                          *(("offload_params", offload_params) if offload_params != "none" else ("zero", zero)))


def expert_dp_members(dp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Within one (pp, tp) slice, the dp indices of each expert-parallel group (adjacent) and of each
    expert-data-parallel group (ranks holding the same experts)."""
    ep_groups = [list(range(start, start + ep)) for start in range(0, dp, ep)]
    edp_groups = [list(range(e, dp, ep)) for e in range(ep)]
    return ep_groups, edp_groups


def all_to_all_bytes(sent_rows: list[int], received_rows: list[int], me: int, d_model: int, element_bytes: int,
                     n_experts: int, ep: int, backward: bool = True) -> float:
    """Bytes one rank sends in one MoE layer's all-to-alls for one micro-batch: sent_rows[j] rows to
    rank j's experts, received_rows[j] from rank j; the counts first (n_experts/ep int64 per peer);
    with backward, the two exchanges again the other way (no counts: the forward's are reused)."""
    others = sum(sent_rows) - sent_rows[me] + sum(received_rows) - received_rows[me]
    rows = others * (2 if backward else 1)
    return rows * d_model * element_bytes + (ep - 1) * (n_experts // ep) * COUNT_BYTES


def uniform_all_to_all_bytes(tokens: int, k: int, d_model: int, element_bytes: int, ep: int) -> float:
    """The planner's expectation of `all_to_all_bytes` (forward and backward, counts left out) when the
    router spreads the k*tokens assignments evenly: (ep-1)/ep of them leave the rank, and as many come in."""
    return 4 * tokens * k * (ep - 1) / ep * d_model * element_bytes
