"""Run `strata ...` as a user would and capture everything it writes, without paying for a fresh
interpreter per call: each run is a process forked from the test harness's fork server (torch is
imported there already), with file descriptors 1 and 2 sent to files, so whatever writes to them
(Python, C++ logging, a launcher's children) is captured."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from distributed import _CONTEXT


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def _child(argv, cwd, out_path, err_path, env):
    import sys
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    from strata.cli import main
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's --help
        code = e.code if isinstance(e.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_strata(*argv, cwd=None, env=None, timeout: float = 120) -> Result:
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
        proc = _CONTEXT.Process(target=_child, args=([str(a) for a in argv], cwd, out, err, child_env))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise TimeoutError(f"strata {' '.join(map(str, argv))} did not finish within {timeout} s")
        with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
            return Result(proc.exitcode, f_out.read(), f_err.read())


def assert_refused_in_one_line(result: Result, needle: str) -> None:
    """A refusal as the project wants it: exit code 2, the bad value's line on stderr, no traceback."""
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr, result.stderr


def generated_lines(checkpoint, prompts: tuple[str, ...], new_tokens: int, *extra) -> list[str]:
    """What `strata generate --temperature 0` prints for each of `prompts` (comma-separated token
    ids), a line each: the greedy answers a layout (`extra` flags) must reproduce."""
    ids = [a for p in prompts for a in ("--prompt-ids", p)]
    result = run_strata("generate", "--checkpoint", checkpoint, *ids, "--max-new-tokens", new_tokens,
                        "--temperature", 0, *extra, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(prompts) and all(len(line.split()) >= new_tokens for line in lines), lines
    return lines
