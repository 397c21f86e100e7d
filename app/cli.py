"""The `tierlab` command line.

Each subcommand lives in its own module `tierlab.app.cmd_<name>` with two
functions, `add_parser(subparsers)` and `run(args) -> int`; this file only
discovers them, so adding a command never touches a shared file.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from tierlab.engine.errors import TierlabError
from tierlab.engine.knobs import KnobError


def _command_modules():
    import tierlab.app as pkg

    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("cmd_"):
            yield importlib.import_module(f"tierlab.app.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierlab",
        description="Run and tune Mixture-of-Experts LLMs whose experts live in tiers. "
        "With no command, opens the terminal app on the shipped model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:
        argv = ["app"] if "app" in parser._subparsers._group_actions[0].choices else ["--help"]  # type: ignore[union-attr]
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (TierlabError, KnobError) as exc:
        print(f"tierlab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tierlab: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
