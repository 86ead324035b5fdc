"""`--offload disk`: Adam's moments in a file, streamed through a bounded buffer; the same losses
and weights as keeping them in memory, and a checkpoint that resumes exactly (the memory it saves,
measured as peak RSS, is in bench/timing_checks.py)."""


import pytest
import torch

from strata.config import train_config
from strata.train.trainer import train

from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=32, steps=4, micro_batch=1, global_batch=4, progress=False, peak_flops=1e10,
            eval_batches=1, seed=9)


def _both(settings):
    out = {}
    for offload in ("none", "disk"):
        s = train(train_config(**BASE, **settings, offload=offload), keep_state=True)
        out[offload] = (s["losses"], s["state"], s["records"][-1]["model_state_breakdown"])
    return out


def _assert_same(out):
    assert out["disk"][0] == out["none"][0]  # exact: the same fused kernel, chunk by chunk
    for name, value in out["none"][1].items():
        assert torch.equal(out["disk"][1][name], value), name
    breakdown = out["disk"][2]
    assert breakdown["optimizer"] == 0 and breakdown["optimizer_on_disk"] == out["none"][2]["optimizer"]


def test_disk_offload_gives_the_same_training_on_one_process():
    _assert_same(_both({}))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_disk_offload_under_zero_gives_the_same_training_and_streams_only_the_shard(zero):
    for rank in run_on_ranks(_both, 2, dict(zero=zero), timeout=300):
        _assert_same(rank)


def test_disk_offload_resumes_exactly(tmp_path):
    common = {**BASE, "steps": 6, "offload": "disk", "offload_dir": str(tmp_path / "off")}
    straight = train(train_config(**common))["losses"]
    train(train_config(**common, save=str(tmp_path / "ck"), save_every=3))
    resumed = train(train_config(**common, resume=str(tmp_path / "ck" / "step_000003")))["losses"]
    assert resumed == straight[3:]


def test_cpu_offload_copies_to_host_masters_and_back_exactly():
    # On a CPU device the host is the device and nothing is copied; here the copies an accelerator
    # needs are forced, and the result must still be AdamW's bit for bit.
    from strata.memory.offload import HostOffloadAdamW
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2, fused=True)
    offloaded = HostOffloadAdamW([{"params": twins, "weight_decay": 0.1}], 1e-2, (0.9, 0.999), copy_on_cpu=True)
    assert all(m is not p for m, p in zip(offloaded.masters, twins))
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        reference.step()
        offloaded.step()
    for p, t in zip(params, twins):
        assert torch.equal(p, t)
    assert offloaded.host_bytes() == 2 * 4 * 22 + 4 * 22  # masters + two moments, fp32


@pytest.mark.parametrize("local_ranks", [1, 2])
def test_the_host_step_runs_on_the_cores_the_node_s_ranks_leave_free(monkeypatch, local_ranks):
    """The ranks compute on one thread each; the host optimizer step takes the process's cores
    divided by the node's ranks, and the update is the same bit for bit (it is elementwise)."""
    import os

    from strata.memory.offload import HostOffloadAdamW, host_threads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    expected = max(1, len(os.sched_getaffinity(0)) // local_ranks)
    assert host_threads() == expected
    seen, fused = [], torch._fused_adamw_

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return fused(*args, **kwargs)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1 << 20, dtype=torch.float64))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW(params, lr=1e-2, fused=True)
    offloaded = HostOffloadAdamW([{"params": twins, "weight_decay": 0.01}], 1e-2, (0.9, 0.999), copy_on_cpu=True)
    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    for _ in range(2):
        params[0].grad = torch.randn_like(params[0])
        twins[0].grad = params[0].grad.clone()
        with torch.no_grad():
            torch.set_num_threads(1)
            reference.step()
        offloaded.step()
    assert seen[1::2] == [expected, expected] and torch.get_num_threads() == 1  # set back after the step
    assert torch.equal(params[0], twins[0])


def test_cpu_offload_in_training_gives_the_same_losses():
    a = train(train_config(**BASE))
    b = train(train_config(**BASE, offload="cpu"))
    assert a["losses"] == b["losses"]
    assert b["records"][-1]["model_state_breakdown"]["optimizer_on_host"] > 0


def test_an_fp64_run_keeps_fp64_masters_and_moments_in_every_tier():
    """fp64 is the equivalence tests' precision: the host masters of `--offload cpu` (copies
    forced, as on an accelerator) and the moments in memory or on disk, with or without
    ZeRO-Infinity, stay fp64 (they were fp32, or the fused kernel refused the mix), so every tier
    trains as the in-memory run does, bit for bit."""
    from strata.memory.offload import HostOffloadAdamW
    twin = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    assert HostOffloadAdamW([{"params": [twin]}], 1e-2, (0.9, 0.999), copy_on_cpu=True).masters[0].dtype == torch.float64
    common = {**BASE, "dtype": "fp64"}
    reference = train(train_config(**common), keep_state=True)
    for tiers in (dict(offload="cpu"), dict(offload="disk"), dict(offload_params="disk", offload="disk")):
        got = train(train_config(**common, **tiers), keep_state=True)
        assert got["losses"] == reference["losses"], tiers
        for name, value in reference["state"].items():
            assert torch.equal(got["state"][name], value), (tiers, name)
