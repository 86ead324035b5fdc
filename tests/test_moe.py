"""Mixtures of experts and expert parallelism (strata/model/moe.py, strata/parallel/expert.py):
every layout against the single-process run, the auxiliary loss against transformers' function,
capacity drops against a reference of their rule, the all-to-all's counted bytes against the
formula, and checkpoints across expert-parallel layouts."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from strata.config import train_config
from strata.model.moe import MoE, RouterLosses
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.rules.experts import all_to_all_bytes
from strata.train.tensorboard import scalars
from strata.train.trainer import train

from cli_runner import run_strata
from distributed import run_on_ranks

# sequences of 31 tokens and a vocabulary of 251: the dispatch's splits are as uneven as they come
BASE = dict(model="tiny-moe", seq_len=31, steps=6, progress=False, peak_flops=1e10, eval_batches=1, lr=3e-3, seed=7,
            vocab_size=251, global_batch=8, micro_batch=2, grad_clip=0.5)


def _run(settings):
    s = train(train_config(**{**BASE, **settings}), keep_state=settings.get("save") is None)
    return {"losses": s["losses"], "records": s["records"], "state": s.get("state"), "checkpoint": s["checkpoint"]}


def _key(**settings):
    return tuple(sorted(settings.items()))


@functools.lru_cache(maxsize=None)
def single_process(key):
    return _run(dict(key))


@functools.lru_cache(maxsize=None)
def parallel_run(world, key):
    return run_on_ranks(_run, world, dict(key), timeout=600)


LAYOUTS = [
    (2, dict(ep=2)),
    (4, dict(ep=4)),
    (4, dict(dp=4, ep=2, zero=1)),  # dp2 x ep2: experts' states sharded over their own pair of ranks
    (4, dict(dp=4, ep=2, zero=2)),
    (4, dict(tp=2, ep=2)),
    (4, dict(pp=2, ep=2)),
]


@pytest.mark.parametrize("world,layout", LAYOUTS, ids=lambda v: str(v))
def test_expert_parallel_layouts_reproduce_the_single_process_run_in_fp64(world, layout):
    reference = single_process(_key(dtype="fp64"))
    ranks = parallel_run(world, _key(dtype="fp64", **layout))
    aux = [r["aux_loss"] for r in reference["records"]]
    assert all(a > 0 for a in aux)
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-10, atol=0)
        torch.testing.assert_close([r["aux_loss"] for r in rank["records"]], aux, rtol=1e-10, atol=0)
        assert [r["expert_load"] for r in rank["records"]] == [r["expert_load"] for r in reference["records"]]
    for name, value in reference["state"].items():
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=1e-8, atol=1e-10)


def test_the_load_counts_every_routed_token_and_dropless_drops_none():
    record = single_process(_key(dtype="fp64"))["records"][-1]
    cfg = get_preset("tiny-moe")
    tokens = BASE["global_batch"] * BASE["seq_len"]
    assert sum(record["expert_load"]) == tokens * cfg.experts_per_token * cfg.n_layers
    assert record["dropped_tokens"] == 0


def test_the_all_to_all_moves_what_the_formula_says_for_the_rows_routed():
    """Each rank's counted all-to-all bytes in a step equal rules/experts.all_to_all_bytes of the
    rows it sent and received (summed over layers and micro-batches: the formula is linear), and
    the rows the ranks sent add up to the router's count of assignments."""
    cfg = get_preset("tiny-moe")
    ranks = parallel_run(4, _key(dtype="fp64", ep=4))
    for step in range(BASE["steps"]):
        sent_total = 0
        for me, rank in enumerate(ranks):
            record = rank["records"][step]
            rows = record["all_to_all_rows"]
            assert rows["dispatches"] == cfg.n_layers * BASE["global_batch"] // (4 * BASE["micro_batch"])
            expected = all_to_all_bytes(rows["sent"], rows["received"], me, cfg.d_model, 8, cfg.n_experts, 4)
            # the formula counts one exchange of the counts; each dispatch makes one
            expected += (rows["dispatches"] - 1) * all_to_all_bytes([0] * 4, [0] * 4, me, cfg.d_model, 8,
                                                                    cfg.n_experts, 4)
            assert record["comm_bytes_by_op"]["all_to_all/ep"] == pytest.approx(expected, rel=1e-12)
            sent_total += sum(rows["sent"])
        assert sent_total == sum(ranks[0]["records"][step]["expert_load"])


