"""The planner against the field's rules of thumb and published results (shared/REFERENCE.md),
and `strata plan` as a user types it."""

import json

import pytest

from strata.cli import main as strata_main
from strata.model.config import ModelConfig
from strata.model.presets import get_preset
from strata.plan.cost import estimate
from strata.plan.hardware import DEVICES
from strata.plan.inputs import build_cluster, workload
from strata.plan.search import explain, search
from strata.rules.layout import Layout

GB = 10**9


def _selene(nodes):
    """Megatron-LM's cluster: DGX A100 80 GB nodes, NVLink inside, 8 x HDR InfiniBand per node."""
    return build_cluster("A100-80G", nodes, 8, "nvlink", "ib-200", nics_per_node=8)


# --- published results: Narayanan et al. 2021 ------------------------------------------------------
MEGATRON_1T = ModelConfig(vocab_size=51200, n_layers=128, d_model=25600, n_heads=160, d_ff=4 * 25600,
                          max_seq_len=2048, norm="layernorm", position="learned", mlp="gelu",
                          tie_embeddings=True, bias=True)
# Megatron-LM's 2021 runs trained in fp16 and all-reduced 16-bit gradients (its fp32 accumulation
# and reduction were an option, off by default): 2 bytes per element, reduce=bf16 in strata's terms.
PUBLISHED = {  # name: (model, nodes, global batch, the paper's layout, TFLOP/s per GPU)
    "gpt3-175b on 1024 A100": (get_preset("gpt3-175b"), 128, 1536,
                               Layout(dp=8, tp=8, pp=16, checkpointing="full", reduce_dtype="bf16"), 140),
    "1T on 3072 A100": (MEGATRON_1T, 384, 3072, Layout(dp=6, tp=8, pp=64, checkpointing="full", reduce_dtype="bf16"),
                        163),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_megatron_throughput_is_predicted_within_15_percent(name):
    model, nodes, batch, layout, tflops = PUBLISHED[name]
    e = estimate(workload(model, batch, 2048, "bf16"), _selene(nodes), layout)
    assert e.fits
    assert e.tflops_per_device == pytest.approx(tflops, rel=0.15), e.tflops_per_device


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_planners_own_layout_is_no_worse_than_the_published_one(name):
    model, nodes, batch, layout, _ = PUBLISHED[name]
    work, cluster = workload(model, batch, 2048, "bf16"), _selene(nodes)
    ranked, _ = search(work, cluster, offload=False)
    assert ranked[0].step_time_s <= estimate(work, cluster, layout).step_time_s


# --- rules of thumb -------------------------------------------------------------------------------
def test_full_fine_tuning_of_an_n_billion_model_needs_about_20n_gb():
    model = get_preset("llama-7b")
    n = model.num_params() / 1e9
    e = estimate(workload(model, 1, 2048, "bf16"), build_cluster("A100-80G", 1, 1, None, "ib-200"), Layout())
    assert 16 * n * GB < e.memory_bytes_per_device < 24 * n * GB


def test_zero3_moves_3_psi_and_on_10_gbe_the_planner_refuses_it():
    model = get_preset("llama-65b")
    work, cluster = workload(model, 64, 2048, "bf16"), build_cluster("A100-80G", 8, 8, None, "10gbe")
    e = estimate(work, cluster, Layout(dp=64, zero=3, reduce_dtype="bf16", gather_dtype="bf16"))  # one micro-batch
    elements = e.comm_bytes["dp"] / 2  # bf16
    assert elements == pytest.approx(3 * model.num_params() * 63 / 64, rel=1e-6)
    # strata's defaults move fp32 (the masters): twice the bytes; bf16 gathers alone (FSDP2 mixed policy): 4/3
    assert estimate(work, cluster, Layout(dp=64, zero=3)).comm_bytes["dp"] == pytest.approx(2 * e.comm_bytes["dp"])
    gathers = estimate(work, cluster, Layout(dp=64, zero=3, gather_dtype="bf16")).comm_bytes["dp"]
    assert gathers == pytest.approx(4 / 3 * e.comm_bytes["dp"])
    assert elements == pytest.approx(195e9, rel=0.03)  # "65B: 195 G elements"
    assert e.comm_seconds["dp"] > 120  # minutes per step on 10 Gb/s
    ranked, rejected = search(work, cluster)
    # (ZeRO-3 within a pipeline stage moves a stage's share, over a few ranks: it may rank)
    assert all(r.layout.zero != 3 or r.layout.pp > 1 for r in ranked)
    assert any(n.startswith("refused: communication alone takes") for r in rejected if r.layout.zero == 3 for n in r.notes)


def test_tensor_parallelism_across_nodes_drops_utilisation_to_a_few_percent():
    work = workload(get_preset("llama-13b"), 256, 2048, "bf16")
    cluster = build_cluster("A100-80G", 2, 8, None, "100gbe")
    inside = estimate(work, cluster, Layout(dp=2, tp=8, checkpointing="full"))
    across = estimate(work, cluster, Layout(dp=1, tp=16, checkpointing="full"))
    assert across.mfu < 0.1 and inside.mfu > 3 * across.mfu, (inside.mfu, across.mfu)


def test_without_nvlink_the_planner_prefers_pipeline_over_tensor_parallelism():
    """The same 8 A100-40G and model: over PCIe the planner pipelines, over NVLink it splits tensors.
    (128 sequences a step: at 64, the pipeline's once-a-step fp32 gradient reduction over PCIe
    brings dp2 x pp4 within 1% of tp2 x pp4.)"""
    work = workload(get_preset("llama-13b"), 128, 2048, "bf16")
    best_by_link = {}
    for link in ("pcie", "nvlink"):
        cluster = build_cluster("A100-40G", 1, 8, link, "10gbe")
        ranked, rejected = search(work, cluster)
        with_tp = next(e for e in ranked if e.layout.tp > 1)
        pipelined = next(e for e in ranked if e.layout.pp > 1 and e.layout.tp == 1)
        best_by_link[link] = (ranked[0], with_tp, pipelined, explain(ranked[0], ranked, rejected, cluster))
    best, with_tp, pipelined, lines = best_by_link["pcie"]
    assert best.layout.pp > 1 and best.layout.tp == 1, best.layout
    assert with_tp.step_time_s > pipelined.step_time_s
    assert any("tensor parallelism over 32 GB/s inside a node (no NVLink)" in line for line in lines), lines
    best, with_tp, pipelined, _ = best_by_link["nvlink"]
    assert best.layout.tp > 1 and with_tp.step_time_s < pipelined.step_time_s, best.layout


def test_slow_network_and_little_memory_give_dp_pp_tp_and_zero1():
    work = workload(get_preset("llama-13b"), 256, 2048, "bf16")
    cluster = build_cluster("A100-40G", 4, 8, None, "10gbe")
    best = search(work, cluster)[0][0].layout
    assert best.dp > 1 and best.pp > 1 and best.tp > 1 and best.zero == 1, best


# --- the command ------------------------------------------------------------------------------------
def test_plan_json_lists_layouts_best_first_with_every_field(capsys):
    assert strata_main(["plan", "--model", "llama-7b", "--device", "H100-80G", "--nodes", "2", "--global-batch", "64",
                        "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = out["layouts"]
    assert len(layouts) == 3
    assert [x["step_time_s"] for x in layouts] == sorted(x["step_time_s"] for x in layouts)
    for key in ("dp", "tp", "pp", "virtual_stages", "zero", "micro_batch", "checkpointing", "offload", "fits",
                "memory_bytes_per_device", "memory_breakdown", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"):
        assert key in layouts[0], key
    assert set(layouts[0]["memory_breakdown"]) == {"weights", "gradients", "optimizer_states", "activations", "buffers"}
    assert layouts[0]["dp"] * layouts[0]["tp"] * layouts[0]["pp"] == 16


def test_plan_evaluates_a_given_layout_explains_and_draws(capsys, tmp_path):
    assert strata_main(["plan", "--model", "gpt3-175b", "--nodes", "128", "--nics-per-node", "8", "--global-batch",
                        "1536", "--seq-len", "2048", "--layout", "dp=8,tp=8,pp=16,mb=1,ckpt=full", "--explain",
                        "--chart", str(tmp_path / "m.png")]) == 0
    out = capsys.readouterr().out
    assert "dp=8,tp=8,pp=16,zero=0,mb=1,1f1b,ckpt=full" in out and "best:" in out
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_plan_reads_a_hugging_face_config(tmp_path, capsys):
    config = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert strata_main(["plan", "--model", str(tmp_path / "config.json"), "--global-batch", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layouts"][0]["fits"]


@pytest.mark.parametrize("args,message", [
    (["--model", "nope"], "not a preset"),
    (["--model", "tiny", "--device", "Z80"], "--device Z80: valid"),
    (["--model", "tiny", "--network", "carrier-pigeon"], "--network carrier-pigeon: valid"),
    (["--model", "tiny", "--device", "RTX-4090", "--intra", "nvlink"], "has no NVLink"),
    (["--model", "tiny", "--layout", "dp=3,tp=2"], "the world size is 8; the product must equal it"),
    (["--model", "tiny", "--layout", "dp=8,zero=7"], "--layout dp=8,zero=7: zero=7: valid: 0, 1, 2, 3"),
    (["--model", "gpt3-175b", "--gpus-per-node", "1"], "no layout of 1 x A100-80G runs gpt3-175b"),
])
def test_plan_bad_input_gets_one_line(args, message, capsys):
    assert strata_main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


# --- calibration and --parallel auto --------------------------------------------------------------
def test_calibrate_then_train_with_the_planners_layout(tmp_path, capsys):
    """`strata calibrate` writes the cpu-local profile; `--parallel auto` runs the planner's best
    layout for it, says which and why, and trains."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "STRATA_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = lambda *args: subprocess.run([sys.executable, "-m", "strata", *args], env=env, capture_output=True,  # noqa: E731
                                       text=True, timeout=300)
    calibrated = run("calibrate", "--nproc", "2", "--model", "tiny", "--quick")  # one round, short timings
    assert calibrated.returncode == 0, calibrated.stdout + calibrated.stderr
    profile = json.loads((tmp_path / "calibration.json").read_text())
    assert set(profile["matmul_flops"]) == {"1", "2"} and "2/2" in profile["collectives"]["all_reduce"]
    trained = run("train", "--parallel", "auto", "--nproc", "2", "--model", "tiny", "--steps", "3",
                  "--global-batch", "8", "--no-progress")
    assert trained.returncode == 0, trained.stderr[-3000:]
    chose = next(line for line in trained.stderr.splitlines() if line.startswith("--parallel auto chose"))
    assert "for 2 x cpu-local" in chose and "per step" in chose and "of the step (the parts add up to it): compute" in chose, chose
    assert "validation loss" in trained.stdout
    # refused before anything runs: in this process (a subprocess would spend its time importing)
    assert strata_main(["train", "--parallel", "auto", "--nproc", "2", "--model", "tiny", "--tp", "2"]) == 2
    assert "--parallel auto chooses the layout; drop --tp" in capsys.readouterr().err


@pytest.mark.parametrize("preset,nodes", [("llama3-8b", 1), ("gpt2-1.5b", 1), ("gemma-7b", 2), ("llama-65b", 4)])
def test_mfu_never_exceeds_the_efficiency_and_the_shares_add_up_over_the_search_space(preset, nodes):
    """Model FLOPs are the matmuls the compute time is made of (no embedding lookup), and nothing
    runs faster than peak x efficiency: no layout the search offers claims more. The step's parts
    (compute, exposed communication by group, bubble, optimizer) add up to it."""
    model = get_preset(preset)
    work, cluster = workload(model, 64, min(2048, model.max_seq_len), "bf16"), _selene(nodes)
    ranked, rejected = search(work, cluster, offload=False)
    assert ranked
    for e in ranked + rejected:
        assert e.mfu <= e.kernel_ceiling * (1 + 1e-9), (e.layout.describe(), e.mfu, e.kernel_ceiling)
        assert sum(e.shares().values()) == pytest.approx(1.0, rel=1e-9), e.layout.describe()
        assert all(e.exposed_comm_s[g] <= e.comm_seconds[g] * (1 + 1e-9) for g in e.comm_seconds)


# --- compute from the work's shapes (strata/plan/compute.py) ---------------------------------------
def test_the_gemm_efficiency_curve_rises_with_the_work_and_saturates_at_the_devices_fraction():
    device = DEVICES["A100-80G"]
    k, peak, bandwidth = device.kernels, device.peak_flops["bf16"], device.memory_bandwidth
    sizes = [64, 256, 1024, 4096, 16384]
    curve = [k.gemm_efficiency(m, 4096, 4096, peak, bandwidth, 2) for m in sizes]
    assert curve == sorted(curve) and curve[0] < 0.5 * k.gemm_fraction
    assert k.gemm_fraction * 0.97 < curve[-1] < k.gemm_fraction


def test_small_micro_batches_and_tensor_parallel_splits_run_below_the_large_ones():
    """The same tokens per step take longer in micro-batches of one sequence, and a tensor-parallel
    split shrinks every GEMM's n or k: the step's MFU falls, as published runs show (Narayanan et
    al. 2021: 44% at 1.7B with t 1, where one constant gave every layout the same)."""
    work = workload(get_preset("llama3-8b"), 64, 2048, "bf16")
    cluster = _selene(1)
    big = estimate(work, cluster, Layout(dp=8, zero=1, micro_batch=4, checkpointing="full"))
    small = estimate(work, cluster, Layout(dp=8, zero=1, micro_batch=1, checkpointing="full"))
    split = estimate(work, cluster, Layout(dp=1, tp=8, micro_batch=4, checkpointing="full"))
    assert big.compute_s < small.compute_s and big.mfu > small.mfu
    assert split.kernel_ceiling < big.kernel_ceiling


def test_sequence_parallelism_saves_the_elementwise_work_tensor_parallel_ranks_repeat():
    work = workload(get_preset("llama3-8b"), 8, 2048, "bf16")
    cluster = _selene(1)
    plain = estimate(work, cluster, Layout(tp=8, micro_batch=1, checkpointing="selective"))
    sp = estimate(work, cluster, Layout(tp=8, micro_batch=1, checkpointing="selective", sequence_parallel=True))
    assert sp.compute_s < plain.compute_s


def test_unfused_attention_costs_more_than_fused_and_more_so_with_longer_sequences():
    """Unfused, the b·a·s² scores go through memory between two batched GEMMs: the cost grows
    with the sequence faster than the fused kernel's."""
    from dataclasses import replace
    cluster, layout = _selene(1), Layout(tp=8, micro_batch=1, checkpointing="full")
    ratios = []
    for seq in (2048, 8192):
        work = workload(get_preset("llama3-8b"), 8, seq, "bf16")
        fused = estimate(work, cluster, layout)
        ratios.append(estimate(replace(work, fused_attention=False), cluster, layout).compute_s / fused.compute_s)
    assert 1 < ratios[0] < ratios[1], ratios


def test_a_calibration_profile_from_before_the_kernel_measurements_is_refused_in_one_line(tmp_path, capsys):
    old = {"cores": 2, "memory_bytes": 2**34, "memory_bandwidth": 1e10, "matmul_flops": {"1": 1e11},
           "collectives": {}, "efficiency": 0.7, "efficiency_by_tokens": {"128": 0.7}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert strata_main(["plan", "--model", "tiny", "--device", "cpu-local", "--gpus-per-node", "1",
                        "--profile", str(tmp_path / "old.json")]) == 2
    err = capsys.readouterr().err
    assert "predates the kernel measurements; run `strata calibrate` again" in err and "Traceback" not in err


def test_gradient_passes_are_priced_per_micro_batch_as_the_runtime_makes_them():
    """ZeRO-0/1 add each micro-batch's fp32 gradients after the first into the accumulated ones
    (3 passes over them); Megatron's fused accumulation makes none; ZeRO-2/3 stage every
    micro-batch's full gradients and add the reduced shard."""
    from dataclasses import replace

    from strata.plan.data_parallel import gradient_pass_seconds
    cluster = _selene(1)
    params, bandwidth = 1e9, cluster.device.memory_bandwidth
    for m in (1, 8):
        assert gradient_pass_seconds(cluster, Layout(dp=8), params, m, False) == \
            pytest.approx((m - 1) * 12 * params / bandwidth)
        assert gradient_pass_seconds(cluster, Layout(dp=8), params, m, True) == 0
        assert gradient_pass_seconds(cluster, Layout(dp=8, zero=2), params, m, True) == \
            pytest.approx((m * 12 * params + (m - 1) * 12 * params / 8) / bandwidth)
    work = workload(get_preset("llama3-8b"), 64, 2048, "bf16")
    one, eight = (estimate(work, cluster, Layout(dp=8, zero=1, micro_batch=mb, checkpointing="full"))
                  for mb in (8, 1))
    fused = estimate(replace(work, fused_accumulation=True), cluster, Layout(dp=8, zero=1, micro_batch=1,
                                                                            checkpointing="full"))
    assert eight.compute_s - fused.compute_s == pytest.approx(7 * 12 * work.model.num_params() / bandwidth, rel=1e-6)
    assert one.compute_s < eight.compute_s


def test_zero_1_and_2_pay_a_latency_for_each_buckets_collective_as_the_runtime_issues_them():
    """The runtime reduce-scatters each --bucket-mb bucket on its own (every micro-batch under
    ZeRO-2) and all-gathers each bucket's updated shards after the step: on a link of latency only,
    the planner's data-parallel time is that many latencies, with the bucket count the runtime's
    own (one rule cuts both: strata/rules/buckets.py), whatever --bucket-mb is."""
    from dataclasses import replace

    import torch

    from strata.model.transformer import Transformer
    from strata.parallel.buckets import bucket_elements, plan_buckets
    from strata.plan.buckets import bucket_parts
    from strata.plan.data_parallel import data_parallel_seconds
    cfg = get_preset("small")
    model = Transformer(cfg)
    params = sum(p.numel() for p in model.parameters())
    latency = 1e-3
    cluster = replace(_selene(1), intra_bandwidth=float("inf"), intra_latency=latency, overlap=False)
    step = (4 - 1) * latency  # one ring collective over 4 ranks: 3 steps
    counts = {}
    for bucket_mb in (0.5, 4.0, 25.0, 1000.0):
        buckets, _ = plan_buckets(list(reversed(list(model.parameters()))), bucket_elements(bucket_mb, torch.float32), 4)
        parts = bucket_parts(cfg, cfg.n_layers, True, True, None, params, bucket_mb)
        counts[bucket_mb] = parts.count
        assert parts.count == len(buckets)
        assert sorted(size for size, n in parts.sizes for _ in range(n)) == \
            sorted(sum(p.numel() for p in b.params) for b in buckets)
        for zero, m, collectives in ((0, 2, len(buckets)), (1, 2, len(buckets) * (1 + 1)),
                                     (2, 2, len(buckets) * (2 + 1)), (2, 4, len(buckets) * (4 + 1))):
            total, exposed, _ = data_parallel_seconds(cluster, Layout(dp=4, zero=zero), parts, m, 0.0, 0.0)
            ring = 2 if zero == 0 else 1  # an all-reduce is a reduce-scatter and an all-gather
            assert total == exposed == pytest.approx(collectives * ring * step)
        # and the estimate reads the workload's --bucket-mb
        work = replace(workload(cfg, 16, 128, "bf16"), bucket_mb=bucket_mb)
        e = estimate(work, cluster, Layout(dp=4, zero=1, micro_batch=2))
        assert e.comm_seconds["dp"] == pytest.approx(len(buckets) * 2 * step)
    assert counts[25.0] == 3 and counts[0.5] > counts[4.0] > counts[25.0] > counts[1000.0] == 1


def test_plan_prices_the_bucket_mb_it_is_given(capsys):
    """`strata plan --bucket-mb`: smaller buckets, more collectives, more data-parallel time."""
    dp = {}
    for bucket_mb in ("0.05", "25"):
        assert strata_main(["plan", "--model", "small", "--gpus-per-node", "4", "--layout", "dp=4,zero=1,mb=1",
                            "--bucket-mb", bucket_mb, "--json"]) == 0
        dp[bucket_mb] = json.loads(capsys.readouterr().out)["layouts"][0]["comm_seconds"]["dp"]
    assert dp["0.05"] > dp["25"] > 0


def test_a_bubble_slot_lasts_the_other_stages_micro_batch():
    """With strata's uneven cut (the head on the last stage), the fill and drain wait on the
    stages that are not the slowest: the bubble is shorter than (p-1) of the slowest's micro-batch."""
    from strata.plan.cost import _rank_time, _terms, stage_loads
    from strata.rules.schedules import profile
    work = workload(get_preset("small"), 16, 128, "bf16")
    cluster, layout = _selene(1), Layout(pp=2, micro_batch=2)
    e = estimate(work, cluster, layout)
    terms = _terms(work, cluster, layout, 1.0)
    times = sorted(_rank_time(cluster, layout, terms, load).total for load in stage_loads(work.model, 2, 1, 128))
    assert times[0] < times[1]
    slots = profile("1f1b", 2, 16 // 2).bubble_slots  # from the schedule's simulation
    assert e.bubble * e.step_time_s == pytest.approx(slots * times[0])  # slots of the faster stage


def test_full_checkpointing_runs_the_blocks_forward_again_not_the_embedding_or_head():
    """strata checkpoints blocks (strata/memory/checkpointing.py): full recomputation adds each
    micro-batch's blocks' forward, and the hardware FLOPs two per block weight and token plus the
    attention's forward; the head, a large share of a small model's forward, is not run again."""
    from strata.plan.cost import _terms
    work, cluster = workload(get_preset("small"), 16, 128, "bf16"), _selene(1)
    kept, full = (Layout(dp=8, micro_batch=1, checkpointing=mode) for mode in ("none", "full"))
    a, b = estimate(work, cluster, kept), estimate(work, cluster, full)
    block = _terms(work, cluster, full, 1.0).units[1]
    m, cfg = 16 // 8, work.model
    assert b.compute_s - a.compute_s == pytest.approx(m * cfg.n_layers * block.forward)
    tokens, s = 16 * 128, cfg.attended_positions(128)
    recomputed = tokens * (2 * cfg.n_layers * cfg.block_matmul_params() + cfg.n_layers * 4 * s * cfg.q_dim)
    hardware = [e.tflops_per_device * 1e12 * e.step_time_s * 8 for e in (a, b)]
    assert hardware[1] - hardware[0] == pytest.approx(recomputed, rel=1e-9)
