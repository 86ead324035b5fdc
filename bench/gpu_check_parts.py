"""The measurements of bench/gpu_check.py, one function per part (the device against the CPU:
gpu_check_correctness.py). Each takes the `Check` (device,
shapes, budget, the training runs measured so far) and returns a JSON-ready dict. Quick mode calls
the same functions with tiny shapes, so nothing here runs only on a GPU.

The planner's predictions come from strata's own commands, run in this process (`strata plan
--layout ... --json`, `strata plan --inference ... --json`), so they are what a user would read."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field, replace

import torch
from gpu_check_correctness import tiny_config

from strata.config import TrainConfig, train_config
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.plan.hardware import DEVICES, device_for_cuda_name
from strata.rules.dtypes import torch_dtype
from strata.rules.pipeline_cut import unit_costs
from strata.tools.bench_generate import Run, time_strata
from strata.tools.calibrate_inference import inference_overheads
from strata.train.metrics import measure_matmul_flops, mfu_peak
from strata.train.trainer import train

GENERATION_DTYPE = torch.bfloat16
# A training run starts only if it leaves this much of the budget: the step-time part (arithmetic
# over the runs measured) and the files still get written when the runs have used up the rest.
ANALYSIS_RESERVE_S = 15.0


@dataclass(frozen=True)
class Shapes:
    """The sizes one mode runs at; quick mode runs the same functions at tiny ones."""
    llm: str  # LLaMA-shaped: MFU, memory, step time, generation
    llm_seq: int
    gpt2: str
    gpt2_seq: int
    gpt2_micro_batch: int
    mfu_micro_batch: int
    memory_micro_batches: tuple[int, ...]
    checkpointing: tuple[str, ...]
    train_steps: int  # per measured run; the first is warm-up and is not timed
    matmul_size: int
    prompt_tokens: int
    new_tokens: int
    generation_batches: tuple[int, ...]
    generation_runs: int
    calibration_widths: tuple[int, ...] | None  # None: strata calibrate's own
    timing_repeats: int = 5  # event timing: timed runs of each workload, after one warm-up


FULL = Shapes("llama-1b", 2048, "gpt2-124m", 1024, 16, 4, (1, 4), ("none", "selective", "full"), 5, 8192,
              128, 64, (1, 8), 3, None)
QUICK = Shapes("tiny", 64, "tiny-gpt2", 64, 4, 4, (1, 4), ("none", "selective", "full"), 2, 256,
               8, 8, (1, 8), 1, (64, 128, 256), 3)


class Budget:
    """Seconds left of the whole check, counted from `started` (the script's start: importing torch
    counts too); a part or item starts only if what it is expected to take fits."""

    def __init__(self, seconds: float, started: float | None = None):
        self.seconds = seconds
        self.started = time.perf_counter() if started is None else started

    def spent(self) -> float:
        return time.perf_counter() - self.started

    def allows(self, expected_s: float = 0.0) -> bool:
        return self.seconds - self.spent() > expected_s


@dataclass(frozen=True)
class RunSpec:
    """One measured training run: a single process, bf16 autocast, no gradient accumulation."""
    model: str
    seq_len: int
    micro_batch: int
    checkpointing: str = "none"
    steps: int = 5
    compile: bool = False

    def describe(self) -> str:
        return f"{self.model},seq={self.seq_len},mb={self.micro_batch},ckpt={self.checkpointing}" + \
            (",compile" if self.compile else "")


@dataclass
class Check:
    device: torch.device
    shapes: Shapes
    budget: Budget
    out_dir: str
    plan_device: str  # the device-table entry the planner predicts for
    stubbed: list[str] = field(default_factory=list)
    runs: dict = field(default_factory=dict)  # RunSpec -> measured run (parts share them)
    run_seconds: dict = field(default_factory=dict)  # model -> wall time of its last run (budget guess)
    skipped: list = field(default_factory=list)
    matmul_peak: float | None = None

    @property
    def table_peak(self) -> float:
        return DEVICES[self.plan_device].peak_flops["bf16"]

    def skip(self, part: str, item: str, reason: str) -> None:
        self.skipped.append({"part": part, "item": item, "reason": reason})


def table_entry(device: torch.device) -> str | None:
    """The device table's entry for this GPU, matched by name as the trainer's MFU peak matches it
    (strata/plan/hardware.py: device_for_cuda_name); None for a CPU or a GPU the table lacks."""
    return device_for_cuda_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def plan_device_for(device: torch.device) -> str:
    """The planner's table entry for this GPU; an H200 for one the table lacks (the environment part
    says so: `table_entry` is None) and for a CPU in quick mode, where the predictions only exercise
    the code."""
    return table_entry(device) or "H200"


def synchronize(device: torch.device) -> None:
    """The whole device, every stream: a bracket for wall times here (the runtime itself waits for its
    compute stream only: strata.distributed.timing.synchronize_stream)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Free what the previous run left, and start the next peak from zero."""
    gc.collect()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def strata_output(argv: list) -> str:
    """Run a `strata` command in this process; its stdout, or an error with its one-line message."""
    from strata.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    if code != 0:
        raise RuntimeError(f"strata {' '.join(map(str, argv))}: exit {code}: {err.getvalue().strip()}")
    return out.getvalue()


def strata_json(argv: list) -> dict:
    return json.loads(strata_output([*argv, "--json"]))


# --- environment ------------------------------------------------------------------------------------
def environment(check: Check) -> dict:
    import numpy
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "numpy": numpy.__version__,
            "device": str(check.device), "plan_device": check.plan_device, "table_entry": table_entry(check.device),
            "threads": torch.get_num_threads(),
            "stubbed_modules": check.stubbed, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    if check.device.type == "cuda":
        props = torch.cuda.get_device_properties(check.device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", memory_bytes=props.total_memory,
                    multiprocessors=props.multi_processor_count)
    return info


# --- training runs, shared by MFU, memory and step time -----------------------------------------------
def training_config(spec: RunSpec, device: str, peak_flops: float) -> TrainConfig:
    return train_config(model=spec.model, seq_len=spec.seq_len, micro_batch=spec.micro_batch,
                       global_batch=spec.micro_batch, dtype="bf16", checkpointing=spec.checkpointing,
                       steps=spec.steps, device=device, eval_batches=1, progress=False,
                       peak_flops=peak_flops, seed=0, compile=spec.compile)


def measured_run(check: Check, spec: RunSpec) -> dict:
    """Train `spec` (or return the run already measured): step times with the warm-up step left
    out, tokens/s, and the peak memory (CUDA: max_memory_allocated; on a CPU the tensors strata
    counts: model states + saved activations, what max_memory_allocated would see)."""
    if spec in check.runs:
        return check.runs[spec]
    release_memory(check.device)
    started = time.perf_counter()
    summary = train(training_config(spec, check.device.type, check.table_peak))
    summary.pop("model")
    allocated = torch.cuda.max_memory_allocated(check.device) if check.device.type == "cuda" else None
    last = summary["records"][-1]
    median_step = statistics.median(summary["step_times"][1:] or summary["step_times"])
    run = {"spec": spec.describe(), "step_times_s": summary["step_times"], "median_step_s": median_step,
           "tokens_per_s": spec.micro_batch * spec.seq_len / median_step, "losses": summary["losses"],
           "max_memory_allocated": allocated, "compile_s": summary.get("compile_s"),
           "counted_bytes": last["model_state_bytes"] + (last["peak_activation_bytes"] or 0),
           "seconds": time.perf_counter() - started}
    check.runs[spec] = run
    check.run_seconds[spec.model] = run["seconds"]
    release_memory(check.device)
    return run


def run_if_budget_allows(check: Check, part: str, spec: RunSpec) -> dict | None:
    """The measured run, or None (recorded as skipped) when the time its model took last, and the
    reserve, would not fit in what is left of the budget. An error (out of memory, say) is kept as
    the run's result, so no other part tries it again, and the check goes on."""
    expected = check.run_seconds.get(spec.model, 0.0) + ANALYSIS_RESERVE_S
    if spec not in check.runs and not check.budget.allows(expected):
        check.skip(part, spec.describe(), "budget spent")
        return None
    try:
        return measured_run(check, spec)
    except Exception as e:  # noqa: BLE001 - reported in the results
        check.runs[spec] = {"spec": spec.describe(), "error": f"{type(e).__name__}: {e}"}
    release_memory(check.device)  # only now: the exception's traceback held the failed run's tensors
    return check.runs[spec]


