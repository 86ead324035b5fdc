"""The serving stack's fixed cost in `strata plan --inference` (strata/plan/inference.py): the term's
arithmetic on hand-computed numbers, its share of a token's time for a small model at batch 1 and
a 70B model at batch 64, the stacks' profiles, and how `strata calibrate --inference` measures it
(strata/tools/calibrate_inference.py)."""

import dataclasses
import json
from types import SimpleNamespace

import pytest

from strata.errors import ConfigError
from strata.model.presets import get_preset
from strata.plan.hardware import DEVICES, Device
from strata.plan.inference import STACKS, Overheads, Serving, estimate_serving, serving_layouts, stack_overheads
from strata.tools import calibrate_inference

from cli_runner import run_strata

LLAMA_1B = get_preset("llama-1b")  # 16 layers, tied embeddings: a step reads every parameter
NVLINK = 300e9


def one_ms_device(name: str = "test-1ms") -> Device:
    """A device that reads llama-1b's bf16 weights and its KV cache at 1 token in exactly 1 ms, with
    FLOPs too fast to count."""
    kv = 2 * 16 * 1 * 1 * 8 * 64 * 2  # keys and values, 16 layers, 8 KV heads of 64, 2 bytes
    return Device(name, 80 * 10**9, {"bf16": 1e24}, (2 * LLAMA_1B.num_params() + kv) / 1e-3, None)


def estimate(overheads: Overheads, device: Device | None = None, pp: int = 1):
    work = Serving(LLAMA_1B, batch=1, context=1, precision="bf16")
    return estimate_serving(work, device or one_ms_device(), 1, pp, NVLINK, 5e-6, overheads, efficiency=1.0)


# --- the term's arithmetic ----------------------------------------------------------------------
def test_host_bound_step_takes_the_layers_launches_plus_the_step():
    """16 layers x 100 us = 1.6 ms of launches against 1 ms of reads: the device waits for the host."""
    e = estimate(Overheads(100e-6, 50e-6, "test"))
    assert e.memory_s == pytest.approx(1e-3)
    assert e.token_latency_s == pytest.approx(1.6e-3 + 50e-6)
    assert e.overhead_s == pytest.approx(0.65e-3, rel=1e-6)  # on the path: 1.65 ms less the 1 ms bound
    assert e.fixed_s == pytest.approx(1.65e-3)
    assert e.bound_s == pytest.approx(1e-3, rel=1e-6)
    assert e.fixed_share == pytest.approx(0.65 / 1.65, rel=1e-6)


def test_device_bound_step_hides_the_launches_and_adds_the_step():
    """16 x 25 us = 0.4 ms of launches run ahead of 1 ms of reads: only the step's 50 us shows."""
    e = estimate(Overheads(25e-6, 50e-6, "test"))
    assert e.token_latency_s == pytest.approx(1.05e-3)
    assert e.overhead_s == pytest.approx(50e-6, rel=1e-5)
    assert e.fixed_s == pytest.approx(0.45e-3)
    assert e.fixed_share == pytest.approx(0.05 / 1.05, rel=1e-5)


def test_costs_on_the_device_timeline_and_on_a_cpu_add():
    graph = Overheads(100e-6, 50e-6, "test", per_layer_on_host=False)  # a CUDA graph's gaps
    assert estimate(graph).token_latency_s == pytest.approx(1e-3 + 1.6e-3 + 50e-6)
    assert estimate(graph).overhead_s == pytest.approx(1.65e-3, rel=1e-6)
    # cpu-local: the cores that read the weights also run the host's Python: nothing overlaps
    cpu = estimate(Overheads(100e-6, 50e-6, "test"), one_ms_device("cpu-local"))
    assert cpu.token_latency_s == pytest.approx(2.65e-3)


