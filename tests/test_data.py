import json
import os

import numpy as np
import pytest
import torch

from strata.data.loader import BatchLoader, open_split, synthetic_split
from strata.data.prepare import prepare, shakespeare_files
from strata.errors import ConfigError

TEXT = ("From fairest creatures we desire increase,\nThat thereby beauty's rose might never die,\n"
        "But as the riper should by time decease,\nHis tender heir might bear his memory:\n") * 40


@pytest.fixture
def prepared(tmp_path):
    src = tmp_path / "sonnets"
    src.mkdir()
    (src / "a.txt").write_text(TEXT)
    (src / "b.txt").write_text(TEXT.upper())
    out = tmp_path / "data"
    meta = prepare([str(src)], str(out), "bpe:300", val_fraction=0.1)
    return out, meta


def test_prepare_writes_shards_tokenizer_and_meta(prepared):
    out, meta = prepared
    assert json.loads((out / "meta.json").read_text()) == meta
    assert (out / "tokenizer.json").is_file()
    assert meta["vocab_size"] == 300
    for split in ("train", "val"):
        info = meta["splits"][split]
        stored = sum(os.path.getsize(out / s["file"]) for s in info["shards"]) // 2  # uint16
        assert stored == info["tokens"] > 0
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    assert abs(meta["splits"]["val"]["tokens"] / total - 0.1) < 0.02


def test_tokens_decode_back_to_the_text(prepared):
    from tokenizers import Tokenizer
    out, _ = prepared
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = np.fromfile(out / "train_000.bin", dtype=np.uint16)[:200].tolist()
    assert tokenizer.decode(ids) == TEXT[:len(tokenizer.decode(ids))]


def test_shakespeare_source_is_installed():
    files = shakespeare_files()
    assert len(files) > 30 and sum(os.path.getsize(f) for f in files) > 4_000_000


def test_bad_tokenizer_spec_is_refused(tmp_path):
    (tmp_path / "x.txt").write_text(TEXT)
    with pytest.raises(ConfigError, match="bpe:N"):
        prepare([str(tmp_path / "x.txt")], str(tmp_path / "out"), "bpe:ten")


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ranks_together_see_exactly_the_single_process_batch(prepared, dp_size):
    out, _ = prepared
    source = open_split(str(out), "train")
    single = BatchLoader(source, seq_len=16, global_batch=8, seed=3)
    ranks = [BatchLoader(source, 16, 8, 3, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for step in (0, 1, 17):
        inputs, targets = single.batch(step)
        assert torch.equal(torch.cat([r.batch(step)[0] for r in ranks]), inputs)
        assert torch.equal(torch.cat([r.batch(step)[1] for r in ranks]), targets)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(single.batch(0)[0], single.batch(1)[0])


def test_windows_are_a_pure_function_of_seed_and_step():
    source = synthetic_split(64, seed=1, split="train", tokens=5000)
    a, b = BatchLoader(source, 8, 4, seed=1), BatchLoader(source, 8, 4, seed=1)
    assert torch.equal(a.batch(5)[0], b.batch(5)[0])
    assert not torch.equal(a.batch(5)[0], BatchLoader(source, 8, 4, seed=2).batch(5)[0])
    micro = a.micro_batches(5, 2)
    assert len(micro) == 2 and torch.equal(torch.cat([x for x, _ in micro]), a.batch(5)[0])


def test_windows_never_cross_shards():
    from strata.data.loader import TokenSource
    source = TokenSource([np.arange(10), np.arange(100, 110)], vocab_size=200)
    loader = BatchLoader(source, seq_len=4, global_batch=64, seed=0)
    inputs, targets = loader.batch(0)
    rows = torch.cat([inputs, targets[:, -1:]], 1)
    assert torch.all(rows[:, 1:] - rows[:, :-1] == 1)


def test_missing_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="strata data prepare"):
        open_split(str(tmp_path), "train")
