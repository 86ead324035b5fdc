"""A pipeline's messages in the dtype of the wire (strata/rules/pipeline_wire.py).

- Counted: under bf16 (and fp16) the hidden states and their gradients cross stages as 2-byte
  sends, under fp32 as 4-byte ones, for 1F1B, interleaved, zero-bubble and 2BW; the planner prices
  a send in the bytes the runtime moves.
- The rule's mathematics: a pipeline equals the single-process run that rounds the hidden states
  to the wire at the same cuts, forward and backward (`round_at_cuts`). In fp64 with the wire
  forced to bf16, to 1e-10, for every schedule and 4 stages (which tests the rounding itself, in
  arithmetic that adds no error of its own); under bf16 and fp16, as the runs are. A stage whose
  output autocast made wider than its weights: the next goes on in its weights' dtype.
- `--gather-dtype bf16` runs with a pipeline (ZeRO-1, bf16 weights on every stage, the tied
  embedding's two copies included) and equals the same layout without one.
fp32 and fp64 runs cast nothing (the wire is their own dtype): tests/test_pipeline.py and
tests/test_pipeline_matrix.py hold them to the single-process run (fp32 1e-5, fp64 1e-10)."""

from __future__ import annotations

import functools

import pytest
import torch

import strata.train.trainer as trainer
from strata.config import layout_of, train_config
from strata.model.presets import get_preset
from strata.rules.dtypes import torch_dtype
from strata.rules.pipeline_cut import make_layout
from strata.rules.schedules import SCHEDULES

from distributed import run_on_ranks

SEQ, M, STEPS = 32, 4, 3  # M: micro-batches per step on a pipeline
BASE = dict(model="tiny", seq_len=SEQ, steps=STEPS, progress=False, peak_flops=1e10, eval_batches=1, lr=3e-3,
            seed=3, micro_batch=1)
ELEMENTS = 1 * SEQ * 64  # one message: micro-batch x sequence x tiny's d_model
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class RoundTrip(torch.autograd.Function):
    """Hidden states rounded to the wire's dtype and widened back, and their gradient likewise:
    what a pipeline cut does to them."""

    @staticmethod
    def forward(ctx, hidden, wire):
        ctx.wire = wire
        return hidden.to(wire).to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.wire).to(grad.dtype), None


def round_at_cuts(model, layout, wire: torch.dtype) -> None:
    """One process's model rounding the hidden states where `layout` cuts it: at the input of each
    later chunk's first block (of the final norm, for a last chunk that holds no block)."""
    for c in range(1, layout.num_chunks):
        blocks = layout.blocks_of(c)
        first = model.layers()[blocks.start] if len(blocks) else model.final_norm
        first.register_forward_pre_hook(lambda _, args: (RoundTrip.apply(args[0], wire), *args[1:]))


def _run(settings: dict) -> dict:
    s = trainer.train(train_config(**{**BASE, **settings}))
    return {"losses": s["losses"], "val": [v for _, v in s["val_losses"]],
            "bytes": [r["comm_bytes_by_op"] for r in s["records"]]}


def _pipelined(runs: list[dict], wire: str | None = None) -> list[dict]:
    """Pipelined runs, in this rank's process; `wire` forces the rule's dtype (fp64 arithmetic
    with a bf16 wire: the rounding alone)."""
    if wire is not None:
        trainer.activation_wire = lambda precision: wire
    return [_run(settings) for settings in runs]


def _references(cases: list[tuple[dict, int, int]], wire: str | None) -> list[dict]:
    """Single-process runs (in a process of their own: the model builder is patched there), each
    rounding at the cuts of its p x v chunks to `wire` (default: the rule's, for its dtype)."""
    build = trainer.parallelize
    out = []
    for settings, p, v in cases:
        def parallelize(model_cfg, cfg, *args, p=p, v=v, **kwargs):
            model, parallel = build(model_cfg, cfg, *args, **kwargs)
            cut = make_layout(model_cfg, p, v, SEQ, None)
            round_at_cuts(model, cut, torch_dtype(wire or trainer.activation_wire(cfg.dtype)))
            return model, parallel
        trainer.parallelize = parallelize
        out.append(_run(settings))
    trainer.parallelize = build
    return out


def _schedule_settings(schedule: str, v: int, dtype: str) -> dict:
    spec = SCHEDULES[schedule]
    return dict(dtype=dtype, schedule=schedule, virtual_stages=v, n_layers=4 if v > 1 else None,
                global_batch=1 if spec.update_per_micro_batch else M, **({"grad_clip": 0.0} if spec.asynchronous else {}))


