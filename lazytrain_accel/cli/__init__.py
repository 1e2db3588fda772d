"""`lazytrain`: the command line. Each subcommand lives in its own module of this package
and registers itself through `add_parser(subparsers)` and a `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

from lazytrain_accel import __version__

#: subcommand name -> module holding `add_parser(subparsers)` and `run(args)`.
SUBCOMMANDS: dict[str, str] = {
    "profile": "lazytrain_accel.cli.profile_cmd",
    "plan": "lazytrain_accel.cli.plan_cmd",
    "simulate": "lazytrain_accel.cli.plan_cmd",
    "max-batch": "lazytrain_accel.cli.plan_cmd",
    "demo": "lazytrain_accel.cli.demo_cmd",
}


class CliError(Exception):
    """An error to print as one paragraph (no traceback); `exit_code` is the status."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazytrain",
        description="Plan, simulate and run LLM training that streams layers through a "
        "small GPU.",
    )
    parser.add_argument("--version", action="version", version=f"lazytrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        importlib.import_module(module).add_parser(subparsers, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(importlib.import_module(SUBCOMMANDS[args.command]).run(args) or 0)
    except CliError as err:
        print(f"lazytrain {args.command}: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
