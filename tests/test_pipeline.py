"""Pipeline parallelism against the single-process run (every schedule, 2 and 4 stages, 1, p and
2p+1 micro-batches; 3D with ZeRO-1 on 8 ranks), its measured activation memory and bubble, the
stage split, the trace and the settings it refuses."""

import functools
import json
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from strata.config import train_config
from strata.distributed.mesh import ParallelDims, pipeline_links
from strata.errors import ConfigError
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.parallel.pipeline.executor import PipelineExecutor
from strata.parallel.pipeline.stage import keep_stage
from strata.parallel.pipeline.timeline import plot_schedule, read_trace
from strata.rules.pipeline_cut import balanced_split, make_layout
from strata.rules.schedules import build, simulate
from strata.train.spec import resolve
from strata.train.trainer import train

from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=32, steps=10, progress=False, peak_flops=1e10, eval_batches=1,
            lr=3e-3, seed=3, micro_batch=1)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]


def _settings(p, schedule, v, m):
    # tiny has 2 blocks: with the embedding and the head, 4 units, enough for p·v <= 4 chunks;
    # 4 stages x 2 virtual stages need 8, so that case uses 6 blocks
    return dict(schedule=schedule, virtual_stages=v, global_batch=m, n_layers=6 if p * v > 4 else None)


def _summary(settings, keep_state=False):
    s = train(train_config(**{**BASE, **settings}), keep_state=keep_state)
    return {"losses": s["losses"], "val": s["val_losses"], "state": s.get("state"), "records": s["records"]}


@functools.lru_cache(maxsize=None)
def single_process(dtype, n_layers, m, model="tiny"):
    return _summary(dict(dtype=dtype, n_layers=n_layers, global_batch=m, model=model), keep_state=True)


def _every_schedule(p, dtype):
    out = {}
    for schedule, v in SCHEDULES:
        for m in (1, p, 2 * p + 1):
            out[(schedule, m)] = _summary({**_settings(p, schedule, v, m), "dtype": dtype, "pp": p})
    return out


@functools.lru_cache(maxsize=None)
def pipelined(p, dtype):
    return run_on_ranks(_every_schedule, p, p, dtype, timeout=600)


# fp64 to 1e-10: every schedule, on 2 and 4 stages, alone and composed, in tests/test_pipeline_matrix.py
@pytest.mark.parametrize("dtype,rtol", [("fp32", 1e-5)])
@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_reproduces_the_single_process_losses(p, dtype, rtol):
    ranks = pipelined(p, dtype)
    for schedule, v in SCHEDULES:
        for m in (1, p, 2 * p + 1):
            settings = _settings(p, schedule, v, m)
            reference = single_process(dtype, settings["n_layers"], m)
            for rank in ranks:  # every rank reports the same loss (the last stage's, shared)
                got = rank[(schedule, m)]
                torch.testing.assert_close(got["losses"], reference["losses"], rtol=rtol, atol=0,
                                           msg=f"{schedule} m={m}")
                torch.testing.assert_close([x for _, x in got["val"]], [x for _, x in reference["val"]],
                                           rtol=rtol, atol=0)


def _three_d(dtype, schedule, v):
    settings = dict(dtype=dtype, dp=2, tp=2, pp=2, zero=1, schedule=schedule, virtual_stages=v,
                    global_batch=6, sequence_parallel=True)
    return _summary(settings, keep_state=True)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("dtype,rtol", [("fp64", 1e-10), ("fp32", 1e-5)])
def test_3d_with_zero1_on_8_ranks_reproduces_the_single_process_run(dtype, rtol, schedule, v):
    ranks = run_on_ranks(_three_d, 8, dtype, schedule, v, timeout=600)
    reference = single_process(dtype, None, 6)
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=rtol, atol=0)
    # the final parameters, gathered over tp and pp; Adam divides by sqrt(v), so an element whose
    # gradients are ~0 moves by rounding-level differences times lr: a wider absolute tolerance
    for name, value in reference["state"].items():
        torch.testing.assert_close(ranks[5]["state"][name], value, rtol=rtol * 100, atol=rtol * 10)


def _tied(schedule, v):
    return _summary(dict(model="tiny-gpt2", dtype="fp64", pp=2, global_batch=4, schedule=schedule,
                         virtual_stages=v), keep_state=True)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("zb", 1)])
def test_tied_embeddings_stay_in_sync_across_the_first_and_last_stage(schedule, v):
    ranks = run_on_ranks(_tied, 2, schedule, v, timeout=300)
    reference = single_process("fp64", None, 4, model="tiny-gpt2")
    torch.testing.assert_close(ranks[0]["losses"], reference["losses"], rtol=1e-10, atol=0)
    torch.testing.assert_close(ranks[1]["state"]["embed.weight"], reference["state"]["embed.weight"],
                               rtol=1e-8, atol=1e-10)


# --- memory: the activations each schedule keeps, counted from the saved tensors -------------------
def _peaks(p):
    out = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (1, p, 2 * p, 4 * p):
            s = train(train_config(**{**BASE, "steps": 1, "pp": p, "schedule": schedule, "global_batch": m}))
            out[(schedule, m)] = s["records"][-1]["peak_activation_bytes"]
    return out


