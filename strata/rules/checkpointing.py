"""The activation-checkpointing modes (what each does: strata/memory/checkpointing.py). The
runtime, the layout check, the planner and the CLI read them here."""

from __future__ import annotations

from strata.errors import ConfigError

MODES = ("none", "full", "selective", "every:K")
PLANNED_MODES = ("none", "selective", "full")  # what the cost model prices (every:K: not yet)


def parse(mode: str) -> tuple[str, int]:
    """'every:3' -> ('every', 3); 'full' -> ('full', 0). Raises ConfigError on anything else."""
    if mode in ("none", "full", "selective"):
        return mode, 0
    if isinstance(mode, str) and mode.startswith("every:"):
        count = mode.split(":", 1)[1]
        if count.isdigit() and int(count) >= 1:
            return "every", int(count)
    raise ConfigError(f"valid: {', '.join(MODES)} (K >= 1)", "checkpointing", mode)
