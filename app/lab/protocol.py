"""Fixed sweeps behind the tables of docs/routing.md: the paper's protocol and the strategy dials.

`paper` follows arXiv 2412.00099's evaluation on one model: RAM caches of
1.5x, 2x and 3x top-K slots per layer; at each size the lever-off run (LRU,
routing unchanged) is the baseline, the Belady line is the optimal eviction
of that run's own requests, and each of the three strategies (maxrank's
top-J/top-M window, cumprob's P window, Cache-Prior) runs with the top
half of the K experts protected (J = K/2, at least 1). Each is reported
as miss reduction against LRU and Δ perplexity %.

`strategies` walks each strategy's dial at one cache size (J, M for
maxrank; P for cumprob; lambda for prior).

Both teacher-force the model's held-out text (`heldout.txt`, a 32-token
prompt, 1024 tokens after it) through `sweep.run_sweep`, and print the
command that reproduces them above the table.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from tierlab.app.lab.sweep import RowSettings, run_sweep
from tierlab.app.lab.sweep_report import render_table
from tierlab.engine.config import load_config
from tierlab.engine.errors import FormatError, TierlabError
from tierlab.engine.knobs import SPEC_BY_NAME, parse_value

PROMPT_TOKENS = 32
TOKENS = 1024
CACHE_MULTIPLES = (1.5, 2.0, 3.0)


def heldout_reference(model: Path, tokens: int = TOKENS) -> tuple[list[int], list[int]]:
    from tierlab.engine.tokenizer import Tokenizer

    path = model / "heldout.txt"
    try:
        ids = Tokenizer.from_folder(model).encode(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError("the protocol runs on the model's held-out text; no such file", path) from None
    if len(ids) < PROMPT_TOKENS + tokens:
        raise FormatError(f"has {len(ids)} tokens, the protocol needs {PROMPT_TOKENS + tokens}", path)
    return ids[:PROMPT_TOKENS], ids[: PROMPT_TOKENS + tokens]


def row(cache: int, **knobs) -> RowSettings:
    """A row from knob values (canonical strings, defaults dropped, as the grid makes them)."""
    kept = []
    for name, value in knobs.items():
        spec = SPEC_BY_NAME[name]
        parsed = parse_value(spec, value)
        if parsed != spec.default:
            kept.append((name, "1" if parsed is True else str(parsed)))
    return RowSettings(tuple(kept), cache)


def strategy_rows(cache: int, top_k: int) -> dict[str, RowSettings]:
    j = max(1, top_k // 2)
    return {
        f"maxrank J={j}": row(cache, CACHE_ROUTE=1, ROUTE_J=j),
        f"cumprob J={j} P=0.7": row(cache, CACHE_ROUTE=1, ROUTE_MODE="cumprob", ROUTE_J=j, ROUTE_P=0.7),
        f"prior J={j} λ=0.2": row(cache, CACHE_ROUTE=1, ROUTE_MODE="prior", ROUTE_J=j, ROUTE_LAMBDA=0.2),
    }


def protocol_caches(top_k: int, n_experts: int) -> list[int]:
    return sorted({min(n_experts - 1, max(1, math.ceil(m * top_k))) for m in CACHE_MULTIPLES})


def paper_table(model: Path, workers: int, tokens: int = TOKENS, progress=lambda s: None) -> str:
    cfg = load_config(model)
    prompt, full = heldout_reference(model, tokens)
    caches = protocol_caches(cfg.top_k, cfg.n_experts)
    labelled = {c: strategy_rows(c, cfg.top_k) for c in caches}
    rows = [r for c in caches for r in labelled[c].values()]
    result = run_sweep(model, prompt, full, rows, workers=workers, progress=progress)
    found = {(r["row"], r["cache"]): r for r in result.rows}
    names = list(labelled[caches[0]])
    head = ["cache (slots/layer)", "LRU miss", "ppl", "Belady miss", "Belady miss −"]
    for name in names:
        head += [f"{name}: miss", "miss −", "Δppl %"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for c in caches:
        base = found[("off", c)]
        lru_miss = 1.0 - base["ram_hit"]
        belady_miss = 1.0 - base["oracle_hit"]
        cells = [f"{c} ({c / cfg.top_k:g}×K)", _pct(lru_miss), f"{base['ppl']:.2f}", _pct(belady_miss),
                 _pct(1.0 - belady_miss / lru_miss if lru_miss else None)]
        for name in names:
            r = found[(labelled[c][name].label, c)]
            cells += [_pct(1.0 - r["ram_hit"]), _pct(r["miss_reduction"]), f"{r['dppl_pct']:+.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    title = (f"{model.name}: {cfg.n_layers} layers x {cfg.n_experts} experts, top-{cfg.top_k}; "
             f"{len(full) - len(prompt)} held-out tokens teacher-forced after a {len(prompt)}-token prompt")
    return title + "\n\n" + "\n".join(lines)


def strategies_rows(cache: int, top_k: int, n_experts: int) -> list[RowSettings]:
    rows = []
    for j in sorted({top_k // 2, top_k // 4, 0}, reverse=True):
        for m in sorted({2 * top_k, 3 * top_k, n_experts}):
            rows.append(row(cache, CACHE_ROUTE=1, ROUTE_J=j, ROUTE_M=m))
    j = max(1, top_k // 4)
    for p in (0.5, 0.7, 0.9):
        rows.append(row(cache, CACHE_ROUTE=1, ROUTE_MODE="cumprob", ROUTE_J=j, ROUTE_P=p))
    for lam in (0.05, 0.1, 0.2, 0.3, 0.5):
        rows.append(row(cache, CACHE_ROUTE=1, ROUTE_MODE="prior", ROUTE_J=j, ROUTE_LAMBDA=lam))
    return rows


def strategies_table(model: Path, cache: int | None, workers: int, tokens: int = TOKENS,
                     progress=lambda s: None) -> str:
    cfg = load_config(model)
    cache = cache or cfg.n_experts // 2
    prompt, full = heldout_reference(model, tokens)
    result = run_sweep(model, prompt, full, strategies_rows(cache, cfg.top_k, cfg.n_experts), workers=workers,
                       progress=progress)
    title = (f"{model.name}: {cfg.n_layers} layers x {cfg.n_experts} experts, top-{cfg.top_k}, RAM cache {cache} "
             f"slots per layer, {len(full) - len(prompt)} held-out tokens")
    return title + "\n\n" + render_table(result.rows, markdown=True)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def print_protocol(model: Path, args) -> int:
    """`tierlab sweep --protocol NAME`: the command line, then its table (markdown)."""
    import os

    workers = args.workers or min(os.cpu_count() or 1, 4)
    tokens = args.tokens or TOKENS
    progress = lambda s: print(s, file=sys.stderr)  # noqa: E731
    command = f"tierlab sweep --protocol {args.protocol} --model {_shown(model)}"
    if args.protocol == "strategies" and args.cache:
        command += f" --cache {args.cache}"
    if tokens != TOKENS:
        command += f" --tokens {tokens}"
    if args.protocol == "paper":
        table = paper_table(model, workers, tokens, progress)
    elif args.protocol == "strategies":
        table = strategies_table(model, args.cache, workers, tokens, progress)
    else:
        raise TierlabError(f"--protocol: unknown protocol {args.protocol}")
    print(f"    {command}\n\n{table}")
    return 0


def _shown(model: Path) -> str:
    try:
        return str(model.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(model)
