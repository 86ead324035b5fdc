"""`strata generate`: the flags made into a GenerateConfig, every check that can fail on input run
once in the process the user started, then generation here, or on tp x pp x ep ranks started here
(or by torchrun). The engine is strata/infer/session.py; it never sees the flags.

Handlers import the engine only when they run: parsing flags and `--help` never import torch."""

from __future__ import annotations

import os

from strata.errors import ConfigError


def generate_config(args):
    """The command line's namespace as the engine's typed config."""
    from strata.infer.config import GenerateConfig
    from strata.infer.generate import Sampling
    return GenerateConfig(
        checkpoint=args.checkpoint, prompts=tuple(args.prompt) if args.prompt is not None else None,
        prompt_ids=tuple(args.prompt_ids) if args.prompt_ids is not None else None,
        max_new_tokens=args.max_new_tokens,
        sampling=Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed),
        stop=tuple(args.stop), tp=args.tp, pp=args.pp, ep=args.ep, nproc=args.nproc,
        micro_batches=args.micro_batches, dtype=args.dtype, device=args.device, timeout=args.timeout,
        timing=args.timing)


def generate_command(args, argv: list[str]) -> int:
    """Generate on one process, or on tp x pp x ep processes (started here unless torchrun did)."""
    from strata.rules.devices import check_device
    cfg = generate_config(args)
    problems = cfg.problems()
    if problems:
        raise ConfigError(problems[0])
    check_device(cfg.device)
    world = cfg.world_size
    if cfg.nproc is not None and cfg.nproc != world:
        sizes = (("tp", cfg.tp), ("pp", cfg.pp)) + ((("ep", cfg.ep),) if cfg.ep > 1 else ())
        raise ConfigError(f"--nproc {cfg.nproc}: generation runs on {' x '.join(n for n, _ in sizes)} = "
                          f"{' x '.join(str(v) for _, v in sizes)} = {world} processes; set --nproc {world}")
    from strata.checkpoint import store
    from strata.infer.session import generate_here, generate_on_ranks, prepare_requests
    launched = "LOCAL_RANK" in os.environ
    if world > 1 and not launched:
        prepare_requests(cfg)  # every check that can fail on input, once, before any process starts
        store.check_checkpoint(cfg.checkpoint)  # its files too: every checksum, every shard's header
        from strata.distributed.launch import launch_local
        return launch_local(world, argv)
    if not launched or int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return generate_here(cfg, prepare_requests(cfg))
    return generate_on_ranks(cfg)
