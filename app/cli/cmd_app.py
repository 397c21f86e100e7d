"""`tierlab app`: the terminal app (also what `tierlab` alone, or with only options, opens)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tierlab.app.cli.engine_options import add_model_args, options_from_args
from tierlab.engine.errors import TierlabError
from tierlab.engine.meters import RECENT_TOKENS


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "app",
        help="open the terminal app: chat while tuning cache-aware routing",
        description="Chat with a Mixture-of-Experts model while watching its experts move between tiers "
        "and tuning the routing knobs live. Takes the same model, cache, tier and knob flags as every "
        "other command.",
    )
    add_model_args(parser, cache_default="3/8 of the experts, at least 2*top-K, at most all but one: 12 of 32 "
                   "for the shipped model")
    parser.add_argument("--sessions", type=Path, default=Path("tierlab-sessions"), metavar="DIR",
                        help="folder for recorded session logs, saved heat and A/B exports (default: ./tierlab-sessions)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--theme", default=None, metavar="NAME",
                        help="colour theme, e.g. textual-dark, nord, gruvbox, tokyo-night (ctrl+p lists them all)")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens per reply at start (default 64)")
    parser.add_argument("--meter-window", type=int, default=RECENT_TOKENS, metavar="N",
                        help=f"tokens in the meters' recent window (default {RECENT_TOKENS}; F5 switches windows)")
    parser.set_defaults(run=run)
    return parser


def check_before_opening(options) -> None:
    """A model folder that is not one, or a knob flag it cannot take, is one line and exit 2
    before the screen opens, not a screen that can do nothing."""
    from tierlab.engine.config import load_config
    from tierlab.engine.knobs import Knobs

    load_config(options.model)
    Knobs.from_env(**options.knobs)


def run(args: argparse.Namespace) -> int:
    from tierlab.app.tui.app import TierlabApp

    if args.meter_window < 1:
        raise TierlabError(f"--meter-window must be at least 1 token, got {args.meter_window}")
    options = options_from_args(args)
    check_before_opening(options)

    app = TierlabApp(
        options,
        sessions_dir=args.sessions,
        seed=args.seed,
        max_tokens=args.max_tokens,
        meter_window=args.meter_window,
        theme=args.theme,
    )
    app.run()
    return int(app.return_code or 0)
