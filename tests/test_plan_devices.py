"""The planner's devices (issue 54, item 5): the datasheet entries, FP8 matmuls and power caps.

Counted quantities only: each entry's datasheet figures; FP8 changing the blocks' GEMM seconds by
the ratio of the two peaks' saturated rates and nothing else; a power cap's clock factor slowing
what the compute clock sets and nothing that the memory's rate does."""

from __future__ import annotations

import dataclasses

import pytest

from strata.errors import ConfigError
from strata.model.presets import get_preset
from strata.plan.compute import StepWork, block_gemm_seconds, unit_seconds
from strata.plan.cost import estimate
from strata.plan.hardware import DEVICES, GB, LINKS, SUSTAINED_CLOCK_GH100, device_for_cuda_name, power_clock_factor
from strata.plan.inputs import build_cluster, check_fp8, workload
from strata.plan.report import parse_layout

T = 1e12

# name: (memory GB, bf16 TFLOP/s, fp8 TFLOP/s or None, fp32 TFLOP/s, HBM GB/s, NVLink GB/s per direction)
# from the datasheets named in strata/plan/hardware.py (a "with sparsity" figure halved)
DATASHEETS = {
    "H100-80G": (80, 989, 1979, 67, 3350, 450),
    "H800": (80, 989, 1979, 67, 3350, 200),
    "H100-NVL": (94, 835, 1670, 60, 3900, 300),
    "H20": (96, 148, 296, 44, 4000, 450),
    "H200": (141, 989, 1979, 67, 4800, 450),
    "B200": (180, 2250, 4500, 80, 8000, 900),
    "MI300X": (192, 1307.4, 2614.9, 163.4, 5300, 448),
    "A100-80G": (80, 312, None, 19.5, 2039, 300),
}


@pytest.mark.parametrize("name", DATASHEETS)
def test_each_device_carries_its_datasheet(name):
    memory, bf16, fp8, fp32, hbm, nvlink = DATASHEETS[name]
    d = DEVICES[name]
    assert d.memory_bytes == memory * GB
    assert d.peak_flops["bf16"] == d.peak_flops["fp16"] == bf16 * T and d.peak_flops["fp32"] == fp32 * T
    assert d.fp8_flops == (None if fp8 is None else fp8 * T)
    assert (d.kernels.fp8_gemm_fraction is None) == (fp8 is None)
    assert d.memory_bandwidth == hbm * GB and d.nvlink_bandwidth == nvlink * GB


def test_h800_is_an_h100_with_less_nvlink():
    """Everything but the name and the NVLink (400 GB/s both ways against 900) is the H100's; a
    tensor-parallel layout computes alike and communicates longer."""
    h100, h800 = DEVICES["H100-80G"], DEVICES["H800"]
    differ = {f.name for f in dataclasses.fields(h100) if getattr(h100, f.name) != getattr(h800, f.name)}
    assert differ == {"name", "nvlink_bandwidth"}
    work = workload(get_preset("llama3-8b"), 64, 4096, "bf16")
    by = {}
    for name in ("H100-80G", "H800"):
        cluster = build_cluster(name, 1, 8, None, "ib-400")
        by[name] = estimate(work, cluster, parse_layout("tp=8,mb=1,sp", work, cluster.world))
    assert by["H800"].compute_s == by["H100-80G"].compute_s
    assert by["H800"].comm_seconds["tp"] > by["H100-80G"].comm_seconds["tp"]


@pytest.mark.parametrize("cuda_name,entry", [
    ("NVIDIA H100 80GB HBM3", "H100-80G"), ("NVIDIA H100 NVL", "H100-NVL"), ("NVIDIA H800", "H800"),
    ("NVIDIA H20", "H20"), ("NVIDIA H200", "H200"), ("NVIDIA B200", "B200"), ("AMD Instinct MI300X", "MI300X"),
    ("AMD Instinct MI300X VF", "MI300X"), ("NVIDIA H100 PCIe", None), ("NVIDIA H800 PCIe", None),
])
def test_cuda_names_find_their_entry_and_no_other(cuda_name, entry):
    assert device_for_cuda_name(cuda_name) == entry


