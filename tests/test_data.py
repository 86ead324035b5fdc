import json
import os

import numpy as np
import pytest
import torch
from documents import DOCUMENTS, model_tokenizer_dir, write_sources

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


def test_an_accelerator_s_batch_is_copied_a_step_ahead_from_pinned_memory(monkeypatch):
    """The loader's bookkeeping, with the meta device standing in for an accelerator (this machine
    has none: bench/gpu_check.py counts the step's syncs on one): each step's tokens are pinned
    and copied once, non-blocking, queued while the step before takes its batch."""
    copies = []
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        copies.append((kwargs.get("non_blocking"), getattr(self, "pinned", False)))
        return original_to(self, *args, **kwargs)

    def pin(self):
        pinned = self.clone()
        pinned.pinned = True
        return pinned
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    source = synthetic_split(64, seed=1, split="train", tokens=5000)
    host, device = BatchLoader(source, 8, 4, seed=1), BatchLoader(source, 8, 4, seed=1, device=torch.device("meta"))
    for step in range(3):
        micro = device.micro_batches(step, 2)
        assert len(micro) == 2 and all(x.device.type == "meta" and x.shape == (2, 8) for pair in micro for x in pair)
        assert list(device.ahead) == [step + 1]  # the next step's copy is queued
    assert copies == [(True, True)] * 4  # steps 0 and 1 at the first take, then one a step, all pinned
    assert torch.equal(device.tokens(2), torch.cat([host.batch(2)[0], host.batch(2)[1][:, -1:]], dim=1))


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


# --- .jsonl and .parquet sources, a Hugging Face model's tokenizer ---------------------------------
def test_jsonl_and_parquet_documents_are_each_framed_by_the_models_bos_and_eos(tmp_path):
    sources = write_sources(tmp_path, field="body")
    meta = prepare(sources, str(tmp_path / "out"), str(model_tokenizer_dir(tmp_path / "hf")), 0.1, text_field="body")
    assert meta["vocab_size"] == 251 and meta["document_prefix"] == [1] and meta["end_of_text"] == 2
    stream = np.concatenate([np.fromfile(tmp_path / "out" / f"{split}_000.bin", dtype=np.uint16)
                             for split in ("train", "val")])  # (val is the tail of each file: order differs)
    assert (stream == 1).sum() == (stream == 2).sum() == 2 * len(DOCUMENTS)
    train = np.fromfile(tmp_path / "out" / "train_000.bin", dtype=np.uint16)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    first = train[1:list(train).index(2)].tolist()
    assert train[0] == 1 and tokenizer.decode(first) == DOCUMENTS[0]


def test_without_a_bos_in_its_tokenizer_a_document_is_followed_by_eos_only(tmp_path):
    meta = prepare(write_sources(tmp_path)[:1], str(tmp_path / "out"),
                   str(model_tokenizer_dir(tmp_path / "hf", add_bos=False)), 0.1)
    assert meta["document_prefix"] == [] and meta["end_of_text"] == 2


@pytest.mark.parametrize("lines,needle", [
    (['{"text": "fine"}', '{"txt": "typo"}'], "docs.jsonl: line 2 has no 'text' field"),
    (['{"text": "fine"}', "", '{"text": 3}'], "docs.jsonl: line 3: 'text' holds a JSON int, not text"),
    (['{"text": "fine"', '{"text": "x"}'], "docs.jsonl: line 1 is not JSON"),
])
def test_a_bad_jsonl_line_is_one_line_naming_the_file_and_line(tmp_path, lines, needle, capsys):
    from strata.cli import main as strata_main
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    assert strata_main(["data", "prepare", "--source", str(tmp_path / "docs.jsonl"), "--tokenizer", "bpe:300",
                        "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("strata: error: --source ") and err.count("\n") == 1, err


def test_a_parquet_file_without_the_column_or_with_a_null_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["a", None]}), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match="has no column 'text' \\(columns: body"):
        prepare([str(tmp_path / "a.parquet")], str(tmp_path / "o1"), "bpe:300")
    with pytest.raises(ConfigError, match="row 1 has no 'body' \\(null\\)"):
        prepare([str(tmp_path / "a.parquet")], str(tmp_path / "o2"), "bpe:300", text_field="body")
