"""A checkpoint and a run directory's config.toml written by strata at c7f5090, before the layout
became its own config section (issue 52), still load and resume exactly: the steps after the
resume point give the losses that commit's uninterrupted run logged (tests/fixtures/
checkpoint_c7f5090/expected.json holds them, with the command that wrote the fixture)."""

from __future__ import annotations

import json
import os
import shutil

from cli_runner import run_strata

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint_c7f5090")


def _expected() -> dict:
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        return json.load(f)


def _train_records(path: str) -> dict[int, dict]:
    with open(path) as f:
        return {r["step"]: r for r in map(json.loads, f) if r["kind"] == "train"}


def _resume(tmp_path, *flags) -> dict[int, dict]:
    """The old run's config.toml and its step-3 checkpoint, resumed to step 6."""
    checkpoint = shutil.copytree(os.path.join(FIXTURE, "step_000003"), tmp_path / "old" / "step_000003")
    metrics = tmp_path / "metrics.jsonl"
    result = run_strata("train", "--config", os.path.join(FIXTURE, "config.toml"), "--resume", checkpoint,
                        "--save", tmp_path / "save", "--metrics", metrics, *flags, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "resuming from" in result.stderr and "at step 3" in result.stderr
    return _train_records(metrics)


def test_same_layout_resumes_exactly(tmp_path):
    """Two ranks, dp 2 with ZeRO-1 as it was saved: the same reductions in the same order, so the
    losses and gradient norms of steps 4-6 are the old run's, bit for bit."""
    records, expected = _resume(tmp_path), _expected()
    assert sorted(records) == [4, 5, 6]
    for step in (4, 5, 6):
        assert records[step]["loss"] == expected["losses"][str(step)], step
        assert records[step]["grad_norm"] == expected["grad_norms"][str(step)], step


def test_other_layout_resumes_to_fp64_tolerance(tmp_path):
    """One process (the checkpoint is layout-free): the old run's losses to 1e-10 in fp64."""
    records, expected = _resume(tmp_path, "--nproc", "1", "--zero", "0"), _expected()
    for step in (4, 5, 6):
        assert abs(records[step]["loss"] - expected["losses"][str(step)]) < 1e-10, step
        assert abs(records[step]["grad_norm"] - expected["grad_norms"][str(step)]) < 1e-10, step
