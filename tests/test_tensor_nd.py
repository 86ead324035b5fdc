"""Multi-dimensional tensor parallelism (2-D, 2.5-D, 3-D) against the single-process run, its
traffic against the papers' counts (strata/rules/tensor_modes.py), its activations against the
partition, and its checkpoints under other layouts."""

import functools
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from strata.config import train_config
from strata.distributed import comm
from strata.distributed.mesh import ParallelDims, grid_axes
from strata.model.presets import get_preset
from strata.rules.tensor_modes import grid_of
from strata.rules.tensor_traffic import ElementBytes, step_traffic
from strata.train.trainer import train

from distributed import SharedLaunches, assert_states_close, run_on_ranks
from memory_probe import saved_bytes_of_first_block

# vocabulary 251 and sequences of 31 tokens: neither a multiple of q nor of any group's size.
BASE = dict(model="tiny", seq_len=31, steps=6, progress=False, peak_flops=1e10, eval_batches=1, lr=3e-3, seed=7,
            vocab_size=251, global_batch=8, micro_batch=4, grad_clip=0.5)


def _run(settings):
    s = train(train_config(**{**BASE, **settings}), keep_state=True)
    return {"losses": s["losses"], "state": s["state"], "record": s["records"][-1]}


@functools.lru_cache(maxsize=None)
def single_process(dtype):
    return _run(dict(dtype=dtype))


def _runs(settings_list):
    return [_run(settings) for settings in settings_list]


def _key(**settings):
    return tuple(sorted(settings.items()))


LAYOUTS = [
    (4, dict(tp=4, tp_mode="2d")),
    (8, dict(tp=8, tp_mode="2.5d", tp_depth=2)),
    (8, dict(tp=8, tp_mode="3d")),
    (8, dict(dp=2, tp=4, tp_mode="2d", zero=1)),
    (8, dict(pp=2, tp=4, tp_mode="2d")),
    (8, dict(dp=2, tp=4, tp_mode="2d", zero=2, checkpointing="full")),
]


# every layout in fp64 (1e-10); 2-D, 3-D and dp2 x 2-D in fp32 too (1e-5; the planner test reads those runs)
CASES = [(w, lay, "fp64", 1e-10) for w, lay in LAYOUTS] + [(w, lay, "fp32", 1e-5) for w, lay in LAYOUTS[:4]]
# One process group per layout runs all of its runs: fp64, fp32 (LAYOUTS[:4]) and bf16 (2.5-D and
# 3-D, the bf16 test's): the same runs as a launch each, fewer process groups to start.
LAUNCHES = [(w, tuple(_key(dtype=dtype, **lay) for dtype in ("fp64", "fp32", "bf16")
                      if dtype == "fp64" or (dtype == "fp32" and i < 4) or (dtype == "bf16" and i in (1, 2))))
            for i, (w, lay) in enumerate(LAYOUTS)]
parallel_run = SharedLaunches(_run, LAUNCHES, timeout=900)


@pytest.mark.parametrize("world,layout,dtype,rtol", CASES, ids=lambda v: str(v))
def test_grid_tensor_parallel_reproduces_the_single_process_run(world, layout, dtype, rtol):
    reference = single_process(dtype)
    ranks = parallel_run(world, _key(dtype=dtype, **layout))
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=rtol, atol=0)
    assert_states_close(ranks[0]["state"], reference["state"], dtype, BASE["lr"])  # the logical parameters


def _sub_groups(traffic) -> dict[str, float]:
    """rules/tensor_traffic's count in comm.py's keys ("all_gather/tp.row", ...), the whole group's
    "tp" (which carries the gradient norm's sum too) left out."""
    return {f"{op}/tp.{group}": nbytes for (group, op), nbytes in traffic.bytes.items() if group != "tp"}