def planned_layout(check: Check, spec: RunSpec, efficiency: float | None = None) -> dict:
    """`strata plan --layout` for this single-device run: its memory and step time."""
    argv = ["plan", "--model", spec.model, "--device", check.plan_device, "--nodes", 1, "--gpus-per-node", 1,
            "--global-batch", spec.micro_batch, "--seq-len", spec.seq_len, "--precision", "bf16",
            "--layout", f"dp=1,mb={spec.micro_batch},ckpt={spec.checkpointing}"]
    if efficiency is not None:
        argv += ["--efficiency", f"{efficiency:.6g}"]
    return strata_json(argv)["layouts"][0]


# --- MFU ----------------------------------------------------------------------------------------------
def mfu_of(check: Check, spec: RunSpec, run: dict) -> dict:
    flops_per_token = get_preset(spec.model).flops_per_token(spec.seq_len)
    achieved = run["tokens_per_s"] * flops_per_token
    return {"tokens_per_s": run["tokens_per_s"], "median_step_s": run["median_step_s"],
            "model_tflops": achieved / 1e12, "mfu_table_peak": achieved / check.table_peak,
            "mfu_measured_peak": achieved / check.matmul_peak, "compile_s": run["compile_s"]}


def mfu_entry(check: Check, model: str, seq_len: int, micro_batch: int) -> dict:
    entry = {"model": model, "params": get_preset(model).num_params(), "seq_len": seq_len,
             "micro_batch": micro_batch, "dtype": "bf16"}
    for compiled in (False, True):
        key = "compile" if compiled else "eager"
        spec = RunSpec(model, seq_len, micro_batch, steps=check.shapes.train_steps, compile=compiled)
        run = run_if_budget_allows(check, "mfu", spec)
        if run is None:
            entry[key] = {"status": "skipped"}
        elif "error" in run:
            entry[key] = {"status": "error", "error": run["error"]}
        else:
            entry[key] = {"status": "measured", **mfu_of(check, spec, run)}
    return entry


