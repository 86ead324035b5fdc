"""The expected cost of a run (strata/plan/goodput.py): the ideal run plus checkpoint saves,
evaluations and failures, each a named term, so that expected = ideal + their sum; each term's
formula on numbers worked by hand; the counts by strata train's own rules and the bytes its
checkpoints hold; more devices, more failures a day; the JSON; and the new flags' bad input."""

import json
import math
import re
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from strata.cli import main as strata_main
from strata.config import train_config
from strata.model.presets import get_preset
from strata.plan.cost import Workload, estimate
from strata.plan.goodput import FAILURE_RATE, GoodputSettings, checkpoint_bytes, evaluations, losses, node_write_bytes
from strata.plan.inputs import build_cluster, workload
from strata.plan.run_cost import expected_cost, run_cost
from strata.rules.layout import Layout
from strata.train.preflight import saves_after
from strata.train.trainer import evaluates_after, train

from cli_runner import run_strata
from distributed import run_on_ranks

PLAN = ["plan", "--model", "llama3-8b", "--device", "H100-80G", "--nodes", "4", "--nics-per-node", "8",
        "--global-batch", "512", "--seq-len", "4096", "--tokens", "2T", "--no-offload", "--top", "3"]


def _plan_json(*extra: str, capsys) -> dict:
    assert strata_main([*PLAN, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


# --- the identity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [(), ("--price-per-device-hour", "2.5", "--save-every", "200", "--eval-every", "500"),
                                   ("--failure-rate", "1e-4", "--restart-minutes", "30", "--storage-bandwidth", "0.2")])
def test_expected_cost_is_the_ideal_cost_plus_the_named_overheads(extra, capsys):
    out = _plan_json(*extra, capsys=capsys)
    for layout in out["layouts"]:
        ideal, expected, overheads = layout["ideal"], layout["expected"], layout["overheads"]
        assert set(overheads) == {"checkpoints", "evaluation", "failures"}
        assert all(seconds > 0 for seconds in overheads.values()), overheads
        added = sum(overheads.values())
        assert expected["train_days"] * 86400 == pytest.approx(ideal["train_days"] * 86400 + added, rel=1e-12)
        assert expected["device_hours"] == pytest.approx(ideal["device_hours"] + added / 3600 * out["world"], rel=1e-12)
        if ideal["price"] is not None:
            assert expected["price"] - ideal["price"] == pytest.approx(2.5 * added / 3600 * out["world"], rel=1e-9)
        # failures lengthen the run and the longer run has more: the term is the expected run's own
        failures_per_s = layout["goodput"]["failures_per_hour"] / 3600
        per_failure = layout["goodput"]["restart_s"] + layout["goodput"]["save_s"] + \
            layout["goodput"]["lost_s_per_failure"]
        assert overheads["failures"] == pytest.approx(failures_per_s * expected["train_days"] * 86400 * per_failure,
                                                      rel=1e-12)
        assert layout["goodput"]["ratio"] == pytest.approx(ideal["train_days"] / expected["train_days"], rel=1e-12)


def test_the_json_keeps_the_ideal_at_the_top_and_gives_both_by_name(capsys):
    out = _plan_json("--price-per-device-hour", "2", capsys=capsys)
    best = out["layouts"][0]
    for key in ("train_days", "device_hours", "price"):
        assert best[key] == best["ideal"][key]  # what every reader of the JSON read before
        assert best["expected"][key] > best["ideal"][key]
    assert set(best["ideal"]) == set(best["expected"]) == {"train_days", "device_hours", "price"}
    assert {"checkpoint_bytes", "save_s", "save_every_steps", "saves", "eval_s", "evaluations", "failures_per_hour",
            "restart_s", "lost_s_per_failure", "steps", "ratio"} <= set(best["goodput"])


