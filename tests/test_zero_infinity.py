"""ZeRO-Infinity: `--offload-params cpu|disk` (ZeRO-3's shards and gradients in a tier, read a unit at
a time), with `--offload cpu|disk` (Adam's moments) and `--offload-activations cpu` (checkpointed
block inputs). Every combination trains bit for bit as in memory, on one process and on dp2 with
ZeRO-3; the bytes moved per step equal the count of what each unit must read and write; checkpoints
cross between offloaded and in-memory runs. The 1.5B run on this machine is bench/zero_infinity.py."""

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from strata.config import train_config
from strata.rules.offload import activation_traffic, moment_traffic, parameter_traffic
from strata.train.trainer import train

from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=32, steps=3, micro_batch=1, global_batch=4, progress=False, peak_flops=1e10,
            eval_batches=1, seed=9, checkpointing="full")
COMBINATIONS = list(itertools.product(("cpu", "disk"), ("none", "cpu", "disk"), ("none", "cpu")))


def _offloaded(params, optimizer, activations, directory):
    uses_files = "disk" in (params, optimizer) or activations != "none"  # activations: a file on a CPU device
    return dict(offload_params=params, offload=optimizer, offload_activations=activations,
                offload_dir=directory if uses_files else None)


def _compare_all(settings, directory, combinations=COMBINATIONS):
    """(combination, same losses, same weights) for each, against the run without offload."""
    reference = train(train_config(**{**BASE, **settings}), keep_state=True)
    out = []
    for combination in combinations:
        run = train(train_config(**{**BASE, **settings}, **_offloaded(*combination, directory)), keep_state=True)
        out.append((combination, run["losses"] == reference["losses"] and run["val_losses"] == reference["val_losses"],
                    all(torch.equal(reference["state"][k], v) for k, v in run["state"].items())))
    return out


@pytest.mark.parametrize("model, dtype", [("tiny", "fp32"), ("tiny", "bf16"), ("tiny-gpt2", "fp32")])
def test_every_offload_combination_trains_bit_for_bit_as_in_memory_on_one_process(model, dtype, tmp_path):
    """tiny-gpt2 ties its embedding (kept gathered from its forward to the head's backward) and
    validates after every step, between updates."""
    settings = {"model": model, "dtype": dtype, **({"eval_every": 1} if model == "tiny-gpt2" else {})}
    for combination, same_losses, same_weights in _compare_all(settings, str(tmp_path)):
        assert same_losses and same_weights, combination


def test_offload_on_the_small_model_is_bit_for_bit(tmp_path):
    small = {"model": "small", "steps": 2, "global_batch": 2, "dtype": "bf16"}
    results = _compare_all({**small}, str(tmp_path), [("disk", "disk", "cpu"), ("cpu", "cpu", "none")])
    for combination, same_losses, same_weights in results:
        assert same_losses and same_weights, combination


def _dp2(directory):
    rank_dir = f"{directory}/rank{torch.distributed.get_rank()}"
    wire = {"zero": 3, "dtype": "bf16", "reduce_dtype": "bf16", "gather_dtype": "bf16"}  # bf16 gradients staged
    return _compare_all({"zero": 3, "grad_clip": 0.05}, rank_dir) + \
        _compare_all(wire, rank_dir, [("disk", "disk", "cpu"), ("cpu", "none", "none")])


def _tp2(directory):
    rank_dir = f"{directory}/rank{torch.distributed.get_rank()}"
    return _compare_all({"tp": 2, "sequence_parallel": True, "grad_clip": 0.05}, rank_dir,
                        [("disk", "disk", "cpu"), ("cpu", "none", "none")])


def test_offload_under_tensor_parallelism_with_sp_is_bit_for_bit(tmp_path):
    """ZeRO-3 on one data-parallel rank of tp 2 with sequence parallelism: the norms' and biases'
    gradients, which each tp rank holds part of, are summed over tp as each unit's final gradient
    goes to the tier; against tp 2 kept in memory (ZeRO-0)."""
    for rank in run_on_ranks(_tp2, 2, str(tmp_path), timeout=600):
        for combination, same_losses, same_weights in rank:
            assert same_losses and same_weights, combination


def test_every_offload_combination_under_zero3_on_two_ranks_is_bit_for_bit(tmp_path):
    for rank in run_on_ranks(_dp2, 2, str(tmp_path), timeout=600):
        for combination, same_losses, same_weights in rank:
            assert same_losses and same_weights, combination


