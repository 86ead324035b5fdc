"""Layout-free checkpoints: saved under one layout, resumed under every other, the run goes on as
if never interrupted; and the safety of the directory (atomic, checked, pruned, in the background)."""

import json
import os

import pytest
import torch

from strata.checkpoint import shards, store
from strata.cli import main as strata_main
from strata.config import train_config
from strata.errors import ConfigError
from strata.train.trainer import train

from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=32, steps=10, progress=False, peak_flops=1e10, eval_batches=1,
            lr=3e-3, seed=5, micro_batch=2, global_batch=8, warmup_steps=2)
# name -> (world size, settings): the layouts of the acceptance list
LAYOUTS = {
    "single": (1, {}),
    "dp2": (2, {}),  # replicas: only dp rank 0 writes
    "dp4-zero1": (4, {"zero": 1}),
    "dp2-zero3": (2, {"zero": 3}),
    "tp2": (2, {"tp": 2}),
    "pp2-1f1b": (2, {"pp": 2, "schedule": "1f1b"}),
    "dp2-tp2-pp2-zero1": (8, {"tp": 2, "pp": 2, "zero": 1}),
}
SAVE_AT = 5


def _run_jobs(jobs):
    """Train each job in turn (this world size's layouts); returns their losses."""
    return [train(train_config(**{**BASE, **job}))["losses"] for job in jobs]


def _on_world(world, jobs):
    if world == 1:
        return _run_jobs(jobs)
    return run_on_ranks(_run_jobs, world, jobs, timeout=600)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every layout trained 10 steps, saving at step 5: (directory, losses per layout)."""
    root = tmp_path_factory.mktemp("reshard")
    losses = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        jobs = [{**LAYOUTS[n][1], "save": str(root / n), "save_every": SAVE_AT} for n in names]
        losses.update(zip(names, _on_world(world, jobs)))
    return root, losses


def test_every_layout_runs_the_single_process_losses(saved):
    _, losses = saved
    for name, got in losses.items():
        torch.testing.assert_close(got, losses["single"], rtol=1e-5, atol=0, msg=name)


@pytest.mark.parametrize("target", list(LAYOUTS))
def test_a_checkpoint_from_any_layout_resumes_under_this_one(saved, target):
    """Saved at step 5 under each other layout, resumed here: steps 6-10 are the single run's."""
    root, losses = saved
    world, settings = LAYOUTS[target]
    sources = [n for n in LAYOUTS if n != target]
    jobs = [{**settings, "resume": str(root / source / f"step_{SAVE_AT:06d}")} for source in sources]
    for source, got in zip(sources, _on_world(world, jobs)):
        torch.testing.assert_close(got, losses["single"][SAVE_AT:], rtol=1e-5, atol=0, msg=f"{source} -> {target}")


def test_each_rank_writes_only_its_own_pieces_and_nothing_twice(saved):
    root, _ = saved
    path = root / "dp2-tp2-pp2-zero1" / f"step_{SAVE_AT:06d}"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["layout"]["dp"] == manifest["layout"]["tp"] == manifest["layout"]["pp"] == 2
    assert {f"shard_{r}.safetensors" for r in range(8)} <= set(manifest["files"])
    _, _, reader = store.open_checkpoint(str(path))
    single = store.open_checkpoint(str(root / "single" / f"step_{SAVE_AT:06d}"))[2]
    with reader, single:
        for name in single.names():
            saved_elements = sum(r.hi - r.lo for _, r in reader.index[name])
            # the logical size, plus the vocabulary padding rows of tp-split embeddings (none here)
            assert saved_elements == torch.Size(single.shape(name)).numel(), name
        assembled = shards.read_full(reader)
        # fp32 after 5 Adam steps on two layouts: equal to ~1e-6; a piece put in the wrong place
        # would be off by the weights' own size (~0.02)
        for name, value in shards.read_full(single).items():
            torch.testing.assert_close(assembled[name], value, rtol=0, atol=1e-5)


# --- safety -------------------------------------------------------------------------------------
def _tiny_run(tmp_path, **extra):
    return train(train_config(**{**BASE, "steps": 4, "save": str(tmp_path / "ck"), "save_every": 2, **extra}))


def test_keep_prunes_old_checkpoints_and_latest_names_the_newest(tmp_path):
    _tiny_run(tmp_path, steps=6, keep=2)
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step_000004", "step_000006"]
    assert store.latest(str(tmp_path / "ck")).endswith("step_000006")


def test_async_save_writes_the_same_checkpoint_as_a_blocking_one(tmp_path):
    _tiny_run(tmp_path / "a")
    _tiny_run(tmp_path / "b", async_save=True)
    for step in ("step_000002", "step_000004"):
        a = store.open_checkpoint(str(tmp_path / "a" / "ck" / step))[2]
        b = store.open_checkpoint(str(tmp_path / "b" / "ck" / step))[2]
        with a, b:
            for kind in shards.KINDS:
                for name in a.names():
                    region = shards.Region.whole(a.shape(name))
                    assert torch.equal(a.read(kind, name, region), b.read(kind, name, region)), (step, kind, name)


def test_a_save_killed_midway_is_never_loaded(tmp_path, monkeypatch):
    _tiny_run(tmp_path)
    ck = tmp_path / "ck"
    # the process dies while the step-6 save writes its manifest, after the shards
    real_write_json = store._write_json

    def die_at_the_manifest(path, obj):
        if path.endswith(store.MANIFEST):
            raise SystemExit("killed")
        real_write_json(path, obj)
    monkeypatch.setattr(store, "_write_json", die_at_the_manifest)
    with pytest.raises(SystemExit):
        train(train_config(**{**BASE, "steps": 6, "save": str(ck), "resume": str(ck)}))
    monkeypatch.undo()
    assert (ck / "step_000006.tmp" / "shard_0.safetensors").exists() and not (ck / "step_000006").exists()
    assert store.resolve(str(ck)).endswith("step_000004")
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        store.resolve(str(ck / "step_000006.tmp"))
    # a crash between the rename and the `latest` update leaves latest on the older one: still complete
    summary = train(train_config(**{**BASE, "steps": 6, "save": str(ck), "resume": "auto"}))
    assert len(summary["losses"]) == 2  # resumed at step 4
    assert not (ck / "step_000006.tmp").exists()  # the next save cleaned it up


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_file_is_named_at_load(tmp_path, capsys, damage):
    _tiny_run(tmp_path)
    shard = tmp_path / "ck" / "step_000004" / "shard_0.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:-100]))
    else:
        shard.unlink()
    expected = {"flip": "shard_0.safetensors fails its checksum", "truncate": "shard_0.safetensors has",
                "delete": "shard_0.safetensors is missing"}[damage]
    code = strata_main(["train", "--model", "tiny", "--steps", "6", "--no-progress", "--resume", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err, err


def test_init_from_starts_a_new_run_from_the_weights(tmp_path):
    saving = _tiny_run(tmp_path)
    started = train(train_config(**{**BASE, "steps": 2, "init_from": str(tmp_path / "ck")}))
    # validation reads the same batches every time: the new run's step-0 loss is the old run's last
    assert started["val_losses"][0][1] == saving["val_losses"][-1][1]
    assert len(started["losses"]) == 2  # from step 0, with a fresh optimizer


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(tmp_path, capsys):
    _tiny_run(tmp_path)
    code = strata_main(["train", "--model", "tiny", "--n-layers", "3", "--no-progress", "--resume", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert code == 2 and "its model differs from this one in n_layers (saved 2, now 3)" in err, err
