"""The command-line flags that open an engine, shared by every command and the app.

Each lever is a flag named after its environment variable (ROUTE_J ->
--route-j); a flag wins over the environment, which wins over the default.
The same holds for the tier flags (TIER, TIER_GB, TIER_DEVICE,
TIER_NO_WARMSTART, HEAT_FILE) and the memory budget (--ram-gb over
TIER_RAM_GB, default auto; --verbose prints its breakdown). `add_knobs_at_arg` is the one `--knobs-at`
flag of `generate`, `eval` and `ab` (scripted knob changes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tierlab.app.lab.knob_script import KNOBS_AT_HELP, KnobStep, parse_script
from tierlab.engine.knobs import SPECS
from tierlab.engine.options import EngineOptions, default_model
from tierlab.engine.surface import EngineSurface
from tierlab.engine.tiering import TierOptions


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    """The EngineOptions that `add_model_args` flags describe."""
    tier = TierOptions.from_env(enabled=args.tier, budget=args.tier_gb, device=args.tier_device,
                                warmstart=args.warmstart, heat_file=args.heat)
    knobs = {spec.name: getattr(args, f"knob_{spec.name}", None) for spec in SPECS}
    return EngineOptions(Path(args.model), getattr(args, "cache", None), tier, knobs,
                         ram_gb=getattr(args, "ram_gb", None))


def add_model_args(parser: argparse.ArgumentParser, cache: bool = True,
                   cache_default: str = "what the memory budget leaves, all experts when they fit") -> None:
    parser.add_argument("--model", metavar="DIR", type=Path, default=default_model(),
                        help=f"model folder or tierlab container (default: the shipped {default_model().name})")
    if cache:
        parser.add_argument("--cache", type=int, metavar="N", default=None,
                            help=f"RAM expert cache slots per layer (default: {cache_default})")
    parser.add_argument("--ram-gb", metavar="GB", default=None,
                        help="memory budget in GiB for dense weights, state and the RAM cache, or auto: "
                             "available memory (or the cgroup limit) minus 10%% (default TIER_RAM_GB, else auto); "
                             "the cache gets what is left, unless --cache sets it")
    parser.add_argument("--verbose", action="store_true", help="print the memory budget's breakdown on stderr")
    tier = parser.add_argument_group("GPU tier and heat profile (flags override TIER, TIER_GB, TIER_DEVICE, "
                                     "TIER_NO_WARMSTART, HEAT_FILE)")
    tier.add_argument("--tier", action="store_const", const=True, default=None,
                      help="put experts on an OpenCL device as the first residency level")
    tier.add_argument("--tier-gb", metavar="GB", default=None, help="tier budget in GB, or auto (default auto)")
    tier.add_argument("--tier-device", metavar="NAME", default=None, help="substring of the device name")
    tier.add_argument("--no-warmstart", action="store_const", const=False, default=None, dest="warmstart",
                      help="start with an empty tier")
    tier.add_argument("--heat", metavar="FILE", default=None,
                      help="heat profile: plans the tier's warmstart if it exists; written on exit")
    group = parser.add_argument_group("levers (flags override the environment variables of the same name)")
    for spec in SPECS:
        flag = "--" + spec.name.lower().replace("_", "-")
        group.add_argument(flag, dest=f"knob_{spec.name}", metavar=spec.name, default=None,
                           help=f"{spec.help} (default {spec.default})")


def add_knobs_at_arg(parser: argparse.ArgumentParser) -> None:
    """The repeatable `--knobs-at "T:KEY=V[,KEY=V]"` flag (app/lab/knob_script.py)."""
    parser.add_argument("--knobs-at", action="append", default=None, metavar="T:KEY=V[,KEY=V]",
                        help=KNOBS_AT_HELP)


def knob_steps_from_args(args: argparse.Namespace) -> list[KnobStep]:
    """The `--knobs-at` script, checked (a bad step is one line naming it, exit 2)."""
    return parse_script(getattr(args, "knobs_at", None))


def open_engine(args: argparse.Namespace, with_tokenizer: bool = True) -> EngineSurface:
    """The engine the flags describe; kernel compiles during loading are reported on stderr."""
    options = options_from_args(args)
    if getattr(args, "verbose", False):
        plan = options.budget_plan()
        lines = plan.lines() if plan else [f"RAM cache set by --cache: {options.cache} slots per layer"
                                           if options.cache is not None else "no memory figure: every expert"]
        for line in lines:
            print(f"tierlab: {line}", file=sys.stderr)
    progress = CompileProgress(sys.stderr)
    try:
        return options.open(with_tokenizer=with_tokenizer, progress=progress)
    finally:
        progress.finish()


class CompileProgress:
    """The kernel warm-up's progress on stderr, only while numba compiles (cache loads stay quiet):
    one line rewritten in place on a terminal, a line per step otherwise."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.shown = False
        self._last = ""
        self._last_step = -1
        self._last_compiled = 0

    def __call__(self, done: int, total: int, label: str, compiled: int) -> None:
        if compiled == 0:
            return
        line = f"tierlab: compiling kernels {done}/{total} ({label}, {compiled} compiled)"
        if self.tty:
            self.stream.write("\r" + line.ljust(len(self._last)))
        elif done == total or (done != self._last_step and compiled > self._last_compiled):
            self.stream.write(line + "\n")  # a line for each step that compiled, and the last
            self._last_step, self._last_compiled = done, compiled
        else:
            return
        self.stream.flush()
        self._last = line
        self.shown = True

    def finish(self) -> None:
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def print_notices(engine: EngineSurface) -> None:
    for line in engine.notices:
        print(f"tierlab: {line}", file=sys.stderr)
    engine.notices.clear()
