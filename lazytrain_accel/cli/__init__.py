"""`lazytrain`: the command line. Each subcommand lives in its own module of this package
and registers itself through `add_parser(subparsers, name)` and a `run(args) -> int`.

Only the chosen subcommand's module is imported (the planner pulls in SCIP and numpy, the
demo torch and transformers): `lazytrain --help` and every other subcommand stay quick.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import NoReturn

from lazytrain_accel import __version__

#: subcommand name -> (module holding `add_parser(subparsers, name)` and `run(args)`,
#: the one-line help `lazytrain --help` shows without importing the module).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "profile": ("lazytrain_accel.cli.profile_cmd",
                "profile a model on a hardware profile (bytes, FLOPs, seconds per layer)"),
    "plan": ("lazytrain_accel.cli.plan_cmd",
             "solve the activation plan of one run and print or save it"),
    "simulate": ("lazytrain_accel.cli.plan_cmd", "run one step of a plan in the event simulator"),
    "max-batch": ("lazytrain_accel.cli.plan_cmd",
                  "largest micro-batch a strategy can plan within the budgets"),
    "max-seq": ("lazytrain_accel.cli.plan_cmd",
                "longest sequence a strategy can plan within the budgets"),
    "demo": ("lazytrain_accel.cli.demo_cmd",
             "fine-tune a small model end to end on this machine (no downloads)"),
}


class CliError(Exception):
    """An error to print as one paragraph (no traceback); `exit_code` is the status."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def help_of(name: str) -> str:
    """The one-line help of subcommand `name`, for its module's `add_parser`."""
    return SUBCOMMANDS[name][1]


class _Parser(argparse.ArgumentParser):
    """Usage errors (bad values, unknown flags) become a `CliError` with status 2, so every
    input error of every subcommand reads the same: `lazytrain CMD: what; what to do`."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message}; see `{self.prog} --help`", exit_code=2)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand's name and help; only `command`'s module is
    imported to add its flags."""
    parser = _Parser(prog="lazytrain", description="Plan, simulate and run LLM training that "
                     "streams layers through a small GPU.")
    parser.add_argument("--version", action="version", version=f"lazytrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(subparsers, name)
        else:
            subparsers.add_parser(name, help=help_text)
    return parser


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand named on the command line: its first word that is not a flag (the
    top-level flags, --help and --version, take no value)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    if word is None or word in SUBCOMMANDS:
        return word
    close = difflib.get_close_matches(word, SUBCOMMANDS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise CliError(f"unknown command {word!r}; {hint}commands: {', '.join(SUBCOMMANDS)}",
                   exit_code=2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = None
    try:
        command = _chosen_command(argv)
        args = build_parser(command).parse_args(argv)
        if args.command is None:
            build_parser().print_help()
            return 0
        return int(importlib.import_module(SUBCOMMANDS[command][0]).run(args) or 0)
    except CliError as err:
        print(f"lazytrain{' ' + command if command else ''}: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
