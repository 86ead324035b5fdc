"""Every numeric flag of `strata train`, `plan`, `generate` and `bench` (comm, generate), given a
value from the extremes (0, negative, 1e30, 20-digit integers, NaN, inf, and for floats 1e-300),
ends in a one-line refusal (exit code 2) or a run (exit code 0, or 1 with one `strata: error:`
line when the run itself stops, e.g. a loss that diverges at lr 1e30): never a traceback, and
never an allocation past the machine's memory (the sweep runs under a soft RLIMIT_AS of this
machine's memory, so such an allocation fails at once, as a traceback, instead of swapping).

The flags come from the parsers (an argparse action whose type is int or float), so a new flag is
swept without a word here. Each is given alone, on otherwise small settings (a one-step run of the
tiny model, a plan of the tiny model on two devices, a two-token answer), then pairs of flags drawn
with a fixed seed (PAIRS of them), since two extremes together reach code one alone does not.
Today: 83 flags x 9 or 7 values (about 690 cases) and 60 pairs; about 40 of them run."""

from __future__ import annotations

import argparse
import os
import random
import resource

import pytest

from strata.cli import main
from strata.cli.parser import build_parser
from strata.rules.limits import machine_memory

INT_VALUES = ("0", "-1", "12345678901234567890", "-12345678901234567890", "1e30", "nan", "inf")
FLOAT_VALUES = ("0", "-1", "1e30", "-1e30", "nan", "inf", "-inf", "1e-300", "12345678901234567890")
PAIRS = 60
HEADROOM = 4 * 2**30  # bytes a case may map past what the test process holds (see memory_capped)
SEED = 51

# otherwise small settings per command, as {flag: value}; a flag under test replaces its own
TRAIN = {"--steps": "1", "--micro-batch": "1", "--seq-len": "8", "--eval-batches": "1", "--no-progress": None}
PLAN_TRAINING = {"--model": "tiny", "--gpus-per-node": "2", "--tokens": "1B"}
PLAN_SERVING = {"--model": "tiny", "--gpus-per-node": "2", "--inference": None}
GENERATE = {"--prompt-ids": "1,2,3", "--max-new-tokens": "2", "--temperature": "0"}
BENCH_COMM = {"--nproc": "2", "--ops": "all_reduce", "--min-bytes": "1K", "--max-bytes": "1K", "--iters": "1",
              "--timeout": "60"}
BENCH_GENERATE = {"--model": "tiny", "--lengths": "2", "--runs": "1", "--prompt-ids": "1,2", "--batch": "1"}


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def numeric_flags(*command: str) -> list[tuple[str, type]]:
    """(flag, int or float) of every numeric option of a (sub)command, from its parser."""
    parser = _subparser(build_parser(), *command)
    return [(a.option_strings[-1], a.type) for a in parser._actions
            if a.option_strings and a.type in (int, float) and a.help != argparse.SUPPRESS]


def _argv(command: list[str], base: dict, given: dict) -> list[str]:
    argv = list(command)
    for flag, value in {**{k: v for k, v in base.items() if k not in given}, **given}.items():
        argv += [flag] if value is None else [flag, value]
    return argv


def _cases(checkpoint: str) -> list[list[str]]:
    """Every flag alone at every extreme, then PAIRS seeded pairs, as argv lists."""
    groups = [(["train"], TRAIN, numeric_flags("train")),
              (["plan"], PLAN_TRAINING, numeric_flags("plan")),
              (["plan"], PLAN_SERVING, numeric_flags("plan")),
              (["generate", "--checkpoint", checkpoint], GENERATE, numeric_flags("generate")),
              (["bench", "comm"], BENCH_COMM, numeric_flags("bench", "comm")),
              (["bench", "generate"], BENCH_GENERATE, numeric_flags("bench", "generate"))]
    cases = []
    for command, base, flags in groups:
        for flag, kind in flags:
            for value in INT_VALUES if kind is int else FLOAT_VALUES:
                cases.append(_argv(command, base, {flag: value}))
    rng = random.Random(SEED)
    for _ in range(PAIRS):
        command, base, flags = rng.choice(groups)
        (a, kind_a), (b, kind_b) = rng.sample(flags, 2)
        given = {a: rng.choice(INT_VALUES if kind_a is int else FLOAT_VALUES),
                 b: rng.choice(INT_VALUES if kind_b is int else FLOAT_VALUES)}
        cases.append(_argv(command, base, given))
    return cases


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    save = tmp_path_factory.mktemp("extremes") / "ck"
    assert main(["train", "--steps", "1", "--micro-batch", "1", "--seq-len", "8", "--eval-batches", "1",
                 "--no-progress", "--save", str(save)]) == 0
    return str(save)