def mfu_denominator(check: Check) -> dict:
    """What the trainer divides MFU by on this device without --peak-flops (metrics.mfu_peak: the
    number and its source), per compute dtype, beside the table's number for the device and a
    matmul measured here (measured / table: how far a host-timed matmul would have put MFU off)."""
    entry = table_entry(check.device)
    rows = {}
    for dtype in ("bf16", "fp32"):
        peak = mfu_peak(check.device, dtype)
        table = DEVICES[entry].peak_flops.get(dtype) if entry else None
        measured = check.matmul_peak if dtype == "bf16" else \
            measure_matmul_flops(check.device, torch_dtype(dtype), size=check.shapes.matmul_size)
        rows[dtype] = {"trainer_peak_flops": peak.flops, "trainer_source": peak.source, "note": peak.note,
                       "table_device": entry, "table_peak_flops": table, "measured_matmul_flops": measured,
                       "measured_over_table": measured / table if table else None}
    return rows


RECORD_FIELDS = ("peak_flops", "peak_flops_source", "mfu", "peak_mem_bytes", "memory_reserved_bytes", "alloc_retries",
                 "largest_alloc_bytes")


def trainer_record(check: Check, denominator: dict) -> dict:
    """The last metrics record of `tiny` trained 2 steps in bf16 without --peak-flops: the peak and
    source the trainer wrote (`agrees`: those mfu_denominator found), and the allocator's numbers."""
    cfg = replace(tiny_config("bf16", check.device.type), steps=2, peak_flops=None)
    last = train(cfg)["records"][-1]
    expected = denominator["bf16"]
    return {**{key: last.get(key) for key in RECORD_FIELDS},
            "agrees": last.get("peak_flops") == expected["trainer_peak_flops"]
            and last.get("peak_flops_source") == expected["trainer_source"]}