def _reference_settings(schedule: str, p: int, v: int, dtype: str) -> dict:
    """The one-process run of a p-stage schedule's rule: a flushing schedule's is the plain run;
    2BW's and PipeDream's keep their weight versions (PipeDream's those of p stages)."""
    settings = {**_schedule_settings(schedule, v, dtype), "virtual_stages": 1}
    spec = SCHEDULES[schedule]
    if not spec.asynchronous:
        return {**settings, "schedule": "1f1b"}
    return {**settings, "emulate_stages": p if spec.update_per_micro_batch else 1}


# --- counted: the bytes of the messages --------------------------------------------------------------
# What each of the 2 ranks sends per micro-batch: 1F1B, zero-bubble and 2BW, rank 0 the forward's
# message and rank 1 the backward's; interleaved over 4 chunks, 3 of the 6 hops (rank 0 sends
# 0->1, 2->3 and back 2->1; rank 1 sends 1->2 and back 3->2, 1->0).
COUNTED = [("1f1b", 1, 1), ("interleaved", 2, 3), ("zb", 1, 1), ("2bw", 1, 1)]


@functools.lru_cache(maxsize=None)
def _sends(schedule: str, v: int) -> list[dict[str, list[dict]]]:
    dtypes = ("fp32", "bf16") if SCHEDULES[schedule].asynchronous else ("fp32", "bf16", "fp16")  # 2BW: no fp16
    runs = [{**_schedule_settings(schedule, v, dtype), "pp": 2} for dtype in dtypes]
    ranks = run_on_ranks(_pipelined, 2, runs, timeout=600)
    return [{dtype: run["bytes"] for dtype, run in zip(dtypes, rank)} for rank in ranks]


@pytest.mark.parametrize("schedule,v,per_micro_batch", COUNTED)
def test_activations_and_their_gradients_cross_stages_in_2_bytes_under_bf16_and_4_under_fp32(schedule, v,
                                                                                             per_micro_batch):
    for rank in _sends(schedule, v):
        for dtype, records in rank.items():
            sent = sum(r.get("send/pp", 0) for r in records)  # 2BW's steps send unevenly: the run's total
            assert sent == STEPS * M * per_micro_batch * ELEMENTS * ELEMENT_BYTES[dtype], (dtype, sent)
        assert 2 * sum(r["send/pp"] for r in rank["bf16"]) == sum(r["send/pp"] for r in rank["fp32"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_planner_prices_a_send_in_the_bytes_the_runtime_moves(dtype):
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    # the planner's pipeline bytes are the interior stage's, both directions: on 2 stages, the two ranks' sends
    counted = sum(rank[dtype][-1]["send/pp"] for rank in _sends("1f1b", 1))
    cfg = train_config(**BASE, **{**_schedule_settings("1f1b", 1, dtype), "pp": 2})
    work, cluster = workload(get_preset("tiny"), M, SEQ, dtype), build_cluster("A100-80G", 1, 2, None, "ib-200")
    assert estimate(work, cluster, layout_of(cfg, 2)).comm_bytes["pp"] == counted


# --- the rule's mathematics: a pipeline is the one-process run rounding at its cuts -------------------
EXACT = [(2, "gpipe", 1), (2, "1f1b", 1), (2, "interleaved", 2), (2, "zb", 1), (2, "2bw", 1), (2, "pipedream", 1),
         (4, "1f1b", 1)]  # 4 stages of tiny: (0, 1, 1, 0) blocks, the last cut at the final norm


def _exact_cases(p: int, dtype: str) -> list[tuple[str, int]]:
    """EXACT's schedules of p stages that run in `dtype` (the asynchronous ones refuse fp16)."""
    return [(schedule, v) for stages, schedule, v in EXACT
            if stages == p and not (dtype == "fp16" and SCHEDULES[schedule].asynchronous)]


@functools.lru_cache(maxsize=None)
def _against_reference(p: int, dtype: str, wire: str | None) -> tuple[list[dict], list[dict], list[dict]]:
    """(the pipelined runs, as rank 0 reports them; the references rounding at their cuts; the
    references without rounding), one each per schedule of `p` stages."""
    cases = _exact_cases(p, dtype)
    runs = [{**_schedule_settings(schedule, v, dtype), "pp": p} for schedule, v in cases]
    piped = run_on_ranks(_pipelined, p, runs, wire, timeout=600)[0]
    settings = [_reference_settings(schedule, p, v, dtype) for schedule, v in cases]
    rounded = run_on_ranks(_references, 1, [(s, p, v) for s, (_, v) in zip(settings, cases)], wire, timeout=600)[0]
    plain = run_on_ranks(_pipelined, 1, settings, timeout=600)[0]
    return piped, rounded, plain


@pytest.mark.parametrize("p", [2, 4])
def test_fp64_with_a_bf16_wire_is_the_single_process_run_rounding_at_the_cuts_to_1e_10(p):
    piped, rounded, plain = _against_reference(p, "fp64", "bf16")
    for (schedule, _), got, want, unrounded in zip(_exact_cases(p, "fp64"), piped, rounded, plain):
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-10, atol=0, msg=schedule)
        torch.testing.assert_close(got["val"], want["val"], rtol=1e-10, atol=0, msg=schedule)
        # the rounding is there to find: without it the losses differ by over 1e-6 (measured 3e-5 to 2e-4)
        assert max(abs(a - b) / b for a, b in zip(got["losses"], unrounded["losses"])) > 1e-6, schedule


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_mixed_precision_pipeline_is_the_single_process_run_rounding_at_the_cuts(dtype):
    # measured: equal bit for bit (the same kernels on the same shapes); the tolerance is 1/50 of
    # what the rounding moves the losses by (7e-5 to 3e-4 relative, `plain`)
    piped, rounded, _ = _against_reference(2, dtype, None)
    for (schedule, _), got, want in zip(_exact_cases(2, dtype), piped, rounded):
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0, msg=schedule)
        torch.testing.assert_close(got["val"], want["val"], rtol=1e-6, atol=0, msg=schedule)


