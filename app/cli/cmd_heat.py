"""`tierlab heat`: look inside heat profiles (show one, diff two)."""

from __future__ import annotations

import argparse
import math

from tierlab.engine.config import load_config
from tierlab.engine.heat import HeatProfile, diff


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("heat", help="show or compare heat profiles (expert routing counts)")
    sub = parser.add_subparsers(dest="heat_command", metavar="ACTION", required=True)

    show = sub.add_parser("show", help="per-layer summary of one profile")
    show.add_argument("file", help="heat profile (.heat, as the app and HEAT_FILE write it)")
    show.add_argument("--model", metavar="DIR", help="check the dims against this model's config.json")
    show.add_argument("--top", type=_positive_int, default=8, metavar="N", help="experts listed per layer (default 8)")
    show.set_defaults(run=run)

    cmp_ = sub.add_parser("diff", help="per-layer comparison of two profiles")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    cmp_.add_argument("--top", type=_positive_int, default=8, metavar="N", help="size of the top sets compared (default 8)")
    cmp_.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.heat_command == "show":
        layers = experts = None
        if args.model:
            cfg = load_config(args.model)
            layers, experts = cfg.n_layers, cfg.n_experts
        heat = HeatProfile.read(args.file, layers, experts)
        print_show(heat, args.file, args.top)
    else:
        a = HeatProfile.read(args.a)
        b = HeatProfile.read(args.b, a.n_layers, a.n_experts)
        print_diff(a, b, args.top)
    return 0


def print_show(heat: HeatProfile, name: str, top: int) -> None:
    total = int(heat.counts.sum())
    print(f"{name}: {heat.n_layers} layers x {heat.n_experts} experts, {total} routings")
    print(f"{'layer':>5} {'routings':>9} {'H nats':>7} {'H/Hmax':>6} {'cov50':>5} {'cov90':>5}  top experts (share)")
    for s in heat.summaries(top):
        tops = " ".join(f"{e}({100 * c / s.routings:.1f}%)" for e, c in s.top) if s.routings else "-"
        print(
            f"{s.layer:>5} {s.routings:>9} {s.entropy_nats:>7.3f} {s.entropy_norm:>6.3f} "
            f"{s.cover50:>5} {s.cover90:>5}  {tops}"
        )


def print_diff(a: HeatProfile, b: HeatProfile, top: int) -> None:
    rows = diff(a, b, top)
    print(f"{a.n_layers} layers x {a.n_experts} experts; top-{min(top, a.n_experts)} overlap, TVD, Jensen-Shannon (nats)")
    print(f"{'layer':>5} {'overlap':>7} {'TVD':>6} {'JS':>6}")
    for r in rows:
        print(f"{r.layer:>5} {_fmt(r.top_overlap, 7, 2)} {_fmt(r.tvd, 6, 3)} {_fmt(r.js, 6, 3)}")
    valid = [r for r in rows if not math.isnan(r.tvd)]
    if valid:
        n = len(valid)
        print(
            f"{'mean':>5} {sum(r.top_overlap for r in valid) / n:>7.2f} "
            f"{sum(r.tvd for r in valid) / n:>6.3f} {sum(r.js for r in valid) / n:>6.3f}"
        )


def _fmt(value: float, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}.{digits}f}"
