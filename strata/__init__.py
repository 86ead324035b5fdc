"""strata: training large language models across many devices on torch.distributed."""

__version__ = "0.1.0"
