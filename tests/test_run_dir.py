"""A run directory holds everything of one run, and its config.toml runs it again: the TOML writer
reads back exactly, and a run killed after a checkpoint continues from the directory alone."""

import json
import os
import shutil
import tomllib

import pytest

from strata.config import run_dir_outputs as default_outputs
from strata.config import setting_fields, train_config, with_settings
from strata.config_file import load_toml, make_config
from strata.train.run_dir import config_toml, toml_text

from cli_runner import run_strata

TRAIN = ["train", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--no-progress", "--eval-batches", "1",
         "--peak-flops", "1e10"]


@pytest.mark.parametrize("value", ["plain", 'a "quoted" \\ back\\slash', "tab\there\nnew line\x7f\x01", "ünï ☃ 中",
                                   "", 0, -7, 2**63 - 1, 1e-3, 1e-05, 2.5e+20, 0.1 + 0.2, -0.0, float("inf"),
                                   True, False])
def test_toml_values_read_back_exactly(value):
    assert tomllib.loads(toml_text({"key": value})) == {"key": value}


def test_a_config_reads_back_exactly(tmp_path):
    """Every field set away from its default, of every type TrainConfig holds."""
    cfg = train_config(model="small", n_layers=3, max_seq_len=512, data="data/it's \"here\"", seq_len=128, seed=2**40,
                      dtype="bf16",
                      steps=7, micro_batch=3, global_batch=12, lr=3e-4, min_lr=1e-5, warmup_steps=2,
                      weight_decay=0.0, beta2=0.999, grad_clip=0.5, loss_scale=1024.0, parallel="manual", nproc=4,
                      dp=2, tp=2, sequence_parallel=True, pp=1, cp=2, cp_mode="ulysses", checkpointing="every:2",
                      offload="disk",
                      offload_dir="/tmp/o", reduce_dtype="bf16", bucket_mb=12.5, device="cpu", timeout=60.0,
                      eval_every=5, metrics="m.jsonl", tensorboard="tb", save="ck", save_every=2, keep=3,
                      async_save=True, resume="auto", max_restarts=1, progress=False, trace="t.json",
                      peak_flops=1e12, pp_split="1,1", comm_semantics="nccl")
    path = tmp_path / "config.toml"
    path.write_text(config_toml(cfg))
    expected = {k: v for k, v in cfg.to_dict().items() if v is not None}
    # the [layout] table, less dp: what the world leaves of cp x tp x pp, so the file runs on any world size
    expected["layout"] = {k: v for k, v in expected["layout"].items() if v is not None and k != "dp"}
    assert tomllib.loads(path.read_text()) == expected
    values = load_toml(str(path))
    assert make_config(values, {}) == with_settings(cfg, dp=None)
    assert set(setting_fields()) - set(values) == {"vocab_size", "n_heads", "init_from", "run_dir",
                                                   "capacity_factor", "dp_shard", "dp_replicate", "dp"}  # None, and dp


def test_a_run_directory_leaves_out_the_paths_it_implies(tmp_path):
    cfg = train_config(run_dir=str(tmp_path / "run"), metrics=str(tmp_path / "elsewhere.jsonl"))
    assert cfg.save == str(tmp_path / "run" / "ckpt")  # filled from the run directory
    path = tmp_path / "config.toml"
    path.write_text(config_toml(cfg))
    values = load_toml(str(path))
    assert values["metrics"] == str(tmp_path / "elsewhere.jsonl") and "save" not in values
    assert make_config(values, {}) == cfg
    other = make_config(values, {"run_dir": str(tmp_path / "other")})  # the same config in another directory
    assert other.save == default_outputs(str(tmp_path / "other"))["save"]


def _train_records(path) -> list[dict]:
    return [r for r in map(json.loads, open(path)) if r["kind"] == "train"]


def test_a_killed_run_continues_from_its_directory_alone(tmp_path):
    run = tmp_path / "runs" / "a"
    first = run_strata(*TRAIN, "--steps", "4", "--save-every", "2", "--run-dir", "runs/a", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    expected = {"config.toml", "metrics.jsonl", "ckpt", "loss.png", "train.log"} | \
               ({"tb"} if "tensorboard" in default_outputs(str(run)) else set())
    assert expected <= set(os.listdir(run))
    straight = _train_records(run / "metrics.jsonl")
    config = tomllib.loads((run / "config.toml").read_text())
    assert config["run_dir"] == "runs/a" and config["steps"] == 4 and "metrics" not in config
    # killed after step 3: the checkpoint of step 4 never written
    shutil.rmtree(run / "ckpt" / "step_000004")
    again = run_strata("train", "--config", "runs/a/config.toml", "--resume", "auto", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from runs/a/ckpt/step_000002 at step 2" in again.stderr
    resumed = _train_records(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # exact resume
    log = (run / "train.log").read_text()
    assert "started at step 0 of 4" in log and "resumed at step 2 of 4" in log and log.count("step 4: loss") == 2


@pytest.mark.parametrize("flag,file", [("--metrics", "mine.jsonl"), ("--save", "mine_ckpt")])
def test_explicit_flags_win_over_the_run_directory(tmp_path, flag, file):
    result = run_strata(*TRAIN, "--steps", "1", "--run-dir", "r", flag, file, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(tmp_path / file)
    assert not os.path.exists(tmp_path / "r" / {"--metrics": "metrics.jsonl", "--save": "ckpt"}[flag])


def test_a_fine_tuning_run_continues_from_its_own_checkpoint(tmp_path):
    """config.toml keeps --init-from; with --resume auto the run's own checkpoint wins once there is one."""
    base = run_strata(*TRAIN, "--steps", "2", "--save", "base", cwd=tmp_path)
    assert base.returncode == 0, base.stderr[-3000:]
    first = run_strata(*TRAIN, "--steps", "4", "--save-every", "2", "--init-from", "base", "--run-dir", "ft",
                       cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    straight = _train_records(tmp_path / "ft" / "metrics.jsonl")
    shutil.rmtree(tmp_path / "ft" / "ckpt" / "step_000004")
    again = run_strata("train", "--config", "ft/config.toml", "--resume", "auto", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from ft/ckpt/step_000002 at step 2" in again.stderr
    assert [r["loss"] for r in _train_records(tmp_path / "ft" / "metrics.jsonl")] == [r["loss"] for r in straight]


def test_a_run_directorys_config_resolves_again_on_another_world_size(tmp_path):
    """A run resolved for one process writes a config.toml that resolves for two: dp is left to the
    world, the global batch stays as the first run fixed it (the same optimisation)."""
    from strata.train.spec import resolve
    first = resolve(train_config(model="tiny", seq_len=16, micro_batch=2, progress=False, run_dir=str(tmp_path)), 1,
                    announce=False)
    path = tmp_path / "config.toml"
    path.write_text(config_toml(first.config))
    again = resolve(make_config(load_toml(str(path)), {"nproc": 2, "micro_batch": 1}), 2, announce=False)
    assert (first.config.layout.dp, again.config.layout.dp) == (1, 2)
    assert again.config.global_batch == first.config.global_batch == 2
