"""The errors a user can act on. The CLI prints any of them as one line (`strata: error: ...`) and
exits with code 2; anything else is a bug and keeps its traceback.

- ConfigError: a setting or input is wrong (names the value and what would be valid).
- CorruptError: a file is damaged, incomplete, or points outside its directory (names the file).

CollectiveError is not the user's input but a failure of the run (exit code 1): a collective that
timed out or broke, with the ranks that never arrived.

This module imports nothing from strata: every layer may raise these."""

from __future__ import annotations


class StrataError(Exception):
    """An error the user can act on, printed as one line."""


class ConfigError(StrataError, ValueError):
    """A bad setting or input. Library code names the setting by its field (a config key such as
    'pp_split') and its value, and says why in `reason`; the CLI renders the field as its own flag
    (`render`), so the library never words an error as a flag of one command."""

    def __init__(self, reason: str, field: str | None = None, value: object = None):
        super().__init__(reason)
        self.reason, self.field, self.value = reason, field, value

    def render(self, name=None) -> str:
        """'<field> <value>: <reason>', the field and value as `name(field, value)` gives them."""
        if self.field is None:
            return self.reason
        return f"{(name or _plain)(self.field, self.value)}: {self.reason}"

    def __str__(self) -> str:
        return self.render()


def _plain(field: str, value: object) -> str:
    return f"{field} {value}"


def as_flag(field: str, value: object) -> str:
    """How a command-line tool names a field: '--pp-split 3,5'; a switch alone: '--sequence-parallel'."""
    flag = "--" + field.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


class CorruptError(StrataError):
    """A file that is damaged, incomplete or unsafe to follow."""


class CollectiveError(RuntimeError):
    """A collective failed: `where` names it (operation, number, group); `missing` holds the ranks
    that never entered it, when they are known."""

    def __init__(self, message: str, where: str, missing: list[int]):
        super().__init__(message)
        self.where, self.missing = where, missing
