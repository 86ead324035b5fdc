"""strata's pipeline schedules against torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B) on the same model cut the same way, all ranks one pipeline.

  python bench/pipeline.py --nproc 2 --micro-batches 8 [--rounds 2] [--steps 6]
  python bench/pipeline.py --nproc 4 --micro-batches 8
"""

from jobs import compare, parser

PAIRS = [(f"PP {schedule}", f"strata-pp-{schedule}", f"torch-pp-{schedule}")
         for schedule in ("gpipe", "1f1b", "interleaved")]

if __name__ == "__main__":
    compare(PAIRS, parser(__doc__.split("\n")[0]).parse_args())
