"""Mixtures of experts for the cost model (docs/cost-model.md, "Mixture of experts and expert
parallelism"): what a rank holds of the experts and of their states, what an MoE layer keeps for
backward, its GEMMs and memory-bound passes, and the all-to-all that moves its routed rows,
priced on the link the expert-parallel group crosses. The layout (ep carved out of dp, ep adjacent
dp ranks, tp innermost) and the traffic are strata/rules/experts.py's, which the runtime follows.

A dense model passes through every function here unchanged (no experts, nothing added)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.model.config import ModelConfig
from strata.plan.links import Cluster, all_to_all_seconds, group_link
from strata.plan.links import members_per_node as members_on_a_node
from strata.plan.memory import ModelStates, held_state_bytes, onebit_error_bytes, powersgd_fractions
from strata.rules.experts import COUNT_BYTES, uniform_all_to_all_bytes
from strata.rules.layout import Layout


def expert_degrees(cfg: ModelConfig, dp: int) -> list[int]:
    """The ep values the search tries: divisors of the model's experts that divide dp (1 for a dense model)."""
    if not cfg.moe:
        return [1]
    return [e for e in range(1, cfg.n_experts + 1) if cfg.n_experts % e == 0 and dp % e == 0]


def expert_group(lay: Layout) -> tuple[int, int]:
    """(size, stride) of the expert-data-parallel group: the dp / ep ranks holding the same experts,
    ep x tp ranks apart (the ep group's members are adjacent dp ranks, tp innermost)."""
    return lay.dp // lay.ep, lay.ep * lay.tp


def expert_share(cfg: ModelConfig, lay: Layout, held: float, layers: float) -> tuple[float, float]:
    """(dense, expert) parameters one rank holds, of `held` (a stage's parameters after tensor
    parallelism's 1/tp): the routed experts of its `layers` blocks with the mixture are n_experts /
    ep per rank, each cut along d_ff by tp. Without expert parallelism the experts count as dense
    (one group)."""
    if not cfg.moe or lay.ep == 1:
        return held, 0.0
    experts = layers * cfg.expert_params() / lay.tp
    return held - experts, experts / lay.ep


def local_params(cfg: ModelConfig, lay: Layout, held: float, layers: float) -> float:
    """The parameters a rank holds, its experts included."""
    return sum(expert_share(cfg, lay, held, layers))


def held_states(cfg: ModelConfig, lay: Layout, held: float, layers: float, precision: str,
                optimizer: str) -> ModelStates:
    """Model-state bytes of one rank: the dense parameters' under ZeRO over the dp x cp ranks that
    hold them (as for a dense model), the experts' over their own data-parallel group of dp / ep
    ranks (the runtime's ExpertSplit: a group of one rank shards nothing, so its experts keep
    ZeRO-0's states; a mixture has no context parallelism)."""
    dense, experts = expert_share(cfg, lay, held, layers)
    states = held_state_bytes(dense, lay.zero, lay.shards, precision, optimizer, lay.gather_dtype)
    if lay.compress == "powersgd":  # each compressed matrix's error, kept beside its fp32 gradient
        states = replace(states, grads=states.grads + powersgd_fractions(cfg, lay.compress_rank)[2] * dense * 4)
    if lay.compress in ("onebit", "zeroone"):  # the worker's and the server's error buffers
        extra = onebit_error_bytes(dense, lay.shards)
        if lay.compress == "zeroone":  # and 0/1 Adam's flat fp32 gradient, compressed in place
            extra += 4 * dense
        elif lay.zero == 1:  # 1-bit Adam's fp32 momentum, whole on every rank: beyond ZeRO-1's shard of it
            extra += 4 * dense * (1 - 1 / lay.shards)
        states = replace(states, grads=states.grads + extra)
    if not experts:
        return states
    edp, _ = expert_group(lay)
    zero, gather = (lay.zero, lay.gather_dtype) if edp > 1 else (0, "fp32")
    ex = held_state_bytes(experts, zero, edp, precision, optimizer, gather)
    return ModelStates(states.weights + ex.weights, states.grads + ex.grads, states.optimizer + ex.optimizer)


def updated_params(cfg: ModelConfig, lay: Layout, held: float, layers: float) -> float:
    """The parameters this rank's optimizer step updates: everything it holds, or under ZeRO its
    shards (the dense parameters' 1/(dp·cp), the experts' 1/(dp/ep))."""
    dense, experts = expert_share(cfg, lay, held, layers)
    if lay.zero < 1:
        return dense + experts
    return dense / lay.shards + experts / expert_group(lay)[0]


