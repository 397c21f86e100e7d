"""`tierlab bench kernels|decode|rss`: kernel and end-to-end speed next to the memory roofline,
and peak memory against the budget.

Each benchmark is a sub-subcommand registered in BENCHES (`kernels`: matvec
and fused-expert throughput, app/lab/bench_kernels.py; `decode`: the engine
end to end, app/lab/bench_decode.py; `rss`: peak resident memory over a long
decode against `--ram-gb`, app/lab/bench_rss.py); adding one never touches
the others.
"""

from __future__ import annotations

import argparse
import json
import sys


def _add_kernels(sub) -> None:
    p = sub.add_parser("kernels", help="memory bandwidth and fp32/bf16/int8/int4 matvec throughput")
    p.add_argument("--quick", action="store_true", help="a few seconds (CI); fewer, shorter timings")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--threads", type=int, default=None, help="numba threads (default: all cores)")
    p.add_argument("--working-set", type=int, default=None, metavar="MIB",
                   help="MiB of operands the timed calls rotate through (default 512, beyond the "
                        "last-level cache; 16 with --quick); a small one measures cache-resident speed")
    p.set_defaults(bench_run=_run_kernels)


def _run_kernels(args: argparse.Namespace) -> int:
    from tierlab.app.lab.bench_kernels import format_report, run_kernel_bench

    def progress(what: str) -> None:
        if not args.json:
            print(f"  measuring {what} ...", file=sys.stderr, flush=True)

    if args.working_set is not None and args.working_set < 1:
        from tierlab.engine.errors import TierlabError

        raise TierlabError("--working-set must be at least 1 MiB")
    report = run_kernel_bench(quick=args.quick, threads=args.threads, progress=progress,
                              working_set_mib=args.working_set)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_report(report))
    return 0


def _add_decode(sub) -> None:
    from tierlab.app.cli.engine_options import add_model_args

    p = sub.add_parser("decode", help="the engine end to end: prefill and decode tok/s against the roofline")
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random prompt tokens (default 32)")
    p.add_argument("--cold", action="store_true",
                   help="start with empty RAM slots (default: slots warmed by other traffic, as in a chat)")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="drop the page cache before the measured run (root only)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GBS",
                   help="memory bandwidth for the roofline, in GB/s (default: read between chunks of 16 decoded "
                        "tokens, 256 MiB at a time)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.set_defaults(bench_run=_run_decode)


def _run_decode(args: argparse.Namespace) -> int:
    from tierlab.app.cli.engine_options import open_engine, print_notices
    from tierlab.app.lab.bench_decode import format_decode_report, run_decode_bench
    from tierlab.engine.errors import TierlabError

    if args.tokens < 1 or args.prompt_tokens < 1:
        raise TierlabError("--tokens and --prompt-tokens must be at least 1")
    if args.bandwidth is not None and not args.bandwidth > 0:
        raise TierlabError("--bandwidth must be a positive number of GB/s")
    engine = open_engine(args, with_tokenizer=False)
    try:
        report = run_decode_bench(engine, args.prompt_tokens, args.tokens, cold=args.cold,
                                  drop_cache=args.drop_page_cache, bandwidth_gbs=args.bandwidth)
    finally:
        engine.close()
    print_notices(engine)
    if args.drop_page_cache and not report.page_cache_dropped:
        print("tierlab: could not drop the page cache (needs root); the run is warm", file=sys.stderr)
    print(json.dumps(report.to_json()) if args.json else format_decode_report(report))
    return 0


def _add_rss(sub) -> None:
    from tierlab.app.cli.engine_options import add_model_args

    p = sub.add_parser("rss", help="peak resident memory over a long decode against the memory budget")
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=2000, help="decode tokens (default 2000)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random prompt tokens (default 32)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.set_defaults(bench_run=_run_rss)


def _run_rss(args: argparse.Namespace) -> int:
    import dataclasses

    from tierlab.app.cli.engine_options import CompileProgress, options_from_args, print_notices
    from tierlab.app.lab.bench_rss import format_rss_report, run_rss_bench
    from tierlab.engine.budget import auto_budget
    from tierlab.engine.errors import TierlabError

    if args.tokens < 1 or args.prompt_tokens < 1:
        raise TierlabError("--tokens and --prompt-tokens must be at least 1")
    options = dataclasses.replace(options_from_args(args), context=args.prompt_tokens + args.tokens)
    plan = options.budget_plan()
    if plan is not None:
        budget, origin = plan.budget, plan.origin
        for line in plan.lines():
            print(f"tierlab: {line}", file=sys.stderr)
    else:  # --cache sets the slots; the budget compared against is still --ram-gb or auto
        from tierlab.engine.budget import GIB, ram_gb_setting

        ram_gb, origin = ram_gb_setting(args.ram_gb)
        budget = auto_budget() if ram_gb is None else int(ram_gb * GIB)
        if budget is None:
            raise TierlabError("cannot tell how much memory this system has; give --ram-gb")
    engine = options.open(with_tokenizer=False, progress=CompileProgress(sys.stderr))

    def progress(done: int, rss: int) -> None:
        if not args.json:
            print(f"  {done} tokens, RSS {rss / 2**20:,.0f} MiB", file=sys.stderr, flush=True)

    try:
        report = run_rss_bench(engine, budget, origin, args.prompt_tokens, args.tokens, progress=progress)
    finally:
        engine.close()
    print_notices(engine)
    print(json.dumps(report.to_json()) if args.json else format_rss_report(report))
    return 0


# name -> function(subparsers) that adds the benchmark's parser and sets bench_run
BENCHES = {"kernels": _add_kernels, "decode": _add_decode, "rss": _add_rss}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (kernels, decode, rss)", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for add in BENCHES.values():
        add(sub)
    parser.set_defaults(run=run, bench_parser=parser)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_run", None) is None:
        args.bench_parser.print_help()
        return 2
    return int(args.bench_run(args) or 0)
