"""The `strata` command. Subcommands only parse, check and dispatch; the work lives elsewhere.

Bad input ends in one line on stderr (`strata: error: ...`) and exit code 2, never a traceback: a
ConfigError names a setting by its field, and the field is printed as the flag that sets it."""

from __future__ import annotations

import sys

from strata.cli.generate import generate_command
from strata.cli.parser import build_parser
from strata.cli.plan import plan_command
from strata.cli.tools import (
    bench_command,
    calibrate_command,
    check_outputs,
    convert_command,
    data_command,
    doctor_command,
    plot_command,
    schedule_command,
)
from strata.cli.train import launch_command, train_command
from strata.errors import CollectiveError, ConfigError, StrataError, as_flag
from strata.rules.comm_semantics import resolve_semantics
from strata.rules.limits import PROCESS_BYTES, check_ceiling, check_fits_machine

# The commands whose processes communicate: their semantics (flag or environment) is checked here,
# before any process starts.
COMMUNICATING = ("train", "generate", "launch", "doctor", "bench", "calibrate")
COMMANDS = {"train": train_command, "data": data_command, "generate": generate_command, "convert": convert_command,
            "plan": plan_command, "launch": launch_command, "doctor": doctor_command, "bench": bench_command,
            "calibrate": calibrate_command, "plot": plot_command, "schedule": schedule_command}


def check_numbers(args) -> None:
    """Every numeric flag of every command against rules/limits.py's table, by its name (NaN is
    refused for all), and the processes --nproc starts on this machine against its memory: before
    any command reads them, so that no value that fits no machine reaches an allocation or a loop."""
    for name, value in vars(args).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            check_ceiling(name, value)
    nproc = getattr(args, "nproc", None)
    if isinstance(nproc, int) and nproc > 1:
        check_fits_machine([("nproc", nproc, nproc * PROCESS_BYTES, f"{nproc} processes of Python and torch")])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
        if args.command in COMMUNICATING:
            resolve_semantics(getattr(args, "comm_semantics", None))
        check_numbers(args)
        check_outputs(args)
        return COMMANDS[args.command](args, argv)
    except CollectiveError as e:  # the run failed (not the input): one line, and the launcher is told who hung
        from strata.distributed.launch import report_failure
        print(f"strata: error: {e}", file=sys.stderr)
        report_failure(e)
        return 1
    except ConfigError as e:
        print(f"strata: error: {e.render(as_flag)}", file=sys.stderr)
        return 2
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