@pytest.mark.parametrize("model", ["tiny", "tiny-gpt2"])
def test_bytes_moved_per_step_are_what_each_unit_must_read_and_write(model, tmp_path):
    """Per step, with m micro-batches, Ψ this rank's shard elements (fp32) and moments on disk:
    parameters read once for each forward and once for each backward (its recomputation included;
    a tied embedding, kept gathered for the head, once), gradients written each micro-batch and read
    back for every one after the first, and the optimizer reading shard + gradient and writing the
    shard; Adam's moments read and written once; each block's input written once and read once per
    micro-batch."""
    m = BASE["global_batch"] // BASE["micro_batch"]
    run = train(train_config(**{**BASE, "model": model}, **_offloaded("disk", "disk", "cpu", str(tmp_path))))
    shard = sum(p.numel() for p in run["model"].parameters())  # one process: the whole model, unpadded
    cfg = run["model"].cfg
    kept = cfg.unit_params()[0] if cfg.tie_embeddings else 0
    activations = m * cfg.n_layers * BASE["micro_batch"] * BASE["seq_len"] * cfg.d_model * 4
    record = run["records"][-1]["offload"]
    assert record["read_bytes"] == {"disk": 4 * shard * (2 * m + (m - 1) + 2) - 4 * kept * m + 8 * shard + activations}
    assert record["written_bytes"] == {"disk": 4 * shard * (m + 1) + 8 * shard + activations}
    # the rule the planner prices is this count
    backward, step = parameter_traffic(shard, m, kept)
    rule = backward + step + moment_traffic(shard) + activation_traffic(activations / m, m)
    assert (rule.read, rule.written) == (record["read_bytes"]["disk"], record["written_bytes"]["disk"])
    assert run["records"][-1]["model_state_breakdown"]["params_and_grads_on_disk"] == 8 * shard
    assert run["records"][-1]["model_state_breakdown"]["params"] == 0  # nothing held between steps
    assert record["io_wait_s"] >= 0 and run["records"][-1]["peak_rss_bytes"] > 0


def test_checkpoints_cross_between_offloaded_and_in_memory_runs(tmp_path):
    common = {**BASE, "steps": 6}
    offload = _offloaded("disk", "disk", "cpu", str(tmp_path / "off"))
    straight = train(train_config(**common))["losses"]
    train(train_config(**common, **offload, save=str(tmp_path / "a"), save_every=3))
    in_memory = train(train_config(**common, resume=str(tmp_path / "a" / "step_000003")))["losses"]
    train(train_config(**common, save=str(tmp_path / "b"), save_every=3))
    offloaded = train(train_config(**common, **offload, resume=str(tmp_path / "b" / "step_000003")))["losses"]
    assert in_memory == straight[3:] and offloaded == straight[3:]


