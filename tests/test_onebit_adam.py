"""1-bit Adam (--compress onebit, strata/parallel/onebit_adam.py): two ranks equal the
single-process run of its rule, written here apart from the runtime (each rank's gradient computed
on its rows, then Tang et al. 2021's update: AdamW for the warm-up, then v frozen and the momenta
averaged through sign compression with worker and server error feedback), in fp64 to 1e-10; the
bytes a step sends are the formula's (rules/compression.py); a resumed run goes on bit for bit; and
what the flag does not run with is one line. The same for 0/1 Adam (--compress zeroone, Lu et al.
2022): v updated on the whole average gradient at DeepSpeed's ZeroOneAdam steps, the gradient
averaged 1-bit between them."""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch
from test_compression import BASE

from strata.config import train_config
from strata.data.loader import BatchLoader
from strata.distributed import comm
from strata.rules.compression import (
    onebit_padded,
    onebit_pieces,
    onebit_wire_bytes,
    variance_updates,
    zeroone_wire_bytes,
)
from strata.train import trainer
from strata.train.optim import lr_at

from cli_runner import assert_refused_in_one_line, run_strata
from distributed import assert_compressed_runs_follow_the_rule, run_on_ranks

RANKS, AFTER, STEPS = 2, 2, 6
COMPRESSED = dict(compress="onebit", compress_after=AFTER)
SCALER = 2  # 0/1 Adam's kappa: v updated at steps 1, 2, 4, 6 (then 8, 12, ..): steps 3 and 5 compressed
ZEROONE = dict(compress="zeroone", var_update_scaler=SCALER)


# --- the rule, in one process ---------------------------------------------------------------------
def _sign_compressed(values: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
    """A chunk's values as +-(the mean absolute value of their piece), by each value's sign bit (+0
    is +1, -0 is -1); a piece is a run of values of one tensor (`owners`: each value's tensor, -1 for
    the padding)."""
    out, start = torch.empty_like(values), 0
    for n in torch.unique_consecutive(owners, return_counts=True)[1].tolist():
        scale = values[start:start + n].abs().sum() / n
        out[start:start + n] = torch.where(torch.signbit(values[start:start + n]), -scale, scale)
        start += n
    return out


def _compressed_average(momenta: list[torch.Tensor], worker_errors: list[torch.Tensor],
                        server_errors: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The ranks' flat momenta (padded; units of `sizes` elements end to end: `units`) -> their 1-bit
    average, a scale per tensor's piece of a chunk; the errors updated in place."""
    ranks, padded, elements = len(momenta), momenta[0].numel(), sum(sizes)
    chunk = padded // ranks
    owners = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)] + [torch.full((padded - elements,), -1)])
    sent = []
    for r in range(ranks):
        corrected = momenta[r] + worker_errors[r]
        compressed = torch.cat([_sign_compressed(corrected[j * chunk:(j + 1) * chunk], owners[j * chunk:(j + 1) * chunk])
                                for j in range(ranks)])
        worker_errors[r].copy_(corrected - compressed)
        worker_errors[r][elements:] = 0
        sent.append(compressed.view(ranks, chunk))
    average = []
    for j in range(ranks):  # rank j serves chunk j
        served = sum(sent[r][j] for r in range(ranks)) / ranks + server_errors[j]
        served[max(elements - j * chunk, 0):] = 0
        compressed = _sign_compressed(served, owners[j * chunk:(j + 1) * chunk])
        server_errors[j].copy_(served - compressed)
        average.append(compressed)
    result = torch.cat(average)
    result[elements:] = 0
    return result


def units(named) -> list[int]:
    """The lengths of the parameters' units in flat order, each with a scale of its own: an
    embedding's (the tokens', the learned positions') rows one by one, any other tensor whole."""
    return [n for name, p in named
            for n in ([p.shape[1]] * p.shape[0] if name in ("embed.weight", "pos_embed.weight") else [p.numel()])]


