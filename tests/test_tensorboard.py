"""TensorBoard event files, read back as TensorBoard reads them: every scalar of the metrics records at
its step, once, across a resume that replays steps an earlier run had logged."""

import json
import sys

import pytest

from strata.train.tensorboard import TAGS, scalars

from cli_runner import run_strata

TRAIN = ["train", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--global-batch", "4", "--no-progress",
         "--eval-batches", "1", "--eval-every", "2", "--peak-flops", "1e10", "--timeout", "60"]


def _events(log_dir) -> dict[str, list]:
    """tag -> [(step, value)], as TensorBoard shows them (points an earlier run left past a restart purged)."""
    from tensorboard.backend.event_processing import event_accumulator  # the dev extra's: a missing one fails
    events = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_every_scalar_appears_once_per_step_across_a_resume(tmp_path):
    """Two pipeline stages (so the records have a bubble and communication seconds): 6 steps saving at
    4 and 6, then a run resumed from step 4 to 8, which replays steps 5 and 6."""
    common = [*TRAIN, "--nproc", "2", "--pp", "2", "--tensorboard", "tb", "--metrics", "m.jsonl", "--save", "ck",
              "--save-every", "4"]
    first = run_strata(*common, "--steps", "6", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_strata(*common, "--steps", "8", "--resume", "ck/step_000004", cwd=tmp_path, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]

    events = _events(tmp_path / "tb")
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    expected = set(scalars(train[0]))  # the tags of one step's record
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "memory/peak_bytes",
            "perf/pipeline_bubble", "comm_seconds/all_reduce/pp"} <= expected
    for tag in expected:
        assert [step for step, _ in events[tag]] == list(range(1, 9)), tag
    assert [step for step, _ in events["eval/val_loss"]] == [0, 2, 4, 6, 8]
    # the values are the metrics file's (which keeps each step once too): the resumed run's steps 5-8
    for key in ("loss", "lr", "grad_norm", "bubble"):
        assert [value for _, value in events[TAGS[key]]] == pytest.approx([r[key] for r in train], rel=1e-6)
    evals = [r["val_loss"] for r in records if r["kind"] == "eval"]
    assert [value for _, value in events["eval/val_loss"]] == pytest.approx(evals, rel=1e-6)


def test_a_fresh_run_starts_the_curves_anew(tmp_path):
    for steps in ("3", "2"):
        result = run_strata(*TRAIN, "--steps", steps, "--tensorboard", "tb", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    assert [step for step, _ in _events(tmp_path / "tb")["train/loss"]] == [1, 2]


def test_without_the_package_a_run_asking_for_events_is_refused_before_it_starts(tmp_path, monkeypatch, capsys):
    from strata.cli import main
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what an import finds without tensorboard
    assert main([*TRAIN, "--steps", "1", "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"strata: error: --tensorboard {tmp_path / 'tb'}: needs the tensorboard package, which is not "
                   f"installed here (pip install tensorboard)"]
    assert not (tmp_path / "tb").exists()
