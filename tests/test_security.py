"""Nothing of a local run is reachable from the network, and no name read from a file leads out of
its directory."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from listeners import is_loopback, kill_tree, listeners_of_tree

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_a_local_run_listens_on_loopback_only(tmp_path):
    metrics = tmp_path / "m.jsonl"
    job = subprocess.Popen([sys.executable, "-m", "strata", "train", "--model", "tiny", "--nproc", "2",
                            "--steps", "100000", "--no-progress", "--eval-batches", "1", "--metrics", str(metrics)],
                           env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # training has started: every rank and the store are up
            if metrics.exists() and sum(1 for _ in open(metrics)) >= 3:
                break
            assert job.poll() is None, job.stderr.read().decode()[-2000:]
            time.sleep(0.5)
        else:
            pytest.fail("the run did not start training within 180 s")
        listeners = listeners_of_tree(job.pid)
    finally:
        kill_tree(job.pid)
        job.wait()
    # the launcher's rendezvous store and each rank's gloo pairs: found, and all on loopback
    assert len(listeners) >= 3, listeners
    exposed = {pid: [a for a in addresses if not is_loopback(a)] for pid, addresses in listeners.items()}
    assert not any(exposed.values()), f"listening beyond loopback: {exposed}"


# --- names read from files stay inside their directory -----------------------------------------------
def _checkpoint(tmp_path):
    from strata.config import train_config
    from strata.train.trainer import train
    save = tmp_path / "ck"
    train(train_config(model="tiny", seq_len=16, steps=1, micro_batch=2, save=str(save), progress=False,
                      eval_batches=1, peak_flops=1e10))
    return save


def _edit_manifest(step_dir, change):
    manifest = json.loads((step_dir / "manifest.json").read_text())
    change(manifest)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_no_name_in_a_checkpoint_leads_outside_it(tmp_path):
    from strata.checkpoint import store
    from strata.errors import CorruptError
    save = _checkpoint(tmp_path)
    step = save / "step_000001"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_bytes(b"secret")
    cases = {
        "manifest entry": lambda: _edit_manifest(step, lambda m: m["files"].update(
            {"../../outside/x": {"bytes": 6, "sha256": "0" * 64}})),
        "shard name": lambda: _edit_manifest(step, lambda m: m["files"].update(
            {"shard_../../../outside/x.json": m["files"]["shard_0.json"]})),
        "latest": lambda: (save / "latest").write_text("../outside/step_000005"),
    }
    pristine = {p: p.read_bytes() for p in (step / "manifest.json", save / "latest")}
    for what, damage in cases.items():
        for path, data in pristine.items():
            path.write_bytes(data)
        damage()
        with pytest.raises(CorruptError, match="is not a plain file name|not a step directory"):
            path, manifest, reader = store.open_checkpoint(str(save))
            with reader:
                pass


def test_a_hugging_face_index_cannot_name_a_file_outside_the_model(tmp_path):
    from safetensors.torch import save_file

    from strata.checkpoint.hf import read_hf_tensors
    from strata.errors import CorruptError
    model, secret = tmp_path / "model", tmp_path / "secret.safetensors"
    model.mkdir()
    save_file({"w": torch.ones(2)}, str(secret))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../secret.safetensors"}}))
    with pytest.raises(CorruptError, match="'../secret.safetensors' is not a plain file name"):
        read_hf_tensors(str(model))


def test_a_data_directory_cannot_name_a_shard_outside_it(tmp_path):
    from strata.data.loader import read_meta
    from strata.errors import CorruptError
    (tmp_path / "d").mkdir()
    shard = {"file": "../elsewhere.bin", "tokens": 0}
    (tmp_path / "d" / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16", "splits": {
        "train": {"tokens": 0, "shards": [shard]}, "val": {"tokens": 0, "shards": []}}}))
    with pytest.raises(CorruptError, match="'../elsewhere.bin' is not a plain file name"):
        read_meta(str(tmp_path / "d"))
