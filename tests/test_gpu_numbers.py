"""The numbers a run reports on a GPU, tested on the CPU: which peak MFU divides by (the device
table's for a CUDA device it names, a measured matmul on the CPU, the flag above both), the
allocator's numbers in every record, and the device a Slurm task picks. torch.cuda's functions are
monkeypatched where a path needs a GPU; nothing asserts on a time."""

import json

import pytest
import torch

from strata.config import train_config
from strata.distributed import mesh
from strata.model.presets import get_preset
from strata.plan.hardware import DEVICES, device_for_cuda_name
from strata.train import metrics
from strata.train.trainer import train

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


# --- torch.cuda.get_device_name() -> the device table ---------------------------------------------
@pytest.mark.parametrize("name,entry", [
    ("NVIDIA H100 80GB HBM3", "H100-80G"),  # SXM5
    ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100-80G"),
    ("NVIDIA A100-SXM4-40GB", "A100-40G"),
    ("NVIDIA A100 80GB PCIe", "A100-80G"),  # the SXM4 peak
    ("NVIDIA A100-PCIE-40GB", "A100-40G"),
    ("NVIDIA A800-SXM4-80GB", "A800-80G"),
    ("Tesla V100-SXM2-32GB", "V100-32G"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    # other parts, with other peaks or memory: no entry, so no datasheet rate is borrowed
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA H100 NVL", "H100-NVL"),  # in the table since issue 54 (its own datasheet column)
    ("NVIDIA H200 NVL", None),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA H800", "H800"),
    ("NVIDIA H800 PCIe", None),
    ("Tesla V100-PCIE-32GB", None),
    ("Tesla V100-SXM2-16GB", None),
    ("NVIDIA L4", None),
    ("NVIDIA GeForce RTX 3090", None),
    # a MIG slice has a fraction of the device's rate
    ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", None),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
])
def test_cuda_device_names_match_the_table(name, entry):
    assert device_for_cuda_name(name) == entry


def test_every_table_device_has_a_name_that_matches_it():
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB",
             "NVIDIA A800-SXM4-80GB", "Tesla V100-SXM2-32GB", "NVIDIA GeForce RTX 4090", "NVIDIA H100 NVL",
             "NVIDIA H800", "NVIDIA H20", "NVIDIA B200", "AMD Instinct MI300X"]
    assert sorted(device_for_cuda_name(n) for n in names) == sorted(DEVICES)


