"""`tierlab app`: the terminal app (also what `tierlab` alone opens)."""

from __future__ import annotations

import argparse
from pathlib import Path

import tierlab


def default_model() -> Path:
    """The shipped model: assets/tiny-moe, else another shipped model folder (the header shows which)."""
    main = tierlab.ASSETS_DIR / "tiny-moe"
    if (main / "config.json").exists():
        return main
    others = sorted(p.parent for p in tierlab.ASSETS_DIR.glob("*/config.json"))
    return others[0] if others else main


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "app",
        help="open the terminal app: chat while tuning cache-aware routing",
        description="Chat with a Mixture-of-Experts model while watching its experts move between tiers "
        "and tuning the routing knobs live.",
    )
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help=f"model folder or tierlab container (default: the shipped {default_model().name})")
    parser.add_argument("--cache", type=int, default=None, metavar="N", help="RAM cache slots per layer (default: all experts)")
    parser.add_argument("--tier", action="store_true", help="attach the GPU expert tier (OpenCL)")
    parser.add_argument("--heat", type=Path, default=None, metavar="FILE",
                        help="heat profile: plans the GPU tier, opens in the heat inspector and gets this run's "
                        "counts on exit")
    parser.add_argument("--sessions", type=Path, default=Path("tierlab-sessions"), metavar="DIR",
                        help="folder for recorded session logs, saved heat and A/B exports (default: ./tierlab-sessions)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--theme", default=None, metavar="NAME",
                        help="colour theme, e.g. textual-dark, nord, gruvbox, tokyo-night (ctrl+p lists them all)")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens per reply at start (default 64)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from tierlab.app.tui import TierlabApp

    app = TierlabApp(
        args.model or default_model(),
        cache_slots=args.cache,
        tier=args.tier,
        heat=args.heat,
        sessions_dir=args.sessions,
        seed=args.seed,
        max_tokens=args.max_tokens,
        theme=args.theme,
    )
    app.run()
    return int(app.return_code or 0)