def test_explain_says_where_the_difference_goes(capsys):
    assert strata_main([*PLAN, "--explain", "--eval-every", "1000"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("the expected run:"):].splitlines()
    shares = {line.split()[0]: float(line.split()[1].strip("+%:")) for line in lines[1:4]}
    assert set(shares) == {"checkpoints", "evaluation", "failures"}
    expected, ideal = (float(x.replace(",", "")) for x in
                       re.match(r"the expected run: ([\d,.]+) days where the ideal takes ([\d,.]+)", lines[0]).groups())
    # the shares (rounded to 0.1%) add up to the expected run over the ideal one
    assert sum(shares.values()) == pytest.approx((expected / ideal - 1) * 100, abs=0.3)
    assert "saves of" in lines[1] and "Young's interval" in lines[1] and "evaluations" in lines[2]
    assert "expected interruptions" in lines[3]


# --- each term on numbers worked by hand -------------------------------------------------------
def _fake(tokens_per_step: int, step_s: float, tflops: float, layout: Layout):
    return SimpleNamespace(tokens_per_s=tokens_per_step / step_s, step_time_s=step_s, tflops_per_device=tflops,
                           layout=layout)


def test_each_overhead_follows_its_formula():
    """llama3-8b, 64 x 1024 tokens a step, 2 s a step on 2 nodes of 8 (dp=2, tp=8, ZeRO-1), 1,000
    steps: saves every 100 steps, evaluations every 250 of 2 global batches, 1e-3 interruptions per
    device-hour, 5 minutes to restart, 1 GB/s."""
    model = get_preset("llama3-8b")
    work = Workload(model, 64, 1024)
    e = _fake(64 * 1024, 2.0, 300.0, Layout(dp=2, tp=8, zero=1))
    settings = GoodputSettings(save_every="100", eval_every=250, eval_batches=2, storage_bandwidth=1.0,
                               failure_rate=1e-3, restart_minutes=5)
    lost = losses(work, e, 1000 * 64 * 1024, 8, settings)
    psi = model.num_params()
    assert lost.checkpoint_bytes == 12 * psi  # fp32 masters + Adam's two moments
    assert lost.save_s == 12 * psi / 16 * 8 / 1e9  # ZeRO-1: each node writes its 8 ranks' shards
    assert (lost.saves, lost.save_every, lost.checkpoints) == (10, 100, 10 * lost.save_s)
    assert lost.evaluations == 5  # before step 1, after 250, 500, 750, 1000
    forward = 64 * 1024 * model.flops_per_token(1024) / 3 / (300e12 * 16)
    assert lost.eval_s == pytest.approx(2 * forward, rel=1e-12)
    assert lost.evaluation == pytest.approx(5 * 2 * forward, rel=1e-12)
    rate = 1e-3 * 16 / 3600
    per_failure = 300 + lost.save_s + 100 * 2.0 / 2
    steady = 2000 + lost.checkpoints + lost.evaluation
    assert lost.failures == pytest.approx(rate * per_failure * steady / (1 - rate * per_failure), rel=1e-12)
    assert lost.expected_failures(2000) == pytest.approx(rate * (steady + lost.failures), rel=1e-12)


def test_the_default_interval_is_youngs_and_no_failures_save_at_the_end_only():
    model = get_preset("llama3-8b")
    work = Workload(model, 64, 1024)
    e = _fake(64 * 1024, 2.0, 300.0, Layout(dp=2, tp=8, zero=1))
    lost = losses(work, e, 10**5 * 64 * 1024, 8, GoodputSettings())
    save_s, rate = 12 * model.num_params() / 2 / 1e9, FAILURE_RATE * 16 / 3600
    assert lost.young and lost.save_every == round(math.sqrt(2 * save_s / rate) / 2.0)
    quiet = losses(work, e, 10**5 * 64 * 1024, 8, GoodputSettings(failure_rate=0))
    assert (quiet.saves, quiet.save_every, quiet.failures) == (1, 10**5, 0.0)
    timed = losses(work, e, 10**5 * 64 * 1024, 8, GoodputSettings(save_every="30m"))
    assert (timed.save_every, timed.saves, timed.young) == (900, math.ceil(10**5 / 900), False)


@pytest.mark.parametrize("layout,per_node,share", [
    (Layout(dp=2, tp=8, zero=1), 8, 1 / 2),  # every rank its 1/16: a node 8 of them
    (Layout(dp=2, tp=4, pp=2), 8, 1 / 2),  # the first replica: stage 0 on node 0, stage 1 on node 1
    (Layout(dp=4, tp=2), 8, 1.0),  # the first replica's 2 ranks, on node 0
    (Layout(dp=1, tp=2, pp=4), 8, 1.0),  # 4 stages of 2 ranks, all on node 0
    (Layout(dp=2, tp=8, pp=2), 4, 1 / 4),  # a stage's 8 ranks over 2 nodes; stage 1 on nodes 4 and 5
    (Layout(dp=8, zero=3), 8, 1.0),  # one node: it writes everything
])
def test_the_fullest_node_writes_its_share(layout, per_node, share):
    assert node_write_bytes(layout, per_node, 1e12) == pytest.approx(share * 1e12, rel=1e-12)


@pytest.mark.parametrize("every", [0, 1, 3, 5, 10, 20])
def test_saves_and_evaluations_are_counted_by_strata_trains_own_rules(every):
    steps = 10
    cfg = train_config(model="tiny", steps=steps, eval_every=every, save="ck", save_every=every)
    assert evaluations(steps, every) == 1 + sum(evaluates_after(cfg, done) for done in range(1, steps + 1))
    if every:
        assert math.ceil(steps / every) == sum(saves_after(cfg, done) for done in range(1, steps + 1))


def _written_bytes(settings: dict, save_dir: str) -> float:
    """This rank's bytes of the checkpoint strata train wrote (its shard's tensors)."""
    import torch.distributed as dist
    train(train_config(model="tiny", steps=1, seq_len=16, global_batch=4, micro_batch=1, eval_batches=1,
                       progress=False, save=save_dir, **settings))
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors = load_file(f"{save_dir}/step_000001/shard_{rank}.safetensors")
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("zero", [0, 1])
def test_the_checkpoint_bytes_are_what_strata_train_writes(zero, tmp_path):
    """Two ranks, each its own node: under ZeRO-0 the first writes all of it, under ZeRO-1 each its
    half; in all, the planner's 12 bytes per parameter (the tp-split vocabulary has no padding here)."""
    written = run_on_ranks(_written_bytes, 2, {"zero": zero}, str(tmp_path / "ck"), timeout=300)
    total = checkpoint_bytes(Workload(get_preset("tiny"), 4, 16, "fp32"))
    assert sum(written) == total
    planned = node_write_bytes(Layout(dp=2, zero=zero), 1, total)
    assert max(written) == pytest.approx(planned, rel=1e-3)  # ZeRO's shards: equal to a padding element


# --- scale ------------------------------------------------------------------------------------------
def test_more_devices_are_interrupted_more_often():
    """llama3-8b data parallel on 1 to 64 nodes: the failures a day grow with the devices, and take
    a larger share of the run."""
    work = workload(get_preset("llama3-8b"), 1024, 4096, "bf16")
    per_day, share = [], []
    for nodes in (1, 4, 16, 64):
        cluster = build_cluster("H100-80G", nodes, 8, None, "ib-400", nics_per_node=8)
        e = estimate(work, cluster, Layout(dp=8 * nodes, zero=1))
        cost = expected_cost(work, e, 1e12, 8, GoodputSettings())
        per_day.append(cost.losses.expected_failures(1e12 / e.tokens_per_s) / cost.expected.train_days)
        share.append(cost.losses.failures / (cost.expected.train_days * 86400))
    assert per_day == sorted(per_day) and len(set(per_day)) == 4, per_day
    assert per_day[-1] / per_day[0] == pytest.approx(64, rel=1e-9)  # the rate is per device-hour
    assert share == sorted(share) and len(set(share)) == 4, share


def test_llama3_405b_on_16k_h100s_comes_out_near_its_published_goodput():
    """Llama 3 (arXiv 2407.21783): over 90% effective training time on 16,384 H100s, with the 466
    interruptions the default rate is taken from. Its layout (tp 8, pp 16, dp 128, ZeRO-1) at 8K
    tokens and 16M-token batches, the defaults unchanged: 91.9% on the day this was written."""
    work = workload(get_preset("llama3.1-405b"), 2048, 8192, "bf16")
    cluster = build_cluster("H100-80G", 2048, 8, None, "ib-400", nics_per_node=8)
    e = estimate(work, cluster, Layout(dp=128, tp=8, pp=16, zero=1, sequence_parallel=True, virtual_stages=8,
                                       schedule="interleaved"))
    cost = expected_cost(work, e, 15.6e12, 8, GoodputSettings())
    assert 0.88 <= cost.goodput <= 0.95, cost.goodput
    assert cost.losses.failures > 5 * cost.losses.checkpoints  # failures dominate at this scale
    # the ideal cost is the planner's steady state, untouched
    assert cost.ideal == run_cost(e, 15.6e12)


# --- bad input -----------------------------------------------------------------------------------
TINY = ["plan", "--model", "tiny", "--gpus-per-node", "2"]
BAD = [
    ([*TINY, "--save-every", "100"], "--save-every 100: needs --tokens"),
    ([*TINY, "--failure-rate", "1e-5"], "--failure-rate 1e-05: needs --tokens"),
    ([*TINY, "--tokens", "1B", "--save-every", "0"], "--save-every 0: give a number of steps >= 1, or a time"),
    ([*TINY, "--tokens", "1B", "--save-every", "2d"], "--save-every 2d: give a number of steps >= 1, or a time"),
    ([*TINY, "--tokens", "1B", "--save-every", "5s"], "--save-every 5s: give a number of steps"),
    ([*TINY, "--tokens", "1B", "--eval-every", "-1"], "--eval-every -1: must be >= 0"),
    ([*TINY, "--tokens", "1B", "--eval-batches", "0"], "--eval-batches 0: must be >= 1"),
    ([*TINY, "--tokens", "1B", "--storage-bandwidth", "0"], "--storage-bandwidth 0.0: must be a number of GB/s > 0"),
    ([*TINY, "--tokens", "1B", "--storage-bandwidth", "inf"], "--storage-bandwidth inf: must be a number of GB/s"),
    ([*TINY, "--tokens", "1B", "--failure-rate", "-1"], "--failure-rate -1.0: must be a number of interruptions"),
    ([*TINY, "--tokens", "1B", "--failure-rate", "nan"], "--failure-rate nan: must be a number"),
    ([*TINY, "--tokens", "1B", "--restart-minutes", "-3"], "--restart-minutes -3.0: must be a number of minutes"),
    ([*TINY, "--tokens", "1B", "--failure-rate", "100"], "the run never finishes: at 100 interruptions per device-hour"),
    ([*TINY, "--inference", "--eval-every", "10"], "--eval-every 10: only without --inference"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[n[:40] for _, n in BAD])
def test_bad_goodput_flags_are_one_line_exit_code_2_and_no_traceback(args, needle):
    result = run_strata(*args)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("strata: error:") and needle in lines[0], lines