# --- the peak MFU divides by ----------------------------------------------------------------------
@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda reporting a device of the given name; the measured peak a constant (no GPU to time)."""
    def use(name: str):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(metrics, "device_peak", lambda device, dtype_name: 123e12)
    return use


@pytest.mark.parametrize("dtype,rate", [("bf16", 989e12), ("fp16", 989e12), ("fp32", 67e12)])
def test_a_gpu_in_the_table_divides_by_its_datasheet_rate_for_the_dtype(fake_cuda, dtype, rate):
    fake_cuda("NVIDIA H100 80GB HBM3")
    assert metrics.mfu_peak(CUDA, dtype) == metrics.Peak(rate, "table:H100-80G")


def test_the_flag_wins_over_the_table_and_the_measurement(fake_cuda):
    fake_cuda("NVIDIA H100 80GB HBM3")
    assert metrics.mfu_peak(CUDA, "bf16", 5e14) == metrics.Peak(5e14, "flag")
    assert metrics.mfu_peak(CPU, "fp32", 5e14) == metrics.Peak(5e14, "flag")


@pytest.mark.parametrize("name,dtype,why", [
    ("NVIDIA L4", "bf16", "NVIDIA L4 is not in the device table"),
    ("NVIDIA H100 80GB HBM3", "fp64", "the device table has no fp64 rate for H100-80G"),
    ("Tesla V100-SXM2-32GB", "bf16", "the device table has no bf16 rate for V100-32G"),
])
def test_a_gpu_or_dtype_the_table_lacks_is_measured_and_says_why(fake_cuda, name, dtype, why):
    fake_cuda(name)
    peak = metrics.mfu_peak(CUDA, dtype)
    assert (peak.flops, peak.source) == (123e12, "measured") and peak.note.startswith(why)


def test_the_cpu_is_measured_without_a_note(fake_cuda):
    assert metrics.mfu_peak(CPU, "fp32") == metrics.Peak(123e12, "measured")


# --- the allocator's numbers --------------------------------------------------------------------
def test_a_cpu_has_no_allocator_numbers():
    assert metrics.AllocatorStats(CPU).read() == {"memory_reserved_bytes": None, "alloc_retries": None,
                                                  "largest_alloc_bytes": None}


def test_cuda_allocator_numbers_and_the_snapshot_read_only_after_a_cudamalloc(monkeypatch):
    stats = {"reserved_bytes.all.current": 0, "num_alloc_retries": 2, "num_device_alloc": 0}
    segments = []
    snapshots = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))

    def memory_snapshot(include_traces=True):
        snapshots.append(include_traces)
        return [dict(s) for s in segments]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", memory_snapshot)
    allocator = metrics.AllocatorStats(CUDA)  # 2 retries before the run: not the run's
    # step 1: two segments on this device, a larger one on another
    stats.update({"reserved_bytes.all.current": 60 << 20, "num_device_alloc": 2})
    segments[:] = [{"device": 0, "total_size": 20 << 20}, {"device": 0, "total_size": 40 << 20},
                   {"device": 1, "total_size": 1 << 30}]
    assert allocator.read() == {"memory_reserved_bytes": 60 << 20, "alloc_retries": 0, "largest_alloc_bytes": 40 << 20}
    assert snapshots == [False]  # without the allocation history's traces
    # step 2: no cudaMalloc, so no snapshot; a retry counted
    stats["num_alloc_retries"] = 3
    assert allocator.read()["alloc_retries"] == 1 and len(snapshots) == 1
    # step 3: the cache emptied and a smaller segment made: the run's largest stays
    stats["num_device_alloc"] = 3
    segments[:] = [{"device": 0, "total_size": 2 << 20}]
    assert allocator.read()["largest_alloc_bytes"] == 40 << 20 and len(snapshots) == 2


def test_a_torch_without_include_traces_reads_the_plain_snapshot(monkeypatch):
    def memory_snapshot():
        return [{"device": 0, "total_size": 6 << 20}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", memory_snapshot)
    assert metrics.largest_segment_bytes(CUDA) == 6 << 20


# --- the records of a run -------------------------------------------------------------------------
TINY = dict(model="tiny", seq_len=32, steps=2, micro_batch=1, global_batch=1, progress=False, eval_batches=1)


def test_a_cpu_run_records_its_measured_peak_and_no_allocator(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "device_peak", lambda device, dtype_name: 2.5e10)
    path = tmp_path / "metrics.jsonl"
    train(train_config(**TINY, metrics=str(path)))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert len(train_records) == 2
    flops_per_token = get_preset("tiny").flops_per_token(TINY["seq_len"])
    for r in train_records:
        assert r["peak_flops"] == 2.5e10 and r["peak_flops_source"] == "measured"
        assert r["memory_reserved_bytes"] is None and r["alloc_retries"] is None and r["largest_alloc_bytes"] is None
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops_per_token / r["peak_flops"], rel=1e-12)


def test_the_flag_is_the_records_peak():
    summary = train(train_config(**TINY, peak_flops=1e10))
    assert {(r["peak_flops"], r["peak_flops_source"]) for r in summary["records"]} == {(1e10, "flag")}


# --- the device a task picks ------------------------------------------------------------------------
@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda with `count` visible devices; returns the ordinals set_device was called with."""
    chosen = []

    def use(count: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(device))
        return chosen
    return use


@pytest.mark.parametrize("local_rank,visible,ordinal", [
    (3, 1, 0),  # Slurm --gpus-per-task=1: each task sees its one GPU as ordinal 0
    (3, 8, 3),  # torchrun on a node of 8: the local rank is the ordinal
    (5, 4, 1),  # 4 visible per task, 8 tasks on the node
    (0, 1, 0),
])
def test_the_device_is_the_local_rank_modulo_the_visible_devices(fake_gpus, monkeypatch, local_rank, visible, ordinal):
    chosen = fake_gpus(visible)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert mesh.pick_device("auto") == torch.device("cuda", ordinal) and chosen == [ordinal]


def test_the_cpu_choice_touches_no_gpu(fake_gpus, monkeypatch):
    chosen = fake_gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert mesh.pick_device("cpu") == CPU and chosen == []
