"""Routing sweeps for docs/routing.md: the tiny-fixture table, the three strategies, the GPU tier.

    python tools/routing_sweep.py fixture [--model assets/tiny-moe-8x2] [--cache 4]
    python tools/routing_sweep.py strategies [--model assets/tiny-moe] [--cache N] [--plot FILE]
    python tools/routing_sweep.py tier [--model assets/tiny-moe] [--tier-gb G]

Each runs `tierlab.app.lab.ab.run_ab` on a reference made from the model's
held-out text (prompt = its first 32 tokens, continuation = the next N), and
reports the teacher-forced run: TF-NLL, hit rates and routing meters all come
from feeding real held-out text (a tiny model's greedy continuation loops,
which would flatter every cache). "ids match" is still the greedy decode
against the held-out text. Routing meters are deterministic; no timings are
taken (repeat 0). Prints markdown.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tierlab
from tierlab.app.lab.ab import run_ab
from tierlab.app.lab.abtable import render_markdown
from tierlab.engine.tokenizer import Tokenizer


def heldout_reference(model: Path, prompt_len: int, n: int) -> tuple[list[int], list[int]]:
    tok = Tokenizer.from_folder(model)
    ids = tok.encode((model / "heldout.txt").read_text(encoding="utf-8"))
    if len(ids) < prompt_len + n:
        raise SystemExit(f"{model}/heldout.txt has only {len(ids)} tokens")
    return ids[:prompt_len], ids[: prompt_len + n]


def fixture(args) -> None:
    prompt, full = heldout_reference(args.model, 32, args.tokens)
    rows = ["off", "CACHE_ROUTE=1", "CACHE_ROUTE=1 ROUTE_J=1", "CACHE_ROUTE=1 ROUTE_J=0"]
    results = run_ab(args.model, prompt, full, rows, repeat=0, default_engine={"CACHE": str(args.cache)},
                     progress=lambda s: print(s, file=sys.stderr))
    print(render_markdown([r.as_row("teacher_forced") for r in results]))


def strategy_rows(k: int, n_experts: int) -> list[tuple[str, str]]:
    rows = [("off", "off")]
    for j in sorted({k // 2, k // 4, 0}, reverse=True):
        for m in sorted({2 * k, 3 * k, n_experts}):
            rows.append(("maxrank", f"CACHE_ROUTE=1 ROUTE_J={j} ROUTE_M={m}"))
    for p in (0.5, 0.7, 0.9):
        rows.append(("cumprob", f"CACHE_ROUTE=1 ROUTE_MODE=cumprob ROUTE_J={k // 4} ROUTE_P={p}"))
    for lam in (0.05, 0.1, 0.2, 0.3, 0.5):
        rows.append(("prior", f"CACHE_ROUTE=1 ROUTE_MODE=prior ROUTE_J={k // 4} ROUTE_LAMBDA={lam}"))
    return rows


def strategies(args) -> None:
    from tierlab.engine.config import load_config

    cfg = load_config(args.model)
    cache = args.cache or cfg.n_experts // 2
    prompt, full = heldout_reference(args.model, 32, args.tokens)
    labelled = strategy_rows(cfg.top_k, cfg.n_experts)
    results = run_ab(args.model, prompt, full, [r for _, r in labelled], repeat=0,
                     default_engine={"CACHE": str(cache)}, progress=lambda s: print(s, file=sys.stderr))
    rows = [r.as_row("teacher_forced") for r in results]
    print(f"{cfg.n_layers} layers x {cfg.n_experts} experts, top-{cfg.top_k}, RAM cache {cache} slots per layer, "
          f"{len(full) - len(prompt)} held-out tokens\n")
    print(render_markdown(rows))
    base = rows[0]
    if args.plot:
        import plotext as plt

        plt.clear_figure()
        plt.plot_size(78, 22)
        plt.theme("clear")
        markers = {"maxrank": "x", "cumprob": "o", "prior": "+"}
        for name in ("maxrank", "cumprob", "prior"):
            pts = [(100 * r["ram_hit"], r["tf_nll"] - base["tf_nll"]) for (n, _), r in zip(labelled, rows)
                   if n == name and r["tf_nll"] - base["tf_nll"] <= args.max_cost]
            plt.scatter([p[0] for p in pts], [p[1] for p in pts], marker=markers[name], label=name)
        plt.vertical_line(100 * base["oracle_hit"])
        plt.vertical_line(100 * base["ram_hit"])
        plt.title(f"RAM hit % vs TF-NLL cost (nats/token, rows up to {args.max_cost:g}); "
                  "lines: lever off, its Belady bound")
        plt.xlabel("RAM hit %")
        ansi = re.compile(r"\x1b\[[0-9;]*m")
        Path(args.plot).write_text(ansi.sub("", plt.build()) + "\n")
        print(f"\nplot written to {args.plot}", file=sys.stderr)


def tier(args) -> None:
    """The GPU tier's residency: index-order vs heat-planned warmstart, then the lever on top."""
    import tempfile

    from tierlab.engine.config import load_config
    from tierlab.app.lab.evaluate import teacher_forced_nll
    from tierlab.engine.model import load_engine
    from tierlab.engine.tiering import TierOptions

    cfg = load_config(args.model)
    prompt, full = heldout_reference(args.model, 32, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        heat = Path(tmp) / "heat.bin"
        # the profile of one lever-off run on the same text, then read-only: every row plans from the
        # same bytes, and a profile of the very text it is tested on is the best case for a heat plan
        engine = load_engine(args.model, cache_slots=cfg.n_experts, with_tokenizer=False,
                             tier=TierOptions(heat_file=str(heat)))
        teacher_forced_nll(engine, prompt, full)
        engine.close()
        heat.chmod(0o444)
        budget = f"TIER=1 TIER_GB={args.tier_gb}"
        rows = ["off", budget, f"{budget} HEAT_FILE={heat}", f"{budget} HEAT_FILE={heat} CACHE_ROUTE=1",
                f"{budget} HEAT_FILE={heat} CACHE_ROUTE=1 ROUTE_MODE=prior ROUTE_J=1 ROUTE_LAMBDA=0.1"]
        results = run_ab(args.model, prompt, full, rows, repeat=0, default_engine={"CACHE": str(args.cache)},
                         progress=lambda s: print(s, file=sys.stderr))
        table = [r.as_row("teacher_forced") for r in results]
        for row in table:
            row["row"] = row["row"].replace(str(heat), "heat.bin")
    print(render_markdown(table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixture")
    f.add_argument("--model", type=Path, default=tierlab.ASSETS_DIR / "tiny-moe-8x2")
    f.add_argument("--cache", type=int, default=4)
    f.add_argument("--tokens", type=int, default=256)
    f.set_defaults(fn=fixture)
    s = sub.add_parser("strategies")
    s.add_argument("--model", type=Path, default=tierlab.ASSETS_DIR / "tiny-moe")
    s.add_argument("--cache", type=int, default=None)
    s.add_argument("--tokens", type=int, default=256)
    s.add_argument("--plot", default=None)
    s.add_argument("--max-cost", type=float, default=0.05, help="leave costlier rows out of the plot")
    s.set_defaults(fn=strategies)
    t = sub.add_parser("tier")
    t.add_argument("--model", type=Path, default=tierlab.ASSETS_DIR / "tiny-moe")
    t.add_argument("--cache", type=int, default=32, help="RAM slots per layer (default: all, so only the tier moves)")
    t.add_argument("--tier-gb", default="0.003", help="tier budget in GiB (default: about a quarter of the experts)")
    t.add_argument("--tokens", type=int, default=1024)
    t.set_defaults(fn=tier)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
