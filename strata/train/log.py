"""What a run reports as it goes: one record per step (the metrics file, written by rank 0), the
progress bar, and the summary `train` returns."""

from __future__ import annotations

import math

from tqdm import tqdm

from strata.distributed import comm
from strata.memory import tiers
from strata.train import metrics as m
from strata.train.optim import lr_at
from strata.train.run_dir import RunOutputs


class RunLog:
    def __init__(self, run):
        cfg = run.cfg
        self.is_main = run.rank == 0
        # metrics, TensorBoard, --run-dir
        self.writer = RunOutputs(cfg, self.is_main, run.state.start_step, run.world_size, comm.semantics(), run.device.type)
        self.peak = m.mfu_peak(run.device, cfg.dtype, cfg.peak_flops)
        self.allocator = m.AllocatorStats(run.device)
        seq_len = run.train_data.seq_len
        self.tokens_per_step = cfg.global_batch * seq_len
        self.flops_per_token = run.model_cfg.flops_per_token(seq_len)
        self.summary = {"losses": [], "val_losses": [], "step_times": [], "records": [], "checkpoint": None}
        self.progress = tqdm(total=cfg.steps, initial=run.state.start_step, disable=not (self.is_main and cfg.progress),
                             desc="train", unit="step", dynamic_ncols=True)
        if self.is_main and self.peak.note:  # a GPU without a datasheet rate: the MFU read is optimistic
            self.progress.write(f"MFU: {self.peak.note}")

    def emit(self, record: dict, loss: float, grad_norm: float) -> dict:
        record.update(loss=loss, grad_norm=grad_norm)
        self.writer.write(record)
        for key, value in (("losses", loss), ("step_times", record["step_time_s"]), ("records", record)):
            self.summary[key].append(value)
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", mfu=f"{record['mfu']:.1%}")
        return record

    def compiled(self, step: int, seconds: float | None) -> None:
        """Once, after the first step: the time torch.compile took (the blocks compile lazily)."""
        if seconds is None:
            return
        self.summary["compile_s"] = seconds
        self.writer.write({"kind": "compile", "step": step, "compile_s": seconds})
        if self.is_main:
            self.progress.write(f"torch.compile: {seconds:.1f} s tracing and generating code (in the first step)")

    def evaluation(self, step: int, val_loss: float) -> None:
        self.summary["val_losses"].append((step, val_loss))
        self.writer.write({"kind": "eval", "step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
        if self.is_main:
            self.progress.write(f"step {step}: validation loss {val_loss:.4f}")

    def close(self) -> None:
        self.progress.close()
        self.writer.close()

    def measure(self, run, step: int, states: dict[str, int], elapsed: float) -> dict:
        """Step `step` (0-based) as one JSON object, taken when it ends: rates, memory and
        communication; `emit` adds the loss and the gradient norm (which an asynchronous pipeline
        learns a step later) and writes it."""
        tokens_per_s = self.tokens_per_step / elapsed
        sharding_stats = run.parallel.sharding.stats()
        record = {"kind": "train", "step": step + 1, "loss": None, "lr": lr_at(step, run.cfg), "grad_norm": None,
                  "tokens_per_s": tokens_per_s,
                  "mfu": tokens_per_s * self.flops_per_token / (self.peak.flops * run.world_size),
                  "peak_flops": self.peak.flops, "peak_flops_source": self.peak.source, "step_time_s": elapsed,
                  "model_state_bytes": sum(states.values()),
                  "model_state_breakdown": _by_location(run, states, sharding_stats),
                  "comm_bytes": comm.counter.total(), "comm_bytes_by_op": comm.counter.by_op(),
                  "comm_seconds_by_op": comm.counter.seconds_by_op(),
                  "comm_exposed_seconds_by_op": comm.counter.exposed_seconds_by_op(), "peak_mem_bytes": m.peak_memory_bytes(run.device),
                  **self.allocator.read(), "optimizer_step_s": run.state.update_s}
        if any(setting != "none" for setting in (run.cfg.layout.offload, run.cfg.layout.offload_params,
                                                 run.cfg.layout.offload_activations)):
            record["offload"] = {"read_bytes": dict(tiers.io.read), "written_bytes": dict(tiers.io.written),
                                 "io_wait_s": tiers.io.wait_s}
        record["peak_rss_bytes"] = tiers.peak_resident_bytes()
        if "peak_buffer_bytes" in sharding_stats:  # ZeRO-2's staging; ZeRO-3's gathered units, staged gradients
            record["buffer_bytes"] = sharding_stats["peak_buffer_bytes"]
        if run.scaler is not None:
            record.update(loss_scale=run.scaler.scale, skipped=run.state.skipped, skipped_steps=run.scaler.skipped_steps)
        if run.versions:  # asynchronous schedules: stashed weight versions per (emulated) stage, after the update
            record.update(weight_versions=[len(v.stashes) for v in run.versions],
                          weight_version_bytes=[v.stash_bytes() for v in run.versions])
        if run.state.routed is not None:  # a mixture of experts
            record.update(run.state.routed)
        if run.pipeline is not None:  # measured on this rank's timeline and saved tensors
            record.update(bubble=run.pipeline.idle_fraction, peak_activation_bytes=run.pipeline.peak_activation_bytes)
        else:  # one micro-batch's activations at a time
            record["peak_activation_bytes"] = run.state.activation_bytes
        return record


def _by_location(run, states: dict[str, int], sharding_stats: dict[str, int]) -> dict[str, int]:
    """Model-state bytes by kind, and, with offload, where the optimizer's states are instead."""
    if run.cfg.layout.offload_params != "none":  # the shards and gradients; the moments where --offload puts them
        states = {**states, f"params_and_grads_on_{run.cfg.layout.offload_params}": sharding_stats["offloaded_bytes"]}
    if run.cfg.layout.offload == "disk":
        return {**states, "optimizer_on_disk": run.optimizer.disk_bytes()}
    if run.cfg.layout.offload == "cpu":  # what stays on the device, what the host holds
        return {**states, "optimizer": 0, "optimizer_on_host": run.optimizer.host_bytes()}
    return states
