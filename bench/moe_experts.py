"""The experts' products on this CPU, side by side in one run (issue 53): the per-expert loop as it
was before (w[i] indexing: its backward builds a full-size zero gradient per expert), the loop over
w.unbind(0), the padded batched products, torch's grouped product (fp32 only: it refuses fp64),
and what `Experts` takes (strata/model/grouped_experts.experts_path). Each: forward and backward
of rows sorted by expert (random routing; one skewed case), the best of --repeats, in ms of the
process's CPU time (one thread: the work, whatever else the machine runs).

  OMP_NUM_THREADS=1 python bench/moe_experts.py [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from strata.model import grouped_experts as ge

# (experts, d_model, d_ff, rows, dtype, skew): rows = tokens x top-k routed rows
SHAPES = [(8, 256, 512, 4096, torch.float32, 0.0), (8, 1024, 1024, 4096, torch.float32, 0.0),
          (64, 256, 256, 4096, torch.float32, 0.0), (64, 512, 512, 4096, torch.float32, 0.0),
          (64, 256, 256, 4096, torch.float32, 0.5),
          (8, 256, 512, 4096, torch.float64, 0.0), (64, 256, 256, 4096, torch.float64, 0.0),
          (64, 256, 256, 4096, torch.float64, 0.5)]
QUICK = [(4, 64, 128, 124, torch.float32, 0.0), (4, 64, 128, 124, torch.float64, 0.0)]  # tiny-moe's layer


def old_loop(x, sizes, w_gate, w_up, w_down):
    """Experts.forward before issue 53, verbatim."""
    outs = []
    for i, rows in enumerate(x.split(sizes)):
        h = F.silu(F.linear(rows, w_gate[i])) * F.linear(rows, w_up[i])
        outs.append(F.linear(h, w_down[i]))
    return torch.cat(outs)


def routed_sizes(n: int, rows: int, skew: float, generator: torch.Generator) -> list[int]:
    """Rows per expert: uniform at random, with `skew` of them sent to expert 0 first."""
    to_first = int(skew * rows)
    expert = torch.randint(0, n, (rows - to_first,), generator=generator)
    counts = torch.zeros(n, dtype=torch.long).scatter_add_(0, expert, torch.ones_like(expert))
    counts[0] += to_first
    return counts.tolist()


def best_ms(forms: dict, grad: torch.Tensor, repeats: int) -> dict[str, float]:
    """The best of each form's times, the forms taking turns. The time is the process's CPU time
    (time.process_time): on a shared machine a wall clock also counts the time the process waits
    for a core; with one thread the CPU time is the work done."""
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(repeats):
        for name, run in forms.items():
            started = time.process_time()
            run().backward(grad)
            best[name] = min(best[name], time.process_time() - started)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def measure(n, d_model, d_ff, rows, dtype, skew, repeats) -> dict:
    generator = torch.Generator().manual_seed(0)
    sizes = routed_sizes(n, rows, skew, generator)
    counts = torch.tensor(sizes)
    x = torch.randn(rows, d_model, dtype=dtype, generator=generator).requires_grad_()
    weights = [(torch.randn(shape, dtype=dtype, generator=generator) * 0.05).requires_grad_()
               for shape in ((n, d_ff, d_model), (n, d_ff, d_model), (n, d_model, d_ff))]
    grad = torch.randn(rows, d_model, dtype=dtype, generator=generator)
    forms = {"old loop": lambda: old_loop(x, sizes, *weights),
             "unbind loop": lambda: ge.loop_experts(x, sizes, *weights),
             "padded": lambda: ge.padded_experts(x, counts, max(sizes), *weights)}
    if ge.grouped_applies(x, *weights):
        forms["grouped"] = lambda: ge.grouped_experts(x, counts, *weights)
    times = best_ms(forms, grad, repeats)
    path = ge.experts_path(x, tuple(weights), sizes)
    return {"sizes": sizes, "times": times, "path": path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny-moe's layer only")
    args = parser.parse_args()
    print(f"`OMP_NUM_THREADS={torch.get_num_threads()} python bench/moe_experts.py --repeats {args.repeats}"
          f"{' --quick' if args.quick else ''}`: forward + backward, best of {args.repeats}, CPU ms (torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread(s))")
    print()
    print("| experts | d_model | d_ff | rows | dtype | longest / mean | old loop | unbind loop | padded | grouped "
          "| Experts takes | old loop / taken |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, d_model, d_ff, rows, dtype, skew in QUICK if args.quick else SHAPES:
        r = measure(n, d_model, d_ff, rows, dtype, skew, args.repeats)
        t = r["times"]
        cells = " | ".join(f"{t[name]:.1f}" if name in t else "-" for name in ("old loop", "unbind loop", "padded",
                                                                              "grouped"))
        taken = t["unbind loop" if r["path"] == "loop" else r["path"]]
        print(f"| {n} | {d_model} | {d_ff} | {rows} | {str(dtype).split('.')[1]} | "
              f"{max(r['sizes']) * n / rows:.2f} | {cells} | {r['path']} | {t['old loop'] / taken:.2f} |")


if __name__ == "__main__":
    main()
