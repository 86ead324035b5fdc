"""Checkpoint files mutated at random (issue 51): loading a mutated checkpoint ends in a one-line
refusal (CorruptError or ConfigError, whose message is one line) or in a correct load; any other
exception fails the test.

One tiny checkpoint (a step of the tiny preset on prepared data, so that it holds a tokenizer) is
mutated CASES times from a fixed seed, one mutation a case, drawn from: a JSON field of the
manifest, of the rank's shard JSON or of the tokenizer changed, deleted or given another type;
bytes of the safetensors header overwritten; its header length replaced (0, off by one, past
the end, 2**64 - 1); its header's JSON changed (dtype, shape, offsets); a file truncated or
grown; a low bit of a stored value flipped; `latest` rewritten; and a file, the step directory
or `latest` replaced by a symbolic link (to an identical copy outside the checkpoint, a
directory, nothing, itself, or another file inside). Most changes to a data file come with the
manifest rewritten to agree (size and sha256), as a copy truncated before its manifest was
written, or an attacker, leaves it: the checksum then proves nothing and the file's own
structure must be checked.

How the cases are split, and why: every case is loaded three ways by the functions the commands
themselves call, in this process, where an exception other than a refusal surfaces with its type
and the case that caused it, and a load costs about 0.05 s (the command line's train also runs a
step and a validation; 320 cases x 3 commands must fit in about 20 s of the suite's budget):
  generate         strata.cli.generate.generate_command, the command's handler (one process, one token);
  train --resume   strata.cli.train.checked_train (what the launcher checks: preflight), then
                   strata.train.trainer.setup (what a rank does to start: build, then restore the
                   checkpoint); the training step after it reads no file and is left out;
  convert --to-hf  strata.checkpoint.hf.convert_to_hf.
Every CLI_EVERY-th case also runs the three real command lines (strata.cli.main, in this process,
stderr captured; train runs its step): each prints exactly one line `strata: error: ...` with
exit code 2, or succeeds with exit code 0."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil

import pytest

from strata.checkpoint import store
from strata.checkpoint.hf import convert_to_hf
from strata.cli import main
from strata.cli.generate import generate_command
from strata.cli.parser import build_parser
from strata.cli.train import checked_train
from strata.config import train_config
from strata.data.prepare import prepare
from strata.distributed import comm
from strata.errors import ConfigError, CorruptError, as_flag
from strata.train.trainer import setup, train

CASES = 320
SEED = 51
CLI_EVERY = 40  # 8 cases through the command line, 24 commands
STEP = "step_000001"
FILES = ("manifest.json", "shard_0.json", "shard_0.safetensors", "tokenizer.json")
ODD_VALUES = [None, True, False, 0, -1, 1, 7, 2 ** 31, 2 ** 63, 10 ** 30, -10 ** 20, 1.5, -0.0, 1e308,
              float("nan"), float("inf"), "", "x", "step_000001", "../x", "a\nb", "\ud800", "F32", "float32",
              [], {}, [1, 2, 3], [[1]], {"a": 1}, [None]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the directory to work in, the prepared data, the pristine files of a one-step checkpoint)."""
    root = tmp_path_factory.mktemp("mutations")
    (root / "corpus.txt").write_text("It was the best of times, it was the worst of times.\n" * 200)
    prepare([str(root / "corpus.txt")], str(root / "data"), "bpe:300", 0.1)
    save = root / "pristine"
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        train(train_config(model="tiny", data=str(root / "data"), steps=1, micro_batch=1, seq_len=16, save=str(save),
                          progress=False, eval_batches=1, peak_flops=1e10))
    pristine = {name: (save / STEP / name).read_bytes() for name in FILES}
    pristine["latest"] = (save / "latest").read_bytes()
    return root, str(root / "data"), pristine


class Checkpoint:
    """A save directory rebuilt from the pristine bytes for each case, and the changes made to it."""

    def __init__(self, root, pristine: dict[str, bytes]):
        self.save, self.outside, self.pristine = root / "ck", root / "outside", pristine
        self.step = self.save / STEP

    def reset(self) -> None:
        for path in (self.save, self.outside):
            if path.exists() or path.is_symlink():
                shutil.rmtree(path)
        self.step.mkdir(parents=True)
        self.outside.mkdir()
        for name, data in self.pristine.items():
            (self.save / name if name == "latest" else self.step / name).write_bytes(data)

    def read(self, name: str) -> bytes:
        return (self.step / name).read_bytes()

    def write(self, name: str, data: bytes, agree: bool) -> None:
        """Replace a file of the step directory; agree: the manifest is rewritten to match it."""
        (self.step / name).write_bytes(data)
        if agree and name != "manifest.json":
            manifest = json.loads(self.read("manifest.json"))
            manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            (self.step / "manifest.json").write_text(json.dumps(manifest))