def test_capacity_drops_follow_their_rule_and_expert_parallelism_keeps_them():
    """With a capacity factor each expert takes at most ceil(c·T·k/E) of a micro-batch's
    assignments, in token order; the run under ep 2 drops the same ones (losses to 1e-10)."""
    settings = _key(dtype="fp64", capacity_factor=1.0)
    reference = single_process(settings)
    assert all(r["dropped_tokens"] > 0 for r in reference["records"])
    ranks = parallel_run(2, _key(dtype="fp64", capacity_factor=1.0, ep=2))
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-10, atol=0)
        assert [r["dropped_tokens"] for r in rank["records"]] == [r["dropped_tokens"] for r in reference["records"]]


def _reference_capacity(chosen: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """The rule written as a loop: assignments taken token by token, slot by slot, while their
    expert has room."""
    taken, keep = [0] * n_experts, []
    for expert in chosen.reshape(-1).tolist():
        keep.append(taken[expert] < capacity)
        taken[expert] += 1
    return torch.tensor(keep)


def test_the_capacity_mask_equals_its_loop():
    cfg = get_preset("tiny-moe")
    layer = MoE(cfg, RouterLosses(cfg.n_layers, cfg.router_aux_coef))
    generator = torch.Generator().manual_seed(0)
    for tokens, factor in ((31, 1.0), (64, 0.5), (7, 1.25)):
        chosen = torch.stack([torch.randperm(cfg.n_experts, generator=generator)[:cfg.experts_per_token]
                              for _ in range(tokens)])
        layer.capacity_factor = factor
        capacity = math.ceil(factor * tokens * cfg.experts_per_token / cfg.n_experts)
        assert layer._within_capacity(chosen, tokens).tolist() == \
            _reference_capacity(chosen, cfg.n_experts, capacity).tolist()


def test_the_auxiliary_loss_and_its_gradient_are_transformers_load_balancing_loss():
    """One layer: strata's auxiliary loss is Mixtral's load_balancing_loss_func of the router's
    logits, and the gradient it adds in backward is that of lm_loss + coef * that loss."""
    cfg = get_preset("tiny-moe").with_overrides(n_layers=1, router_aux_coef=0.3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ours = build_model(cfg, dtype=torch.float64, seed=3)
    logits = []
    router = dict(ours.named_modules())["blocks.0.mlp.router"]
    handle = router.register_forward_hook(lambda m, args, out: logits.append(out))
    loss = ours(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    handle.remove()
    hf_aux = load_balancing_loss_func((logits[0].detach(),), cfg.n_experts, cfg.experts_per_token)
    aux = ours.router_losses.take()["aux_loss"]
    torch.testing.assert_close(aux, cfg.router_aux_coef * hf_aux.double(), rtol=1e-6, atol=0)  # HF sums in fp32

    reference = build_model(cfg.with_overrides(router_aux_coef=0.0), dtype=torch.float64, seed=3)
    captured = []
    router = dict(reference.named_modules())["blocks.0.mlp.router"]
    router.register_forward_hook(lambda m, args, out: captured.append(out))
    lm = reference(tokens[:, :-1], tokens[:, 1:])
    probs = F.softmax(captured[0], dim=-1)
    _, chosen = torch.topk(probs, cfg.experts_per_token, dim=-1)
    fraction = F.one_hot(chosen, cfg.n_experts).sum((0, 1)).double() / probs.shape[0]
    (lm + cfg.router_aux_coef * cfg.n_experts * (fraction * probs.mean(0)).sum()).backward()
    for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)


def test_checkpoints_cross_expert_parallel_layouts(tmp_path):
    """Saved at step 3 under ep 4 and under dp4 x ep2 with ZeRO-1 (the experts' moments sharded over
    their pairs of ranks), resumed under ep 2 and in one process: the losses of the uninterrupted
    single-process run (fp32)."""
    whole = single_process(_key(dtype="fp32"))["losses"]
    for name, layout, resume_world, resume_layout in (("ep4", dict(ep=4), 2, dict(ep=2)),
                                                      ("ep2zero1", dict(dp=4, ep=2, zero=1), 1, {})):
        save = str(tmp_path / name)
        first = run_on_ranks(_run, 4, dict(dtype="fp32", save=save, save_every=3, **layout), timeout=600)
        torch.testing.assert_close(first[0]["losses"], whole, rtol=1e-5, atol=0)
        settings = dict(dtype="fp32", resume=f"{save}/step_000003", **resume_layout)
        ranks = run_on_ranks(_run, resume_world, settings, timeout=600) if resume_world > 1 else [_run(settings)]
        torch.testing.assert_close(ranks[0]["losses"], whole[3:], rtol=1e-5, atol=0, msg=name)


@pytest.mark.parametrize("args,needle", [
    (["--nproc", "2", "--ep", "2", "--model", "tiny"], "--ep 2: splits a mixture's experts, and the model has none"),
    (["--nproc", "3", "--ep", "3"], "--ep 3: must divide the model's 4 experts"),
    (["--nproc", "2", "--ep", "4"], "--ep 4: is carved out of the data-parallel ranks: must divide dp 2"),
    (["--nproc", "2", "--ep", "2", "--zero", "3"], "--zero 3: not with ep 2"),
    (["--capacity-factor", "0"], "--capacity-factor 0.0: must be a positive number"),
    (["--nproc", "4", "--tp", "4", "--tp-mode", "2d"], "--tp-mode 2d: a mixture of experts runs with tp_mode 1d"),
    (["--nproc", "2", "--ep", "2", "--offload-params", "cpu"], "--offload-params cpu: not with ep 2"),
    (["--schedule", "2bw", "--grad-clip", "0"], "--schedule 2bw: not with a mixture of experts"),
])
def test_bad_expert_layouts_are_one_line_and_exit_code_2(args, needle):
    result = run_strata("train", "--model", "tiny-moe", *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert needle in lines[0], lines[0]


def test_compiled_blocks_train_as_eager_with_the_router_left_eager():
    """--compile compiles each block around the MoE layer (its shapes follow the routing): the
    losses and the auxiliary losses of the eager run, in fp64."""
    eager = single_process(_key(dtype="fp64", steps=2))
    compiled = single_process(_key(dtype="fp64", steps=2, compile=True))
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-12, atol=0)
    torch.testing.assert_close([r["aux_loss"] for r in compiled["records"]],
                               [r["aux_loss"] for r in eager["records"]], rtol=1e-12, atol=0)


def test_tensorboard_shows_the_routers_metrics():
    record = single_process(_key(dtype="fp64"))["records"][-1]
    tags = scalars(record)
    assert tags["train/aux_loss"] == record["aux_loss"] and tags["moe/dropped_tokens"] == 0
    assert [tags[f"moe/expert_load/{e}"] for e in range(4)] == record["expert_load"]


class _Favouring(torch.nn.Module):
    """A router whose logits favour experts 0 and 1 (expert-parallel rank 0's of 2), whatever the token."""

    def forward(self, x):
        return torch.tensor([5.0, 4.0, 0.0, 0.0], dtype=x.dtype) + 0 * x[:, :4]


def _idle_rank_steps(rank_steps: int):
    """tiny-moe under ep 2 with every token routed to rank 0's experts: rank 1's experts get no rows
    from anyone, yet its backward runs the exchanges the others wait for, and its experts get a
    (zero) gradient, so every rank takes its optimizer steps."""
    import torch.distributed as dist

    from strata.distributed.mesh import ParallelDims, expert_axes
    from strata.parallel.expert import ExpertAxes, apply_expert_parallel
    rank = dist.get_rank()
    model = build_model(get_preset("tiny-moe"), seed=None)
    apply_expert_parallel(model, ExpertAxes(*expert_axes(ParallelDims(dp=2), 2, rank, 30)))
    model = model.to_empty(device="cpu")
    model.init_weights(0)
    for name, module in model.named_modules():
        if name.endswith("mlp.router"):
            model.get_submodule(name.rsplit(".", 1)[0]).router = _Favouring()
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(rank_steps):
        tokens = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(step * 2 + rank))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    expert = dict(model.named_parameters())["blocks.0.mlp.experts.w_gate"]
    return len(optimizer.state), len(list(model.parameters())), float(optimizer.state[expert]["step"])


def test_a_rank_whose_experts_get_no_tokens_takes_part_in_every_exchange():
    for states, params, steps in run_on_ranks(_idle_rank_steps, 2, 3, timeout=120, collective_timeout=30):
        assert states == params and steps == 3.0


def test_bf16_rows_travel_in_bf16():
    """Under autocast the rows go to the experts in the dtype the experts compute in, both ways:
    the counted bytes are the formula's with 2-byte elements."""
    cfg = get_preset("tiny-moe")
    ranks = parallel_run(2, _key(dtype="bf16", ep=2, steps=2))
    for me, rank in enumerate(ranks):
        record = rank["records"][-1]
        rows = record["all_to_all_rows"]
        expected = all_to_all_bytes(rows["sent"], rows["received"], me, cfg.d_model, 2, cfg.n_experts, 2) + \
            (rows["dispatches"] - 1) * all_to_all_bytes([0, 0], [0, 0], me, cfg.d_model, 2, cfg.n_experts, 2)
        assert record["comm_bytes_by_op"]["all_to_all/ep"] == expected
