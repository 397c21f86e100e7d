"""`--log FILE` and `--append`: a session log never overwrites a file."""

from __future__ import annotations

from pathlib import Path

from tierlab.engine.errors import TierlabError


def add_log_args(parser, help: str = "record a session log (JSON lines)") -> None:
    parser.add_argument("--log", metavar="FILE", help=f"{help}; refuses an existing file unless --append")
    parser.add_argument("--append", action="store_true", help="add this run's records to an existing --log file")


def check_log_target(args) -> None:
    """Refuse, before the engine opens, a --log that would overwrite a file."""
    if args.append and not args.log:
        raise TierlabError("--append needs --log FILE")
    if args.log and not args.append and Path(args.log).exists():
        raise TierlabError(f"--log {args.log}: the file exists (use --append to add to it, or name a new file)")