def _rank_gradients(run, loader: BatchLoader, step: int, ranks: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One rank's gradient: its rows' micro-batches, each loss x 1/ranks / micro-batches."""
    run.model.zero_grad(set_to_none=True)
    micro_batches = loader.micro_batches(step, 1)
    losses = []
    for inputs, targets in micro_batches:
        loss = run.model(inputs, targets)
        (loss / ranks / len(micro_batches)).backward()
        losses.append(loss.item())
    return {name: p.grad.clone() for name, p in run.model.named_parameters()}, losses


def _simulated_ranks(ranks: int, settings: dict):
    """What both rules below start from: one process's run, each rank's loader, the trained
    parameters, every rank's zeroed worker and server errors (fp64, padded), betas and decays."""
    run = trainer.setup(train_config(**{**BASE, **settings, "nproc": 1, "zero": 0}))  # the rule is ZeRO's alike
    data = run.train_data
    loaders = [BatchLoader(data.source, data.seq_len, data.global_batch, data.seed, dp_rank=r, dp_size=ranks)
               for r in range(ranks)]
    named = [(name, p) for name, p in run.model.named_parameters() if p.requires_grad]
    padded = onebit_padded(sum(p.numel() for _, p in named), ranks)
    worker_errors = [torch.zeros(padded, dtype=torch.float64) for _ in range(ranks)]
    server_errors = [torch.zeros(padded // ranks, dtype=torch.float64) for _ in range(ranks)]
    decay = {p: group["weight_decay"] for group in run.optimizer.param_groups for p in group["params"]}
    return run, loaders, named, worker_errors, server_errors, (run.cfg.beta1, run.cfg.beta2), decay


def single_process_rule(ranks: int, settings: dict) -> list[float]:
    """The losses of 1-bit Adam over `ranks` ranks' rows, every rank simulated in this process: the
    warm-up is torch's AdamW on the averaged gradient."""
    run, loaders, named, worker_errors, server_errors, (b1, b2), decay = _simulated_ranks(ranks, settings)
    elements, padded = sum(p.numel() for _, p in named), worker_errors[0].numel()
    losses = []
    for step in range(STEPS):
        for group in run.optimizer.param_groups:
            group["lr"] = lr_at(step, run.cfg)
        per_rank = [_rank_gradients(run, loader, step, ranks) for loader in loaders]
        losses.append(sum(sum(rank_losses) for _, rank_losses in per_rank) / (ranks * len(per_rank[0][1])))
        grads = [g for g, _ in per_rank]  # each carries 1/ranks of the loss
        if step < AFTER:
            for name, param in named:
                param.grad = sum(g[name] for g in grads)
            trainer.update(run)
            continue
        states = [run.optimizer.state[p] for _, p in named]
        old = torch.cat([s["exp_avg"].reshape(-1) for s in states])
        momenta = []
        for g in grads:
            local = torch.cat([ranks * g[name].reshape(-1) for name, _ in named])
            momenta.append(torch.nn.functional.pad(b1 * old + (1 - b1) * local, (0, padded - elements)))
        average = _compressed_average(momenta, worker_errors, server_errors, units(named))
        lr, t, at = lr_at(step, run.cfg), step + 1, 0
        with torch.no_grad():
            for (_, p), state in zip(named, states):
                state["exp_avg"].copy_(average[at:at + p.numel()].view_as(p))
                at += p.numel()
                denom = state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** AFTER) + 1e-8
                p.mul_(1 - lr * decay[p])
                p.sub_(lr / (1 - b1 ** t) * state["exp_avg"] / denom)
        run.model.zero_grad(set_to_none=True)
    return losses


def _deepspeed_variance_steps(steps: int, scaler: int) -> set[int]:
    """The steps (1 is the first) DeepSpeed's ZeroOneAdam updates v at: its var_interval and
    var_counter, as its step() moves them."""
    interval, counter, updates = 1, 0, set()
    for t in range(1, steps + 1):
        if t % interval == 0:
            updates.add(t)
            counter += 1
            if counter == scaler:
                counter, interval = 0, interval * 2
    return updates


def zeroone_rule(ranks: int, settings: dict, scaler: int) -> list[float]:
    """The losses of 0/1 Adam over `ranks` ranks' rows in this process: a step that updates v runs
    Adam on the average gradient (m and v), any other averages the ranks' flat gradients through the
    1-bit compression with error feedback and only m takes it; AdamW's update, v's bias correction
    counting v's updates."""
    run, loaders, named, worker_errors, server_errors, (b1, b2), decay = _simulated_ranks(ranks, settings)
    elements, padded = sum(p.numel() for _, p in named), worker_errors[0].numel()
    m = {name: torch.zeros_like(p) for name, p in named}
    v = {name: torch.zeros_like(p) for name, p in named}
    variance_steps, updates, losses = _deepspeed_variance_steps(STEPS, scaler), 0, []
    for step in range(STEPS):
        t = step + 1
        per_rank = [_rank_gradients(run, loader, step, ranks) for loader in loaders]
        losses.append(sum(sum(rank_losses) for _, rank_losses in per_rank) / (ranks * len(per_rank[0][1])))
        grads = [g for g, _ in per_rank]  # each carries 1/ranks of the loss
        if t in variance_steps:
            average = {name: sum(g[name] for g in grads) for name, _ in named}
            for name, _ in named:
                v[name] = b2 * v[name] + (1 - b2) * average[name] ** 2
            updates += 1
        else:
            flats = [torch.nn.functional.pad(torch.cat([ranks * g[name].reshape(-1) for name, _ in named]),
                                             (0, padded - elements)) for g in grads]
            flat, average, at = _compressed_average(flats, worker_errors, server_errors, units(named)), {}, 0
            for name, p in named:
                average[name] = flat[at:at + p.numel()].view_as(p)
                at += p.numel()
        lr = lr_at(step, run.cfg)
        with torch.no_grad():
            for name, p in named:
                m[name] = b1 * m[name] + (1 - b1) * average[name]
                p.mul_(1 - lr * decay[p])
                p.sub_(lr / (1 - b1 ** t) * m[name] / (v[name].sqrt() / math.sqrt(1 - b2 ** updates) + 1e-8))
        run.model.zero_grad(set_to_none=True)
    return losses


def test_the_variance_steps_are_deepspeeds():
    """rules/compression.variance_updates counts ZeroOneAdam's var_interval / var_counter policy."""
    for scaler in (1, 2, 3, 16):
        steps = _deepspeed_variance_steps(5000, scaler)
        assert [variance_updates(t, scaler) for t in range(5001)] == [
            sum(1 for s in steps if s <= t) for t in range(5001)]
    assert variance_updates(300, 16) == 67  # the bench's run: 16 + 16 + 16 + 16 + 3 steps whole


@pytest.mark.parametrize("ranks,settings", [(2, {}), (3, {"global_batch": 6, "zero": 1})])
def test_zeroone_ranks_equal_the_single_process_rule_in_fp64(ranks, settings):
    """Steps 1 and 2 are AdamW's (plain run's losses), step 3 the first compressed one. Under ZeRO-1
    (3 ranks) m and v are sharded and the compressed average of the gradient is whole."""
    reference = zeroone_rule(ranks, settings, SCALER)
    plain = run_on_ranks(_on_ranks, ranks, settings)[0]
    compressed = run_on_ranks(_on_ranks, ranks, {**settings, **ZEROONE})
    assert_compressed_runs_follow_the_rule(compressed, reference, plain, 2)


def _on_ranks(settings: dict) -> list[float]:
    return trainer.train(train_config(**{**BASE, **settings}))["losses"]


@pytest.mark.parametrize("ranks,settings", [(2, {}), (3, {"global_batch": 6}), (3, {"global_batch": 6, "zero": 1})])
def test_the_ranks_equal_the_single_process_rule_in_fp64(ranks, settings):
    """tiny's 106,816 elements split into whole bytes of signs on 2 ranks; on 3 the last chunk ends in
    8 elements of padding (106,816 = 24 x 4,450 + 16). ZeRO-1 (3 ranks: its bucket shards are not the
    1-bit chunks) keeps m whole, gathered once after the warm-up, and updates its shard with its v."""
    reference = single_process_rule(ranks, settings)
    plain = run_on_ranks(_on_ranks, ranks, settings)[0]
    compressed = run_on_ranks(_on_ranks, ranks, {**settings, **COMPRESSED})
    assert_compressed_runs_follow_the_rule(compressed, reference, plain, AFTER)


def _most_pieces(sizes: list[int], ranks: int) -> int:
    """The most pieces a chunk holds, counted here as runs of one unit's elements (or the padding's)."""
    padded = onebit_padded(sum(sizes), ranks)
    owners = [i for i, n in enumerate(sizes) for _ in range(n)] + [-1] * (padded - sum(sizes))
    chunk = padded // ranks
    return max(1 + sum(owners[i] != owners[i - 1] for i in range(j * chunk + 1, (j + 1) * chunk)) for j in range(ranks))


def test_the_pieces_are_the_runs_of_one_tensor_in_each_chunk():
    """rules/compression.onebit_pieces against the runs of one owner in each chunk, for tensors of
    0-40 elements (zero-sized ones too) on 1-5 ranks, the padding a piece of its own."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        ranks = int(torch.randint(1, 6, (), generator=generator))
        sizes = torch.randint(0, 41, (int(torch.randint(1, 7, (), generator=generator)),), generator=generator).tolist()
        if not sum(sizes):
            continue
        pieces = onebit_pieces(sizes, ranks)
        chunk = onebit_padded(sum(sizes), ranks) // ranks
        assert [sum(lengths) for lengths in pieces] == [chunk] * ranks
        assert max(len(lengths) for lengths in pieces) == _most_pieces(sizes, ranks)
        owners = [i for i, n in enumerate(sizes) for _ in range(n)] + [-1] * (ranks * chunk - sum(sizes))
        at = 0
        for lengths in pieces:  # each piece one owner's, and a neighbour in its chunk another's
            runs = []
            for n in lengths:
                assert n > 0 and len(set(owners[at:at + n])) == 1
                runs.append(owners[at])
                at += n
            assert all(a != b for a, b in zip(runs, runs[1:]))


def _step_bytes(settings: dict) -> dict:
    run = trainer.setup(train_config(**{**BASE, **settings}))
    sent, reported = [], []
    for step in range(AFTER + 2 if settings["compress"] == "onebit" else 5):
        comm.counter.reset()
        loss, norm, _ = trainer.train_step(run, step)
        sent.append(dict(comm.counter.bytes_sent))
        reported.append((loss, float(norm)))
    from strata.plan.buckets import onebit_scales
    named = [(name, p) for name, p in run.model.named_parameters() if p.requires_grad]
    assert [p for _, p in named] == run.parallel.sharding.params
    sizes = [p.numel() for _, p in named]
    total = run.parallel.sharding.total
    planned = onebit_scales(run.model_cfg, run.model_cfg.n_layers, RANKS)  # the planner's count, from the shapes
    run.parallel.close()
    comm.close_streams()
    return {"sent": sent, "elements": sum(sizes), "total": total, "scales": _most_pieces(units(named), RANKS),
            "planned": planned, "reported": reported}


@lru_cache(maxsize=None)
def _zero0_step_bytes() -> tuple[dict, ...]:
    return tuple(run_on_ranks(_step_bytes, RANKS, COMPRESSED))


def test_a_compressed_step_sends_the_formulas_bytes():
    """fp64, 2 ranks: the warm-up steps all-reduce the padded gradient buffer and the step's loss
    (a ring all-reduce sends 2(N-1)/N of its bytes); a compressed step all-reduces the loss only,
    and its all-to-all and all-gather each send (N-1)/N of rules/compression.onebit_wire_bytes:
    the momentum's signs, 8 a byte, and a scale per piece of a chunk (tiny's 21 tensors cut in 2
    chunks, its embedding's 256 rows each a unit: 266 pieces in the first), each chunk's row as
    long: under 1/40 of the fp64 gradients (tiny's embedding is a sixth of it, in rows of 64 with an
    fp64 scale each)."""
    ring = (RANKS - 1) / RANKS
    for rank in _zero0_step_bytes():
        assert rank["scales"] == rank["planned"] == 266
        wire = onebit_wire_bytes(rank["elements"], RANKS, 8, rank["scales"])
        for sent in rank["sent"][:AFTER]:
            assert sent == {("all_reduce", "dp"): 2 * ring * 8 * (rank["total"] + 1)}
        for sent in rank["sent"][AFTER:]:
            assert sent == {("all_reduce", "dp"): 2 * ring * 8, ("all_to_all", "dp"): ring * wire,
                            ("all_gather", "dp"): ring * wire}
        assert 2 * wire * 40 < 2 * 8 * rank["elements"]


def test_a_zeroone_run_sends_the_formulas_bytes():
    """fp64, 2 ranks, kappa 2: steps 1, 2, 4, 6 all-reduce the padded gradient buffer (and the
    loss), steps 3 and 5 the loss and the two 1-bit collectives; the run's total is
    rules/compression.zeroone_wire_bytes x (N-1)/N, a ring's share, plus the losses."""
    ring = (RANKS - 1) / RANKS
    for rank in run_on_ranks(_step_bytes, RANKS, ZEROONE):
        wire, whole = onebit_wire_bytes(rank["elements"], RANKS, 8, rank["scales"]), 8 * rank["total"]
        for t, sent in enumerate(rank["sent"], 1):
            if t in (1, 2, 4):
                assert sent == {("all_reduce", "dp"): 2 * ring * (whole + 8)}
            else:
                assert sent == {("all_reduce", "dp"): 2 * ring * 8, ("all_to_all", "dp"): ring * wire,
                                ("all_gather", "dp"): ring * wire}
        steps = len(rank["sent"])
        total = sum(nbytes for sent in rank["sent"] for nbytes in sent.values()) - steps * 2 * ring * 8
        assert total == ring * zeroone_wire_bytes(steps, SCALER, rank["elements"], RANKS, 8, whole, rank["scales"])


def test_a_zero1_step_sends_the_formulas_bytes_and_the_parameters_gather():
    """ZeRO-1, fp64, 2 ranks: the warm-up steps reduce-scatter the padded gradient buffer and
    all-gather the updated parameters ((N-1)/N of the buffer each); a compressed step sends 1-bit
    Adam's two rounds and ZeRO-1's all-gather of the parameters, uncompressed; the first compressed
    step of the run also all-gathers the momentum the warm-up left in shards, once. The loss is
    all-reduced every step; the gradient norm's two fp64 partial sums of squares only on the
    warm-up's steps (a compressed step's norm is each rank's own, whole: nothing to sum). Each
    rank's losses and norms are ZeRO-0's: the average's on the warm-up, its own on a compressed step
    (the ranks' differ then; clipping is off in these runs, so the norm is checked here)."""
    ring = (RANKS - 1) / RANKS
    ranks = run_on_ranks(_step_bytes, RANKS, {**COMPRESSED, "zero": 1})
    norms = [[norm for _, norm in rank["reported"]] for rank in ranks]
    assert norms[0][:AFTER] == pytest.approx(norms[1][:AFTER], rel=1e-12)
    assert all(a != pytest.approx(b, rel=1e-6) for a, b in zip(norms[0][AFTER:], norms[1][AFTER:]))
    for rank, zero0 in zip(ranks, _zero0_step_bytes()):
        torch.testing.assert_close(torch.tensor(rank["reported"]), torch.tensor(zero0["reported"]), rtol=1e-12, atol=0)
        wire, whole = onebit_wire_bytes(rank["elements"], RANKS, 8, rank["scales"]), 8 * rank["total"]
        loss = {("all_reduce", "dp"): 2 * ring * 8}
        for sent in rank["sent"][:AFTER]:
            assert sent == {("all_reduce", "dp"): 2 * ring * (8 + 2 * 8), ("reduce_scatter", "dp"): ring * whole,
                            ("all_gather", "dp"): ring * whole}
        first, later = rank["sent"][AFTER:]
        assert later == {**loss, ("all_to_all", "dp"): ring * wire, ("all_gather", "dp"): ring * (wire + whole)}
        assert first == {**later, ("all_gather", "dp"): ring * (wire + 2 * whole)}


@pytest.mark.parametrize("flags,needle", [
    (["--compress", "onebit", "--compress-after", "2"], "--compress onebit: compresses the data-parallel reduction"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--zero", "2"],
     "replaces ZeRO-0's or ZeRO-1's reduction; zero is 2 (use zero 0 or 1)"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--zero", "1", "--dtype", "bf16",
      "--gather-dtype", "bf16"], "--compress onebit: averages fp32 momenta and gradients; leave --gather-dtype at fp32"),
    (["--nproc", "4", "--compress", "zeroone", "--zero", "1", "--dp-shard", "2"],
     "--compress zeroone: not with hybrid sharding (--dp-shard, --dp-replicate)"),
    (["--nproc", "2", "--compress", "onebit"], "--compress-after 0: 1-bit Adam freezes Adam's second moment"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--compress-rank", "8"],
     "--compress-rank 8: only with --compress powersgd"),
    (["--nproc", "4", "--tp", "2", "--compress", "onebit", "--compress-after", "2"],
     "runs with data parallelism alone for now"),
    (["--nproc", "2", "--compress-after", "3"], "--compress-after 3: only with --compress powersgd or onebit"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--offload", "cpu"],
     "--compress onebit: runs its own optimizer on the device; not with offload cpu"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--schedule", "2bw", "--grad-clip", "0"],
     "--compress onebit: not with schedule 2bw"),
    (["--nproc", "2", "--compress", "zeroone", "--compress-after", "2"],
     "--compress-after 2: only with --compress powersgd or onebit"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--var-update-scaler", "4"],
     "--var-update-scaler 4: only with --compress zeroone"),
    (["--nproc", "2", "--compress", "zeroone", "--var-update-scaler", "0"], "--var-update-scaler 0: must be >= 1"),
    (["--nproc", "2", "--compress", "zeroone", "--zero", "3"], "--compress zeroone: replaces ZeRO-0's or ZeRO-1's"),
    (["--nproc", "4", "--tp", "2", "--compress", "zeroone"],
     "--compress zeroone: runs with data parallelism alone for now (tp and cp 1; beside a pipeline too)"),
])
def test_what_onebit_does_not_run_with_is_one_line(flags, needle):
    result = run_strata("train", "--model", "tiny", "--steps", "1", "--micro-batch", "1", *flags)
    assert_refused_in_one_line(result, needle)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _saved_and_resumed(directory: str, settings: dict) -> tuple[list[float], list[float]]:
    """STEPS steps saving after step AFTER + 1 (past 1-bit Adam's warm-up, after 0/1 Adam's first
    compressed step: both errors are nonzero), then a second run resumed from that checkpoint."""
    save_at = AFTER + 1
    whole = trainer.train(train_config(**{**BASE, **settings, "save": directory, "save_every": save_at}))["losses"]
    resumed = trainer.train(train_config(**{**BASE, **settings, "resume": f"{directory}/step_{save_at:06d}"}))
    return whole[save_at:], resumed["losses"]


@pytest.mark.parametrize("settings", [COMPRESSED, ZEROONE, {**COMPRESSED, "zero": 1}],
                         ids=["onebit", "zeroone", "onebit-zero1"])
def test_a_resumed_run_goes_on_bit_for_bit(tmp_path, settings):
    """The momentum, v and the step go with AdamW's state; each rank's worker error and its chunk
    of the server error with its own shard file: without them the resumed steps would differ (0/1
    Adam's step count says which steps update v). Under ZeRO-1 each rank saves its shard of m, and
    the resumed run gathers m whole before its first step."""
    for whole, resumed in run_on_ranks(_saved_and_resumed, RANKS, str(tmp_path / "ck"), settings):
        assert len(resumed) == STEPS - AFTER - 1
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(whole), rtol=1e-10, atol=0)