def test_pipeline_stages_pay_their_layers_one_after_another():
    e = estimate(Overheads(100e-6, 50e-6, "test"), pp=2)
    assert e.pp_comm_s == pytest.approx(5e-6 + 2048 * 2 / NVLINK)  # one send of d x 2 bytes
    assert e.fixed_s == pytest.approx(16 * 100e-6 + 50e-6)  # 8 layers on each stage
    assert e.token_latency_s == pytest.approx(max(1e-3 + e.pp_comm_s, 1.6e-3) + 50e-6)


# --- whom it matters to ---------------------------------------------------------------------------
def best(model: str, device: str, devices: int, batch: int, context: int, overheads: Overheads):
    work = Serving(get_preset(model), batch, context, "bf16")
    return serving_layouts(work, DEVICES[device], devices, NVLINK, 5e-6, overheads)[0]


def test_fixed_cost_dominates_a_1b_model_at_batch_1_not_a_70b_model_at_batch_64():
    """strata's eager profile: llama-1b reads 2.5 GB a token (0.74 ms on an H100) against 16 layers
    of launches (3.5 ms); llama-70b at batch 64 on 8 A100s reads 17.2 GB of weights and 5.4 GB of
    cache per device (11.1 ms) and spends 5.8 ms in all-reduces, behind which 80 layers of launches
    (17.6 ms) mostly hide."""
    small = best("llama-1b", "H100-80G", 1, 1, 512, Overheads())
    assert small.bound_s == pytest.approx(2 * LLAMA_1B.num_params() / DEVICES["H100-80G"].memory_bandwidth, rel=0.02)
    assert small.token_latency_s == pytest.approx(16 * 220e-6 + 150e-6)  # host-bound
    assert small.fixed_share > 0.75
    large = best("llama-70b", "A100-80G", 8, 64, 2048, Overheads())
    assert (large.tp, large.pp) == (8, 1) and large.fits
    assert large.fixed_share < 0.1
    for stack in STACKS:  # the order holds for every stack
        small, large = (best("llama-1b", "H100-80G", 1, 1, 512, STACKS[stack]),
                        best("llama-70b", "A100-80G", 8, 64, 2048, STACKS[stack]))
        assert small.fixed_share > 0.35 > 0.1 > large.fixed_share, stack


# --- the stacks' profiles -------------------------------------------------------------------------
def test_profiles_differ_as_documented():
    assert list(STACKS) == ["strata", "hf-transformers", "vllm"]
    strata, hf, vllm = STACKS["strata"], STACKS["hf-transformers"], STACKS["vllm"]
    assert Overheads() == strata and strata.per_token_s == strata.per_step_s == 150e-6
    assert (hf.per_layer_s, strata.per_layer_s, vllm.per_layer_s) == (300e-6, 220e-6, 10e-6)
    assert (hf.per_step_s, vllm.per_step_s, strata.per_step_s) == (450e-6, 300e-6, 150e-6)
    assert strata.per_layer_on_host and hf.per_layer_on_host and not vllm.per_layer_on_host
    assert all("estimate" in o.source for o in STACKS.values())
    latency = {name: best("llama-1b", "H100-80G", 1, 1, 512, o).token_latency_s for name, o in STACKS.items()}
    assert latency["hf-transformers"] > latency["strata"] > latency["vllm"]
    bound = best("llama-1b", "H100-80G", 1, 1, 512, vllm).bound_s
    assert latency["vllm"] == pytest.approx(bound + 16 * 10e-6 + 300e-6)  # a graph's gaps add to the reads


def test_a_calibration_replaces_strata_s_profile_only():
    measured = {"device": "NVIDIA H100 80GB HBM3", "per_layer_s": 180e-6, "per_token_s": 90e-6}
    assert stack_overheads("strata", measured) == Overheads(180e-6, 90e-6, "calibrated on NVIDIA H100 80GB HBM3", True)
    cpu = stack_overheads("strata", {**measured, "device": "cpu"})
    assert not cpu.per_layer_on_host  # written before the key existed: a CPU's own cores do both
    assert stack_overheads("strata", {**measured, "per_layer_on_host": False}).per_layer_on_host is False
    assert stack_overheads("vllm", measured) == STACKS["vllm"]  # calibration times strata's loop
    with pytest.raises(ConfigError, match="--serving-stack tgi: valid: strata, hf-transformers, vllm"):
        stack_overheads("tgi")