@pytest.fixture
def memory_capped():
    """A soft limit on the address space: what the test process has mapped, plus HEADROOM. The
    sweep's settings are small (a one-step run of the tiny model needs a few hundred MB), so an
    allocation past HEADROOM means an extreme value got through to a size unchecked; under the
    limit it fails at once (MemoryError, or torch's RuntimeError: a traceback, which this test
    reports), where without one it would swap or be killed. HEADROOM is below this machine's
    memory, so "none allocates past the machine's memory" is checked in a stronger form."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    cap = mapped + min(HEADROOM, machine_memory())
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _outcome(argv: list[str], capsys) -> str | None:
    """None when the outcome is a refusal or a run; else what went wrong."""
    capsys.readouterr()
    try:
        code = main(argv)
    except BaseException as e:  # noqa: BLE001 - a traceback is the failure this test looks for
        capsys.readouterr()
        return f"traceback: {type(e).__name__}: {e}"[:300]
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("strata: error:")]
    if "Traceback" in err:
        return f"a traceback on stderr: {err[-300:]}"
    if code == 2 and (len(lines) != 1 or len(errors) != 1):
        return f"exit 2 without exactly one line: {lines[-3:]}"
    if code == 1 and len(errors) != 1:
        return f"exit 1 without one `strata: error:` line: {lines[-3:]}"
    if code not in (0, 1, 2):
        return f"exit code {code}: {lines[-3:]}"
    return None


def test_every_numeric_flag_at_the_extremes_is_refused_in_one_line_or_runs(checkpoint, memory_capped, capsys,
                                                                           monkeypatch):
    monkeypatch.chdir(os.path.dirname(checkpoint))  # outputs a run writes (none expected) land in tmp
    cases = _cases(checkpoint)
    assert len(cases) > 500
    failures = []
    for argv in cases:
        problem = _outcome(argv, capsys)
        if problem:
            failures.append(f"strata {' '.join(argv)}\n    {problem}")
    assert not failures, f"{len(failures)} of {len(cases)}:\n" + "\n".join(failures)


def test_the_sweep_covers_every_numeric_flag():
    """The parsers' numeric flags are the ones swept: a few known ones are among them."""
    train = dict(numeric_flags("train"))
    assert {"--micro-batch", "--max-seq-len", "--bucket-mb", "--loss-scale", "--timeout"} <= set(train)
    assert train["--lr"] is float and train["--steps"] is int
    assert {"--days", "--nodes", "--batch", "--context"} <= dict(numeric_flags("plan")).keys()
    assert {"--max-new-tokens", "--top-p", "--seed"} <= dict(numeric_flags("generate")).keys()
    assert {"--iters", "--factor"} <= dict(numeric_flags("bench", "comm")).keys()


def test_the_docs_print_the_limits_table_as_the_code_has_it():
    """docs/cli.md's Limits table is rules/limits.py's, row for row, and each of its names is a
    setting some command reads (a flag of train, plan, generate or bench, or a model field)."""
    from dataclasses import fields

    from strata.model.config import ModelConfig
    from strata.rules.limits import CEILINGS, FLOORS, markdown_table
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md"), encoding="utf-8") as f:
        assert markdown_table() in f.read()
    flags = {flag for command in (["train"], ["plan"], ["generate"], ["bench", "comm"], ["bench", "generate"])
             for action in _subparser(build_parser(), *command)._actions for flag in action.option_strings}
    models = {f.name for f in fields(ModelConfig)}
    unknown = [name for name in {**CEILINGS, **FLOORS} if f"--{name.replace('_', '-')}" not in flags
               and name not in models]
    assert not unknown, unknown
