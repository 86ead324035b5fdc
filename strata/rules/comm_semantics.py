"""How a run's communication behaves: as its backend does (`native`), or by NCCL's rules whatever
the backend (`nccl`: on a CPU, gloo made to run as NCCL would; strata/distributed/rehearsal.py).
The runtime and the CLI read the choice here; checking it imports no torch."""

from __future__ import annotations

import os

from strata.errors import ConfigError

SEMANTICS = ("native", "nccl")
SEMANTICS_ENV = "STRATA_COMM_SEMANTICS"  # the default when a run does not choose (the test suite sets nccl)


def default_semantics() -> str:
    """$STRATA_COMM_SEMANTICS, else native."""
    return os.environ.get(SEMANTICS_ENV) or "native"


def resolve_semantics(choice: str | None) -> str:
    """The semantics a run uses: its choice, else the environment's, checked."""
    value = choice or default_semantics()
    if value not in SEMANTICS:
        if choice is None:  # the environment's: named as such, not as a flag nobody gave
            raise ConfigError(f"${SEMANTICS_ENV} {value}: valid: {', '.join(SEMANTICS)}")
        raise ConfigError(f"valid: {', '.join(SEMANTICS)}", "comm_semantics", value)
    return value


def describe(semantics: str, device_type: str) -> str:
    """The words a run's log starts with."""
    if semantics == "native":
        return "communication: native (the backend's own rules)"
    if device_type == "cpu":
        return "communication: NCCL's rules rehearsed on gloo (comm_semantics nccl)"
    return "communication: NCCL's rules (comm_semantics nccl)"
