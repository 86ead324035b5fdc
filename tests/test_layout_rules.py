"""The planner and the trainer accept exactly the same layouts: both call strata/rules/layout.py,
and this checks it from the outside, through what each one is given (plan's `--layout` text and a
workload; train's config), over random (model, world size, layout) tuples."""

import dataclasses
import random

import pytest

from strata.config import train_config
from strata.errors import ConfigError
from strata.model.presets import PRESETS
from strata.plan.inputs import workload
from strata.plan.report import parse_layout
from strata.plan.search import layouts
from strata.rules.checkpointing import PLANNED_MODES
from strata.rules.schedules import SCHEDULES
from strata.train.spec import resolve

PRESET_NAMES = ["tiny", "tiny-gpt2", "small", "gpt2-124m", "llama-7b", "llama-70b", "bloom-176b"]


def _random_case(rng: random.Random) -> dict:
    """A layout that is plausible for the model (degrees that multiply to the world, a batch that
    splits), then, half of the time, one field set to something that may break it."""
    name = rng.choice(PRESET_NAMES)
    model = PRESETS[name]
    tp = rng.choice([t for t in (1, 2, 4, 8) if model.n_heads % t == 0] or [1])
    pp = rng.choice([1, 1, 2, 4])
    dp = rng.choice([1, 2, 4])
    mb = rng.choice([1, 2, 4])
    schedule = rng.choice(list(SCHEDULES)) if pp > 1 else "1f1b"
    case = {"model": name, "world": dp * tp * pp, "tp": tp, "pp": pp, "dp": rng.choice([None, dp]),
            "v": 2 if schedule == "interleaved" else 1, "zero": rng.choice([0, 1] if pp > 1 else [0, 1, 2, 3]) if dp > 1
            else 0, "mb": mb, "ckpt": rng.choice(PLANNED_MODES), "offload": rng.choice(["none", "cpu"]),
            "sp": tp > 1 and rng.random() < 0.5, "schedule": schedule, "global_batch": dp * mb * rng.choice([1, 2, 4]),
            "seq_len": min(model.max_seq_len, 32)}
    if rng.random() < 0.5:
        field, choices = rng.choice([
            ("world", [1, 2, 3, 4, 6, 8, 12, 16]), ("tp", [1, 2, 3, 4, 8, 16]), ("pp", [1, 2, 3, 4, 8, 16]),
            ("dp", [None, 1, 2, 3]), ("v", [1, 2, 3, 4]), ("zero", [0, 1, 2, 3, 4]), ("mb", [1, 2, 3, 4, 8]),
            ("sp", [False, True]), ("schedule", [*SCHEDULES, "zigzag"]), ("global_batch", [1, 3, 4, 6, 8, 32]),
            ("seq_len", [1, 33, model.max_seq_len, model.max_seq_len + 1])])
        case[field] = rng.choice(choices)
    return case


def _plan_accepts(case) -> bool:
    keys = [("tp", case["tp"]), ("pp", case["pp"]), ("v", case["v"]), ("zero", case["zero"]), ("mb", case["mb"]),
            ("ckpt", case["ckpt"]), ("offload", case["offload"]), ("schedule", case["schedule"])]
    text = ",".join([*(f"{k}={v}" for k, v in keys), *(["sp"] if case["sp"] else []),
                     *([f"dp={case['dp']}"] if case["dp"] is not None else [])])
    try:
        work = workload(PRESETS[case["model"]], case["global_batch"], case["seq_len"], "bf16")
        parse_layout(text, work, case["world"])
    except ConfigError:
        return False
    return True


def _train_accepts(case) -> bool:
    cfg = train_config(model=case["model"], nproc=case["world"], dp=case["dp"], tp=case["tp"], pp=case["pp"],
                      virtual_stages=case["v"], zero=case["zero"], micro_batch=case["mb"], checkpointing=case["ckpt"],
                      offload=case["offload"], sequence_parallel=case["sp"], schedule=case["schedule"],
                      global_batch=case["global_batch"], seq_len=case["seq_len"],
                      # a run setting, not the layout's: the asynchronous schedules refuse clipping
                      grad_clip=0.0 if case["schedule"] in SCHEDULES and SCHEDULES[case["schedule"]].asynchronous
                      else 1.0)
    try:
        resolve(cfg, case["world"])
    except ConfigError:
        return False
    return True


def test_plan_and_train_accept_exactly_the_same_layouts():
    rng = random.Random(20261130)
    verdicts = []
    for _ in range(600):
        case = _random_case(rng)
        plan, train = _plan_accepts(case), _train_accepts(case)
        assert plan == train, f"plan {'accepts' if plan else 'refuses'}, train {'accepts' if train else 'refuses'}: {case}"
        verdicts.append(plan)
    # both answers occur often enough for the comparison to mean something
    assert sum(verdicts) >= 60 and len(verdicts) - sum(verdicts) >= 60, sum(verdicts)


@pytest.mark.parametrize("name,world", [("tiny", 4), ("small", 8), ("llama-7b", 16), ("bloom-176b", 8)])
def test_every_layout_the_search_proposes_is_one_train_runs(name, world):
    work = workload(PRESETS[name], 16, None, "bf16")
    proposed = list(layouts(work, world))
    assert proposed
    for lay in proposed:
        resolve(dataclasses.replace(train_config(model=name, nproc=world, global_batch=16), layout=lay), world)
