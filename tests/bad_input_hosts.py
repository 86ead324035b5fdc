"""Bad inputs of issue 51 (hardening, second round), hosts: rows of tests/test_bad_input.py's table,
each (argv, what its one line must say, extra environment or None). A placeholder '{group.name}'
in argv is a path of tests/bad_input_files.py's fixture."""

from __future__ import annotations

CASES: list[tuple[list[str], str, dict | None]] = []
