"""One rank of one benchmark job (started via torchrun by bench/data_parallel.py,
bench/tensor_parallel.py and bench/pipeline.py).

Every implementation trains strata's model (the same weights, batches and AdamW settings) so that
only the data-parallel machinery differs. Writes {"step_times": [...], "peak_rss": bytes} for
rank 0 to --out."""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist

from strata.config import train_config, with_settings
from strata.data.loader import BatchLoader, synthetic_split
from strata.model.presets import get_preset
from strata.model.transformer import build_model

LR, BETAS, WD, CLIP = 1e-3, (0.9, 0.95), 0.1, 1.0


def peer_loop(model, optimizer_step, backward, steps, cfg, rank, world):
    """The loop a user of a peer writes: forward, backward, clip, step (no accumulation)."""
    loader = BatchLoader(synthetic_split(get_preset(cfg.model).vocab_size, 0, "train"), cfg.seq_len,
                         cfg.global_batch, 0, dp_rank=rank, dp_size=world)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        inputs, targets = loader.batch(step)
        loss = model(inputs, targets)
        backward(loss)
        optimizer_step()
        times.append(time.perf_counter() - start)
    return times


def run_dtensor_tp(cfg, rank, world, sequence_parallel):
    """torch's own tensor parallelism on the same model: DTensor ColwiseParallel / RowwiseParallel
    with the Megatron placement (q, k, v and the MLP's first matrices column-wise, the output
    projections row-wise; the embedding split by vocabulary, the head column-wise), and with
    sequence parallelism torchtitan's plan (SequenceParallel norms, PrepareModuleInput gathers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    model = build_model(get_preset(cfg.model), seed=0)
    mesh = init_device_mesh("cpu", (world,))
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel:
        plan["final_norm"] = SequenceParallel()
    for i in range(len(model.blocks)):
        block = f"blocks.{i}"
        plan.update({f"{block}.attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")})
        plan[f"{block}.attn.wo"] = RowwiseParallel(output_layouts=seq)
        plan.update({f"{block}.mlp.{w}": ColwiseParallel() for w in ("w_gate", "w_up")})
        plan[f"{block}.mlp.w_down"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            plan[f"{block}.attn_norm"] = SequenceParallel()
            plan[f"{block}.mlp_norm"] = SequenceParallel()
            plan[f"{block}.attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                       desired_input_layouts=(Replicate(), None, None, None))
            plan[f"{block}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)

    def step():
        # clip_grad_norm_ refuses a mix of DTensor and plain gradients (the norms stay plain)
        from torch.distributed.tensor import DTensor
        norms = [torch.linalg.vector_norm(p.grad) for p in model.parameters()]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        scale = min(1.0, CLIP / (torch.linalg.vector_norm(torch.stack(norms)).item() + 1e-6))
        for p in model.parameters():
            p.grad.mul_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
    # every rank of the TP group reads the same batch, of micro_batch sequences (as strata's)
    cfg = with_settings(cfg, global_batch=cfg.layout.micro_batch)
    return peer_loop(model, step, lambda loss: loss.backward(), cfg.steps, cfg, 0, 1)


def run_torch(impl, cfg, rank, world):
    model = build_model(get_preset(cfg.model), seed=0)
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, bucket_cap_mb=25)
    else:  # fsdp2: shard each block, then the root
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks.values():
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, fused=True)

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return peer_loop(model, step, lambda loss: loss.backward(), cfg.steps, cfg, rank, world)


def run_deepspeed(zero, cfg, rank, world):
    import deepspeed
    model = build_model(get_preset(cfg.model), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    ds_config = {"train_batch_size": cfg.global_batch, "train_micro_batch_size_per_gpu": cfg.layout.micro_batch,
                 "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
                 "zero_optimization": {"stage": zero, "reduce_bucket_size": 25 * 2**20 // 4,
                                       "allgather_bucket_size": 25 * 2**20 // 4, "overlap_comm": True},
                 "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    return peer_loop(engine, engine.step, engine.backward, cfg.steps, cfg, rank, world)


PIPELINE_V = {"gpipe": 1, "1f1b": 1, "interleaved": 2}


def run_torch_pipeline(schedule, cfg, rank, world, micro_batches):
    """torch.distributed.pipelining on strata's model cut exactly as strata cuts it (same layout,
    same chunk modules): PipelineStage per chunk, ScheduleGPipe / Schedule1F1B /
    ScheduleInterleaved1F1B, AdamW; no clipping on either side (it would need a norm all-reduce
    the peer does not do for you)."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from strata.parallel.pipeline.stage import chunk_views, keep_stage
    from strata.rules.pipeline_cut import make_layout
    model_cfg = get_preset(cfg.model)
    layout = make_layout(model_cfg, world, PIPELINE_V[schedule], cfg.seq_len)
    model = build_model(model_cfg, seed=0)
    keep_stage(model, layout, rank)
    chunks = chunk_views(model, layout, rank)
    stages = [PipelineStage(chunks[c], c, layout.num_chunks, torch.device("cpu")) for c in sorted(chunks)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if schedule == "interleaved":
        runner = ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss_fn)
    else:
        runner = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stages[0], micro_batches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    loader = BatchLoader(synthetic_split(model_cfg.vocab_size, 0, "train"), cfg.seq_len, cfg.global_batch, 0)
    times = []
    for step in range(cfg.steps):
        start = time.perf_counter()
        inputs, targets = loader.batch(step)
        has_first, has_last = 0 in chunks, layout.num_chunks - 1 in chunks
        args = (inputs,) if has_first else ()
        runner.step(*args, target=targets if has_last else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def run_strata(impl, cfg, world, micro_batches=1):
    from strata.train.trainer import train
    # "-nccl": the same run under NCCL's rules on gloo (bench/comm_semantics.py); else gloo's own
    cfg = with_settings(cfg, comm_semantics="nccl" if impl.endswith("-nccl") else "native")
    impl = impl.removesuffix("-nccl")
    micro_batch = cfg.layout.micro_batch
    if impl.startswith("strata-pp-"):  # all ranks one pipeline
        schedule = impl.removeprefix("strata-pp-")
        cfg = with_settings(cfg, schedule=schedule, pp=world, dp=1, virtual_stages=PIPELINE_V[schedule], grad_clip=0.0,
                            global_batch=micro_batch * micro_batches)
    elif impl.startswith("strata-z"):
        cfg = with_settings(cfg, zero=int(impl[-1]))
    else:  # strata-tp[-sp]: all ranks in one tensor-parallel group
        cfg = with_settings(cfg, tp=world, dp=1, sequence_parallel=impl.endswith("-sp"), global_batch=micro_batch)
    return train(cfg)["step_times"]


def main() -> None:
    parser = argparse.ArgumentParser()
    # strata-z0..3, ddp, fsdp2, deepspeed-z0..3 (data parallel); strata-tp[-sp], dtensor-tp[-sp];
    # strata-pp-{gpipe,1f1b,interleaved}, torch-pp-{gpipe,1f1b,interleaved} (pipelines); a strata
    # impl ending in -nccl runs under NCCL's rules (--comm-semantics nccl)
    parser.add_argument("--impl", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--model", default="small")
    parser.add_argument("--micro-batches", type=int, default=1, help="pipelines: micro-batches per step")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    cfg = train_config(model=args.model, steps=args.steps, seq_len=args.seq_len, micro_batch=args.micro_batch,
                      global_batch=args.micro_batch * world, progress=False, peak_flops=1e12, eval_batches=1,
                      lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD, grad_clip=CLIP)
    impl = args.impl
    rank = int(os.environ["RANK"])
    if impl.startswith("strata"):
        times = run_strata(impl, cfg, world, args.micro_batches)
    else:
        dist.init_process_group("gloo")
        if impl.startswith("torch-pp-"):
            cfg = with_settings(cfg, global_batch=cfg.layout.micro_batch * args.micro_batches)
            times = run_torch_pipeline(impl.removeprefix("torch-pp-"), cfg, rank, world, args.micro_batches)
        elif impl.startswith("deepspeed"):
            times = run_deepspeed(int(impl[-1]), cfg, rank, world)
        elif impl.startswith("dtensor-tp"):
            times = run_dtensor_tp(cfg, rank, world, sequence_parallel=impl.endswith("-sp"))
        else:
            times = run_torch(impl, cfg, rank, world)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_times": times, "peak_rss": peak}, f)


if __name__ == "__main__":
    main()