# --- what an MoE layer keeps for backward ---------------------------------------------------------
def activation_change(cfg: ModelConfig, tokens: int, tp: int, checkpointing: str, act_bytes: int) -> float:
    """Bytes one MoE layer keeps for backward (one micro-batch of `tokens`, one rank) beyond the dense
    layer the activation formula counts (plan/memory.activation_bytes_per_layer): its MLP's hidden
    part (Korthikanti's 16·sbh/t at 2 bytes) replaced by the routed rows (strata/model/moe.py, as the
    saved-tensor hooks count them): per token k rows of d_model into the experts and k of their
    outputs (kept twice: by the routing weights' product and by the scatter back), 4 tensors of
    expert_width/t per row (gate, its SiLU, up, their product), the shared expert's 4 of
    shared_d_ff/t (and its output, when gated), and the routing's own small tensors (fp32
    probabilities over the experts, top-k weights and indices, the rows' indices). The router's
    input is the dense MLP's input, counted already. Full recomputation keeps the block input only."""
    if not cfg.moe or checkpointing == "full":
        return 0.0
    d, k, f = cfg.d_model, cfg.experts_per_token, cfg.expert_width
    routed = act_bytes * k * (3 * d + 4 * f / tp)
    shared = act_bytes * (4 * cfg.shared_d_ff / tp + (d if cfg.gated_shared_expert else 0)) if cfg.shared_d_ff else 0.0
    routing = 4 * cfg.n_experts + (8 + 4) * k + 4 + 2 * 8 * k + act_bytes * k
    dense_hidden = 16 * d / tp * act_bytes / 2
    return tokens * (routed + shared + routing - dense_hidden)