@pytest.mark.parametrize("flags, says", [
    (["--offload-params", "disk", "--zero", "1", "--nproc", "2"], "--offload-params disk: streams ZeRO-3's"),
    (["--offload-params", "tape"], "--offload-params tape: valid: none, cpu, disk"),
    (["--offload-activations", "cpu"], "--offload-activations cpu: moves the block inputs that activation"),
    (["--offload-activations", "cpu", "--checkpointing", "selective"], "needs checkpointing full or every:K"),
    (["--offload-activations", "cpu", "--checkpointing", "full", "--pp", "2", "--nproc", "2"],
     "--offload-activations cpu: not with pp 2"),
    (["--offload-params", "cpu", "--dtype", "fp16"], "--offload-params cpu: not with dtype fp16"),
    (["--offload-params", "cpu", "--pp", "2", "--nproc", "2", "--zero", "3"], "--offload-params cpu: not with pp 2"),
    (["--offload-dir", "/tmp/x"], "--offload-dir /tmp/x: only with offload disk"),
    (["--parallel", "auto", "--offload-params", "disk"], "--parallel auto chooses the layout; drop --offload-params"),
    # 175B x 16 bytes: 2.8 TB of files, more than any test machine's disk (checked before any work)
    (["--model", "gpt3-175b", "--offload-params", "disk", "--offload", "disk", "--offload-dir", "/tmp/strata-x"],
     "--offload-dir /tmp/strata-x: the disk offload needs about 2.8 TB"),
])
def test_bad_offload_flags_get_one_line(flags, says):
    done = subprocess.run([sys.executable, "-m", "strata", "train", "--steps", "1", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_offload_params_alone_on_one_process_is_zero3_and_said_in_the_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run = train(train_config(**BASE, offload_params="cpu", metrics=str(metrics)))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_records = [r for r in records if r.get("kind") == "train"]
    assert len(train_records) == BASE["steps"] and run["losses"]
    assert all(r["offload"]["read_bytes"]["cpu"] > 0 and "peak_rss_bytes" in r for r in train_records)
    shards = sum(p.numel() for p in run["model"].parameters())  # ZeRO-3: every shard and gradient in the tier
    assert train_records[-1]["model_state_breakdown"]["params_and_grads_on_cpu"] == 8 * shards


# --- the planner ------------------------------------------------------------------------------------
def _cluster(device: str, devices: int = 1):
    from strata.plan.cost import Cluster
    from strata.plan.hardware import get_device
    return Cluster(get_device(device), 1, devices, 25e9, 25e9)


def test_the_planner_holds_in_each_tier_what_the_run_counted(tmp_path):
    from strata.model.presets import get_preset
    from strata.plan.cost import Workload, estimate
    from strata.rules.layout import Layout
    run = train(train_config(**BASE, **_offloaded("disk", "disk", "none", str(tmp_path))))
    counted = run["records"][-1]["model_state_breakdown"]
    work = Workload(get_preset("tiny"), BASE["global_batch"], BASE["seq_len"], "fp32")
    predicted = estimate(work, _cluster("A100-80G"), Layout(zero=3, micro_batch=1, checkpointing="full",
                                                            offload="disk", offload_params="disk"))
    assert predicted.tier_bytes == {"disk": counted["params_and_grads_on_disk"] + counted["optimizer_on_disk"]}
    assert predicted.memory_breakdown["weights"] == predicted.memory_breakdown["gradients"] == 0
    assert predicted.memory_breakdown["optimizer_states"] == 0 and predicted.exposed_io_s > 0


def test_the_planner_offloads_parameters_only_when_nothing_else_fits():
    from strata.model.presets import get_preset
    from strata.plan.cost import Workload
    from strata.plan.search import explain, search
    cluster = _cluster("RTX-4090")
    fits = Workload(get_preset("gpt2-124m"), 8, 1024, "bf16")
    ranked, _ = search(fits, cluster)
    assert ranked and all(e.layout.offload_params == "none" for e in ranked)
    too_big = Workload(get_preset("llama-7b"), 8, 2048, "bf16")  # 7B: 56 GB of weights and gradients, 24 GB here
    ranked, rejected = search(too_big, cluster)
    assert ranked and all(e.layout.offload_params != "none" for e in ranked)
    assert all("no layout without it fits" in " ".join(e.notes) for e in ranked)
    lines = explain(ranked[0], ranked, rejected, cluster)
    assert any("parameters offloaded (ZeRO-Infinity), because nothing else fits" in line for line in lines)
    assert ranked[0].fits and ranked[0].memory_bytes_per_device <= cluster.device.memory_bytes


def test_a_tier_that_cannot_hold_its_share_does_not_fit():
    from strata.model.presets import get_preset
    from strata.plan.cost import Workload, estimate
    from strata.rules.layout import Layout
    work = Workload(get_preset("llama-7b"), 8, 2048, "bf16")
    everything_on_host = estimate(work, _cluster("RTX-4090"), Layout(zero=3, micro_batch=1, checkpointing="full",
                                                                      offload="cpu", offload_params="cpu"))
    assert not everything_on_host.fits and everything_on_host.memory_bytes_per_device < 24e9
    assert any("host tier would hold" in note for note in everything_on_host.notes)


def test_plan_layout_takes_the_offload_keys():
    done = subprocess.run([sys.executable, "-m", "strata", "plan", "--model", "llama-7b", "--device", "RTX-4090",
                           "--gpus-per-node", "1", "--global-batch", "8", "--seq-len", "2048", "--json", "--layout",
                           "dp=1,zero=3,mb=1,ckpt=full,offload=disk,offload_params=cpu,offload_activations=cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    best = json.loads(done.stdout)["layouts"][0]
    from strata.model.presets import get_preset
    half = 8 * get_preset("llama-7b").num_params()  # fp32 shards and gradients; two fp32 moments
    assert best["offload_params"] == "cpu" and best["fits"]
    assert best["tier_bytes"]["host"] > half and best["tier_bytes"]["disk"] == half
    assert best["memory_breakdown"]["weights"] == 0 and best["exposed_io_seconds"] > 0


def test_a_disk_tier_leaves_no_file_behind_however_the_process_ends(tmp_path):
    """The file is unlinked once open: a killed run cannot leave gigabytes under --offload-dir."""
    from strata.memory.tiers import Tier, wait
    tier = Tier("disk", "params", str(tmp_path), 0)
    kept = torch.arange(1000, dtype=torch.float32)
    tier.reserve("x", kept)
    tier.evict("x", kept, dirty=True)
    wait(tier.writes[-1])  # written, then freed, on the worker thread
    assert kept.untyped_storage().nbytes() == 0
    wait(tier.fetch("x", kept))
    assert torch.equal(kept, torch.arange(1000, dtype=torch.float32)) and os.listdir(tmp_path) == []
    tier.close()
