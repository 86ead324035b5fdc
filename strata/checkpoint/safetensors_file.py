"""What a safetensors file holds, read from its header and checked against the file before the
`safetensors` library opens it: a checksum proves that a file is the one the manifest recorded,
not that it is a valid file (a copy truncated before the manifest was written, or a manifest
rewritten to match a damaged file, agrees with its checksum).

The format (https://github.com/huggingface/safetensors#format): 8 bytes, the header's length N
(little-endian); N bytes of JSON mapping each tensor's name to its dtype, shape and
[begin, end) byte offsets into the rest of the file; then the data, which the tensors cover
exactly, without gaps or overlaps."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from strata.checkpoint.records import whole
from strata.errors import CorruptError

# Bytes per element of the dtypes strata writes (its checkpoints hold floating-point values only).
FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str, what: str) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file by name, once its header is checked against the file's
    size: a length that fits, JSON of the right shape, floating-point dtypes, and offsets that
    match each shape and cover the data exactly. `what` names the file in the one-line error."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            if length is None or length > min(size - 8, MAX_HEADER_BYTES):
                raise CorruptError(_damaged(what, f"its header length {length} does not fit in its {size} bytes"
                                            if length is not None else f"{size} bytes is too short to hold a header"))
            raw = f.read(length)
    except OSError as e:
        raise CorruptError(f"{what}: cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CorruptError(_damaged(what, "its header is not JSON")) from None
    if not isinstance(header, dict):
        raise CorruptError(_damaged(what, f"its header is a JSON {type(header).__name__}, not an object"))
    tensors, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CorruptError(_damaged(what, "its __metadata__ is not a map of strings"))
            continue
        tensor, span = _entry(name, entry, what)
        tensors[name] = tensor
        spans.append(span)
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise CorruptError(_damaged(what, f"tensor {name!r} starts at byte {begin} of the data, "
                                              f"{'overlapping the one before' if begin < end else f'leaving a gap after {end}'}"))
        end = stop
    if end != size - 8 - length:
        raise CorruptError(_damaged(what, f"its tensors cover {end} bytes of data, the file holds {size - 8 - length}"))
    return tensors


def _entry(name: str, entry: object, what: str) -> tuple[TensorEntry, tuple[int, int, str]]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CorruptError(_damaged(what, f"tensor {name!r}: want dtype, shape and data_offsets"))
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in FLOAT_BYTES:
        raise CorruptError(_damaged(what, f"tensor {name!r} has dtype {dtype!r}; want one of {', '.join(FLOAT_BYTES)}"))
    if not isinstance(shape, list) or not all(whole(n) for n in shape):
        raise CorruptError(_damaged(what, f"tensor {name!r} has shape {shape!r}; want whole numbers"))
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(whole(n) for n in offsets) \
            or offsets[0] > offsets[1]:
        raise CorruptError(_damaged(what, f"tensor {name!r} has data_offsets {offsets!r}; want [begin, end]"))
    tensor = TensorEntry(dtype, tuple(shape))
    if offsets[1] - offsets[0] != tensor.numel * FLOAT_BYTES[dtype]:
        raise CorruptError(_damaged(what, f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} "
                                          f"of {dtype}"))
    return tensor, (offsets[0], offsets[1], name)



def _damaged(what: str, why: str) -> str:
    return f"{what}: not a valid safetensors file ({why})"
