"""The planner's view of the ways of cutting tensor parallelism's matrices (1-D, 2-D, 2.5-D, 3-D):
where a grid beats 1-D and where it loses, what `--explain` says about it, and `strata plan
--layout tp_mode=...` as a user types it. (The runs' counted bytes and memory against the same
formulas: tests/test_tensor_nd.py.)"""

import json

import pytest

from strata.cli import main as strata_main
from strata.model.presets import get_preset
from strata.plan.cost import Workload, estimate
from strata.plan.inputs import build_cluster
from strata.plan.report import parse_layout
from strata.plan.search import explain, search
from strata.plan.tensor import spread
from strata.rules.tensor_modes import grid_of
from strata.rules.tensor_traffic import ElementBytes, step_bytes

LLAMA3_8B = Workload(get_preset("llama3-8b"), 64, 8192, "bf16")


def _tp(text: str, nodes: int, per_node: int = 8):
    cluster = build_cluster("A100-80G", nodes, per_node, "nvlink", "ib-200")
    return estimate(LLAMA3_8B, cluster, parse_layout(text, LLAMA3_8B, cluster.world))


def test_a_grid_moves_more_than_1d_on_a_small_group_and_less_on_a_large_one_across_nodes():
    """1-D moves every token's activations through every rank whatever t; a grid's blocks shrink
    with q but its weight blocks are gathered again for every micro-batch. On 4 ranks over NVLink
    1-D with sequence parallelism moves less and is faster; on 16 ranks over two nodes with 8
    sequences of 8192 tokens per micro-batch, 2-D moves less and is faster."""
    small_1d, small_2d = _tp("tp=4,mb=2,sp", 1, 4), _tp("tp=4,tp_mode=2d,mb=2", 1, 4)
    assert small_2d.comm_bytes["tp"] > small_1d.comm_bytes["tp"]
    assert small_2d.step_time_s > small_1d.step_time_s
    large_1d, large_2d = _tp("tp=16,mb=8,sp", 2), _tp("tp=16,tp_mode=2d,mb=8", 2)
    assert large_2d.comm_bytes["tp"] < large_1d.comm_bytes["tp"]
    assert large_2d.step_time_s < large_1d.step_time_s
    # fewer, larger micro-batches gather the weight blocks fewer times: the grid's bytes fall
    assert _tp("tp=16,tp_mode=2d,mb=4", 2).comm_bytes["tp"] > large_2d.comm_bytes["tp"]


def test_a_grid_sub_group_is_priced_on_the_links_its_members_cross():
    """A sub-group's members, as places in the tp group, stand for the evenly spaced group with as
    many members in each node; 3-D on 8 ranks over two nodes of 4 puts its l and batch groups
    across the network, and pays for it."""
    assert spread([0, 2], 8) == (2, 1)  # one node
    assert spread([0, 4], 4) == (2, 4)  # one member in each node
    assert spread([0, 1, 4, 5], 4) == (4, 2)  # two in each node
    assert spread([0, 2, 4, 6], 4) == (4, 2)
    work = Workload(get_preset("llama-7b"), 16, 2048, "bf16")
    seconds = []
    for nodes, per_node in ((1, 8), (2, 4)):
        cluster = build_cluster("A100-80G", nodes, per_node, "nvlink", "100gbe")
        seconds.append(estimate(work, cluster, parse_layout("tp=8,tp_mode=3d,mb=4", work, 8)).comm_seconds["tp"])
    assert seconds[1] > 10 * seconds[0]


@pytest.mark.parametrize("text", ["tp=4,tp_mode=2d,mb=2", "dp=2,tp=8,tp_mode=2.5d,tp_depth=2,mb=4",
                                  "dp=2,tp=8,tp_mode=3d,mb=4,ckpt=full"])
def test_the_planners_tp_bytes_are_the_modes_formula_per_micro_batch(text):
    """With one stage the planner's tp bytes are the step's count that the runtime's equal
    (recomputation and the step's partial-gradient sums included), in the run's dtypes."""
    e = _tp(text, 2)
    lay = e.layout
    grid = grid_of(lay.tp_mode, lay.tp, lay.tp_depth)
    m = LLAMA3_8B.global_batch // (lay.dp * lay.micro_batch)
    recomputed = LLAMA3_8B.model.n_layers if lay.checkpointing == "full" else 0
    formula = step_bytes(LLAMA3_8B.model, grid, lay.micro_batch * LLAMA3_8B.seq_len, ElementBytes(2, 4, 4), m,
                         recomputed)
    assert e.comm_bytes["tp"] == pytest.approx(formula.total, rel=1e-12)


def test_explain_compares_the_best_grid_with_1d_at_the_same_degrees():
    """Two nodes of 8 A100: the best layout has no tensor parallelism, so --explain says how the
    best grid fares against 1-D at its degrees, with both estimates' numbers."""
    cluster = build_cluster("A100-80G", 2, 8, "nvlink", "ib-200")
    ranked, rejected = search(LLAMA3_8B, cluster, offload=False)
    lines = explain(ranked[0], ranked, rejected, cluster)
    line = next(x for x in lines if x.startswith("tensor parallelism at"))
    grid = next(e for e in ranked if e.layout.tp_mode != "1d")
    rival = next(e for e in ranked if e.layout.tp_mode == "1d" and
                 (e.layout.dp, e.layout.tp, e.layout.pp) == (grid.layout.dp, grid.layout.tp, grid.layout.pp))
    for e in (grid, rival):
        assert f"{e.comm_bytes['tp'] / 1e9:.2f} GB per rank per step" in line
        assert f"{e.memory_breakdown['activations'] / 1e9:.2f} GB of activations" in line
    assert f"as {grid.layout.tp_mode}" in line and "as 1d" in line and "Why:" in line


def test_plan_layout_takes_tp_mode_and_depth_and_reports_them(capsys):
    assert strata_main(["plan", "--model", "llama3-8b", "--nodes", "2", "--json",
                        "--layout", "dp=2,tp=8,tp_mode=2.5d,tp_depth=2,mb=4"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    assert (row["tp_mode"], row["tp_depth"], row["fits"]) == ("2.5d", 2, True)
    assert strata_main(["plan", "--model", "llama3-8b", "--layout", "tp=8,tp_mode=3d,mb=4"]) == 0
    assert "tp=8,tp_mode=3d,pp=1" in capsys.readouterr().out


@pytest.mark.parametrize("layout,message", [
    ("tp=8,tp_mode=2d,mb=4", "tp=8: tp_mode 2d needs q² (4, 9, 16, ...) ranks"),
    ("dp=2,tp=4,tp_mode=2d,mb=1", "mb=1: must be a multiple of 2 with tp_mode 2d on 4 ranks"),
    ("dp=2,tp=4,tp_mode=2d,tp_depth=2,mb=2", "tp_depth=2: is the depth of 2.5-D tensor parallelism; tp_mode is 2d"),
    ("dp=2,tp=4,tp_mode=2d,mb=2,zero=3", "zero=3: not with tp_mode 2d"),
    ("tp=8,tp_mode=2.5d,tp_depth=3,mb=4", "tp_mode 2.5d needs q² x tp_depth 3"),
])
def test_plan_refuses_a_grid_that_cannot_run_in_one_line(layout, message, capsys):
    assert strata_main(["plan", "--model", "llama3-8b", "--layout", layout]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err
