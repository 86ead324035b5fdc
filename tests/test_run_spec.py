"""A run is resolved once per launch (strata/train/spec.py): the launcher checks it (one
`config.validate`, counted by `config.RunChecks`) and hands the ranks a spec file; the ranks check
nothing again and train exactly as a run resolved in place. The config is never changed."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from strata.cli.parser import build_parser
from strata.cli.train import checked_train
from strata.config import RunChecks, train_config
from strata.errors import ConfigError
from strata.plan.inputs import build_cluster
from strata.train import auto
from strata.train import spec as run_spec
from strata.train.trainer import train

from cli_runner import run_strata
from distributed import run_on_ranks

FLAGS = ["train", "--model", "tiny", "--seq-len", "16", "--micro-batch", "2", "--global-batch", "8", "--steps", "2",
         "--eval-batches", "1", "--no-progress", "--dtype", "fp64", "--device", "cpu"]


def _launcher(argv: list[str], world: int) -> tuple[run_spec.RunSpec, int]:
    """What `strata train` does before it starts the ranks, and how many runs it checked."""
    before = RunChecks.runs
    spec = checked_train(build_parser().parse_args(argv), world, in_a_rank=False)
    return spec, RunChecks.runs - before


def _rank_from_file(path: str) -> tuple[list[float], int]:
    before = RunChecks.runs
    losses = train(run_spec.read(path))["losses"]
    return losses, RunChecks.runs - before


def _rank_in_place(cfg) -> list[float]:
    return train(cfg)["losses"]


def test_one_check_per_launch_and_none_on_the_ranks(tmp_path):
    spec, checks = _launcher([*FLAGS, "--tp", "2", "--zero", "0"], 2)
    assert checks == 1 and spec.files_checked
    assert (spec.config.layout.dp, spec.config.layout.tp, spec.config.global_batch) == (1, 2, 8)  # resolved
    path = run_spec.write(spec, str(tmp_path))
    ranks = run_on_ranks(_rank_from_file, 2, path)
    assert [checks for _, checks in ranks] == [0, 0]
    in_place = run_on_ranks(_rank_in_place, 2, train_config(model="tiny", seq_len=16, micro_batch=2, global_batch=8,
                                                            steps=2, eval_batches=1, progress=False, dtype="fp64",
                                                            device="cpu", tp=2))
    assert ranks[0][0] == in_place[0]  # the same run, bit for bit


def test_parallel_auto_chooses_once_in_the_launcher(monkeypatch):
    """The planner tries its layouts against the run (uncounted, as its search does); the chosen
    config is checked once, and the spec holds the choice: the ranks never plan."""
    monkeypatch.setattr(auto, "local_cluster", lambda n: build_cluster("A100-80G", 1, n, "nvlink", "ib-200"))
    spec, checks = _launcher([*FLAGS[:5], "--steps", "2", "--parallel", "auto", "--no-progress", "--device", "cpu"], 2)
    assert checks == 1
    assert spec.config.parallel == "manual" and spec.config.layout.world_size == 2


def test_the_spec_round_trips_and_the_config_is_frozen(tmp_path):
    spec, _ = _launcher([*FLAGS, "--pp", "2", "--schedule", "gpipe"], 2)
    assert run_spec.read(run_spec.write(spec, str(tmp_path))) == spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.config.steps = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.config.layout.tp = 2


def test_a_spec_for_another_world_size_is_refused(tmp_path):
    spec, _ = _launcher(FLAGS, 1)
    path = run_spec.write(spec, str(tmp_path))
    with pytest.raises(RuntimeError, match="the run's spec was resolved for 1 processes, and 2 were launched"):
        run_on_ranks(_rank_from_file, 2, path)


def test_spec_files_and_flags_beside_them_get_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"config": {"steps": 1}}))
    for argv, message in ((["train", "--spec", str(bad)], "is not a run spec strata wrote"),
                          (["train", "--spec", str(tmp_path / "none.json")], "cannot be read"),
                          (["train", "--spec", str(bad), "--tp", "2"], "--spec: the file a launcher writes for its "
                                                                       "ranks holds the whole run; not with --tp")):
        result = run_strata(*argv)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_the_launcher_starts_its_ranks_on_the_spec_alone(tmp_path, monkeypatch):
    """`strata train --nproc 2`: the ranks' command line is the spec's file, nothing else."""
    from strata.cli import train as cli_train
    from strata.distributed import launch
    started = {}

    def fake_launch(nproc, argv, max_restarts=0, env=None):
        started.update(nproc=nproc, argv=argv, env=env, spec=run_spec.read(argv[2]))
        return 0

    monkeypatch.setattr(launch, "launch_local", fake_launch)
    args = build_parser().parse_args([*FLAGS, "--nproc", "2", "--zero", "1"])
    assert cli_train.train_command(args, [*FLAGS, "--nproc", "2", "--zero", "1"]) == 0
    assert started["argv"][:2] == ["train", "--spec"] and len(started["argv"]) == 3 and started["env"] is None
    assert started["spec"].config.layout.dp == 2 and started["spec"].files_checked
    assert not os.path.exists(started["argv"][2])  # the launcher's directory is gone with it
    with pytest.raises(ConfigError):
        run_spec.read(started["argv"][2])


def test_a_launcher_refuses_a_spec_among_the_flags_it_resolves():
    """`strata launch -- train --spec F` (or an srun task given one): the launcher resolves flags,
    and would otherwise train a default run while ignoring F."""
    with pytest.raises(ConfigError, match="--spec: only for the ranks a launcher starts"):
        checked_train(build_parser().parse_args(["train", "--spec", "run_spec.json"]), 2, in_a_rank=False)
