"""Pipeline-parallel generation: each rank holds a stage (a run of blocks, like a device map), and
the requests are split into micro-batches that are in flight at once, so that while stage 1
works on one micro-batch stage 0 already works on the next.

Every rank walks the same order of work items, (step t, micro-batch j), skipping micro-batches
that have finished:
  - the first stage embeds micro-batch j's prompt (t = 0) or the ids sampled at step t - 1;
  - every stage runs its blocks on it, with micro-batch j's own KV cache, and sends the hidden
    states to the next stage;
  - the last stage computes the logits, samples, and sends the ids, with whether micro-batch j goes
    on, to every other stage, which reads them before its item (t + 1, j).
Each item waits only on items earlier in that order, so nothing deadlocks; sends are
asynchronous and a round's sends are waited for at the end of the next round. Hidden states and
the last stage's words each travel on links of their own (distributed/mesh.PipelineLinks: one
process group per sender and receiver), so every group carries one stream of messages that its
receiver takes in the order they were sent, as NCCL needs. With one
micro-batch the stages run one after another (the bubble is (p - 1)/p); with p or more every stage
can be busy."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from strata.distributed import comm
from strata.distributed.mesh import PipelineLinks
from strata.infer.generate import Sampler, Sampling, check_length, left_pad
from strata.infer.kv_cache import KVCache

GROUP = "pp"


def split_rows(batch: int, micro_batches: int) -> list[range]:
    """Contiguous runs of rows, as even as they can be."""
    base, extra = divmod(batch, micro_batches)
    runs, start = [], 0
    for j in range(micro_batches):
        size = base + (j < extra)
        runs.append(range(start, start + size))
        start += size
    return runs


@torch.inference_mode()
def generate_pipelined(stage, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                       stop: Callable[[int, list[int]], bool] | None, micro_batches: int,
                       pp_rank: int, pp_size: int, links: PipelineLinks) -> Iterator[tuple[range, torch.Tensor]]:
    """On the last stage, yield (rows, next ids) as each micro-batch's step completes (ids are
    FINISHED for rows already stopped); on the other stages, yield nothing and return when all
    micro-batches have finished. links: the "activation" and "control" links at this rank's tp place."""
    stage.eval()
    cfg = stage.cfg
    check_length(prompts, max_new_tokens, cfg.max_seq_len)
    if not 1 <= micro_batches <= len(prompts):
        raise ValueError(f"--micro-batches {micro_batches}: must be between 1 and the {len(prompts)} prompts")
    device = next(stage.parameters()).device
    dtype = next(stage.parameters()).dtype
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    ids, pad = left_pad(prompts)
    prompt_len = ids.shape[1]
    rows = split_rows(len(prompts), micro_batches)
    caches = [KVCache(stage, len(r), prompt_len + max_new_tokens, pad[r.start:r.stop].to(device)) for r in rows]
    samplers = [Sampler([prompts[i] for i in r], cfg.vocab_size, max_new_tokens, sampling, stop, r.start)
                for r in rows] if last else []
    inputs = [ids[r.start:r.stop].to(device) for r in rows]  # the first stage's next input per micro-batch
    alive = [True] * micro_batches
    pending, previous = [], []
    peers = links.peers
    step = 0
    while any(alive):
        for j, r in enumerate(rows):
            if not alive[j]:
                continue
            if step > 0 and not last:  # the last stage's word on micro-batch j: its ids, and whether it goes on
                control = torch.empty(len(r) + 1, dtype=torch.long, device=device)
                _recv(control, links, "control", pp_size - 1, pp_rank)
                if not control[-1]:
                    alive[j] = False
                    continue
                inputs[j] = control[:-1, None].clamp(min=0)
            if first:
                x = inputs[j]
            else:
                x = torch.empty(len(r), prompt_len if step == 0 else 1, cfg.d_model, dtype=dtype, device=device)
                _recv(x, links, "activation", pp_rank - 1, pp_rank)
            out = stage(x, cache=caches[j], last_only=True)
            if not last:
                pending.append(comm.send_recv([(out.contiguous(), peers[pp_rank + 1])], [],
                                              links.group("activation", pp_rank, pp_rank + 1), GROUP))
                continue
            next_ids = samplers[j].choose(out[:, -1])
            alive[j] = not samplers[j].done
            control = torch.cat([next_ids.to(device), torch.tensor([int(alive[j])], device=device)])
            pending += [comm.send_recv([(control, peer)], [], links.group("control", pp_rank, s), GROUP)
                        for s, peer in enumerate(peers[:-1])]
            yield r, next_ids
        for handle in previous:  # last round's sends: their receivers have posted them by now or soon
            handle.wait()
        previous, pending = pending, []
        step += 1
    for handle in previous:
        handle.wait()


def _recv(tensor: torch.Tensor, links: PipelineLinks, kind: str, sender: int, receiver: int) -> None:
    comm.send_recv([], [(tensor, links.peers[sender])], links.group(kind, sender, receiver), GROUP).wait()
