"""Every data-parallel sharding strategy answers the one interface (strata/parallel/sharding.py), and
no caller asks a strategy what it has: nothing in strata/ probes one with hasattr or getattr."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from strata.memory.offloaded_shards import OffloadedShards
from strata.memory.tiers import Tier
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.parallel.data import DataParallelSettings
from strata.parallel.expert import ExpertSplit
from strata.parallel.gradients import Replicate, ShardGradients, ShardOptimizerStates
from strata.parallel.onebit_adam import OnebitReplicate, OnebitShardStates
from strata.parallel.sharding import ShardingStrategy
from strata.parallel.zero3 import ShardParameters

STRATA = pathlib.Path(__file__).resolve().parent.parent / "strata"
MEMBERS = {name for name in vars(ShardingStrategy) if not name.startswith("_")} | set(ShardingStrategy.__annotations__)


def _params() -> list[torch.nn.Parameter]:
    return list(build_model(get_preset("tiny")).parameters())


def _strategies(tmp_path):
    """One of each, on one process (no group: nothing communicates)."""
    settings = DataParallelSettings()
    zero3 = ShardParameters(build_model(get_preset("tiny")), settings)
    offloaded = ShardParameters(build_model(get_preset("tiny")), settings,
                                offload=OffloadedShards(Tier("disk", "params", str(tmp_path), 0)))
    params = _params()
    split = ExpertSplit(Replicate(params[:2], settings), Replicate(params[2:], settings), set())
    return {"zero0": Replicate(_params(), settings), "zero1": ShardOptimizerStates(_params(), settings),
            "zero2": ShardGradients(_params(), settings), "zero3": zero3, "zero3-offloaded": offloaded,
            "experts": split, "onebit-zero0": OnebitReplicate(_params(), settings, 2),
            "zeroone-zero1": OnebitShardStates(_params(), settings, 0, scaler=16)}


def test_the_protocol_names_what_the_callers_use():
    assert {"backward", "reduce_all", "grad_pairs", "grad_norm_pairs", "clip_", "optimizer_pieces", "stream_units",
            "separate_optimizer_targets", "prepare_step", "after_step", "overlap_gathers", "wait_parameters", "zero_grad", "in_memory",
            "full_state_dict", "stats", "close", "stage", "reduce_every_micro_batch", "offloaded", "params",
            "expert_names", "grads_partitioned"} == MEMBERS


def test_every_strategy_is_a_sharding_strategy_and_counts_through_stats(tmp_path):
    strategies = _strategies(tmp_path)
    try:
        for name, strategy in strategies.items():
            assert isinstance(strategy, ShardingStrategy), name
            missing = [m for m in sorted(MEMBERS) if m not in dir(strategy)]
            assert not missing, (name, missing)
            stats = strategy.stats()
            assert {"params_bytes", "grads_bytes"} <= set(stats), name
            assert all(isinstance(v, int) for v in stats.values()), name
            assert stats["params_bytes"] > 0 or name == "zero3-offloaded", name
            # in memory, the optimizer's tensors come in one pass over every unit or as one group
            streamed = [t for group in strategy.stream_units() for t in group]
            assert {id(t) for t in streamed} == {id(t) for t, _, _, _ in strategy.optimizer_pieces()}, name
        assert "peak_buffer_bytes" not in strategies["zero0"].stats()
        assert "peak_buffer_bytes" not in strategies["zero1"].stats()
        assert "peak_buffer_bytes" in strategies["zero2"].stats()
        assert "peak_buffer_bytes" in strategies["zero3"].stats()
        assert "offloaded_bytes" not in strategies["zero3"].stats()
        assert strategies["zero3-offloaded"].stats()["offloaded_bytes"] > 0
        assert [s.offloaded for s in strategies.values()] == [False, False, False, False, True, False, False, False]
        assert [s.grads_partitioned for s in strategies.values()] == [False, True, True, True, True, False, False, True]
        assert all(not s.expert_names for s in strategies.values())
    finally:
        for strategy in strategies.values():
            strategy.close()


def _probes(tree: ast.AST):
    """(line, source) of every hasattr/getattr call in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            yield node.lineno, ast.unparse(node)


def _probes_a_strategy(call: ast.Call) -> bool:
    """A probe of a strategy: on something named `sharding` (DataParallel's, run.parallel's), or
    for one of the interface's members by name."""
    target = call.args[0] if call.args else None
    names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(target) if isinstance(n, ast.Attribute)} if target is not None else set()
    asked = call.args[1] if len(call.args) > 1 else None
    return "sharding" in names or (isinstance(asked, ast.Constant) and asked.value in MEMBERS | {"sharding"})


@pytest.mark.parametrize("path", sorted(STRATA.rglob("*.py")), ids=lambda p: str(p.relative_to(STRATA)))
def test_no_caller_probes_a_strategy(path):
    tree = ast.parse(path.read_text(), str(path))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in ("hasattr", "getattr")]
    probes = [f"{path.name}:{c.lineno}: {ast.unparse(c)}" for c in calls if _probes_a_strategy(c)]
    # ExpertSplit holds two strategies: it calls their methods, never looks them up by name
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "ExpertSplit":
            probes += [f"{path.name}:{line}: {source}" for line, source in _probes(node)]
    assert not probes, probes


def test_the_probe_check_sees_the_probes_it_replaced():
    caught = [ast.parse(source).body[0].value for source in (
        'getattr(run.parallel, "sharding", None)', 'hasattr(sharding, "peak_buffer_bytes")',
        'getattr(run.parallel.sharding, "expert_names", set())', 'hasattr(strategy, "stats")')]
    assert all(_probes_a_strategy(call) for call in caught)
    assert not _probes_a_strategy(ast.parse('getattr(module, "tp_specs", {})').body[0].value)
