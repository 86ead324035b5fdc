"""Every accepted pipeline schedule, on 2 and 4 stages, alone and with tp2 + sequence parallelism,
dp2 + ZeRO-1, cp2 and ep2, reproduces the single process in fp64 to 1e-10 (the asynchronous ones:
the single-process run of their weight-version rule). Run under NCCL's rules (`make test` sets
STRATA_COMM_SEMANTICS=nccl; this module sets it too), so none of them hangs or crashes for want of
them: one operation at a time per group in issue order, sends that wait for their receive, one
handle per batched send/receive, no tags, device tensors only.

Schedules: gpipe, 1f1b and zb at m = p + 1; interleaved with v = 2 and 3 at m = p, m = 2p and the
smallest accepted m that is not a multiple of p; 2bw at m = 2p and pipedream, pipedream-vs at one
micro-batch a step (they update after each). A combination the rules refuse is checked to be
refused (the asynchronous schedules with a mixture of experts), not run."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from strata.config import train_config
from strata.errors import ConfigError
from strata.rules.schedules import SCHEDULES
from strata.train.spec import resolve
from strata.train.trainer import train

from distributed import SharedLaunches

STAGES = (2, 4)
BASE = dict(seq_len=16, progress=False, peak_flops=1e10, eval_batches=1, lr=3e-3, seed=5, micro_batch=1,
            dtype="fp64", grad_clip=0.0, comm_semantics="nccl")
COMBOS = {"alone": {}, "tp2+sp": dict(tp=2, sequence_parallel=True), "dp2+zero1": dict(dp=2, zero=1),
          "cp2": dict(cp=2), "ep2": dict(model="tiny-moe", dp=2, ep=2)}


def _layers(p: int, v: int) -> int:
    """Blocks enough for p x v chunks (the embedding and the head are units too), and at least 2."""
    return max(2, p * v - 2)


def _settings(p: int, combo: str, schedule: str, v: int, m: int) -> dict:
    extra = COMBOS[combo]
    dp = extra.get("dp", 1)
    # One step checks a synchronous schedule whole: the losses of its forward, then its gradients and
    # update through the validation loss after it. An asynchronous one needs a second: its stale
    # weights differ from the synchronous update's only from there on.
    steps = 2 if SCHEDULES[schedule].asynchronous else 1
    return {"model": "tiny", **BASE, **extra, "n_layers": _layers(p, v), "pp": p, "schedule": schedule,
            "virtual_stages": v, "global_batch": m * dp, "steps": steps}


def _accepted(settings: dict) -> bool:
    cfg = train_config(**settings)
    world = settings["pp"] * settings.get("tp", 1) * settings.get("dp", 1) * settings.get("cp", 1)
    try:
        resolve(cfg, world)
        return True
    except ConfigError:
        return False


def smallest_m_not_a_multiple(p: int, v: int) -> int:
    """The smallest micro-batch count interleaving accepts that p does not divide."""
    return next(m for m in range(1, 4 * p) if m % p and _accepted(_settings(p, "alone", "interleaved", v, m)))


def schedules(p: int) -> list[tuple[str, int, int]]:
    """(schedule, v, m) of the matrix for p stages."""
    runs = [(name, 1, p + 1) for name in ("gpipe", "1f1b", "zb")]
    runs += [("interleaved", v, m) for v in (2, 3) for m in (p, 2 * p, smallest_m_not_a_multiple(p, v))]
    return runs + [("2bw", 1, 2 * p), ("pipedream", 1, 1), ("pipedream-vs", 1, 1)]


def _key(settings: dict) -> tuple:
    return tuple(sorted(settings.items()))


def _world(settings: dict) -> int:
    return settings["pp"] * settings.get("tp", 1) * settings.get("dp", 1) * settings.get("cp", 1)


def matrix() -> dict[tuple, dict]:
    """(p, combo, schedule, v, m) -> its settings, for every accepted run."""
    out = {}
    for p in STAGES:
        for combo in COMBOS:
            for schedule, v, m in schedules(p):
                settings = _settings(p, combo, schedule, v, m)
                if _accepted(settings):
                    out[(p, combo, schedule, v, m)] = settings
    return out


def _run(settings: dict) -> dict:
    summary = train(train_config(**settings))
    return {"losses": summary["losses"], "val": [v for _, v in summary["val_losses"]],
            "semantics": {r["comm_semantics"] for r in summary["records"]}}


# Runs of the same world share one launch: three launches for the whole matrix.
RUNS = matrix()
_LAUNCHES: dict[int, list] = {}
for _s in RUNS.values():
    _LAUNCHES.setdefault(_world(_s), []).append(_key(_s))
LAUNCHES = SharedLaunches(_run, [(world, tuple(keys)) for world, keys in _LAUNCHES.items()], timeout=1500)


@functools.lru_cache(maxsize=None)
def reference(p: int, combo: str, schedule: str, v: int, m: int) -> dict:
    """One process: the same model and global batch; an asynchronous schedule's version rule
    (2BW's one update late on every stage; PipeDream's p - i - 1 on stage i, emulated)."""
    settings = _settings(p, combo, schedule, v, m)
    dp = settings.get("dp", 1)
    for layout_only in ("tp", "sequence_parallel", "dp", "zero", "cp", "ep", "pp", "virtual_stages"):
        settings.pop(layout_only, None)
    spec = SCHEDULES[schedule]
    if not spec.asynchronous:
        settings["schedule"] = "1f1b"
    elif spec.update_per_micro_batch:  # a step: one micro-batch on each dp rank, here one of all of them
        settings.update(emulate_stages=p, micro_batch=dp)
    return _run({**settings, "comm_semantics": "native"})


@pytest.fixture(autouse=True)
def _nccl_rules(monkeypatch):
    monkeypatch.setenv("STRATA_COMM_SEMANTICS", "nccl")


def test_the_matrix_covers_every_schedule_and_refuses_only_the_asynchronous_ones_with_experts():
    names = {schedule for (_, _, schedule, _, _) in RUNS}
    assert names == set(SCHEDULES)
    for p in STAGES:
        assert smallest_m_not_a_multiple(p, 2) == 1 and smallest_m_not_a_multiple(p, 3) == 1
        for combo in COMBOS:
            refused = {name for name, v, m in schedules(p) if (p, combo, name, v, m) not in RUNS}
            expected = {name for name, spec in SCHEDULES.items() if spec.asynchronous} if combo == "ep2" else set()
            assert refused == expected, (p, combo)


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("combo", list(COMBOS))
def test_every_accepted_schedule_reproduces_one_process_under_nccls_rules(p, combo):
    for (p_, combo_, schedule, v, m), settings in RUNS.items():
        if (p_, combo_) != (p, combo):
            continue
        expected = reference(p, combo, schedule, v, m)
        for rank in LAUNCHES(_world(settings), _key(settings)):
            assert rank["semantics"] == {"nccl"}
            torch.testing.assert_close(rank["losses"], expected["losses"], rtol=1e-10, atol=0,
                                       msg=f"{combo} pp{p} {schedule} v={v} m={m}")
            torch.testing.assert_close(rank["val"], expected["val"], rtol=1e-10, atol=0,
                                       msg=f"{combo} pp{p} {schedule} v={v} m={m}: validation")


def test_the_suite_itself_runs_under_nccls_rules_in_ci():
    """`make test` (what CI runs) sets the mode for every test, not just this module."""
    makefile = open(os.path.join(os.path.dirname(__file__), "..", "Makefile")).read()
    assert "STRATA_COMM_SEMANTICS=nccl" in makefile.split("\ntest:")[1].split("\n\n")[0]
