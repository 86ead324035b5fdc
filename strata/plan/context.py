"""Context parallelism for the cost model (docs/cost-model.md, "Context parallelism"): what a rank
keeps when it holds 1/cp of every sequence, and what its attention sends over the context-parallel
group, priced on the link that group crosses, with what the attention's compute hides. The split
and the bytes are strata/rules/context.py's, which the runtime (strata/parallel/context.py)
follows and its counters are tested against.

The cp ranks of a group are tp ranks apart (the mesh puts tp innermost, then cp), so a group spans
cp x tp consecutive devices. Everything else a rank does (its GEMMs, norms, the loss, tensor
parallelism's collectives, the pipeline's messages) is what it does for any b·s/cp tokens; that is
cost.py's, with the tokens per rank divided by cp.

A layout with cp 1 passes through every function here unchanged (nothing sent, nothing added)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.model.config import ModelConfig
from strata.plan.experts import link_name
from strata.plan.links import Cluster, all_to_all_seconds, collective_seconds, group_link, members_per_node
from strata.rules.context import attention_traffic, extra_activation_elements, recomputed_traffic, ring_gradient_bytes
from strata.rules.layout import Layout

SEARCHED_DEGREES = (2, 4, 8)  # the cp values the search tries (any other through --layout)


def context_degrees(cfg: ModelConfig, ranks: int) -> list[tuple[int, str]]:
    """The (cp, cp_mode) pairs the search tries on the `ranks` devices tp and pp leave: cp 1, and
    each power of two up to 8 that divides them, by ring and by Ulysses (the layout check drops
    what the model or the sequence does not allow). Up to 8: a node's devices, where the group's
    hops run on the fastest link while tp 1 (a larger cp, which Llama 3 used at 128K tokens on
    16K GPUs, can be priced with --layout); each degree adds layouts to every search. A mixture of
    experts has none (rules/context.check_context)."""
    if cfg.moe:
        return [(1, "ring")]
    return [(1, "ring")] + [(cp, mode) for cp in SEARCHED_DEGREES if ranks % cp == 0 for mode in ("ring", "ulysses")]


def searched_micro_batches(cp: int, micro_batches: tuple[int, ...]) -> tuple[int, ...]:
    """The micro-batches worth trying with cp: all of them without context parallelism, 1 with it.
    cp c with micro-batches of b gives every rank b·s/c tokens a micro-batch; so does cp c/b with
    micro-batches of 1 (b < c; b ≥ c: cp 1 with micro-batches of b/c) on b times the data-parallel
    ranks (c times, b ≥ c): the same GEMMs, attention work, activations, micro-batches per step,
    global batches it divides and gradient group (dp x cp ranks), with a smaller context-parallel
    group or none (fewer hops, each hidden behind more attention). So that one is never slower,
    and the search skips the former."""
    return micro_batches if cp == 1 else (1,)


def data_parallel_twin(lay: Layout) -> Layout | None:
    """The layout that makes a cp > 1 layout without a pipeline pointless where it runs: its cp
    ranks turned into data-parallel ones (dp x cp, cp 1), the micro-batch the same. Every rank
    then computes whole sequences, as many tokens per step as before in 1/cp of the micro-batches:
    the same gradient group, states and work, larger GEMMs, no exchanges, fewer passes, and only
    the activations cp times larger. So where it fits it is faster, and the search does not price
    the cp layout. With a pipeline, cp's more micro-batches also shrink the bubble: no twin."""
    if lay.cp == 1 or lay.pp > 1:
        return None
    return replace(lay, dp=lay.dp * lay.cp, cp=1, cp_mode="ring")


def extra_activation_bytes(cfg: ModelConfig, lay: Layout, tokens: int, act_bytes: int) -> float:
    """What a block keeps for backward under context parallelism beyond 1/cp of what the activation
    formula counts (plan/memory.activation_bytes_per_layer, fused attention), per micro-batch of
    `tokens` (micro-batch x sequence): rules/context.extra_activation_elements. The ring keeps its
    output as the transposed view the output projection reads, one tensor, as one process's fused
    kernel does: nothing more. Ulysses' kernel keeps its output in its head split beside the copy
    the projection keeps, and K and V as exchanged (repeated when cp does not divide the KV heads).
    Counted with saved-tensor hooks: tests/test_plan_context.py. Selective recomputation keeps
    none of the kernel's tensors (the core, its exchanges included, runs again), full
    recomputation only the block's input: then nothing more either."""
    if lay.checkpointing != "none":
        return 0.0
    return extra_activation_elements(cfg, lay.cp, lay.cp_mode, lay.tp, tokens) * act_bytes


