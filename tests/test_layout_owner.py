"""The Layout is the one owner of the layout's fields (issue 52): a field added to it, with no
other edit, is a `strata train` flag (in the layout's `--help` group), a key of the config file's
[layout] table, a `strata plan --layout` key, part of `--parallel auto`'s choice and of a
checkpoint's metadata. The test adds one to a copy of the source tree and runs there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest

from strata.config import RUN_LAYOUT, train_config
from strata.config_file import load_toml, make_config
from strata.model.presets import get_preset
from strata.plan.inputs import build_cluster, workload
from strata.plan.report import parse_layout
from strata.rules import layout_text
from strata.rules.layout import Layout
from strata.train import auto
from strata.train.run_dir import config_toml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW_FIELD = '    probe_degree: int = setting(1, "a field the layout-owner test adds")\n'

CHECKS = textwrap.dedent('''
    import json, os, sys
    import strata
    assert strata.__file__.startswith(sys.argv[1]), strata.__file__
    from strata.cli.parser import build_parser
    from strata.config import setting_fields, train_config
    from strata.config_file import load_toml, make_config
    from strata.model.presets import get_preset
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.report import parse_layout
    from strata.train import auto
    from strata.train.trainer import train

    parser = build_parser()
    args = parser.parse_args(["train", "--probe-degree", "3"])  # the flag
    assert make_config({}, {n: getattr(args, n) for n in setting_fields()}).layout.probe_degree == 3
    train_help = parser._subparsers._group_actions[0].choices["train"].format_help()
    assert "--probe-degree" in train_help.split("layout: [layout]")[1]  # in the layout's group
    toml = os.path.join(sys.argv[2], "run.toml")  # the config file's [layout] table
    with open(toml, "w") as f:
        f.write("model = 'tiny'\\n[layout]\\nprobe_degree = 4\\n")
    assert make_config(load_toml(toml), {}).layout.probe_degree == 4
    work = workload(get_preset("tiny"), 4, 16, "fp32")  # strata plan --layout, and describe() back
    planned = parse_layout("dp=2,probe_degree=5", work, 2)
    assert planned.probe_degree == 5 and "probe_degree=5" in planned.describe()
    auto.local_cluster = lambda n: build_cluster("A100-80G", 1, n, "nvlink", "ib-200")  # --parallel auto
    chosen, _ = auto.choose(train_config(parallel="auto", seq_len=16, probe_degree=6), 2, get_preset("tiny"))
    assert chosen.layout.probe_degree == 6
    save = os.path.join(sys.argv[2], "save")  # a checkpoint's metadata
    train(train_config(seq_len=16, steps=1, micro_batch=2, eval_batches=1, progress=False, save=save,
                       probe_degree=7, device="cpu"))
    with open(os.path.join(save, "step_000001", "manifest.json")) as f:
        assert json.load(f)["layout"]["probe_degree"] == 7
    print("all five")
''')


def test_a_field_added_to_the_layout_is_a_flag_a_key_a_layout_part_a_choice_and_metadata(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "strata"), tree / "strata", ignore=shutil.ignore_patterns("__pycache__"))
    source = tree / "strata" / "rules" / "layout.py"
    text = source.read_text()
    anchor = "\n    @property\n    def grid(self)"
    assert text.count(anchor) == 1
    source.write_text(text.replace(anchor, "\n" + NEW_FIELD + anchor))
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHECKS, str(tree), str(tmp_path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "all five" in done.stdout, done.stderr[-3000:]


def test_describe_writes_what_plan_layout_reads():
    """Every searched kind of layout goes through text and back unchanged."""
    work = workload(get_preset("tiny"), 8, 16, "fp32")
    for layout in (Layout(dp=2, tp=2, zero=1, micro_batch=2, sequence_parallel=True, checkpointing="full"),
                   Layout(dp=1, tp=2, pp=2, virtual_stages=2, schedule="interleaved", micro_batch=1),
                   Layout(dp=2, cp=2, cp_mode="ulysses", micro_batch=1, reduce_dtype="fp32"),
                   Layout(dp=4, zero=3, micro_batch=2, offload="cpu")):
        assert parse_layout(layout.describe(), work, layout.world_size) == layout, layout.describe()


def test_every_layout_field_is_one_setting_with_one_help():
    """The layout's fields and the run's own share one name space (a flag each), each with its text."""
    own = {f.name for f in fields(train_config()) if f.name != "layout"}
    assert not own & {f.name for f in fields(Layout)}
    assert all(f.metadata["help"] and f.metadata["auto"] in ("planned", "replaced", "kept") for f in fields(Layout))
    assert set(layout_text.keys(Layout)) >= {"dp", "tp", "pp", "v", "mb", "ckpt", "sp", "reduce", "gather"}


def test_a_config_toml_round_trips_and_older_flat_files_still_load(tmp_path):
    cfg = train_config(tp=2, micro_batch=4, sequence_parallel=True, steps=3, capacity_factor=1.5)
    path = tmp_path / "config.toml"
    path.write_text(config_toml(cfg))
    assert "[layout]" in path.read_text()
    assert make_config(load_toml(str(path)), {}) == cfg
    flat = tmp_path / "flat.toml"  # a file written before the [layout] table: the same config
    flat.write_text("steps = 3\ntp = 2\nmicro_batch = 4\nsequence_parallel = true\ncapacity_factor = 1.5\n")
    assert make_config(load_toml(str(flat)), {}) == cfg
    both = tmp_path / "both.toml"
    both.write_text("tp = 2\n[layout]\ntp = 4\n")
    with pytest.raises(Exception, match="'tp' and \\[layout\\] 'tp' both set tp"):
        load_toml(str(both))
    scalar = tmp_path / "scalar.toml"
    scalar.write_text("layout = 3\n")
    with pytest.raises(Exception, match="'layout' is a table of the layout's keys"):
        load_toml(str(scalar))
    misplaced = tmp_path / "misplaced.toml"
    misplaced.write_text("[layout]\nsteps = 3\n")
    with pytest.raises(Exception, match="unknown key \\[layout\\] 'steps'"):
        load_toml(str(misplaced))


def test_parallel_auto_keeps_the_users_kept_fields(monkeypatch):
    monkeypatch.setattr(auto, "local_cluster", lambda n: build_cluster("A100-80G", 1, n, "nvlink", "ib-200"))
    cfg = train_config(parallel="auto", seq_len=16, reduce_dtype="bf16", dtype="bf16", offload="cpu")
    chosen, _ = auto.choose(cfg, 2, get_preset("tiny"))
    assert (chosen.layout.reduce_dtype, chosen.layout.offload) == ("bf16", "cpu")
    assert chosen.layout.dp is not None and RUN_LAYOUT.dp is None
