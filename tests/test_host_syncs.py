"""The host waits for the device at most once per step (issue 53): a training step's host syncs,
counted by strata/distributed/host_syncs.HostSyncs (item, tolist, nonzero and boolean indexing,
value-sized outputs, synchronize, pageable uploads), for each kind of layout, and never per
micro-batch: the count is the same with twice the micro-batches."""

from __future__ import annotations

import pytest
import torch

from strata.config import train_config
from strata.distributed import comm
from strata.distributed.host_syncs import HostSyncs
from strata.train import trainer

from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=16, micro_batch=1, steps=4, progress=False, eval_batches=1, device="cpu",
            dtype="fp64")


def _syncs_of_a_step(settings: dict, micro_batches: int) -> dict:
    """The host syncs of this rank's second step (the first makes what is cached)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    replicas = world // (settings.get("tp", 1) * settings.get("pp", 1) * settings.get("cp", 1))
    run = trainer.setup(train_config(**{**BASE, **settings, "global_batch": micro_batches * replicas}))
    trainer.train_step(run, 0)
    with HostSyncs() as syncs:
        trainer.train_step(run, 1)
    run.parallel.close()
    comm.close_streams()
    return dict(syncs.by_kind)


def _both(settings: dict) -> tuple[dict, dict]:
    return _syncs_of_a_step(settings, 2), _syncs_of_a_step(settings, 4)


LAYOUTS = {"one process": (1, {}), "dp2": (2, {}), "dp2 zero1": (2, {"zero": 1}), "dp2 zero2": (2, {"zero": 2}),
           "dp2 zero3": (2, {"zero": 3}), "tp2 sp": (2, {"tp": 2, "sequence_parallel": True}),
           "pp2 1f1b": (2, {"pp": 2}), "pp2 interleaved": (2, {"pp": 2, "schedule": "interleaved",
                                                               "virtual_stages": 2, "n_layers": 4}),
           "cp2": (2, {"cp": 2})}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_dense_step_reads_the_device_once_whatever_its_micro_batches(name):
    world, settings = LAYOUTS[name]
    results = run_on_ranks(_both, world, settings)  # one process too: its process group stays there
    for fewer, more in results:
        assert fewer == more, (fewer, more)  # nothing per micro-batch
        assert sum(fewer.values()) <= 1, fewer  # the loss and the gradient norm, read together


MOE_LAYOUTS = {"moe one process": (1, {"model": "tiny-moe"}), "moe ep2": (2, {"model": "tiny-moe", "ep": 2}),
               "moe capacity": (1, {"model": "tiny-moe", "capacity_factor": 1.0})}


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_a_mixture_of_experts_reads_the_rows_per_expert_once_per_layer(name):
    """Beside the dense step's one read (and one for the routing's statistics), each MoE layer's
    forward reads its rows per expert once: the split sizes its experts compute on (under ep, the
    rows sent and received, read together after the counts' exchange)."""
    world, settings = MOE_LAYOUTS[name]
    layers = 2  # tiny-moe's
    for fewer, more in run_on_ranks(_both, world, settings):
        assert sum(more.values()) - sum(fewer.values()) == 2 * layers, (fewer, more)  # 2 more micro-batches
        assert sum(fewer.values()) == 2 + 2 * layers, fewer


def test_experts_on_torch_s_grouped_product_read_nothing_per_layer():
    """fp32 on a CPU, where torch's grouped product has a kernel (strata/model/grouped_experts.py):
    the offsets stay on the device, so a dropless mixture reads the loss and norm and its routing
    statistics, and nothing per layer or micro-batch."""
    for fewer, more in run_on_ranks(_both, 1, {"model": "tiny-moe", "dtype": "fp32"}):
        assert fewer == more and sum(fewer.values()) == 2, (fewer, more)
