"""`--nproc N`: start N local ranks through torch.distributed.run (torchrun), the same engine a
multi-node job uses."""

from __future__ import annotations

import os
import sys


def launch_local(nproc: int, strata_argv: list[str], max_restarts: int = 0) -> int:
    """Run `strata <strata_argv>` on nproc local ranks; when a rank fails, torchrun restarts all of
    them up to max_restarts times (each restart finds its checkpoint through --save)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # One compute thread per rank unless the user says otherwise: ranks share the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}",
                                         f"--max-restarts={max_restarts}", "--module", "strata"])
    # Set the workers' arguments directly: parsed by torchrun, a strata flag could be taken for an
    # abbreviation of one of torchrun's own.
    args.training_script_args = strata_argv
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"strata: error: rank {rank} failed with exit code {failure.exitcode}; its output is above",
              file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
