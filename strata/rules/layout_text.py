"""A Layout as text and back, generated from its fields' metadata (strata/rules/layout.setting):
`describe()` writes what `strata plan --layout` reads, so a layout the planner prints can be pasted
back, and a field added to the Layout is a `--layout` key with no edit here.

    dp=8,tp=8,pp=16,v=2,zero=1,mb=1,interleaved,sp,ckpt=full,reduce=bf16

Each part is `key=value`; a switch alone (`sp`) is on; a bare schedule name is the schedule."""

from __future__ import annotations

from dataclasses import Field, fields

from strata.errors import ConfigError

KINDS = {"int": int, "float": float, "str": str, "bool": bool}


def kind(f: Field) -> type:
    """A field's value type, from its annotation ('int', 'float | None', ...)."""
    return KINDS[str(f.type).split(" | ")[0]]


def key_of(f: Field) -> str:
    """The field's name inside a `--layout` string ("" when it has none)."""
    key = f.metadata.get("key")
    return f.name if key is None else key


def keys(layout_type) -> dict[str, Field]:
    return {key_of(f): f for f in fields(layout_type) if key_of(f)}


def describe(layout) -> str:
    """The fields `show` asks for (the degrees always; the schedule with a pipeline; the rest
    where they differ from the default), in the fields' order."""
    parts = []
    for f in fields(layout):
        key, value, show = key_of(f), getattr(layout, f.name), f.metadata.get("show", "changed")
        shown = show == "always" or (layout.pp > 1 if show == "pipeline" else value != f.default)
        if not key or not shown:
            continue
        if value is True:
            parts.append(key)
        elif value in f.metadata.get("bare", ()):
            parts.append(str(value))
        else:
            parts.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return ",".join(parts)


def parse(text: str, layout_type) -> dict:
    """The fields a `--layout` string sets, typed (checking them is the layout rule's work)."""
    by_key, values = keys(layout_type), {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, has_value, raw = part.partition("=")
        if not has_value:
            bare = [f for f in fields(layout_type) if part in f.metadata.get("bare", ())]
            if bare:
                values[bare[0].name] = part
                continue
            if key in by_key and kind(by_key[key]) is bool:
                values[by_key[key].name] = True
                continue
        if key not in by_key:
            raise ConfigError(f"unknown key {key!r}; valid: {', '.join(by_key)}")
        f = by_key[key]
        values[f.name] = _value(f, key, raw)
    return values


def _value(f: Field, key: str, raw: str):
    want = kind(f)
    if want is bool:
        if raw.lower() not in ("true", "false"):
            raise ConfigError(f"{key}={raw}: want true or false (or {key} alone for true)")
        return raw.lower() == "true"
    if want is str:
        return raw
    try:
        return want(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw} is not a number") from None