# --- a stage whose output is wider than its weights -----------------------------------------------------
class _Stage(torch.nn.Module):
    """A toy stage of bf16 weights. The first outputs fp32, as CUDA autocast's fp32 LayerNorm makes
    BLOOM's embedding do with bf16 weights (measured on an H100; the CPU's autocast keeps bf16); the
    last records the dtype its input arrives in."""

    def __init__(self, first: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8, dtype=torch.bfloat16))
        self.first, self.seen = first, set()

    def forward(self, x, targets=None):
        if self.first:
            return (x.double() + 1).float()[..., None] / 3 * self.weight.float()  # fp32 out of bf16 weights
        self.seen.add(x.dtype)
        return (x * self.weight).float().pow(2).mean()


def _wider_output(m: int):
    import torch.distributed as dist

    from strata.distributed import comm
    from strata.distributed.mesh import ParallelDims, pipeline_links
    from strata.parallel.pipeline.executor import PipelineExecutor
    rank = dist.get_rank()
    stage = _Stage(first=rank == 0)
    layout = make_layout(get_preset("tiny"), 2, 1, 4, "1,1")
    links = pipeline_links(ParallelDims(pp=2), rank, wraps=False, timeout_s=60)
    executor = PipelineExecutor({rank: stage}, layout, "1f1b", dist.group.WORLD, links, (1, 4, 8), torch.bfloat16,
                                torch.device("cpu"))
    comm.counter.reset()
    loss = executor.step([(torch.arange(4).reshape(1, 4) + i, torch.zeros(1, 4)) for i in range(m)])
    return loss.item(), stage.weight.grad.clone(), stage.seen, comm.counter.by_op().get("send/pp", 0)


def test_a_stage_output_wider_than_its_weights_goes_on_in_the_weights_dtype():
    """The rule where autocast widens a stage's output: rounded to the wire and widened to the
    next stage's weights' dtype (bf16 here), not to the sender's; its gradient back likewise."""
    m = 3
    ranks = run_on_ranks(_wider_output, 2, m, timeout=300)
    first, last = _Stage(first=True), _Stage(first=False)
    loss = torch.zeros((), dtype=torch.float64)
    for i in range(m):  # one process: the cut's rounding, the receiver in its weights' dtype
        hidden = RoundTrip.apply(first(torch.arange(4).reshape(1, 4) + i), torch.bfloat16).to(torch.bfloat16)
        out = last(hidden)
        (out / m).backward()
        loss += out.detach().double()
    assert ranks[1][2] == {torch.bfloat16}
    assert ranks[1][0] == loss.item()
    assert torch.equal(ranks[0][1], first.weight.grad) and torch.equal(ranks[1][1], last.weight.grad)
    assert ranks[0][3] == ranks[1][3] == m * 4 * 8 * 2  # each way: m messages of 4 x 8 bf16 elements


