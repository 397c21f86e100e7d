"""The `tierlab` command line: a table of commands, each a module with `add_parser` and `run`.

`tierlab` alone, or with only options (`tierlab --model DIR --cache 12`),
opens the terminal app, so the flags people try first work.
"""

from __future__ import annotations

import argparse
import sys

import tierlab
from tierlab.app.cli import (
    cmd_ab,
    cmd_app,
    cmd_bench,
    cmd_chat,
    cmd_compare,
    cmd_convert,
    cmd_eval,
    cmd_generate,
    cmd_heat,
    cmd_inspect,
    cmd_make_synthetic,
    cmd_ref,
    cmd_replay,
    cmd_sweep,
)
from tierlab.app.cli.errors import run_guarded

#: Every command, in the order `tierlab --help` lists them.
COMMANDS = (
    cmd_app, cmd_generate, cmd_chat, cmd_ref, cmd_eval, cmd_ab, cmd_compare, cmd_replay, cmd_sweep,
    cmd_convert, cmd_inspect, cmd_make_synthetic, cmd_heat, cmd_bench,
)
DEFAULT_COMMAND = "app"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierlab",
        description="Run and tune Mixture-of-Experts LLMs whose experts live in tiers. "
        "With no command, opens the terminal app on the shipped model.",
    )
    parser.add_argument("--version", action="version", version=f"tierlab {tierlab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def with_default_command(argv: list[str]) -> list[str]:
    """No command, or options only (other than help and version): the app."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        return [DEFAULT_COMMAND, *argv]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(with_default_command(argv))
    return run_guarded(lambda: int(args.run(args) or 0))


if __name__ == "__main__":
    sys.exit(main())
