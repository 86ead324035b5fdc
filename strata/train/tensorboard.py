"""TensorBoard event files of a run (`--tensorboard DIR`): each metrics record as scalars, written by
rank 0 through torch's SummaryWriter. The `tensorboard` package is an optional dependency; a run that
asks for events without it is refused before any process starts."""

from __future__ import annotations

from strata.errors import ConfigError

# record key -> tag. TensorBoard groups the curves by the tag's first part.
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "loss_scale": "train/loss_scale",
        "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s",
        "bubble": "perf/pipeline_bubble", "peak_mem_bytes": "memory/peak_bytes",
        "model_state_bytes": "memory/model_state_bytes", "peak_activation_bytes": "memory/peak_activation_bytes",
        "comm_bytes": "comm/bytes", "val_loss": "eval/val_loss", "val_ppl": "eval/val_ppl",
        "compile_s": "perf/compile_s", "aux_loss": "train/aux_loss", "dropped_tokens": "moe/dropped_tokens"}
COMM_SECONDS = "comm_seconds"  # one curve per operation and group: comm_seconds/all_reduce/dp


def installed() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401 - needs the tensorboard package
    except ImportError:
        return False
    return True


def check_installed(log_dir: str) -> None:
    if not installed():
        raise ConfigError("needs the tensorboard package, which is not installed here (pip install tensorboard)",
                          "tensorboard", log_dir)


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers by tag; the seconds each collective was in flight, per operation/group."""
    out = {tag: float(record[key]) for key, tag in TAGS.items()
           if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)}
    for op_and_group, seconds in (record.get("comm_seconds_by_op") or {}).items():
        out[f"{COMM_SECONDS}/{op_and_group}"] = float(seconds)
    for expert, tokens in enumerate(record.get("expert_load") or ()):  # a mixture of experts: one curve per expert
        out[f"moe/expert_load/{expert}"] = float(tokens)
    return out


class TensorBoardWriter:
    """Scalars of every record at its step; only rank 0 writes (enabled)."""

    def __init__(self, log_dir: str | None, enabled: bool, resume_step: int = 0):
        self.writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter
            # TensorBoard shows every point written for a step, from every event file of the
            # directory. purge_step hides the points an earlier run of this directory wrote from that
            # step on: a run resumed at step k replays k+1, k+2, ... (written before a crash, perhaps),
            # and a fresh run starts the curves anew.
            self.writer = SummaryWriter(log_dir, purge_step=resume_step + 1 if resume_step else 0)

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()  # a killed run keeps what it logged, and a live TensorBoard sees each step

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
