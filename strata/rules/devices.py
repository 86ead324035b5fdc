"""Which device a command may run on."""

from __future__ import annotations

from strata.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda")  # auto: cuda when there is one, else cpu


def check_device(choice: str, valid: tuple[str, ...] = DEVICE_CHOICES) -> None:
    """A device name this machine can use: one of `valid`, and cuda only where there is one."""
    if choice not in valid:
        raise ConfigError(f"valid: {', '.join(valid)}", "device", choice)
    if choice == "cuda":
        import torch  # only when cuda is asked for: checking flags should not cost torch's import
        if not torch.cuda.is_available():
            raise ConfigError("no CUDA device here (torch.cuda.is_available() is False); use cpu or auto",
                              "device", choice)
