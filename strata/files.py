"""Paths the user names and paths read from files, checked before anything is written or followed.
Errors name the setting (a field) or the file; the CLI renders fields as flags."""

from __future__ import annotations

import json
import os

from strata.errors import ConfigError, CorruptError


def inside(directory: str, name: object, what: str) -> str:
    """directory/name, for a `name` read from a file (a manifest, a pointer, an index): it must be a
    plain file name, so that what a file says can never lead out of its directory."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or \
            os.path.basename(name) != name or (os.altsep and os.altsep in name):
        raise CorruptError(f"{what}: {name!r} is not a plain file name inside {directory}")
    return os.path.join(directory, name)


def cache_dir() -> str:
    """Where strata keeps what it measures once per machine (the matmul peak, the calibration
    profile): $STRATA_CACHE_DIR when set and not empty, else ~/.cache/strata."""
    return os.environ.get("STRATA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "strata")


def read_json(path: str, what: str = "") -> object:
    """A JSON file's value; one line naming the file when it is not JSON (or not text)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CorruptError(f"{path}: not valid JSON{what and f' ({what})'}: {e}") from None


def read_json_object(path: str, what: str = "") -> dict:
    """A JSON file that must hold an object (a manifest, meta.json, a profile)."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise CorruptError(f"{path}: holds a JSON {type(value).__name__}, not an object{what and f' ({what})'}")
    return value


def _nearest_existing(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return parent


def check_output_dir(path: str, field: str) -> None:
    """A directory to write into: a name, not a file, and under a directory (made as needed)."""
    if not path:
        raise ConfigError("give a directory", field, repr(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("exists and is not a directory", field, path)
    parent = _nearest_existing(path)
    if not os.path.isdir(parent):
        raise ConfigError(f"{parent} is a file, so nothing can be made under it", field, path)


def check_output_file(path: str, field: str) -> None:
    """A file to write: a name, not a directory, in a directory that exists."""
    if not path:
        raise ConfigError("give a file name", field, repr(path))
    if os.path.isdir(path):
        raise ConfigError("is a directory; want a file name", field, path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"the directory {folder} does not exist", field, path)


IMAGE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")  # what matplotlib writes, by the file's suffix


def check_image_file(path: str, field: str) -> None:
    """A picture to write: a file name whose suffix says the format (matplotlib would otherwise add
    .png to a name without one, and the command would report a file it did not write)."""
    check_output_file(path, field)
    if path.rsplit(".", 1)[-1].lower() not in IMAGE_FORMATS or "." not in os.path.basename(path):
        raise ConfigError(f"give a file name ending in .{', .'.join(IMAGE_FORMATS)}", field, path)

