"""The GPU check: everything strata has never run on a GPU, measured in one call of at most 8 minutes
on one device, for the rare times a GPU machine is lent.

  cd <repo> && PYTHONPATH=. python bench/gpu_check.py --device cuda --out $OUT
  PYTHONPATH=. python bench/gpu_check.py --device cpu --quick --out /tmp/gpu-check   # the same code, tiny shapes

Parts, in order (each timed; when the --budget-s budget is spent the rest are skipped and listed):
  environment   torch, CUDA, the device, which optional modules were missing
  correctness   `tiny` trained 6 steps on the device equals the CPU run (fp64 within 1e-9, fp32 within
                1e-4: losses and final weights); ZeRO-Infinity with everything in pinned host memory
                equals the run kept on the device bit for bit; greedy generation gives the CPU's tokens;
                context parallelism's ring attention, its blocks computed by the device's kernel and
                merged, equals one attention over the whole sequence (fp32, bf16; causal, a window)
  step          issue 53's step on the device (bench/gpu_check_step.py): host syncs a step by strata's
                counter and CUDA's sync debug mode; initial values made on the device equal the CPU's;
                an 8B-shaped model's weights made on the device; the loss's peak at a 128K vocabulary
  mfu           the trainer's MFU denominator on this device without --peak-flops (bf16, fp32: its
                number and source, the table's number, a measured matmul beside it) and the record
                a 2-step run writes (its peak and source, the allocator's reserved bytes, retries
                and largest allocation); bf16 training of the ~1B LLaMA-shaped preset at 2048 tokens
                and of gpt2-124m: MFU against the device table's peak, and the measured matmul peak
                beside it; eager and --compile, with the compile time
  event_timing  step-like workloads (matmuls; tiny's and gpt2-124m's forward, backward and AdamW step)
                timed by CUDA events (strata.distributed.timing) against the wall time of the same
                work bracketed by torch.cuda.synchronize(), and the host's launch time beside them
  collectives   a world-1 NCCL process group started with the flight recorder's variables (as `strata
                launch` sets them): all-reduces and a barrier through comm under NCCL's rules, a host
                tensor refused, the dump written, read back and diagnosed
  generation    TTFT and time per output token at batch 1 and 8 against `strata plan --inference`
                (uncalibrated, and calibrated on this device as `strata calibrate --inference` does)
  memory        the planner's peak for micro-batch 1/4 x checkpointing none/selective/full against
                torch.cuda.max_memory_allocated
  step_time     the planner's step time (device table, its compute model; and with the efficiency
                measured here, as `strata calibrate` measures it for a CPU) against the measured runs

Writes gpu_check.json and gpu_check.txt (a short report) into --out after every part, so a run cut
short still leaves what it measured. Runs from the source tree with the machine's own torch (no
install): only torch, numpy and strata's code are needed; tqdm and safetensors, when missing, are
replaced by stand-ins for what the check never calls (progress bars are off, nothing is saved)."""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
import time
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_check_parts, however this is started
STARTED = time.perf_counter()  # the budget counts from here: importing torch takes time too
BUDGET_S = 480.0
PART_NAMES = ("environment", "correctness", "step", "mfu", "event_timing", "collectives", "generation", "memory",
              "step_time")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, as strata's own commands do
        fail(f"{message} (see --help)")


def fail(message: str) -> None:
    print(f"gpu_check: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda | cpu")
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.txt")
    p.add_argument("--quick", action="store_true", help="the same code paths on tiny models (under a minute on a CPU)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the whole check (default 480)")
    p.add_argument("--parts", default=",".join(PART_NAMES),
                   help=f"comma-separated subset of {', '.join(PART_NAMES)} (the environment is always recorded)")
    args = p.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        fail(f"--device {args.device}: valid: cuda, cpu")
    if not args.budget_s > 0:
        fail(f"--budget-s {args.budget_s}: must be > 0 seconds")
    args.parts = [name.strip() for name in args.parts.split(",") if name.strip()]
    unknown = [name for name in args.parts if name not in PART_NAMES]
    if unknown or not args.parts:
        fail(f"--parts {','.join(unknown) or '(none)'}: valid: {', '.join(PART_NAMES)}")
    return args


