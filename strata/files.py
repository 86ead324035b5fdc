"""Paths the user names and paths read from files, checked before anything is written or followed.
Errors name the setting (a field) or the file; the CLI renders fields as flags."""

from __future__ import annotations

import json
import os
import re
import tempfile

from strata.errors import ConfigError, CorruptError


def inside(directory: str, name: object, what: str, links_out: bool = False) -> str:
    """directory/name, for a `name` read from a file (a manifest, a pointer, an index): it must be a
    plain file name (no separator, no control character: it is printed in one-line errors), so
    that what a file says can never lead out of its directory, and (unless
    links_out) not a symbolic link to something outside it either (see `resolves_inside`)."""
    if not _plain_name(name):
        raise CorruptError(f"{what}: {name!r} is not a plain file name inside {directory}")
    path = os.path.join(directory, name)
    if not links_out:
        resolves_inside(directory, path, what)
    return path


def _plain_name(name: object) -> bool:
    if not isinstance(name, str) or name in ("", ".", "..") or any(ord(c) < 32 for c in name) or \
            os.path.basename(name) != name or (os.altsep and os.altsep in name):
        return False
    try:
        name.encode("utf-8")  # a lone surrogate (JSON allows "\ud800") names no file
    except UnicodeEncodeError:
        return False
    return True


def resolves_inside(directory: str, path: str, what: str) -> str:
    """`path` (an entry of `directory`), once what it names after every symbolic link is resolved
    lies inside the resolved directory: a link is followed only where its name may lead. A broken
    link is judged by where it points (reading it then fails as a missing file does)."""
    home, target = os.path.realpath(directory), os.path.realpath(path)
    if target == home or os.path.commonpath([home, target]) != home:
        raise CorruptError(f"{what}: {os.path.basename(path)!r} is a link to {target!r}, outside {directory}")
    return path


def cache_dir() -> str:
    """Where strata keeps what it measures once per machine (the matmul peak, the calibration
    profile): $STRATA_CACHE_DIR when set and not empty, else ~/.cache/strata."""
    return os.environ.get("STRATA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "strata")


def read_json(path: str, what: str = "") -> object:
    """A JSON file's value; one line naming the file when it is not JSON (or not text, or nested
    deeper than Python's parser goes), or cannot be read."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        reason = "nested too deeply" if isinstance(e, RecursionError) else e
        raise CorruptError(f"{path}: not valid JSON{what and f' ({what})'}: {reason}") from None
    except OSError as e:
        raise CorruptError(f"{path}: cannot be read{what and f' ({what})'}: {e.strerror or e}") from None


def read_json_object(path: str, what: str = "") -> dict:
    """A JSON file that must hold an object (a manifest, meta.json, a profile)."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise CorruptError(f"{path}: holds a JSON {type(value).__name__}, not an object{what and f' ({what})'}")
    return value


# File systems that hold the kernel's state or devices, not storage: a file made there is not kept
# (or, as root, writes into the kernel). /dev's devices (e.g. /dev/null) may still be named as files.
PSEUDO_FILE_SYSTEMS = ("proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                       "securityfs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "binfmt_misc", "efivarfs",
                       "autofs", "rpc_pipefs", "nsfs", "hugetlbfs")
PSEUDO_ROOTS = ("/proc", "/sys")  # whatever is mounted under them
NAME_MAX = 255  # bytes in one part of a path (ext4, xfs, btrfs, tmpfs)


def _nearest_existing(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return parent


def _mounted_file_system(place: str) -> str | None:
    """The type of the file system holding the directory `place` (Linux's /proc/self/mounts; None
    where it cannot be read)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    best, kind = "", None
    for point, fs_type in mounts:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)  # "\040" is a space
        if (place == point or place.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fs_type
    return kind


def _check_name(path: str, field: str) -> None:
    """A name the file system can hold: no NUL byte (a TOML string may carry one), and no part
    longer than the 255 bytes Linux's file systems take (else every write fails after the run)."""
    if "\0" in path:
        raise ConfigError("holds a NUL character, which no file name can", field, repr(path))
    longest = max(len(os.fsencode(part)) for part in path.split(os.sep))
    if longest > NAME_MAX:
        raise ConfigError(f"a part of it is {longest} bytes long; file systems take at most {NAME_MAX}", field, path)


def _under_pseudo_root(real: str) -> str | None:
    return next((root for root in PSEUDO_ROOTS if real == root or real.startswith(root + "/")), None)


def check_writable_place(place: str, field: str, path: str) -> None:
    """`place`, an existing directory, can hold what `path` (the value of `field`) writes: it is on
    storage (not /proc, /sys or another of the kernel's file systems) and a file can be made and
    removed there. The probe is the honest test: permissions, read-only mounts, quotas and root's
    exemptions all show in it, which os.access does not."""
    real = os.path.realpath(place)
    fs_type = _mounted_file_system(real)
    if _under_pseudo_root(real) or fs_type in PSEUDO_FILE_SYSTEMS:
        what = f"on a {fs_type} file system" if fs_type in PSEUDO_FILE_SYSTEMS else f"under {_under_pseudo_root(real)}"
        raise ConfigError(f"{place} is {what}, which holds the kernel's state or devices, not files; choose a "
                          f"directory on a disk", field, path)
    try:
        handle, probe = tempfile.mkstemp(prefix=".strata-write-test-", dir=place)
    except OSError as e:
        raise ConfigError(f"cannot write in {place} ({e.strerror or e})", field, path) from None
    os.close(handle)
    try:
        os.unlink(probe)
    except OSError:
        pass


def check_output_dir(path: str, field: str) -> None:
    """A directory to write into: a name, not a file, and under a directory (made as needed) on
    storage where this process can write (check_writable_place)."""
    if not path:
        raise ConfigError("give a directory", field, repr(path))
    _check_name(path, field)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("exists and is not a directory", field, path)
    place = path if os.path.isdir(path) else _nearest_existing(path)
    if not os.path.isdir(place):
        raise ConfigError(f"{place} is a file, so nothing can be made under it", field, path)
    check_writable_place(place, field, path)


def check_output_file(path: str, field: str, make_parents: bool = False) -> None:
    """A file to write: a name, not a directory, in a directory that exists (or, with make_parents,
    one that the writer makes under an existing one), where this process can write. An existing
    device (/dev/null) is written as it is."""
    if not path:
        raise ConfigError("give a file name", field, repr(path))
    _check_name(path, field)
    if os.path.isdir(path):
        raise ConfigError("is a directory; want a file name", field, path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path) and not os.path.isfile(path) and not _under_pseudo_root(os.path.realpath(folder)):
        return  # a device (/dev/null) or a pipe: the user's choice of where the bytes go
    if not os.path.isdir(folder):
        if not make_parents:
            raise ConfigError(f"the directory {folder} does not exist", field, path)
        folder = _nearest_existing(path)
        if not os.path.isdir(folder):
            raise ConfigError(f"{folder} is a file, so nothing can be made under it", field, path)
    check_writable_place(folder, field, path)


IMAGE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")  # what matplotlib writes, by the file's suffix


def check_image_file(path: str, field: str) -> None:
    """A picture to write: a file name whose suffix says the format (matplotlib would otherwise add
    .png to a name without one, and the command would report a file it did not write)."""
    check_output_file(path, field)
    if path.rsplit(".", 1)[-1].lower() not in IMAGE_FORMATS or "." not in os.path.basename(path):
        raise ConfigError(f"give a file name ending in .{', .'.join(IMAGE_FORMATS)}", field, path)