def test_plan_output_shows_the_share_of_fixed_cost():
    e = best("llama-1b", "H100-80G", 1, 1, 512, Overheads())
    args = ("plan", "--inference", "--model", "llama-1b", "--device", "H100-80G", "--gpus-per-node", 1,
            "--precision", "bf16", "--context", 512)
    result = run_strata(*args, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "220 us per layer + 150 us per step (strata eager (estimate, uncalibrated)" in result.stdout
    assert (f"the stack's fixed cost is {e.fixed_share:.0%} of it ({e.overhead_s * 1e3:.2f} ms): bytes, FLOPs and "
            f"links alone take {e.bound_s * 1e3:.2f} ms") in result.stdout
    report = json.loads(run_strata(*args, "--json", timeout=300).stdout)
    assert report["overheads"]["per_step_s"] == report["overheads"]["per_token_s"] == 150e-6
    assert report["layouts"][0]["fixed_share"] == pytest.approx(e.fixed_share)


# --- calibration -------------------------------------------------------------------------------
def test_calibration_times_the_models_round_by_round(monkeypatch):
    calls = []
    monkeypatch.setattr(calibrate_inference, "_one_decode",
                        lambda model, tokens: calls.append(model) or {"a": 1.0, "b": 2.0, "c": 3.0}[model] * len(calls))
    seconds = calibrate_inference.interleaved_decode_seconds(["a", "b", "c"], rounds=2)
    assert calls == ["a", "b", "c"] * 3  # a warm-up round, then two, each model once a round
    assert seconds == [(4 + 7) / 2, 2 * (5 + 8) / 2, 3 * (6 + 9) / 2]  # the warm-up round left out


def test_calibration_reads_the_per_layer_cost_at_the_narrowest_width(monkeypatch):
    """Synthetic decode times: 300 us per layer and 100 us per step, layers of 128 and 512 wide
    streamed from a cache at 40 GB/s and of 1024 wide from memory at 10 GB/s. The line through
    all three has a negative intercept (what calibration used to take, clamped to 0); the
    narrowest width's own layer time less its bytes over the fitted bandwidth reproduces that
    width exactly under the planner's sum."""
    def seconds(models):
        return [100e-6 + m.cfg.n_layers * (300e-6 + layer_bytes(m.cfg) / (40e9 if m.cfg.d_model < 1024 else 10e9))
                for m in models]

    def layer_bytes(cfg):
        return 4 * (dataclasses.replace(cfg, n_layers=2).num_params() - dataclasses.replace(cfg, n_layers=1).num_params())

    monkeypatch.setattr(calibrate_inference, "build_model", lambda cfg, *a, **k: SimpleNamespace(cfg=cfg))
    monkeypatch.setattr(calibrate_inference, "interleaved_decode_seconds", seconds)
    monkeypatch.setattr(calibrate_inference, "decode_bandwidth", lambda *a: {"1": 1.0, "32": 1.0})
    monkeypatch.setattr(calibrate_inference, "device_matmul_rate", lambda *a: 1.0)
    import torch
    measured = calibrate_inference.inference_overheads(torch.device("cpu"))
    narrow = measured["points"]["128"]
    assert narrow["layer_bytes"] == 656_384
    assert narrow["layer_s"] == pytest.approx(300e-6 + 656_384 / 40e9)
    assert measured["per_layer_s"] + narrow["layer_bytes"] / measured["memory_bandwidth"] == pytest.approx(narrow["layer_s"])
    assert measured["per_layer_s"] == pytest.approx(246e-6, rel=0.01)
    assert measured["per_token_s"] == pytest.approx(100e-6)
    assert measured["per_layer_on_host"] is False
