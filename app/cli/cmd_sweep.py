"""`tierlab sweep`: a grid of settings, each teacher-forced on one text and paired with its baseline."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tierlab.app.cli.gate_args import add_gate_args, gates_from_args
from tierlab.app.cli.signals import sigterm_exits
from tierlab.app.lab.evaluate import read_ref
from tierlab.app.lab.gates import judge
from tierlab.app.lab.sweep import check_cache, grid_rows, parse_grid, run_sweep, with_baselines
from tierlab.app.lab.sweep_report import PLOT_KINDS, pareto_front, render_csv, render_table, terminal_plot, write_plot
from tierlab.engine.config import load_config
from tierlab.engine.errors import FormatError, TierlabError
from tierlab.engine.options import default_model


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="run a grid of knob and cache settings teacher-forced; table and Pareto front")
    p.add_argument("--model", metavar="DIR", type=Path, default=default_model(),
                   help=f"model folder or tierlab container (default: the shipped {default_model().name})")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=v1,v2,...",
                   help="a knob (CACHE_ROUTE, ROUTE_J, ...) or CACHE (RAM slots per layer) and its values; repeatable")
    p.add_argument("--cache", type=int, metavar="N", default=None,
                   help="RAM slots per layer for rows without CACHE in the grid (default: all experts)")
    src = p.add_mutually_exclusive_group(required=False)
    src.add_argument("--ref", help="reference file (ref.json)")
    src.add_argument("--text", help="text file: its tokens after the first --prompt-tokens are teacher-forced")
    src.add_argument("--log", help="session log: its recorded token stream (prompt, then the decoded tokens)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length for --text (default 32)")
    p.add_argument("--tokens", type=int, default=None, help="teacher-force at most this many tokens after the prompt")
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: min(CPUs, rows)); 1 runs in this process")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run on Ray: local (start one on this machine, --workers CPUs) or HOST:PORT (needs tierlab[ray])")
    p.add_argument("--ray-timeout", type=float, default=10.0, help="seconds to wait for a Ray address (default 10)")
    p.add_argument("--out", metavar="FILE", help="append each finished row to this JSON-lines file")
    p.add_argument("--resume", action="store_true", help="skip rows already in --out (same settings, model, text)")
    p.add_argument("--plot", metavar="FILE.svg|FILE.png", help="write the Pareto front as an SVG or PNG image")
    p.add_argument("--no-terminal-plot", action="store_true", help="leave the terminal plot out of the report")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    fmt.add_argument("--csv", action="store_true", help="print the rows as CSV")
    fmt.add_argument("--md", action="store_true", help="print the table as markdown")
    p.add_argument("--protocol", choices=("paper", "strategies"), default=None,
                   help="paper: the arXiv 2412.00099 protocol table; strategies: each strategy's dial (docs/routing.md)")
    add_gate_args(p)
    p.set_defaults(run=run)


def reference_from_args(args, model: Path) -> tuple[list[int], list[int]]:
    if args.ref:
        prompt, full = read_ref(args.ref)
    elif args.log:
        prompt, full = log_reference(args.log)
    elif args.text:
        prompt, full = text_reference(args.text, model, args.prompt_tokens)
    else:
        raise TierlabError("sweep: give the text to run on: --ref FILE, --text FILE or --log FILE")
    if args.tokens is not None:
        if args.tokens < 1:
            raise TierlabError(f"--tokens: {args.tokens} must be at least 1")
        full = full[: len(prompt) + args.tokens]
    return prompt, full


def text_reference(path: str, model: Path, prompt_tokens: int) -> tuple[list[int], list[int]]:
    from tierlab.engine.tokenizer import Tokenizer

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError("no such text file", path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FormatError(f"cannot read as UTF-8 text ({type(exc).__name__})", path) from None
    ids = Tokenizer.from_folder(model).encode(text)
    if prompt_tokens < 1 or len(ids) <= prompt_tokens:
        raise FormatError(f"{len(ids)} tokens: needs more than --prompt-tokens {prompt_tokens}", path)
    return ids[:prompt_tokens], ids


def log_reference(path: str) -> tuple[list[int], list[int]]:
    """A session log's prompt (its prefill tokens) and the decoded tokens after it."""
    from tierlab.engine.sessionlog import read_session_log

    log = read_session_log(path)
    tokens = sorted(log.tokens, key=lambda t: t["index"])
    prompt = [int(t["token"]) for t in tokens if t.get("phase") == "prefill"]
    decoded = [int(t["token"]) for t in tokens if t.get("phase") == "decode"]
    if not prompt or not decoded:
        raise FormatError("the log records no prompt and decoded tokens to teacher-force", path)
    return prompt, prompt + decoded


def run(args) -> int:
    model = Path(args.model)
    cfg = load_config(model)
    if args.protocol:
        from tierlab.app.lab.protocol import print_protocol

        return print_protocol(model, args)
    prompt, full = reference_from_args(args, model)
    default_cache = check_cache(args.cache, cfg.n_experts, "--cache") if args.cache is not None else cfg.n_experts
    if not args.grid:
        raise TierlabError("sweep: give at least one --grid KEY=v1,v2,...")
    rows = grid_rows(parse_grid(args.grid, cfg.n_experts), default_cache)
    if args.workers is not None and args.workers < 1:
        raise TierlabError(f"--workers: {args.workers} must be at least 1")
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_KINDS:
        raise TierlabError(f"--plot {args.plot}: write a .svg or .png file")
    if args.resume and not args.out:
        raise TierlabError("--resume: needs --out FILE (the results to continue)")
    workers = args.workers or max(1, min(os.cpu_count() or 1, len(with_baselines(rows))))
    with sigterm_exits():
        result = run_sweep(model, prompt, full, rows, workers=workers, ray_address=args.ray, out=args.out,
                           resume=args.resume, progress=lambda s: print(s, file=sys.stderr),
                           ray_cpus=args.workers, ray_timeout_s=args.ray_timeout)
    gates = gates_from_args(args)
    for row in result.rows:
        row["gate"] = judge(row, gates).label()
    if args.plot:
        write_plot(args.plot, result.rows)
    if args.json:
        print(json.dumps({"rows": result.rows, "front": [r["row"] + f" CACHE={r['cache']}" for r in pareto_front(result.rows)],
                          "tokens": len(full) - len(prompt), "runner": result.runner, "resumed": result.resumed}))
    elif args.csv:
        sys.stdout.write(render_csv(result.rows))
    else:
        print(render_table(result.rows, markdown=args.md))
        if not args.no_terminal_plot and not args.md and len(result.rows) > 1:
            print()
            print(terminal_plot(result.rows))
    return 0