def _assert_traffic(records, model_name, layout, e: ElementBytes):
    """What each rank counted over each sub-group and operation in its last step equals
    rules/tensor_traffic.step_traffic. Under ZeRO-1/2 a rank sums only its data-parallel shard of
    the partial gradients: summed over the data-parallel ranks at one grid place, the counts equal
    dp x the micro-batches' traffic + the sums once."""
    model = get_preset(model_name).with_overrides(vocab_size=BASE["vocab_size"])
    grid = grid_of(layout["tp_mode"], layout["tp"], layout.get("tp_depth", 1))
    dp = layout.get("dp", 1)
    micro_batches = BASE["global_batch"] // BASE["micro_batch"] // dp
    recomputed = model.n_layers if layout.get("checkpointing") == "full" else 0
    per_micro_batch, sums = step_traffic(model, grid, BASE["micro_batch"] * BASE["seq_len"], e, micro_batches,
                                         recomputed)
    sharded = layout.get("zero", 0) in (1, 2)
    groups = [records[t::grid.size] for t in range(grid.size)] if sharded else [[r] for r in records]
    for group in groups:
        counted: dict[str, float] = {}
        for record in group:
            for key, nbytes in record["comm_bytes_by_op"].items():
                if "/tp." in key:
                    counted[key] = counted.get(key, 0.0) + nbytes
        expected = {key: len(group) * nbytes for key, nbytes in _sub_groups(per_micro_batch).items()}
        for key, nbytes in _sub_groups(sums).items():
            expected[key] = expected.get(key, 0.0) + nbytes * (1 if sharded else len(group))
        assert set(counted) == set(expected), (counted, expected)
        for key, nbytes in expected.items():
            assert counted[key] == pytest.approx(nbytes, rel=1e-12), (key, counted, expected)


@pytest.mark.parametrize("world,layout", [*LAYOUTS[:3], LAYOUTS[5]], ids=lambda v: str(v))
def test_grid_traffic_matches_the_papers_count(world, layout):
    """Bytes each rank sends over each tensor-parallel sub-group with each operation in a step
    equal the per-layer sums of strata/rules/tensor_traffic.py (SUMMA, Tesseract, Bian et al.'s
    Algorithm 1), recomputation and the step's partial-gradient sums included."""
    ranks = parallel_run(world, _key(dtype="fp64", **layout))
    _assert_traffic([rank["record"] for rank in ranks], "tiny", layout, ElementBytes.uniform(8))


@pytest.mark.parametrize("world,layout", [LAYOUTS[1], LAYOUTS[2]], ids=lambda v: str(v))
def test_under_bf16_the_blocks_travel_in_16_bits_and_the_losses_follow_the_single_process(world, layout):
    """bf16 autocast: the linear layers gather their blocks and reduce-scatter the activations'
    gradients in bf16, the norms' statistics and the loss's sums stay fp32, weight gradients,
    vectors' sums and the embedding travel in the parameters' fp32, as ElementBytes says; the
    losses follow the single process's bf16 run up to bf16's rounding of sums in another order."""
    reference = single_process("bf16")
    ranks = parallel_run(world, _key(dtype="bf16", **layout))
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=2e-3, atol=0)
    _assert_traffic([rank["record"] for rank in ranks], "tiny", layout, ElementBytes(2, 4, 4))


def _saved_bytes_of_first_block(**settings):
    return saved_bytes_of_first_block(micro_batch=4, **settings)


@pytest.mark.parametrize("world,layout", LAYOUTS[:3], ids=lambda v: str(v))
def test_activations_between_layers_are_cut_tp_ways(world, layout):
    """A block keeps 1/tp of what the single process keeps: each rank holds 1/|B| of the sequences
    and 1/q of the features of every activation, and the heads are split q ways; only the norms'
    1/rms (one number per token, of every feature) is cut by |B| alone."""
    b, s = 4, 64
    grid = grid_of(layout["tp_mode"], layout["tp"], layout.get("tp_depth", 1))
    whole = _saved_bytes_of_first_block()
    rms = 2 * b * s * 4  # two norms, fp32
    predicted = (whole - rms) / grid.size + rms / grid.batch_parts
    for measured in run_on_ranks(_saved_bytes_of_first_block, world, **layout):
        assert measured == predicted, (measured, predicted, whole)


def _train_jobs(jobs):
    return [train(train_config(**{**BASE, **job}))["losses"] for job in jobs]


def _on_world(world, jobs):
    return _train_jobs(jobs) if world == 1 else run_on_ranks(_train_jobs, world, jobs, timeout=600)[0]