def mfu(check: Check) -> dict:
    s = check.shapes
    check.matmul_peak = measure_matmul_flops(check.device, torch.bfloat16, size=s.matmul_size)
    denominator = mfu_denominator(check)
    return {"peak_flops_table": check.table_peak, "table_device": check.plan_device,
            "peak_flops_measured_matmul": check.matmul_peak, "matmul_size": s.matmul_size,
            "denominator": denominator, "trainer_record": trainer_record(check, denominator),
            "models": [mfu_entry(check, s.llm, s.llm_seq, s.mfu_micro_batch),
                       mfu_entry(check, s.gpt2, s.gpt2_seq, s.gpt2_micro_batch)]}


# --- memory: the planner's peak against the measured one -------------------------------------------
def measured_memory(run: dict) -> tuple[int, str]:
    if run["max_memory_allocated"] is not None:
        return run["max_memory_allocated"], "torch.cuda.max_memory_allocated"
    return run["counted_bytes"], "tensors strata counts (model states + saved activations)"


def memory(check: Check) -> dict:
    s, rows = check.shapes, []
    for micro_batch in s.memory_micro_batches:
        for mode in s.checkpointing:
            spec = RunSpec(s.llm, s.llm_seq, micro_batch, mode, steps=s.train_steps)
            run = run_if_budget_allows(check, "memory", spec)
            if run is None:
                continue
            row = {"layout": f"mb={micro_batch},ckpt={mode}", "micro_batch": micro_batch, "checkpointing": mode}
            if "error" in run:
                rows.append({**row, "error": run["error"]})
                continue
            plan = planned_layout(check, spec)
            measured, source = measured_memory(run)
            rows.append({**row, "predicted_bytes": plan["memory_bytes_per_device"],
                         "predicted_breakdown": plan["memory_breakdown"], "measured_bytes": measured,
                         "measured_source": source, "counted_bytes": run["counted_bytes"],
                         "error": None, "relative_error": plan["memory_bytes_per_device"] / measured - 1})
    return {"model": s.llm, "seq_len": s.llm_seq, "dtype": "bf16", "layouts": rows}


# --- step time: the planner against the measured runs --------------------------------------------
def measured_efficiency(check: Check, spec: RunSpec, step_s: float) -> float | None:
    """What `strata calibrate` measures for cpu-local, on this device: the FLOP/s of a step's forward
    and backward (FLOPs as the planner counts them, the predicted optimizer step taken out) over the
    table's peak. None when it is not in (0, 1] (the optimizer's prediction exceeds the step)."""
    cfg = get_preset(spec.model)
    flops = 3 * sum(unit_costs(cfg, spec.seq_len)) * spec.micro_batch * spec.seq_len
    optimizer_s = cfg.num_params() * 32 / DEVICES[check.plan_device].memory_bandwidth
    if step_s <= optimizer_s:
        return None
    efficiency = flops / (step_s - optimizer_s) / check.table_peak
    return efficiency if 0 < efficiency <= 1 else None


def step_time(check: Check) -> dict:
    """Every training run measured so far. The default prediction uses the planner's compute model
    with the device table's kernels; the calibrated one the efficiency measured on the run without checkpointing at the same
    micro-batch (for that run it holds by construction; for checkpointed runs it tests the planner's
    recomputation terms)."""
    measured = {spec: run for spec, run in check.runs.items() if "error" not in run and not spec.compile}
    efficiency = {(spec.model, spec.micro_batch): measured_efficiency(check, spec, run["median_step_s"])
                  for spec, run in measured.items() if spec.checkpointing == "none"}
    rows = []
    for spec, run in measured.items():
        if not check.budget.allows():
            check.skip("step_time", spec.describe(), "budget spent")
            continue
        measured_s, predicted_s = run["median_step_s"], planned_layout(check, spec)["step_time_s"]
        row = {"run": spec.describe(), "measured_step_s": measured_s, "predicted_step_s": predicted_s,
               "relative_error": predicted_s / measured_s - 1,
               "efficiency_used": efficiency.get((spec.model, spec.micro_batch))}
        if row["efficiency_used"] is not None:
            calibrated_s = planned_layout(check, spec, row["efficiency_used"])["step_time_s"]
            row.update(predicted_calibrated_step_s=calibrated_s,
                       relative_error_calibrated=calibrated_s / measured_s - 1)
        rows.append(row)
    return {"plan_device": check.plan_device, "default_compute": "the device's kernels (strata/plan/compute.py)",
            "runs": rows}