# --- mutations: each changes the checkpoint and says how ---------------------------------------------
def _odd_value(rng: random.Random, old):
    if isinstance(old, (int, float)) and not isinstance(old, bool) and rng.random() < 0.5:
        return rng.choice([old + 1, old - 1, old * 2, -old, old // 2 if isinstance(old, int) else old / 2, 0])
    if isinstance(old, list) and old and rng.random() < 0.3:
        return old[:rng.randrange(len(old))] if rng.random() < 0.5 else old + old[:1]
    return rng.choice(ODD_VALUES)


def _mutate_tree(rng: random.Random, tree) -> tuple[object, str]:
    """Change one node of a JSON value, found by walking down from the root (stopping early at
    times, so that whole records change too): replaced, deleted, or a key added."""
    if not isinstance(tree, (dict, list)) or not tree:
        return _odd_value(rng, tree), "the root replaced"
    path, parent, key = [], None, None
    node = tree
    while isinstance(node, (dict, list)) and node and (not path or rng.random() > 0.3):
        parent, key = node, rng.choice(list(node) if isinstance(node, dict) else range(len(node)))
        path.append(key)
        node = node[key]
    where = "/".join(map(str, path))[:80]
    choice = rng.random()
    if isinstance(parent, dict) and choice < 0.2:
        del parent[key]
        return tree, f"{where} deleted"
    if isinstance(node, dict) and choice < 0.3:
        node[rng.choice(["extra", "more", "dim", "rng", "hf", "loss_scaler", "data_position"])] = _odd_value(rng, None)
        return tree, f"{where}: a key added"
    parent[key] = _odd_value(rng, node)
    return tree, f"{where} = {parent[key]!r}"[:120]


def json_field(rng, ck: Checkpoint) -> str:
    name = rng.choices(["manifest.json", "shard_0.json", "tokenizer.json"], [5, 4, 1])[0]
    tree, how = _mutate_tree(rng, json.loads(ck.read(name)))
    agree = rng.random() < 0.85
    ck.write(name, json.dumps(tree).encode(), agree)
    return f"{name}: {how}{' (manifest agrees)' if agree else ''}"


def _header(ck: Checkpoint) -> tuple[int, bytes]:
    data = ck.read("shard_0.safetensors")
    return int.from_bytes(data[:8], "little"), data


def header_bytes(rng, ck: Checkpoint) -> str:
    length, data = _header(ck)
    data = bytearray(data)
    places = [rng.randrange(8 + length) for _ in range(rng.randint(1, 4))]
    for place in places:
        data[place] = rng.randrange(256)
    agree = rng.random() < 0.85
    ck.write("shard_0.safetensors", bytes(data), agree)
    return f"safetensors header bytes {places} overwritten{' (manifest agrees)' if agree else ''}"


def header_length(rng, ck: Checkpoint) -> str:
    length, data = _header(ck)
    new = rng.choice([0, 1, 2, length - 1, length + 1, len(data) - 8, len(data), 2 ** 32, 2 ** 63, 2 ** 64 - 1,
                      rng.randrange(2 ** 64)])
    ck.write("shard_0.safetensors", new.to_bytes(8, "little") + data[8:], agree=True)
    return f"safetensors header length {length} -> {new}"


def header_json(rng, ck: Checkpoint) -> str:
    length, data = _header(ck)
    header = json.loads(data[8:8 + length])
    tree, how = _mutate_tree(rng, header)
    text = json.dumps(tree).encode()
    ck.write("shard_0.safetensors", len(text).to_bytes(8, "little") + text + data[8 + length:], agree=True)
    return f"safetensors header: {how}"


def truncate(rng, ck: Checkpoint) -> str:
    name = rng.choice(FILES)
    data = ck.read(name)
    size = rng.choice([0, 1, 7, 8, 9, rng.randrange(len(data)), len(data) - 1])
    agree = rng.random() < 0.7
    ck.write(name, data[:size], agree)
    return f"{name} truncated to {size} bytes{' (manifest agrees)' if agree else ''}"


def grow(rng, ck: Checkpoint) -> str:
    name = rng.choice(FILES)
    extra = bytes(rng.randrange(256) for _ in range(rng.choice([1, 8, 100])))
    agree = rng.random() < 0.7
    ck.write(name, ck.read(name) + extra, agree)
    return f"{name} grown by {len(extra)} bytes{' (manifest agrees)' if agree else ''}"


def value_bit(rng, ck: Checkpoint) -> str:
    """A stored value's lowest mantissa bit: still a valid file, still finite, other weights."""
    length, data = _header(ck)
    place = 8 + length + 4 * rng.randrange((len(data) - 8 - length) // 4)
    data = bytearray(data)
    data[place] ^= 1
    ck.write("shard_0.safetensors", bytes(data), agree=True)
    return f"a stored value's low bit flipped at byte {place} (manifest agrees)"


def latest(rng, ck: Checkpoint) -> str:
    text = rng.choice([b"step_000002", b"step_1", b"", b"../step_000001", b"step_000001\n", b"\xff\xfe",
                       b"step_000001/manifest.json", b"latest", b"step_" + b"9" * 300])
    (ck.save / "latest").write_bytes(text)
    return f"latest says {text[:40]!r}"


def link(rng, ck: Checkpoint) -> str:
    """Replace a file, the step directory or `latest` with a symbolic link."""
    what = rng.choice([*FILES, "latest", STEP])
    path = ck.save / what if what in ("latest", STEP) else ck.step / what
    copy = ck.outside / what
    if path.is_dir():
        shutil.copytree(path, copy)
        shutil.rmtree(path)
    else:
        shutil.copy(path, copy)
        path.unlink()
    target = rng.choice(["an identical copy outside", "a directory outside", "nothing", "itself", "a file inside",
                         "the same file by its absolute path"])
    if target == "a file inside":
        destination = ck.step / rng.choice([f for f in FILES if f != what]) if what != STEP else ck.save / "latest"
    elif target == "the same file by its absolute path":
        os.rename(copy, path)  # put it back, under another name, and link to that
        hidden = path.with_name(path.name + ".real")
        os.rename(path, hidden)
        destination = hidden
    else:
        destination = {"an identical copy outside": copy, "a directory outside": ck.outside,
                       "nothing": ck.outside / "gone", "itself": path}[target]
    os.symlink(destination, path)
    return f"{what} is a link to {target}"


MUTATIONS = [(json_field, 30), (header_bytes, 10), (header_length, 8), (header_json, 14), (truncate, 10),
             (grow, 5), (value_bit, 3), (latest, 5), (link, 15)]


# --- the three commands' loading, in this process -----------------------------------------------------
def load_generate(ck: Checkpoint, data: str, out) -> None:
    argv = ["generate", "--checkpoint", str(ck.save), "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert generate_command(build_parser().parse_args(argv), argv) == 0


def _train_argv(ck: Checkpoint, data: str) -> list[str]:
    return ["train", "--model", "tiny", "--data", data, "--seq-len", "16", "--micro-batch", "1", "--steps", "2",
            "--resume", str(ck.save), "--eval-batches", "1", "--peak-flops", "1e10", "--no-progress"]


def load_train(ck: Checkpoint, data: str, out) -> None:
    argv = _train_argv(ck, data)
    with contextlib.redirect_stderr(io.StringIO()):
        spec = checked_train(build_parser().parse_args(argv), None, in_a_rank=False)
        run = setup(spec)  # the spec says its files were checked
    run.parallel.close()
    comm.close_streams()
    assert run.state.start_step == store.read_state(str(ck.save))["step"]


def load_convert(ck: Checkpoint, data: str, out) -> None:
    convert_to_hf(str(ck.save), str(out))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))


def _outcome(load, ck: Checkpoint, data: str, out, case: str) -> str:
    try:
        load(ck, data, out)
    except (CorruptError, ConfigError) as e:
        message = e.render(as_flag) if isinstance(e, ConfigError) else str(e)
        assert message.strip() and "\n" not in message, f"{case}: {load.__name__}: a message of several lines: {message!r}"
        return "refused"
    return "loaded"


def _cli(argv: list[str], case: str) -> int:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    lines = err.getvalue().strip().splitlines()
    if code == 0:
        return code
    assert code == 2 and len(lines) == 1 and lines[0].startswith("strata: error: "), \
        f"{case}: strata {' '.join(argv[:2])}: exit {code}, stderr {err.getvalue()[-2000:]!r}"
    return code


def test_every_mutated_checkpoint_is_refused_in_one_line_or_loads(tiny):
    root, data, pristine = tiny
    ck = Checkpoint(root, pristine)
    rng = random.Random(SEED)
    ck.reset()
    for load in (load_generate, load_train, load_convert):  # the pristine checkpoint loads every way
        assert _outcome(load, ck, data, root / "hf_pristine" / load.__name__, "pristine") == "loaded"
    counts = {"refused": 0, "loaded": 0}
    for i in range(CASES):
        ck.reset()
        mutation = rng.choices([m for m, _ in MUTATIONS], [w for _, w in MUTATIONS])[0]
        case = f"case {i} (seed {SEED}): {mutation(rng, ck)}"
        for load in (load_generate, load_train, load_convert):
            out = root / "hf" / f"{i}_{load.__name__}"
            try:
                counts[_outcome(load, ck, data, out, case)] += 1
            except (CorruptError, ConfigError, AssertionError):
                raise
            except Exception as e:  # noqa: BLE001 - named with the case that caused it
                raise AssertionError(f"{case}: {load.__name__}: {type(e).__name__}: {e}") from e
        if i % CLI_EVERY == 0:
            out = root / "hf" / f"{i}_cli"
            _cli(["generate", "--checkpoint", str(ck.save), "--prompt-ids", "1,2", "--max-new-tokens", "1"], case)
            _cli(_train_argv(ck, data), case)
            _cli(["convert", "--to-hf", str(ck.save), "--out", str(out)], case)
        shutil.rmtree(root / "hf", ignore_errors=True)
    # both outcomes are common: the mutations reach past the first check
    assert counts["refused"] > CASES and counts["loaded"] > CASES // 4, counts
