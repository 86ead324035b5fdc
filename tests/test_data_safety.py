"""No silent loss of a checkpoint or of a run's time: resuming finds the last complete checkpoint
and says how, a save never replaces a checkpoint, --keep never deletes the one just written, and a
run whose loss is gone (fp16 overflowing at every scale, a NaN validation loss) stops and saves
nothing rather than finishing as if all were well."""

import json
import os
import shutil

from strata.checkpoint import store

from cli_runner import run_strata

TRAIN = ["train", "--model", "tiny", "--seq-len", "16", "--micro-batch", "2", "--no-progress", "--eval-batches", "1",
         "--peak-flops", "1e10"]


def _files(path) -> dict[str, bytes]:
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def test_resume_auto_past_a_missing_latest_continues_from_the_last_complete_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    assert run_strata(*TRAIN, "--steps", "10", "--save", ck, "--save-every", "5").returncode == 0
    step5 = _files(ck / "step_000005")
    shutil.rmtree(ck / "step_000010")  # `latest` now names a directory that is gone
    result = run_strata(*TRAIN, "--steps", "7", "--save", ck, "--save-every", "5", "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert "latest names step_000010, which is not the last complete checkpoint written; resuming from the last " \
           "complete checkpoint written, step_000005" in result.stderr, result.stderr
    assert "resuming from" in result.stderr and "at step 5" in result.stderr
    assert _files(ck / "step_000005") == step5  # untouched
    assert store.latest(str(ck)).endswith("step_000007")


def test_a_new_run_never_overwrites_the_checkpoints_in_its_save_directory(tmp_path):
    ck = tmp_path / "ck"
    assert run_strata(*TRAIN, "--steps", "4", "--save", ck, "--save-every", "2").returncode == 0
    before = {step: _files(ck / step) for step in ("step_000002", "step_000004")}
    result = run_strata(*TRAIN, "--steps", "4", "--save", ck, "--save-every", "2", "--lr", "5e-3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"strata: error: --save {ck}: holds step 2 already, which this run would save again (newest there: step 4); "
        f"resume with --resume auto, or save elsewhere"]
    assert {step: _files(ck / step) for step in before} == before


def test_keep_prunes_by_writing_time_and_never_the_checkpoint_just_written(tmp_path):
    ck = tmp_path / "ck"
    assert run_strata(*TRAIN, "--steps", "10", "--save", ck, "--save-every", "5").returncode == 0
    # resume from the older checkpoint into the same directory: its next saves are steps 6 and 8,
    # lower than step 10 but written later
    result = run_strata(*TRAIN, "--steps", "8", "--save", ck, "--save-every", "3", "--keep", "1",
                        "--resume", ck / "step_000005")
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(ck)) == ["latest", "step_000008"]  # the older writes went, steps 5 and 10 included
    assert (ck / "latest").read_text() == "step_000008" and (ck / "step_000008" / "manifest.json").exists()


def test_fp16_that_overflows_at_every_scale_stops_with_one_line_and_saves_nothing(tmp_path):
    ck = tmp_path / "ck"
    result = run_strata(*TRAIN, "--dtype", "fp16", "--lr", "1e6", "--min-lr", "0", "--steps", "30", "--save", ck,
                        "--metrics", tmp_path / "m.jsonl")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "the gradients overflow even at the smallest loss scale (1)" in lines[0], lines
    assert not ck.exists() or store.complete_steps(str(ck)) == []
    skipped = [json.loads(line) for line in open(tmp_path / "m.jsonl") if '"train"' in line]
    assert all(r["skipped"] for r in skipped[1:]) and len(skipped) < 30


def test_a_resumed_run_does_not_start_past_its_steps(tmp_path):
    ck = tmp_path / "ck"
    assert run_strata(*TRAIN, "--steps", "4", "--save", ck).returncode == 0
    result = run_strata(*TRAIN, "--steps", "2", "--save", ck, "--resume", "auto")
    assert result.returncode == 2
    assert "--steps 2: the checkpoint" in result.stderr and "is at step 4 already" in result.stderr
