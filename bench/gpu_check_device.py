"""Two parts of bench/gpu_check.py about the device's own clocks and communicators (issue 50):
`event_timing`, CUDA events against the wall time of a synchronised step, and `collectives`, a
world-1 NCCL process group started with the flight recorder's variables. The other parts, and the
`Check` each part takes, are in gpu_check_parts.py."""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
from gpu_check_parts import ANALYSIS_RESERVE_S, Check, release_memory, synchronize

from strata.distributed.timing import DeviceClock, synchronize_stream
from strata.model.presets import get_preset
from strata.model.transformer import build_model


# --- event timing: CUDA events against the wall time of a synchronised step ------------------------
def timed_once(device: torch.device, work) -> dict:
    """One run of `work`, timed four ways: CUDA events around it on the current stream (DeviceClock,
    read after synchronize_stream), the host clock when the launches returned (what an
    unsynchronised timestamp measures), when synchronize_stream returned, and when a device-wide
    torch.cuda.synchronize() returned (the wall time of a synchronised step; the bracket opens with
    one too, so nothing queued before is counted). On a CPU all four are host times."""
    clock = DeviceClock(device)
    synchronize(device)
    started = time.perf_counter()
    start = clock.mark()
    work()
    end = clock.mark()
    launch_s = time.perf_counter() - started
    synchronize_stream(device)
    stream_s = time.perf_counter() - started
    synchronize(device)
    wall_s = time.perf_counter() - started
    return {"events_s": clock.seconds(start, end), "launch_s": launch_s, "stream_s": stream_s, "wall_s": wall_s}


def matmul_work(device: torch.device, size: int, count: int = 4):
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))

    def work():
        out = a
        for _ in range(count):
            out = out @ b
    return work


def train_step_work(device: torch.device, model_name: str, seq_len: int, micro_batch: int):
    """Forward, backward and an AdamW step of a preset under bf16 autocast, as a training step runs."""
    cfg = get_preset(model_name)
    model = build_model(cfg, device, torch.float32, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), device=device,
                           generator=torch.Generator(device).manual_seed(0))

    def work():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return work


def event_timing(check: Check) -> dict:
    """A few step-like workloads timed with CUDA events (strata.distributed.timing, what the runtime
    times device work with) against the wall time of the same work bracketed by
    torch.cuda.synchronize(): medians over the repeats, and events / wall (near 1: the events time
    the work; the rest is the synchronisation's cost) and launch / wall (how much of the step an
    unsynchronised host timestamp sees)."""
    s = check.shapes
    workloads = {f"matmuls 4x{s.matmul_size} bf16": lambda: matmul_work(check.device, s.matmul_size),
                 "tiny train step (bf16, mb 4, seq 64)": lambda: train_step_work(check.device, "tiny", 64, 4),
                 f"{s.gpt2} train step (bf16, mb {s.gpt2_micro_batch}, seq {s.gpt2_seq})":
                     lambda: train_step_work(check.device, s.gpt2, s.gpt2_seq, s.gpt2_micro_batch)}
    rows = []
    for name, make in workloads.items():
        if not check.budget.allows(ANALYSIS_RESERVE_S):
            check.skip("event_timing", name, "budget spent")
            continue
        release_memory(check.device)
        work = make()
        timed_once(check.device, work)  # warm-up: kernels chosen, memory allocated
        samples = [timed_once(check.device, work) for _ in range(s.timing_repeats)]
        median = {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}
        rows.append({"workload": name, **median, "repeats": len(samples),
                     "events_over_wall": median["events_s"] / median["wall_s"],
                     "launch_over_wall": median["launch_s"] / median["wall_s"]})
        del work
        release_memory(check.device)
    return {"clock": "CUDA events" if check.device.type == "cuda" else "the host clock", "workloads": rows}


# --- collectives: a world-1 NCCL process group with the flight recorder's variables ------------------
COLLECTIVES_PROGRAM = r"""
import json, os, sys
import torch, torch.distributed as dist
from strata.distributed import comm, flight_recorder
device = torch.device(sys.argv[1])
backend = "nccl" if device.type == "cuda" else "gloo"
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group(backend, rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
comm.configure("nccl", device)
x = torch.ones(1 << 20, device=device)
comm.all_reduce(x, None, "world")
comm.all_reduce(x, None, "world", async_op=True).wait()
comm.barrier(None, "world")
refused = None
try:  # a host tensor handed to the device group: refused by comm on a GPU as in the rehearsal
    comm.all_reduce(torch.ones(4), None, "world")  # made without a device: the host
except Exception as e:
    refused = str(e).splitlines()[0]
path = flight_recorder.dump()
dumps = flight_recorder.read_dumps(os.path.dirname(path)) if path else {}
names = [e.get("profiling_name") for d in dumps.values() for e in d.get("entries", [])]
print(json.dumps({"backend": backend, "dump": path, "entries": names, "refused": refused,
                  "diagnosis": flight_recorder.diagnose(dumps, world_size=1) if dumps else None}))
dist.destroy_process_group()
"""


def collectives(check: Check) -> dict:
    """A world-1 process group (NCCL on a GPU, gloo on a CPU) started in a fresh process with the
    flight-recorder variables `strata launch` sets (flight_recorder.nccl_debug_environment): it
    initialises, runs all-reduces and a barrier through comm under NCCL's rules, refuses a host
    tensor, and writes a dump that strata reads back and diagnoses (nothing hangs: no diagnosis)."""
    import subprocess
    import sys
    import tempfile

    from strata.distributed.flight_recorder import nccl_debug_environment
    with tempfile.TemporaryDirectory(prefix="strata-fr-") as dumps:
        variables = nccl_debug_environment(dumps)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, **variables, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
               "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", COLLECTIVES_PROGRAM, str(check.device)], env=env,
                              capture_output=True, text=True, timeout=180)
        seconds = time.perf_counter() - started
    if done.returncode != 0:
        return {"ok": False, "variables": variables, "seconds": seconds, "stderr": done.stderr[-2000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    reduces = sum(1 for name in result["entries"] if name and name.endswith("all_reduce"))
    return {"ok": reduces >= 2 and result["refused"] is not None and result["diagnosis"] is None,
            "variables": variables, "seconds": seconds, "all_reduces_recorded": reduces, **result}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