# --- modules the check never calls -----------------------------------------------------------------
class _NoProgress:
    """tqdm's interface as the trainer uses it, doing nothing (progress bars are off anyway)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _unavailable(module: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{module} is not installed on this machine; the GPU check saves and loads nothing")
    return call


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def _stand_in(name: str, **attributes) -> types.ModuleType:
    """A module of the given attributes, with a spec (torch._dynamo looks up some modules' specs,
    tqdm's among them) whose origin is None: nothing on disk."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def stub_missing_modules() -> list[str]:
    """Stand in for strata's dependencies that the check's code paths import but never call, when
    this machine lacks them (nothing can be installed there). Returns the names stubbed."""
    stubbed = []
    if not _importable("tqdm"):
        _stand_in("tqdm", tqdm=_NoProgress)
        stubbed.append("tqdm")
    if not _importable("safetensors"):
        missing = _unavailable("safetensors")
        _stand_in("safetensors", safe_open=missing, SafetensorError=RuntimeError,
                  torch=_stand_in("safetensors.torch", save_file=missing, load_file=missing))
        stubbed.append("safetensors")
    return stubbed


# --- running the parts -------------------------------------------------------------------------------
def run_parts(check, names: list[str], results: dict, write) -> None:
    import gpu_check_correctness as correctness
    import gpu_check_device as device_parts
    import gpu_check_parts as parts
    import gpu_check_step as step_parts
    functions = {"environment": parts.environment, "correctness": correctness.correctness,
                 "step": step_parts.step, "mfu": parts.mfu,
                 "event_timing": device_parts.event_timing, "collectives": device_parts.collectives,
                 "generation": parts.generation, "memory": parts.memory,
                 "step_time": parts.step_time}
    for name in names:
        if name != "environment" and not check.budget.allows():  # the environment costs nothing: always said
            check.skip(name, "all", f"budget of {check.budget.seconds:.0f} s spent")
            results[name] = {"status": "skipped"}
            write()
            continue
        started = time.perf_counter()
        try:
            results[name] = {"status": "done", **functions[name](check)}
        except Exception as e:  # noqa: BLE001 - one part failing must not cost the others their turn
            traceback.print_exc()
            results[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        results[name]["seconds"] = time.perf_counter() - started
        results["seconds"] = check.budget.spent()
        write()


def write_outputs(out_dir: str, results: dict) -> None:
    """gpu_check.json and gpu_check.txt, each replaced whole (a run killed mid-write leaves the last)."""
    for name, text in (("gpu_check.json", json.dumps(results, indent=1, default=str)),
                       ("gpu_check.txt", "\n".join(report_lines(results)) + "\n")):
        tmp = os.path.join(out_dir, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out_dir, name))


# --- the text report ---------------------------------------------------------------------------------
def _pct(x) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _bytes(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB" if x >= 1e9 else f"{x / 2**20:.2f} MiB"


def _flops(x) -> str:
    return "-" if x is None else f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def _ms(x) -> str:
    return f"{x * 1e3:.2f} ms"


def report_lines(r: dict) -> list[str]:
    env = r.get("environment", {})
    device_name = f" ({env['name']})" if env.get("name") else ""
    lines = [f"strata GPU check ({'quick' if r['quick'] else 'full'}) on {r['device']}{device_name}, "
             f"torch {env.get('torch', '?')}, {r.get('seconds', 0):.0f} s of {r['budget_s']:.0f}"]
    if "error" in r:
        lines.append(f"error: {r['error']}")
    for name in PART_NAMES:
        part = r.get(name)
        if part is None:
            continue
        if part.get("status") != "done":
            lines.append(f"{name}: {part.get('status')} {part.get('error', '')}".rstrip())
            continue
        lines += globals()[f"_report_{name}"](part)
    if r["skipped"]:
        lines.append("skipped: " + "; ".join(f"{s['part']} {s['item']} ({s['reason']})" for s in r["skipped"]))
    return lines


def _report_environment(p: dict) -> list[str]:
    stubbed = f"; stand-ins for {', '.join(p['stubbed_modules'])}" if p["stubbed_modules"] else ""
    unmatched = " (not in the table)" if p.get("name") and p.get("table_entry") is None else ""
    return [f"environment: CUDA {p['cuda']}, predictions for the table's {p['plan_device']}{unmatched}{stubbed}"]


def _report_correctness(p: dict) -> list[str]:
    train = ", ".join(f"{d} |Δloss| {t['max_loss_diff']:.1e} |Δw| {t['max_param_diff']:.1e} (tol {t['tolerance']:g})"
                      for d, t in p["training"].items())
    greedy = ", ".join(f"{d} {'equal' if g['passed'] else 'DIFFER'}" for d, g in p["generation"].items())
    ring = ", ".join(f"{name} {max(r['relative_errors'].values()):.1e} (tol {r['tolerance']:g})"
                     for name, r in p.get("ring attention", {}).items())
    verdict = "PASS" if p["passed"] else "FAIL"
    lines = [f"correctness: {verdict}: {p['device']} vs cpu, tiny {p['steps']} steps: {train}; greedy tokens {greedy}; "
             f"ring attention's blocks vs one attention {ring}"]
    grouped = p.get("grouped experts", {}).get("bf16")
    if grouped:
        lines.append(f"  grouped experts bf16: {grouped['path']}, max rel err "
                     f"{max(grouped['relative_errors'].values()):.1e} (tol {grouped['tolerance']:g}), host syncs "
                     f"{sum(grouped['host_syncs'].values())} + CUDA {grouped['cuda_sync_warnings']}, loop / taken "
                     f"{grouped['timing']['loop_over_taken']:.1f}x")
    return lines


def _report_step(p: dict) -> list[str]:
    syncs = ", ".join(f"{model} {s['dtype']} {s['strata_total']} (CUDA's warnings {s['cuda_warnings']}; budget "
                      f"{s['budget']})" for model, s in p["syncs"].items())
    values, start, loss = p["initial_values"], p["startup"], p["chunked_loss"]
    same = "equal" if values["passed"] else f"DIFFER: {', '.join(values['differing'])}"
    ring, window, shape = p["attention"]["ring"], p["attention"]["window"], p["attention"]["shape"]
    return [f"step: host syncs a step: {syncs}",
            f"  attention, {shape['dtype']} {shape['heads']}/{shape['kv_heads']} heads of {shape['d']}, "
            f"{shape['seq']} tokens, forward + backward: ring blocks (cp 4, {ring['kernel']}) "
            f"{_ms(ring['blocks_ms'] / 1e3)} vs one SDPA {_ms(ring['sdpa_ms'] / 1e3)} ({ring['blocks_over_sdpa']:.2f}x; "
            f"tiles as before {ring['tiles_over_blocks']:.1f}x slower); window {window['window']} by blocks "
            f"{_ms(window['blocks_ms'] / 1e3)}, {_bytes(window['blocks_peak_bytes'])} vs SDPA's mask "
            f"{_ms(window['sdpa_mask_ms'] / 1e3)}, {_bytes(window['sdpa_mask_peak_bytes'])} (differ "
            f"{window['relative_difference']:.1e})",
            f"  offload copies beside compute: {_overlap(p['offload_overlap'])}",
            f"  initial values on the device vs the CPU, {values['model']}'s embedding and block 0: {same}",
            f"  start-up: {start['model']}'s {start['elements'] / 1e9:.2f} G weights made on the device in "
            f"{start['made_on_device_s']:.1f} s (drawn whole on the CPU as before: ~{start['cpu_randn_estimate_s']:.0f} s)",
            f"  the loss at a 131,072 vocabulary, {loss['tokens']} tokens: peak {_bytes(loss['unchunked'])} unchunked, "
            f"{_bytes(loss['chunked'])} in chunks of {_bytes(loss['chunk_bytes'])} of fp32 logits"]


def _overlap(o: dict) -> str:
    if "copy_stream" not in o:
        return f"not measured ({o['reason']})"
    new, old = o["copy_stream"], o["inline"]

    def _pct(x):
        return "-" if x is None else f"{x:.0%}"
    return (f"reads {_pct(new['read_overlap'])}, writes {_pct(new['write_overlap'])} of the copy time under kernels "
            f"(as before: {_pct(old['read_overlap'])}, {_pct(old['write_overlap'])})")


def _mfu_line(run: dict) -> str:
    if run["status"] != "measured":
        return run["status"] + (f": {run['error']}" if "error" in run else "")
    compiled = f", {run['compile_s']:.0f} s compiling" if run["compile_s"] is not None else ""
    return (f"{run['tokens_per_s']:,.0f} tokens/s, MFU {run['mfu_table_peak']:.1%} of the table peak, "
            f"{run['mfu_measured_peak']:.1%} of the measured{compiled}")


def _report_mfu(p: dict) -> list[str]:
    lines = [f"MFU, bf16: peak {_flops(p['peak_flops_table'])} ({p['table_device']} table), "
             f"measured matmul {_flops(p['peak_flops_measured_matmul'])}"]
    for dtype, d in p["denominator"].items():
        ratio = f", {d['measured_over_table']:.2f}x the table" if d["measured_over_table"] is not None else ""
        lines.append(f"  trainer's {dtype} denominator: {_flops(d['trainer_peak_flops'])} ({d['trainer_source']}); "
                     f"table {_flops(d['table_peak_flops'])}, "
                     f"measured matmul {_flops(d['measured_matmul_flops'])}{ratio}")
    r = p["trainer_record"]
    retries = "-" if r["alloc_retries"] is None else r["alloc_retries"]
    lines.append(f"  a 2-step record: peak {_flops(r['peak_flops'])} ({r['peak_flops_source']}, "
                 f"{'as above' if r['agrees'] else 'DIFFERS from the above'}), "
                 f"reserved {_bytes(r['memory_reserved_bytes'])}, alloc retries {retries}, "
                 f"largest allocation {_bytes(r['largest_alloc_bytes'])}")
    for m in p["models"]:
        eager, compiled = (_mfu_line(m[key]) for key in ("eager", "compile"))
        shape = f"{m['model']} seq {m['seq_len']} mb {m['micro_batch']}"
        lines.append(f"  {shape}: {eager}; --compile: {compiled}")
    return lines


def _report_event_timing(p: dict) -> list[str]:
    lines = [f"event timing ({p['clock']}) vs the wall time of a synchronised step, medians"]
    for w in p["workloads"]:
        lines.append(f"  {w['workload']}: events {_ms(w['events_s'])}, wall {_ms(w['wall_s'])} "
                     f"({w['events_over_wall']:.2f}), stream-synchronised {_ms(w['stream_s'])}, "
                     f"launches returned after {_ms(w['launch_s'])} ({w['launch_over_wall']:.2f})")
    return lines


def _report_collectives(p: dict) -> list[str]:
    if not p["ok"] and "stderr" in p:
        return [f"collectives: world-1 process group failed ({p['seconds']:.1f} s): {p['stderr'][-300:]}"]
    return [f"collectives: world-1 {p['backend']} group with the flight recorder's variables "
            f"({', '.join(sorted(p['variables']))}): {'ok' if p['ok'] else 'FAIL'}; "
            f"{p['all_reduces_recorded']} all-reduces in the dump, host tensor refused: {p['refused'] is not None}"]


def _report_generation(p: dict) -> list[str]:
    if not p["batches"]:
        return [f"generation, {p['model']}: nothing measured"]
    lines = [f"generation, {p['model']} bf16, prompt {p['prompt_tokens']} + {p['new_tokens']} tokens; "
             f"plan --inference at context {p['plan_context']} on {p['plan_device']} (TTFT: not predicted)"]
    for b in p["batches"]:
        lines.append(f"  batch {b['batch']}: TTFT {b['ttft_s'] * 1e3:.2f} ms, TPOT {b['tpot_s'] * 1e3:.2f} ms; "
                     f"predicted {b['predicted_tpot_s'] * 1e3:.2f} ms ({_pct(b['relative_error'])}), calibrated "
                     f"{b['predicted_tpot_calibrated_s'] * 1e3:.2f} ms ({_pct(b['relative_error_calibrated'])})")
    return lines


def _report_memory(p: dict) -> list[str]:
    lines = [f"memory, {p['model']} seq {p['seq_len']} bf16: planner vs measured peak"]
    for row in p["layouts"]:
        lines.append(f"  {row['layout']}: " + (f"error {row['error']}" if row["error"] else
                     f"predicted {_bytes(row['predicted_bytes'])}, measured {_bytes(row['measured_bytes'])} "
                     f"({_pct(row['relative_error'])})"))
    return lines


def _report_step_time(p: dict) -> list[str]:
    lines = [f"step time: planner ({p['plan_device']}, {p['default_compute']}) vs measured"]
    for row in p["runs"]:
        calibrated = (f"; at the measured efficiency {row['efficiency_used']:.3g}: "
                      f"{row['predicted_calibrated_step_s'] * 1e3:.1f} ms ({_pct(row['relative_error_calibrated'])})"
                      if row["efficiency_used"] is not None else "")
        lines.append(f"  {row['run']}: measured {row['measured_step_s'] * 1e3:.1f} ms, predicted "
                     f"{row['predicted_step_s'] * 1e3:.1f} ms ({_pct(row['relative_error'])}){calibrated}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stubbed = stub_missing_modules()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(f"--device cuda: no CUDA device here (torch {torch.__version__}); use --device cpu --quick")
    os.makedirs(args.out, exist_ok=True)
    results = {"schema": 1, "command": " ".join(sys.argv), "device": args.device, "quick": args.quick,
               "budget_s": args.budget_s, "seconds": 0.0, "skipped": []}
    try:
        import gpu_check_parts as parts
    except ImportError as e:  # a module strata needs for real (numpy) is missing: say so, in the files too
        results["error"] = f"cannot import strata with torch {torch.__version__}: {type(e).__name__}: {e}"
        write_outputs(args.out, results)
        print(f"gpu_check: {results['error']}", file=sys.stderr)
        return 1
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shapes = parts.QUICK if args.quick else parts.FULL
    check = parts.Check(device, shapes, parts.Budget(args.budget_s, STARTED), args.out, parts.plan_device_for(device),
                        stubbed)
    results["skipped"] = check.skipped
    # in the order above, and the environment always: it costs nothing and says what ran where
    chosen = [name for name in PART_NAMES if name in args.parts or name == "environment"]
    run_parts(check, chosen, results, lambda: write_outputs(args.out, results))
    results["seconds"] = check.budget.spent()
    write_outputs(args.out, results)
    print("\n".join(report_lines(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