# --- generation: TTFT and time per output token against plan --inference ----------------------------
def calibrate_inference(check: Check) -> str:
    """strata's inference calibration on this device (what `strata calibrate --inference` writes),
    saved as a profile for `strata plan --inference --profile`."""
    measured = inference_overheads(check.device, GENERATION_DTYPE, check.shapes.calibration_widths)
    path = os.path.join(check.out_dir, "inference_profile.json")
    with open(path, "w") as f:
        json.dump({"inference": measured}, f, indent=1)
    return path


def planned_decode(check: Check, model: str, batch: int, context: int, profile: str | None) -> float:
    argv = ["plan", "--inference", "--model", model, "--device", check.plan_device, "--gpus-per-node", 1,
            "--precision", "bf16", "--batch", batch, "--context", context]
    if profile:
        argv += ["--profile", profile]
    return strata_json(argv)["layouts"][0]["token_latency_s"]


def timed_generation(model, prompt: list[int], batch: int, tokens: int, runs: int) -> dict:
    timed = [Run("strata", batch, "random ids", tokens, None, *time_strata(model, prompt, batch, tokens)[:2])
             for _ in range(runs)]
    return {"ttft_s": statistics.median(r.ttft for r in timed), "tpot_s": statistics.median(r.tpot for r in timed),
            "latency_s": statistics.median(r.latency for r in timed), "runs": len(timed)}


def generation(check: Check) -> dict:
    s = check.shapes
    cfg = get_preset(s.llm)
    # building the model takes about what a training run of it took (the host draws the weights)
    if not check.budget.allows(check.run_seconds.get(s.llm, 0.0) + ANALYSIS_RESERVE_S):
        check.skip("generation", "all", "budget spent")
        return {"model": s.llm, "batches": []}
    release_memory(check.device)
    model = build_model(cfg, check.device, GENERATION_DTYPE, seed=0).eval()
    prompt = torch.randint(1, cfg.vocab_size, (s.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    time_strata(model, prompt, max(s.generation_batches), 4)  # warm-up: allocation, kernel choice
    profile = calibrate_inference(check)
    with open(profile) as f:
        calibration = json.load(f)["inference"]
    context = s.prompt_tokens + s.new_tokens // 2  # the mean context over the answer's decode steps
    rows = []
    for batch in s.generation_batches:
        if not check.budget.allows():
            check.skip("generation", f"batch {batch}", "budget spent")
            continue
        row = {"batch": batch, **timed_generation(model, prompt, batch, s.new_tokens, s.generation_runs),
               "predicted_tpot_s": planned_decode(check, s.llm, batch, context, None),
               "predicted_tpot_calibrated_s": planned_decode(check, s.llm, batch, context, profile),
               "predicted_ttft_s": None}
        row["relative_error"] = row["predicted_tpot_s"] / row["tpot_s"] - 1
        row["relative_error_calibrated"] = row["predicted_tpot_calibrated_s"] / row["tpot_s"] - 1
        rows.append(row)
    del model
    release_memory(check.device)
    return {"model": s.llm, "dtype": "bf16", "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens,
            "plan_context": context, "plan_device": check.plan_device,
            "ttft_note": "strata plan --inference predicts the decode step only, not the prefill",
            "calibration": {k: calibration[k] for k in ("device", "memory_bandwidth", "per_layer_s", "per_token_s",
                                                        "matmul_flops", "fit_r2")},
            "batches": rows}