def test_checkpoints_cross_between_1d_2d_3d_and_one_process(tmp_path):
    """Saved at step 3 under 2-D, resumed under 1-D tp 2, 3-D and one process; saved under 3-D and
    1-D, resumed under 2-D: every resumed run continues with the uninterrupted losses (fp32)."""
    layouts = {"2d": (4, dict(tp=4, tp_mode="2d")), "3d": (8, dict(tp=8, tp_mode="3d")), "tp2": (2, dict(tp=2)),
               "single": (1, {})}
    saved, resumed = {}, {}

    def save(name):
        return {**layouts[name][1], "save": str(tmp_path / name), "save_every": 3}

    def resume(source, target):
        return {**layouts[target][1], "resume": str(tmp_path / source / "step_000003")}

    # one process group per layout: its own save first, then its resumes of checkpoints saved before
    # (the 2-D save first: every other layout resumes it)
    saved["2d"], = _on_world(4, [save("2d")])
    saved["tp2"], resumed[("2d", "tp2")] = _on_world(2, [save("tp2"), resume("2d", "tp2")])
    saved["3d"], resumed[("2d", "3d")] = _on_world(8, [save("3d"), resume("2d", "3d")])
    resumed[("2d", "single")], = _on_world(1, [resume("2d", "single")])
    resumed[("3d", "2d")], resumed[("tp2", "2d")] = _on_world(4, [resume("3d", "2d"), resume("tp2", "2d")])
    reference = single_process("fp32")["losses"]
    for name, got in saved.items():
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=0, msg=name)
    assert sorted(resumed) == sorted([("2d", "tp2"), ("2d", "3d"), ("2d", "single"), ("3d", "2d"), ("tp2", "2d")])
    for (source, target), got in resumed.items():
        torch.testing.assert_close(got, reference[3:], rtol=1e-5, atol=0, msg=f"{source} -> {target}")


def test_a_tied_model_with_learned_positions_and_biases_reproduces_the_single_process_run():
    """GPT-2's shape: the head is the embedding's matrix (cut as the embedding is), a learned position
    table, LayerNorm with biases, biases in every linear layer; under pp 2 the last stage keeps the
    embedding's blocks and sums their gradients with the first stage's."""
    settings = dict(model="tiny-gpt2", dtype="fp64")
    reference = _run(settings)
    # the two 8-rank runs (pp 2 x 2-D, and 3-D) in one process group
    pipelined, three_d = zip(*run_on_ranks(_runs, 8, [{**settings, "tp": 4, "tp_mode": "2d", "pp": 2},
                                                      {**settings, "tp": 8, "tp_mode": "3d"}], timeout=900))
    for rank in pipelined:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-10, atol=0)
    two_d = run_on_ranks(_run, 4, {**settings, "tp": 4, "tp_mode": "2d"}, timeout=600)
    for ranks, layout in ((two_d, dict(tp=4, tp_mode="2d")), (three_d, dict(tp=8, tp_mode="3d"))):
        torch.testing.assert_close(ranks[0]["losses"], reference["losses"], rtol=1e-10, atol=0)
        _assert_traffic([rank["record"] for rank in ranks], "tiny-gpt2", layout, ElementBytes.uniform(8))


@pytest.mark.parametrize("world,layout", LAYOUTS[:4], ids=lambda v: str(v))
def test_the_planner_predicts_the_counted_memory_of_each_mode(world, layout):
    """`strata plan --layout tp=..,tp_mode=..` (parsed as the CLI parses it) against the runs above:
    model states and activations each within 5% of what the ranks counted, and the bytes sent over
    the tensor-parallel groups equal to the count (all but the gradient norm's one sum)."""
    from strata.plan.cost import Cluster, Workload, estimate
    from strata.plan.hardware import get_device
    from strata.plan.report import parse_layout
    counted = parallel_run(world, _key(dtype="fp32", **layout))[0]["record"]
    model = get_preset("tiny").with_overrides(vocab_size=BASE["vocab_size"])
    work = Workload(model, BASE["global_batch"], BASE["seq_len"], "fp32")
    text = ",".join(f"{k}={v}" for k, v in {"mb": BASE["micro_batch"], **layout}.items())
    estimated = estimate(work, Cluster(get_device("A100-80G"), 1, world, 25e9, 25e9), parse_layout(text, work, world))
    predicted = estimated.memory_breakdown
    states = predicted["weights"] + predicted["gradients"] + predicted["optimizer_states"]
    assert states == pytest.approx(counted["model_state_bytes"], rel=0.05)
    assert predicted["activations"] == pytest.approx(counted["peak_activation_bytes"], rel=0.05)
    tp = layout["tp"]
    sent = sum(v for k, v in counted["comm_bytes_by_op"].items() if k.split("/")[1].startswith("tp"))
    grad_norm = 2 * (tp - 1) / tp * 8  # one fp64 sum of squares over the whole tp group
    # under ZeRO-1/2 a rank sums its shard's pieces of the partially seen parameters; the planner
    # prices the average share, and the aligned buckets (rules/buckets.py) move a shard's edge by
    # less than one parameter alignment: at most PARAM_ALIGN_ELEMENTS fp32 elements off a rank's share
    from strata.rules.constants import PARAM_ALIGN_ELEMENTS
    edge = 2 * (tp - 1) / tp * 4 * PARAM_ALIGN_ELEMENTS if layout.get("zero", 0) in (1, 2) else 0.0
    assert estimated.comm_bytes["tp"] == pytest.approx(sent - grad_norm, rel=1e-12, abs=edge)