@dataclass(frozen=True)
class ContextComm:
    """One attention layer's context-parallel traffic for one micro-batch on one rank: bytes sent
    and seconds on the link, forward and backward, and of those seconds what the attention's own
    compute does not hide (Ulysses: all of them). The backward's include what recomputation
    sends again."""
    forward_bytes: float
    backward_bytes: float
    forward_seconds: float
    backward_seconds: float
    forward_exposed: float
    backward_exposed: float

    @property
    def bytes(self) -> float:
        return self.forward_bytes + self.backward_bytes

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    @property
    def exposed(self) -> float:
        return self.forward_exposed + self.backward_exposed


NO_CONTEXT = ContextComm(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def context_comm(cfg: ModelConfig, lay: Layout, cluster: Cluster, tokens: int, act_bytes: int,
                 attention_forward_s: float, attention_backward_s: float) -> ContextComm:
    """A layer's traffic (rules/context.attention_traffic for the micro-batch's whole `tokens`, b·s,
    and recomputed_traffic), timed on the cp group's link. attention_*_s: this rank's attention
    compute for the layer (1/cp of the layer's: the chunk pairing balances the causal work), of
    which each ring step computes 1/cp.

    Ring forward: cp-1 hops of this rank's K and V, hop j sent while block j is attended to; the
    next block cannot start before its hop arrives, so a hop longer than a block's attention shows
    by the difference. Backward: cp steps; at each the link carries the next K/V hop (all but the
    last step) and the dK/dV accumulator of the step before (all but the first), beside that
    step's attention backward; the last accumulator's hop home comes after all compute, exposed.
    Ulysses: four all-to-alls each way, each of its own tensor (q, k, v, the output; their
    gradients backward), on the critical path: the attention needs all of q, k and v, and the
    layer's output projection the output back."""
    cp = lay.cp
    if cp == 1:
        return NO_CONTEXT
    grad_bytes = ring_gradient_bytes(act_bytes)
    forward, backward = attention_traffic(cfg, cp, lay.cp_mode, lay.tp, tokens, act_bytes, grad_bytes)
    again = recomputed_traffic(cfg, cp, lay.cp_mode, lay.tp, tokens, act_bytes, lay.checkpointing)
    if lay.cp_mode == "ulysses":
        inside = members_per_node(cluster, cp, lay.tp)  # the group's members, tp ranks apart
        # four exchanges each way (q's and the output's larger than k's and v's under grouped-query
        # attention): all_to_all_seconds is affine in the bytes, so four of the mean size take as
        # long as the four; what recomputation sends again, at the forward's rate
        forward_s = 4 * all_to_all_seconds(cluster, forward / 4, cp, inside)
        backward_s = 4 * all_to_all_seconds(cluster, backward / 4, cp, inside) + forward_s * again / forward
        return ContextComm(forward, backward + again, forward_s, backward_s, forward_s, backward_s)
    kv_hop = collective_seconds(cluster, "send", forward / (cp - 1), cp, lay.tp)
    dkv_hop = collective_seconds(cluster, "send", (backward - forward) / cp, cp, lay.tp)
    fwd_block, bwd_block = (attention_forward_s / cp, attention_backward_s / cp) if cluster.overlap else (0.0, 0.0)
    forward_exposed = (cp - 1) * max(0.0, kv_hop - fwd_block)
    steps = [(kv_hop if j < cp - 1 else 0.0) + (dkv_hop if j > 0 else 0.0) for j in range(cp)]
    backward_exposed = sum(max(0.0, link - bwd_block) for link in steps) + dkv_hop
    forward_s = (cp - 1) * kv_hop
    recomputed = again / forward  # the forward's ring again, beside the recomputed attention
    return ContextComm(forward, backward + again, forward_s, sum(steps) + dkv_hop + recomputed * forward_s,
                       forward_exposed, backward_exposed + recomputed * forward_exposed)


# --- --explain ---------------------------------------------------------------------------------------
def context_lines(best, ranked: list, rejected: list, cluster: Cluster) -> list[str]:
    """--explain's lines on context parallelism (estimates: plan/cost.Estimate). When the best
    layout splits its sequences: where its group runs, what it sends and hides, and the best
    layout without it (slower, or none fits); when it does not, the best layout with it and
    why it loses. Nothing when no layout with context parallelism was tried."""
    lay, s = best.layout, best.seq_len
    if lay.cp == 1:
        rival = next((e for e in ranked if e.layout.cp > 1), None)
        if rival is None:
            return []
        slower = rival.step_time_s / best.step_time_s - 1
        return [f"context parallelism: the best with it, {rival.layout.describe()}, is {slower:.0%} slower: "
                f"{_spends(rival, cluster)}; of its {_seconds(rival.step_time_s - best.step_time_s)} more per step, "
                f"{_seconds(rival.exposed_comm_s['cp'])} are exchanges the attention does not hide, the rest elsewhere "
                f"(a rank computes {s // rival.layout.cp:,} tokens of a sequence at a time: smaller GEMMs, more "
                f"micro-batches). It pays "
                f"where the activations of whole {s:,}-token sequences do not fit, or where the tensor parallelism "
                f"that would cut them has to leave the node; here the best without it fits "
                f"({best.memory_bytes_per_device / 1e9:.1f} GB per device)"]
    cp = lay.cp
    crosses = group_link(cluster, cp, lay.tp)[2]
    where = "across nodes" if crosses else "inside a node"
    attends = ("one early and one late, so the ring's causal attention is even" if lay.cp_mode == "ring" else
               f"attention itself on all {s:,} tokens of 1/{cp} of the heads")
    lines = [f"context parallelism: cp {cp} ({lay.cp_mode}) splits each {s:,}-token sequence over {cp} ranks "
             f"{lay.tp} apart ({where}), each holding 2 of {2 * cp} chunks ({s // cp:,} tokens, {attends}): "
             f"{_spends(best, cluster)}"]
    other = next((e for e in ranked if e.layout.cp > 1 and e.layout.cp_mode != lay.cp_mode), None)
    if other is not None:
        lines[0] += (f"; the best with {other.layout.cp_mode}, {other.layout.describe()}, is "
                     f"{other.step_time_s / best.step_time_s - 1:.0%} slower")
    carries = ("the ring carries each token's K and V instead (a fraction of the hidden state with grouped-query "
               "attention), behind an attention whose work per token grows with the sequence" if lay.cp_mode == "ring"
               else "Ulysses' all-to-alls carry 1/cp of each token's q, k, v and output per rank, less as cp grows")
    why = (f"Why: tensor parallelism cuts the activations as context parallelism does, but its collectives carry "
           f"every token's whole hidden state on the critical path, in every layer, whatever the sequence's length, "
           f"and a larger tp leaves the node; {carries}. So at {s:,} tokens splitting the sequence is the cheaper "
           f"way to more ranks per sequence")
    rival = next((e for e in ranked if e.layout.cp == 1), None)
    if rival is not None:
        slower = rival.step_time_s / best.step_time_s - 1
        lines.append(f"without context parallelism the best is {rival.layout.describe()}, {slower:.0%} slower: "
                     f"{rival.memory_breakdown['activations'] / 1e9:.1f} GB of activations per device, tensor "
                     f"parallelism {rival.comm_bytes.get('tp', 0) / 1e9:.1f} GB per rank per step "
                     f"({_seconds(rival.comm_seconds.get('tp', 0))}, on the critical path). {why}")
        return lines
    smallest = min((e for e in rejected if e.layout.cp == 1), key=lambda e: e.memory_bytes_per_device, default=None)
    if smallest is not None:
        lines.append(f"without context parallelism nothing fits: the smallest layout needs "
                     f"{smallest.memory_bytes_per_device / 1e9:.1f} GB per device ({smallest.layout.describe()}, "
                     f"{smallest.memory_breakdown['activations'] / 1e9:.1f} GB of it activations). {why}")
    return lines


def _spends(e, cluster: Cluster) -> str:
    """What a layout's context parallelism keeps and sends, in words."""
    lay = e.layout
    link = link_name(cluster, group_link(cluster, lay.cp, lay.tp)[2])
    sent = (f"{e.comm_bytes['cp'] / 1e9:.2f} GB per rank per step over {link}, {_seconds(e.comm_seconds['cp'])}")
    if lay.cp_mode == "ring":
        hidden = 1 - e.exposed_comm_s["cp"] / e.comm_seconds["cp"] if e.comm_seconds["cp"] else 1.0
        sent = f"K and V round the ring, {sent}, {hidden:.0%} of it hidden behind the attention"
    else:
        sent = f"all-to-alls of q, k, v and the output, {sent}, all of it on the critical path"
    return f"{e.memory_breakdown['activations'] / 1e9:.1f} GB of activations per device; {sent}"


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"