def test_h100_nvl_defaults_to_nvlink_only_where_its_bridges_reach():
    """H100 NVL's bridges join pairs: two devices a node talk over NVLink, eight over PCIe."""
    assert build_cluster("H100-NVL", 1, 2, None, "ib-400").intra_bandwidth == 300 * GB
    assert build_cluster("H100-NVL", 1, 8, None, "ib-400").intra_bandwidth == LINKS["pcie"]
    assert build_cluster("H100-80G", 1, 8, None, "ib-400").intra_bandwidth == 450 * GB


# --- FP8 ---------------------------------------------------------------------------------------------
def _work(model="llama3-8b", tokens=8192, tp=1):
    cfg = get_preset(model)
    return StepWork(cfg, tokens, 1, tokens, tp, False, True, 2)


def test_fp8_changes_the_blocks_gemms_by_the_ratio_of_the_saturated_rates():
    """A large GEMM, compute-bound in both: its seconds beyond the fixed cost go as the 16-bit
    peak x its curve's saturation over the FP8 peak x the FP8 curve's (H100: 989 x 0.801 against
    1979 x 0.709)."""
    d = DEVICES["H100-80G"]
    k = d.kernels
    m, n, kk = 8192, 14336, 4096
    bf16 = k.gemm_seconds(m, n, kk, d.peak_flops["bf16"], d.memory_bandwidth, 2) - k.gemm_overhead_s
    fp8 = k.fp8().gemm_seconds(m, n, kk, d.fp8_flops, d.memory_bandwidth, 1) - k.gemm_overhead_s
    assert fp8 / bf16 == pytest.approx(989 * 0.801 / (1979 * 0.709), rel=1e-12)


def test_fp8_changes_only_the_blocks_gemm_seconds():
    d = DEVICES["H100-80G"]
    w = _work()
    args = (w, d.kernels, d.peak_flops["bf16"], d.memory_bandwidth)
    embedding, block, head = unit_seconds(*args)
    embedding8, block8, head8 = unit_seconds(*args, fp8_peak=d.fp8_flops)
    gained = block_gemm_seconds(*args) - block_gemm_seconds(*args, fp8_peak=d.fp8_flops)
    assert gained > 0.4 * block_gemm_seconds(*args)
    assert (embedding8, head8) == (embedding, head)
    assert block8.attention_forward == block.attention_forward
    assert block.forward - block8.forward == pytest.approx(gained, rel=1e-12)
    assert block.backward - block8.backward == pytest.approx(2 * gained, rel=1e-12)


def test_fp8_leaves_memory_and_communication_as_they_are():
    bf16 = workload(get_preset("llama3-8b"), 64, 4096, "bf16")
    fp8 = workload(get_preset("llama3-8b"), 64, 4096, "bf16", fp8=True)
    cluster = build_cluster("H100-80G", 2, 8, None, "ib-400", 8)
    plain, fast = (estimate(w, cluster, parse_layout("dp=4,tp=4,mb=1,sp", w, cluster.world)) for w in (bf16, fp8))
    assert fast.memory_breakdown == plain.memory_breakdown and fast.comm_bytes == plain.comm_bytes
    assert fast.compute_s < plain.compute_s and fast.tokens_per_s > plain.tokens_per_s
    assert fast.mfu > plain.mfu  # MFU stays over the 16-bit peak, as published FP8 runs report it


def test_fp8_is_refused_where_it_cannot_be_priced():
    with pytest.raises(ConfigError, match=r"--fp8: the A100-80G has no FP8 matrix units; valid devices: H100-80G, H800"):
        check_fp8(DEVICES["A100-80G"], "bf16")
    with pytest.raises(ConfigError, match="--fp8: FP8 matmuls in a bf16 or fp16 run"):
        check_fp8(DEVICES["H100-80G"], "fp32")
    check_fp8(DEVICES["B200"], "bf16")


