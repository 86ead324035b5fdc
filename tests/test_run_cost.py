"""The cost of a training run (strata plan --tokens, --price-per-device-hour, --days): the
arithmetic, the smallest cluster that finishes in time, and published device-hours."""

import json
import re

import pytest

from strata.cli import main as strata_main
from strata.errors import ConfigError
from strata.model.presets import get_preset
from strata.plan.cost import estimate
from strata.plan.inputs import build_cluster, workload
from strata.plan.run_cost import parse_count, run_cost, smallest_cluster
from strata.plan.search import search
from strata.rules.layout import Layout


def test_token_counts_read_with_their_suffixes():
    assert [parse_count(t, "--tokens") for t in ("2T", "300B", "300G", "1.5e12", "10M", "800k", "7")] == \
        [2e12, 3e11, 3e11, 1.5e12, 1e7, 8e5, 7.0]
    for bad in ("0", "-1T", "abc", "nanT", "inf", "T"):
        with pytest.raises(ConfigError, match="--tokens"):
            parse_count(bad, "--tokens")


def test_days_device_hours_and_price_follow_the_throughput():
    work, cluster = workload(get_preset("llama3-8b"), 64, 2048, "bf16"), build_cluster("H100-80G", 2, 8, None, "ib-200")
    e = estimate(work, cluster, Layout(dp=8, tp=2, zero=1))
    cost = run_cost(e, 1e12, 2.5)
    assert cost.train_days == pytest.approx(1e12 / e.tokens_per_s / 86400)
    assert cost.device_hours == pytest.approx(cost.train_days * 24 * 16)
    assert cost.price == pytest.approx(2.5 * cost.device_hours)
    assert run_cost(e, 1e12).price is None


def test_days_picks_the_first_node_count_that_finishes_in_time_and_says_so(capsys):
    """`--days` bisects the node count: the cluster it names trains the tokens in time with its
    best layout, one node fewer does not (or runs nothing). 500B tokens: about a dozen nodes,
    doubled to 16 and bisected between 8 and 16 (2T took 56 nodes: 12 searches of up to 512
    devices and the check below on 440, for the same rule)."""
    assert strata_main(["plan", "--model", "llama3-8b", "--device", "H100-80G", "--nics-per-node", "8",
                        "--global-batch", "512", "--seq-len", "4096", "--tokens", "500B", "--days", "10",
                        "--no-offload", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "(the fewest nodes within 10 days)" in out and "| days | device-hours |" in out
    days, nodes = re.search(r": ([\d.,]+) days on (\d+) x 8 H100-80G \(the fewest", out).groups()
    nodes = int(nodes)
    assert float(days.replace(",", "")) <= 10 and nodes > 1
    work = workload(get_preset("llama3-8b"), 512, 4096, "bf16")
    fewer, _ = search(work, build_cluster("H100-80G", nodes - 1, 8, None, "ib-400", nics_per_node=8), offload=False)
    assert not fewer or run_cost(fewer[0], 5e11).train_days > 10


def test_the_bisection_finds_the_first_count_that_finishes():
    """smallest_cluster's doubling and bisection on a made-up throughput: every count from 1 to 40
    as the first that finishes, found with about 2·log2 of it calls."""
    class Best:
        def __init__(self, nodes):
            self.tokens_per_s = 1e12 / 86400 * nodes  # one node: a trillion tokens a day
            self.layout = Layout(dp=nodes)

    for first in range(1, 41):
        calls = []

        def best_at(nodes):
            calls.append(nodes)
            return Best(nodes)
        nodes, best = smallest_cluster(best_at, first * 1e12, 1.0)
        assert nodes == first and best.layout.dp == first
        assert len(calls) <= 2 * first.bit_length() + 1


# Published: Touvron et al. 2023 (LLaMA, Table 15): 65B, 1.4T tokens, 1,022,362 A100-80GB hours;
# Touvron et al. 2023 (Llama 2, Table 2): 70B, 2T tokens, 1,720,320 A100-80GB hours. Both on 2048
# GPUs with 4M-token batches; the planner picks its own layout on 256 DGX nodes (8 NICs each).
PUBLISHED_HOURS = {"llama-65b": (2048, 2048, "1.4T", 1_022_362), "llama-70b": (1024, 4096, "2T", 1_720_320)}


@pytest.mark.parametrize("name", list(PUBLISHED_HOURS))
def test_device_hours_land_within_a_quarter_of_the_published(name, capsys):
    batch, seq_len, tokens, hours = PUBLISHED_HOURS[name]
    assert strata_main(["plan", "--model", name, "--nodes", "256", "--nics-per-node", "8", "--global-batch",
                        str(batch), "--seq-len", str(seq_len), "--tokens", tokens, "--price-per-device-hour", "1.5",
                        "--no-offload", "--top", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["layouts"][0]
    assert best["device_hours"] == pytest.approx(hours, rel=0.25), best["device_hours"]
    assert best["price"] == pytest.approx(1.5 * best["device_hours"])
    assert best["train_days"] == pytest.approx(best["device_hours"] / 24 / 2048)


def _fake_estimate(tokens_per_s: float, nodes: int):
    from types import SimpleNamespace
    return SimpleNamespace(tokens_per_s=tokens_per_s, layout=SimpleNamespace(world_size=8 * nodes))


def test_days_gives_up_after_two_doublings_without_a_faster_run_and_not_before():
    """Past what the global batch lets devices share, more nodes are no faster: the search stops
    after two such doublings (not at 65,536 nodes, minutes later), and one flat doubling before a
    faster one does not stop it."""
    asked = []

    def plateau(nodes):  # as fast as 4 nodes from there on
        asked.append(nodes)
        return _fake_estimate(1e6 * min(nodes, 4), nodes)
    with pytest.raises(ConfigError, match="2 doublings of the nodes after it were no faster"):
        smallest_cluster(plateau, tokens=1e12, days=1.0)
    assert max(asked) == 16  # 4 the fastest; 8 and 16 no faster

    def flat_then_faster(nodes):  # 2 nodes no faster than 1, 4 fast enough
        return _fake_estimate({1: 1e6, 2: 1e6, 3: 1e6}.get(nodes, 1e9), nodes)
    nodes, _ = smallest_cluster(flat_then_faster, tokens=1e12, days=1.0)
    assert nodes == 4
