"""One rank of a peer job of bench/vs_hf.py: transformers' LlamaForCausalLM of a strata preset's
shape, trained the way a user of each engine would write it, each with its best settings:

  hf            one process: forward with labels, backward, clip_grad_norm_, fused AdamW
  ddp           torch DistributedDataParallel (25 MB buckets, gradients as bucket views)
  fsdp2         torch fully_shard per decoder layer, then the root (bf16: its MixedPrecisionPolicy,
                parameters gathered in bf16, gradients reduced in fp32)
  deepspeed-zK  DeepSpeed ZeRO-K, overlap_comm, 25 MB buckets, its own clipping (bf16: its bf16
                mode, bf16 weights with fp32 masters in the optimizer)
  dtensor-tp    DTensor tensor parallelism, the Megatron plan on the attention and MLP projections,
                the embedding split by rows and the head by columns (every rank reads the batch);
                fused AdamW, one for the DTensor parameters and one for the plain ones (the norms)

fp32, or bf16 autocast over fp32 parameters (what `strata train --dtype bf16` does) unless the
engine has a bf16 mode of its own. Started by torchrun (one process for `hf`); writes
{"step_times": [...]} for rank 0 to --out."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
import transformers

from strata.data.loader import BatchLoader, synthetic_split
from strata.model.presets import get_preset

LR, BETAS, WD, CLIP, BUCKET_MB = 1e-3, (0.9, 0.95), 0.1, 1.0, 25


def llama(preset: str) -> transformers.LlamaForCausalLM:
    c = get_preset(preset)
    config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
                                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                                      num_key_value_heads=c.kv_heads, max_position_embeddings=c.max_seq_len,
                                      rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=False,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert model.num_parameters() == c.num_params(), "not the preset's shape"
    return model


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, fused=True)


def train_loop(forward_backward, optimizer_step, args, rank: int, world: int) -> list[float]:
    vocab = get_preset(args.model).vocab_size
    loader = BatchLoader(synthetic_split(vocab, 0, "train"), args.seq_len, args.micro_batch * world, 0,
                         dp_rank=rank, dp_size=world)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        inputs, _ = loader.batch(step)
        forward_backward(inputs)
        optimizer_step()
        times.append(time.perf_counter() - start)
    return times


def autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def run_torch(args, rank, world):
    model = llama(args.model)
    if args.impl == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
    elif args.impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if args.dtype == "bf16" else MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    opt = adamw(model.parameters())
    amp = autocast(args.dtype) if args.impl != "fsdp2" else contextlib.nullcontext()

    def forward_backward(inputs):
        with amp:
            loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return train_loop(forward_backward, step, args, rank, world)


def run_deepspeed(args, rank, world):
    import deepspeed
    model = llama(args.model)
    config = {"train_batch_size": args.micro_batch * world, "train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": 1, "gradient_clipping": CLIP, "steps_per_print": 10**9,
              "zero_optimization": {"stage": int(args.impl[-1]), "reduce_bucket_size": BUCKET_MB * 2**20 // 4,
                                    "allgather_bucket_size": BUCKET_MB * 2**20 // 4, "overlap_comm": True},
              "bf16": {"enabled": args.dtype == "bf16"}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=config)

    def forward_backward(inputs):
        engine.backward(engine(input_ids=inputs, labels=inputs).loss)
    return train_loop(forward_backward, engine.step, args, rank, world)


def run_dtensor_tp(args, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = llama(args.model)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}"
        plan.update({f"{layer}.self_attn.{w}": ColwiseParallel() for w in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{layer}.mlp.{w}": ColwiseParallel() for w in ("gate_proj", "up_proj")})
        plan[f"{layer}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    # fused AdamW refuses DTensors and plain tensors (the norms) in one call: one optimizer each
    split = [[p for p in model.parameters() if isinstance(p, DTensor) == kind] for kind in (True, False)]
    optimizers = [adamw(params) for params in split if params]
    amp = autocast(args.dtype)

    def forward_backward(inputs):
        with amp:
            loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()

    def step():
        # clip_grad_norm_ refuses DTensor and plain gradients together (the norms stay plain)
        norms = [torch.linalg.vector_norm(p.grad) for p in model.parameters()]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        total = torch.linalg.vector_norm(torch.stack(norms))
        scale = min(1.0, CLIP / (total.item() + 1e-6))  # one float: the gradients are DTensors and tensors
        for p in model.parameters():
            p.grad.mul_(scale)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    # every rank of the group reads the same batch of micro_batch sequences, as strata's tensor-parallel ranks do
    return train_loop(forward_backward, step, args, 0, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", required=True)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    if args.impl.startswith("deepspeed"):
        times = run_deepspeed(args, rank, world)
    elif args.impl == "dtensor-tp":
        times = run_dtensor_tp(args, rank, world)
    else:
        times = run_torch(args, rank, world)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_times": times}, f)
    if world > 1:
        dist.barrier()
        # DeepSpeed ZeRO-3 leaves a thread that aborts the interpreter's teardown on some runs
        # ("terminate called without an active exception"): the measurement is written, so leave now
        os._exit(0)


if __name__ == "__main__":
    main()
