"""The documents of one source file: a .txt file is one document; a .jsonl file one per line (the
text under `text_field`); a .parquet file one per row (the `text_field` column, read with pyarrow).
A line or row that has no text is refused in one line naming the file and the line (or row)."""

from __future__ import annotations

import json
from pathlib import Path

from strata.errors import ConfigError, CorruptError


def read_text(path: str) -> str:
    """A source file's text; text that is not UTF-8 is refused, not silently replaced."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--source {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_documents(path: str, text_field: str = "text") -> list[str]:
    if path.endswith(".jsonl"):
        return jsonl_documents(path, text_field)
    if path.endswith(".parquet"):
        return parquet_documents(path, text_field)
    return [read_text(path)]


def jsonl_documents(path: str, text_field: str) -> list[str]:
    documents = []
    # "\n" only: JSON strings may hold U+2028 and other characters str.splitlines() would cut at
    for number, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"line {number} is not JSON ({e.msg}, column {e.colno})", "source", path) from None
        if not isinstance(record, dict) or text_field not in record:
            raise ConfigError(f"line {number} has no {text_field!r} field (choose the field with text_field)",
                              "source", path)
        if not isinstance(record[text_field], str):
            raise ConfigError(f"line {number}: {text_field!r} holds a JSON {type(record[text_field]).__name__}, "
                              f"not text", "source", path)
        documents.append(record[text_field])
    return documents


def parquet_documents(path: str, text_field: str) -> list[str]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("a .parquet source needs pyarrow (pip install pyarrow)", "source", path) from None
    try:
        schema = pq.read_schema(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise CorruptError(f"--source {path}: not a readable parquet file ({str(e).splitlines()[0][:200]})") from None
    if text_field not in schema.names:
        raise ConfigError(f"has no column {text_field!r} (columns: {', '.join(schema.names[:8])}; choose one "
                          f"with text_field)", "source", path)
    kind = schema.field(text_field).type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
        raise ConfigError(f"column {text_field!r} holds {kind}, not text", "source", path)
    documents = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    missing = next((row for row, text in enumerate(documents) if text is None), None)
    if missing is not None:
        raise ConfigError(f"row {missing} has no {text_field!r} (null)", "source", path)
    return documents