# --- --gather-dtype bf16 with a pipeline --------------------------------------------------------------
GATHER = dict(dtype="bf16", zero=1, gather_dtype="bf16", dp=2)
# (model, schedule, v, global batch): 4 micro-batches per rank, or 1 with the tied embedding, whose
# copies' gradients accumulate in bf16 over micro-batches: one process adds the embedding's and the
# head's for each, the pipeline sums each copy's and then the two (4e-5 apart after 6 steps of
# tiny-gpt2, where fp32 masters are 6e-5 away)
GATHERED = [("tiny", "1f1b", 1, 8), ("tiny", "interleaved", 2, 8), ("tiny", "2bw", 1, 8), ("tiny-gpt2", "1f1b", 1, 2)]


def _gathered(model: str, schedule: str, v: int, global_batch: int, pipeline: bool) -> dict:
    settings = _schedule_settings(schedule, v, "bf16") if pipeline else _reference_settings(schedule, 1, v, "bf16")
    return {**settings, **GATHER, "model": model, "global_batch": global_batch, **({"pp": 2} if pipeline else {})}


@functools.lru_cache(maxsize=None)
def _gathered_runs() -> tuple[list[dict], list[dict]]:
    """(rank 0's pipelined runs, pp2 x dp2; the same layouts without a pipeline, dp2), one per GATHERED."""
    piped = run_on_ranks(_pipelined, 4, [_gathered(*case, pipeline=True) for case in GATHERED], timeout=600)[0]
    flat = run_on_ranks(_pipelined, 2, [_gathered(*case, pipeline=False) for case in GATHERED], timeout=600)[0]
    return piped, flat


@pytest.mark.parametrize("case", GATHERED, ids=[f"{m}-{s}" for m, s, _, _ in GATHERED])
def test_bf16_gathers_with_a_pipeline_equal_the_same_layout_without_one(case):
    piped, flat = _gathered_runs()
    got, want = piped[GATHERED.index(case)], flat[GATHERED.index(case)]
    # measured: equal bit for bit; the weights are bf16 on every stage, so nothing is cast at the cuts
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0)
    torch.testing.assert_close(got["val"], want["val"], rtol=1e-6, atol=0)
    model, schedule, v, global_batch = case
    per_micro_batch = next(n for s, _, n in COUNTED if s == schedule)
    sent = sum(r["send/pp"] for r in got["bytes"])
    assert sent == STEPS * global_batch // 2 * per_micro_batch * ELEMENTS * 2
    if model == "tiny-gpt2":  # the two copies' gradients summed in bf16, their dtype, every step
        vocab = get_preset(model).vocab_size
        assert [r["all_reduce/embedding"] for r in got["bytes"]] == [vocab * 64 * 2] * STEPS


def _resume(save_dir: str) -> tuple[list[float], list[float]]:
    common = {**_gathered("tiny-gpt2", "1f1b", 1, 2, pipeline=True), "steps": 6, "warmup_steps": 2}
    straight = trainer.train(train_config(**{**BASE, **common}))
    trainer.train(train_config(**{**BASE, **common}, save=save_dir, save_every=3))
    resumed = trainer.train(train_config(**{**BASE, **common}, resume=f"{save_dir}/step_000003"))
    return straight["losses"], resumed["losses"]


def test_a_pipelined_run_with_bf16_gathers_resumes_bit_for_bit(tmp_path):
    straight, resumed = run_on_ranks(_resume, 4, str(tmp_path / "ck"), timeout=600)[0]
    assert resumed == straight[3:]


def test_the_planner_offers_bf16_gathers_with_a_pipeline_and_the_trainer_accepts_them():
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.search import search
    from strata.train.spec import resolve
    ranked, rejected = search(workload(get_preset("tiny"), 8, SEQ, "bf16"),
                              build_cluster("A100-80G", 1, 4, None, "ib-200"), offload=False, transfers=("fp32", "bf16"))
    assert any(e.layout.pp > 1 and e.layout.zero == 1 and e.layout.gather_dtype == "bf16" for e in ranked + rejected)
    cfg = train_config(**{**BASE, **_gathered("tiny", "1f1b", 1, 8, pipeline=True)})
    assert resolve(cfg, 4).config.layout.gather_dtype == "bf16"  # the one check (rules/layout.py) lets it by
