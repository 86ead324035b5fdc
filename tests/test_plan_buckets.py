"""The planner cuts gradient buckets and counts ZeRO-3's units by the runtime's own rules
(strata/rules/buckets.py, strata/rules/units.py), over a list of the model's parameters that is the
model's own: so the collectives it prices are the ones the runtime issues."""

import pytest
import torch

from strata.errors import ConfigError
from strata.model.presets import PRESETS, get_preset
from strata.model.transformer import Transformer
from strata.parallel.buckets import bucket_elements, plan_buckets
from strata.plan.buckets import block_parameters, bucket_parts, input_parameters, output_parameters
from strata.rules import buckets as rule
from strata.rules.units import unit_count


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _model(cfg):
    with torch.device("meta"):
        return Transformer(cfg)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_planners_parameter_list_is_the_models_own(name):
    cfg = PRESETS[name].with_overrides(n_layers=2)
    model = _model(cfg)
    named = list(model.named_parameters())
    listed = [(size, False) for size in input_parameters(cfg)] + block_parameters(cfg, 0) + block_parameters(cfg, 1) + \
        [(size, False) for size in output_parameters(cfg)]
    assert listed == [(p.numel(), _is_expert(n)) for n, p in named]
    assert len(model.units()) == unit_count(cfg.n_layers)


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt2", "tiny-moe", "small"])
@pytest.mark.parametrize("bucket_mb", [0.001, 0.01, 0.1, 25.0])
def test_bucket_counts_equal_the_runtimes_on_every_pipeline_stage_and_expert_split(name, bucket_mb):
    """A stage of a 2-stage pipeline (the last one of a tied model keeps the embedding), and a
    mixture's experts apart from the other parameters, as parallelize() hands them over; each
    bucket's elements as the runtime pads and aligns it on 2 ranks (what its collectives move)."""
    cfg = get_preset(name).with_overrides(n_layers=4)
    for layers, first, last in ((range(4), True, True), (range(2), True, False), (range(2, 4), False, True)):
        model = _model(cfg)
        model.keep(set(layers), first, last)
        named = list(model.named_parameters())
        for experts in ((None,) if not cfg.moe else (None, False, True)):
            params = [p for n, p in named if experts is None or _is_expert(n) == experts]
            runtime, _ = plan_buckets(list(reversed(params)), bucket_elements(bucket_mb, torch.float32), 2,
                                      aligned=True)
            parts = bucket_parts(cfg, len(layers), first, last, experts, float(sum(p.numel() for p in params)),
                                 bucket_mb, 2)
            assert parts.count == len(runtime), (layers, experts)
            assert sorted(size for size, n in parts.sizes for _ in range(n)) == sorted(b.size for b in runtime)
            assert parts.last == runtime[-1].size


def test_the_rule_cuts_as_documented():
    """In the order given, a parameter never split: one larger than a bucket alone, and a small
    one between two such alone too; each bucket padded to a multiple of dp."""
    plans = rule.plan_buckets([3, 10, 1, 10, 2, 2], 5, dp_size=4)
    assert [p.members for p in plans] == [(0,), (1,), (2,), (3,), (4, 5)]
    assert [p.size for p in plans] == [4, 12, 4, 12, 4]
    assert [p.start for p in plans] == [0, 4, 16, 20, 32] and plans[4].offsets == (32, 34)
    assert rule.bucket_fills([3, 10, 1, 10, 2, 2], 5) == [3, 10, 1, 10, 4]
    assert len(rule.plan_buckets([], 5)) == 1  # no parameters: one empty bucket, as the runtime makes
    assert rule.bucket_elements(25.0, 4) == 25 * 2**20 // 4 and rule.bucket_elements(1e-9, 4) == 1


@pytest.mark.parametrize("dp,multiple", [(1, 128), (2, 128), (3, 384), (4, 256), (8, 512)])
def test_the_aligned_rule_cuts_alike_and_pads_as_documented(dp, multiple):
    """ZeRO-0/1/2's buffers: the same cut; each parameter at a multiple of 64 elements, each bucket
    a multiple of 128 elements and of dp shards of 64; what the collectives move, padded."""
    sizes = [3, 10, 1, 10, 2, 2]
    plans = rule.plan_buckets(sizes, 5, dp_size=dp, aligned=True)
    assert [p.members for p in plans] == [(0,), (1,), (2,), (3,), (4, 5)]
    assert rule.bucket_multiple(dp, aligned=True) == multiple
    assert [p.size for p in plans] == [multiple] * 5 and [p.start for p in plans] == [i * multiple for i in range(5)]
    assert plans[4].offsets == (4 * multiple, 4 * multiple + 64)  # the second parameter after 62 elements of padding
    assert rule.bucket_fills(sizes, 5, dp, aligned=True) == [multiple] * 5
    # fractional shares (the planner's under tensor parallelism) round up alike
    assert rule.bucket_fills([100.5, 3.25], 1000, dp, aligned=True) == [rule.round_up(128 + 3.25, multiple)]


def test_parallel_auto_prices_the_runs_own_bucket_size(monkeypatch):
    """`--parallel auto` hands the planner the run's --bucket-mb, as `strata plan --bucket-mb` does."""
    from strata.config import train_config
    from strata.plan.inputs import build_cluster
    from strata.train import auto
    seen = []

    def search(work, cluster, **kwargs):
        seen.append(work.bucket_mb)
        return [], []
    monkeypatch.setattr(auto, "local_cluster", lambda world: build_cluster("A100-80G", 1, world, None, "ib-200"))
    monkeypatch.setattr(auto, "search", search)
    with pytest.raises(ConfigError):  # no layout: the search was stubbed
        auto.choose(train_config(parallel="auto", bucket_mb=3.5, micro_batch=1), 2, get_preset("tiny"))
    assert seen == [3.5]