def _skip_a_row_collective(timeout_s):
    """2-D on 4 ranks: rank 1 never joins its row's second all-reduce."""
    rank = dist.get_rank()
    row = grid_axes(ParallelDims(dp=1, tp=4, pp=1), grid_of("2d", 4), rank, None, timeout_s)["row"]
    x = torch.ones(4, device="cpu")
    comm.all_reduce(x, row.group, row.name)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # asleep until rank 0 has its answer (timeout_s + 15 at most)
        deadline = time.monotonic() + timeout_s + 15
        while time.monotonic() < deadline and not store.check(["rank 0 answered"]):
            time.sleep(0.1)
        store.set("rank 1 awake", "yes")  # (a peer that leaves also ends the wait, with another error)
        return None
    if rank > 1:  # the other row
        return "other row"
    try:
        comm.all_reduce(x, row.group, row.name)
    except RuntimeError as e:
        answer = ("while rank 1 slept: " if not store.check(["rank 1 awake"]) else "after rank 1 woke: ") + str(e)
    else:
        answer = "no error"
    store.set("rank 0 answered", "yes")
    # Rank 0 hosts the store: leaving before rank 1 has read the answer would end rank 1's wait
    # with "connection closed" instead (seen in CI).
    store.wait(["rank 1 awake"], timedelta(seconds=timeout_s + 30))
    return answer


def test_a_grid_sub_group_times_out_with_the_runs_timeout_and_names_the_missing_rank():
    """torch gives a new group a 30-minute timeout; the grid's sub-groups get the run's."""
    messages = run_on_ranks(_skip_a_row_collective, 4, 3, collective_timeout=3, timeout=60)
    assert messages[0].startswith("while rank 1 slept: "), messages[0]
    assert "collective all_reduce #2 on process group 'tp.row' (ranks [0, 1])" in messages[0], messages[0]
    assert "ranks that did not arrive: 1" in messages[0], messages[0]
    assert messages[2:] == ["other row", "other row"]


def test_the_grid_layernorm_keeps_its_precision_far_from_a_zero_mean():
    """Its statistics are sums over features split between ranks: the mean first, then the squares
    about it (E[x²] - mean² in fp32 loses every digit when the mean is large)."""
    from strata.parallel.tensor_nd import norm_from_statistics
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(0)) * 0.5 + 1000
    got = norm_from_statistics(x, torch.ones(1024), torch.zeros(1024), "layernorm", 1e-5, 1024, lambda s: s)
    torch.testing.assert_close(got, torch.nn.functional.layer_norm(x, (1024,), eps=1e-5), rtol=0, atol=1e-3)


def test_a_family_whose_placements_the_grids_do_not_cut_is_refused_in_one_line():
    """rules/tensor_modes.GRID_PLACEMENTS is what the grids' cutter computes; a family placing a layer
    otherwise (Gemma 2's output norms, OLMo 2's projection norms, MLA's summed replicas) is refused
    before processes start (MLA's used to crash inside the ranks), the parallel blocks are not."""
    from strata.errors import ConfigError
    from strata.model.families.base import PLACEMENTS
    from strata.parallel.tensor_nd import _GridCutter
    from strata.rules.tensor_modes import GRID_PLACEMENTS, check_grid
    assert GRID_PLACEMENTS == {p for p in PLACEMENTS if hasattr(_GridCutter, p)}
    grid = grid_of("2d", 4)
    with pytest.raises(ConfigError, match="deepseek_v3 family's summed_replica placement has no cut on a grid"):
        check_grid(get_preset("tiny-mla"), grid, 2)
    with pytest.raises(ConfigError, match="olmo2 family's kv_projection_norm, normed_kv_column, output_norm"):
        check_grid(get_preset("olmo-2-7b"), grid, 2)
    check_grid(get_preset("pythia-1.4b"), grid, 2)  # GPT-NeoX's parallel block is cut (test_family_parallel)