# --- compute ----------------------------------------------------------------------------------------
def moe_gemms(cfg: ModelConfig, tokens: float, tp: int, ep: int) -> list[tuple[float, float, float]]:
    """(m, n, k) of an MoE layer's GEMMs on one rank for one micro-batch: the router (every token
    against every expert, whole on each tp rank), then each of the rank's n_experts / ep experts on
    its rows (the ep ranks' k·tokens assignments spread evenly: ep·tokens·k / n_experts rows each),
    its width cut by tp; the shared expert on every token, and its gate."""
    d, k, n = cfg.d_model, cfg.experts_per_token, cfg.n_experts
    rows, f = ep * tokens * k / n, cfg.expert_width / tp
    gemms = [(tokens, n, d)] + [(rows, f, d), (rows, f, d), (rows, d, f)] * (n // ep)
    if cfg.shared_d_ff:
        fs = cfg.shared_d_ff / tp
        gemms += [(tokens, fs, d), (tokens, fs, d), (tokens, d, fs)] + ([(tokens, 1, d)] if cfg.gated_shared_expert else [])
    return gemms


# Elements read and written per token by the routing's passes, in units of d_model per routed row:
# gathering the rows (x[token_of]: read, write), the routing weight's product (read two, write) and
# the scatter back (index_add: read, read, write), under expert parallelism the rows' reordering by
# expert and back (two copies); and in units of n_experts, the softmax (read, write) and top-k (read).
ROUTE_PASSES, EP_REORDER_PASSES, SOFTMAX_PASSES = 2 + 3 + 3, 4, 3
ROUTE_KERNELS = 16  # softmax, top-k, renormalisation, bincounts, argsort, gathers, the scatter, the aux loss


def moe_elementwise(cfg: ModelConfig, tp: int, ep: int, activation_passes: int) -> tuple[float, float, int]:
    """Per token on one rank: (elements of the experts' activations, each to be multiplied by
    `activation_passes`, elements the routing moves, kernels) of an MoE layer's forward outside its GEMMs."""
    k, d = cfg.experts_per_token, cfg.d_model
    activation = k * cfg.expert_width / tp + cfg.shared_d_ff / tp
    routing = (ROUTE_PASSES + (EP_REORDER_PASSES if ep > 1 else 0)) * k * d + SOFTMAX_PASSES * cfg.n_experts + d
    kernels = ROUTE_KERNELS + 2 * (cfg.n_experts // ep) + (2 if cfg.shared_d_ff else 0) + (3 if cfg.gated_shared_expert else 0)
    return activation * activation_passes, routing, kernels


# --- the all-to-all ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AllToAll:
    """One MoE layer's all-to-alls for one micro-batch on one rank (forward and backward)."""
    bytes: float  # rules/experts.uniform_all_to_all_bytes: the four exchanges, counts left out
    seconds: float  # the four exchanges and the counts' (forward)
    forward_seconds: float  # the forward's two and the counts': what a full recomputation runs again
    crosses_nodes: bool


NO_ALL_TO_ALL = AllToAll(0.0, 0.0, 0.0, False)


def all_to_all(cfg: ModelConfig, lay: Layout, cluster: Cluster, tokens: int, act_bytes: int,
               members_per_node: int | None = None) -> AllToAll:
    """The dispatch and the combine forward, the same two backward, each rank sending (ep-1)/ep of its
    k·tokens rows of d_model (the router spreading them evenly), every rank of the layout at once;
    the routed-row counts (int64, n_experts / ep per peer) before the forward's dispatch. On the
    critical path: the experts wait for their rows, the layer's output for the combine.
    members_per_node: place the group so (default: where the layout puts it)."""
    if not cfg.moe or lay.ep == 1:
        return NO_ALL_TO_ALL
    ep = lay.ep
    inside = members_per_node or members_on_a_node(cluster, ep, lay.tp)
    total = uniform_all_to_all_bytes(tokens, cfg.experts_per_token, cfg.d_model, act_bytes, ep)
    one = all_to_all_seconds(cluster, total / 4, ep, inside)
    counts = all_to_all_seconds(cluster, (ep - 1) * (cfg.n_experts // ep) * COUNT_BYTES, ep, inside)
    crosses = inside < ep if members_per_node else group_link(cluster, ep, lay.tp)[2]
    return AllToAll(total, 4 * one + counts, 2 * one + counts, crosses)


def link_name(cluster: Cluster, crosses: bool) -> str:
    """The link an expert-parallel group's all-to-all runs on, in words."""
    if not crosses:
        if cluster.device.name == "cpu-local":
            return "gloo between the processes of this machine"
        nvlink = cluster.device.nvlink_bandwidth
        return "NVLink" if nvlink and cluster.intra_bandwidth >= nvlink else \
            f"{cluster.intra_bandwidth / 1e9:.0f} GB/s inside a node"
    return f"the network ({cluster.inter_bandwidth / 1e9:.1f} GB/s per node, shared by its {cluster.devices_per_node} devices)"


# --- tensor parallelism's extra collectives in an MoE layer -----------------------------------------
def moe_tp_collectives(cfg: ModelConfig, tokens: int, act_bytes: int) -> list[tuple[float, int]]:
    """(bytes of the tensor, count) of the all-reduces an MoE layer adds, per micro-batch, to a dense
    block's four under 1-D tensor parallelism (strata/parallel/tensor.py's `moe`): the routing
    weights' partial gradients (tokens x k, backward) and the shared expert's row-parallel output
    (forward); the routed experts' partial outputs take the dense MLP's all-reduce."""
    if not cfg.moe:
        return []
    found = [(tokens * cfg.experts_per_token * act_bytes, 1)]
    if cfg.shared_d_ff:
        found.append((tokens * cfg.d_model * act_bytes, 1))
    return found


# --- --explain ---------------------------------------------------------------------------------------
def across_seconds(cfg: ModelConfig, lay: Layout, cluster: Cluster, tokens: int, act_bytes: int,
                   here: AllToAll) -> float:
    """The ratio of one layer's all-to-all time with the group split over two nodes (half its members
    in each) to its time where it is: what --explain says a group inside a node saves. 0 when the
    group crosses nodes already, or there is one node."""
    if not here.seconds or here.crosses_nodes or cluster.nodes < 2:
        return 0.0
    return all_to_all(cfg, lay, cluster, tokens, act_bytes, max(1, lay.ep // 2)).seconds / here.seconds


def moe_lines(best, ranked: list, cluster: Cluster) -> list[str]:
    """--explain's lines for a mixture (best: a plan/cost.Estimate): total against active parameters,
    where the experts live and what their all-to-all costs there and would cost elsewhere."""
    lay = best.layout
    lines = [f"parameters: {best.total_params / 1e9:.2f}B in all, {best.active_params / 1e9:.2f}B active per token "
             f"(the FLOPs and the step time follow the active ones, the memory all of them)"]
    if lay.ep == 1:
        rival = next((e for e in ranked if e.layout.ep > 1), None)
        why = (f"; the best with expert parallelism, {rival.layout.describe()}, is "
               f"{rival.step_time_s / best.step_time_s - 1:.0%} slower (its all-to-all takes "
               f"{_seconds(rival.all_to_all_s)} per step on {link_name(cluster, rival.ep_crosses_nodes)})") if rival else ""
        return lines + [f"experts: ep 1: every data-parallel rank holds all of them (no all-to-all){why}"]
    per_node = cluster.devices_per_node
    where = (f"across nodes ({lay.ep} ranks, {lay.tp} apart, span {lay.ep * lay.tp} devices, more than a node's "
             f"{per_node})" if best.ep_crosses_nodes else f"inside a node ({lay.ep} ranks, {lay.tp} apart, span "
             f"{lay.ep * lay.tp} of a node's {per_node} devices)")
    edp = lay.dp // lay.ep
    held = (f"their gradients reduced{' and states sharded' if lay.zero else ''} over the {edp} ranks holding the "
            f"same ones" if edp > 1 else "no other rank holds the same ones (nothing to reduce)")
    line = (f"experts: ep {lay.ep} {where}: each rank holds 1/{lay.ep} of every layer's experts, {held}; all-to-all {_seconds(best.all_to_all_s)}/step over {link_name(cluster, best.ep_crosses_nodes)}"
            f" ({best.all_to_all_bytes / 1e9:.2f} GB per rank), on the critical path")
    if best.all_to_all_across_s:
        line += (f"; across nodes (half the group in each of two) it would take {_seconds(best.all_to_all_across_s)} "
                 f"over {link_name(cluster, True)}")
    return lines + [line]


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"
