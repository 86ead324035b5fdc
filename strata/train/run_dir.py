"""A run directory (`--run-dir DIR`): one place for everything a run writes, enough to run it again
from the directory alone (`strata train --config DIR/config.toml --resume auto`).

    DIR/config.toml      the resolved config, every key with a value, the layout's under [layout]
    DIR/metrics.jsonl    the metrics records            (unless --metrics says otherwise)
    DIR/tb/              TensorBoard event files        (unless --tensorboard; when tensorboard is installed)
    DIR/ckpt/            checkpoints                    (unless --save)
    DIR/loss.png         the loss curves, drawn at the end
    DIR/train.log        one line per step and validation, and where the run started

This module also gathers a run's record sinks (the metrics file, TensorBoard, the log) behind the
one `write(record)` the training loop calls."""

from __future__ import annotations

import math
import os
import time

from strata.config import check_output_paths, run_dir_outputs
from strata.errors import ConfigError
from strata.rules.comm_semantics import describe as describe_semantics
from strata.train import tensorboard
from strata.train.metrics import MetricsWriter
from strata.train.plot import plot_losses

CONFIG, LOG, PLOT = "config.toml", "train.log", "loss.png"


# --- TOML ----------------------------------------------------------------------------------------
def toml_value(value) -> str:
    """A TOML value for a str, int, float or bool (what TrainConfig holds)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")  # repr: exact round trip
    if isinstance(value, str):
        return '"' + "".join(_escaped(char) for char in value) + '"'
    raise TypeError(f"no TOML value for {type(value).__name__}")


def _escaped(char: str) -> str:
    """A character inside a TOML basic string: quotes, backslashes and control characters escaped."""
    if char in '"\\':
        return "\\" + char
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"\\u{ord(char):04X}"
    return char


def toml_text(values: dict) -> str:
    """Flat `key = value` lines; None values are left out (TOML has no null: the default applies)."""
    return "".join(f"{key} = {toml_value(value)}\n" for key, value in values.items() if value is not None)


def config_toml(cfg) -> str:
    """The run's config as TOML: every key with a value, the layout's in its [layout] table, except
    dp and the outputs the run directory implies (so the file run with another --run-dir writes
    there, not into this one)."""
    implied = run_dir_outputs(cfg.run_dir) if cfg.run_dir else {}
    values = cfg.to_dict()
    layout = values.pop("layout")
    # dp is what the world leaves of cp x tp x pp (the layout check holds their product to it), and
    # a resolved run has it filled in: left out, the file runs again on any world size
    layout.pop("dp")
    values = {k: v for k, v in values.items() if not (k in implied and v == implied[k])}
    return "# strata train --config this-file (the same keys as the flags; docs/config.md)\n" + \
        toml_text(values) + "\n[layout]\n" + toml_text(layout)


# --- checks ---------------------------------------------------------------------------------------
def check_outputs(cfg) -> None:
    """Every path the run writes can be written (config.check_output_paths), events have their
    package, and config.toml can hold the settings."""
    check_output_paths(cfg)
    if cfg.tensorboard:
        tensorboard.check_installed(cfg.tensorboard)
    if cfg.run_dir:
        try:
            config_toml(cfg).encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError("a setting holds a name that is not UTF-8, which config.toml cannot hold",
                              "run_dir", cfg.run_dir) from None


# --- the run's outputs ------------------------------------------------------------------------------
class RunOutputs:
    """Where a run's records go: the metrics file, TensorBoard, and with --run-dir the log; with
    --run-dir also the config at the start and the loss plot at the end. Rank 0 writes (is_main)."""

    def __init__(self, cfg, is_main: bool, start_step: int = 0, world_size: int = 1, semantics: str = "native",
                 device_type: str = "cpu"):
        """semantics: the run's communication semantics (strata/rules/comm_semantics.py), in every
        record and in the log's first line."""
        self.cfg, self.is_main, self.semantics = cfg, is_main, semantics
        self.sinks = [MetricsWriter(cfg.metrics, is_main, resume_step=start_step),
                      tensorboard.TensorBoardWriter(cfg.tensorboard, is_main, resume_step=start_step)]
        self.log = None
        if cfg.run_dir and is_main:
            os.makedirs(cfg.run_dir, exist_ok=True)
            _write_atomically(os.path.join(cfg.run_dir, CONFIG), config_toml(cfg))
            self.log = open(os.path.join(cfg.run_dir, LOG), "a" if start_step else "w", encoding="utf-8")
            self._log(f"{'resumed at' if start_step else 'started at'} step {start_step} of {cfg.steps}, "
                      f"{world_size} process(es), model {cfg.model}, data {cfg.data}; "
                      f"{describe_semantics(semantics, device_type)}")

    def write(self, record: dict) -> None:
        record.setdefault("comm_semantics", self.semantics)
        for sink in self.sinks:
            sink.write(record)
        if self.log is not None:
            self._log(_log_line(record))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.log is not None:
            self._log(f"finished at step {self.cfg.steps}")
            self.log.close()
            if self.cfg.metrics and os.path.isfile(self.cfg.metrics):
                plot_losses(self.cfg.metrics, os.path.join(self.cfg.run_dir, PLOT))

    def _log(self, text: str) -> None:
        self.log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        self.log.flush()


def _log_line(record: dict) -> str:
    if record.get("kind") == "compile":
        return f"step {record['step']}: torch.compile took {record['compile_s']:.1f} s"
    if record.get("kind") == "eval":
        return f"step {record['step']}: validation loss {record['val_loss']:.4f} (perplexity {record['val_ppl']:.2f})"
    return (f"step {record['step']}: loss {record['loss']:.4f}, lr {record['lr']:.3g}, grad norm "
            f"{record['grad_norm']:.3f}, {record['tokens_per_s']:,.0f} tokens/s, MFU {record['mfu']:.1%}, "
            f"{record['step_time_s']:.3f} s")


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