def test_gpipe_activation_memory_grows_with_micro_batches_1f1b_is_bounded_by_p():
    p = 2
    first_stage = run_on_ranks(_peaks, p, p, timeout=300)[0]
    one = first_stage[("gpipe", 1)]  # one micro-batch through the first stage
    assert one > 0
    for m in (1, p, 2 * p, 4 * p):
        assert first_stage[("gpipe", m)] == m * one
        assert first_stage[("1f1b", m)] == min(m, p) * one


# --- bubble: the executor on stages of known cost, on a clock it keeps itself -----------------------
# Each rank keeps a virtual clock, and every activation and gradient carries (as its values) the
# time its producer finished: an action starts when its rank is free and its input has arrived,
# and takes its cost. The executor's own sends, receives and order of actions decide when each
# input arrives, so the per-rank idle time it produces must equal the schedule's simulation
# exactly, whatever the machine is doing (sleeping stages timed by the wall clock were at the
# mercy of its load).
_CLOCK = {"now": 0.0, "busy": 0.0}


def _work(arrival: float, cost: float) -> float:
    start = max(_CLOCK["now"], arrival)
    _CLOCK["now"] = start + cost
    _CLOCK["busy"] += cost
    return _CLOCK["now"]


class _Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, chunk, first):
        ctx.chunk = chunk
        return torch.full_like(x, _work(0.0 if first else x.max().item(), chunk.cost["F"]))

    @staticmethod
    def backward(ctx, grad):
        chunk = ctx.chunk
        arrival = 0.0 if chunk.last else grad.max().item()  # the loss's own gradient is here already
        done = _work(arrival, chunk.cost["B"])
        if chunk.store is not None:  # zero-bubble: the weight gradient comes later
            chunk.store.defer(lambda: _work(0.0, chunk.cost["W"]))
        elif "W" in chunk.cost:
            done = _work(0.0, chunk.cost["W"])
        return torch.full_like(grad, done), None, None


class _TimedChunk(nn.Module):
    """A pipeline chunk that takes a known time on the virtual clock: forward F, backward B (+ W)."""

    def __init__(self, shape, cost, last):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.shape, self.cost, self.last, self.store = shape, cost, last, None

    def forward(self, x, targets=None):
        first = not x.is_floating_point()
        h = self.weight.expand(self.shape) if first else x * self.weight
        h = _Timed.apply(h, self, first)
        return h.mean() if self.last else h


def _measure_bubble(schedule, p, m, v, cost):
    shape = (1, 4, 8)
    layout = make_layout(get_preset("tiny").with_overrides(n_layers=p * v), p, v, 4, ",".join(["1"] * (p * v)))
    chunks = {c: _TimedChunk(shape, cost, c == p * v - 1) for c in layout.chunks_of(dist.get_rank())}
    links = pipeline_links(ParallelDims(pp=p), dist.get_rank(), wraps=v > 1, timeout_s=60)
    executor = PipelineExecutor(chunks, layout, schedule, dist.group.WORLD, links, shape, torch.float32,
                                torch.device("cpu"))
    for chunk in chunks.values():
        chunk.store = executor.store
    batch = [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))] * m
    _CLOCK.update(now=0.0, busy=0.0)
    executor.step(batch)
    makespan = torch.tensor([_CLOCK["now"]], dtype=torch.float64)
    dist.all_reduce(makespan, op=dist.ReduceOp.MAX)
    return 1 - _CLOCK["busy"] / makespan.item()


@pytest.mark.parametrize("schedule,v,cost", [
    ("gpipe", 1, {"F": 1.0, "B": 2.0}),
    ("1f1b", 1, {"F": 1.0, "B": 2.0}),
    ("interleaved", 2, {"F": 0.5, "B": 1.0}),  # each of the 2 chunks does half a stage's work
    ("zb", 1, {"F": 1.0, "B": 1.0, "W": 1.0}),
])
def test_the_executor_idles_exactly_as_the_schedule_says(schedule, v, cost):
    p, m = 4, 8
    measured = run_on_ranks(_measure_bubble, p, schedule, p, m, v, cost, timeout=300)
    theory = simulate(build(schedule, p, m, v), p * v, cost)
    assert measured == [theory.idle_fraction(rank) for rank in range(p)]
    if schedule in ("gpipe", "1f1b"):
        assert theory.idle_fraction(0) == pytest.approx((p - 1) / (m + p - 1))
    else:  # interleaved and zero-bubble idle less than 1F1B
        assert max(measured) < (p - 1) / (m + p - 1)


# --- trace and plot -----------------------------------------------------------------------------
def _traced(path):
    return train(train_config(**{**BASE, "steps": 2, "pp": 2, "global_batch": 4, "trace": path}))["records"][-1]


