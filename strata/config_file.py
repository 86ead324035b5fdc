"""A run's settings as the user gives them: a TOML file (the layout's keys in its [layout] table,
or at the top as files written before it) and the command line's flags, merged into one
TrainConfig (strata/config.py). Both hold settings by their one names (a flag's, a key's)."""

from __future__ import annotations

import tomllib

from strata.config import LAYOUT_NAMES, TrainConfig, default_of, is_layout_setting, setting_fields, train_config
from strata.errors import ConfigError


def load_toml(path: str) -> dict:
    """Read a TOML config into settings by their one names; keys are the long flag names with '_'
    or '-', the layout's in the [layout] table or, as in files written before it, at the top."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path}: is a directory; want a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    if "layout" in raw and not isinstance(raw["layout"], dict):
        raise ConfigError(f"--config {path}: layout = {raw['layout']!r}: 'layout' is a table of the layout's keys "
                          f"([layout], then dp = ..., tp = ..., one per line)")
    out, spelled = {}, {}
    entries = [(key, value, "") for key, value in raw.items() if key != "layout"]
    entries += [(key, value, "[layout] ") for key, value in raw.get("layout", {}).items()]
    valid = setting_fields()
    for key, value, table in entries:
        name = key.replace("-", "_")
        if name not in valid or (table and not is_layout_setting(name)):
            names = sorted(LAYOUT_NAMES) if table else list(valid)
            raise ConfigError(f"--config {path}: unknown key {table}{key!r}; valid keys: {', '.join(names)}")
        if name in out:  # seq-len and seq_len: one value would win and the other vanish
            raise ConfigError(f"--config {path}: {spelled[name]} and {table}{key!r} both set {name}; keep one")
        out[name], spelled[name] = value, f"{table}{key!r}"
    return out


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_types(values: dict, source: str) -> None:
    """TOML values must have the field's type (an int where a float is wanted is fine)."""
    types = {name: f.type for name, f in setting_fields().items()}
    for key, value in values.items():
        base = types[key].split(" | ")[0]
        ok = isinstance(value, _TYPES[base]) and not (base in ("int", "float") and isinstance(value, bool))
        if not ok and not (value is None and "None" in types[key]):
            raise ConfigError(f"{source}: {key} = {value!r} is not of type {base}")


def make_config(file_values: dict, flag_values: dict, source: str = "--config") -> TrainConfig:
    """Defaults < config file < flags (flags given as None were not set). Both hold settings by
    their one names (load_toml flattens the [layout] table)."""
    _check_types(file_values, source)
    values = dict(file_values)
    values.update({k: v for k, v in flag_values.items() if v is not None})
    types = setting_fields()
    for name, value in values.items():  # TOML gives ints where floats are meant
        if types[name].type.split(" | ")[0] == "float" and isinstance(value, int) and not isinstance(value, bool):
            values[name] = float(value)
    return train_config(**values)


def given_settings(file_values: dict, flag_values: dict) -> set[str]:
    """The settings the user set: every flag given, and the config file's keys whose value is not
    the default (a config.toml that --run-dir wrote lists every key, defaults included)."""
    return {k for k, v in flag_values.items() if v is not None} | \
        {k for k, v in file_values.items() if v != default_of(k)}