# --- power caps ----------------------------------------------------------------------------------------
def test_a_power_cap_is_a_cube_root_clock_factor():
    h100 = DEVICES["H100-80G"]
    assert power_clock_factor(h100, 700) == 1.0
    assert power_clock_factor(h100, 350) == pytest.approx(0.5 ** (1 / 3), rel=1e-12)
    capped = build_cluster("H100-80G", 1, 8, None, "ib-400", power_cap=350).device
    # below the clock the H100 holds at its 700 W limit (its sustained clock), not the boost clock
    assert capped.kernels.clock_factor == pytest.approx(SUSTAINED_CLOCK_GH100 * 0.5 ** (1 / 3), rel=1e-12)
    assert dataclasses.replace(capped, kernels=h100.kernels) == h100  # nothing else changes


def test_a_gh100_runs_at_its_sustained_clock_and_an_a100_at_its_own():
    """The H100, H800 and H200 price their GEMMs and fused attention at the clock a 700 W board holds
    through a run (Bekman's H200: 708.5 of 841.9 TFLOP/s), the A100 at the clock its fractions were
    measured at; a 700 W cap changes nothing."""
    assert SUSTAINED_CLOCK_GH100 == pytest.approx(708.5 / 841.9)
    for name in ("H100-80G", "H800", "H200"):
        assert DEVICES[name].kernels.clock_factor == SUSTAINED_CLOCK_GH100
    assert DEVICES["A100-80G"].kernels.clock_factor == 1.0
    uncapped = build_cluster("H100-80G", 1, 8, None, "ib-400", power_cap=700).device
    assert uncapped.kernels.clock_factor == SUSTAINED_CLOCK_GH100


def test_a_power_cap_slows_the_compute_clock_and_not_the_memory():
    """A compute-bound GEMM's FLOPs and fused attention take 1/factor as long; an elementwise
    kernel (the embedding unit) and a memory-bound GEMM do not change."""
    h100 = DEVICES["H100-80G"]
    capped = build_cluster("H100-80G", 1, 8, None, "ib-400", power_cap=350).device
    factor = capped.kernels.clock_factor / h100.kernels.clock_factor
    w = _work()
    plain = unit_seconds(w, h100.kernels, h100.peak_flops["bf16"], h100.memory_bandwidth)
    slow = unit_seconds(w, capped.kernels, h100.peak_flops["bf16"], h100.memory_bandwidth)
    assert slow[0] == plain[0]
    assert slow[1].attention_forward == pytest.approx(plain[1].attention_forward / factor, rel=1e-12)
    k, kc = h100.kernels, capped.kernels
    big = (8192, 14336, 4096, h100.peak_flops["bf16"], h100.memory_bandwidth, 2)
    assert kc.gemm_seconds(*big) - kc.gemm_overhead_s == pytest.approx((k.gemm_seconds(*big) - k.gemm_overhead_s)
                                                                        / factor, rel=1e-12)
    thin = (1, 14336, 4096, h100.peak_flops["bf16"], h100.memory_bandwidth, 2)  # a decode-like GEMV
    assert kc.gemm_seconds(*thin) == k.gemm_seconds(*thin)


def test_a_power_cap_outside_the_devices_range_is_refused():
    with pytest.raises(ConfigError, match="--power-cap 100: the H100-80G takes 200 to 700 W"):
        build_cluster("H100-80G", 1, 8, None, "ib-400", power_cap=100)
    with pytest.raises(ConfigError, match="--power-cap 800: the H100-80G takes 200 to 700 W"):
        build_cluster("H100-80G", 1, 8, None, "ib-400", power_cap=800)
    with pytest.raises(ConfigError, match="--power-cap 500: the table has no power range for the B200; valid with: "
                                          "A100-40G"):
        build_cluster("B200", 1, 8, None, "ib-400", power_cap=500)
    with pytest.raises(ConfigError, match="--power-cap 50: a GPU's; cpu-local"):
        build_cluster("cpu-local", 1, 2, None, "ib-400", power_cap=50)