def test_trace_holds_every_action_and_plots(tmp_path):
    trace = str(tmp_path / "trace.json")
    records = run_on_ranks(_traced, 2, trace, timeout=300)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    waits = [e for e in events if e.get("cat") == "exposed communication"]
    # each rank's blocked waits of the last step, on a row of its own under its actions' row
    assert {e["tid"] for e in waits} == {1000, 1001} and all(e["dur"] >= 0 for e in waits)
    for rank, record in enumerate(records):  # the step log sums them (with the waits before the schedule)
        exposed = record["comm_exposed_seconds_by_op"]
        assert any(name.endswith("/pp") for name in exposed), exposed  # the stages' transfers
        in_trace = sum(e["dur"] for e in waits if e["tid"] == 1000 + rank) / 1e6
        assert 0 < in_trace <= sum(exposed.values()) + 1e-6
    ranks = read_trace(trace)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert sorted((a["kind"], a["microbatch"]) for a in r["actions"]) == \
            sorted((k, i) for k in "FB" for i in range(4))
    assert 0 < records[0]["bubble"] < 1
    out = tmp_path / "schedule.png"
    plot_schedule(ranks, str(out), "1f1b")
    assert out.stat().st_size > 10_000


# --- splitting the model ----------------------------------------------------------------------------
def test_balanced_split_minimises_the_largest_chunk():
    assert balanced_split([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_split([0.1, 1, 1, 0.4], 2) == [2, 2]
    assert balanced_split([1, 5, 1, 1, 1], 3) == [1, 1, 3]
    assert balanced_split([1] * 4, 4) == [1, 1, 1, 1]


def test_stage_keeps_its_layers_under_their_global_names():
    cfg = get_preset("tiny").with_overrides(n_layers=6)
    layout = make_layout(cfg, 2, 1, 64, "2,4")
    model = build_model(cfg, seed=None)
    keep_stage(model, layout, 1)
    names = {n for n, _ in model.named_parameters()}
    assert {n.split(".")[1] for n in names if n.startswith("blocks.")} == {"2", "3", "4", "5"}
    assert "embed.weight" not in names and "head.weight" in names
    tied = get_preset("tiny-gpt2")
    model = build_model(tied, seed=None)
    keep_stage(model, make_layout(tied, 2, 1, 64), 1)
    assert "embed.weight" in {n for n, _ in model.named_parameters()}  # the head reads it


@pytest.mark.parametrize("settings,message", [
    (dict(pp=2, zero=3, dp=2, schedule="zb"), "not with zero 3: ZeRO-3 gathers a unit for its backward"),
    (dict(pp=2, schedule="interleaved"), "needs virtual_stages 2"),
    (dict(pp=2, virtual_stages=2), "a schedule that runs several chunks per rank (interleaved)"),
    (dict(pp=2, schedule="zigzag"), "valid: gpipe, 1f1b, interleaved, zb"),
    (dict(pp=4, schedule="interleaved", virtual_stages=2), "only 2 layers + embedding + head = 4 units"),
    (dict(pp=2, pp_split="1,2"), "summing to the model's 2 layers"),
    (dict(pp=4, pp_split="1,0,0,1"), "only the first and last chunk may hold no blocks"),
    (dict(trace="t.json"), "only with pp 2 or more"),
])
def test_bad_pipeline_settings_are_refused_with_the_reason(settings, message):
    world = settings.get("pp", 1) * settings.get("dp", 1)
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(train_config(**settings), world)


# --- checkpoints and bf16 -------------------------------------------------------------------------
def _resume(save_dir):
    common = {**BASE, "steps": 6, "pp": 2, "global_batch": 4, "warmup_steps": 2, "schedule": "zb"}
    straight = train(train_config(**common))
    train(train_config(**common, save=save_dir, save_every=3))
    resumed = train(train_config(**common, resume=f"{save_dir}/step_000003"), keep_state=True)
    return straight["losses"], resumed["losses"], resumed["state"]


def test_pipeline_resume_is_bit_exact_and_the_checkpoint_holds_the_whole_model(tmp_path):
    straight, resumed, state = run_on_ranks(_resume, 2, str(tmp_path / "ck"), timeout=300)[0]
    assert resumed == straight[3:]  # exact equality, not a tolerance
    from strata.checkpoint import shards, store
    with store.open_checkpoint(str(tmp_path / "ck" / "step_000006"))[2] as reader:
        saved = shards.read_full(reader)
    model = build_model(get_preset("tiny"), seed=None)
    assert set(saved) == {n for n, _ in model.named_parameters()}  # every stage's layers, full names
    for name, value in saved.items():
        assert torch.equal(value, state[name]), name


def _bf16(schedule):
    return train(train_config(**{**BASE, "pp": 2, "global_batch": 4, "dtype": "bf16", "schedule": schedule}))["losses"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_bf16_pipeline_tracks_the_single_process_bf16_run(schedule):
    losses = run_on_ranks(_bf16, 2, schedule, timeout=300)[0]
    reference = train(train_config(**{**BASE, "global_batch": 4, "dtype": "bf16"}))["losses"]
    torch.testing.assert_close(losses, reference, rtol=2e-3, atol=0)
