import os
import sys

import pytest
import torch

# One compute thread: several ranks share two cores, and results must not depend on thread count.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py as `distributed`


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep the measured-peak cache out of the user's home."""
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def two_nodes():
    """(namespace, address, veth device) of two nodes joined by a veth pair (tests/netns.py), for the
    multi-node and Slurm tests; mark them with netns.needs_netns."""
    import netns
    with netns.two_nodes("s", "10.231.7") as nodes:
        yield nodes