def _error_bytes() -> dict:
    run = trainer.setup(train_config(**{**BASE, **COMPRESSED, "dtype": "fp32"}))
    for step in range(AFTER + 1):
        trainer.train_step(run, step)
    errors = sum(t.numel() * t.element_size() for t in run.parallel.sharding.errors().values())
    elements = sum(p.numel() for p in run.parallel.sharding.params)
    run.parallel.close()
    comm.close_streams()
    return {"errors": errors, "elements": elements}


def test_the_runtimes_error_buffers_are_the_planners_with_their_padding():
    from strata.plan.memory import onebit_error_bytes
    for rank in run_on_ranks(_error_bytes, RANKS):
        padded = onebit_padded(rank["elements"], RANKS)
        assert rank["errors"] == 4 * (padded + padded // RANKS)
        assert 0 <= rank["errors"] - onebit_error_bytes(rank["elements"], RANKS) < 4 * 8 * RANKS * 2


def _averaged_with_empty_rows() -> dict:
    """Two rounds of the compressed average of random momenta whose embedding rows past the first
    half are zero on every rank (the tokens no batch had): those rows, out and in both errors."""
    run = trainer.setup(train_config(**{**BASE, **COMPRESSED}))
    averager, embedding = run.parallel.sharding.averager, run.model.embed.weight
    half = embedding.shape[0] // 2
    generator = torch.Generator().manual_seed(1 + averager.dp_rank)
    elements = sum(p.numel() for p in run.parallel.sharding.params)
    out = []
    for _ in range(2):
        flat = averager.zeros()
        flat[:elements] = torch.randn(elements, generator=generator, dtype=flat.dtype)
        averager.view(flat, embedding)[half:] = 0
        averager.average(flat)
        out.append(averager.view(flat, embedding).clone())
    errors = averager.view(averager.worker_error, embedding)[half:].clone()
    run.parallel.close()
    comm.close_streams()
    return {"averaged": out, "half": half, "worker_error": errors}


def test_an_embeddings_empty_rows_stay_zero():
    """An embedding's rows are units with a scale each (rules/compression.onebit_units): rows that are
    zero on every rank come out zero, and leave no error behind, where a scale for the whole tensor
    would send each of them as +-that scale; the other rows come out nonzero."""
    for rank in run_on_ranks(_averaged_with_empty_rows, RANKS):
        half = rank["half"]
        for averaged in rank["averaged"]:
            assert torch.count_nonzero(averaged[half:]) == 0
            assert torch.count_nonzero(averaged[:half]) == averaged[:half].numel()
        assert torch.count_nonzero(rank["worker_error"]) == 0
