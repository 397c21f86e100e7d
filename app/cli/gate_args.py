"""The quality-gate flags (`--gate-dnll`, `--gate-agree`, `--gate-kl99`, `--gate-flips`),
shared by `ab`, `compare`, `replay` and `sweep` (app/lab/gates.py says what each gate means)."""

from __future__ import annotations

import argparse

from tierlab.app.lab.gates import Gates

_DEFAULTS = Gates()


def add_gate_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quality gates (each row shows pass, or FAIL and the gates it failed)")
    group.add_argument("--gate-dnll", type=float, default=_DEFAULTS.dnll, metavar="NATS",
                       help=f"upper end of the 95%% interval of ΔNLL per token at most this (default {_DEFAULTS.dnll})")
    group.add_argument("--gate-agree", type=float, default=_DEFAULTS.agree, metavar="FRACTION",
                       help=f"top-1 agreement with the baseline at least this (default {_DEFAULTS.agree})")
    group.add_argument("--gate-kl99", type=float, default=_DEFAULTS.kl99, metavar="NATS",
                       help=f"99th percentile of KL(baseline‖row) at most this (default {_DEFAULTS.kl99})")
    group.add_argument("--gate-flips", type=float, default=_DEFAULTS.flips, metavar="FRACTION",
                       help="share of confident tokens (baseline top-1 p > 0.5) whose top-1 changes, "
                            f"at most this (default {_DEFAULTS.flips})")


def gates_from_args(args: argparse.Namespace) -> Gates:
    """The gates the flags set (a bad value is one line naming the flag, exit 2)."""
    return Gates(dnll=args.gate_dnll, agree=args.gate_agree, kl99=args.gate_kl99, flips=args.gate_flips)
